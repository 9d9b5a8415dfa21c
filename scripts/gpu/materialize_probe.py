#!/usr/bin/env python3
"""Where GDSBatch.materialize's time goes per batch in the loop of gdsfs.torch.DataLoader, without
a daemon (issue 15, 16 KiB: the 18:45 GPU run's "materialize in the loop" was ~190 us per batch
of 16 whatever the sample size, while the same call costs ~15 us of Python plus the copy on the
CPU machine's host engine).

Usage: materialize_probe.py [--batches 2000] [--kib 16] [--batch 16] [--cpu] [--gap-us 500]
       [--bin build/gpu/gdsfs [--loop-workers 8]]

A stand-in slab (a 64 MiB uint8 tensor on cuda:0; --cpu: in host memory) replaces the daemon's:
gdsfs._tensors._slab_of is patched to return it, the batches' leases have no Hold (nothing to
check or release), so what is timed is exactly the loop's call,
``b.materialize(cuda:0, pin=True, _defer=True, _parsed=True, _record=False)`` (gdsfs._tensors.settled),
on a batch shaped as a worker sends it at 16 KiB: ``__key__``, ``__url__`` (lists), ``x.npy``
(float32, one lease shared by the batch's samples at evenly spaced starts, or a lease per sample
at uneven starts) and ``cls`` (a CPU int64 tensor of the batch). Printed, us per batch (median of
rounds): the whole call for each batch shape; the torch calls it makes, alone (the typed strided
clone, the pin of the small CPU tensor, torch.cuda.is_available, is_pinned); then cProfile's top
functions of the shared-lease call by own time. No GPU memory beyond ~100 MiB; ~10 s.

--bin GDSFS: also the same calls on batches of a real slab: the probe mounts a temp dir with
that binary (its default engine; --cpu: the host engine), writes a tar of 16 KiB samples, reads
64 batches as a gdsfs.torch.DataLoader worker does (one lease per batch; a lease per sample), and
times materialize on them over and over (deferred, never settled: the leases stay held until
the end), so a slab the daemon exported (CUDA VMM/IPC) can be told from a plain CUDA tensor.

--gap-us (default 500): also the same calls one at a time, each after that long a sleep or that
much other work (pickling, a 1 MiB copy). The loop calls materialize once per batch, its thread
idle or busy elsewhere in between, so the CPU's caches and branch predictors are cold for the
call; back to back they are hot (on the CPU test machine the same call on the same batch costs
2.5-4x more after a 500 us sleep: that, and the slab's bytes not being in cache, is the whole gap
between this probe's figure and the main profile's "materialize in the loop").

--loop-workers N (with --bin): also, in the real loader's main process (gdsfs.torch.DataLoader, N
workers, over the temp mount's tar), per batch: the loop's own call, the same call again on the
same batch, and the stand-in batch's call, made right where the loop makes its own.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pickle
import pstats
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import torch  # noqa: E402

from gdsfs import _core, _tensors  # noqa: E402


def _column(slab_dev: int, starts: list[int], offsets: list[int], n: int) -> Any:
    """A _RefColumn of len(starts) float32 samples of n bytes: one Ref per distinct offset
    (offsets[i]: sample i's lease offset in the slab), no Holds."""
    leases: list[Any] = []
    at: dict[int, int] = {}
    idx = []
    for off, st in zip(offsets, starts):
        if off not in at:
            at[off] = len(leases)
            valid = max(s for o, s in zip(offsets, starts) if o == off) + n
            leases.append(_core.Ref("/probe", 1, 1, 1, 100 + len(leases), 1, off, valid, valid, slab_dev, "probe"))
        idx.append(at[off])
    col = _tensors._RefColumn.__new__(_tensors._RefColumn)
    col._refs = None
    col.leases = leases
    col.holds = [None] * len(leases)
    col.geos = [(torch.float32, (n // 4,), False)]
    col.idx, col.gidx, col.starts = idx, [0] * len(starts), list(starts)
    col.fields = ["x.npy"] * len(starts)
    col.samples = [f"{i:06d}" for i in range(len(starts))]
    col.paths = ["/probe/shard.tar"] * len(starts)
    return col


def _timed(fn: Callable[[], Any], reps: int, rounds: int = 5) -> float:
    """Median over rounds of the mean us per call of fn (a CUDA sync after each round)."""
    meds = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        meds.append((time.perf_counter() - t) / reps * 1e6)
    return statistics.median(meds)


def _busy(seconds: float, junk: list[Any], buf: bytearray) -> None:
    """About seconds of other work in this thread: pickling small containers and copying 1 MiB
    (what the loop's thread does between two materializes: unpickle the next batch, settle)."""
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        pickle.loads(pickle.dumps(junk))
        buf[: 1 << 20] = buf[1 << 20 : 2 << 20]


def _gapped(fn: Callable[[], Any], reps: int, gap: str, gap_s: float, rounds: int = 5) -> float:
    """Median us of one call of fn (its CPU side: the copies it queues on CUDA are waited for
    before the next gap, untimed) when each call follows gap_s of sleep (gap "sleep": the loop's
    thread waiting for the next batch) or of other work (gap "busy", _busy), the gap untimed. A
    loop calls materialize once per batch with its thread idle or busy elsewhere in between: the
    CPU's caches and predictors are cold for it, unlike _timed's calls back to back."""
    junk: list[Any] = [{"k": [str(i) * 10 for i in range(50)], "v": list(range(200))} for _ in range(3)]
    buf = bytearray(2 << 20)
    per: list[float] = []
    for _ in range(rounds):
        for _ in range(reps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the last call's copies done, before the gap: not timed
            if gap == "sleep":
                time.sleep(gap_s)
            else:
                _busy(gap_s, junk, buf)
            t = time.perf_counter()
            fn()
            per.append(time.perf_counter() - t)
    return statistics.median(per) * 1e6


def _real(bin_path: str, cpu: bool, kib: int, rows: int, reps: int, dev: Any, pin: bool, gap_s: float = 0.0,
          loop_workers: int = 0, stand: Any = None) -> None:
    """The loop's materialize on batches of a real slab (see --bin), then unmount."""
    import numpy as np

    import gdsfs.torch as gt

    base = tempfile.mkdtemp(prefix="gdsfs-matprobe-")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.makedirs(src)
    os.makedirs(mnt)
    cmd = [bin_path, "mount", "--background", "--source", src, "--log-file", os.path.join(base, "daemon.log"), mnt] + (["--engine", "host"] if cpu else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        print(f"materialize_probe: real slab: mount failed: {r.stderr.strip()}")
        return
    try:
        rng = np.random.default_rng(16)
        truth: dict[str, bytes] = {}
        with tarfile.open(os.path.join(src, "s.tar"), "w") as tf:
            for i in range(64 * rows * 2):
                b = io.BytesIO()
                arr = rng.standard_normal((kib << 10) // 4, dtype=np.float32)
                if i < 64 * rows:
                    truth[f"{i:06d}"] = arr.tobytes()
                np.save(b, arr)
                for ext, data in (("cls", str(i % 1000).encode()), ("x.npy", b.getvalue())):
                    ti = tarfile.TarInfo(f"{i:06d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        for label, batched in (("one lease per batch", rows), ("a lease per sample", 0)):
            ds = gt.GDSShardDataset([os.path.join(mnt, "s.tar")], gpu_keys=["x.npy"], strict=True, read_ahead=64)
            ds._batched = batched  # as gdsfs.torch.DataLoader tells its workers' copies
            it = iter(ds)
            import itertools

            bs = [gt.collate(list(itertools.islice(it, rows))) for _ in range(64)]
            it.close()
            out: list[Any] = []

            def one(b: Any) -> None:
                m = b.materialize(dev, pin=pin, _defer=True, _parsed=True, _record=False)
                if m._pending is not None:  # never settled: no release, no wait when dropped
                    m._pending.holds, m._pending.devices = [], []
                out.append(m)

            k = [0]

            def step() -> None:
                one(bs[k[0] % len(bs)])
                k[0] += 1
                if len(out) >= 256:
                    out.clear()

            got = bs[0].materialize(dev, pin=pin, _defer=True, _parsed=True, _record=False)
            if got._pending is not None:
                got._pending.holds, got._pending.devices = [], []
            xs = got["x.npy"].cpu()
            assert [xs[i].numpy().tobytes() for i in range(rows)] == [truth[k] for k in got["__key__"]], "real slab: wrong bytes"
            del got, xs
            x = bs[0]["x.npy"]
            leases = len(x.leases)
            dev_of = "cuda" if x.leases[0].device >= 0 else "host"
            us = _timed(step, reps)
            gapped = ""
            if gap_s > 0:
                greps = max(1, min(reps, int(1.0 / 5 / gap_s)))
                gapped = (f"; one after each {gap_s * 1e6:g} us gap: after sleep {_gapped(step, greps, 'sleep', gap_s):.1f}, "
                          f"after other work {_gapped(step, greps, 'busy', gap_s):.1f}")
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(reps):
                step()
            pr.disable()
            out.clear()
            print(f"materialize_probe: real slab ({dev_of}, engine {x.leases[0].engine}), {label} ({leases} leases in the first): "
                  f"the loop's materialize {us:.1f} us per batch{gapped}")
            _top(pr, reps, f"real slab, {label}")
            for b in bs:
                b.release()
            x = None
            ds.close()
        if loop_workers > 0 and stand is not None:
            _in_loop(mnt, rows, loop_workers, not cpu, stand)
    finally:
        for c in ([bin_path, "unmount", mnt], ["umount", "-l", mnt]):
            if os.path.ismount(mnt):
                subprocess.run(c, capture_output=True, timeout=30)
        if not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)


def _in_loop(mnt: str, rows: int, workers: int, cuda: bool, stand: Any, epochs: int = 3) -> None:
    """In the real loader's main process (gdsfs.torch.DataLoader over mnt/s.tar, persistent workers,
    pin_memory on CUDA), per batch: the loop's materialize (its first call on the batch), the same
    call again on the same batch, then the stand-in batch stand (a GDSBatch over the stand-in slab,
    no Holds); medians over epochs after a warm-up one. The second call and the stand-in's are the
    probe's own call, made where the loop makes its own: what the loop adds over them is the
    first call's cold caches, not gdsfs's lookups (issue 15, 16 KiB)."""
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset([os.path.join(mnt, "s.tar")], gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=rows, num_workers=workers, pin_memory=cuda, collate_fn=gt.collate, persistent_workers=True, timeout=300)
    times: dict[str, list[float]] = {"first call": [], "same call again": [], "stand-in batch": [], "first call's CPU time": []}
    real = _tensors.GDSBatch.materialize
    real_slab_of = _tensors._slab_of
    slab, sb = stand
    on = [False]

    def mat(self: Any, *a: Any, **kw: Any) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        got = real(self, *a, **kw)
        t1, c1 = time.perf_counter(), time.thread_time()
        if not on[0]:
            return got
        again = real(self, *a, **kw)
        t2 = time.perf_counter()
        if again._pending is not None:  # the first call's pending settles the leases
            again._pending.holds, again._pending.devices = [], []
        _tensors._slab_of = lambda r, h, slabs: slab  # type: ignore[assignment]
        try:
            t3 = time.perf_counter()
            real(sb, *a, **kw)
            t4 = time.perf_counter()
        finally:
            _tensors._slab_of = real_slab_of  # type: ignore[assignment]
        for k, v in zip(times, (t1 - t, t2 - t1, t4 - t3, c1 - c)):
            times[k].append(v)
        return got

    _tensors.GDSBatch.materialize = mat  # type: ignore[method-assign]
    try:
        for _b in dl:  # warm-up epoch: workers started, slabs mapped
            pass
        on[0] = True
        for _ in range(epochs):
            for _b in dl:
                pass
    finally:
        _tensors.GDSBatch.materialize = real  # type: ignore[method-assign]
        on[0] = False
        del dl
        ds.close()
    n = len(times["first call"])
    print(f"materialize_probe: in the real loader's main process ({workers} workers, {n} batches; the calls' CPU side, as the main profile's), "
          "us per batch (median): " + "; ".join(f"{k} {statistics.median(v) * 1e6:.1f}" for k, v in times.items() if v))


def _top(pr: cProfile.Profile, reps: int, what: str, n: int = 12) -> None:
    st = pstats.Stats(pr)
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:n]  # type: ignore[attr-defined]
    print(f"materialize_probe: cProfile of {reps} calls ({what}), top by own time (us per batch: own, cumulative; calls per batch):")
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in top:
        print(f"materialize_probe:   {os.path.basename(fn)}:{line}({name}) {tt / reps * 1e6:.1f} {ct / reps * 1e6:.1f} {nc / reps:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--kib", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--cpu", action="store_true", help="host-memory stand-in slab, CPU target, no pinning (runs without a GPU)")
    ap.add_argument("--gap-us", type=float, default=500,
                    help="also time the calls one at a time, each after this many us of sleep or of other work (0: not)")
    ap.add_argument("--loop-workers", type=int, default=0,
                    help="with --bin: also time the calls in the real loader's main process with this many workers (0: not)")
    ap.add_argument("--bin", help="also time batches of a real slab: a temp mount with this gdsfs binary")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.cpu
    dev = torch.device("cuda", 0) if cuda else None
    slab = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device=dev or "cpu")  # bytes that tell rows apart
    real_slab_of = _tensors._slab_of
    _tensors._slab_of = lambda r, h, slabs: slab  # type: ignore[assignment]
    n = a.kib << 10
    step = n + 2048  # a tar's headers and the .cls member between two samples
    rows = a.batch
    shared = _column(0 if cuda else -1, [k * step for k in range(rows)], [4096] * rows, n)
    # A lease per sample at uneven offsets (what an in-process iteration or a stock DataLoader sends).
    per = _column(0 if cuda else -1, [0] * rows, [(1 << 20) + k * (n + 4096) + (2048 if k % 2 else 0) for k in range(rows)], n)
    cls = torch.tensor([k % 1000 for k in range(rows)])

    def batch(col: Any) -> Any:
        return _tensors.GDSBatch({"__key__": [f"{k:06d}" for k in range(rows)], "__url__": ["/probe/shard.tar"] * rows, "x.npy": col, "cls": cls},
                                 gpu_fields=("x.npy",))

    bs, bp = batch(shared), batch(per)
    bx = _tensors.GDSBatch({"__key__": bs["__key__"], "x.npy": shared}, gpu_fields=("x.npy",))
    pin = cuda

    def mat(b: Any) -> Callable[[], Any]:
        return lambda: b.materialize(dev, pin=pin, _defer=True, _parsed=True, _record=False)

    # The bytes first: each row is its sample's.
    for b in (bs, bp):
        x = mat(b)()["x.npy"].cpu()
        for k in range(rows):
            r = b["x.npy"].leases[b["x.npy"].idx[k]]
            at = r.offset + b["x.npy"].starts[k]
            assert torch.equal(x[k].view(torch.uint8), slab[at : at + n].cpu()), f"row {k} is not its sample's bytes"
    reps = max(1, a.batches // 5)
    where = f"{'cuda:0' if cuda else 'cpu'}, torch {torch.__version__}, batch {rows} x {a.kib} KiB float32 + cls"
    print(f"materialize_probe: {where}; us per batch (median of 5 rounds of {reps})")
    print(f"materialize_probe: the loop's materialize: shared lease {_timed(mat(bs), reps):.1f}; a lease per sample {_timed(mat(bp), reps):.1f}; "
          f"shared lease without cls {_timed(mat(bx), reps):.1f}")
    if a.gap_us > 0:
        g = a.gap_us / 1e6
        greps = max(1, min(reps, int(1.0 / 5 / g)))  # about a second per figure
        cases = [("shared lease", mat(bs)), ("clone of the typed view alone", lambda: typed0.clone(memory_format=torch.contiguous_format))]
        typed0 = _tensors._typed_run(shared)
        print(f"materialize_probe: the same calls, one after each {a.gap_us:g} us gap (median of {5 * greps} calls; the loop's thread "
              "idles or works between two batches): " + "; ".join(
                  f"{name}: after sleep {_gapped(fn, greps, 'sleep', g):.1f}, after other work {_gapped(fn, greps, 'busy', g):.1f}"
                  for name, fn in cases))
    typed = _tensors._typed_run(shared)
    parts = [("typed strided view (as_strided)", lambda: _tensors._typed_run(shared)),
             ("its clone", lambda: typed.clone(memory_format=torch.contiguous_format)),
             ("torch.cuda.is_available()", torch.cuda.is_available)]
    if cuda:
        pinned = cls.pin_memory()
        parts += [("cls.pin_memory()", cls.pin_memory), ("cls.is_pinned()", cls.is_pinned), ("pinned.is_pinned()", pinned.is_pinned),
                  ("torch.empty(16, int64, pin_memory=True)", lambda: torch.empty(rows, dtype=torch.int64, pin_memory=True)),
                  ("typed.device", lambda: typed.device), ("torch.cuda.current_device()", torch.cuda.current_device)]
    print("materialize_probe: its torch calls alone: " + "; ".join(f"{name} {_timed(fn, reps):.1f}" for name, fn in parts))
    pr = cProfile.Profile()
    f = mat(bs)
    pr.enable()
    for _ in range(reps):
        f()
    pr.disable()
    if cuda:
        torch.cuda.synchronize()
    _top(pr, reps, "stand-in slab, shared lease", 14)
    _tensors._slab_of = real_slab_of  # type: ignore[assignment]
    if a.bin:
        _real(a.bin, not cuda, a.kib, rows, reps, dev, pin, a.gap_us / 1e6, a.loop_workers, (slab, bs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
