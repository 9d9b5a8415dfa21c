#!/usr/bin/env bash
# Installs what building, running and testing gdsfs needs on a fresh Debian machine.
# Idempotent: skips what is already there. Needs root (or sudo) for apt-get.
set -euo pipefail

pkgs=(fuse3 attr python3-torch python3-numpy python3-pytest python3-hypothesis tar coreutils)
missing=()
for p in "${pkgs[@]}"; do
	dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	export DEBIAN_FRONTEND=noninteractive
	$sudo apt-get update -qq
	$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
command -v go >/dev/null || { echo "install-deps: Go is not on PATH; install Go >= 1.26 from https://go.dev/dl" >&2; exit 1; }
go mod download
