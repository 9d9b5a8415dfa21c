#!/usr/bin/env python3
"""Which step of checkpoint_check.py's benchmark breaks a later stock ``dcp.save`` in the same
process (2026-12-01 18:30 GPU run: "unexpected pos 704 vs 598" from torch.save's zip writer).

Runs the benchmark's steps in its order on a small state dict; after each, a stock
FileSystemWriter save of two CUDA tensors into the mount, loaded back and compared.

Usage: dcp_stock_bisect.py MOUNTPOINT BACKING_DIR [--gib N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import gdsfs.checkpoint as gck  # noqa: E402
import gdsfs.dcp as gdcp  # noqa: E402
import gdsfs.safetensors as gst  # noqa: E402

warnings.filterwarnings("ignore")


def log(msg: str) -> None:
    print(f"bisect: {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mount")
    ap.add_argument("backing")
    ap.add_argument("--gib", type=float, default=1)
    a = ap.parse_args()
    n = max(2, int(round(a.gib * (1 << 30) / (8192 * 8192 * 2))))
    sd = {f"layers.{i}.weight": torch.randn(8192, 8192, device="cuda").to(torch.bfloat16) for i in range(n)}
    w = os.path.join(a.mount, "bisect")
    shutil.rmtree(w, ignore_errors=True)
    os.makedirs(w)
    probes = {"a": torch.randn(1000, device="cuda"), "b": torch.arange(4096, device="cuda")}
    broken: list[str] = []

    def probe(after: str, full: bool = False) -> None:
        p = os.path.join(w, "probe")
        shutil.rmtree(p, ignore_errors=True)
        src = sd if full else probes
        try:
            dcp.save(src, storage_writer=dcp.FileSystemWriter(p))
            dst = {k: torch.empty_like(v) for k, v in src.items()}
            dcp.load(dst, storage_reader=dcp.FileSystemReader(p))
            ok = all(torch.equal(dst[k], src[k]) for k in src)
            log(f"after {after}: stock dcp.save {'of the full dict ' if full else ''}{'ok' if ok else 'LOADS WRONG BYTES'}")
            if not ok:
                broken.append(after)
        except BaseException as e:  # noqa: BLE001
            log(f"after {after}: stock dcp.save {'of the full dict ' if full else ''}FAILED: {type(e).__name__}: {str(e)[-300:]}")
            traceback.print_exc(limit=3)
            broken.append(after)
        shutil.rmtree(p, ignore_errors=True)

    def step(name: str, fn) -> None:  # type: ignore[no-untyped-def]
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            log(f"step {name} raised {type(e).__name__}: {e}")
        probe(name)

    probe("nothing")
    probe("nothing", full=True)
    p = os.path.join(w, "g.pt")
    step("gdsfs.checkpoint.save", lambda: gck.save(sd, p))
    step("gdsfs.checkpoint.load", lambda: gck.load(p, map_location="cuda"))

    def tgds() -> None:
        import torch.cuda.gds as g
        from gdsfs._ckpt import zipfmt

        bp = os.path.join(a.backing, "bisect", "g.pt")
        with open(bp, "rb") as f:
            _, recs = zipfmt.locate(f)
        k = min((k for k in recs if k.startswith("data/")), key=lambda k: int(k.split("/")[1]))
        t = torch.empty_like(next(iter(sd.values())))
        g.GdsFile(bp, os.O_RDONLY).load_storage(t.untyped_storage(), recs[k].offset)

    step("torch.cuda.gds load_storage", tgds)
    tp = os.path.join(w, "t.pt")
    step("torch.save", lambda: torch.save(sd, tp))
    step("torch.load(mmap=True)", lambda: torch.load(tp, map_location="cuda", mmap=True))
    sp = os.path.join(w, "g.safetensors")
    step("gdsfs.safetensors.save_file", lambda: gst.save_file(sd, sp))
    step("gdsfs.safetensors.load_file", lambda: gst.load_file(sp, device="cuda"))
    try:
        import safetensors.torch as st

        lp = os.path.join(w, "l.safetensors")
        step("safetensors.save_file", lambda: st.save_file(sd, lp))
        step("safetensors.load_file", lambda: st.load_file(lp, device="cuda"))
    except ImportError:
        log("no safetensors")
    dp = os.path.join(w, "gdcp")
    step("gdsfs dcp writer", lambda: dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(dp)))
    step("gdsfs dcp reader", lambda: dcp.load({k: torch.empty_like(v) for k, v in sd.items()},
                                              storage_reader=gdcp.GDSFileSystemReader(dp)))
    probe("everything", full=True)
    shutil.rmtree(w, ignore_errors=True)
    log(f"first broken after: {broken[0] if broken else 'none'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
