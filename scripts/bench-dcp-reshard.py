#!/usr/bin/env python3
"""Resharded DCP loads against the matched load, in one run, on a host-engine mount (issue 14.2).

Usage: bench-dcp-reshard.py [--mib 1024] [--tensor-mib 32] [--reps 5] [--mount MNT --source SRC]
                            [--profile] [--pkg DIR] [--json PATH]

Saves one bf16 state dict (rows of 4096 elements, tensors of TENSOR_MIB) with GDSFileSystemWriter
twice: by 1 rank (the whole tensors, one data file) and by 2 ranks as Shard(0) (the halves, one
data file per rank), then loads, interleaved, REPS times each, with GDSFileSystemReader:

- matched 1 -> 1:   the 1-rank checkpoint into whole tensors (what dcp_check.py calls matched);
- matched 2 -> 2:   the 2-rank checkpoint, each rank's half into a half (rank 0, then rank 1);
- Shard(0) 2 -> 1:  the 2-rank checkpoint into whole tensors (Replicate, Shard(0) on 1 rank and
                    plain targets all make these ReadItems on one rank);
- Shard(0) 1 -> 2:  the 1-rank checkpoint, rank 0's half, then rank 1's;
- Shard(0) -> Shard(1), 2 -> 2: the 2-rank checkpoint into column halves (a span read and a copy).

Rates are payload / wall time of dcp.load's calls (read_metadata, set_up_storage_reader, read_data;
the planner's ReadItems are made before the clock starts, as torch 2.11's planner makes them),
best and median of REPS; ratios are of medians to matched 1 -> 1 of the same run. Every gdsfs load
is compared byte for byte with the stock reader's (loaded once per case). Without a real
torch.distributed.checkpoint (torch 1.x) it runs against python/tests/_dcp_standin. Warm page cache.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "python", "tests"))
# --pkg DIR (parsed here, before gdsfs is imported): the gdsfs package of another tree, for an A/B.
if "--pkg" in sys.argv:
    sys.path.insert(0, sys.argv[sys.argv.index("--pkg") + 1])
sys.path.insert(0, HERE)

import torch  # noqa: E402

import _dcp_standin as S  # noqa: E402

if S.has_real_dcp():
    print("bench-dcp-reshard: this torch has a real torch.distributed.checkpoint: use scripts/gpu/dcp_check.py "
          "(this script drives the stand-in's calls)", file=sys.stderr)
    sys.exit(2)
S.install()
import gdsfs.dcp as gdcp  # noqa: E402

Chunk = S.Chunk


def halves(shape: tuple[int, int], dim: int) -> list[Chunk]:
    n = shape[dim] // 2
    if dim == 0:
        return [((0, 0), (n, shape[1])), ((n, 0), (shape[0] - n, shape[1]))]
    return [((0, 0), (shape[0], n)), ((0, n), (shape[0], shape[1] - n))]


def piece(t: torch.Tensor, c: Chunk) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(*c)):
        t = t.narrow(d, o, n)
    return t


def save(d: str, tensors: dict[str, torch.Tensor], chunks: list[Chunk]) -> None:
    per_rank = [{fqn: {c: piece(t, c).contiguous()} for fqn, t in tensors.items()} for c in chunks]
    S.save_ranks(per_rank, lambda r: gdcp.GDSFileSystemWriter(d))


def load_once(reader: Any, tensors: dict[str, torch.Tensor], saved: list[Chunk], local: Chunk,
              prof: cProfile.Profile | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    targets = {fqn: torch.empty(local[1], dtype=t.dtype) for fqn, t in tensors.items()}
    for t in targets.values():
        t.fill_(0)  # touched first, as a model's parameters are
    items = [it for fqn in tensors for it in S.read_items(fqn, saved, local)]
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    S.load_items(targets, items, reader)
    if prof is not None:
        prof.disable()
    return time.perf_counter() - t0, targets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024, help="state dict size in MiB (default 1024)")
    ap.add_argument("--tensor-mib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mount", help="an existing host-mode gdsfs mount (with --source: the directory it serves)")
    ap.add_argument("--source")
    ap.add_argument("--mount-flags", default="", help="extra flags for the mount this script makes (e.g. '--host-pool 4GiB')")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each case's loads")
    ap.add_argument("--cases", help="only the cases whose names contain one of these comma-separated words "
                                    "(e.g. 'matched 1,2 -> 1'); the first case kept is the reference")
    ap.add_argument("--pkg", help="import gdsfs from this directory (another tree's python/) instead of this tree's")
    ap.add_argument("--json")
    a = ap.parse_args()

    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    bd = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bd)
    base = None
    if a.mount:
        mnt = a.mount
    else:
        base = tempfile.mkdtemp(prefix="bench-dcp-reshard-")
        _src, mnt = bd.own_mount(base, flags=tuple(a.mount_flags.split()))
    work = os.path.join(mnt, "bench-dcp-reshard")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        cols = 4096
        rows = (a.tensor_mib << 20) // (2 * cols)
        n = max(1, (a.mib << 20) // (rows * cols * 2))
        shape = (rows, cols)
        g = torch.Generator().manual_seed(0)
        tensors = {f"layers.{i}.weight": torch.randint(-32768, 32767, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
                   for i in range(n)}
        payload = n * rows * cols * 2
        whole: list[Chunk] = [((0, 0), shape)]
        d1, d2 = os.path.join(work, "one-rank"), os.path.join(work, "two-ranks")
        t = time.perf_counter()
        save(d1, tensors, whole)
        save(d2, tensors, halves(shape, 0))
        print(f"bench-dcp-reshard: gdsfs from {os.path.dirname(os.path.dirname(gdcp.__file__))}: {n} bf16 tensors of {a.tensor_mib} MiB ({payload / 2**20:.0f} MiB), "
              f"saved by 1 and 2 ranks in {time.perf_counter() - t:.1f} s: {sorted(os.listdir(d1))} {sorted(os.listdir(d2))}")
        # (name, dir, saved chunks, the loading ranks' local chunks: each rank's load in turn)
        cases = [
            ("matched 1 -> 1", d1, whole, whole),
            ("matched 2 -> 2", d2, halves(shape, 0), halves(shape, 0)),
            ("Shard(0) 2 -> 1 (Replicate)", d2, halves(shape, 0), whole),
            ("Shard(0) 1 -> 2", d1, whole, halves(shape, 0)),
            ("Shard(0) -> Shard(1), 2 -> 2", d2, halves(shape, 0), halves(shape, 1)),
        ]
        if a.cases:
            cases = [c for c in cases if any(w.strip() in c[0] for w in a.cases.split(","))]
        # Byte-equality with the stock reader, once per case (its loads are slow: not timed).
        for name, d, saved, locals_ in cases:
            for local in locals_:
                _, ref = load_once(S.FileSystemReader(d), tensors, saved, local)
                _, got = load_once(gdcp.GDSFileSystemReader(d, strict=True), tensors, saved, local)
                for fqn in tensors:
                    want = piece(tensors[fqn], local)
                    if not (torch.equal(got[fqn].view(torch.int16), ref[fqn].view(torch.int16))
                            and torch.equal(got[fqn].view(torch.int16), want.contiguous().view(torch.int16))):
                        raise AssertionError(f"{name}: {fqn} differs from the stock reader's or the saved bytes")
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        profs = {c[0]: cProfile.Profile() for c in cases} if a.profile else {}
        for r in range(a.reps):
            order = cases if r % 2 == 0 else cases[::-1]
            for name, d, saved, locals_ in order:
                total = 0.0
                for local in locals_:
                    secs, _ = load_once(gdcp.GDSFileSystemReader(d, strict=True), tensors, saved, local, profs.get(name))
                    total += secs
                times[name].append(total)
        med0 = statistics.median(times[cases[0][0]])
        out = {}
        print(f"{'case':34s} {'best GB/s':>10s} {'median GB/s':>12s} {'x matched':>10s}   (ms per load)")
        for name, *_ in cases:
            ts = times[name]
            med = statistics.median(ts)
            out[name] = {"best_gbs": payload / min(ts) / 1e9, "median_gbs": payload / med / 1e9, "ratio": med0 / med,
                         "ms": [round(x * 1e3, 1) for x in ts]}
            print(f"{name:34s} {payload / min(ts) / 1e9:10.2f} {payload / med / 1e9:12.2f} {med0 / med:9.2f}x   "
                  + " ".join(f"{x * 1e3:.0f}" for x in ts))
        print("bench-dcp-reshard: every gdsfs load byte-equal to the stock reader's")
        if a.profile:
            for name, p in profs.items():
                print(f"--- profile: {name} ({a.reps} reps)")
                pstats.Stats(p).sort_stats("cumulative").print_stats(18)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"payload": payload, "cases": out}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if base is not None:
            bd.unmount(mnt)
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
