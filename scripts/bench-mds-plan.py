#!/usr/bin/env python3
"""MDS shards with a per-sample-shape ndarray column: a fresh loader, cold, with and without the
index's ndarray geometry (issue 15, helper mdsplan).

Usage: bench-mds-plan.py [--sizes 16,64] [--mib 64] [--workers 2] [--batch 16] [--reps 3]

Writes an MDS dataset per size (4 shards, columns id: int64 and x: "ndarray", dtype and shape
stored in each sample, float32 of the size) with the project's MDS writer
(python/tests/_mds_helpers.py) on a host-mode gdsfs mount of its own, has the daemon index it,
then per repetition, interleaved: the disk's sequential read of the shards (pages dropped), and
a fresh GDSShardDataset + gdsfs.torch.DataLoader over the dropped shards planned from the
index's ndarray_headers ("after") or with them taken away in each worker, so that each sample's
header is pread as before ("before"). Prints the first batch's seconds (median), samples/s of
the whole pass (best), and the header preads the workers made (preads at an x value's first
byte), and the after/before ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing.util
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _load(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Init:
    """worker_init_fn: counts this worker's preads at an x value's first byte (written to
    countdir as it exits) and, for "before", takes the index's ndarray geometry away."""

    def __init__(self, countdir: str, starts: dict[str, set[int]], strip: bool) -> None:
        self.countdir, self.starts, self.strip = countdir, starts, strip

    def __call__(self, _wid: int) -> None:
        import torch.utils.data

        from gdsfs import _dataset

        if self.strip:
            ds = torch.utils.data.get_worker_info().dataset
            for st in ds._open.values():
                st.mds_headers = []
            init = _dataset._ShardState.__init__

            def bare(st: Any, *a: Any, **kw: Any) -> None:
                init(st, *a, **kw)
                st.mds_headers = []

            _dataset._ShardState.__init__ = bare  # type: ignore[method-assign]
        real, starts, names, count = os.pread, self.starts, {}, [0]

        def pread(fd: int, n: int, off: int) -> bytes:
            name = names.get(fd)
            if name is None:
                try:
                    name = names[fd] = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    name = names[fd] = ""
            if off in starts.get(name, ()):
                count[0] += 1
            return real(fd, n, off)

        def save() -> None:
            with open(os.path.join(self.countdir, str(os.getpid())), "w") as f:
                f.write(str(count[0]))

        os.pread = pread  # type: ignore[assignment]
        multiprocessing.util.Finalize(None, save, exitpriority=100)


def cold_pass(bd: Any, shards: list[str], backing: list[str], starts: dict[str, set[int]], strip: bool, batch: int, workers: int, n: int) -> dict[str, float]:
    import gdsfs.torch as gt

    countdir = tempfile.mkdtemp(prefix="mdsplan-preads-")
    bd.drop(backing + shards)
    t0 = time.perf_counter()
    ds = gt.GDSShardDataset(shards, gpu_keys=["x"], strict=True)
    dl = gt.DataLoader(ds, batch_size=batch, num_workers=workers, worker_init_fn=_Init(countdir, starts, strip))
    got, first = 0, 0.0
    for b in dl:
        if not got:
            first = time.perf_counter() - t0
        got += b["x"].shape[0]
    secs = time.perf_counter() - t0
    del dl
    ds.close()
    if got != n:
        raise RuntimeError(f"{got} samples, expected {n}")
    hdr = sum(int(open(os.path.join(countdir, f)).read()) for f in os.listdir(countdir))
    shutil.rmtree(countdir, ignore_errors=True)
    return {"first_s": first, "samples_per_s": n / secs, "header_preads": hdr}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64")
    ap.add_argument("--mib", type=int, default=64, help="MiB of shards per size (4 shards)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "python"))
    bd = _load("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    mh = _load("mds_helpers", os.path.join(ROOT, "python", "tests", "_mds_helpers.py"))
    base = tempfile.mkdtemp(prefix="gdsfs-bench-mds-plan-")
    src, mnt = bd.own_mount(base)
    rows = []
    try:
        for kib in (int(x) for x in a.sizes.split(",") if x.strip()):
            n = (a.mib << 20) // (kib << 10)
            n -= n % 4
            rng = np.random.default_rng(kib)
            d = os.path.join(src, f"{kib}KiB")
            per = n // 4
            backing = mh.write_dataset(d, {"id": "int64", "x": "ndarray"},
                                       [[{"id": s * per + i, "x": rng.standard_normal(kib * 256).astype(np.float32)} for i in range(per)] for s in range(4)])
            shards = [p.replace(src, mnt, 1) for p in backing]
            starts = {os.path.basename(p): {w["x"][0] for w in mh.decode_shard(p)[2]} for p in backing}
            cold_pass(bd, shards, backing, starts, False, a.batch, 0, n)  # the daemon indexes the shards
            row: dict[str, Any] = {"kib": kib, "disk": 0.0, "before": [], "after": []}
            for rep in range(a.reps):
                row["disk"] = max(row["disk"], bd.sequential_rate(backing))
                for label in ("after", "before") if rep % 2 == 0 else ("before", "after"):
                    row[label].append(cold_pass(bd, shards, backing, starts, label == "before", a.batch, a.workers, n))
            rows.append(row)
    finally:
        bd.unmount(mnt)
        if not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)
    print(f"host engine, MDS, x: 'ndarray' (dtype and shape per sample), cold, {a.workers} workers, batch {a.batch}, {a.mib} MiB per size; "
          f"{a.reps} interleaved runs: first batch median, samples/s best")
    print(f"{'sample':>7} {'disk GB/s':>9} {'planning':>8} {'first batch s':>13} {'samples/s':>9} {'hdr preads':>10}")
    for r in rows:
        for label in ("before", "after"):
            rs = r[label]
            r[label + " first"] = statistics.median(x["first_s"] for x in rs)
            r[label + " sps"] = max(x["samples_per_s"] for x in rs)
            print(f"{str(r['kib']) + ' KiB':>7} {r['disk']:>9.2f} {label:>8} {r[label + ' first']:>13.3f} {r[label + ' sps']:>9,.0f} "
                  f"{max(x['header_preads'] for x in rs):>10}")
        print(f"{str(r['kib']) + ' KiB':>7} after/before: first batch {r['after first'] / r['before first']:.2f}x the time, "
              f"samples/s {r['after sps'] / r['before sps']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
