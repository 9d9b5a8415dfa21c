#!/usr/bin/env python3
"""A/B of the gdsfs save paths on one state dict, alternating, in one process.

Usage: save_ab.py MOUNTPOINT [--gib N] [--rounds R]
       save_ab.py MOUNTPOINT --dcp BACKING_DIR [--gib N] [--tensor-mib M] [--rounds R]

Saves the same bf16 state dict (CUDA when available) with gdsfs.checkpoint.save and
gdsfs.safetensors.save_file in turn, R rounds, each timed including its fsyncs (the savers'
own), removing the file after each save, and prints GB/s per save. It tells whether a
difference between the two paths in checkpoint_check.py's table is the code or the
order the benchmark ran them in.

With --dcp (BACKING_DIR: the directory MOUNTPOINT serves), alternates instead the disk's
parallel write+fsync probe (scripts/gpu/disk_phases.py's "probe": the payload as 4 files in
BACKING_DIR, O_DIRECT 4 MiB writes, fsync) with a staged gdsfs.dcp save of the same payload
(GDSFileSystemWriter.stage, then dcp.save's calls: write_data, finish), and prints each save's
timeline (save_times: stage, create, fallocate/ENOSPC check, lease writes, fsync+rename,
finish) and its completion rate over the probe's of the same round. Without a real
torch.distributed.checkpoint (torch 1.x) it runs against python/tests/_dcp_standin. The host
engine (no GPU) stages into host slabs: mount with --host-pool of twice the payload.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402


def dcp_ab(a: argparse.Namespace, dev: str) -> int:
    import mmap
    import warnings

    import disk_phases as dp

    sys.path.insert(0, os.path.join(HERE, "..", "..", "python", "tests"))
    import _dcp_standin as S

    real = S.has_real_dcp()
    if not real:
        S.install()
    import gdsfs.dcp as gdcp

    rows = (a.tensor_mib << 20) // 2 // 4096
    n = max(1, int(a.gib * 2**30) // (rows * 4096 * 2))
    sd = {f"layers.{i}.weight": torch.randn(rows, 4096, device=dev).to(torch.bfloat16) for i in range(n)}
    nbytes = n * rows * 4096 * 2
    print(f"save_ab: dcp {n} bf16 tensors of {a.tensor_mib} MiB, {nbytes / 2**30:.2f} GiB on {dev}, "
          f"{'real DCP' if real else 'DCP stand-in'}")
    raw = mmap.mmap(-1, 4 << 20)
    raw.write(os.urandom(4 << 20))
    probe_d = os.path.join(a.dcp, "gdsfs-save-ab-probe")
    os.makedirs(probe_d, exist_ok=True)
    d = os.path.join(a.mountpoint, "gdsfs-save-ab-dcp")
    rates: dict[str, list[float]] = {"probe": [], "dcp": []}
    ratios = []
    warnings.simplefilter("ignore")
    try:
        for r in range(a.rounds):
            got = {}
            for which in ("probe", "dcp") if r % 2 == 0 else ("dcp", "probe"):
                dp.settle(a.dcp)
                if which == "probe":
                    rate, ms = dp.one_run(probe_d, dp.VARIANTS["probe"], nbytes, 4, 4 << 20, 1, memoryview(raw))
                    print(f"save_ab: round {r} disk probe (4 files O_DIRECT) {rate:5.2f} GB/s ("
                          + " ".join(f"{k} {v:.0f}" for k, v in ms.items()) + " ms)")
                else:
                    if dev == "cuda":
                        torch.cuda.synchronize()
                    w = gdcp.GDSFileSystemWriter(d)
                    t0 = time.perf_counter()
                    staged = w.stage({"model": sd} if real else sd)
                    blocked = time.perf_counter() - t0
                    if real:
                        import torch.distributed.checkpoint as dcp

                        dcp.save(staged, storage_writer=w)
                    else:
                        S.save(staged, w)
                    secs = time.perf_counter() - t0
                    rate = nbytes / secs / 1e9
                    after = nbytes / (secs - blocked) / 1e9
                    st = w.save_times
                    phases = " ".join(f"{k[:-2]} {v * 1e3:.0f}" for k, v in st.items() if k.endswith("_s"))
                    print(f"save_ab: round {r} gdsfs.dcp staged save {rate:5.2f} GB/s from the stage() call, "
                          f"{after:5.2f} from its return ({phases} ms)")
                    shutil.rmtree(d)
                    # On a GPU the staging copies run on the device after stage() returns (and
                    # write_data waits for them); with host slabs stage() copies: compare from its return.
                    rate = rate if dev == "cuda" else after
                rates[which].append(rate)
                got[which] = rate
            ratios.append(got["dcp"] / got["probe"])
            print(f"save_ab: round {r} dcp / probe = {ratios[-1]:.2f}x")
    finally:
        shutil.rmtree(probe_d, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
        gdcp.close_staging()
    print(f"save_ab: median disk probe {statistics.median(rates['probe']):.2f} GB/s, gdsfs.dcp "
          f"{statistics.median(rates['dcp']):.2f} GB/s, ratio per round {[round(x, 2) for x in ratios]}, "
          f"median {statistics.median(ratios):.2f}x")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mountpoint")
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dcp", metavar="BACKING_DIR", help="A/B a staged gdsfs.dcp save vs the disk probe")
    ap.add_argument("--tensor-mib", type=int, default=32)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.dcp:
        return dcp_ab(a, dev)
    import gdsfs.checkpoint as gck
    import gdsfs.safetensors as gst

    side = 8192 if dev == "cuda" else 2048
    n = max(1, int(a.gib * 2**30 / (side * side * 2)))
    sd = {f"layers.{i}.weight": torch.randn(side, side, device=dev).to(torch.bfloat16) for i in range(n)}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    d = os.path.join(a.mountpoint, "gdsfs-save-ab")
    os.makedirs(d, exist_ok=True)
    savers = [
        ("gdsfs.checkpoint.save", os.path.join(d, "ab.pt"), lambda p: gck.save(sd, p)),
        ("gdsfs.safetensors.save_file", os.path.join(d, "ab.safetensors"), lambda p: gst.save_file(sd, p)),
    ]
    print(f"save_ab: {n} bf16 tensors, {nbytes / 2**30:.2f} GiB on {dev}")
    for r in range(a.rounds):
        for name, path, fn in savers if r % 2 == 0 else reversed(savers):
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn(path)
            dt = time.perf_counter() - t
            print(f"save_ab: round {r} {name:30s} {nbytes / dt / 1e9:6.2f} GB/s")
            os.unlink(path)
    os.rmdir(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
