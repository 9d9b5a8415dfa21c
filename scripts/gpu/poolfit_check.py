#!/usr/bin/env python3
"""GPU check: a gdsfs.torch.DataLoader that cannot fit its uid's share of the GPU pool (poolfit).

Usage (as root, on a GPU machine, after scripts/gpu-build.sh):

    poolfit_check.py [--bin build/gpu/gdsfs] [--work /root/gdsfs-gpu/poolfit]

A daemon with the default GPU pool settings but --gpu-pool 2GiB (64 MiB slabs, --uid-share 50%:
1 GiB per uid), 8 tars of 40 samples of 4 MiB (.npy float32) and a .cls, 8 workers,
pin_memory=True (the loop copies to cuda:0):

1. batch_size=32: the other 7 workers' 64 samples each and the awaited batch cannot fit 1 GiB:
   GDSPoolError at the first next(), before any worker starts, naming --gpu-pool.
2. batch_size=16: 8 x 32 + 16 samples in flight (18.1 slabs) are more than the 16 slabs, but the
   awaited batch always fits (16 slabs exactly): one GDSPoolWarning, then every sample once,
   its bytes equal to the file's, within 120 s (no READ gave up).

Prints one line per check and a verdict; exits 0 when both pass. --host runs the same with the
host engine (--host-pool 2GiB, device="cpu", no pinning), on machines without a GPU.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "python"))

SAMPLE = 4 << 20


def log(msg: str) -> None:
    print(f"poolfit_check: {msg}", flush=True)


def write_shards(src: str, nshards: int, per: int) -> dict[str, bytes]:
    import numpy as np

    truth: dict[str, bytes] = {}
    rng = np.random.default_rng(7)
    for s in range(nshards):
        with tarfile.open(os.path.join(src, f"shard-{s}.tar"), "w") as tf:
            for i in range(per):
                a = rng.standard_normal(SAMPLE // 4).astype(np.float32)
                key = f"s{s}_{i:03d}"
                truth[key] = a.tobytes()
                b = io.BytesIO()
                np.save(b, a)
                for ext, data in (("cls", str(i).encode()), ("x.npy", b.getvalue())):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
    return truth


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "build", "gpu", "gdsfs"))
    ap.add_argument("--work", default="/root/gdsfs-gpu/poolfit")
    ap.add_argument("--host", action="store_true", help="the host engine (no GPU)")
    a = ap.parse_args()
    pool = ["--engine", "host", "--host-pool", "2GiB"] if a.host else ["--gpu-pool", "2GiB"]
    flag, device = ("--host-pool", "cpu") if a.host else ("--gpu-pool", "cuda:0")
    src, mnt = os.path.join(a.work, "src"), os.path.join(a.work, "mnt")
    shutil.rmtree(a.work, ignore_errors=True)
    os.makedirs(src)
    os.makedirs(mnt)
    truth = write_shards(src, 8, 40)
    r = subprocess.run([a.bin, "mount", "--background", "--source", src, *pool, "--log-file",
                        os.path.join(a.work, "mount.log"), mnt], capture_output=True, text=True)
    if r.returncode != 0:
        log(f"mount failed: {r.stderr.strip()}")
        return 1
    ok = True
    try:
        import gdsfs.torch as gt
        from gdsfs import GDSPoolError, GDSPoolWarning

        paths = [os.path.join(mnt, f"shard-{s}.tar") for s in range(8)]
        ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, device=device)
        dl = gt.DataLoader(ds, batch_size=32, num_workers=8, pin_memory=not a.host, timeout=120)
        t = time.monotonic()
        try:
            next(iter(dl))
            log("1. batch_size=32: FAIL, no GDSPoolError")
            ok = False
        except GDSPoolError as e:
            good = flag in str(e) and "can hang" in str(e)
            ok &= good
            log(f"1. batch_size=32: {'ok' if good else 'FAIL'} in {time.monotonic() - t:.2f} s: {e}")
        dl = gt.DataLoader(ds, batch_size=16, num_workers=8, pin_memory=not a.host, timeout=120)
        t = time.monotonic()
        seen: dict[str, bool] = {}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for b in dl:
                x = b["x.npy"]
                for i, key in enumerate(b["__key__"]):
                    seen[key] = x[i].cpu().numpy().tobytes() == truth[key]
        pw = [str(m.message) for m in w if issubclass(m.category, GDSPoolWarning)]
        good = len(pw) == 1 and len(seen) == len(truth) and all(seen.values())
        ok &= good
        log(f"2. batch_size=16: {'ok' if good else 'FAIL'}: {len(seen)} of {len(truth)} samples, {sum(seen.values())} equal, "
            f"{len(pw)} GDSPoolWarning, {time.monotonic() - t:.1f} s: {pw[0] if pw else ''}")
        ds.close()
    finally:
        subprocess.run([a.bin, "unmount", mnt], capture_output=True)
        shutil.rmtree(a.work, ignore_errors=True)
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
