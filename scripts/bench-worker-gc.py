#!/usr/bin/env python3
"""What a DataLoader worker's garbage collector costs at small samples (issue 15, host engine).

Usage: bench-worker-gc.py [--kib 16] [--samples 8192] [--workers 2] [--reps 3] [--compare PKGDIR]

Writes WebDataset tars (bench-dataset.py's make_tars: 4 shards) on a host-mode gdsfs mount of its
own and runs GDSShardDataset through torch's DataLoader with its workers forked as
gdsfs.torch.DataLoader forks them (_dataset._frozen_heap), batch 16. Each worker prints its
collections during the epoch (count and ms per generation, from gc.callbacks), its CPU per
sample, and then what a full collection at the end of its epoch walks (tracked objects) and
costs. --compare PKGDIR also runs with the gdsfs package in PKGDIR (e.g. an older commit's
python/ from `git archive`), interleaved, and prints the medians of both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child(shards: list[str], workers: int) -> list[dict[str, Any]]:
    """One epoch (run in a child process with the package under test first on sys.path)."""
    import gc

    import torch
    import torch.utils.data

    import gdsfs._dataset as gd
    import gdsfs.torch as gt

    class Timed(torch.utils.data.IterableDataset):
        def __init__(self, ds: Any, outdir: str) -> None:
            super().__init__()
            self.ds, self.outdir = ds, outdir

        def __iter__(self) -> Iterator[Any]:
            st = {"t0": 0.0, "n": [0, 0, 0], "ms": [0.0, 0.0, 0.0]}

            def on_gc(phase: str, info: dict[str, int]) -> None:
                if phase == "start":
                    st["t0"] = time.perf_counter()
                    return
                g = info["generation"]
                st["n"][g] += 1
                st["ms"][g] += (time.perf_counter() - st["t0"]) * 1e3

            gc.callbacks.append(on_gc)
            n = 0
            c0 = time.process_time()
            for s in self.ds:
                n += 1
                yield s
            gc.callbacks.remove(on_gc)
            cpu = time.process_time() - c0
            tracked = len(gc.get_objects())
            t = time.perf_counter()
            gc.collect()
            full = (time.perf_counter() - t) * 1e3
            with open(os.path.join(self.outdir, f"{os.getpid()}.json"), "w") as f:
                json.dump({"samples": n, "n": st["n"], "ms": st["ms"], "cpu_us": cpu / max(1, n) * 1e6, "tracked": tracked, "full_ms": full}, f)

    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    outdir = tempfile.mkdtemp(prefix="gdsfs-wgc-")
    loader = torch.utils.data.DataLoader(Timed(ds, outdir), batch_size=16, num_workers=workers, collate_fn=gt.collate, timeout=300)
    with gd._frozen_heap(loader):
        it = iter(loader)
    for b in it:
        if isinstance(b, gt.GDSBatch) and not b.materialized:
            b = b.materialize()
        del b
    del it
    recs = [json.load(open(os.path.join(outdir, f))) for f in sorted(os.listdir(outdir))]
    ds.close()
    return recs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", help="also run with the gdsfs package in PKGDIR, interleaved")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        sys.path.insert(0, a.child)
        shards = json.loads(os.environ["GDSFS_WGC_SHARDS"])
        print(json.dumps(child(shards, a.workers)))
        return 0
    bench = _bench()
    base = tempfile.mkdtemp(prefix="gdsfs-wgc-")
    src, mnt = bench.own_mount(base)
    try:
        paths = bench.make_tars(os.path.join(src, "d"), a.kib, a.samples)
        shards = [os.path.join(mnt, "d", os.path.basename(p)) for p in paths]
        pkgs = [("this", os.path.join(ROOT, "python"))] + ([("compare", a.compare)] if a.compare else [])
        rows: dict[str, list[dict[str, Any]]] = {k: [] for k, _ in pkgs}
        env = dict(os.environ, GDSFS_WGC_SHARDS=json.dumps(shards))
        for _ in range(a.reps):
            for label, pkg in pkgs:
                r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", pkg, "--workers", str(a.workers)],
                                   env=env, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    print(r.stderr, file=sys.stderr)
                    return 1
                for w in json.loads(r.stdout.strip().splitlines()[-1]):
                    rows[label].append(w)
                    print(f"{label}: worker {w['samples']} samples: collections {w['n']} ({sum(w['ms']):.1f} ms: {', '.join(f'{x:.1f}' for x in w['ms'])} per "
                          f"generation), CPU {w['cpu_us']:.1f} us per sample; at the end {w['tracked']} tracked objects, a full collection {w['full_ms']:.1f} ms", flush=True)
        for label, ws in rows.items():
            med = {"gc": statistics.median(sum(w["ms"]) for w in ws), "cpu": statistics.median(w["cpu_us"] for w in ws),
                   "tracked": statistics.median(w["tracked"] for w in ws), "full": statistics.median(w["full_ms"] for w in ws)}
            print(f"median {label} ({len(ws)} workers): collections {med['gc']:.1f} ms per epoch, CPU {med['cpu']:.1f} us per sample, "
                  f"{med['tracked']:.0f} tracked at the end, full collection {med['full']:.1f} ms")
    finally:
        bench.unmount(mnt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
