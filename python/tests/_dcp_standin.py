"""A minimal stand-in for torch.distributed.checkpoint, for torches that lack it (Debian's 1.13).

It implements only the on-disk contract of the stock FileSystemWriter/FileSystemReader that
gdsfs.dcp must honour (torch/distributed/checkpoint/filesystem.py): files named
``{prefix}{n}.distcp``, each tensor item a complete ``torch.save`` archive written to the stream at
its current position (no alignment), each byte item raw bytes, located by
``_StorageInfo(relative_path, offset, length)``; the reader ``torch.load``s an item's byte range
and narrows it to the requested chunk. Where the real module exists, tests use it instead and the
GPU script (scripts/gpu/dcp_2gpu.py) checks gdsfs.dcp against the real stock classes.
"""

from __future__ import annotations

import enum
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DEFAULT_SUFFIX = ".distcp"


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int


@dataclass
class _StoragePrefix:
    prefix: str


class WriteItemType(enum.Enum):
    TENSOR = 1
    BYTE_IO = 2


class LoadItemType(enum.Enum):
    TENSOR = 1
    BYTE_IO = 2


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: tuple[int, ...] | None = None


@dataclass
class WriteItem:
    index: MetadataIndex
    type: WriteItemType


@dataclass
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None


@dataclass
class ReadItem:
    type: LoadItemType
    storage_index: MetadataIndex
    storage_offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()


@dataclass
class LoadPlan:
    items: list[ReadItem]


@dataclass
class WriteResult:
    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


@dataclass
class Metadata:
    storage_data: dict[MetadataIndex, _StorageInfo] = field(default_factory=dict)


class DefaultLoadPlanner:
    """Targets from a dict of fqn -> tensor (resolve_tensor), bytes into a dict (load_bytes)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.bytes: dict[str, bytes] = {}
        self.committed: list[str] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.targets[req.storage_index.fqn]
        for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            t = t.narrow(dim, off, n)
        return t

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req.storage_index.fqn)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        self.bytes[req.storage_index.fqn] = value.read()


class SavePlannerStub:
    """resolve_data over a flat dict of fqn -> tensor or bytes."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> Any:
        v = self.data[item.index.fqn]
        return io.BytesIO(v) if isinstance(v, bytes) else v


class FileSystem:
    """The two operations of the stock FileSystem that finish() uses."""

    def rm_file(self, path: Path) -> None:
        path.unlink()

    def rename(self, path: Path, new_path: Path) -> None:
        path.rename(new_path)


class FileSystemWriter:
    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True) -> None:
        self.fs = FileSystem()
        self.path = Path(path)
        self.save_id = os.urandom(8).hex()
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        results = []
        groups = [plan.items] if self.single_file_per_rank else [[i] for i in plan.items]
        for n, items in enumerate(groups):
            name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
            with open(self.path / name, "wb") as stream:
                for wi in sorted(items, key=lambda w: w.type != WriteItemType.BYTE_IO):
                    off = stream.tell()
                    data = planner.resolve_data(wi)
                    if wi.type == WriteItemType.BYTE_IO:
                        stream.write(data.getbuffer())
                    else:
                        torch.save(data.detach().cpu().clone(), stream)
                    results.append(WriteResult(wi.index, stream.tell() - off, _StorageInfo(name, off, stream.tell() - off)))
        fut = torch.futures.Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        tmp = self.path / ".metadata.tmp"  # the stock commit: temp, fsync, unlink old, rename
        with open(tmp, "wb") as f:
            pickle.dump(metadata, f)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        final = self.path / ".metadata"
        if final.exists():
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()}


class FileSystemReader:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}

    def read_metadata(self) -> Metadata:
        with open(self.path / ".metadata", "rb") as f:
            md = pickle.load(f)
        self.storage_data = md.storage_data
        return md

    def read_data(self, plan: LoadPlan, planner: DefaultLoadPlanner) -> Any:
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            with open(self.path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(raw))
                continue
            t = torch.load(io.BytesIO(raw), map_location="cpu")
            for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                t = t.narrow(dim, off, n)
            target = planner.resolve_tensor(req)
            target.copy_(t)
            planner.commit_tensor(req, target)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def install() -> None:
    """Register this module as torch.distributed.checkpoint (and the submodules gdsfs.dcp imports)."""
    me = sys.modules[__name__]
    pkg = types.ModuleType("torch.distributed.checkpoint")
    pkg.__path__ = []  # type: ignore[attr-defined]
    pkg._gdsfs_standin = True  # type: ignore[attr-defined]
    pkg.FileSystemWriter = FileSystemWriter  # type: ignore[attr-defined]
    pkg.FileSystemReader = FileSystemReader  # type: ignore[attr-defined]
    pkg.filesystem = me  # type: ignore[attr-defined]
    sys.modules["torch.distributed.checkpoint"] = pkg
    for sub in ("filesystem", "planner", "storage", "default_planner"):
        sys.modules[f"torch.distributed.checkpoint.{sub}"] = me


def has_real_dcp() -> bool:
    """True when the installed torch has a usable torch.distributed.checkpoint."""
    try:
        import torch.distributed.checkpoint as dcp  # noqa: F401

        return hasattr(dcp, "FileSystemWriter") and not getattr(dcp, "_gdsfs_standin", False)
    except Exception:
        return False
