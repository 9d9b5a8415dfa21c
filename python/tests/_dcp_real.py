"""Helpers for the real-DCP tests (torch >= 2.x): process groups, and a 2-rank save run in
spawned processes (importable by multiprocessing's spawn, unlike a test module)."""

from __future__ import annotations

import contextlib
import datetime
import socket
import traceback
from typing import Any, Iterator

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group (what dcp.async_save and DTensors need), torn down after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
    finally:
        dist.destroy_process_group()


def full(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


SHAPES = {"w": (64, 48), "e": (10, 30)}


def save_shard0(rank: int, port: int, d: str, errq: Any) -> None:
    """Rank ``rank`` of 2 saves its Shard(0) half of every SHAPES tensor (CPU DTensors, gloo)."""
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        import gdsfs.dcp as gdcp

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (2,))
        sd = {}
        for i, (k, shape) in enumerate(SHAPES.items()):
            t = full(i, shape)
            half = -(-shape[0] // 2)
            mine = t[rank * half:(rank + 1) * half].clone()
            sd[k] = DTensor.from_local(mine, mesh, [Shard(0)], run_check=False, shape=t.shape, stride=t.stride())
        dcp.save({"model": sd}, storage_writer=gdcp.GDSFileSystemWriter(d))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        errq.put(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}")
        raise
