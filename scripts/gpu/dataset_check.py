#!/usr/bin/env python3
"""GPU check and benchmark of gdsfs.torch.GDSShardDataset (issue 6).

Usage: dataset_check.py MOUNTPOINT BACKING_DIR [--quick] [--cpu] [--workers N] [--json PATH]

MOUNTPOINT is a gdsfs mount serving BACKING_DIR at its root (gdsfs mount
--source BACKING_DIR MOUNTPOINT, or an overmount where both are the same
path). The script writes WebDataset tars of float32 .npy tensors (100 KiB and
4 MiB samples) under <mount>/gdsfs-dataset-check/, then:

1. correctness: GDSShardDataset with num_workers=8, pin_memory=True and a
   stock DataLoader (collate_fn=gdsfs.torch.collate): every batch's tensors
   are CUDA tensors, every sample arrives once, and each equals the plain-read
   reference (sha256 of the .npy data read with tarfile + numpy from the
   backing directory);
2. no CUDA in workers: nvidia-smi lists the main process, and none of the
   DataLoader worker pids, as a compute process;
3. benchmark, warm and cold (page cache dropped), samples/s and GB/s of
   tensor payload (warm: steady state of one loader with persistent workers,
   best of --epochs epochs after a warm-up epoch; cold: one fresh loader) for: gdsfs; gdsfs+features (shuffle, shuffle_buffer,
   interleave=2, a per-sample map, keys=; their cost is the ratio printed
   at the end); (a) a plain IterableDataset reading the same
   tars through the mount with pin_memory=True and .cuda(non_blocking=True);
   (b) the same reading the backing directory directly.

Prints one table, then issue 15's (plain (a) vs gdsfs per size with its targets, and the cold
runs against the disk's sequential read rate measured over the same shards right before them, the
page cache dropped); exits 1 when a correctness check fails (the speed target,
gdsfs >= 2x (b) for 4 MiB samples warm, is reported, not enforced).

Below 1 MiB samples it also prints the probes (the daemon alone, the loader's halves) and the
worker profile (worker_profile: one worker's loop in-process, timed and under cProfile, the READ
ioctl round trip apart via GDSFS_DEBUG_TIMING; then each worker of the real loader timed, with
the CPU cores the daemon, this process and the workers kept busy; --metrics HOST:PORT of the
daemon's --metrics-addr adds the daemon's own time per READ).

--cpu runs the same on a machine without GPU (a host-mode mount): tensors
stay on the CPU, pin_memory is off and the CUDA-context check is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import inspect
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any, Iterator, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils.data  # noqa: E402

import gdsfs  # noqa: E402
import gdsfs.torch as gt  # noqa: E402

SUBDIR = "gdsfs-dataset-check"


def log(msg: str) -> None:
    print(f"dataset_check: {msg}", flush=True)


# ----------------------------------------------------------------------------
# Data.


def _npy(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def _write_shard(job: tuple[str, int, int, int]) -> None:
    """One shard of make_dataset: per samples of sample_bytes, its own random stream (seeded by
    the sample size and the shard's number, so a shard's bytes do not depend on the others)."""
    path, sample_bytes, s, per = job
    rng = np.random.default_rng([sample_bytes, s])
    n = sample_bytes // 4
    with open(path + ".tmp", "wb") as f, tarfile.open(fileobj=f, mode="w") as tf:
        for i in range(per):
            key = f"{s:04d}_{i:06d}"
            x = rng.standard_normal(n, dtype=np.float32)
            for ext, data in (("cls", str(i % 1000).encode()), ("x.npy", _npy(x))):
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
        tf.close()
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def make_dataset(root: str, name: str, sample_bytes: int, nsamples: int, nshards: int) -> list[str]:
    """WebDataset tars of {x.npy: float32[sample_bytes/4], cls: label}, written by one process
    per CPU, a shard each at a time (one process wrote 32768 samples of 16 KiB in 15.6 s on the
    GPU machine); reused when a previous run wrote the same layout."""
    import multiprocessing

    d = os.path.join(root, name)
    stamp = os.path.join(d, "DONE")
    want = f"{sample_bytes} {nsamples} {nshards} v2\n"
    shards = [os.path.join(d, f"shard-{s:04d}.tar") for s in range(nshards)]
    if os.path.exists(stamp) and open(stamp).read() == want:
        return shards
    os.makedirs(d, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(stamp)
    per = nsamples // nshards
    t0 = time.monotonic()
    jobs = [(path, sample_bytes, s, per) for s, path in enumerate(shards)]
    procs = max(1, min(nshards, os.cpu_count() or 1))
    if procs == 1:
        for j in jobs:
            _write_shard(j)
    else:
        # fork: the children only write files (no CUDA, no gdsfs session), and start at once.
        with multiprocessing.get_context("fork").Pool(procs) as pool:
            pool.map(_write_shard, jobs, chunksize=1)
    with open(stamp, "w") as f:
        f.write(want)
    log(f"wrote {name}: {nsamples} samples of {sample_bytes} B in {nshards} shards, {procs} processes ({time.monotonic() - t0:.1f}s)")
    return shards


def reference(shards: list[str]) -> dict[str, str]:
    """sha256 of each sample's x.npy array bytes, read plainly."""
    out = {}
    for p in shards:
        with tarfile.open(p, "r|") as tf:
            for m in tf:
                if m.name.endswith(".x.npy"):
                    arr = np.load(io.BytesIO(tf.extractfile(m).read()))
                    out[m.name[: -len(".x.npy")]] = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
    return out


# ----------------------------------------------------------------------------
# The plain baseline: what users do today.


class PlainTarDataset(torch.utils.data.IterableDataset):
    """Reads tars sequentially with tarfile, splits shards across workers,
    decodes .npy with numpy."""

    def __init__(self, shards: list[str]) -> None:
        super().__init__()
        self.shards = shards

    def __iter__(self) -> Iterator[dict[str, Any]]:
        wi = torch.utils.data.get_worker_info()
        mine = self.shards if wi is None else self.shards[wi.id :: wi.num_workers]
        for p in mine:
            with open(p, "rb", buffering=1 << 20) as f, tarfile.open(fileobj=f, mode="r|") as tf:
                cur: dict[str, Any] = {}
                for m in tf:
                    key, _, ext = m.name.partition(".")
                    data = tf.extractfile(m).read()
                    if cur and cur["__key__"] != key:
                        yield cur
                        cur = {}
                    cur["__key__"] = key
                    cur[ext] = torch.from_numpy(np.load(io.BytesIO(data))) if ext == "x.npy" else int(data)
                if cur:
                    yield cur


# ----------------------------------------------------------------------------
# Runs.


def drop_caches() -> bool:
    if Opts.drop_files is not None:
        # --drop-files: only this size's shards (both the backing files and the mount's), for a
        # machine shared with others, where dropping every cache would disturb them.
        for p in Opts.drop_files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        log(f"cannot drop the page cache ({e}): cold runs are skipped")
        return False


def _readahead_counters(path: str) -> tuple[int, int, int]:
    """The daemon's readahead counters (windows, bytes, dropped); zeros from a daemon without them."""
    c = gdsfs.status(path).get("counters", {})
    return int(c.get("readaheads", 0)), int(c.get("readahead_bytes", 0)), int(c.get("readahead_dropped", 0))


def disk_rate(paths: list[str]) -> float:
    """GB/s of one sequential pass over paths (8 MiB reads) with the page cache dropped before:
    the disk's sequential read rate, which the cold target compares with."""
    buf = bytearray(8 << 20)
    mv = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                k = os.readv(fd, [mv])
                if k <= 0:
                    break
                n += k
        finally:
            os.close(fd)
    return n / (time.perf_counter() - t0) / 1e9


def disk_rate_parallel(paths: list[str], streams: int, chunk: int) -> float:
    """GB/s of the workers' pattern on the bare disk, page cache dropped before: streams threads,
    each reading its contiguous block of paths (a worker's shards, as EpochPlan.block gives them)
    in order with chunk-byte preads. Beside disk_rate's one stream of 8 MiB reads it tells
    whether this disk serves parallel streams faster or slower than one: the most a loader whose
    workers read this way can reach."""
    import threading

    per = [paths[i * len(paths) // streams:(i + 1) * len(paths) // streams] for i in range(streams)]
    done = [0] * streams

    def run(k: int) -> None:
        buf = bytearray(chunk)
        mv = memoryview(buf)
        for p in per[k]:
            fd = os.open(p, os.O_RDONLY)
            try:
                off = 0
                while True:
                    n = os.preadv(fd, [mv], off)
                    if n <= 0:
                        break
                    off += n
                    done[k] += n
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=run, args=(k,)) for k in range(streams) if per[k]]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(done) / (time.perf_counter() - t0) / 1e9


