"""Platform wheels: `make wheel` puts the static gdsfs binary in gdsfs/_bin/,
so the wheel is tagged for its platform (py3-none-linux_<arch>) instead of
pure Python. The metadata lives in pyproject.toml."""

import os

from setuptools import setup

try:
    from wheel.bdist_wheel import bdist_wheel
except ImportError:  # no wheel package: sdists and plain installs still work
    bdist_wheel = None

cmdclass = {}
if bdist_wheel is not None:

    class PlatformWheel(bdist_wheel):
        """bdist_wheel for a wheel that carries a native binary but no
        Python extension: any Python 3, no ABI, one platform."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.root_is_pure = not os.path.exists(os.path.join("gdsfs", "_bin", "gdsfs"))

        def get_tag(self) -> tuple:
            python, abi, plat = super().get_tag()
            if self.root_is_pure:
                return python, abi, plat
            return "py3", "none", os.environ.get("GDSFS_WHEEL_PLAT", plat)

    cmdclass["bdist_wheel"] = PlatformWheel

setup(cmdclass=cmdclass)
