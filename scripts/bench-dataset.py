#!/usr/bin/env python3
"""Host-engine benchmark of GDSShardDataset's per-sample path (issue 15).

Usage: bench-dataset.py [--quick] [--sizes 16,64,256] [--workers 0,2] [--batch 16]
                        [--mount MNT --source SRC] [--profile] [--no-main] [--compare PKGDIR] [--cold] [--json PATH]

Writes WebDataset tars of float32 .npy samples (plus a .cls) on a host-mode
gdsfs mount and prints, per sample size and worker count, samples/s and GB/s
of a plain tarfile IterableDataset through the mount and of
GDSShardDataset + gdsfs.torch.DataLoader (batch 16, every batch
materialized), with their ratio measured in the same run. Warm page cache;
each figure is the best of a few passes after a warm-up pass.

Without --mount it mounts one itself (the binary: $GDSFS_BIN, else
bin/gdsfs; as root, or with fusermount3) in a temp dir and unmounts it.
--compare PKGDIR also runs the gdsfs rows with the gdsfs package in PKGDIR
(e.g. an older commit's python/ from `git archive`), in a child process,
and prints after/before ratios. --profile prints where the time of one
process (num_workers=0) goes per sample: planning, the READ and RELEASE
round trips, the lease book, the gather, CPU decoding, and what pickling a
batch from a worker to the main process costs. Per worker count > 0 it
also prints the main process's cost per batch in the real loader (--no-main:
not) as it runs on a GPU machine (torch's pin-memory thread started on a
CPU-only torch where the package uses one: _PinThreadOnCPU): CPU per thread,
the gather's CPU (a kernel launch on a GPU), unpickling, the copy, the
settle and its RELEASE ioctls per batch.

--cold adds the cold page cache: per size, the disk's sequential read rate over
the shards (8 MiB reads, as dd) and a fresh loader's pass with the shards'
pages dropped (posix_fadvise DONTNEED on this run's files only), through the
mount (the daemon reading ahead of sequential READs) and through a second
mount with --readahead 0.

`make bench-dataset` runs it with --quick (a few seconds; CI runs it and
asserts nothing about the figures: they are for review). Exits non-zero only
when the run itself fails (wrong bytes, a missing sample).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pickle
import pstats
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _setup_path(pkg: str) -> None:
    sys.path.insert(0, pkg)


def log(msg: str) -> None:
    print(f"bench-dataset: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# Data and the plain baseline.


def make_tars(d: str, kib: int, nsamples: int, nshards: int = 4) -> list[str]:
    import numpy as np

    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(kib)
    per = nsamples // nshards
    paths = []
    for s in range(nshards):
        p = os.path.join(d, f"shard-{s:03d}.tar")
        with tarfile.open(p, "w") as tf:
            for i in range(per):
                b = io.BytesIO()
                np.save(b, rng.standard_normal((kib << 10) // 4, dtype=np.float32))
                for ext, data in (("cls", str(i % 1000).encode()), ("x.npy", b.getvalue())):
                    ti = tarfile.TarInfo(f"{s:03d}_{i:06d}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        paths.append(p)
    return paths


def plain_dataset(shards: list[str]) -> Any:
    import numpy as np
    import torch
    import torch.utils.data

    class PlainTarDataset(torch.utils.data.IterableDataset):
        """What users write without gdsfs: tarfile, split shards across workers, numpy .npy."""

        def __iter__(self) -> Iterator[dict[str, Any]]:
            wi = torch.utils.data.get_worker_info()
            mine = shards if wi is None else shards[wi.id :: wi.num_workers]
            for p in mine:
                with open(p, "rb", buffering=1 << 20) as f, tarfile.open(fileobj=f, mode="r|") as tf:
                    cur: dict[str, Any] = {}
                    for m in tf:
                        key, _, ext = m.name.partition(".")
                        data = tf.extractfile(m).read()  # type: ignore[union-attr]
                        if cur and cur["__key__"] != key:
                            yield cur
                            cur = {}
                        cur["__key__"] = key
                        cur[ext] = torch.from_numpy(np.load(io.BytesIO(data))) if ext == "x.npy" else int(data)
                    if cur:
                        yield cur

    return PlainTarDataset()


# ----------------------------------------------------------------------------
# Measurements.


def _loader(kind: str, shards: list[str], batch: int, workers: int) -> Any:
    import torch.utils.data

    if kind == "plain":
        return torch.utils.data.DataLoader(plain_dataset(shards), batch_size=batch, num_workers=workers, persistent_workers=workers > 0)
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    return gt.DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=workers > 0)


def _pass(dl: Any) -> tuple[int, int]:
    n = nbytes = 0
    for b in dl:
        x = b["x.npy"]
        n += x.shape[0]
        nbytes += x.numel() * x.element_size()
    return n, nbytes


def measure(kind: str, shards: list[str], batch: int, workers: int, nsamples: int, min_s: float) -> dict[str, Any]:
    """Best samples/s of passes over the shards (a warm-up pass first, then until min_s)."""
    dl = _loader(kind, shards, batch, workers)
    n, _ = _pass(dl)
    if n != nsamples:
        raise RuntimeError(f"{kind}: one pass gave {n} samples, expected {nsamples}")
    best = 0.0
    total = 0.0
    nb = 0
    while total < min_s or best == 0.0:
        t0 = time.perf_counter()
        n, nb = _pass(dl)
        dt = time.perf_counter() - t0
        total += dt
        best = max(best, n / dt)
    ds = getattr(dl, "dataset", None)
    del dl
    if hasattr(ds, "close"):
        ds.close()  # type: ignore[union-attr]
    return {"samples_per_s": best, "GBps": best * nb / nsamples / 1e9}


def check_bytes(shards: list[str], batch: int) -> None:
    """Every sample once, its bytes the file's (num_workers=0)."""
    import numpy as np

    import gdsfs.torch as gt

    want: dict[str, bytes] = {}
    for p in shards:
        with tarfile.open(p) as tf:
            for m in tf:
                if m.name.endswith(".x.npy"):
                    want[m.name[: -len(".x.npy")]] = np.load(io.BytesIO(tf.extractfile(m).read())).tobytes()  # type: ignore[union-attr]
    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    got: dict[str, bytes] = {}
    for b in gt.DataLoader(ds, batch_size=batch):
        for i, k in enumerate(b["__key__"]):
            if k in got:
                raise RuntimeError(f"sample {k} delivered twice")
            got[k] = b["x.npy"][i].numpy().tobytes()
    ds.close()
    if got != want:
        raise RuntimeError(f"{sum(got.get(k) != v for k, v in want.items())} samples differ from the file or are missing")


