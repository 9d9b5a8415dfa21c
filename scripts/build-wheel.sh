#!/usr/bin/env bash
# make wheel: platform wheels holding the static gdsfs binary and the Python
# package (the `gdsfs` console script execs the bundled binary), one per
# architecture in $WHEEL_ARCHES (default: amd64 arm64), into dist/. Offline:
# Debian's pip, setuptools and wheel, no build isolation, no index.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-/usr/bin/python3}
out=${WHEEL_DIR:-dist}
arches=${WHEEL_ARCHES:-amd64 arm64}

# The wheel's version is gdsfs.__version__ (pyproject.toml reads it); the
# binary it carries reports daemon.Version: they must be equal.
goversion=$(sed -n 's/^const Version = "\(.*\)"/\1/p' daemon/config.go)
initver=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' python/gdsfs/__init__.py)
if [ -z "$goversion" ] || [ "$goversion" != "$initver" ]; then
	echo "build-wheel: versions differ: python/gdsfs/__init__.py __version__ ${initver:-(none)}, daemon/config.go Version ${goversion:-(none)}; make them equal" >&2
	exit 1
fi
"$py" -c 'import setuptools, wheel' 2>/dev/null || { echo "build-wheel: $py lacks setuptools or wheel; run ./scripts/install-deps.sh" >&2; exit 1; }

mkdir -p "$out"
stage=$(mktemp -d "${TMPDIR:-/tmp}/gdsfs-wheel.XXXXXX")
trap 'rm -rf "$stage"' EXIT
for arch in $arches; do
	case "$arch" in
	amd64) plat=linux_x86_64 ;;
	arm64) plat=linux_aarch64 ;;
	*) echo "build-wheel: unknown architecture $arch (amd64 or arm64)" >&2; exit 1 ;;
	esac
	s="$stage/$arch"
	mkdir -p "$s/gdsfs/_bin"
	cp python/pyproject.toml python/setup.py "$s/"
	(cd python && find gdsfs -name '*.py' -o -name py.typed) | while read -r f; do
		mkdir -p "$s/$(dirname "$f")"
		cp "python/$f" "$s/$f"
	done
	CGO_ENABLED=0 GOOS=linux GOARCH="$arch" go build -trimpath -o "$s/gdsfs/_bin/gdsfs" ./cmd/gdsfs
	GDSFS_WHEEL_PLAT=$plat "$py" -m pip wheel --quiet --no-build-isolation --no-deps --no-index -w "$out" "$s"
done
ls -l "$out"/gdsfs-"$initver"-*.whl
