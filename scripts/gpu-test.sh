#!/usr/bin/env bash
# Runs every GPU check and benchmark of gdsfs on a GPU machine, from the
# binaries scripts/gpu-build.sh put in build/gpu/ (nothing is built here), and
# prints a short table last. Run as root from the repository root.
#
#   GDSFS_GPU_TEST_DIR  directory on the disk under test (default /root/gdsfs-gpu)
#   GDSFS_BENCH_SIZE    benchmark file size (default 4GiB)
#   GDSFS_TUNING=0      skip the chunk-size/worker tuning runs
#   OUT                 where logs go (default /tmp/gdsfs-gpu-out)
#   GDSFS_GPU_SECTIONS  which parts to run (default: mount engines ipcuid devuuid control dataset checkpoint dcp
#                       dcp2 tier pytest; dcp2 needs 2 GPUs and is skipped with fewer; compatfirst, not in
#                       the default: the engines section's cufile tests include its steps). One device call may not
#                       fit them all in 10 minutes: split them across calls.
#   GDSFS_CKPT_GIB      checkpoint benchmark size in GiB (default 8)
#   GDSFS_DCP_ARGS      extra arguments for scripts/gpu/dcp_check.py (e.g. --gib 2 --parts blocked,reshard)
#   GDSFS_TIER_GIB      memory-tier benchmark file size in GiB (default 8)
#   GDSFS_PYTHON        the Python with torch 2.x, safetensors, pytest, hypothesis (default python3)
#   GDSFS_PYTEST_ARGS   extra pytest arguments for the pytest section (e.g. -x), split on spaces
#   GDSFS_PYTEST_K      a pytest -k expression for the pytest section, spaces kept (e.g. "settle or close")
#   GDSFS_DATASET_ARGS  dataset_check.py arguments (default: issue 15's table, --sizes 16,64,256,4096
#                       --batch 16 --features-sizes 4096; about 3.5 minutes)
#   GDSFS_GPU_PACK      a .tgz path: every log under OUT is packed into it on exit (the device tool
#                       brings back at most 8 files from its $OUT: GDSFS_GPU_PACK=$OUT/all.tgz)
#   GDSFS_GPU_DEADLINE_S  seconds from the start after which no further section starts (the rest
#                       are listed as skipped), so that a call's time limit cuts no summary
set -uo pipefail
sections=" ${GDSFS_GPU_SECTIONS:-mount engines ipcuid devuuid control dataset checkpoint dcp dcp2 tier pytest} "
deadline=${GDSFS_GPU_DEADLINE_S:-0}
want() {
	[[ "$sections" == *" $1 "* ]] || return 1
	if [ "$deadline" -gt 0 ] && [ "$SECONDS" -ge "$deadline" ]; then
		echo "== $1: SKIP (GDSFS_GPU_DEADLINE_S=$deadline reached after ${SECONDS}s)" | tee -a "$out/skipped.txt"
		sections=${sections/ $1 / }
		return 1
	fi
}
cd "$(dirname "$0")/.."
bin=build/gpu
out=${OUT:-/tmp/gdsfs-gpu-out}
work=${GDSFS_GPU_TEST_DIR:-/root/gdsfs-gpu}
size=${GDSFS_BENCH_SIZE:-4GiB}
mkdir -p "$out" "$work"
if [ -n "${GDSFS_GPU_PACK:-}" ]; then
	# shellcheck disable=SC2064
	trap "tar czf '$GDSFS_GPU_PACK' -C '$out' . 2>/dev/null" EXIT
fi
need=(gdsfs)
if want engines; then need+=(cufile.test gpubuf.test); fi
if want compatfirst; then need+=(cufile.test); fi
for b in "${need[@]}"; do
	[ -x "$bin/$b" ] || { echo "gpu-test: $bin/$b missing: run scripts/gpu-build.sh first and carry build/gpu" >&2; exit 2; }
done
status=0
export CUFILE_LOGFILE_PATH="$out/cufile.log"

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -4
uname -r; nproc; findmnt -no SOURCE,FSTYPE -T "$work"

# libcufile may live outside the loader's default path (CUDA toolkit dir or
# the nvidia-cufile wheel): point the loader at it.
if ! ldconfig -p | grep -q 'libcufile\.so\.0 '; then
	lib=$(find /usr/local/cuda*/ /usr/lib /opt -xdev -name 'libcufile.so.0' 2>/dev/null | head -1)
	if [ -n "$lib" ]; then
		export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
		echo "libcufile: $lib"
	fi