class DiskStat:
    """The backing disk's counters (/sys/dev/block/MAJ:MIN/stat of the device holding a path)
    around a cold run: how busy the disk was, its reads' mean size and the mean number of reads
    in flight. Tells a loader that left the disk idle (busy < 100%) from one that kept it busy
    with a pattern it serves more slowly (busy ~100%, other sizes or depths than the probe's)."""

    def __init__(self, path: str) -> None:
        st = os.stat(path)
        self.file = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"
        self.t0 = 0.0
        self.c0: "list[int] | None" = None

    def _read(self) -> "list[int] | None":
        try:
            with open(self.file) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return None

    def start(self) -> None:
        self.t0, self.c0 = time.perf_counter(), self._read()

    def line(self) -> str:
        c1, secs = self._read(), time.perf_counter() - self.t0
        if not self.c0 or not c1 or len(c1) < 11 or secs <= 0:
            return "disk counters unavailable"
        reads, sectors, rticks, ioticks = (c1[i] - self.c0[i] for i in (0, 2, 3, 9))
        size = sectors * 512 / reads / 1024 if reads else 0.0
        return (f"disk busy {ioticks / 1000 / secs:.0%} of {secs:.2f} s, {reads:,} reads of {size:,.0f} KiB, "
                f"{rticks / 1000 / secs:.1f} reads in flight (mean)")


def daemon_probe(shards: list[str], threads: int = 8, group: int = 64, secs: float = 1.5) -> dict[str, float]:
    """The daemon alone (no dataset, no DataLoader): `threads` threads each READ `group`
    consecutive samples' x.npy ranges of a shard and RELEASE them, for secs; then the same bytes
    asked for as one range per group. Samples/s of each: how far the daemon's per-range work
    limits small samples."""
    import threading

    from gdsfs import _core

    groups: list[tuple[str, list[tuple[int, int]]]] = []
    layouts = {p: [s["fields"]["x.npy"] for s in gdsfs.layout(p)["samples"]] for p in shards}
    group = max(1, min([group] + [len(xs) for xs in layouts.values()]))
    for p, xs in layouts.items():
        for i in range(0, len(xs) - group + 1, group):
            groups.append((p, [(int(x["offset"]), int(x["length"])) for x in xs[i : i + group]]))
    out: dict[str, float] = {}
    for mode in ("ranges", "coalesced"):
        sess = _core.Session.open(shards[0], strict=True)
        assert sess is not None
        if mode == "coalesced" and groups and groups[0][1][-1][0] + groups[0][1][-1][1] - groups[0][1][0][0] > sess.max_lease:
            sess.close()
            continue
        counts = [0] * threads
        stop = time.monotonic() + secs

        def run(k: int) -> None:
            fds: dict[str, int] = {}
            j = k
            while time.monotonic() < stop:
                path, rs = groups[j % len(groups)]
                j += threads
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY)
                ask = rs if mode == "ranges" else [(rs[0][0], rs[-1][0] + rs[-1][1] - rs[0][0])]
                refs = sess.read(fd, ask)
                sess._release_ids([r.lease for r in refs])
                counts[k] += len(rs)
            for fd in fds.values():
                os.close(fd)

        t0 = time.monotonic()
        ts = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        out[mode] = sum(counts) / (time.monotonic() - t0)
        sess.close()
    return out


def main_probe(shards: list[str], batch: int, sample_bytes: int) -> dict[str, float]:
    """Samples/s of the two halves of the warm gdsfs loader, apart: the workers (and the daemon,
    and unpickling here) producing batches that stay in daemon memory, then this process
    materializing them the way the pin-memory thread does (GDSBatch.pin_memory)."""
    dl, ds = gds_loader(shards, batch, sample_bytes, persistent_workers=True, pin=False)
    for b in dl:  # warm-up epoch (workers, index cache, slabs mapped)
        b.release()
    t0 = time.perf_counter()
    got = list(dl)
    t1 = time.perf_counter()
    n = sum(len(b["__key__"]) for b in got)
    for b in got:
        x = (b.pin_memory() if Opts.cuda else b.materialize())["x.npy"]
    if Opts.cuda:
        torch.cuda.synchronize()
    t2 = time.perf_counter()
    del got, x, dl
    ds.close()
    return {"workers": n / (t1 - t0), "main": n / (t2 - t1)}


