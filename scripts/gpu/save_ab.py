#!/usr/bin/env python3
"""A/B of the gdsfs save paths on one state dict, alternating, in one process.

Usage: save_ab.py MOUNTPOINT [--gib N] [--rounds R]

Saves the same bf16 state dict (CUDA when available) with gdsfs.checkpoint.save and
gdsfs.safetensors.save_file in turn, R rounds, each timed including its fsyncs (the savers'
own), removing the file after each save, and prints GB/s per save. It tells whether a
difference between the two paths in checkpoint_check.py's table is the code or the
order the benchmark ran them in.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import gdsfs.checkpoint as gck  # noqa: E402
import gdsfs.safetensors as gst  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mountpoint")
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
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