fi

# cuFile classifies a file's block device through udev; this machine has no
# udev, so write the record cuFile reads (test machines only, never in the
# product: design.md "Testing").
read -r maj min < <(python3 -c 'import os,sys; s=os.stat(sys.argv[1]); print(os.major(s.st_dev), os.minor(s.st_dev))' "$work")
fstype=$(findmnt -no FSTYPE -T "$work")
rec=/run/udev/data/b$maj:$min
if command -v nvidia-smi >/dev/null; then
	mkdir -p /run/udev/data
	[ -e "$rec" ] || printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$fstype" >"$rec"
	echo "udev record $rec: $(tr '\n' ' ' <"$rec")"
else
	echo "no nvidia-smi: not a GPU machine, no udev record written"
fi

if want mount; then
	echo "== passthrough mount vs direct (gdsfs bench mount, 1 GiB file on $work)"
	timeout 240 "$bin/gdsfs" bench mount --dir "$work" --size 1GiB --runs 3 2>&1 | tee "$out/bench-mount.txt"
fi
if want engines; then
echo "== gdsfs doctor"
: >"$work/doctor-probe"
timeout 60 "$bin/gdsfs" doctor "$work/doctor-probe" 2>&1 | tee "$out/doctor.txt" || status=1

echo "== GPU tests (byte-exact random ranges per engine, write round trip, scrub, IPC from a second process)"
GDSFS_GPU_TEST_DIR="$work" GDSFS_IPC_CHECK=scripts/gpu_ipc_check.py \
	timeout 320 "$bin/cufile.test" -test.v -test.count=1 -test.timeout 300s 2>&1 | tee "$out/cufile-test.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 120 "$bin/gpubuf.test" -test.count=1 -test.timeout 120s 2>&1 | tee "$out/gpubuf-test.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== benchmark: $size file, warm and cold"
timeout 300 "$bin/gdsfs" bench engines --file "$work/bench.dat" --size "$size" --io-workers 16 --threads 16 --runs 3 \
	--min-warm-ratio 0.8 --min-cold-ratio 0.9 2>&1 | tee "$out/bench.txt" 2>/dev/null
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
[ "${GDSFS_TUNING:-1}" = 0 ] || echo "== tuning: chunk size and workers (warm only)"
[ "${GDSFS_TUNING:-1}" = 0 ] || for args in "--chunk-size 2MiB --io-workers 16" "--chunk-size 32MiB --io-workers 16" "--chunk-size 8MiB --io-workers 8"; do
	echo "-- $args"
	# shellcheck disable=SC2086
	timeout 120 "$bin/gdsfs" bench engines --file "$work/bench.dat" --size "$size" --threads 16 --runs 2 --no-cold $args 2>&1 |
		grep -E '^ *(posix|gds|h2d|pread16-pinned)' | tee -a "$out/tuning.txt"
done
echo "== torch.cuda.gds on the same file"
timeout 120 python3 scripts/gpu_torch_gds.py "$work/bench.dat" 2>&1 | tee "$out/torch-gds.txt" 2>/dev/null
fi

