#!/usr/bin/env bash
# make install-check (part of make test): the two install routes README.md
# gives, on this machine, as a new user would take them.
#  1. install-deps.sh with every Go hidden from PATH and a scratch module cache
#     and GOPATH: it must fetch the toolchain go.mod names and the build must
#     work with what it set up.
#  2. make wheel, a fresh venv (--system-site-packages, for the distribution's
#     torch), pip install of the wheel offline: `gdsfs doctor` and the demo
#     (mount, plain reads, control path, gdsfs.torch) run from the venv alone.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-/usr/bin/python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/gdsfs-install.XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { printf '\n== install-check: %s\n' "$*"; }

step "install-deps.sh with Go hidden from PATH"
bare=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin
for d in ${bare//:/ }; do
	# A distribution Go (/usr/bin/go) may be there: it is too old for go.mod
	# or the check below would not exercise the download.
	if [ -x "$d/go" ] && GOTOOLCHAIN=local "$d/go" env GOVERSION 2>/dev/null | grep -q "^go$(awk '$1 == "go" { print $2; exit }' go.mod)"; then
		echo "install-check: $d/go already satisfies go.mod; the bootstrap path cannot be tested here" >&2
		exit 1
	fi
done
gocache=$(go env GOCACHE) # reuse compiled packages: the check is about finding Go, not about compiling
env -i PATH="$bare" HOME="$work/home" GOMODCACHE="$work/mod" GOPATH="$work/gopath" \
	GDSFS_GO_ROOT="$work/goroot" ./scripts/install-deps.sh
gobin=$(env -i PATH="$bare" HOME="$work/home" GDSFS_GO_ROOT="$work/goroot" ./scripts/find-go.sh)
case "$gobin" in
"$work/goroot"/*) ;;
*) echo "install-check: find-go.sh chose $gobin, not the toolchain install-deps.sh fetched" >&2; exit 1 ;;
esac
env -i PATH="$bare" HOME="$work/home" GOMODCACHE="$work/mod" GOPATH="$work/gopath" GOCACHE="$gocache" \
	GDSFS_GO_ROOT="$work/goroot" GOFLAGS=-buildvcs=false make --no-print-directory build BIN="$work/gdsfs"
"$work/gdsfs" doctor >/dev/null
echo "install-check: built with $gobin"

step "the wheel, installed offline into a fresh venv"
WHEEL_DIR="$work/dist" ./scripts/build-wheel.sh
arch=$(uname -m)
whl=$(ls "$work"/dist/gdsfs-*-py3-none-linux_"$arch".whl)
"$py" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/pip" install --quiet --no-index --no-deps "$whl"
"$work/venv/bin/gdsfs" doctor
"$work/venv/bin/python" -c 'import gdsfs, os, sys; assert os.path.dirname(gdsfs.__file__).startswith(sys.prefix), gdsfs.__file__; print("import gdsfs", gdsfs.__version__, "from", gdsfs.__file__)'
(cd "$work" && GDSFS_BIN="$work/venv/bin/gdsfs" GDSFS_PYTHON="$work/venv/bin/python" GDSFS_PYTHONPATH="" "$OLDPWD/scripts/demo.sh")
echo "install-check ok"
