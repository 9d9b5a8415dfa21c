#!/usr/bin/env python3
"""Where a parallel O_DIRECT write + fsync of a checkpoint's data files spends its time (issue 14).

Usage: disk_phases.py DIR [--mib 1024] [--files 4] [--write-mib 4] [--writers 1] [--rounds 3]
                      [--variants NAME,...] [--json PATH]

Writes MIB MiB from page-aligned host memory as FILES files in DIR (a directory of the disk to
measure: never tmpfs), O_DIRECT writes of WRITE_MIB MiB, WRITERS threads per file, and times each
phase: create, fallocate, writes, sync (fsync or fdatasync), rename (temp name -> final name, as
an atomic save does) and the directory fsync. Variants (all by default), run ROUNDS times
interleaved, the disk settled (sync, no I/O in flight) before each:

- probe:        what scripts/gpu/dcp_check.py's disk part does: O_TRUNC final names, no
                fallocate, each file fsynced as its writes end, no rename, no directory fsync.
- prealloc-end: fallocate each file first, fsync every file after all writes end (in parallel),
                rename, one directory fsync per file.
- prealloc-own: fallocate; each file fsynced as soon as its own writes end; rename and a
                directory fsync per file right after (gdsfs.dcp's save before this change).
- noalloc-own:  no fallocate; fsync as its writes end; rename; one directory fsync per file.
- noalloc-own-dir1: as noalloc-own, one directory fsync for the save after every rename.
- noalloc-own-fdatasync: as noalloc-own-dir1 with fdatasync instead of fsync.
- prealloc-own-dir1 / prealloc-own-fdatasync: the same two with fallocate.
- noalloc-end:  no fallocate; fsync every file after all writes end.

Prints one line per run (GB/s of the whole thing, and each phase in ms: the writes and syncs
are the longest file's) and a summary per variant (median GB/s and its ratio to probe's median
in the same invocation). Standard library only, so it runs on the GPU machine as is.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import threading
import time
from typing import Any

VARIANTS: dict[str, dict[str, Any]] = {
    "probe": {"prealloc": False, "when": "own", "sync": "fsync", "rename": False, "dirsync": "none"},
    "prealloc-end": {"prealloc": True, "when": "end", "sync": "fsync", "rename": True, "dirsync": "per-file"},
    "prealloc-own": {"prealloc": True, "when": "own", "sync": "fsync", "rename": True, "dirsync": "per-file"},
    "prealloc-own-dir1": {"prealloc": True, "when": "own", "sync": "fsync", "rename": True, "dirsync": "once"},
    "prealloc-own-fdatasync": {"prealloc": True, "when": "own", "sync": "fdatasync", "rename": True, "dirsync": "once"},
    "noalloc-end": {"prealloc": False, "when": "end", "sync": "fsync", "rename": True, "dirsync": "per-file"},
    "noalloc-own": {"prealloc": False, "when": "own", "sync": "fsync", "rename": True, "dirsync": "per-file"},
    "noalloc-own-dir1": {"prealloc": False, "when": "own", "sync": "fsync", "rename": True, "dirsync": "once"},
    "noalloc-own-fdatasync": {"prealloc": False, "when": "own", "sync": "fdatasync", "rename": True, "dirsync": "once"},
}


def _disk_stat(path: str) -> list[int] | None:
    try:
        dev = os.stat(path).st_dev
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def settle(path: str, limit_s: float = 10.0) -> None:
    """sync, then wait (at most limit_s) until the disk has had nothing in flight for 200 ms."""
    os.sync()
    t0 = time.perf_counter()
    last = _disk_stat(path)
    if last is None or len(last) < 12:
        return
    quiet = 0
    while time.perf_counter() - t0 < limit_s and quiet < 4:
        time.sleep(0.05)
        now = _disk_stat(path)
        if now is None:
            return
        quiet = quiet + 1 if now[8] == 0 and now[4] == last[4] and now[11] == last[11] else 0
        last = now


class Phases:
    """Per-phase durations; parallel phases keep the longest file's."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ms: dict[str, float] = {}

    def add(self, name: str, secs: float, most: bool = True) -> None:
        with self.lock:
            old = self.ms.get(name, 0.0)
            self.ms[name] = max(old, secs * 1e3) if most else old + secs * 1e3