# ---- slab memory never crosses uids (issue 12 item 2, CUDA) --------------
if want ipcuid; then
	echo "== two uids, one process each: A keeps mappings of released slabs, B fills the pool; A sees only its own bytes, B gets none of A's handles (scripts/gpu/ipc_uid_check.py)"
	timeout 300 python3 scripts/gpu/ipc_uid_check.py --bin "$bin/gdsfs" --work /tmp/gdsfs-ipc-uid --out "$out" \
		--json "$out/ipc-uid.json" 2>&1 | tee "$out/ipc-uid.txt"
	[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# ---- control path (issue 4): scripts/gpu/control.sh ----------------------
if want control; then
echo "== control path: GPU slabs end to end (CUDA IPC consumer), gdsfs read, ioctl-hop throughput"
timeout 900 scripts/gpu/control.sh "$bin/gdsfs" "$work" "$out" 2>&1 | tee "$out/control.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# ---- end of control path ---------------------------------------------------

# ---- Python client: datasets (issue 6), checkpoints (issue 7) ------------
# Each runs against its own mount of a fresh backing dir, unmounted afterwards.
pymount() { # NAME POOL [MOUNT FLAGS...]: mounts $work/NAME/src at $work/NAME/mnt
	mkdir -p "$work/$1/src" "$work/$1/mnt"
	"$bin/gdsfs" mount --background --source "$work/$1/src" --gpu-pool "$2" "${@:3}" \
		--log-file "$out/$1-mount.log" "$work/$1/mnt" || { echo "gpu-test: mount for $1 failed"; cat "$out/$1-mount.log"; return 1; }
}
pyunmount() { "$bin/gdsfs" unmount "$work/$1/mnt" 2>/dev/null || umount -l "$work/$1/mnt"; rm -rf "$work/$1/src"; }
if want dataset; then
	echo "== datasets: GDSShardDataset, num_workers=8, pin_memory=True (scripts/gpu/dataset_check.py)"
	# --metrics-addr: the worker profile (issue 15) reads the daemon's own time per READ there.
	# GDSFS_DATASET_MOUNT_FLAGS: more mount flags, e.g. "--readahead 0" for the cold path without
	# the daemon's readahead (issue 15).
	if pymount dataset 8GiB --metrics-addr 127.0.0.1:19478 ${GDSFS_DATASET_MOUNT_FLAGS:-}; then
		PYTHONUNBUFFERED=1 timeout 480 python3 scripts/gpu/dataset_check.py "$work/dataset/mnt" "$work/dataset/src" \
			${GDSFS_DATASET_ARGS:---sizes 16,64,256,4096 --batch 16 --features-sizes 4096} --metrics 127.0.0.1:19478 --json "$out/dataset.json" 2>&1 | tee "$out/dataset.txt"
		[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
		"$bin/gdsfs" status "$work/dataset/mnt" 2>&1 | tail -5
		pyunmount dataset
	else status=1; fi
fi
# ---- cuFile compat mode's first touch of each new slab (issue 14, cufile/compatfirst.go: compat
# mode registers no slab): the engine-level steps, then a fresh daemon's first warm load of a DCP
# checkpoint (12-02 02:20, before: 2.49 GB/s; target >= 20).
if want compatfirst; then
	echo "== compat first touch: fresh slabs unregistered vs registered (cufile/gpu_compatfirst_test.go)"
	GDSFS_GPU_TEST_DIR="$work" timeout 200 "$bin/cufile.test" -test.v -test.count=1 \
		-test.run 'TestGPUCompatFirstTouch|TestGPUFirstReadsOfCachedFiles' 2>&1 | tee "$out/compatfirst.txt" |
		grep -E 'compatfirst:|gpu_firstread_test|^(---|ok|FAIL|PASS)'
	[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
	echo "== compat first touch: a fresh daemon's first warm DCP load (scripts/gpu/dcp_diag.py --second)"
	if pymount cf 16GiB --metrics-addr 127.0.0.1:19479; then
		PYTHONUNBUFFERED=1 timeout 240 python3 scripts/gpu/dcp_diag.py "$work/cf/mnt" "$work/cf/src" --no-stock --gib 4 \
			--bin "$bin/gdsfs" --metrics 127.0.0.1:19479 --second 2>&1 | tee "$out/cf-dcp.txt"
		[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
		pyunmount cf
	else status=1; fi
fi
if want dcp2; then
	if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
		echo "== distributed checkpoint, 2 ranks on 2 GPUs (scripts/gpu/dcp_2gpu.py)"
		if pymount dcp2 8GiB; then
			PYTHONUNBUFFERED=1 timeout 300 python3 scripts/gpu/dcp_2gpu.py "$work/dcp2/mnt" "$work/dcp2/src" 2>&1 | tee "$out/dcp2.txt"
			[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
			pyunmount dcp2
		else status=1; fi
	else
		echo "== distributed checkpoint: SKIP (needs 2 GPUs: nvidia-h200-x2)"
	fi
fi
if want checkpoint; then
	echo "== checkpoints: safetensors, torch.save zip, DCP (scripts/gpu/checkpoint_check.py)"
	if pymount ckpt 16GiB; then
		PYTHONUNBUFFERED=1 timeout "${GDSFS_CKPT_TIMEOUT:-540}" python3 scripts/gpu/checkpoint_check.py "$work/ckpt/mnt" "$work/ckpt/src" \
			--gib "${GDSFS_CKPT_GIB:-8}" ${GDSFS_CKPT_ARGS:-} --json "$out/checkpoint.json" 2>&1 | tee "$out/checkpoint.txt"
		[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
		pyunmount ckpt
	else status=1; fi
fi
# ---- DCP on one GPU (issue 14): async_save blocking and completion, a training
# loop with saves, resharded loads; stock vs gdsfs in the same run.
if want dcp; then
	echo "== DCP on one GPU: async_save, training loop with saves, resharded loads (scripts/gpu/dcp_check.py)"
	echo "backing filesystem options (discard makes deletes cost later writes): $(findmnt -no OPTIONS -T "$work")"
	if [ -x "$bin/cufile.test" ]; then # the daemon's WRITE path: O_DIRECT from device memory (cufile/directwrite.go)
		GDSFS_GPU_TEST_DIR="$work" timeout 120 "$bin/cufile.test" -test.v -test.count=1 -test.run 'TestGPUWrite' 2>&1 |
			grep -E '^(---|ok|FAIL|PASS)|gpu_test' | tee "$out/dcp-cufile.txt"
	fi
	if pymount dcp 16GiB; then
		# shellcheck disable=SC2086
		PYTHONUNBUFFERED=1 timeout "${GDSFS_DCP_TIMEOUT:-480}" python3 scripts/gpu/dcp_check.py "$work/dcp/mnt" "$work/dcp/src" \
			${GDSFS_DCP_ARGS:-} --json "$out/dcp.json" 2>&1 | tee "$out/dcp.txt"
		[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
		"$bin/gdsfs" status "$work/dcp/mnt" 2>&1 | tail -5
		pyunmount dcp
	else status=1; fi
fi
# ---- the daemon's memory tier (issue 14 part 3) ---------------------------
if want tier; then
	echo "== memory tier: ${GDSFS_TIER_GIB:-8} GiB safetensors, warm load via the page cache vs via the tier (gdsfs warm --pin) vs pinned H2D (scripts/gpu/tier_check.py)"
	if [ -x "$bin/cufile.test" ]; then # the tier's pinned memory: copies, and what a fill costs (cufile/hostreg.go)
		timeout 120 "$bin/cufile.test" -test.v -test.count=1 -test.run 'TestGPUTier' 2>&1 | grep -E '^(---|ok|FAIL|PASS)|gpu_(tier|hostreg)_test' | tee "$out/tier-cufile.txt"
	fi
	PYTHONUNBUFFERED=1 timeout "${GDSFS_TIER_TIMEOUT:-420}" python3 scripts/gpu/tier_check.py --bin "$bin/gdsfs" --work "$work/tier" \
		--out "$out" --gib "${GDSFS_TIER_GIB:-8}" --json "$out/tier.json" 2>&1 | tee "$out/tier.txt"
	[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# ---- CUDA devices named by UUID between the daemon and its clients (devuuid) ----
# About a minute. With 2 GPUs (nvidia-h200-x2) it also checks
# CUDA_VISIBLE_DEVICES=1 and a daemon that lacks the client's GPU.
if want devuuid; then
	echo "== device UUIDs: the daemon's are torch's; a client that sees one GPU (CUDA_VISIBLE_DEVICES=GPU-<uuid>, =1) loads onto it (scripts/gpu/devuuid_check.py)"
	if [ -x "$bin/cufile.test" ]; then
		timeout 120 "$bin/cufile.test" -test.v -test.count=1 -test.run 'TestGPUDeviceUUIDs' 2>&1 |
			grep -E '^(---|ok|FAIL|PASS)|gpu_uuid_test' | tee "$out/devuuid-cufile.txt"
	fi
	PYTHONUNBUFFERED=1 timeout 420 python3 scripts/gpu/devuuid_check.py --bin "$bin/gdsfs" --work "$work/devuuid" --out "$out" \
		--json "$out/devuuid.json" 2>&1 | tee "$out/devuuid.txt"
	[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# ---- the Python suite (python/tests), against the carried binary --------
# CI runs it with torch 1.13 and no safetensors, where the DCP fixtures and
# round trips, safe_globals and the signature mirror skip; here torch 2.x,
# safetensors and CUDA are present, so they run. The tests mount their own
# host-engine daemon ($GDSFS_BIN); torch sees the GPUs, so the CUDA paths of
# the client (materialize, device=, map_location=) run too.
if want pytest; then
	py=${GDSFS_PYTHON:-python3}
	echo "== python suite: $py -m pytest python/tests ($("$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1))"
	# On timeout, SIGINT first: pytest tears its fixtures down (unmounts its daemons), and
	# gets killed only if that takes more than 30 s.
	t=${GDSFS_PYTEST_TIMEOUT:-480}
	# shellcheck disable=SC2086
	GDSFS_BIN="$PWD/$bin/gdsfs" PYTHONUNBUFFERED=1 timeout -s INT -k 30 "$t" \
		"$py" -m pytest -q -rs -p no:cacheprovider --junitxml "$out/pytest.xml" ${GDSFS_PYTEST_ARGS:-} \
			${GDSFS_PYTEST_K:+-k "$GDSFS_PYTEST_K"} python/tests 2>&1 |
		tee "$out/pytest.txt"
	rc=${PIPESTATUS[0]}
	if [ "$rc" -ne 0 ]; then
		status=1
		# timeout's 124, or pytest's own exit for an interrupted run (2) after our SIGINT.
		if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] || { [ "$rc" -eq 2 ] && grep -q KeyboardInterrupt "$out/pytest.txt"; }; then
			printf '\ngpu-test: pytest timed out after %ss (GDSFS_PYTEST_TIMEOUT)\n' "$t" | tee -a "$out/pytest.txt"
		fi
	fi
fi

echo
echo "================ summary ================"
grep -hE '^(--- |ok |FAIL|PASS)' "$out/cufile-test.txt" 2>/dev/null | grep -E -- '--- (PASS|FAIL|SKIP): TestGPU' | sed 's/ (.*//'
grep -E '^(ok|PASS|FAIL)' "$out/gpubuf-test.txt" 2>/dev/null | sed 's/^/gpubuf tests: /' | head -1
grep -E 'byte-exact|match' "$out/cufile-test.txt" 2>/dev/null | sed 's/^ *gpu_test.go:[0-9]*: //' | sort -u
grep -E '^ *(read|pread|h2d|odirect|gds|posix|host)' "$out/bench.txt" 2>/dev/null
grep -E 'torch.cuda.gds' "$out/torch-gds.txt" 2>/dev/null
grep -E '^verdict' "$out/doctor.txt" 2>/dev/null
grep -hE '^ipc_uid_check: (FAIL.*|PASS)$|slab handles' "$out/ipc-uid.txt" 2>/dev/null
grep -hE '^control_check: (PASS|consumer)|^gdsfs read --device|^control path .* GB/s|^control.sh:' "$out/control.txt" 2>/dev/null
[ -f "$out/bench-mount.txt" ] && { echo "-- bench mount"; tail -n 12 "$out/bench-mount.txt"; }
[ -f "$out/compatfirst.txt" ] && { echo "-- compatfirst"; grep -hE 'compatfirst:|^--- (PASS|FAIL)' "$out/compatfirst.txt"; grep -hE 'load|GB/s' "$out/cf-dcp.txt" 2>/dev/null | tail -n 8; }
for f in dataset checkpoint dcp; do [ -f "$out/$f.txt" ] && { echo "-- $f (tail)"; tail -n 22 "$out/$f.txt"; }; done
[ -f "$out/dcp2.txt" ] && tail -n 3 "$out/dcp2.txt"
[ -f "$out/tier.txt" ] && { echo "-- tier"; grep -E '^tier_check: (pinned|gdsfs|tier vs|tier memory|tier load profile|fresh|page-cache load profile|residency|two|table|row|a pinned|PASS|FAIL|SKIP)' "$out/tier.txt"; }
[ -f "$out/devuuid.txt" ] && { echo "-- devuuid"; grep -hE '^--- (PASS|FAIL|SKIP): TestGPUDeviceUUIDs' "$out/devuuid-cufile.txt" 2>/dev/null; grep -E '^devuuid_check: (ok|FAIL|PASS|SKIP|CUDA_VISIBLE)' "$out/devuuid.txt"; }
[ -f "$out/skipped.txt" ] && cat "$out/skipped.txt"
# pytest's closing count ("N passed, M skipped in S s", or the failures), else why there is none.
if [ -f "$out/pytest.txt" ]; then
	count=$(grep -E '^gpu-test: pytest timed out|^=* *[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$out/pytest.txt" | tail -n 1 | sed 's/^gpu-test: //; s/^=* *//; s/ *=*$//')
	echo "python suite: ${count:-no pytest count: see $out/pytest.txt}"
fi
echo "gpu-test: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
