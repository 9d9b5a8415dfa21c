#!/usr/bin/env bash
# make demo: generates a small dataset (tar shards and a .npy), overmounts its
# directory with `gdsfs mount --background`, reads it through the mount with
# plain tools, compares with what was written, and unmounts. Leaves nothing
# mounted, even on failure. Needs root (FUSE passthrough) and fuse3.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${GDSFS_BIN:-$PWD/bin/gdsfs}"
# GDSFS_PYTHON: the interpreter for the numpy and gdsfs.torch steps;
# GDSFS_PYTHONPATH: where it finds the gdsfs package (default: this checkout's
# python/; empty: the installed package, as in scripts/check-install.sh).
py=${GDSFS_PYTHON:-/usr/bin/python3}
pypath=${GDSFS_PYTHONPATH-$PWD/python}
[ -x "$bin" ] || { echo "demo: $bin not built; run make demo" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/gdsfs-demo.XXXXXX")
data="$work/data"
cleanup() {
	if mountpoint -q "$data" 2>/dev/null; then
		"$bin" unmount --force "$data" 2>/dev/null || umount -l "$data"
	fi
	if [ "${status:-1}" -ne 0 ] && [ -f "$work/gdsfs.log" ]; then
		echo "demo failed; daemon log:" >&2
		cat "$work/gdsfs.log" >&2
	fi
	rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n== %s\n' "$*"; }

step "generating a demo dataset in $data"
mkdir -p "$data"
for s in 0 1 2 3; do
	gen="$work/gen/$s"
	mkdir -p "$gen"
	for i in $(seq -w 0 31); do
		head -c $((4096 + 97 * 10#$i)) /dev/urandom >"$gen/sample$s$i.bin"
		echo "$((10#$i % 10))" >"$gen/sample$s$i.cls"
	done
	tar --sort=name -C "$gen" -cf "$data/shard-00000$s.tar" .
done
if [ -x "$py" ] && "$py" -c 'import numpy' 2>/dev/null; then
	"$py" -c "import numpy as np; np.save('$data/features.npy', np.arange(1 << 16, dtype=np.float32).reshape(256, 256))"
else
	echo "(no numpy at $py: skipping the .npy)"
fi
(cd "$data" && sha256sum -- * >"$work/written.sha256")
ls -l "$data"

step "gdsfs mount --background $data   (overmount: the directory keeps its path)"
"$bin" mount --background --log-file "$work/gdsfs.log" "$data"
grep -o '"passthrough":[a-z]*,"why":"[^"]*"' "$work/gdsfs.log" || true
mount | grep " $data "

step "reading through the mount with plain tools"
(cd "$data" && sha256sum -c "$work/written.sha256")
for t in "$data"/*.tar; do
	n=$(tar tf "$t" | grep -c '\.bin$')
	echo "$(basename "$t"): $n samples"
	[ "$n" -eq 32 ] || { echo "demo: $t lists $n samples, want 32" >&2; exit 1; }
done
if [ -f "$data/features.npy" ]; then
	"$py" -c "
import numpy as np
a = np.load('$data/features.npy', mmap_mode='r')
assert a.shape == (256, 256) and float(a.sum()) == float(np.arange(1 << 16, dtype=np.float64).sum()), a.shape
print('features.npy via mmap:', a.shape, a.dtype, 'sum', float(a.sum()))
"
fi

step "control path"
# The same files read through the control path (the daemon reads them into
# its slabs; gdsfs read copies them back) must hash like the plain reads.
while read -r sum name; do
	got=$("$bin" read "$data/$name" | sha256sum | cut -d' ' -f1)
	[ "$got" = "$sum" ] || { echo "demo: gdsfs read $name: sha256 $got, want $sum" >&2; exit 1; }
	echo "gdsfs read $name: OK"
done <"$work/written.sha256"
# A range at an unaligned offset, compared with dd.
"$bin" read --offset 1000 --length 50000 "$data/shard-000000.tar" | cmp - <(dd if="$data/shard-000000.tar" bs=1 skip=1000 count=50000 status=none)
echo "gdsfs read --offset 1000 --length 50000: OK"
if "$py" -c 'import torch' 2>/dev/null; then
	# Every sample's .bin field read by the daemon into its memory (GPU, or
	# shared host memory here), through a DataLoader with 2 workers, must
	# equal the file that went into the tar.
	PYTHONPATH="$pypath" "$py" - "$data" "$work/gen" <<'EOF'
import glob, os, sys
import gdsfs.torch as gt
data, gen = sys.argv[1], sys.argv[2]
ds = gt.GDSShardDataset(sorted(glob.glob(os.path.join(data, "shard-*.tar"))), gpu_keys=["bin"], strict=True)
seen = 0
for batch in gt.DataLoader(ds, batch_size=8, num_workers=2):
    for key, x in zip(batch["__key__"], batch["bin"]):
        name = os.path.basename(key)
        with open(os.path.join(gen, name[len("sample")], name + ".bin"), "rb") as f:
            assert x.numpy().tobytes() == f.read(), key
        seen += 1
assert seen == 128, seen
print(f"gdsfs.torch DataLoader: {seen} samples, bytes equal to the files written (read by {'the daemon' if ds.gds else 'plain reads'})")
EOF
fi
"$bin" stat "$data/shard-000000.tar"
"$bin" status "$data"

step "writing through the mount, then unmounting"
echo "written through gdsfs" >"$data/NOTE"
"$bin" unmount "$data"
mountpoint -q "$data" && { echo "demo: still mounted" >&2; exit 1; }
grep -q "written through gdsfs" "$data/NOTE"
echo "after unmount $data/NOTE is in the original directory"
status=0
echo
echo "demo ok"
