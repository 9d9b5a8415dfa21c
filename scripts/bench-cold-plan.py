#!/usr/bin/env python3
"""Cold small samples: a fresh loader's first batch and cold pass against the disk (issue 15).

Usage: bench-cold-plan.py [--sizes 16,64,256] [--mib 128] [--workers 2] [--batch 16]
                          [--reps 3] [--compare PKGDIR] [--json PATH]

Writes WebDataset tars of float32 .npy samples (plus a .cls) on a host-mode gdsfs mount of its
own, has the daemon index them (one pass, as a training job's first epoch or the dataset's
construction does), then per size and repetition, interleaved:

- the disk's sequential read of the same files, their pages dropped first (posix_fadvise
  DONTNEED on this run's files only; 8 MiB reads, as dd), in GB/s of file bytes;
- a fresh GDSShardDataset + gdsfs.torch.DataLoader with the shards' pages dropped: seconds to the
  first batch (worker start, planning, the first READs), samples/s and GB/s of tensor payload of
  the whole pass (first batch included), and the pread calls its workers made to learn npy
  headers (preads of at most 4 KiB at an x.npy member's start, counted in each worker).

A warm row follows: the same fresh loader with the shards cached (where cold is no slower, the
loader, not the disk, bounds it). --one-process REPS adds one process's view (num_workers=0) of
one cold shard: time to the first sample, samples/s, and the time in preads and READs, planned
from the index's npy_headers or with them taken away (each header pread, as before), interleaved.

--compare PKGDIR also runs the loader with the gdsfs package in PKGDIR (e.g. an older commit's
python/ from `git archive`) in a child process, interleaved with this tree's, against the same
daemon, or with --compare-bin BIN against a second mount of the same files served by BIN (the
older commit's binary): before/after from one run. Prints the best of --reps per row.

--trace PATH (with --blkio) records each cold pass: the device's sectors read every 2 ms
(/sys/dev/block/M:m/stat, what the disk served after the cgroup's limit) and each worker's READs
(start, end, shard, offsets); it prints the disk's MB/s per 100 ms and each worker's READ wait,
and writes the traces as JSON (where the disk sat idle: at a shard's end, at the pass's end).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _bench_dataset() -> Any:
    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _npy_starts(backing: list[str]) -> dict[str, set[int]]:
    """Per shard file name, the data offsets of its x.npy members (where a header pread lands)."""
    out: dict[str, set[int]] = {}
    for p in backing:
        with tarfile.open(p) as tf:
            out[os.path.basename(p)] = {m.offset_data for m in tf if m.name.endswith(".x.npy")}
    return out


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One cold pass of a fresh loader with the package job["pkg"]; runs in its own process."""
    sys.path.insert(0, job["pkg"])
    import torch.utils.data

    import gdsfs.torch as gt

    starts = {k: set(v) for k, v in job["starts"].items()}
    tracing = bool(job.get("trace"))
    countdir = tempfile.mkdtemp(prefix="coldplan-preads-")

    def init(_wid: int) -> None:
        # Count this worker's header preads: at most 4 KiB at an x.npy member's first byte.
        real = os.pread
        names: dict[int, str] = {}
        counts = [0, 0]
        # With job["trace"]: each READ's (start, end, shard file, lowest offset, highest end, ranges).
        reads: list[tuple[float, float, str, int, int, int]] = []
        # When this worker started and sent its first READ (wall clock, against the pass's start).
        times = [time.time(), 0.0]
        from gdsfs import _core

        real_read = _core.Session.read

        def read(self: Any, *args: Any, **kw: Any) -> Any:
            t = time.time()
            if not times[1]:
                times[1] = t
            try:
                return real_read(self, *args, **kw)
            finally:
                if tracing:
                    fd, ranges = args[0], args[1]
                    rs = [r for r in ranges if r[1]]
                    if rs:
                        reads.append((t, time.time(), names_of(fd), min(o for o, _ in rs), max(o + n for o, n in rs), len(rs)))

        _core.Session.read = read  # type: ignore[assignment]

        def names_of(fd: Any) -> str:
            fd = fd if isinstance(fd, int) else fd.fileno()
            name = names.get(fd)
            if name is None:
                try:
                    name = names[fd] = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    name = names[fd] = ""
            return name

        def pread(fd: int, n: int, off: int) -> bytes:
            name = names_of(fd)
            counts[1] += 1
            if n <= 4096 and off in starts.get(name, ()):
                counts[0] += 1
            return real(fd, n, off)

        def save() -> None:
            with open(os.path.join(countdir, str(os.getpid())), "w") as f:
                f.write(f"{counts[0]} {counts[1]} {times[0]} {times[1]}")
            if tracing:
                with open(os.path.join(countdir, f"{os.getpid()}.reads"), "w") as f:
                    json.dump(reads, f)

        os.pread = pread  # type: ignore[assignment]
        multiprocessing.util.Finalize(None, save, exitpriority=100)  # run as the worker exits

    import gdsfs

    bd = _bench_dataset()
    if job.get("drop", True):
        bd.drop(job["backing"] + job["shards"])
    names = ("reads", "read_ranges", "read_bytes", "readaheads", "readahead_bytes", "readahead_dropped")
    c0 = gdsfs.status(job["shards"][0]).get("counters", {})
    disk: list[tuple[float, int, int]] = []
    stop = threading.Event()
    sampler = None
    if tracing and job.get("blkio"):
        # The disk's reads of this run's cgroup over time (every 2 ms): where it sat idle.
        # The device's own count of sectors read (/sys/dev/block/M:m/stat): what it served,
        # after the cgroup's limit let the reads through (the cgroup's counters count them as
        # they are submitted); the whole device, so other readers of it count too.
        st = os.stat(job["backing"][0]).st_dev
        statp = f"/sys/dev/block/{os.major(st)}:{os.minor(st)}/stat"

        def sample() -> None:
            while not stop.is_set():
                with open(statp) as f:
                    w = f.read().split()
                disk.append((time.time(), int(w[0]), int(w[2]) * 512))
                stop.wait(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    t0, wall0 = time.perf_counter(), time.time()
    ds = gt.GDSShardDataset(job["shards"], gpu_keys=["x.npy"], strict=True)
    built = time.perf_counter() - t0
    dl = gt.DataLoader(ds, batch_size=job["batch"], num_workers=job["workers"], worker_init_fn=init)
    n = nb = 0
    first = 0.0
    for b in dl:
        x = b["x.npy"]
        if not n:
            first = time.perf_counter() - t0
        n += x.shape[0]
        nb += x.numel() * x.element_size()
    secs = time.perf_counter() - t0
    if sampler is not None:
        stop.set()
        sampler.join()
    c1 = gdsfs.status(job["shards"][0]).get("counters", {})
    del dl
    ds.close()
    if n != job["nsamples"]:
        raise RuntimeError(f"cold pass: {n} samples, expected {job['nsamples']}")
    hdr = total = 0
    started: list[float] = []
    first_read: list[float] = []
    trace: list[Any] = []
    for name in sorted(os.listdir(countdir)):
        if name.endswith(".reads"):
            with open(os.path.join(countdir, name)) as f:
                trace += [[r[0] - wall0, r[1] - wall0, *r[2:], name.split(".")[0]] for r in json.load(f)]
            continue
        a, b_, ti, tr = open(os.path.join(countdir, name)).read().split()
        hdr, total = hdr + int(a), total + int(b_)
        started.append(float(ti) - wall0)
        if float(tr):
            first_read.append(float(tr) - wall0)
    shutil.rmtree(countdir, ignore_errors=True)
    _ = torch.utils.data  # the loader's module, imported for its workers
    return {"first_s": first, "secs": secs, "samples_per_s": n / secs, "GBps": nb / secs / 1e9, "header_preads": hdr, "preads": total,
            "built_s": built, "workers_started_s": sorted(started), "first_reads_s": sorted(first_read),
            "daemon": {k: int(c1.get(k, 0)) - int(c0.get(k, 0)) for k in names},
            **({"trace": {"reads": sorted(trace), "disk": [(t - wall0, n, b) for t, n, b in disk], "secs": secs}} if tracing else {})}


def one_process(job: dict[str, Any], reps: int) -> dict[str, Any]:
    """In this process, interleaved: a fresh dataset's pass over one cold shard (num_workers=0),
    planned from the index's npy_headers ("after") or with them taken away, so that each header
    is pread as before ("before"). Medians of (first sample ms, samples/s, pread ms, READ ms)."""
    import statistics

    import gdsfs.torch as gt
    from gdsfs import _core

    bd = _bench_dataset()
    shard, backing = job["shards"][:1], job["backing"][:1]
    res: dict[str, list[tuple[float, float, float, float]]] = {"before": [], "after": []}
    real_pread, real_read = os.pread, _core.Session.read
    for rep in range(reps):
        for label in ("after", "before") if rep % 2 == 0 else ("before", "after"):
            ds = gt.GDSShardDataset(shard, gpu_keys=["x.npy"], strict=True)
            if label == "before":
                for st in ds._open.values():
                    st.npy_headers = []
            t = {"pread": 0.0, "read": 0.0}

            def pread(fd: int, n: int, off: int) -> bytes:
                t0 = time.perf_counter()
                try:
                    return real_pread(fd, n, off)
                finally:
                    t["pread"] += time.perf_counter() - t0

            def read(self: Any, *a: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return real_read(self, *a, **kw)
                finally:
                    t["read"] += time.perf_counter() - t0

            bd.drop(backing + shard)
            os.pread, _core.Session.read = pread, read  # type: ignore[assignment]
            try:
                t0 = time.perf_counter()
                it = iter(ds)
                next(it)
                t1 = time.perf_counter()
                k = 1 + sum(1 for _ in it)
                t2 = time.perf_counter()
            finally:
                os.pread, _core.Session.read = real_pread, real_read  # type: ignore[assignment]
            ds.close()
            res[label].append((t1 - t0, k / (t2 - t0), t["pread"], t["read"]))
    return {label: [statistics.median(r[i] for r in rs) for i in range(4)] for label, rs in res.items()}


def blkio_reads(d: str, path: str) -> tuple[int, int]:
    """(read requests, read bytes) the disk holding path served for the blkio cgroup d so far."""
    st = os.stat(path).st_dev
    dev = f"{os.major(st)}:{os.minor(st)}"
    out = []
    for name in ("blkio.throttle.io_serviced", "blkio.throttle.io_service_bytes"):
        with open(os.path.join(d, name)) as f:
            out.append(sum(int(w[2]) for w in (ln.split() for ln in f) if len(w) == 3 and w[0] == dev and w[1] == "Read"))
    return out[0], out[1]


def trace_summary(tr: dict[str, Any], bin_s: float = 0.1) -> str:
    """One cold pass's trace in a few lines: the disk's bytes per bin_s over the pass (where it
    sat idle: bins below half the pass's busiest), and per worker the time its READs waited."""
    disk, reads = tr["disk"], tr["reads"]
    if len(disk) < 2:
        return "trace: no disk samples"
    end = disk[-1][0]
    nb = int(end / bin_s) + 1
    bins = [0] * nb
    for (t0, _n0, b0), (t1, _n1, b1) in zip(disk, disk[1:]):
        t0 = max(0.0, t0)
        if t1 <= t0 or b1 == b0:
            continue
        at = t0
        while at < t1:  # the bytes spread over the interval between two samples
            i = min(nb - 1, int(at / bin_s))
            nxt = min(t1, (i + 1) * bin_s)
            bins[i] += (b1 - b0) * (nxt - at) / (t1 - t0)
            at = nxt if nxt > at else t1
    top = max(bins) or 1
    first = min((r[0] for r in reads), default=0.0)
    busy = [b for i, b in enumerate(bins) if i * bin_s >= first]
    idle = sum(1 for b in busy if b < top / 2) * bin_s
    rate = " ".join(f"{b / bin_s / 1e6:.0f}" for b in bins)
    per: dict[str, list[float]] = {}
    for r in reads:
        per.setdefault(r[6], []).append(r[1] - r[0])
    waits = " ".join(f"{sum(v):.2f}/{max(v):.3f}" for _k, v in sorted(per.items()))
    return (f"trace: pass {tr['secs']:.2f} s, first READ at {first:.3f} s, the disk's busiest {bin_s * 1e3:.0f} ms "
            f"{top / bin_s / 1e6:.0f} MB/s, {idle:.2f} s of bins below half of it after the first READ\n"
            f"  disk MB/s per {bin_s * 1e3:.0f} ms: {rate}\n  READ wait per worker (sum/longest s): {waits}")


def run_child(pkg: str, job: dict[str, Any], blkio: str = "") -> dict[str, Any]:
    if blkio:
        d0 = blkio_reads(blkio, job["backing"][0])
        r = run_child(pkg, job)
        d1 = blkio_reads(blkio, job["backing"][0])
        r["disk"] = {"reads": d1[0] - d0[0], "bytes": d1[1] - d0[1]}
        return r
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="coldplan-job-") as f:
        json.dump(dict(job, pkg=pkg), f)  # too long for an argument (every member's offset)
        f.flush()
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f.name], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"child with {pkg} failed: {r.stderr.strip()[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--mib", type=int, default=128, help="MiB of tars per size (--shards shards)")
    ap.add_argument("--shards", type=int, default=4, help="shards per size")
    ap.add_argument("--blkio", metavar="DIR", help="a cgroup v1 blkio directory this run is in: per pass, the reads the disk saw "
                    "(blkio.throttle.io_serviced / io_service_bytes of its device)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--compare", metavar="PKGDIR", help="also run the loader with the gdsfs package in PKGDIR")
    ap.add_argument("--compare-bin", metavar="BIN", help="with --compare: serve its rows from a second mount of the same directory by this gdsfs binary")
    ap.add_argument("--readahead", help="the mount's --readahead (default: the daemon's)")
    ap.add_argument("--compare-readahead", metavar="SIZE", help="with --compare-bin: the before mount's --readahead (default: --readahead)")
    ap.add_argument("--one-process", type=int, default=8, metavar="REPS",
                    help="also the first sample and pass of one cold shard in this process, npy_headers used or taken away, "
                         "REPS interleaved runs each (0: not)")
    ap.add_argument("--warm-all", action="store_true", help="a warm row for every loader (default: this tree's only)")
    ap.add_argument("--trace", metavar="PATH", help="with --blkio: trace each cold pass (the disk's reads every 2 ms, each READ's "
                    "time and offsets per worker), print a summary per pass and write the traces to PATH (JSON)")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with open(a.child) as f:
            print(json.dumps(child(json.load(f))))
        return 0
    sys.path.insert(0, os.path.join(ROOT, "python"))
    bd = _bench_dataset()
    base = tempfile.mkdtemp(prefix="gdsfs-bench-cold-plan-")
    flags = ("--readahead", a.readahead) if a.readahead else ()
    src, mnt = bd.own_mount(base, flags=flags)
    pkgs = {"after": os.path.join(ROOT, "python")}
    mnts = {"after": mnt}
    if a.compare:
        pkgs = {"before": os.path.abspath(a.compare), **pkgs}
        mnts["before"] = mnt
    rows: list[dict[str, Any]] = []
    traces: list[dict[str, Any]] = []
    try:
        if a.compare_bin:
            # The before rows through a second mount of the same directory, served by BIN.
            old, os.environ["GDSFS_BIN"] = os.environ.get("GDSFS_BIN"), os.path.abspath(a.compare_bin)
            try:
                bflags = ("--readahead", a.compare_readahead) if a.compare_readahead else flags
                mnts["before"] = bd.own_mount(base, "mnt-before", bflags)[1]
            finally:
                if old is None:
                    del os.environ["GDSFS_BIN"]
                else:
                    os.environ["GDSFS_BIN"] = old
        for kib in (int(x) for x in a.sizes.split(",") if x.strip()):
            n = (a.mib << 20) // (kib << 10)
            n -= n % a.shards
            backing = bd.make_tars(os.path.join(src, f"{kib}KiB"), kib, n, a.shards)
            shards = [p.replace(src, mnt, 1) for p in backing]
            for m in set(mnts.values()):
                bd._pass(bd._loader("gdsfs", [p.replace(src, m, 1) for p in backing], a.batch, 0))  # the daemon indexes the shards
            job = {"shards": shards, "backing": backing, "batch": a.batch, "workers": a.workers, "nsamples": n,
                   "trace": bool(a.trace and a.blkio), "blkio": a.blkio or "",
                   "starts": {k: sorted(v) for k, v in _npy_starts(backing).items()}}
            row: dict[str, Any] = {"kib": kib, "sequential": 0.0, "file_bytes": sum(os.path.getsize(p) for p in backing), "payload": n * (kib << 10)}
            for _ in range(a.reps):
                row["sequential"] = max(row["sequential"], bd.sequential_rate(backing))
                for label, pkg in pkgs.items():
                    r = run_child(pkg, dict(job, shards=[p.replace(src, mnts[label], 1) for p in backing]), a.blkio or "")
                    row.setdefault(label + " all", []).append(r)
                    if "trace" in r:
                        print(f"{kib} KiB {label} cold: {r['samples_per_s']:,.0f} samples/s\n{trace_summary(r['trace'])}", flush=True)
                        traces.append({"kib": kib, "label": label, **r["trace"]})
                    old = row.get(label)
                    if old is None or r["samples_per_s"] > old["samples_per_s"]:
                        row[label] = r
                    row[label + " first"] = min(row.get(label + " first", 1e9), r["first_s"])
                # The same fresh loader with the shards cached (the cold pass left them so):
                # where cold is no slower, the loader, not the disk, bounds it.
                for label, pkg in pkgs.items():
                    if label != "after" and not a.warm_all:
                        continue
                    w = run_child(pkg, dict(job, drop=False, trace=False, shards=[p.replace(src, mnts[label], 1) for p in backing]))
                    key = "warm" if label == "after" else label + " warm"
                    if w["samples_per_s"] > row.get(key, {}).get("samples_per_s", 0):
                        row[key] = w
                    row[key + " first"] = min(row.get(key + " first", 1e9), w["first_s"])
            if a.one_process:
                row["one process"] = one_process(job, a.one_process)
            rows.append(row)
    finally:
        for m in set(mnts.values()):
            bd.unmount(m)
        if not any(os.path.ismount(m) for m in mnts.values()):
            shutil.rmtree(base, ignore_errors=True)
    print(f"host engine, cold (this run's files dropped), {a.workers} workers, batch {a.batch}, {a.mib} MiB of tars per size; best of {a.reps} "
          "(first batch: the shortest; medians after the table)")
    print(f"{'sample':>7} {'disk GB/s':>9} {'payload share':>13} {'loader':>7} {'first batch s':>13} {'samples/s':>9} {'GB/s':>6} {'vs disk':>7} {'hdr preads':>10}")
    for r in rows:
        for label in (*pkgs, *(f"{x} warm" for x in pkgs if x != "after" and a.warm_all), "warm"):
            x = r[label]
            print(f"{str(r['kib']) + ' KiB':>7} {r['sequential']:>9.2f} {r['payload'] / r['file_bytes']:>13.3f} {label:>7} {r[label + ' first']:>13.3f} "
                  f"{x['samples_per_s']:>9,.0f} {x['GBps']:>6.2f} {x['GBps'] / r['sequential']:>6.2f}x {x['header_preads']:>10}")
    if a.one_process:
        print(f"\none process (num_workers=0), one cold shard, a fresh dataset; medians of {a.one_process} interleaved runs; "
              "before = npy_headers taken away (each header pread, as before)")
        print(f"{'sample':>7} {'planning':>8} {'first sample ms':>15} {'samples/s':>9} {'pread ms':>8} {'READ ms':>7}")
        for r in rows:
            for label, m in r["one process"].items():
                print(f"{str(r['kib']) + ' KiB':>7} {label:>8} {1e3 * m[0]:>15.1f} {m[1]:>9,.0f} {1e3 * m[2]:>8.1f} {1e3 * m[3]:>7.1f}")
    for r in rows:
        for label in pkgs:
            runs = r[label + " all"]
            fb = sorted(x["first_s"] for x in runs)[len(runs) // 2]
            sps = sorted(x["samples_per_s"] for x in runs)[len(runs) // 2]
            d = runs[-1]["daemon"]
            print(f"median {r['kib']} KiB {label}: first batch {fb:.3f} s, {sps:,.0f} samples/s; all first batches "
                  + " ".join(f"{x['first_s']:.3f}" for x in runs)
                  + f"; last pass: dataset built {runs[-1]['built_s']:.3f} s, workers started "
                  + "/".join(f"{x:.3f}" for x in runs[-1]["workers_started_s"][:1] + runs[-1]["workers_started_s"][-1:])
                  + " s (first/last), first READs " + "/".join(f"{x:.3f}" for x in runs[-1]["first_reads_s"][:1] + runs[-1]["first_reads_s"][-1:])
                  + f" s; {d['reads']} READs of {d['read_ranges']} ranges, {d['read_bytes'] / max(1, d['reads']) / 2**20:.2f} MiB per READ, "
                  f"readahead {d['readaheads']} windows / {d['readahead_bytes'] / 2**20:.0f} MiB ({d['readahead_dropped']} dropped)"
                  + (f"; the disk: {runs[-1]['disk']['reads']} reads, {runs[-1]['disk']['bytes'] / max(1, runs[-1]['disk']['reads']) / 1024:.0f} KiB each, "
                     f"{runs[-1]['disk']['bytes'] / r['file_bytes']:.2f}x the files" if "disk" in runs[-1] else ""))
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump(traces, f)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
