#!/usr/bin/env bash
# Installs what building, running and testing gdsfs needs on a fresh Debian or
# Ubuntu machine, Go included. Idempotent: skips what is already there. Needs
# root (or sudo) for apt-get.
#
# Go: when no `go` new enough for go.mod is on PATH (or where this script put
# one before), it installs the distribution's Go and uses it to fetch the
# release toolchain go.mod names from the Go module proxy as the module
# golang.org/toolchain (the mechanism behind GOTOOLCHAIN), then copies it to
# $GDSFS_GO_ROOT/go<version> (default /usr/local/lib/gdsfs-go as root,
# ~/.local/share/gdsfs-go otherwise). The Makefile finds it there
# (scripts/find-go.sh); add its bin directory to PATH to use it by hand.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(fuse3 attr python3-torch python3-numpy python3-pytest python3-hypothesis
	python3-mypy python3-flake8 python3-pil python3-venv python3-pip python3-setuptools python3-wheel tar coreutils)

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
apt_updated=""
apt_install() {
	export DEBIAN_FRONTEND=noninteractive
	if [ -z "$apt_updated" ]; then
		$sudo apt-get update -qq
		apt_updated=1
	fi
	$sudo apt-get install -y -qq --no-install-recommends "$@"
}

missing=()
for p in "${pkgs[@]}"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
	apt_install "${missing[@]}"
fi

want=$(awk '$1 == "go" { print $2; exit }' go.mod)
if ! gobin=$(./scripts/find-go.sh 2>/dev/null); then
	if [ "$(id -u)" -eq 0 ]; then
		root=${GDSFS_GO_ROOT:-/usr/local/lib/gdsfs-go}
	else
		root=${GDSFS_GO_ROOT:-${XDG_DATA_HOME:-$HOME/.local/share}/gdsfs-go}
	fi
	# Any Go that runs can fetch the toolchain module; the distribution's is
	# the one a bare machine can get.
	boot=$(command -v go || true)
	if [ -z "$boot" ]; then
		dpkg -s golang-go >/dev/null 2>&1 || apt_install golang-go
		boot=$(command -v go || echo /usr/bin/go)
	fi
	[ -x "$boot" ] || { echo "install-deps: no Go to bootstrap with (apt-get install golang-go failed?)" >&2; exit 1; }
	arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
	case "$arch" in
	amd64 | x86_64) arch=amd64 ;;
	arm64 | aarch64) arch=arm64 ;;
	*) echo "install-deps: no Go toolchain module for architecture $arch; install Go >= $want from https://go.dev/dl" >&2; exit 1 ;;
	esac
	mod="golang.org/toolchain@v0.0.1-go$want.linux-$arch"
	echo "install-deps: fetching Go $want ($mod) with $boot"
	# GOFLAGS=-mod=mod: the download needs no go.mod; GOTOOLCHAIN=local: the
	# bootstrap Go must not try to switch toolchains itself.
	dir=$(cd / && GOFLAGS=-mod=mod GOTOOLCHAIN=local "$boot" mod download -json "$mod" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",*$/\1/p')
	[ -n "$dir" ] && [ -f "$dir/bin/go" ] || { echo "install-deps: go mod download $mod gave no toolchain; check GOPROXY ($("$boot" env GOPROXY))" >&2; exit 1; }
	dest="$root/go$want"
	tmp="$dest.tmp.$$"
	$sudo mkdir -p "$root"
	$sudo rm -rf "$tmp"
	$sudo cp -R "$dir" "$tmp"
	# The module cache keeps files read-only and not executable.
	$sudo chmod -R u+w,a+rX "$tmp"
	$sudo find "$tmp/bin" "$tmp/pkg/tool" -type f -exec chmod a+x {} +
	$sudo rm -rf "$dest"
	$sudo mv "$tmp" "$dest"
	gobin="$dest/bin/go"
	"$gobin" version >/dev/null || { echo "install-deps: $gobin does not run" >&2; exit 1; }
	echo "install-deps: Go $want installed in $dest; make finds it; to use it by hand: export PATH=$dest/bin:\$PATH"
fi
"$gobin" mod download
