#!/usr/bin/env python3
"""Two-GPU torch.distributed.checkpoint check of gdsfs.dcp against stock DCP (issue 7).

Usage: dcp_2gpu.py MOUNTPOINT BACKING_DIR

Runs on a machine with 2 GPUs (nvidia-h200-x2), no torchrun: it spawns 2 ranks with
torch.multiprocessing (process group "cpu:gloo,cuda:nccl" over a free local TCP port). MOUNTPOINT is
a gdsfs mount serving BACKING_DIR. Each rank builds the same sharded state dict (DTensors sharded
on dim 0 and dim 1, a replicated DTensor, a plain replicated tensor, plain Python values and a
dataloader-like Stateful riding along as BYTE_IO), then under <mount>/gdsfs-dcp-2gpu/:

1. dcp.save with GDSFileSystemWriter and with the stock FileSystemWriter;
2. stock FileSystemReader loads the gdsfs checkpoint, GDSFileSystemReader loads the stock one and
   its own, all into the same sharding; the values must equal the originals;
3. GDSFileSystemReader loads the gdsfs checkpoint into a different sharding (resharding on load);
4. the gdsfs checkpoint has the stock layout (.metadata + __{rank}_{n}.distcp) with every tensor
   item starting on a 4096-byte boundary, and the daemon's counters show the bytes went through
   the control path;
5. dcp.async_save with GDSFileSystemWriter, loaded back by the stock reader.

Prints one line per check and rank; exit status 0 when every check passed on both ranks, 1
otherwise, 2 on usage errors.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import socket
import sys
import traceback
import warnings
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SUBDIR = "gdsfs-dcp-2gpu"
WORLD = 2


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(42)
    return {
        "w": torch.randn(1024, 512, generator=g),
        "e": torch.randn(4096, 256, generator=g).to(torch.bfloat16),
        "b": torch.randn(1000, generator=g),
        "i": torch.randint(-(1 << 40), 1 << 40, (333,), generator=g),
    }


class Loader:
    """A dataloader's resume state as DCP sees it: a Stateful (state_dict / load_state_dict), the
    protocol gdsfs.torch.DataLoader and GDSShardDataset implement."""

    def __init__(self, epoch: int, sample: int) -> None:
        self.state = {"epoch": epoch, "sample_in_epoch": sample, "order": [3, 1, 2]}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def make_state(mesh: Any, placements: dict[str, Any], fill: float | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    out: dict[str, Any] = {}
    for k, t in full_tensors().items():
        src = t if fill is None else torch.full_like(t, fill)
        src = src.cuda()
        out[k] = src if placements.get(k) is None else distribute_tensor(src, mesh, placements[k])
    extra = {"step": 5, "loader": {"epoch": 2, "sample_in_epoch": 999, "seed": 1234}}
    if fill is not None:
        extra = {"step": 0, "loader": {"epoch": 0, "sample_in_epoch": 0, "seed": 0}}
    loader = Loader(2, 999) if fill is None else Loader(0, 0)
    return {"model": out, "extra": extra, "loader": loader}


def check_equal(got: dict[str, Any]) -> None:
    want = full_tensors()
    for k, t in want.items():
        v = got["model"][k]
        v = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert v.dtype == t.dtype and tuple(v.shape) == tuple(t.shape), k
        assert torch.equal(v.cpu(), t), f"{k} differs"
    assert got["extra"] == {"step": 5, "loader": {"epoch": 2, "sample_in_epoch": 999, "seed": 1234}}, got["extra"]
    assert got["loader"].state == Loader(2, 999).state, got["loader"].state


def worker(rank: int, port: int, mount: str, results: Any) -> None:
    warnings.simplefilter("always")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.cuda.set_device(rank)
    # A bounded timeout: a rank that dies must not leave the other waiting forever.
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=180))
    failures: list[str] = []
    try:
        run_checks(rank, mount, failures)
    except BaseException as e:  # noqa: BLE001 - reported below (CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failures.append(f"setup: {type(e).__name__}: {e}")
        traceback.print_exc()
    finally:
        results.put((rank, failures))
        dist.destroy_process_group()


def run_checks(rank: int, mount: str, failures: list[str]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    import gdsfs.dcp as gdcp

    mesh = init_device_mesh("cuda", (WORLD,))
    base = os.path.join(mount, SUBDIR)
    d_gds, d_stock, d_async = (os.path.join(base, n) for n in ("gds", "stock", "async"))
    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(base)
    dist.barrier()
    saving = {"w": [Shard(0)], "e": [Shard(1)], "b": [Replicate()], "i": None}
    resharded = {"w": [Shard(1)], "e": [Replicate()], "b": [Shard(0)], "i": None}
    sd = make_state(mesh, saving)
    c0 = json.loads(os.getxattr(mount, "user.gdsfs.stats"))["counters"]

    def check(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            print(f"dcp_2gpu: rank {rank}: ok   {name}", flush=True)
        except BaseException as e:  # noqa: BLE001 - every failure is reported
            # torch.distributed.checkpoint raises CheckpointException, a BaseException: caught
            # here so one failing check does not end the run.
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            failures.append(f"{name}: {type(e).__name__}: {e}")
            print(f"dcp_2gpu: rank {rank}: FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=8)
        dist.barrier()

    def load_with(reader: Any, placements: dict[str, Any]) -> dict[str, Any]:
        dst = make_state(mesh, placements, fill=0)
        dcp.load(dst, storage_reader=reader)
        return dst

    check("save with GDSFileSystemWriter", lambda: dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(d_gds)))
    check("save with stock FileSystemWriter", lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(d_stock)))
    check("stock reader loads the gdsfs checkpoint", lambda: check_equal(load_with(dcp.FileSystemReader(d_gds), saving)))
    check("gdsfs reader loads the stock checkpoint", lambda: check_equal(load_with(gdcp.GDSFileSystemReader(d_stock), saving)))
    check("gdsfs reader loads the gdsfs checkpoint", lambda: check_equal(load_with(gdcp.GDSFileSystemReader(d_gds), saving)))
    check("gdsfs reader reshards on load", lambda: check_equal(load_with(gdcp.GDSFileSystemReader(d_gds), resharded)))
    check("stock reader reshards the gdsfs checkpoint", lambda: check_equal(load_with(dcp.FileSystemReader(d_gds), resharded)))

    def layout() -> None:
        names = sorted(os.listdir(d_gds))
        assert names == sorted(os.listdir(d_stock)), (names, sorted(os.listdir(d_stock)))
        with open(os.path.join(d_gds, ".metadata"), "rb") as f:
            md = pickle.load(f)
        offs = [(i.relative_path, i.offset) for i in md.storage_data.values()]
        tensor_fqns = {k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks")}
        bad = [(idx.fqn, info.offset) for idx, info in md.storage_data.items() if idx.fqn in tensor_fqns and info.offset % 4096]
        assert not bad, f"tensor items not 4 KiB-aligned: {bad}"
        assert offs, "no storage data"
        c1 = json.loads(os.getxattr(mount, "user.gdsfs.stats"))["counters"]
        assert c1["write_bytes"] > c0["write_bytes"] and c1["read_bytes"] > c0["read_bytes"], (c0, c1)
        print(f"dcp_2gpu: files {names}; daemon +{(c1['write_bytes'] - c0['write_bytes']) >> 20} MiB written, "
              f"+{(c1['read_bytes'] - c0['read_bytes']) >> 20} MiB read", flush=True)

    if rank == 0:
        check("gdsfs checkpoint layout and control-path counters", layout)
    else:
        dist.barrier()

    def async_round() -> None:
        src = make_state(mesh, saving)
        fut = dcp.async_save(src, storage_writer=gdcp.GDSFileSystemWriter(d_async))
        fut = getattr(fut, "upload_completion", fut)
        fut.result()
        check_equal(load_with(dcp.FileSystemReader(d_async), saving))

    check("async_save with GDSFileSystemWriter", async_round)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    mount, backing = sys.argv[1], sys.argv[2]
    if torch.cuda.device_count() < WORLD:
        print(f"dcp_2gpu: needs {WORLD} GPUs, found {torch.cuda.device_count()}: run it on nvidia-h200-x2", file=sys.stderr)
        return 2
    import gdsfs

    if gdsfs.find_mount(mount) is None:
        print(f"dcp_2gpu: {mount} is not a gdsfs mount: mount it with `gdsfs mount --source {backing} {mount}`", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    try:
        mp.start_processes(worker, args=(free_port(), mount, results), nprocs=WORLD, join=True, start_method="spawn")
    except Exception as e:  # noqa: BLE001 - a rank died; its output says why
        print(f"dcp_2gpu: a rank failed: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(os.path.join(mount, SUBDIR), ignore_errors=True)
    failures = []
    while not results.empty():
        rank, f = results.get()
        failures += [f"rank {rank}: {x}" for x in f]
    if failures:
        print(f"dcp_2gpu: {len(failures)} check(s) FAILED:\n  " + "\n  ".join(failures))
        return 1
    print("dcp_2gpu: all checks passed on both ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
