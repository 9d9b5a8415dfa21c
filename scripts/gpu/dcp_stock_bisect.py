#!/usr/bin/env python3
"""Which step of checkpoint_check.py's benchmark breaks a later stock ``dcp.save`` in the same
process (2026-12-01 18:30 GPU run: "unexpected pos 704 vs 598" from torch.save's zip writer).

Runs the benchmark's steps in its order on a small state dict; after each, a stock
FileSystemWriter save of two CUDA tensors into the mount, loaded back and compared. Every
failure names the error behind torch's "unexpected pos" (checkpoint_check.root_cause) and the
backing filesystem's free space and deleted-but-open files.

Then the two experiments that decide the 18:30 failure (docs/gpu-pending.md):
- space: a gdsfs DCP save loaded three times and deleted through the mount must give its blocks
  back at once (the daemon's lookup stash kept them 2-3 s before fs commit "a re-lookup stashes
  on the node go-fuse keeps"), measured by statvfs right after the delete;
- full disk: with the backing filesystem filled to 64 MiB short of full, a stock save of one
  8192x8192 bf16 tensor must fail with the same "unexpected pos 704 vs 598" and an ENOSPC behind
  it: the 18:30 message is then a write error, and its record offsets (598: the start of data/0
  after data.pkl, .format_version, .storage_alignment "64" and byteorder; 704: past its 106-byte
  local header) match.

Usage: dcp_stock_bisect.py MOUNTPOINT BACKING_DIR [--gib N] [--no-fill]
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
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import gdsfs.checkpoint as gck  # noqa: E402
import gdsfs.dcp as gdcp  # noqa: E402
import gdsfs.safetensors as gst  # noqa: E402
from checkpoint_check import describe_error, root_cause, space_report  # noqa: E402

warnings.filterwarnings("ignore")


def log(msg: str) -> None:
    print(f"bisect: {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mount")
    ap.add_argument("backing")
    ap.add_argument("--gib", type=float, default=1)
    ap.add_argument("--no-fill", action="store_true", help="skip the full-disk experiment")
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
            log(f"after {after}: stock dcp.save {'of the full dict ' if full else ''}FAILED: {describe_error(e)[:400]}")
            traceback.print_exc(limit=3)
            rc = root_cause(e)
            if rc is not e:
                traceback.print_exception(type(rc), rc, rc.__traceback__, limit=6, chain=False)
            log(f"after {after}: {space_report(a.backing)}")
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
    log(f"first broken after: {broken[0] if broken else 'none'}")
    freed = space_freed(sd, w, a.backing)
    fill = None if a.no_fill else full_disk(w, a.backing)
    shutil.rmtree(w, ignore_errors=True)
    return 1 if broken or not freed or fill is False else 0


def avail(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def space_freed(sd: dict, w: str, backing: str) -> bool:
    """A gdsfs DCP save, loaded three times (the loads look its names up again), deleted through
    the mount: statvfs right after the delete must show its bytes back (within 64 MiB)."""
    p = os.path.join(w, "freed")
    before = avail(backing)
    dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(p))
    size = sum(os.path.getsize(os.path.join(p, n)) for n in os.listdir(p))
    for _ in range(3):
        dcp.load({k: torch.empty_like(v) for k, v in sd.items()}, storage_reader=gdcp.GDSFileSystemReader(p))
    shutil.rmtree(p)
    short = before - avail(backing)
    ok = short < (64 << 20)
    log(f"space: a {size / 2**30:.2f} GiB gdsfs DCP save, loaded 3 times, deleted through the mount: "
        f"{short / 2**20:.0f} MiB short of the space before it right after the delete "
        f"({'ok' if ok else 'NOT FREED AT ONCE'}); {space_report(backing)}")
    return ok


def full_disk(w: str, backing: str) -> bool | None:
    """Fill the backing filesystem to 64 MiB short of full (root may write into the reserved
    blocks: f_bfree), then a stock save of one 8192x8192 bf16 tensor (128 MiB): True when it
    fails as the 18:30 run did with an ENOSPC behind it, False when it fails otherwise, None when
    the filler could not be made. The filler is removed before returning."""
    import errno

    filler = os.path.join(backing, "bisect-filler")
    st = os.statvfs(backing)
    made = False
    # Root may write into the reserved blocks (f_bfree); where it may not, f_bavail is the wall.
    for free in (st.f_bfree, st.f_bavail):
        n = free * st.f_frsize - (64 << 20)
        if n <= 0:
            continue
        try:
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, n)
            finally:
                os.close(fd)
            made = True
            break
        except OSError as e:
            log(f"full disk: cannot make a {n / 2**30:.1f} GiB filler ({e})")
            if os.path.exists(filler):
                os.unlink(filler)
    if not made:
        log("full disk: no filler: skipped")
        return None
    p = os.path.join(w, "full")
    try:
        log(f"full disk: {space_report(backing)}")
        dcp.save({"w": torch.randn(8192, 8192, device="cuda").to(torch.bfloat16)}, storage_writer=dcp.FileSystemWriter(p))
        log("full disk: the stock save SUCCEEDED with 64 MiB free: the filler did not fill the disk")
        return None
    except BaseException as e:  # noqa: BLE001
        rc = root_cause(e)
        same = "unexpected pos 704 vs 598" in str(getattr(e, "failures", {0: (e,)}).get(0, (e,))[0])
        enospc = isinstance(rc, OSError) and rc.errno == errno.ENOSPC
        log(f"full disk: stock save failed: {describe_error(e)[:300]}")
        log(f"full disk: torch's message {'IS' if same else 'is NOT'} the 18:30 one (704 vs 598); the error "
            f"behind it {'is' if enospc else 'is NOT'} ENOSPC")
        return same and enospc
    finally:
        os.unlink(filler)
        shutil.rmtree(p, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
