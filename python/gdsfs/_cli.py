"""The `gdsfs` console script of the wheel: runs the daemon binary bundled
next to this package (gdsfs/_bin/gdsfs), so `pip install gdsfs-*.whl` gives
`gdsfs mount` and `import gdsfs` of one version."""

from __future__ import annotations

import os
import sys


def bundled_binary() -> str:
    """Path of the gdsfs binary shipped in this package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bin", "gdsfs")


def _binary_on_path() -> str | None:
    """A gdsfs executable on PATH that is the daemon binary (ELF), not a
    console script like this one: source installs carry no binary."""
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, "gdsfs")
        try:
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF" and os.access(p, os.X_OK):
                    return p
        except OSError:
            continue
    return None


def main() -> None:
    """Replace this process with the bundled binary (or, in a source
    install, the gdsfs binary on PATH), passing the arguments on."""
    exe = bundled_binary()
    if not os.access(exe, os.X_OK):
        found = _binary_on_path()
        if found is None:
            sys.stderr.write(
                f"gdsfs: this install of the Python package has no daemon binary ({exe} is missing) and none is on PATH; "
                "install the wheel built by `make wheel`, or put the binary from `make build` on PATH\n"
            )
            sys.exit(2)
        exe = found
    os.execv(exe, ["gdsfs", *sys.argv[1:]])


if __name__ == "__main__":
    main()
