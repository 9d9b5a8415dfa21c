#!/usr/bin/env bash
# GPU checks of the control path (scripts/gpu-test.sh runs this; it can also
# run alone, as root, on a GPU machine, after scripts/gpu-build.sh):
#   1. end to end with GPU slabs: a producer process reads random ranges of
#      several files into device 0 slabs (READ ioctls, no CUDA in it); a
#      consumer process maps the slabs by CUDA IPC, compares every lease with
#      the file on the GPU (torch), writes a checkpoint from GPU memory with
#      WRITE and checks it with sha256sum (scripts/gpu/control_check.py);
#   2. gdsfs read --device 0 (copy-back through CUDA IPC) equals sha256sum;
#   3. throughput of 8 MiB requests, file -> GPU: through the control path vs
#      the same requests served by the engine alone (goal: the ioctl hop costs
#      < 10%), on a GDSFS_CONTROL_SIZE file (default 4GiB), each measurement
#      GDSFS_CONTROL_PASSES (default 5) passes after a warm-up pass, three
#      alternating runs per side, best of each compared.
#
#   scripts/gpu/control.sh [GDSFS_BIN] [WORK_DIR] [OUT_DIR]
#   GDSFS_CONTROL_DEVICE=-1 runs every step against host slabs (a check of
#   this script on a machine without a GPU; use a small GDSFS_CONTROL_SIZE).
set -uo pipefail
cd "$(dirname "$0")/../.."
bin=${1:-build/gpu/gdsfs}
base=${2:-${GDSFS_GPU_TEST_DIR:-/root/gdsfs-gpu}}
work=$base/control
out=${3:-${OUT:-/tmp/gdsfs-gpu-out}}
size=${GDSFS_CONTROL_SIZE:-4GiB}
passes=${GDSFS_CONTROL_PASSES:-5}
dev=${GDSFS_CONTROL_DEVICE:-0}
src=$work/src
mnt=$work/mnt
mkdir -p "$src" "$mnt" "$out"
status=0
fail() { echo "control.sh: FAIL: $*"; status=1; }

cleanup() {
	if mountpoint -q "$mnt" 2>/dev/null; then
		"$bin" unmount "$mnt" 2>/dev/null || umount -l "$mnt"
	fi
}
trap cleanup EXIT

echo "== control path: test files in $src"
head -c 1 /dev/urandom >"$src/one.bin"
head -c 100000 /dev/urandom >"$src/small.bin"
head -c $((7 * 1024 * 1024 + 5)) /dev/urandom >"$src/odd.bin"
head -c $((64 * 1024 * 1024)) /dev/urandom >"$src/big.bin"
# The benchmark file: gpu-test.sh's engine benchmark file when it has the
# size asked for (same filesystem), else one of its own.
bytes=$(numfmt --from=iec-i "${size%B}") || { echo "control.sh: GDSFS_CONTROL_SIZE=$size: give a size like 4GiB"; exit 2; }
if [ "$(stat -c %s "$src/bench.bin" 2>/dev/null)" != "$bytes" ]; then
	rm -f "$src/bench.bin"
	if [ "$(stat -c %s "$base/bench.dat" 2>/dev/null)" = "$bytes" ]; then
		ln -f "$base/bench.dat" "$src/bench.bin" 2>/dev/null || true
	fi
	if [ ! -s "$src/bench.bin" ]; then
		# 256 MiB of random bytes, repeated: /dev/urandom alone takes
		# tens of seconds for 4 GiB, and the page cache does not care.
		head -c $((256 << 20)) /dev/urandom >"$work/chunk.bin"
		for _ in $(seq $(((bytes + (256 << 20) - 1) / (256 << 20)))); do cat "$work/chunk.bin"; done |
			head -c "$bytes" >"$src/bench.bin"
		rm -f "$work/chunk.bin"
	fi
fi

echo "== gdsfs mount --source $src $mnt"
if ! "$bin" mount --background --source "$src" --log-file "$out/control-mount.log" "$mnt"; then
	fail "mount"
	cat "$out/control-mount.log"
	exit 1
fi
grep -o '"message":"control path ready"' "$out/control-mount.log" >/dev/null || fail "the mount log does not say the control path is ready"
"$bin" stat "$mnt/big.bin"

echo "== end to end with device $dev slabs (producer without CUDA, consumer by CUDA IPC, or mmap for host slabs)"
timeout 600 python3 scripts/gpu/control_check.py --device "$dev" "$mnt" "$mnt/one.bin" "$mnt/small.bin" "$mnt/odd.bin" "$mnt/big.bin" 2>&1 |
	tee "$out/control-check.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || fail "control_check.py"

echo "== gdsfs read --device $dev (copy-back by CUDA IPC for GPUs) vs sha256sum"
for f in one.bin odd.bin big.bin; do
	want=$(sha256sum <"$src/$f" | cut -d' ' -f1)
	if got=$(timeout 120 "$bin" read --device "$dev" "$mnt/$f" 2>"$out/control-read.err" | sha256sum | cut -d' ' -f1) &&
		[ ! -s "$out/control-read.err" ]; then
		[ "$got" = "$want" ] && echo "gdsfs read --device $dev $f: OK" || fail "gdsfs read --device $dev $f: sha256 $got, want $want"
	else
		fail "gdsfs read --device $dev $f: $(cat "$out/control-read.err")"
	fi
done

echo "== throughput, 8 MiB requests, file -> device $dev slabs, warm page cache ($size, $passes passes per run)"
cat "$src/bench.bin" >/dev/null
: >"$out/control-bench.txt"
for p in 4 16; do
	for run in 1 2 3; do
		for side in "" --engine-only; do
			# shellcheck disable=SC2086
			timeout 120 "$bin" read --device "$dev" --discard --parallel "$p" --passes "$passes" $side "$mnt/bench.bin" 2>&1 |
				tee -a "$out/control-bench.txt"
			[ "${PIPESTATUS[0]}" -eq 0 ] || fail "gdsfs read --discard --parallel $p $side"
		done
	done
done
# Best of the runs, per parallelism: control path / engine alone.
awk '
	function gbs(   i) { for (i = 1; i <= NF; i++) if ($(i + 1) == "GB/s") return $i + 0 }
	function inflight(   s) { s = $0; sub(/ requests of .*/, "", s); sub(/.* /, "", s); return s }
	/^control-path read:/ { p = inflight(); v = gbs(); if (v > c[p]) c[p] = v }
	/^engine-only read:/  { p = inflight(); v = gbs(); if (v > e[p]) e[p] = v }
	END { for (p in c) if (e[p] > 0) printf "control path %.2f GB/s vs engine alone %.2f GB/s with %s requests in flight: %.2fx %s\n", c[p], e[p], p, c[p] / e[p], (c[p] / e[p] >= 0.9 ? "(goal >= 0.9: met)" : "(goal >= 0.9: MISSED)") }
' "$out/control-bench.txt" | sort -t' ' -k11n | tee "$out/control-summary.txt"
[ -s "$out/control-summary.txt" ] || fail "no throughput figures (see $out/control-bench.txt)"
exhausted=$(grep -c 'pool exhausted' "$out/control-mount.log" 2>/dev/null)
[ "${exhausted:-0}" -eq 0 ] || echo "control.sh: the daemon's pool was exhausted $exhausted times (EAGAIN, retried by gdsfs read)"

"$bin" status "$mnt"
echo "control.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
