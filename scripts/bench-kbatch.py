#!/usr/bin/env python3
"""Host-engine benchmark: the main process's cost per batch with k batches per worker item
(issue 15, 16 KiB samples; gdsfs.torch.DataLoader's batches_per_item).

Usage: bench-kbatch.py [--kib 16] [--batch 16] [--workers 2] [--samples 8192] [--rounds 5]
                       [--k 1,auto] [--loop copies] [--loop-alone ITEMS] [--engine host] [--pin]
                       [--mount MNT --source SRC]

Writes WebDataset tars of float32 .npy samples (plus a .cls) on a host-mode gdsfs mount (its own,
in a temp dir, unless --mount), then per round and per batches_per_item value (1: one batch per
torch item, as before; auto: the loader's default; or a number) one pass of a persistent-worker
gdsfs.torch.DataLoader after a warm-up pass, timing in the loop's thread: its CPU per batch
(time.thread_time: what bounds the loader when the workers keep up, as on the GPU machine's 8
workers), the wall time per batch, the wall time of next() (torch's queues plus the loop's
materialize and settle) and the median of the loop's materialize calls (one per batch, or one per
item's run of batches gathered together: divided by the batches it made). --loop: how the loop
materializes an item of k > 1 batches, per value a pass: copies (the default, as the loader
does: the item's run of batches found once, a copy per batch), views (_tensors.ITEM_VIEWS: one
copy per field per run, each batch a view of its rows) or per-batch (each batch materialized
alone, as before the item path). --loop-alone ITEMS: instead, the loop alone (loop_alone).
--engine auto --pin on a GPU machine: the mount's default engine (CUDA slabs) and
pin_memory=True (the loop copies the gpu fields on the GPU). Prints each round and the
medians; the values of k and --loop alternate within a round, so a busy box loads them alike.
Exits non-zero only when a pass loses or repeats a sample.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))


def log(msg: str) -> None:
    print(f"bench-kbatch: {msg}", flush=True)


def make_tars(d: str, kib: int, nsamples: int, nshards: int = 8) -> list[str]:
    """bench-dataset.py's tars (float32 .npy plus .cls), named relative to d."""
    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return [os.path.basename(p) for p in mod.make_tars(d, kib, nsamples, nshards)]


_CALLS: list[float] = []  # each batch's share of the loop's materialize calls, seconds (timed_materialize)
LOOPS = ("copies", "views", "per-batch")


def timed_materialize() -> None:
    """Time the loop's GDSBatch.materialize calls (one per batch) and its item path's
    _materialize_segment calls (one per run of batches: its time divided among them), into _CALLS."""
    from gdsfs import _tensors

    real = _tensors.GDSBatch.materialize
    real_seg = _tensors._materialize_segment

    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real(self, *args, **kw)
        finally:
            _CALLS.append(time.perf_counter() - t)

    def seg(bs: Any, *args: Any) -> Any:
        t = time.perf_counter()
        out = real_seg(bs, *args)
        if out is not None:
            _CALLS.extend([(time.perf_counter() - t) / len(out)] * len(out))
        return out

    _tensors.GDSBatch.materialize = wrapper  # type: ignore[method-assign]
    _tensors._materialize_segment = seg


def loop_mode(mode: str) -> None:
    """How the loop materializes items of several batches (--loop)."""
    from gdsfs import _tensors

    if not hasattr(_tensors, "_real_item_segments"):
        _tensors._real_item_segments = _tensors._item_segments  # type: ignore[attr-defined]
    _tensors._item_segments = (lambda parts: {}) if mode == "per-batch" else _tensors._real_item_segments  # type: ignore[attr-defined]
    _tensors.ITEM_VIEWS = frozenset({"cpu", "cuda"}) if mode == "views" else frozenset()