def one_run(d: str, v: dict[str, Any], nbytes: int, nfiles: int, wsize: int, writers: int, buf: memoryview) -> tuple[float, dict[str, float]]:
    per = nbytes // nfiles // wsize * wsize
    finals = [os.path.join(d, f"__0_{k}.distcp") for k in range(nfiles)]
    temps = [os.path.join(d, f".__0_{k}.distcp.tmp") for k in range(nfiles)] if v["rename"] else finals
    ph = Phases()
    barrier = threading.Barrier(nfiles)
    errs: list[BaseException] = []
    fds: list[int] = [-1] * nfiles
    sync = os.fdatasync if v["sync"] == "fdatasync" else os.fsync

    def file_job(k: int) -> None:
        try:
            t = time.perf_counter()
            flags = os.O_WRONLY | os.O_CREAT | os.O_DIRECT | (os.O_TRUNC if not v["rename"] else os.O_EXCL)
            fd = fds[k] = os.open(temps[k], flags, 0o600)
            ph.add("create", time.perf_counter() - t)
            if v["prealloc"]:
                t = time.perf_counter()
                os.posix_fallocate(fd, 0, per)
                ph.add("fallocate", time.perf_counter() - t)
            t = time.perf_counter()
            offs = list(range(0, per, wsize))
            lock = threading.Lock()

            def w() -> None:
                while True:
                    with lock:
                        if not offs:
                            return
                        off = offs.pop(0)
                    n = min(wsize, per - off)
                    done = 0
                    while done < n:
                        done += os.pwrite(fd, buf[done:n], off + done)

            ths = [threading.Thread(target=w) for _ in range(writers - 1)]
            for th in ths:
                th.start()
            w()
            for th in ths:
                th.join()
            ph.add("writes", time.perf_counter() - t)
            if v["when"] == "end":
                barrier.wait()
            t = time.perf_counter()
            sync(fd)
            ph.add("sync", time.perf_counter() - t)
            os.close(fd)
            fds[k] = -1
            if v["rename"] and v["dirsync"] == "per-file":
                t = time.perf_counter()
                os.rename(temps[k], finals[k])
                ph.add("rename", time.perf_counter() - t)
                t = time.perf_counter()
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
                os.fsync(dfd)
                os.close(dfd)
                ph.add("dirsync", time.perf_counter() - t)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errs.append(e)
            barrier.abort()

    t0 = time.perf_counter()
    ths = [threading.Thread(target=file_job, args=(k,)) for k in range(nfiles)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    if errs:
        raise errs[0]
    if v["rename"] and v["dirsync"] == "once":
        t = time.perf_counter()
        for a, b in zip(temps, finals):
            os.rename(a, b)
        ph.add("rename", time.perf_counter() - t)
        t = time.perf_counter()
        dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        ph.add("dirsync", time.perf_counter() - t)
    secs = time.perf_counter() - t0
    for p in finals:
        os.unlink(p)
    return per * nfiles / secs / 1e9, ph.ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--write-mib", type=int, default=4)
    ap.add_argument("--writers", type=int, default=1, help="threads writing each file")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    a = ap.parse_args()
    names = [n for n in a.variants.split(",") if n]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        print(f"disk_phases: unknown variant(s) {bad}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    d = os.path.join(a.dir, f"disk-phases-{os.getpid()}")
    os.makedirs(d)
    wsize = a.write_mib << 20
    raw = mmap.mmap(-1, wsize)  # page-aligned for O_DIRECT, incompressible
    raw.write(os.urandom(wsize))
    buf = memoryview(raw)
    runs: dict[str, list[tuple[float, dict[str, float]]]] = {n: [] for n in names}
    try:
        for r in range(a.rounds):
            order = names if r % 2 == 0 else list(reversed(names))
            for n in order:
                settle(d)
                rate, ms = one_run(d, VARIANTS[n], a.mib << 20, a.files, wsize, a.writers, buf)
                runs[n].append((rate, ms))
                phases = " ".join(f"{k} {v:.0f}" for k, v in ms.items())
                print(f"disk_phases: round {r} {n:24s} {rate:5.2f} GB/s  ({phases} ms)", flush=True)
    finally:
        for p in os.listdir(d):
            os.unlink(os.path.join(d, p))
        os.rmdir(d)
    base = statistics.median(x for x, _ in runs["probe"]) if "probe" in runs else 0.0
    out = {}
    print(f"disk_phases: {a.mib} MiB as {a.files} files, {a.write_mib} MiB O_DIRECT writes, {a.writers} writer(s) per file, "
          f"median of {a.rounds}:")
    for n in names:
        med = statistics.median(x for x, _ in runs[n])
        keys = sorted({k for _, ms in runs[n] for k in ms})
        phase = {k: statistics.median(ms.get(k, 0.0) for _, ms in runs[n]) for k in keys}
        out[n] = {"gbs": med, "phases_ms": phase, "runs_gbs": [x for x, _ in runs[n]]}
        rel = f" ({med / base:.2f}x probe)" if base else ""
        print(f"disk_phases:   {n:24s} {med:5.2f} GB/s{rel}  " + " ".join(f"{k} {v:.0f}" for k, v in phase.items()) + " ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