# Functions whose cumulative time makes the profile's rows (one process: worker and main).
PROFILE_ROWS = [
    ("planning (fields, npy headers, groups)", ("_dataset.py", "_emit"), ("_dataset.py", "_read_group")),
    ("READ round trip", ("_core.py", "_read_chunk"), None),
    ("lease book: take (hold, hold_many)", ("_leases.py", "hold"), None),
    ("gather (slab views, stack)", ("_tensors.py", "_gather"), None),
    ("release: RELEASE round trip", ("_core.py", "_release_ids"), None),
    ("release: lease book", ("_leases.py", "release"), ("_core.py", "_release_ids")),
    ("CPU field decode (.cls)", ("_dataset.py", "_decode_cpu"), None),
    ("collate", ("_collate.py", "collate"), None),
]


def profile(shards: list[str], batch: int, nsamples: int) -> list[tuple[str, float]]:
    """(row, microseconds per sample) of a num_workers=0 pass under cProfile, then the
    pickling of one batch between processes, timed without the profiler."""
    import gdsfs.torch as gt
    from torch.multiprocessing.reductions import ForkingPickler

    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=batch)
    _pass(dl)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    _pass(dl)
    pr.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(pr)
    cum: dict[tuple[str, str], float] = {}
    for (fn, _line, name), (_cc, _nc, _tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        k = (os.path.basename(fn), name)
        cum[k] = cum.get(k, 0.0) + ct
    rows = [("whole pass (under the profiler)", wall / nsamples * 1e6)]
    # hold() is hold_many() of one now; before hold_many existed, hold() was the whole cost.
    cum[("_leases.py", "hold")] = max(cum.get(("_leases.py", "hold"), 0.0), cum.get(("_leases.py", "hold_many"), 0.0))
    for label, add, sub in PROFILE_ROWS:
        v = cum.get(add, 0.0) - (cum.get(sub, 0.0) if sub else 0.0)
        rows.append((label, v / nsamples * 1e6))
    # A worker's batch to the main process: pickled there, unpickled here (no profiler). A
    # tensor sent as a shared-memory descriptor unpickles once: each dump is loaded once.
    import torch.utils.data

    it = iter(torch.utils.data.DataLoader(ds, batch_size=batch, collate_fn=gt.collate))
    raw = next(it)
    del it
    reps = 50
    dump = load = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(raw)
        t1 = time.perf_counter()
        pickle.loads(buf.getvalue())
        dump, load = dump + t1 - t0, load + time.perf_counter() - t1
    rows.append((f"pickle a batch in the worker ({len(buf.getvalue())} bytes)", dump / reps / batch * 1e6))
    rows.append(("unpickle it in the main process", load / reps / batch * 1e6))
    raw.release()
    ds.close()
    return rows


def _task_cpu() -> dict[int, float]:
    """CPU seconds (user+system) of each thread of this process, by native thread id."""
    out: dict[int, float] = {}
    tck = os.sysconf("SC_CLK_TCK")
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            out[int(t)] = (int(fields[11]) + int(fields[12])) / tck
        except (OSError, ValueError, IndexError):
            continue
    return out


class _PinThreadOnCPU:
    """A CPU-only torch starts no pin-memory thread (pin_memory needs CUDA): with pin_memory=True
    and pin_memory_device="cpu" torch's iterator does start torch's own _pin_memory_loop, which
    asks torch.cuda for the current device and sets it. Those two calls are stubbed while this is
    entered; nothing else of torch.cuda is, so GDSBatch.pin_memory() in that thread runs exactly
    the code it runs under gdsfs.torch.DataLoader on a GPU machine, minus the CUDA calls (the
    gather's copy is a CPU copy, no CUDA event is recorded, the small CPU fields are not
    pinned)."""

    def __enter__(self) -> "_PinThreadOnCPU":
        import torch

        self.saved = None
        if not torch.cuda.is_available():
            self.saved = (torch.cuda.current_device, torch.cuda.set_device)
            torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
            torch.cuda.set_device = lambda _d: None  # type: ignore[assignment]
        return self

    def __exit__(self, *_exc: Any) -> None:
        import torch

        if self.saved is not None:
            torch.cuda.current_device, torch.cuda.set_device = self.saved  # type: ignore[assignment]


def main_cost(shards: list[str], batch: int, workers: int, min_s: float, pin: Optional[bool] = None) -> dict[str, float]:
    """The main process's cost per batch in the real loader: gdsfs.torch.DataLoader with workers
    (persistent) and a pin-memory thread (torch's own, started on a CPU-only torch by
    _PinThreadOnCPU), whose batches the loop's thread settles (deferred release), as on a GPU
    machine. Microseconds per batch: CPU of the pin-memory thread, the loop's thread and the
    other threads (torch's index-queue feeders, the lease drain) from /proc/self/task; the wall
    time of gdsfs's parts (unpickling a worker's batch; the copy: GDSBatch.materialize, in the
    pin-memory thread's pin_memory or in the loop; the settle and its RELEASE ioctls from
    GDSFS_DEBUG_TIMING; the CPU time of the gather, which on a GPU is a kernel launch); RELEASE requests per batch. pin: run torch's
    pin-memory thread (True) or not (False); None: what this gdsfs package does on a GPU machine
    (a package whose DataLoader pins batches of gdsfs.torch.collate in its own loop, _loop_pins,
    starts no pin-memory thread there)."""
    import functools
    import threading

    import gdsfs.torch as gt
    from gdsfs import _core, _tensors

    T: dict[str, float] = {}

    def timed_fn(obj: Any, name: str, label: str) -> Any:
        real = getattr(obj, name)
        clock = time.thread_time if label.startswith("cpu") else time.perf_counter

        @functools.wraps(real)
        def wrapper(*args: Any, **kw: Any) -> Any:
            t = clock()
            try:
                return real(*args, **kw)
            finally:
                T[label] = T.get(label, 0.0) + clock() - t

        setattr(obj, name, wrapper)
        return real

    parts = [(_tensors, "_rebuild_column", "unpickle"), (_tensors, "_rebuild_tensor", "unpickle"), (_tensors, "_rebuild_batch", "unpickle"),
             (_tensors.GDSBatch, "materialize", "copy"), (_tensors.GDSBatch, "_settle", "settle"), (_tensors, "_gather", "cpu gather")]
    if hasattr(_tensors, "_settle_group"):
        parts.append((_tensors, "_settle_group", "settle"))
    if pin is None:
        pin = not hasattr(gt.DataLoader, "_loop_pins")
    os.environ[_core.DEBUG_TIMING_ENV] = "1"
    reals = [(obj, name, timed_fn(obj, name, label)) for obj, name, label in parts]
    try:
        with _PinThreadOnCPU():
            ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
            dl = gt.DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True, pin_memory=pin, pin_memory_device="cpu" if pin else "")
            _pass(dl)  # warm-up: workers started, slabs mapped
            sess = ds._session
            pin = getattr(getattr(dl, "_iterator", None), "_pin_memory_thread", None)
            pin_tid = getattr(pin, "native_id", None)
            main_tid = threading.get_native_id()
            T.clear()
            if sess is not None and sess.timing is not None:
                sess.timing.clear()
            c0 = _task_cpu()
            nb = 0
            t0 = time.perf_counter()
            while True:
                for b in dl:
                    _x = b["x.npy"]
                    nb += 1
                if time.perf_counter() - t0 >= min_s:
                    break
            wall = time.perf_counter() - t0
            c1 = _task_cpu()
            rel = (sess.timing or {}).get("RELEASE", [0, 0.0, 0]) if sess is not None else [0, 0.0, 0]
            del dl, b, _x
            ds.close()
    finally:
        for obj, name, real in reals:
            setattr(obj, name, real)
        os.environ.pop(_core.DEBUG_TIMING_ENV, None)

    def cpu(tid: Any) -> float:
        return (c1.get(tid, 0.0) - c0.get(tid, 0.0)) if tid is not None else 0.0

    total = sum(c1.values()) - sum(v for k, v in c0.items() if k in c1)
    us = 1e6 / max(1, nb)
    return {"wall": wall * us, "cpu": total * us, "cpu pin thread": cpu(pin_tid) * us, "cpu loop thread": cpu(main_tid) * us,
            "cpu other threads": (total - cpu(pin_tid) - cpu(main_tid)) * us, "cpu gather": T.get("cpu gather", 0.0) * us, "unpickle": T.get("unpickle", 0.0) * us,
            "copy": T.get("copy", 0.0) * us, "settle": T.get("settle", 0.0) * us, "RELEASE ioctl": rel[1] * us,
            "RELEASEs per batch": rel[0] / max(1, nb), "pin thread": 1.0 if pin_tid is not None else 0.0}