def one_pass(dl: Any, nsamples: int, mode: str = "copies") -> dict[str, float]:
    loop_mode(mode)
    seen: set[str] = set()
    _CALLS.clear()
    nb = 0
    nxt = 0.0
    it = iter(dl)
    c0, t0 = time.thread_time(), time.perf_counter()
    while True:
        a = time.perf_counter()
        try:
            b = next(it)
        except StopIteration:
            break
        nxt += time.perf_counter() - a
        nb += 1
        seen.update(b["__key__"])
    c1, t1 = time.thread_time(), time.perf_counter()
    if len(seen) != nsamples:
        raise RuntimeError(f"a pass delivered {len(seen)} distinct samples of {nsamples}")
    calls = sorted(_CALLS)
    return {"mat_us": calls[len(calls) // 2] * 1e6 if calls else 0.0, "cpu_us": (c1 - c0) / nb * 1e6, "wall_us": (t1 - t0) / nb * 1e6,
            "next_us": nxt / nb * 1e6, "sps": nsamples / (t1 - t0), "batches": nb}


def loop_alone(shards: list[str], batch: int, k: int, modes: list[str], reps: int, pin: bool = False) -> None:
    """--loop-alone: the loop's materialize and settle of one item of k batches, in this process
    without workers (no worker competes for the CPU): items read as a worker reads them (chunks
    of whole items, one range per field per shard for an item's samples: GDSShardDataset._runs),
    collated and passed through pickle as a worker's are, then timed (time.thread_time) through _tensors.settled, the
    --loop values alternating item by item. Prints the median per batch of each."""
    import pickle

    import gdsfs.torch as gt
    from gdsfs import _tensors

    import torch

    dev = torch.device("cuda", torch.cuda.current_device()) if pin else None
    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    ds._batched = k * batch  # as in a DataLoader worker that sends items of k batches
    src = iter(())
    times: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(reps):
        for mode in modes:
            samples = list(itertools.islice(src, k * batch))
            if len(samples) < k * batch:
                src = iter(ds)
                samples = list(itertools.islice(src, k * batch))
            item = _tensors._Batches(pickle.loads(pickle.dumps(gt.collate(samples[i : i + batch]), protocol=pickle.HIGHEST_PROTOCOL))
                                     for i in range(0, k * batch, batch))
            del samples
            loop_mode(mode)
            c = time.thread_time()
            out = list(_tensors.settled(iter([item]), pin=pin, device=dev, ready=lambda: False))
            times[mode].append((time.thread_time() - c) / len(out) * 1e6)
            del out, item
    del src
    ds.close()
    base = statistics.median(times[modes[0]])
    for m in modes:
        med = statistics.median(times[m])
        log(f"  loop alone, k={k} {m}: {med:.1f} us per batch ({med / base:.2f}x of {modes[0]}; {reps} items each)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", default="1,auto", help="batches_per_item values, comma-separated (auto: the default)")
    ap.add_argument("--engine", default="host", help="the mount's --engine (default host; auto on a GPU machine)")
    ap.add_argument("--pin", action="store_true", help="pin_memory=True: with CUDA the loop copies the gpu fields to the GPU")
    ap.add_argument("--loop", default="copies", help=f"how an item of k > 1 batches is materialized, comma-separated: {', '.join(LOOPS)}")
    ap.add_argument("--mount")
    ap.add_argument("--source")
    ap.add_argument("--loop-alone", type=int, default=0, metavar="ITEMS",
                    help="instead: time the loop alone over ITEMS items of the largest --k per --loop value (loop_alone)")
    a = ap.parse_args()

    import gdsfs.torch as gt
    from gdsfs import _tensors

    timed_materialize()
    ks: list[Optional[int]] = [None if x.strip() == "auto" else int(x) for x in a.k.split(",") if x.strip()]
    modes = [x.strip() for x in a.loop.split(",") if x.strip()]
    bad = [m for m in modes if m not in LOOPS]
    if bad or not modes:
        ap.error(f"--loop {a.loop!r}: name one or more of {', '.join(LOOPS)}")
    base = tempfile.mkdtemp(prefix="gdsfs-bench-kbatch-")
    mounted = None
    binary = os.environ.get("GDSFS_BIN") or os.path.join(ROOT, "bin", "gdsfs")
    try:
        if a.mount:
            src, mnt = a.source, a.mount
        else:
            src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
            os.makedirs(src)
            os.makedirs(mnt)
            r = subprocess.run([binary, "mount", "--source", src, "--engine", a.engine, "--background", "--log-file",
                                os.path.join(base, "daemon.log"), mnt], capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                log(f"mount failed: {r.stderr.strip()}")
                return 2
            mounted = mnt
        sub = f"kbatch-{os.getpid()}"
        names = make_tars(os.path.join(src, sub), a.kib, a.samples)
        shards = [os.path.join(mnt, sub, n) for n in names]
        nsamples = a.samples - a.samples % 8
        if a.loop_alone:
            kmax = max(k or _tensors.KBATCH_MAX for k in ks)
            log(f"the loop alone ({a.kib} KiB samples, batch {a.batch}, items of {kmax} batches):")
            loop_alone(shards, a.batch, kmax, modes, a.loop_alone, a.pin)
            return 0
        rows: dict[str, list[dict[str, float]]] = {}
        loaders = []
        for k in ks:
            ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
            dl = gt.DataLoader(ds, batch_size=a.batch, num_workers=a.workers, persistent_workers=True, timeout=120, batches_per_item=k,
                               pin_memory=a.pin)
            one_pass(dl, nsamples)  # warm-up: workers, page and index caches, slabs mapped
            for mode in (modes if dl._kbatch > 1 else modes[:1]):
                loaders.append((k, mode, ds, dl))
        for rnd in range(a.rounds):
            for k, mode, _ds, dl in loaders:
                r = one_pass(dl, nsamples, mode)
                name = f"k={dl._kbatch}" + (" (auto)" if k is None else "") + (f" {mode}" if dl._kbatch > 1 and len(modes) > 1 else "")
                rows.setdefault(name, []).append(r)
                log(f"round {rnd + 1} {name}: loop thread CPU {r['cpu_us']:.0f} us per batch, wall {r['wall_us']:.0f} us per batch "
                    f"(next() {r['next_us']:.0f}; materialize median {r['mat_us']:.0f}), {r['sps']:,.0f} samples/s")
        log(f"medians of {a.rounds} rounds ({a.kib} KiB samples, batch {a.batch}, {a.workers} workers, {nsamples} samples a pass):")
        base_cpu = statistics.median(x["cpu_us"] for x in next(iter(rows.values())))
        for name, rs in rows.items():
            cpu = statistics.median(x["cpu_us"] for x in rs)
            log(f"  {name}: loop thread CPU {cpu:.0f} us per batch ({cpu / base_cpu:.2f}x of the first), wall "
                f"{statistics.median(x['wall_us'] for x in rs):.0f} us, next() {statistics.median(x['next_us'] for x in rs):.0f} us, "
                f"materialize {statistics.median(x['mat_us'] for x in rs):.0f} us, "
                f"{statistics.median(x['sps'] for x in rs):,.0f} samples/s")
        for _k, _mode, ds, dl in loaders:
            if dl._iterator is not None and ds._session is not None:
                dl._iterator._shutdown_workers()
                ds.close()
    finally:
        if mounted:
            for cmd in ([binary, "unmount", mounted], ["umount", "-l", mounted]):
                if os.path.ismount(mounted):
                    subprocess.run(cmd, capture_output=True, timeout=30)
        subprocess.run(["rm", "-rf", base], timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
