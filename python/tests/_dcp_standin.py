"""A minimal stand-in for torch.distributed.checkpoint, for torches that lack it (Debian's 1.13).

It implements the contract of torch 2.11's stock FileSystemWriter/FileSystemReader that gdsfs.dcp
must honour (torch/distributed/checkpoint/filesystem.py in 2.11), and the order in which
dcp.save/dcp.load call them (``save``/``load`` below):

- writer: ``reset``; ``set_up_storage_writer(is_coordinator, rank=, use_collectives=)``;
  ``prepare_local_plan`` (mkdir, then an existing ``.metadata`` warns, or raises when
  ``overwrite=False``); ``prepare_global_plan`` (``_StoragePrefix(f"__{i}_")`` per rank);
  ``write_data`` (files ``{prefix}{n}.distcp``, byte items first, each tensor item a complete
  ``torch.save`` archive written at the stream's position, no alignment, each located by
  ``_StorageInfo(relative_path, offset, length, transform_descriptors=None)``); ``finish``
  (``metadata.version``, ``storage_data`` from all ranks' results, ``storage_meta`` =
  ``StorageMeta(checkpoint_id, save_id)``; ``.metadata.tmp`` (``__{rank}.metadata.tmp`` without
  collectives), fsync, unlink an existing ``.metadata``, rename);
- reader: ``read_metadata`` (sets ``storage_meta.load_id``), ``set_up_storage_reader`` (takes
  ``storage_data`` from the metadata), ``read_data`` (each item's byte range through
  ``torch.load(weights_only=True)``, narrowed to the requested chunk).

Where the real module exists, tests use it instead and the GPU scripts
(scripts/gpu/checkpoint_check.py, dcp_2gpu.py) check gdsfs.dcp against the real stock classes.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import sys
import types
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_SUFFIX = ".distcp"


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


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
    # As torch 2.11's ReadItem: where in the target (the local chunk dest_index names) the
    # lengths land; None: at storage_offsets (this stand-in's older, one-chunk use).
    dest_index: MetadataIndex | None = None
    dest_offsets: tuple[int, ...] | None = None


@dataclass
class LoadPlan:
    items: list[ReadItem]


@dataclass
class WriteResult:
    index: MetadataIndex
    size_in_bytes: int
    storage_data: Any


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: str | None = None
    load_id: str | None = None


CURRENT_DCP_VERSION = "1.0.0"


@dataclass
class Metadata:
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


class DefaultLoadPlanner:
    """Targets from a dict of fqn -> tensor (resolve_tensor), bytes into a dict (load_bytes)."""

    def __init__(self, targets: dict[str, torch.Tensor]) -> None:
        self.targets = targets
        self.bytes: dict[str, bytes] = {}
        self.committed: list[str] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        t = self.targets[req.storage_index.fqn]
        dest = req.storage_offsets if req.dest_offsets is None else req.dest_offsets
        for dim, (off, n) in enumerate(zip(dest, req.lengths)):
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
    """The operations of the stock FileSystem that the writer and reader use."""

    def concat_path(self, path: Path, suffix: str) -> Path:
        return Path(path) / suffix

    def mkdir(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def exists(self, path: Path) -> bool:
        return Path(path).exists()

    def rm_file(self, path: Path) -> None:
        Path(path).unlink()

    def rename(self, path: Path, new_path: Path) -> None:
        Path(path).rename(new_path)


class FileSystemWriter:
    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True) -> None:
        self.fs = FileSystem()
        self.path = Path(path)
        self.save_id = str(uuid.uuid4())
        self.single_file_per_rank = single_file_per_rank
        self.sync_files = sync_files
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.rank: int | None = None
        self.use_collectives = True

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def _get_metadata_path(self, rank: int | None = None) -> Path:
        return self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.fs.mkdir(self.path)
        if self.fs.exists(self._get_metadata_path(None if self.use_collectives else 0)):
            if not self.overwrite:
                raise RuntimeError(f"Checkpoint already exists and {self.overwrite=}.")
            warnings.warn(f"Detected an existing checkpoint in {self.path}, overwriting since {self.overwrite=}.",
                          stacklevel=2)
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) if p.storage_data is None else p
                for i, p in enumerate(plans)]

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def write_data(self, plan: SavePlan, planner: Any) -> Any:
        results = []
        groups = [plan.items] if self.single_file_per_rank else [[i] for i in plan.items]
        for n, items in enumerate(groups):
            name = f"{plan.storage_data.prefix}{n}{DEFAULT_SUFFIX}"
            with self.fs.concat_path(self.path, name).open("wb") as stream:
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
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        per_rank = not self.use_collectives and self.rank is not None
        # The stock commit: temp, fsync, unlink old, rename.
        tmp = self.fs.concat_path(self.path, f"__{self.rank}.metadata.tmp" if per_rank else ".metadata.tmp")
        with tmp.open("wb") as f:
            pickle.dump(metadata, f)
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        final = self._get_metadata_path(self.rank if per_rank else None)
        if self.fs.exists(final):
            self.fs.rm_file(final)
        self.fs.rename(tmp, final)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items()}


class FileSystemReader:
    def __init__(self, path: str | os.PathLike) -> None:
        self.fs = FileSystem()
        self.path = Path(path)
        self.storage_data: dict[MetadataIndex, _StorageInfo] = {}
        self.load_id = str(uuid.uuid4())

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self.fs.concat_path(self.path, ".metadata").open("rb") as f:
            md = pickle.load(f)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        assert self.storage_data is not None

    def read_data(self, plan: LoadPlan, planner: DefaultLoadPlanner) -> Any:
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for rel, reqs in per_file.items():
            with self.fs.concat_path(self.path, rel).open("rb") as f:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    f.seek(info.offset)
                    raw = f.read(info.length)
                    self._one(req, raw, planner)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut

    def _one(self, req: ReadItem, raw: bytes, planner: DefaultLoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(raw))
            return
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        for dim, (off, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            t = t.narrow(dim, off, n)
        target = planner.resolve_tensor(req)
        target.copy_(t)
        planner.commit_tensor(req, target)


def save(data: dict[str, Any], storage_writer: Any, checkpoint_id: Any = None) -> Metadata:
    """dcp.save's calls on a one-rank storage writer, in torch 2.11's order; ``data`` is a flat
    dict of fqn -> tensor or bytes (a BYTE_IO item)."""
    if checkpoint_id is not None:
        storage_writer.reset(checkpoint_id)
    storage_writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    items = [WriteItem(MetadataIndex(k), WriteItemType.BYTE_IO if isinstance(v, bytes) else WriteItemType.TENSOR)
             for k, v in data.items()]
    local = storage_writer.prepare_local_plan(SavePlan(items))
    (final,) = storage_writer.prepare_global_plan([local])
    results = storage_writer.write_data(final, SavePlannerStub(data)).wait()
    md = Metadata()
    storage_writer.finish(md, [results])
    return md


def load(targets: dict[str, torch.Tensor], byte_keys: list[str], storage_reader: Any,
         chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] | None = None) -> DefaultLoadPlanner:
    """dcp.load's calls on a one-rank storage reader: whole tensors (or the given chunks) into
    ``targets``, byte items into the returned planner's ``bytes``."""
    md = storage_reader.read_metadata()
    storage_reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner(targets)
    reqs = [ReadItem(LoadItemType.BYTE_IO, MetadataIndex(k)) for k in byte_keys]
    for k, v in targets.items():
        for offs, lens in (chunks or {}).get(k, [((0,) * v.dim(), tuple(v.shape))]):
            reqs.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(k), offs, lens))
    storage_reader.read_data(LoadPlan(reqs), planner).wait()
    return planner


Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a chunk in the global tensor


