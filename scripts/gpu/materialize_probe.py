#!/usr/bin/env python3
"""Where GDSBatch.materialize's time goes per batch in the loop of gdsfs.torch.DataLoader, without
a daemon (issue 15, 16 KiB: the 18:45 GPU run's "materialize in the loop" was ~190 us per batch
of 16 whatever the sample size, while the same call costs ~15 us of Python plus the copy on the
CPU machine's host engine).

Usage: materialize_probe.py [--batches 2000] [--kib 16] [--batch 16] [--cpu] [--bin build/gpu/gdsfs]

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
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
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


def _real(bin_path: str, cpu: bool, kib: int, rows: int, reps: int, dev: Any, pin: bool) -> None:
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
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(reps):
                step()
            pr.disable()
            out.clear()
            print(f"materialize_probe: real slab ({dev_of}, engine {x.leases[0].engine}), {label} ({leases} leases in the first): "
                  f"the loop's materialize {us:.1f} us per batch")
            _top(pr, reps, f"real slab, {label}")
            for b in bs:
                b.release()
            x = None
            ds.close()
    finally:
        for c in ([bin_path, "unmount", mnt], ["umount", "-l", mnt]):
            if os.path.ismount(mnt):
                subprocess.run(c, capture_output=True, timeout=30)
        if not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)


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
        _real(a.bin, not cuda, a.kib, rows, reps, dev, pin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