MAIN_ROWS = ["wall", "cpu", "cpu pin thread", "cpu loop thread", "cpu other threads", "cpu gather", "unpickle", "copy", "settle", "RELEASE ioctl",
             "RELEASEs per batch"]


def run_gdsfs(sets: list[tuple[int, list[str], int]], workers: list[int], batch: int, min_s: float, with_profile: bool,
              with_main: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"gdsfs": {}, "profile": {}, "main": {}}
    for kib, shards, n in sets:
        for w in workers:
            out["gdsfs"][f"{kib}/{w}"] = measure("gdsfs", shards, batch, w, n, min_s)
        if with_profile:
            out["profile"][str(kib)] = profile(shards, batch, n)
        if with_main:
            for w in workers:
                if w > 0:
                    out["main"][f"{kib}/{w}"] = main_cost(shards, batch, w, 2 * min_s)
    return out


# ----------------------------------------------------------------------------
# Cold page cache (--cold): the daemon's readahead against the disk's sequential rate.


def drop(paths: list[str]) -> None:
    """Drops these files' pages from the page cache (posix_fadvise DONTNEED, this benchmark's own
    files only: a machine shared with others keeps its caches)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_rate(paths: list[str]) -> float:
    """GB/s of one pass over the files with 8 MiB reads (what dd does), their pages dropped first."""
    drop(paths)
    buf = memoryview(bytearray(8 << 20))
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while (k := os.readv(fd, [buf])) > 0:
                n += k
        finally:
            os.close(fd)
    return n / (time.perf_counter() - t0) / 1e9


def cold_pass(shards: list[str], backing: list[str], batch: int, workers: int, nsamples: int) -> float:
    """GB/s of one pass of a fresh GDSShardDataset loader, the shards' pages dropped first (the
    mount's and the backing files'), timed from its first batch (worker start-up is not the
    disk's business; dataset_check.py on the GPU machine times it all)."""
    drop(backing + shards)
    n = nb = 0
    t0 = 0.0
    for b in _loader("gdsfs", shards, batch, workers):
        x = b["x.npy"]
        if not t0:
            t0 = time.perf_counter()
        else:
            n, nb = n + x.shape[0], nb + x.numel() * x.element_size()
    if n + batch < nsamples:
        raise RuntimeError(f"cold pass: {n + batch} samples, expected {nsamples}")
    return nb / (time.perf_counter() - t0) / 1e9


def run_cold(src: str, mounts: dict[str, str], sizes: list[int], batch: int, workers: int, quick: bool, reps: int) -> list[dict[str, Any]]:
    """Per size: the disk's sequential rate over the shards and a cold gdsfs pass through each
    mount (label -> mountpoint serving src), best of reps, interleaved."""
    rows = []
    for kib in sizes:
        n = ((32 if quick else 256) << 20) // (kib << 10)
        n -= n % 4
        d = os.path.join(src, "cold", f"{kib}KiB")
        backing = make_tars(d, kib, n)
        for m in mounts.values():
            # The daemon parses the shards' indexes (reading every tar header) before the runs.
            _pass(_loader("gdsfs", [p.replace(src, m, 1) for p in backing], batch, 0))
        row: dict[str, Any] = {"kib": kib, "workers": workers, "sequential": 0.0}
        for _ in range(reps):
            row["sequential"] = max(row["sequential"], sequential_rate(backing))
            for label, m in mounts.items():
                row[label] = max(row.get(label, 0.0), cold_pass([p.replace(src, m, 1) for p in backing], backing, batch, workers, n))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------
# Mount and main.


def _bin() -> str:
    return os.environ.get("GDSFS_BIN") or os.path.join(ROOT, "bin", "gdsfs")


def own_mount(base: str, name: str = "mnt", flags: tuple[str, ...] = ()) -> tuple[str, str]:
    src, mnt = os.path.join(base, "src"), os.path.join(base, name)
    os.makedirs(src, exist_ok=True)
    os.makedirs(mnt)
    cmd = [_bin(), "mount", "--source", src, "--engine", "host", "--background", *flags, "--log-file", os.path.join(base, f"daemon-{name}.log"), mnt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0 or not os.path.ismount(mnt):
        raise RuntimeError(f"gdsfs mount failed (rc {r.returncode}): {r.stderr.strip()}")
    return src, mnt


def unmount(mnt: str) -> None:
    for cmd in ([_bin(), "unmount", mnt], ["fusermount3", "-u", mnt], ["umount", "-l", mnt]):
        if not os.path.ismount(mnt):
            return
        try:
            subprocess.run(cmd, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small data, short passes (CI: a few seconds)")
    ap.add_argument("--sizes", default="16,64,256", help="sample sizes in KiB (default 16,64,256)")
    ap.add_argument("--workers", default="0,2", help="DataLoader num_workers values (default 0,2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--mount", help="an existing host-mode gdsfs mount (with --source: the directory it serves)")
    ap.add_argument("--source", help="the backing directory of --mount")
    ap.add_argument("--profile", action="store_true", help="also print where one process's time goes per sample")
    ap.add_argument("--main", action=argparse.BooleanOptionalAction, default=True,
                    help="print the main process's cost per batch in the real loader, per worker count > 0 (default on)")
    ap.add_argument("--compare", metavar="PKGDIR", help="also run the gdsfs rows with the gdsfs package in PKGDIR (a child process)")
    ap.add_argument("--cold", action="store_true",
                    help="also the cold page cache: per size, the disk's sequential rate over the shards and a fresh loader's pass with "
                         "their pages dropped, with the daemon's readahead and (a second mount) without it")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()

    if a.child:  # --compare's child: {"pkg", "sets", "workers", "batch", "min_s", "profile"} -> JSON on stdout
        job = json.loads(a.child)
        _setup_path(job["pkg"])
        res = run_gdsfs([tuple(x) for x in job["sets"]], job["workers"], job["batch"], job["min_s"], job["profile"], job.get("main", False))
        print(json.dumps(res))
        return 0

    _setup_path(os.path.join(ROOT, "python"))
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    workers = [int(x) for x in a.workers.split(",") if x.strip()]
    min_s = 0.25 if a.quick else 1.5
    base = tempfile.mkdtemp(prefix="gdsfs-bench-dataset-")
    mounted = None
    try:
        if a.mount:
            if not a.source:
                ap.error("--mount needs --source (the directory the mount serves)")
            src, mnt = a.source, a.mount
            sub = f"bench-dataset-{os.getpid()}"
        else:
            if not os.access(_bin(), os.X_OK):
                log(f"no gdsfs binary at {_bin()}: run `make build` (or set GDSFS_BIN)")
                return 2
            if not os.path.exists("/dev/fuse") or (os.geteuid() != 0 and shutil.which("fusermount3") is None):
                log("no /dev/fuse (or, not as root, no fusermount3): nothing to measure here, skipped")
                return 0
            src, mnt = own_mount(base)
            mounted = mnt
            sub = "data"
        sets: list[tuple[int, list[str], int]] = []
        for kib in sizes:
            n = max(64, (8 << 20) // (kib << 10)) if a.quick else max(512, (128 << 20) // (kib << 10))
            n -= n % 4
            make_tars(os.path.join(src, sub, f"{kib}KiB"), kib, n)
            sets.append((kib, [os.path.join(mnt, sub, f"{kib}KiB", f"shard-{s:03d}.tar") for s in range(4)], n))
        check_bytes(sets[0][1], a.batch)
        plain = {f"{kib}/{w}": measure("plain", shards, a.batch, w, n, min_s) for kib, shards, n in sets for w in workers}
        mine = run_gdsfs(sets, workers, a.batch, min_s, a.profile, a.main)
        before = None
        if a.compare:
            job = {"pkg": os.path.abspath(a.compare), "sets": sets, "workers": workers, "batch": a.batch, "min_s": min_s, "profile": a.profile, "main": a.main}
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(job)], capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                log(f"--compare run failed: {r.stderr.strip()[-2000:]}")
                return 1
            before = json.loads(r.stdout.strip().splitlines()[-1])

        print(f"host engine, batch {a.batch}, warm page cache; ratios from this run")
        hdr = f"{'sample':>7} {'workers':>7} {'plain samples/s':>15} {'gdsfs samples/s':>15} {'gdsfs GB/s':>10} {'vs plain':>8}"
        print(hdr + (f" {'before samples/s':>16} {'after/before':>12}" if before else ""))
        for kib, _shards, _n in sets:
            for w in workers:
                k = f"{kib}/{w}"
                p, g = plain[k], mine["gdsfs"][k]
                line = (f"{str(kib) + ' KiB':>7} {w:>7} {p['samples_per_s']:>15,.0f} {g['samples_per_s']:>15,.0f} {g['GBps']:>10.2f} "
                        f"{g['samples_per_s'] / p['samples_per_s']:>7.2f}x")
                if before:
                    bg = before["gdsfs"][k]
                    line += f" {bg['samples_per_s']:>16,.0f} {g['samples_per_s'] / bg['samples_per_s']:>11.2f}x"
                print(line)
        if a.profile:
            for kib, _shards, _n in sets:
                print(f"\nprofile, {kib} KiB samples, num_workers=0: microseconds per sample" + (" (before | after)" if before else ""))
                rows = mine["profile"][str(kib)]
                old = dict((r[0].split(" (")[0], r[1]) for r in before["profile"][str(kib)]) if before else {}
                for label, us in rows:
                    b = old.get(label.split(" (")[0])
                    print(f"  {label:<58} " + (f"{b:8.1f} | " if before and b is not None else "") + f"{us:8.1f}")
        if a.main:
            for k, m in mine["main"].items():
                kib, w = k.split("/")
                bm = (before or {}).get("main", {}).get(k)
                print(f"\nthe main process per batch of {a.batch}, {kib} KiB samples, {w} workers, "
                      + ("torch's pin-memory thread (on the CPU: _PinThreadOnCPU)" if m["pin thread"] else "no pin-memory thread")
                      + (" | " + ("torch's pin-memory thread" if bm["pin thread"] else "no pin-memory thread") + " before" if bm else "")
                      + ": microseconds" + (" (before | after | after/before)" if bm else ""))
                for row in MAIN_ROWS:
                    unit = "" if row == "RELEASEs per batch" else " us"
                    line = f"  {row + unit:<24} "
                    if bm:
                        line += f"{bm[row]:8.1f} | {m[row]:8.1f} | " + (f"{m[row] / bm[row]:5.2f}x" if bm[row] else "    -")
                    else:
                        line += f"{m[row]:8.1f}"
                    print(line)
        cold: list[dict[str, Any]] = []
        if a.cold and not a.mount:
            mounts = {"readahead": mnt}
            try:
                mounts["no readahead"] = own_mount(base, "mnt-no-readahead", ("--readahead", "0"))[1]
            except RuntimeError as e:
                log(f"cold: no second mount without readahead ({e})")
            try:
                cold = run_cold(src, mounts, sizes, a.batch, max(workers), a.quick, 2 if a.quick else 3)
            finally:
                if "no readahead" in mounts:
                    unmount(mounts["no readahead"])
            print(f"\ncold page cache (this run's files dropped), num_workers={max(workers)}, GB/s of tensor payload; best of a few interleaved passes")
            print(f"{'sample':>7} {'disk sequential':>15} {'gdsfs':>7} {'vs disk':>7} {'no readahead':>12} {'vs disk':>7}")
            for r in cold:
                g, o = r["readahead"], r.get("no readahead", 0.0)
                print(f"{str(r['kib']) + ' KiB':>7} {r['sequential']:>15.2f} {g:>7.2f} {g / r['sequential']:>6.2f}x {o:>12.2f} {o / r['sequential']:>6.2f}x")
        elif a.cold:
            log("--cold needs its own mounts (leave out --mount)")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"plain": plain, "after": mine, "before": before, "cold": cold}, f, indent=1)
        return 0
    finally:
        if mounted:
            unmount(mounted)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
