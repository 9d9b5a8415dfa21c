#!/usr/bin/env python3
"""Diagnose two findings of the 2026-12-01 18:30 GPU run (checkpoint section, 8 GiB):

1. stock ``dcp.save(FileSystemWriter)`` of 64 x 128 MiB bf16 CUDA tensors failed on the mount
   ("unexpected pos 704 vs 598" from torch.save's zip writer): the same save into the backing
   directory and into the mount, full tracebacks;
2. ``gdsfs.dcp.GDSFileSystemReader`` loaded the gdsfs writer's 8 GiB at 2.05 GB/s "warm" (the
   disk's rate): how much of the files is in the page cache after the save, after each load,
   and after reading them through the page cache, with each load's rate.

3. (2026-12-01 20:55 run) with the fix for 2., load 1 left the files cached but load 2 ran at
   3.60 GB/s and load 3 at 31.5: with --metrics (the daemon's --metrics-addr) each load prints
   the bytes each engine moved, and --second repeats the loads on a second, new checkpoint, to
   tell a once-per-daemon cost from a once-per-file one.

Usage: dcp_diag.py MOUNTPOINT BACKING_DIR [--gib N] [--bin gdsfs] [--metrics HOST:PORT] [--second]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
import sys
import time
import traceback
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import gdsfs  # noqa: E402
import gdsfs.dcp as gdcp  # noqa: E402

libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def log(msg: str) -> None:
    print(f"dcp_diag: {msg}", flush=True)


def resident(path: str) -> tuple[int, int]:
    """Pages of path in the page cache, and its pages (mincore of a shared mapping)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            return -1, pages
        vec = ctypes.create_string_buffer(pages)
        libc.mincore(addr, size, vec)
        libc.munmap(addr, size)
        return sum(b & 1 for b in vec.raw), pages
    finally:
        os.close(fd)


