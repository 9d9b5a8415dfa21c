#!/usr/bin/env bash
# Control-path benchmarks (host engine), run as root:
#   1. Go benchmarks: 8 MiB READ ioctls vs parallel pread of the backing
#      file, and 4 KiB READ latency vs a 4 KiB pread through the mount;
#   2. the ioctl hop: gdsfs read --discard through a host-engine mount vs
#      gdsfs read --discard --engine-only (the same requests, the same pool
#      code and engine, in process), 4 and 16 requests of 4 x 8 MiB in flight
#      over a GDSFS_BENCH_SIZE file (default 1GiB), 5 passes per run.
# Each pair runs ROUNDS times, alternating, and the medians are printed: on a
# shared machine single runs are noise.
#   ./scripts/bench-control.sh [ROUNDS]   (default 5)
set -euo pipefail
rounds="${1:-5}"
size="${GDSFS_BENCH_SIZE:-1GiB}"
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
mnt=$tmp/mnt
cleanup() {
	if mountpoint -q "$mnt" 2>/dev/null; then "$tmp/gdsfs" unmount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
	rm -rf "$tmp"
}
trap cleanup EXIT
go test -c -o "$tmp/itest" ./integration/
go build -o "$tmp/gdsfs" ./cmd/gdsfs

median() { sort -n | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }

out=$(cd integration && for _ in $(seq "$rounds"); do
	"$tmp/itest" -test.run '^$' -test.bench '^Benchmark(ControlRead8MiB|Pread8MiB|ControlRead4KiB|MountPread4KiB)$' -test.benchtime 1s
done | grep '^Benchmark')
echo "$out"
echo "$out" | awk '
	function median(arr, n,   i, j, t) {
		for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (arr[j] < arr[i]) { t = arr[i]; arr[i] = arr[j]; arr[j] = t }
		return (n % 2) ? arr[(n + 1) / 2] : (arr[n / 2] + arr[n / 2 + 1]) / 2
	}
	{
		name = $1; sub(/-[0-9]+$/, "", name)
		for (i = 2; i < NF; i++) {
			if ($(i + 1) == "MB/s") { k = name; mb[k, ++nmb[k]] = $i }
			if ($(i + 1) == "p50-µs") { k = name; p50[k, ++np50[k]] = $i }
			if ($(i + 1) == "p99-µs") { k = name; p99[k, ++np99[k]] = $i }
		}
	}
	END {
		for (k in nmb) { n = nmb[k]; for (i = 1; i <= n; i++) a[i] = mb[k, i]; m[k] = median(a, n); printf "median %-28s %8.0f MB/s\n", k, m[k] }
		if (m["BenchmarkPread8MiB"] > 0) printf "control / pread (8 MiB): %.2fx\n", m["BenchmarkControlRead8MiB"] / m["BenchmarkPread8MiB"]
		for (k in np50) {
			n = np50[k]; for (i = 1; i <= n; i++) a[i] = p50[k, i]; x = median(a, n)
			for (i = 1; i <= n; i++) a[i] = p99[k, i]; y = median(a, n)
			printf "median %-28s p50 %7.1f µs  p99 %7.1f µs\n", k, x, y
		}
	}'

echo "== gdsfs read --discard: control path vs engine alone ($size, host engine)"
mkdir -p "$tmp/src" "$mnt"
head -c "$(numfmt --from=iec-i "${size%B}")" /dev/urandom >"$tmp/src/bench.bin"
"$tmp/gdsfs" mount --background --engine host --source "$tmp/src" --log-file "$tmp/mount.log" "$mnt"
for p in 4 16; do
	: >"$tmp/c" && : >"$tmp/e"
	for _ in $(seq "$rounds"); do
		"$tmp/gdsfs" read --discard --parallel "$p" --passes 5 "$mnt/bench.bin" 2>&1 | grep -o '[0-9.]* GB/s' | cut -d' ' -f1 >>"$tmp/c"
		"$tmp/gdsfs" read --discard --parallel "$p" --passes 5 --engine-only "$mnt/bench.bin" 2>&1 | grep -o '[0-9.]* GB/s' | cut -d' ' -f1 >>"$tmp/e"
	done
	c=$(median <"$tmp/c") e=$(median <"$tmp/e")
	awk -v c="$c" -v e="$e" -v p="$p" 'BEGIN { printf "median gdsfs read, %2d x 4 x 8 MiB in flight: control path %.2f GB/s, engine alone %.2f GB/s: %.2fx\n", p, c, e, c / e }'
done
"$tmp/gdsfs" status "$mnt" | grep -E '^(reads|refused)' || true
