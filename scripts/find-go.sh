#!/usr/bin/env bash
# Prints the path of a Go toolchain new enough for go.mod, or fails with a
# one-line hint. Looks at every `go` on PATH, then where install-deps.sh puts
# the toolchain it fetches ($GDSFS_GO_ROOT). The Makefile
# uses it so that an old distribution Go earlier on PATH is never picked.
set -euo pipefail
cd "$(dirname "$0")/.."

want=$(awk '$1 == "go" { print $2; exit }' go.mod)

# go_root_default is where install-deps.sh installs a fetched toolchain.
go_root_default() {
	if [ "$(id -u)" -eq 0 ]; then
		echo /usr/local/lib/gdsfs-go
	else
		echo "${XDG_DATA_HOME:-$HOME/.local/share}/gdsfs-go"
	fi
}

# version_ge A B: A >= B for dotted Go versions (1.26.8 >= 1.26).
version_ge() {
	[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# go_version BIN prints BIN's version without the "go" prefix (1.26.8), or
# nothing when BIN does not run. GOTOOLCHAIN=local: report the binary itself,
# never a toolchain it would switch to.
go_version() {
	GOTOOLCHAIN=local "$1" env GOVERSION 2>/dev/null | sed -n 's/^go\([0-9][0-9.]*\).*/\1/p'
}

root=${GDSFS_GO_ROOT:-$(go_root_default)}
candidates=()
IFS=: read -r -a dirs <<<"${PATH:-}"
for d in "${dirs[@]}"; do
	[ -n "$d" ] && [ -x "$d/go" ] && candidates+=("$d/go")
done
candidates+=("$root/go$want/bin/go")

for c in "${candidates[@]}"; do
	[ -x "$c" ] || continue
	v=$(go_version "$c")
	if [ -n "$v" ] && version_ge "$v" "$want"; then
		echo "$c"
		exit 0
	fi
done
echo "find-go: no Go >= $want found (PATH, $root); run ./scripts/install-deps.sh" >&2
exit 1