def _metrics(addr: str) -> dict[str, float]:
    """count and sum of the daemon's READ/RELEASE control requests and FUSE reads, from its
    --metrics-addr (Prometheus text); {} when addr is empty or unreachable."""
    if not addr:
        return {}
    import urllib.request

    want = {'gdsfs_control_request_duration_seconds_sum{command="READ"}': "READ s",
            'gdsfs_control_request_duration_seconds_count{command="READ"}': "READ n",
            'gdsfs_control_request_duration_seconds_sum{command="RELEASE"}': "RELEASE s",
            'gdsfs_control_request_duration_seconds_count{command="RELEASE"}': "RELEASE n",
            'gdsfs_fuse_op_duration_seconds_sum{op="read"}': "fuse read s",
            'gdsfs_fuse_op_duration_seconds_count{op="read"}': "fuse read n"}
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the daemon is local: never a proxy
        text = opener.open(f"http://{addr}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, _, val = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(val)
    return out


def _daemon_side(before: dict[str, float], after: dict[str, float], samples: int) -> str:
    if not before or not after:
        return "daemon-side: no --metrics (start the mount with --metrics-addr and pass --metrics)"
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    parts = []
    for op in ("READ", "RELEASE", "fuse read"):
        n, sec = d.get(f"{op} n", 0.0), d.get(f"{op} s", 0.0)
        if n:
            parts.append(f"{op} {n:,.0f} requests, {sec / n * 1e6:,.0f} us each in the daemon, {sec / samples * 1e6:.1f} us per sample")
    return "daemon-side (its metrics): " + ("; ".join(parts) or "nothing counted")


def _proc_cpu(pid: int) -> float:
    """user+system CPU seconds of process pid (all its threads) so far; -1 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


class _TimedIter(torch.utils.data.IterableDataset):
    """Wraps a GDSShardDataset for the worker profile: each worker times the time spent inside
    the dataset's generator (planning, READ, CPU fields, TensorRefs) against its whole life, and
    writes that and its session's ioctl timing (GDSFS_DEBUG_TIMING) to outdir/<pid>.json when
    its slot is done."""

    def __init__(self, ds: Any, outdir: str) -> None:
        super().__init__()
        self.ds, self.outdir = ds, outdir

    def __iter__(self) -> Iterator[Any]:
        sess = self.ds._session
        if sess is not None and sess.timing is not None:
            sess.timing.clear()
        gcs = {"s": 0.0, "t0": 0.0, "full": 0, "n": 0}

        def on_gc(phase: str, info: dict[str, int]) -> None:
            # This worker's garbage collections (a full one walks every object it inherited
            # unless the parent froze them before the fork, as gdsfs.torch.DataLoader does).
            if phase == "start":
                gcs["t0"] = time.perf_counter()
                return
            gcs["s"] += time.perf_counter() - gcs["t0"]
            gcs["n"] += 1
            gcs["full"] += info.get("generation") == 2

        gc.callbacks.append(on_gc)
        it = iter(self.ds)
        inside = 0.0
        n = 0
        c0 = time.process_time()
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            try:
                s = next(it)
            except StopIteration:
                inside += time.perf_counter() - t
                break
            inside += time.perf_counter() - t
            n += 1
            yield s
        gc.callbacks.remove(on_gc)
        rec = {"samples": n, "wall": time.perf_counter() - t0, "inside": inside, "cpu": time.process_time() - c0, "timing": dict(sess.timing or {}) if sess else {},
               "gc": gcs["s"], "gcs": gcs["n"], "gc_full": gcs["full"]}
        with open(os.path.join(self.outdir, f"{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)


def worker_profile(shards: list[str], batch: int, sample_bytes: int, samples: int = 2000, top: int = 20) -> list[str]:
    """Where a worker's time goes (issue 15: why workers are slower on the GPU machine than with
    the host engine). (1) One worker's loop in this process (num_workers=0 semantics: the same
    dataset, read_ahead and collate, then the pickle a worker sends), for `samples` samples:
    microseconds per sample split into the READ ioctl round trip, the rest of the dataset's
    generator, collate, pickle; the daemon's own time per READ from its metrics; then the same
    under cProfile, top functions by tottime and cumtime. (2) The real loader with Opts.workers
    workers: per worker, time inside the dataset's generator and in its READ ioctls, per sample,
    against the uncontended figures of (1)."""
    import cProfile
    import itertools
    import pickle
    import pstats

    from gdsfs import _core

    os.environ[_core.DEBUG_TIMING_ENV] = "1"
    lines: list[str] = []
    try:
        dl, ds = gds_loader(shards, batch, sample_bytes, pin=False)
        del dl
        sess = ds._session
        assert sess is not None and sess.timing is not None

        def one_pass(prof: Any) -> dict[str, float]:
            sess.timing.clear()
            it = iter(ds)
            t_iter = t_coll = t_pick = t_rel = 0.0
            n = 0
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            while n < samples:
                a = time.perf_counter()
                chunk = list(itertools.islice(it, batch))
                b = time.perf_counter()
                if not chunk:
                    break
                bt = gt.collate(chunk)
                c = time.perf_counter()
                pickle.dumps(bt, protocol=pickle.HIGHEST_PROTOCOL)
                d = time.perf_counter()
                del chunk
                bt.release()  # the main process's part (RELEASE), not the worker's
                e = time.perf_counter()
                t_iter, t_coll, t_pick, t_rel = t_iter + b - a, t_coll + c - b, t_pick + d - c, t_rel + e - d
                n += len(bt["__key__"])
                del bt
            if prof is not None:
                prof.disable()
            wall = time.perf_counter() - t0
            it.close()  # type: ignore[attr-defined]
            rd = sess.timing.get("READ", [0, 0.0, 0])
            rl = sess.timing.get("RELEASE", [0, 0.0, 0])
            return {"n": n, "wall": wall, "iter": t_iter, "collate": t_coll, "pickle": t_pick, "release": t_rel,
                    "read": rd[1], "reads": rd[0], "ranges": rd[2], "rel_ioctl": rl[1]}

        one_pass(None)  # warm-up (index cache, page cache)
        for label, hint in (("a range per sample", 0), ("a batch's adjacent samples share a range", batch)):
            ds._batched = hint
            m0 = _metrics(Opts.metrics)
            r = one_pass(None)
            m1 = _metrics(Opts.metrics)
            n = max(1, r["n"])
            us = {k: r[k] / n * 1e6 for k in ("wall", "iter", "collate", "pickle", "release", "read", "rel_ioctl")}
            per_batch = r["wall"] / max(1, math.ceil(n / batch)) * 1e6
            lines.append(f"one worker in-process, {label}: {n} samples, batch {batch}, {r['reads']} READs of {r['ranges'] / max(1, r['reads']):.1f} ranges: "
                         f"{us['wall']:.1f} us per sample ({per_batch:,.0f} us per batch): READ ioctl {us['read']:.1f}, rest of the dataset's generator "
                         f"{us['iter'] - us['read']:.1f}, collate {us['collate']:.1f}, pickle {us['pickle']:.1f} | main's release {us['release']:.1f} "
                         f"(RELEASE ioctl {us['rel_ioctl']:.1f}); READ round trip {r['read'] / max(1, r['reads']) * 1e6:,.0f} us each")
            lines.append(_daemon_side(m0, m1, n))
        prof = cProfile.Profile()
        one_pass(prof)
        for key in ("tottime", "cumulative"):
            sio = io.StringIO()
            pstats.Stats(prof, stream=sio).strip_dirs().sort_stats(key).print_stats(top)
            body = sio.getvalue()
            at = body.find("ncalls")
            lines.append(f"cProfile of that loop, top {top} by {key} ({n} samples):")
            lines.extend("  " + ln for ln in body[at:].splitlines() if ln.strip())

        # (2) The real loader, Opts.workers workers, each timing itself.
        outdir = tempfile.mkdtemp(prefix="gdsfs-wprof-")
        loader = torch.utils.data.DataLoader(_TimedIter(ds, outdir), batch_size=batch, num_workers=Opts.workers, pin_memory=Opts.cuda,
                                             collate_fn=gt.collate, timeout=300)
        m0 = _metrics(Opts.metrics)
        d0, p0 = _proc_cpu(sess.hello.daemon_pid), time.process_time()
        t0 = time.perf_counter()
        total = 0
        # Its workers forked as gdsfs.torch.DataLoader forks them: the parent's heap frozen.
        frozen = getattr(gdsfs._dataset, "_frozen_heap", None)
        with frozen(loader) if frozen is not None else contextlib.nullcontext():
            it = iter(loader)
        for b in it:
            if isinstance(b, gt.GDSBatch) and not b.materialized:
                b = b.materialize()
            total += len(b["__key__"])
        if Opts.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        m1 = _metrics(Opts.metrics)
        d1, p1 = _proc_cpu(sess.hello.daemon_pid), time.process_time()
        del loader, it
        recs = []
        for fn in os.listdir(outdir):
            with open(os.path.join(outdir, fn)) as f:
                recs.append(json.load(f))
        lines.append(f"loader, {Opts.workers} workers: {total / wall:,.0f} samples/s ({total} samples, {wall:.2f} s; workers that reported: {len(recs)}); "
                     f"CPU cores busy: daemon {(d1 - d0) / wall:.2f}" + (f" ({(d1 - d0) / max(1, total) * 1e6:.1f} us per sample)" if d0 >= 0 and d1 >= 0 else " (unknown)")
                     + f", this process {(p1 - p0) / wall:.2f}, workers {sum(x['cpu'] for x in recs) / wall:.2f}; machine has {os.cpu_count()} CPUs")
        for k, rec in enumerate(sorted(recs, key=lambda x: -x["inside"])):
            rn = max(1, rec["samples"])
            rd = rec["timing"].get("READ", [0, 0.0, 0])
            lines.append(f"  worker {k}: {rec['samples']} samples; inside the dataset's generator {rec['inside'] / rn * 1e6:.1f} us per sample "
                         f"(READ ioctl {rd[1] / rn * 1e6:.1f}, {rd[0]} READs, {rd[1] / max(1, rd[0]) * 1e6:,.0f} us each; rest "
                         f"{(rec['inside'] - rd[1]) / rn * 1e6:.1f}); outside it (collate, pickle, waiting for the main process) "
                         f"{(rec['wall'] - rec['inside']) / rn * 1e6:.1f}; its CPU time (all threads) {rec['cpu'] / rn * 1e6:.1f}; garbage "
                         f"collections {rec.get('gc', 0.0) / rn * 1e6:.1f} ({rec.get('gcs', 0)}, {rec.get('gc_full', 0)} full)")
            if k >= 2 and len(recs) > 4:
                lines.append(f"  ... {len(recs) - 3} more workers")
                break
        lines.append(_daemon_side(m0, m1, max(1, total)))
        shutil.rmtree(outdir, ignore_errors=True)
        ds.close()
    finally:
        os.environ.pop(_core.DEBUG_TIMING_ENV, None)
    return lines


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


def main_profile(shards: list[str], batch: int, sample_bytes: int, legacy: bool = False, per_item: "int | None" = None) -> list[str]:
    """Where the main process's time goes per batch in the real loader (gdsfs.torch.DataLoader,
    Opts.workers persistent workers, pin_memory on CUDA, one timed epoch after a warm-up one):
    the CPU time of the pin-memory thread (if any), the loop's thread and the rest of the
    process's threads (torch's index-queue feeders, the lease drain) per batch, from /proc; the
    wall time of gdsfs's parts in them (unpickling a worker's batch: its column, small tensors
    and the batch; GDSBatch.pin_memory; the loop's materialize and settle, its RELEASE ioctls
    apart, from GDSFS_DEBUG_TIMING) and the loop's wait for the next batch. legacy: the loader
    as before issue 15's wave 5 (torch's pin-memory thread copies, the loop settles each batch
    with its own RELEASE), for a before/after of the same run. per_item: the loader's
    batches_per_item (None: --batches-per-item)."""
    from gdsfs import _tensors

    undo: list[tuple[Any, str, Any]] = []
    if legacy and hasattr(gt.DataLoader, "_loop_pins"):
        undo = [(gt.DataLoader, "_loop_pins", gt.DataLoader._loop_pins), (_tensors, "_ready_probe", _tensors._ready_probe)]
        gt.DataLoader._loop_pins = lambda self: False  # type: ignore[method-assign]
        _tensors._ready_probe = lambda it: None
    elif legacy:
        return ["(this gdsfs has only the pin-memory thread's loader: the profile above is it)"]
    try:
        return _main_profile(shards, batch, sample_bytes, per_item)
    finally:
        for obj, name, real in undo:
            setattr(obj, name, real)


def _main_profile(shards: list[str], batch: int, sample_bytes: int, per_item: "int | None" = None) -> list[str]:
    import threading

    from gdsfs import _core, _tensors

    T: dict[str, float] = {}
    N: dict[str, int] = {}
    M: list[float] = []  # each materialize's seconds: the mean has a 2-4x tail of preempted calls on a busy box

    def timed_fn(obj: Any, name: str, label: str) -> Any:
        real = getattr(obj, name)

        @functools.wraps(real)
        def wrapper(*args: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            out = None
            try:
                out = real(*args, **kw)
                return out
            finally:
                d = time.perf_counter() - t
                T[label] = T.get(label, 0.0) + d
                N[label] = N.get(label, 0) + 1
                if label == "materialize" and isinstance(out, list):  # _materialize_segment: a run of batches at once
                    M.extend([d / len(out)] * len(out))
                elif label == "materialize" and out is not None:
                    M.append(d)

        setattr(obj, name, wrapper)
        return real

    patched = [(_tensors, "_rebuild_column", "unpickle: columns"), (_tensors, "_rebuild_tensor", "unpickle: small tensors"),
               (_tensors, "_rebuild_batch", "unpickle: batch"), (_tensors.GDSBatch, "pin_memory", "pin_memory"),
               (_tensors.GDSBatch, "_settle", "settle"), (_tensors.GDSBatch, "materialize", "materialize")]
    if hasattr(_tensors, "_settle_group"):  # the loop settles groups of batches (gdsfs._tensors.settled)
        patched.append((_tensors, "_settle_group", "settle"))
    if hasattr(_tensors, "_materialize_segment"):  # the loop materializes an item's run of batches at once
        patched.append((_tensors, "_materialize_segment", "materialize"))
    os.environ[_core.DEBUG_TIMING_ENV] = "1"
    reals = [(obj, name, timed_fn(obj, name, label)) for obj, name, label in patched]
    lines: list[str] = []
    try:
        dl, ds = gds_loader(shards, batch, sample_bytes, persistent_workers=True, batches_per_item=per_item if per_item is not None else Opts.per_item)
        sess = ds._session
        for b in dl:  # warm-up epoch (workers started, page and index caches, slabs mapped)
            pass
        k = getattr(dl, "_kbatch", 1)  # the batches per item its workers send
        T.clear()
        N.clear()
        M.clear()
        if sess is not None and sess.timing is not None:
            sess.timing.clear()
        gcs: dict[int, list[float]] = {}  # generation -> [collections, seconds]
        gc_t0 = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_t0[0] = time.perf_counter()
            else:
                row = gcs.setdefault(int(info.get("generation", 0)), [0, 0.0])
                row[0] += 1
                row[1] += time.perf_counter() - gc_t0[0]

        gc.callbacks.append(on_gc)
        it_obj = getattr(dl, "_iterator", None)
        pin = getattr(it_obj, "_pin_memory_thread", None)
        pin_tid = getattr(pin, "native_id", None)
        main_tid = threading.get_native_id()
        c0 = _task_cpu()
        d0 = _proc_cpu(sess.hello.daemon_pid) if sess is not None else -1.0
        wait = 0.0
        n = nb = 0
        t0 = time.perf_counter()
        it = iter(dl)
        while True:
            a = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                break
            wait += time.perf_counter() - a
            n += len(b["__key__"])
            nb += 1
        if Opts.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        gc.callbacks.remove(on_gc)
        c1 = _task_cpu()
        d1 = _proc_cpu(sess.hello.daemon_pid) if sess is not None else -1.0
        rel = (sess.timing or {}).get("RELEASE", [0, 0.0, 0]) if sess is not None else [0, 0.0, 0]
        del b, it, dl
        ds.close()
        nb = max(1, nb)

        def cpu_of(tid: Optional[int]) -> float:
            return c1.get(tid, 0.0) - c0.get(tid, 0.0) if tid is not None else 0.0

        total = sum(c1.values()) - sum(v for k, v in c0.items() if k in c1)
        pin_c, main_c = cpu_of(pin_tid), cpu_of(main_tid)
        per = {k: T[k] / nb * 1e6 for k in T}
        unp = sum(v for k, v in per.items() if k.startswith("unpickle"))
        lines.append(f"main process, the real loader ({Opts.workers} workers, batch {batch}, {k} batches per worker item, pin_memory={Opts.cuda}): "
                     f"{n / wall:,.0f} samples/s, "
                     f"{wall / nb * 1e6:,.0f} us per batch; CPU per batch: pin-memory thread {pin_c / nb * 1e6:,.0f} us"
                     + ("" if pin_tid is not None else " (no pin-memory thread)")
                     + f", loop thread {main_c / nb * 1e6:,.0f}, other threads {(total - pin_c - main_c) / nb * 1e6:,.0f}"
                     + (f", daemon {(d1 - d0) / nb * 1e6:,.0f}" if d0 >= 0 and d1 >= 0 else ""))
        lines.append(f"main process per batch (wall, us): unpickle {unp:,.0f} ("
                     + ", ".join(f"{k[len('unpickle: '):]} {v:,.0f}" for k, v in sorted(per.items()) if k.startswith("unpickle"))
                     + f"), pin_memory {per.get('pin_memory', 0.0):,.0f}, "
                     f"materialize in the loop {per.get('materialize', 0.0) - per.get('pin_memory', 0.0) if pin_tid is None else 0.0:,.0f}"
                     + (f" (median {statistics.median(M) * 1e6:,.0f})" if M and pin_tid is None else "") + ", "
                     f"settle {per.get('settle', 0.0):,.0f} (RELEASE ioctl {rel[1] / nb * 1e6:,.0f}, {rel[0]} RELEASEs of {rel[2] / max(1, rel[0]):.1f} ids, "
                     f"{rel[0] / nb:.2f} per batch); "
                     f"next() in the loop (torch's queues, then gdsfs.torch.DataLoader's materialize or settle) {wait / nb * 1e6:,.0f}")
        lines.append(f"main process's garbage collections during the epoch ({gc.get_count()} pending now, objects tracked {len(gc.get_objects()):,}): "
                     + (", ".join(f"generation {g}: {int(c)} taking {t * 1e3:,.1f} ms in all" for g, (c, t) in sorted(gcs.items())) or "none"))
    finally:
        for obj, name, real in reals:
            setattr(obj, name, real)
        os.environ.pop(_core.DEBUG_TIMING_ENV, None)
    return lines


# Issue 15's targets, warm, gdsfs vs (a) the plain IterableDataset: (ratio, samples/s) per size.
TARGETS: dict[str, tuple[float, float]] = {"16KiB": (2.0, 0), "64KiB": (3.0, 0), "256KiB": (4.0, 25000), "4MiB": (8.0, 0)}
COLD_TARGET = 0.95  # cold gdsfs >= this x the disk's sequential read rate
STARTED = "gdsfs workers started"  # the cold row of a loader whose workers ran an epoch before
# The cold row of gdsfs with GDSFS_START_HINT=0: no start hint of the workers' first bytes while
# they start (gdsfs._starthint), for the A/B in one run.
NOHINT = "gdsfs start hint off"
SEQ, GDS = "disk sequential read", "gdsfs"
# The bare disk read the workers' way (disk_rate_parallel): their blocks of shards in parallel.
PARALLEL = "disk, the workers' pattern"
START_HINT_ENV = "GDSFS_START_HINT"


def _start_hint_env(value: Optional[str], off: bool) -> None:
    """GDSFS_START_HINT as the caller set it (value; None: unset), or 0 when off."""
    if off:
        os.environ[START_HINT_ENV] = "0"
    elif value is None:
        os.environ.pop(START_HINT_ENV, None)
    else:
        os.environ[START_HINT_ENV] = value


def issue_table(results: list[dict[str, Any]]) -> list[str]:
    """The table of issue 15: per size, plain (a) vs gdsfs warm, ratio, targets; cold vs disk."""
    def get(size: str, cache: str, loader: str) -> Any:
        return next((x for x in results if x["size"] == size and x["cache"] == cache and x["loader"] == loader), None)

    out = ["", f"issue 15 table (warm: {Opts.workers} workers, steady state; plain = (a) tarfile IterableDataset via the mount"
           + (", pin_memory, .cuda(non_blocking))" if Opts.cuda else ", CPU tensors)"),
           f"{'sample':<8} {'plain samples/s':>15} {'plain GB/s':>10} {'gdsfs samples/s':>15} {'gdsfs GB/s':>10} {'ratio':>7}  target"]
    sizes = list(dict.fromkeys(x["size"] for x in results))
    for size in sizes:
        pa, g = get(size, "warm", "(a) plain via mount"), get(size, "warm", "gdsfs")
        if not (pa and g):
            continue
        ratio = g["samples_per_s"] / pa["samples_per_s"]
        want = TARGETS.get(size)
        if want:
            ok = ratio >= want[0] and g["samples_per_s"] >= want[1]
            tgt = f">= {want[0]:g}x" + (f" and >= {want[1]:,.0f} samples/s" if want[1] else "") + f" -> {'met' if ok else 'NOT met'}"
        else:
            tgt = "-"
        out.append(f"{size:<8} {pa['samples_per_s']:>15,.0f} {pa['GBps']:>10.2f} {g['samples_per_s']:>15,.0f} {g['GBps']:>10.2f} {ratio:>6.2f}x  {tgt}")
    for size in sizes:
        d, g, pa = get(size, "cold", "disk sequential read"), get(size, "cold", "gdsfs"), get(size, "cold", "(a) plain via mount")
        rounds = _cold_rounds(results, size)
        share = d.get("payload_share") if d else None
        if len(rounds) > 1 and share:
            # --cold-rounds: each round's gdsfs against the disk's rate measured just before it.
            # The verdict is on time: the cold epoch against the disk's time to read the same
            # files (every byte of the tars: file bytes over the disk's rate). The payload's
            # GB/s over the disk's counts only the tensors and cannot pass their share of the
            # files (tar headers, padding, .cls: 0.89 at 16 KiB).
            med = statistics.median(r[GDS] / r[SEQ] / share for r in rounds)
            out.append(f"cold {size:<8} {len(rounds)} rounds, the disk's time to read the files over the epoch's (file bytes/s over the disk's): "
                       f"{', '.join(f'{r[GDS] / r[SEQ] / share:.2f}x' for r in rounds)}; median {med:.2f}x  "
                       f"target >= {COLD_TARGET}x -> {'met' if med >= COLD_TARGET else 'NOT met'}")
            extra = [f"payload GB/s over the disk's {statistics.median(r[GDS] / r[SEQ] for r in rounds):.2f}x median (ceiling {share:.3f})"]
            for lab in sorted({k for r in rounds for k in r if k == NOHINT or k.startswith("gdsfs prefetch_factor")}):
                xs = [r[lab] / r[SEQ] / share for r in rounds if lab in r]
                extra.append(f"{lab.removeprefix('gdsfs ')} {statistics.median(xs):.2f}x median ({', '.join(f'{x:.2f}x' for x in xs)})")
            # The rate once started (the first READ to the last batch): the epoch without the
            # loader's start, which a short cold set makes a large share of the time.
            for lab in (GDS, NOHINT):
                xs = [r[f"{lab} started"] / r[SEQ] / share for r in rounds if f"{lab} started" in r]
                if xs:
                    extra.append(f"{lab.removeprefix('gdsfs').strip() or 'gdsfs'} once started (first READ to last batch) "
                                 f"{statistics.median(xs):.2f}x median ({', '.join(f'{x:.2f}x' for x in xs)})")
            par = [r for r in rounds if PARALLEL in r]
            if par:
                extra.append(f"the bare disk read the workers' way {statistics.median(r[PARALLEL] / r[SEQ] for r in par):.2f}x the sequential read "
                             f"(median), gdsfs {statistics.median(r[GDS] / share / r[PARALLEL] for r in par):.2f}x that")
            out.append(f"cold {size:<8} {'; '.join(extra)}")
        if d and g:
            r = g["GBps"] / d["GBps"]
            plain = f", plain {pa['GBps']:.2f} GB/s ({g['GBps'] / pa['GBps']:.2f}x)" if pa else ""
            w = get(size, "warm", "gdsfs")
            plain += f", gdsfs warm {w['GBps']:.2f} GB/s (cold {g['GBps'] / w['GBps']:.2f}x of it)" if w else ""
            st = get(size, "cold", STARTED)
            plain += f"; workers started: {st['GBps']:.2f} GB/s ({st['GBps'] / d['GBps']:.2f}x)" if st else ""
            share = d.get("payload_share")
            # The disk's rate counts every byte of the tars, gdsfs's only the tensors': the ratio
            # cannot pass the payload's share of the file bytes (tar headers, padding, .cls).
            plain += f"; payload is {share:.3f} of the file bytes (the ratio's ceiling), file bytes {r / share:.2f}x" if share else ""
            # With --cold-rounds the median line above gives the verdict; this one is round 1's.
            verdict = (f"target >= {COLD_TARGET}x (file bytes) -> {'met' if (r / share if share else r) >= COLD_TARGET else 'NOT met'}" if len(rounds) <= 1
                       else "(round 1; the verdict is the median's, above)")
            out.append(f"cold {size:<8} gdsfs {g['GBps']:.2f} GB/s vs disk sequential {d['GBps']:.2f} GB/s: {r:.2f}x{plain}  {verdict}")
    return out


def _cold_rounds(results: list[dict[str, Any]], size: str) -> list[dict[str, float]]:
    """Per cold round of size that timed the disk and gdsfs: GB/s by loader (SEQ, GDS, NOHINT,
    PARALLEL: those it timed)."""
    by: dict[int, dict[str, float]] = {}
    for x in results:
        if x["size"] == size and x["cache"] == "cold" and (x["loader"] in (SEQ, GDS, NOHINT, PARALLEL) or x["loader"].startswith("gdsfs prefetch_factor")):
            by.setdefault(x.get("round", 1), {})[x["loader"]] = x["GBps"]
            if "started_GBps" in x:
                by[x.get("round", 1)][f"{x['loader']} started"] = x["started_GBps"]
    return [r for _, r in sorted(by.items()) if SEQ in r and GDS in r]


class Opts:
    workers = 8
    cuda = True
    epochs = 2
    read_ahead = "auto"
    metrics = ""  # the daemon's --metrics-addr HOST:PORT, for the worker profile's daemon-side times
    drop_files: "list[str] | None" = None  # --drop-files: the files cold runs drop from the page cache
    first_batch_s = 0.0  # timed(): seconds to the last pass's first batch
    end_wall = 0.0  # timed(): time.time() at the last pass's end (its last batch on the GPU)
    per_item: "int | None" = None  # --batches-per-item: gdsfs.torch.DataLoader's batches_per_item (None: its default)


def _same_sample(sample: Any) -> Any:
    return sample


# What the "gdsfs+features" rows add to the plain gdsfs loader (issue 11): cross-shard shuffling,
# a per-sample map in the workers, field selection.
FEATURES: dict[str, Any] = {"shuffle": True, "interleave": 2, "map": _same_sample, "keys": ["x.npy", "cls"]}


def gds_loader(shards: list[str], batch: int, sample_bytes: int, features: bool = False, pin: bool = True, shared: bool = True,
               **kw: Any) -> tuple[torch.utils.data.DataLoader, gt.GDSShardDataset]:
    """GDSShardDataset and its loader: gdsfs.torch.DataLoader (its workers let a batch's adjacent
    samples share one READ range and lease) with pin, or shared=False: a stock torch DataLoader
    with gdsfs.torch.collate (one range per sample, as before issue 15's shared ranges); without
    pin: a stock DataLoader whose batches stay in daemon memory, its workers told the batch size
    as gdsfs.torch.DataLoader tells them."""
    extra = dict(FEATURES, shuffle_buffer=4 * batch) if features else {}
    if Opts.read_ahead == "batch" or (Opts.read_ahead == "auto" and sample_bytes >= (1 << 20)):
        extra.update(read_ahead=batch, read_ahead_bytes=max(batch * sample_bytes, 1 << 20))
    elif Opts.read_ahead != "auto":
        extra.update(read_ahead=int(Opts.read_ahead))
    # else (small samples): the dataset's defaults, what users get (read_ahead=64 samples, 64 MiB).
    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True, **extra)
    if pin and shared:
        if "batches_per_item" in inspect.signature(gt.DataLoader.__init__).parameters:
            kw.setdefault("batches_per_item", Opts.per_item)
        else:
            kw.pop("batches_per_item", None)
        return gt.DataLoader(ds, batch_size=batch, num_workers=Opts.workers, pin_memory=Opts.cuda, collate_fn=gt.collate, timeout=300, **kw), ds
    if shared:
        ds._batched = batch  # what gdsfs.torch.DataLoader tells its workers
    dl = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=Opts.workers, pin_memory=Opts.cuda and pin, collate_fn=gt.collate, timeout=300, **kw)
    return dl, ds


def plain_loader(shards: list[str], batch: int, **kw: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(PlainTarDataset(shards), batch_size=batch, num_workers=Opts.workers, pin_memory=Opts.cuda, timeout=300, **kw)


def timed(dl: torch.utils.data.DataLoader, plain: bool) -> tuple[float, int, int]:
    """(seconds, samples, payload bytes) of one full pass, batches on the
    GPU (on the CPU with --cpu)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if Opts.cuda else torch.device("cpu")
    n = nbytes = 0
    t0 = time.perf_counter()
    Opts.first_batch_s = 0.0
    for b in dl:
        if not n:
            Opts.first_batch_s = time.perf_counter() - t0
        if isinstance(b, gt.GDSBatch) and not b.materialized:
            b = b.materialize()  # --cpu: no pin-memory thread does it
        x = b["x.npy"]
        if plain and Opts.cuda:
            x = x.cuda(non_blocking=True)
        if x.device != dev:
            raise RuntimeError(f"batch tensor on {x.device}, expected {dev}")
        n += x.shape[0]
        nbytes += x.numel() * x.element_size()
    if Opts.cuda:
        torch.cuda.synchronize()
    Opts.end_wall = time.time()
    return time.perf_counter() - t0, n, nbytes


def _record_pid(piddir: str, _worker_id: int) -> None:
    open(os.path.join(piddir, str(os.getpid())), "w").close()


def _time_first_read(d: str, _worker_id: int) -> None:
    """worker_init_fn of the cold runs: writes d/PID with the wall-clock times this worker
    started and sent its first READ (what of a fresh loader's first batch is worker start and
    planning, and what the disk)."""
    from gdsfs import _core

    started, real = time.time(), _core.Session.read

    def read(self: Any, *args: Any, **kw: Any) -> Any:
        if _core.Session.read is read:
            _core.Session.read = real  # type: ignore[method-assign]
            with open(os.path.join(d, str(os.getpid())), "w") as f:
                f.write(f"{started} {time.time()}")
        return real(self, *args, **kw)

    _core.Session.read = read  # type: ignore[method-assign]


def _first_reads(d: str, t0: float) -> tuple[str, float]:
    """The cold run's worker start and first READ times (from _time_first_read), first-last;
    and the first READ's time.time() (0: none recorded)."""
    st: list[float] = []
    rd: list[float] = []
    for name in os.listdir(d):
        with open(os.path.join(d, name)) as f:
            a, b = (float(x) for x in f.read().split())
        st.append(a - t0)
        rd.append(b - t0)
    shutil.rmtree(d, ignore_errors=True)
    if not st:
        return "no worker READ recorded", 0.0
    return f"workers started after {min(st):.3f}-{max(st):.3f} s, their first READs after {min(rd):.3f}-{max(rd):.3f} s", min(rd) + t0


def correctness(shards: list[str], batch: int, sample_bytes: int, ref: dict[str, str]) -> list[str]:
    """Errors found checking values, once-only delivery and worker contexts."""
    errs: list[str] = []
    piddir = tempfile.mkdtemp(prefix="gdsfs-workers-")
    dl, ds = gds_loader(shards, batch, sample_bytes, persistent_workers=True, worker_init_fn=functools.partial(_record_pid, piddir))
    seen: dict[str, str] = {}
    for b in dl:
        if not Opts.cuda:
            b = b.materialize()
        x = b["x.npy"]
        if not (isinstance(x, torch.Tensor) and x.is_cuda == Opts.cuda):
            errs.append(f"batch field x.npy is {type(x).__name__} on {getattr(x, 'device', '?')}, not a CUDA tensor")
            break
        host = x.cpu().numpy()
        for i, key in enumerate(b["__key__"]):
            if key in seen:
                errs.append(f"sample {key} delivered twice")
            seen[key] = hashlib.sha256(host[i].tobytes()).hexdigest()
    bad = [k for k in ref if seen.get(k) != ref[k]]
    if bad:
        errs.append(f"{len(bad)} samples differ from the plain-read reference or are missing (e.g. {bad[:3]})")
    extra = set(seen) - set(ref)
    if extra:
        errs.append(f"{len(extra)} unexpected samples (e.g. {sorted(extra)[:3]})")
    # Workers are alive (persistent_workers): ask the driver who has contexts.
    workers = {int(p) for p in os.listdir(piddir)}
    try:
        if not Opts.cuda:
            raise StopIteration
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
        ctx = {int(x) for x in q.stdout.split() if x.strip().isdigit()}
        if os.getpid() not in ctx:
            log(f"warning: nvidia-smi does not list this process ({os.getpid()}) among {sorted(ctx)}: pid namespaces? worker check is then inconclusive")
        if workers & ctx:
            errs.append(f"DataLoader workers {sorted(workers & ctx)} hold CUDA contexts")
        log(f"workers {sorted(workers)}; processes with CUDA contexts {sorted(ctx)}")
    except StopIteration:
        pass
    except (OSError, subprocess.TimeoutExpired) as e:
        errs.append(f"nvidia-smi failed ({e}): cannot check worker contexts")
    del dl
    ds.close()
    st = gdsfs.status(shards[0])
    log(f"daemon after correctness run: sessions={st.get('sessions')} leases={st.get('leases')}")
    return errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mountpoint")
    ap.add_argument("backing")
    ap.add_argument("--quick", action="store_true", help="smaller datasets (a smoke test)")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--cpu", action="store_true", help="no GPU: host-mode mount, CPU tensors")
    ap.add_argument("--workers", type=int, default=8, help="DataLoader workers (default 8)")
    ap.add_argument("--epochs", type=int, default=2, help="warm: timed epochs after the warm-up epoch, best counts (default 2)")
    ap.add_argument("--sizes", default="100,4096", help="sample sizes in KiB, comma-separated (default 100,4096; issue 15: 16,64,256,4096)")
    ap.add_argument("--batch", type=int, default=0, help="batch size for every size (default: 64 below 1 MiB, 8 above)")
    ap.add_argument("--no-features", action="store_true", help="skip the gdsfs+features loader")
    ap.add_argument("--cold-prefetch", type=int, default=0, metavar="N",
                    help="also time, in every cold round of samples under 256 KiB, gdsfs with DataLoader(prefetch_factor=N) (batches; "
                         "the default is torch's 2, which with k batches per item is one item per worker): how much a deeper queue per "
                         "worker absorbs the disk's stalls")
    ap.add_argument("--batches-per-item", default=os.environ.get("GDSFS_BATCHES_PER_ITEM", "auto"),
                    help="gdsfs.torch.DataLoader's batches_per_item for the gdsfs loaders: auto (its default) or a number; "
                         "env GDSFS_BATCHES_PER_ITEM (the main profile and the 'gdsfs one batch per item' row always show 1 too)")
    ap.add_argument("--probes", action=argparse.BooleanOptionalAction, default=True,
                    help="below 1 MiB samples, also measure the daemon alone and the loader's two halves apart (default on)")
    ap.add_argument("--read-ahead", default="auto",
                    help="GDSShardDataset read_ahead: auto (the dataset's defaults below 1 MiB samples, the batch size above), batch "
                         "(read_ahead=batch, read_ahead_bytes=batch*sample: every size as before issue 15) or a number of samples")
    ap.add_argument("--worker-profile", action=argparse.BooleanOptionalAction, default=True,
                    help="below 1 MiB samples, also profile one worker's loop in this process (cProfile, READ ioctl time) and time "
                         "each worker of the real loader (default on)")
    ap.add_argument("--metrics", default="", help="the daemon's --metrics-addr (HOST:PORT): the worker profile adds the daemon's own time per READ")
    ap.add_argument("--features-sizes", default="", help="sizes in KiB that run the gdsfs+features loader (default: every size)")
    ap.add_argument("--drop-files", action="store_true",
                    help="cold runs drop only the shards' own pages (posix_fadvise DONTNEED on the backing files and the mount's) "
                         "instead of the whole page cache (/proc/sys/vm/drop_caches): for a machine shared with others")
    ap.add_argument("--cold-rounds", type=int, default=1,
                    help="cold runs per size (default 1): the disk's rate, gdsfs and plain (a) are timed again in each round, and the "
                         "cold target compares the median of each round's gdsfs/disk ratio (this machine's cold figures wander by 0.2x between runs)")
    ap.add_argument("--cold-only", action="store_true",
                    help="after the correctness run, the cold runs (disk sequential read, then each loader with the page cache dropped) "
                         "and of the warm runs only gdsfs's (what bounds cold where the loader, not the disk, is the limit): no probes or "
                         "worker profile (issue 15's cold target in a few minutes)")
    ap.add_argument("--cold-gib", type=float, default=None, metavar="G",
                    help="GiB of samples (payload) each size's cold runs read (default 2, with --quick the warm set): an epoch long "
                         "against the loader's start; the warm runs keep their set (about 1 GiB, 512 MiB at 16 KiB, 2 GiB at 4 MiB), "
                         "the first shards of the cold one")
    ap.add_argument("--cold-plain", action=argparse.BooleanOptionalAction, default=True,
                    help="cold rounds also time the plain loaders (a) and (b) (default on; 2 GiB of 16 KiB samples take them 15-20 s each)")
    a = ap.parse_args()
    if a.cold_gib is not None and not a.cold_gib > 0:
        ap.error(f"--cold-gib {a.cold_gib} must be more than 0 (GiB of samples per size)")
    Opts.workers, Opts.cuda, Opts.epochs, Opts.read_ahead = a.workers, not a.cpu, max(1, a.epochs), a.read_ahead
    Opts.metrics = a.metrics
    if a.batches_per_item != "auto" and not (a.batches_per_item.isdigit() and int(a.batches_per_item) >= 1):
        ap.error(f"--batches-per-item {a.batches_per_item!r} is not auto or a number >= 1")
    Opts.per_item = None if a.batches_per_item == "auto" else int(a.batches_per_item)
    if a.read_ahead not in ("auto", "batch") and not a.read_ahead.isdigit():
        ap.error(f"--read-ahead {a.read_ahead!r} is not auto, batch or a number of samples")
    if Opts.cuda and not torch.cuda.is_available():
        print("dataset_check: torch sees no CUDA device: run this on the GPU machine, or pass --cpu", file=sys.stderr)
        return 2
    try:
        caps = gdsfs.capabilities(a.mountpoint)
    except gdsfs.GDSUnavailableError as e:
        print(f"dataset_check: {e}", file=sys.stderr)
        return 2
    log(f"mount {caps.mount}: engine={caps.engine} devices={caps.devices} reason={caps.reason!r} version={caps.daemon_version}")

    sizes = []
    for kib in (int(x) for x in a.sizes.split(",") if x.strip()):
        sb = kib << 10
        # About 1 GiB per size (512 MiB at 16 KiB, 2 GiB at 4 MiB), a sixteenth with --quick.
        ns = min(32768, max(512, (1 << 30) // sb))
        if a.quick:
            ns = max(128, ns // 16)
        ns -= ns % 16
        name = f"{kib // 1024}MiB" if kib % 1024 == 0 else f"{kib}KiB"
        # The cold set: whole shards of the warm set's size (ns / 16 samples each), the warm set
        # its first 16 (both written at once, the cold set's extra shards after the warm's).
        per = ns // 16
        gib = a.cold_gib if a.cold_gib is not None else (ns * sb / 2**30 if a.quick else 2.0)
        cold_shards = max(1, round(gib * 2**30 / (per * sb)))
        sizes.append((name, sb, ns, 16, a.batch or (64 if sb < (1 << 20) else 8), cold_shards))
    root_m = os.path.join(a.mountpoint, SUBDIR)
    root_b = os.path.join(a.backing, SUBDIR)
    # Every size's shards first, while this process has no CUDA context (make_dataset forks).
    made = {name: make_dataset(root_m, name, sb, ns // nsh * max(nsh, csh), max(nsh, csh)) for name, sb, ns, nsh, _b, csh in sizes}
    if Opts.cuda:
        torch.cuda.init()
        torch.cuda.set_device(0)
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    can_drop = True
    hint_env = os.environ.get(START_HINT_ENV)
    probes: list[tuple[str, dict[str, float], dict[str, float]]] = []
    for name, sb, ns, nsh, batch, csh in sizes:
        all_m = made[name]
        all_b = [os.path.join(root_b, name, os.path.basename(p)) for p in all_m]
        shards_m, shards_b = all_m[:nsh], all_b[:nsh]  # the warm set (and the correctness run's)
        cold_m, cold_b, cold_ns = all_m[:csh], all_b[:csh], ns // nsh * csh
        disk = DiskStat(shards_b[0])
        for pm, pb in zip(all_m, all_b):
            if not os.path.exists(pb) or os.path.getsize(pb) != os.path.getsize(pm):
                print(f"dataset_check: {pb} does not match {pm}: BACKING_DIR must be the directory the mount serves", file=sys.stderr)
                return 2
        log(f"{name}: warm set {ns} samples in {nsh} shards ({ns * sb / 2**30:.2f} GiB), cold set {cold_ns} samples in {csh} shards "
            f"({cold_ns * sb / 2**30:.2f} GiB, {sum(os.path.getsize(p) for p in cold_b) / 2**30:.2f} GiB of files)")
        if a.drop_files:
            Opts.drop_files = all_b + all_m
        ref = reference(shards_b)
        try:
            errs = correctness(shards_m, batch, sb, ref)
        except Exception as e:  # noqa: BLE001 - report and go on to the benchmark
            errs = [f"correctness run failed: {type(e).__name__}: {e}"]
        errors += [f"{name}: {e}" for e in errs]
        log(f"{name} correctness: {'ok' if not errs else '; '.join(errs)}")
        if a.probes and sb < (1 << 20) and not a.cold_only:
            try:
                dp = daemon_probe(shards_m)
                mp = main_probe(shards_m, batch, sb)
                log(f"{name} probes (samples/s): daemon alone, {Opts.workers} threads x READ of 64 ranges {dp.get('ranges', 0):,.0f}, "
                    f"as one range per 64 samples {dp.get('coalesced', 0):,.0f}; loader halves: workers+daemon+unpickle {mp['workers']:,.0f}, "
                    f"main-process materialize {mp['main']:,.0f}")
                probes.append((name, dp, mp))
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                log(f"{name} probes failed: {type(e).__name__}: {e}")
        if a.worker_profile and sb < (1 << 20) and not a.cold_only:
            try:
                for line in worker_profile(shards_m, batch, sb):
                    log(f"{name} worker profile: {line}")
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                log(f"{name} worker profile failed: {type(e).__name__}: {e}")
            for legacy, per_item in ((False, None), (False, 1), (True, 1)):
                tag = "main profile" + (" (before: torch's pin-memory thread, a RELEASE per batch)" if legacy else
                                        " (before: one batch per worker item)" if per_item == 1 else "")
                try:
                    for line in main_profile(shards_m, batch, sb, legacy=legacy, per_item=per_item):
                        log(f"{name} {tag}: {line}")
                except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                    log(f"{name} {tag} failed: {type(e).__name__}: {e}")
        feats = not a.no_features and (not a.features_sizes or str(sb >> 10) in a.features_sizes.split(","))
        for rnd, cache in enumerate(["warm"] + ["cold"] * a.cold_rounds):
            # The cold runs read the cold set (--cold-gib), the warm runs the warm set.
            sm, sbk, want_n = (cold_m, cold_b, cold_ns) if cache == "cold" else (shards_m, shards_b, ns)
            if cache == "cold" and rnd == 1 and csh > nsh and can_drop and drop_caches():
                # The cold set's shards past the warm set's have never been indexed: the first
                # round's dataset would index them (reading every tar header, on a cold disk
                # most of the file: 2.4 s for 64 shards of 16 KiB samples at 14:20 UTC) before
                # its timed epoch, leaving their bytes cached for it (that round read 1.47x the
                # disk). Indexed once here, as any earlier use of the dataset leaves the
                # daemon's index cache; the time is the cold first construction's.
                t0 = time.perf_counter()
                gt.GDSShardDataset(cold_m, gpu_keys=["x.npy"], strict=True).close()
                log(f"{name} cold index: the first construction over the cold set ({csh} shards, page cache dropped) "
                    f"took {time.perf_counter() - t0:.2f} s (the daemon indexes each tar once and keeps the index)")
            if cache == "cold" and can_drop and drop_caches():
                # The disk's sequential read rate over the same shards, for the cold target.
                disk.start()
                rate = disk_rate(sbk)
                share = want_n * sb / sum(os.path.getsize(p) for p in sbk)
                results.append({"size": name, "cache": "cold", "loader": "disk sequential read", "seconds": 0.0, "samples": 0, "samples_per_s": 0.0, "GBps": rate,
                                "payload_share": share, "round": rnd})
                log(f"{name} cold disk sequential read: {rate:.2f} GB/s; {disk.line()}")
                if drop_caches():
                    # The same bytes read the way the workers read them (their blocks of shards in
                    # parallel), on the bare disk.
                    chunk = min(64 << 20, max(batch * sb, 2 << 20))
                    disk.start()
                    prate = disk_rate_parallel(sbk, Opts.workers, chunk)
                    results.append({"size": name, "cache": "cold", "loader": PARALLEL, "seconds": 0.0, "samples": 0, "samples_per_s": 0.0, "GBps": prate,
                                    "round": rnd})
                    log(f"{name} cold {PARALLEL} ({Opts.workers} streams of {chunk >> 20} MiB preads): {prate:.2f} GB/s "
                        f"({prate / rate:.2f}x the sequential read); {disk.line()}")
            plains = cache == "warm" or a.cold_plain
            runs = [
                ("gdsfs", lambda **kw: gds_loader(sm, batch, sb, **kw)[0], False),
                *([] if not (cache == "warm" and sb < (1 << 20)) else
                  [("gdsfs range per sample", lambda **kw: gds_loader(sm, batch, sb, shared=False, **kw)[0], False),
                   ("gdsfs one batch per item", lambda **kw: gds_loader(sm, batch, sb, batches_per_item=1, **kw)[0], False)]),
                *([] if not feats else [("gdsfs+features", lambda **kw: gds_loader(sm, batch, sb, features=True, **kw)[0], False)]),
                *([] if cache != "cold" else [(STARTED, lambda **kw: gds_loader(sm, batch, sb, **kw)[0], False)]),
                *([] if cache != "cold" else [(NOHINT, lambda **kw: gds_loader(sm, batch, sb, **kw)[0], False)]),
                *([] if cache != "cold" or not a.cold_prefetch or sb >= (256 << 10) else
                  [(f"gdsfs prefetch_factor {a.cold_prefetch}", lambda **kw: gds_loader(sm, batch, sb, prefetch_factor=a.cold_prefetch, **kw)[0], False)]),
                *([] if not plains else [("(a) plain via mount", lambda **kw: plain_loader(sm, batch, **kw), True),
                                         ("(b) plain backing dir", lambda **kw: plain_loader(sbk, batch, **kw), True)]),
            ]
            if cache == "cold" and rnd % 2 == 0:
                # Every other round the hint's A/B runs the other way round: a disk that serves
                # what it read a moment ago faster (a host's cache under a virtual disk) must not
                # favour one side.
                nh = next(i for i, r in enumerate(runs) if r[0] == NOHINT)
                runs.insert(0, runs.pop(nh))
            for label, make, plain in runs:
                if a.cold_only and cache == "warm" and label != "gdsfs":
                    continue
                if rnd > 1 and label not in ("gdsfs", NOHINT, "(a) plain via mount") and not label.startswith("gdsfs prefetch_factor"):
                    continue  # --cold-rounds: later rounds time what the cold target compares
                # The start hint (GDSFS_START_HINT) as the caller set it, off for the NOHINT row.
                _start_hint_env(hint_env, label == NOHINT)
                extra_row: dict[str, float] = {}
                try:
                    if cache == "warm":
                        # Steady state, as in multi-epoch training: one loader with
                        # persistent workers; the first epoch fills the page cache
                        # (and the index cache) and starts the workers, then the
                        # best of Opts.epochs epochs counts.
                        dl = make(persistent_workers=True)
                        timed(dl, plain)
                        secs, n, nb = min(timed(dl, plain) for _ in range(Opts.epochs))
                        del dl
                    elif label == STARTED:
                        # Cold data, started workers (a dataset larger than the page cache,
                        # epoch 2): the first epoch starts the workers and plans every sample,
                        # then the page cache is dropped and the second epoch counts.
                        dl = make(persistent_workers=True)
                        timed(dl, plain)
                        if not drop_caches():
                            continue
                        before = _readahead_counters(sm[0])
                        disk.start()
                        secs, n, nb = timed(dl, plain)
                        log(f"{name} cold {label}: {disk.line()}")
                        del dl
                        after = _readahead_counters(sm[0])
                        log(f"{name} cold {label}: the daemon read ahead {after[0] - before[0]} windows, "
                            f"{(after[1] - before[1]) / 2**20:,.0f} MiB")
                    elif not (can_drop and drop_caches()):
                        can_drop = False
                        continue
                    else:
                        before = _readahead_counters(sm[0])
                        reads_dir, t0 = tempfile.mkdtemp(prefix="gdsfs-first-reads-"), time.time()
                        disk.start()
                        secs, n, nb = timed(make() if plain else make(worker_init_fn=functools.partial(_time_first_read, reads_dir)), plain)
                        log(f"{name} cold {label}: {disk.line()}")
                        log(f"{name} cold {label}: first batch after {Opts.first_batch_s:.3f} s (worker start, planning, the first READs)")
                        if not plain:
                            line, first = _first_reads(reads_dir, t0)
                            log(f"{name} cold {label}: {line} (from the dataset's construction)")
                            span, built = Opts.end_wall - first, Opts.end_wall - t0
                            if first and span > 0:
                                # The epoch once the disk is asked for its bytes, beside the whole
                                # pass (the row's rate, from iter()) and from the construction.
                                extra_row = {"started_s": span, "started_GBps": nb / span / 1e9, "built_GBps": nb / built / 1e9}
                                log(f"{name} cold {label}: {nb / span / 1e9:.2f} GB/s once started (the first READ to the last batch, {span:.2f} s); "
                                    f"{nb / secs / 1e9:.2f} GB/s from iter() ({secs:.2f} s), {nb / built / 1e9:.2f} GB/s from the dataset's "
                                    f"construction ({built:.2f} s)")
                        else:
                            shutil.rmtree(reads_dir, ignore_errors=True)
                        if not plain:
                            after = _readahead_counters(sm[0])
                            log(f"{name} cold {label}: the daemon read ahead {after[0] - before[0]} windows, "
                                f"{(after[1] - before[1]) / 2**20:,.0f} MiB ({after[2] - before[2]} dropped: enough in flight)")
                except Exception as e:  # noqa: BLE001 - one failed run must not hide the others
                    errors.append(f"{name} {cache} {label}: {type(e).__name__}: {e}")
                    log(errors[-1])
                    continue
                if n != want_n:
                    errors.append(f"{name} {cache} {label}: {n} samples, expected {want_n}")
                results.append({"size": name, "cache": cache, "loader": label, "seconds": secs, "samples": n, "samples_per_s": n / secs, "GBps": nb / secs / 1e9,
                                "round": rnd, **extra_row})
                log(f"{name} {cache} {label}: {n / secs:.0f} samples/s, {nb / secs / 1e9:.2f} GB/s")

    _start_hint_env(hint_env, False)
    gc.collect()
    deadline = time.monotonic() + 10
    while (leases := int(gdsfs.status(a.mountpoint).get("leases", 0))) and time.monotonic() < deadline:
        time.sleep(0.1)
    if leases:
        errors.append(f"{leases} leases still held after every loader is gone")

    print()
    print(f"{'sample':<8} {'cache':<5} {'loader':<22} {'samples/s':>10} {'GB/s':>7} {'vs (b)':>7}")
    for r in results:
        if not r["samples"]:
            continue
        base = next((x for x in results if x["size"] == r["size"] and x["cache"] == r["cache"] and x["loader"].startswith("(b)")), None)
        ratio = f"{r['GBps'] / base['GBps']:.2f}x" if base else "-"
        # --cold-rounds: later rounds' rows say which (their "vs (b)" is round 1's (b)).
        cache = r["cache"] if r.get("round", 1) <= 1 or r["cache"] != "cold" else f"cold{r['round']}"
        print(f"{r['size']:<8} {cache:<5} {r['loader']:<22} {r['samples_per_s']:>10.0f} {r['GBps']:>7.2f} {ratio:>7}")
    g = next((x for x in results if x["size"] == "4MiB" and x["cache"] == "warm" and x["loader"] == "gdsfs"), None)
    b = next((x for x in results if x["size"] == "4MiB" and x["cache"] == "warm" and x["loader"].startswith("(b)")), None)
    if g and b:
        ratio = g["GBps"] / b["GBps"]
        print(f"target gdsfs >= 2x (b) for 4 MiB warm: {ratio:.2f}x -> {'met' if ratio >= 2 else 'NOT met'}")
    pa = next((x for x in results if x["size"] == "4MiB" and x["cache"] == "warm" and x["loader"].startswith("(a)")), None)
    if g and pa:
        ratio = g["GBps"] / pa["GBps"]
        print(f"target gdsfs >= 8x (a) plain IterableDataset for 4 MiB warm (issue 11): {ratio:.2f}x -> {'met' if ratio >= 8 else 'NOT met'}")
    f = next((x for x in results if x["size"] == "4MiB" and x["cache"] == "warm" and x["loader"] == "gdsfs+features"), None)
    if f and g:
        print(f"gdsfs+features (shuffle_buffer, interleave=2, map, keys=) vs gdsfs, 4 MiB warm: {f['GBps'] / g['GBps']:.2f}x")
    for line in issue_table(results):
        print(line)
    if probes:
        print(f"\nwhere the time goes, samples/s of each part alone (the slowest part bounds the loader): daemon alone = {Opts.workers} "
              "threads READ+RELEASE of 64 ranges (or one range per 64 samples; fewer when shards are smaller); workers = batches produced and unpickled here, "
              "left in daemon memory; main = this process materializing them as the pin-memory thread does")
        print(f"{'sample':<8} {'daemon 64 ranges':>16} {'daemon 1 range':>14} {'workers':>10} {'main':>10} {'loader':>10}")
        for name, dp, mp in probes:
            g = next((x for x in results if x["size"] == name and x["cache"] == "warm" and x["loader"] == "gdsfs"), None)
            print(f"{name:<8} {dp.get('ranges', 0):>16,.0f} {dp.get('coalesced', 0):>14,.0f} {mp['workers']:>10,.0f} {mp['main']:>10,.0f} "
                  f"{(g['samples_per_s'] if g else 0):>10,.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"engine": caps.engine, "results": results, "errors": errors}, f, indent=1)
    for e in errors:
        print(f"dataset_check: FAIL: {e}")
    print(f"dataset_check: {'PASS' if not errors else 'FAIL'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