def save_ranks(per_rank: list[dict[str, dict[Chunk, torch.Tensor]]], make_writer: Any) -> Metadata:
    """dcp.save's calls for ``len(per_rank)`` ranks, one writer each (``make_writer(rank)``).

    ``per_rank[r]`` maps fqn -> {chunk: local tensor} (a rank's shards of a sharded tensor,
    saved as torch 2.11 saves DTensor shards: one item per chunk, indexed by fqn and offsets).
    Returns the metadata, with ``chunks``: fqn -> the saved chunks.
    """
    writers = [make_writer(r) for r in range(len(per_rank))]
    local = []
    for r, w in enumerate(writers):
        w.set_up_storage_writer(r == 0, rank=r, use_collectives=True)
        items = [WriteItem(MetadataIndex(fqn, offs), WriteItemType.TENSOR)
                 for fqn, chunks in per_rank[r].items() for (offs, _) in chunks]
        local.append(w.prepare_local_plan(SavePlan(items)))
    plans = writers[0].prepare_global_plan(local)
    results = []
    for r, w in enumerate(writers):
        data = {MetadataIndex(fqn, offs): t for fqn, chunks in per_rank[r].items() for (offs, _), t in chunks.items()}
        results.append(w.write_data(plans[r], _IndexPlanner(data)).wait())
    md = Metadata()
    writers[0].finish(md, results)
    md.chunks = {}  # type: ignore[attr-defined]
    for rank in per_rank:
        for fqn, chunks in rank.items():
            md.chunks.setdefault(fqn, []).extend(chunks)  # type: ignore[attr-defined]
    return md


class _IndexPlanner:
    def __init__(self, data: dict[MetadataIndex, torch.Tensor]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> Any:
        return self.data[item.index]


def read_items(fqn: str, saved: list[Chunk], local: Chunk) -> list[ReadItem]:
    """The ReadItems torch 2.11's planner makes (create_read_items_for_chunk_list) for loading the
    local chunk ``local`` of ``fqn`` from a checkpoint whose saved chunks are ``saved``: one per
    overlapping saved chunk, with the overlap's offsets within the saved chunk (storage_offsets)
    and within the local chunk (dest_offsets)."""
    out = []
    loffs, lsizes = local
    for soffs, ssizes in saved:
        lo = [max(a, b) for a, b in zip(loffs, soffs)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(loffs, lsizes, soffs, ssizes)]
        if any(h <= a for a, h in zip(lo, hi)):
            continue
        out.append(ReadItem(
            LoadItemType.TENSOR, MetadataIndex(fqn, tuple(soffs)),
            storage_offsets=tuple(a - b for a, b in zip(lo, soffs)),
            lengths=tuple(h - a for a, h in zip(lo, hi)),
            dest_index=MetadataIndex(fqn, tuple(loffs)),
            dest_offsets=tuple(a - b for a, b in zip(lo, loffs)),
        ))
    return out


def load_items(targets: dict[str, torch.Tensor], items: list[ReadItem], storage_reader: Any) -> DefaultLoadPlanner:
    """dcp.load's calls on one rank for explicit ReadItems into ``targets`` (fqn -> local chunk)."""
    md = storage_reader.read_metadata()
    storage_reader.set_up_storage_reader(md, True)
    planner = DefaultLoadPlanner(targets)
    storage_reader.read_data(LoadPlan(items), planner).wait()
    return planner


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