def residency(d: str) -> str:
    got = tot = 0
    for root, _, files in os.walk(d):
        for n in files:
            r, p = resident(os.path.join(root, n))
            got += max(r, 0)
            tot += p
    return f"{got * mmap.PAGESIZE / 2**30:.2f} of {tot * mmap.PAGESIZE / 2**30:.2f} GiB cached"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mount")
    ap.add_argument("backing")
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--bin", default="build/gpu/gdsfs")
    ap.add_argument("--no-stock", action="store_true", help="skip the stock FileSystemWriter saves")
    ap.add_argument("--metrics", default="", help="the daemon's --metrics-addr: print each load's bytes per engine")
    ap.add_argument("--second", action="store_true", help="repeat the save and loads on a second, new checkpoint")
    a = ap.parse_args()
    per = 8192 * 8192
    n = max(1, int(round(a.gib * (1 << 30) / (per * 2))))
    sd = {f"layers.{i}.weight": torch.randn(8192, 8192, device="cuda").to(torch.bfloat16) for i in range(n)}
    nbytes = n * per * 2
    log(f"torch {torch.__version__}, {n} bf16 tensors, {nbytes / 2**30:.2f} GiB")

    def status() -> None:
        out = subprocess.run([a.bin, "status", a.mount], capture_output=True, text=True, timeout=30)
        for line in (out.stdout + out.stderr).splitlines():
            if any(w in line for w in ("engine", "read", "lease", "pool")):
                log(f"  status: {line.strip()}")

    # 1. stock FileSystemWriter, backing dir then mount, small then full.
    for where, base in () if a.no_stock else (("backing", a.backing), ("mount", a.mount)):
        for label, keys in (("4 tensors", list(sd)[:4]), ("all", list(sd))):
            p = os.path.join(base, f"diag-stock-{where}-{len(keys)}")
            shutil.rmtree(p, ignore_errors=True)
            t = time.perf_counter()
            try:
                dcp.save({k: sd[k] for k in keys}, storage_writer=dcp.FileSystemWriter(p))
                log(f"stock FileSystemWriter into the {where}, {label}: ok in {time.perf_counter() - t:.1f} s; "
                    f"files {sorted(os.listdir(p))}")
            except BaseException as e:  # noqa: BLE001
                log(f"stock FileSystemWriter into the {where}, {label}: FAILED {type(e).__name__}")
                traceback.print_exc()
            shutil.rmtree(p, ignore_errors=True)

    def engine_bytes() -> dict[str, float]:
        """The daemon's gdsfs_bytes_total read counters by engine ({} without --metrics)."""
        if not a.metrics:
            return {}
        got: dict[str, float] = {}
        with urllib.request.urlopen(f"http://{a.metrics}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("gdsfs_bytes_total{") and 'direction="read"' in line:
                    eng = line.split('engine="', 1)[1].split('"', 1)[0]
                    got[eng] = got.get(eng, 0.0) + float(line.rsplit(" ", 1)[1])
        return got

    def by_engine(before: dict[str, float]) -> str:
        after = engine_bytes()
        parts = [f"{k} {(v - before.get(k, 0.0)) / 2**30:.2f} GiB" for k, v in sorted(after.items()) if v - before.get(k, 0.0) > 0]
        return f"; engines: {', '.join(parts) or 'none'}" if a.metrics else ""

    # 2. gdsfs writer, then loads with residency between.
    p = os.path.join(a.mount, "diag-gdsfs")
    bp = os.path.join(a.backing, "diag-gdsfs")
    shutil.rmtree(p, ignore_errors=True)
    t = time.perf_counter()
    dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(p))
    log(f"gdsfs writer: {nbytes / (time.perf_counter() - t) / 1e9:.2f} GB/s; {residency(bp)}")

    pid = int(gdsfs.status(a.mount).get("daemon_pid", 0))  # 0: an older daemon's STATUS

    def proc_stat(p: int) -> tuple[float, int]:
        """(CPU seconds, threads) of process p, (0, 0) if it cannot be read."""
        try:
            with open(f"/proc/{p}/stat") as fh:
                f = fh.read().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), int(f[17])
        except (OSError, IndexError, ValueError):
            return 0.0, 0

    def load(label: str) -> None:
        before = engine_bytes()
        d0, _ = proc_stat(pid)
        c0 = time.process_time()
        dst = {k: torch.empty_like(v) for k, v in sd.items()}
        torch.cuda.synchronize()
        t = time.perf_counter()
        dcp.load(dst, storage_reader=gdcp.GDSFileSystemReader(p))
        torch.cuda.synchronize()
        secs = time.perf_counter() - t
        c1 = time.process_time()
        d1, threads = proc_stat(pid)
        ok = all(torch.equal(dst[k], sd[k]) for k in list(sd)[:: max(1, n // 4)])
        # Where a slow load's time goes: the daemon's CPU (and its OS threads, each a thread
        # cuFile may see for the first time) against this process's.
        daemon = f"daemon {d1 - d0:.2f} (pid {pid}, {threads} threads after)" if pid else "daemon CPU not known (its STATUS names no pid)"
        log(f"{label}: {nbytes / secs / 1e9:.2f} GB/s in {secs:.2f} s, bytes {'equal' if ok else 'DIFFER'}; "
            f"after: {residency(bp)}{by_engine(before)}; CPU s: {daemon}, this process {c1 - c0:.2f}")
        del dst
        torch.cuda.empty_cache()

    for i in range(3):
        load(f"gdsfs reader load {i + 1}")
    status()
    t = time.perf_counter()
    for root, _, files in os.walk(bp):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                while fh.read(64 << 20):
                    pass
    log(f"read the backing files through the page cache in {time.perf_counter() - t:.1f} s: {residency(bp)}")
    for i in range(2):
        load(f"gdsfs reader load after the cache fill {i + 1}")
    status()
    shutil.rmtree(p, ignore_errors=True)
    if a.second:
        # A new checkpoint in the same daemon: is load 2's slowness paid again per file?
        p = os.path.join(a.mount, "diag-gdsfs-2")
        bp = os.path.join(a.backing, "diag-gdsfs-2")
        shutil.rmtree(p, ignore_errors=True)
        dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(p))
        for i in range(3):
            load(f"second checkpoint, gdsfs reader load {i + 1}")
        shutil.rmtree(p, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
