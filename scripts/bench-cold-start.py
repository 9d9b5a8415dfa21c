#!/usr/bin/env python3
"""A cold epoch's start (issue 15): a fresh gdsfs.torch.DataLoader's cold pass against the
disk, with and without the start hint (GDSFS_START_HINT), in one run.

Usage: bench-cold-start.py [--sizes 64,256] [--mib 256] [--shards 16] [--workers 8]
                           [--batch 16] [--rounds 3] [--json PATH]

Writes WebDataset tars of float32 .npy samples (plus a .cls) on a host-mode gdsfs mount of its
own, has the daemon index them, then per size and round, interleaved (the order of the two
loaders alternates between rounds):

- the disk's sequential read of the same files, their pages dropped first (posix_fadvise
  DONTNEED on this run's files only, the backing files' and the mount's; 8 MiB reads);
- a fresh GDSShardDataset + DataLoader with the pages dropped, hint off (GDSFS_START_HINT=0)
  and on (the default): the pass timed from the dataset's construction (as dataset_check.py
  on the GPU machine does) and from iter(loader) (the loop's start), the first batch's
  latency from iter(loader), samples/s and GB/s of payload; the ratio is payload GB/s over
  the disk's file-bytes GB/s, as dataset_check.py prints it.

--blkio DIR (the cgroup v1 blkio group the run is in, e.g. with a read_bps_device limit that
makes the disk the bound on a small machine): per cold pass, when the run's processes first asked
the disk for a MiB and how much they had asked for by 100 ms after iter() (the start the hint
is for).

Then a warm row per size (pages cached, fresh loaders, hint off and on): what the hint costs
an epoch that needs none. Prints each round and the medians.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "python"))


def _bench_dataset() -> Any:
    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def log(msg: str) -> None:
    print(f"bench-cold-start: {msg}", file=sys.stderr, flush=True)


def _started(d: str, _worker_id: int) -> None:
    """worker_init_fn: writes d/PID with the wall-clock time this worker started."""
    with open(os.path.join(d, str(os.getpid())), "w") as f:
        f.write(str(time.time()))


class _Asked:
    """Samples a blkio cgroup's read bytes (blkio.throttle.io_service_bytes, counted as reads are
    submitted) every 2 ms from start() to stop(): when this run's processes first asked the disk
    for data, whatever the throttle then made them wait."""

    def __init__(self, cgroup: str, dev: str) -> None:
        self.path, self.dev = os.path.join(cgroup, "blkio.throttle.io_service_bytes"), dev
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> int:
        with open(self.path) as f:
            for line in f:
                dev, op, n = line.split()[:3] if len(line.split()) >= 3 else ("", "", "0")
                if dev == self.dev and op == "Read":
                    return int(n)
        return 0

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.done.wait(0.002):
            self.samples.append((time.perf_counter() - t0, self._read()))

    def start(self) -> None:
        self.samples.append((0.0, self._read()))
        self.thread.start()

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.thread.join()
        base = self.samples[0][1]
        first = next((t for t, n in self.samples if n - base >= 1 << 20), -1.0)
        by100 = max((n - base for t, n in self.samples if t <= 0.1), default=0)
        return {"first_mib_s": first, "asked_by_100ms": by100}


def one_pass(shards: list[str], batch: int, workers: int, hint: bool, asked: Optional[_Asked] = None) -> dict[str, float]:
    """One fresh loader's pass: seconds from construction and from iter(), the first batch,
    the last worker's start (from iter())."""
    import functools

    import gdsfs.torch

    os.environ["GDSFS_START_HINT"] = "" if hint else "0"
    d = tempfile.mkdtemp(prefix="gdsfs-cold-start-w-")
    t0 = time.perf_counter()
    ds = gdsfs.torch.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    dl = gdsfs.torch.DataLoader(ds, batch_size=batch, num_workers=workers, worker_init_fn=functools.partial(_started, d) if workers else None)
    if asked is not None:
        asked.start()
    t1 = time.perf_counter()
    w1 = time.time()
    first = 0.0
    n = nb = 0
    for b in dl:
        x = b["x.npy"]
        if not first:
            first = time.perf_counter() - t1
        n += x.shape[0]
        nb += x.numel() * x.element_size()
    t2 = time.perf_counter()
    disk = asked.stop() if asked is not None else {}
    del dl
    ds.close()
    os.environ.pop("GDSFS_START_HINT", None)
    starts = [float(open(os.path.join(d, x)).read()) - w1 for x in os.listdir(d)]
    shutil.rmtree(d, ignore_errors=True)
    return {"from_construction": t2 - t0, "from_iter": t2 - t1, "first_batch": first, "samples": n, "payload": nb,
            "workers_started": max(starts, default=0.0), **disk}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,256", help="sample sizes in KiB")
    ap.add_argument("--mib", type=int, default=256, help="MiB of tars per size")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", help="where to write the tars and mount (default: a temp dir)")
    ap.add_argument("--blkio", metavar="DIR", help="the cgroup v1 blkio directory this run is in: per cold pass, when its "
                    "processes first asked the disk for data (blkio.throttle.io_service_bytes, sampled every 2 ms)")
    ap.add_argument("--blkio-dev", default="254:0", metavar="MAJ:MIN", help="the backing directory's disk (default 254:0)")
    ap.add_argument("--json")
    a = ap.parse_args()
    bd = _bench_dataset()
    base = tempfile.mkdtemp(prefix="gdsfs-cold-start-", dir=a.dir)
    src, mnt = bd.own_mount(base)
    out: list[dict[str, Any]] = []
    try:
        for kib in (int(s) for s in a.sizes.split(",")):
            n = (a.mib << 20) // (kib << 10)
            n -= n % a.shards
            backing = bd.make_tars(os.path.join(src, f"{kib}KiB"), kib, n, a.shards)
            shards = [p.replace(src, mnt, 1) for p in backing]
            file_bytes = sum(os.path.getsize(p) for p in backing)
            one_pass(shards, a.batch, 0, False)  # the daemon indexes every shard once
            rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
            disk: list[float] = []
            for rnd in range(a.rounds):
                disk.append(bd.sequential_rate(backing))
                for label in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                    bd.drop(backing + shards)
                    asked = _Asked(a.blkio, a.blkio_dev) if a.blkio else None
                    r = one_pass(shards, a.batch, a.workers, label == "on", asked)
                    if r["samples"] != n:
                        raise RuntimeError(f"{kib} KiB hint {label}: {r['samples']} samples, expected {n}")
                    r["ratio"] = r["payload"] / r["from_construction"] / 1e9 / disk[-1]
                    r["ratio_iter"] = r["payload"] / r["from_iter"] / 1e9 / disk[-1]
                    rows[label].append(r)
                    log(f"{kib} KiB round {rnd} hint {label}: disk {disk[-1]:.2f} GB/s, pass {r['from_construction']:.3f} s "
                        f"({r['payload'] / r['from_construction'] / 1e9:.2f} GB/s, {r['ratio']:.2f}x; from iter {r['ratio_iter']:.2f}x), "
                        f"first batch {r['first_batch'] * 1e3:.0f} ms, last worker started {r['workers_started'] * 1e3:.0f} ms"
                        + (f"; disk asked for its first MiB at {r['first_mib_s'] * 1e3:.0f} ms, {r['asked_by_100ms'] / 2**20:.0f} MiB by 100 ms"
                           if "first_mib_s" in r else ""))
            warm: dict[str, list[float]] = {"off": [], "on": []}
            for rnd in range(a.rounds):
                for label in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                    warm[label].append(one_pass(shards, a.batch, a.workers, label == "on")["from_iter"])
            fields = ("ratio", "ratio_iter", "first_batch", "from_construction", "workers_started", "first_mib_s", "asked_by_100ms")
            med = {k: {f: statistics.median(r[f] for r in v) for f in fields if all(f in r for r in v)} for k, v in rows.items()}
            res = {"kib": kib, "samples": n, "file_bytes": file_bytes, "disk_GBps": disk, "rounds": rows, "median": med,
                   "warm_s": warm}
            out.append(res)
            print(f"{kib} KiB, {a.shards} shards, {file_bytes / 2**20:.0f} MiB, {a.workers} workers, batch {a.batch}: disk {statistics.median(disk):.2f} GB/s (median)")
            for k in ("off", "on"):
                m = med[k]
                print(f"  hint {k:<3}: cold {m['ratio']:.2f}x the disk (rounds {' / '.join('%.2f' % r['ratio'] for r in rows[k])}), "
                      f"from iter {m['ratio_iter']:.2f}x, first batch {m['first_batch'] * 1e3:.0f} ms, last worker started {m['workers_started'] * 1e3:.0f} ms; "
                      f"warm pass {statistics.median(warm[k]):.3f} s (rounds {' / '.join('%.3f' % s for s in warm[k])})"
                      + (f"; disk asked for its first MiB at {m['first_mib_s'] * 1e3:.0f} ms, {m['asked_by_100ms'] / 2**20:.0f} MiB by 100 ms"
                         if "first_mib_s" in m else ""))
    finally:
        bd.unmount(mnt)
        shutil.rmtree(base, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
