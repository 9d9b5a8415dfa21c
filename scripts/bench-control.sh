#!/usr/bin/env bash
# Control-path benchmarks (host engine), run as root: 8 MiB READ ioctls vs
# parallel pread of the backing file, and 4 KiB READ latency vs a 4 KiB pread
# through the mount. Each pair runs ROUNDS times, alternating, and the medians
# are printed: on a shared machine single runs are noise.
#   ./scripts/bench-control.sh [ROUNDS]   (default 5)
set -euo pipefail
rounds="${1:-5}"
cd "$(dirname "$0")/.."
bin=$(mktemp -d)/itest
trap 'rm -rf "$(dirname "$bin")"' EXIT
go test -c -o "$bin" ./integration/
cd integration
out=$(for _ in $(seq "$rounds"); do
	"$bin" -test.run '^$' -test.bench '^Benchmark(ControlRead8MiB|Pread8MiB|ControlRead4KiB|MountPread4KiB)$' -test.benchtime 1s
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
