#!/usr/bin/env bash
# Runs every Go fuzz target in the module for a bounded time each (default 10s).
#
# A target fails when the fuzzer found an input that fails it: go test then
# says "Failing input written to testdata/fuzz/<target>/..." and leaves the
# file there. Go 1.26's coordinator can also fail a run with a bare "context
# deadline exceeded" as -fuzztime ends (golang/go#75804, fixed in Go 1.27):
# no input, nothing written. Such a run is tried again once, and if it ends
# the same way it is reported as that race and not counted as a failure.
set -euo pipefail
t="${1:-10s}"
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# corpus lists the files of a target's corpus directory, one per line.
corpus() { ls -1 "$1" 2>/dev/null || true; }

# deadline_race tells whether a failed run is golang/go#75804: its only
# complaint is the coordinator's deadline and it wrote no failing input.
deadline_race() {
	local before="$1" dir="$2"
	grep -q 'context deadline exceeded' "$log" || return 1
	grep -q 'Failing input written' "$log" && return 1
	grep -qE '^\s+[a-z_]+_test\.go:[0-9]+:' "$log" && return 1
	[ "$before" = "$(corpus "$dir")" ]
}

for pkg in $(go list ./...); do
	dir=$(go list -f '{{.Dir}}' "$pkg")
	for f in $(grep -ho '^func Fuzz[A-Za-z0-9_]*' "$dir"/*_test.go 2>/dev/null | sed 's/^func //' | sort -u); do
		echo "fuzz $pkg $f ($t)"
		cdir="$dir/testdata/fuzz/$f"
		for try in 1 2; do
			before=$(corpus "$cdir")
			if go test -run='^$' -fuzz="^${f}\$" -fuzztime="$t" "$pkg" >"$log" 2>&1; then
				break
			fi
			if ! deadline_race "$before" "$cdir"; then
				cat "$log"
				exit 1
			fi
			if [ "$try" = 2 ]; then
				echo "fuzz $f: stopped twice by Go's fuzztime race (golang/go#75804); no failing input was found"
			else
				echo "fuzz $f: stopped by Go's fuzztime race (golang/go#75804), no failing input; trying again"
			fi
		done
	done
done
