"""GDSShardDataset and gdsfs.torch.DataLoader (re-exported by gdsfs.torch).

Runs in DataLoader workers: plans each epoch's samples for this (rank,
worker) slot, asks the daemon for the gpu fields of a group of samples with
one request per shard, and yields GDSSamples of TensorRefs and decoded CPU
fields. Never touches CUDA.
"""

from __future__ import annotations

import glob
import json
import multiprocessing
import multiprocessing.context
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.utils.data

from . import _core, _layout
from . import _protocol as proto
from ._core import Ref, Session
from ._errors import GDSUnavailableError, warn_fallback
from ._plan import EpochPlan, expand_braces
from ._tensors import GDSBatch, GDSSample, TensorRef, _numel, _torch_dtype, _view_as, collate

__all__ = ["DataLoader", "GDSShardDataset", "StatefulDataLoader"]


# ----------------------------------------------------------------------------
# Decoding of CPU fields.


def _npy_tensor(b: bytes) -> torch.Tensor:
    h = _layout.parse_npy_header(b)
    dt = _torch_dtype(h.dtype)
    data = bytearray(b[h.data_offset :])
    t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return _view_as(t, dt, h.shape, h.fortran_order)


def _default_decode(field: str, data: bytes) -> Any:
    ext = field.rsplit(".", 1)[-1].lower()
    if ext in ("cls", "cls2", "index", "inx", "id"):
        return int(data.decode().strip())
    if ext in ("txt", "text", "transcript"):
        return data.decode()
    if ext in ("json", "jsn"):
        return json.loads(data)
    if ext == "npy":
        return _npy_tensor(data)
    return data


def _mds_decode(encoding: str, data: bytes) -> Any:
    if encoding in _layout.MDS_FIXED:
        fmt, _ = _layout.MDS_FIXED[encoding]
        return struct.unpack(fmt, data)[0]
    if encoding == "bytes":
        return data
    if encoding == "str":
        return data.decode()
    if encoding == "json":
        return json.loads(data)
    if encoding.startswith("ndarray"):
        at, dtype, shape = _layout.mds_ndarray_prefix(encoding, data)
        buf = bytearray(data[at:])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return _view_as(t, _torch_dtype(dtype), shape, False)
    # jpeg/png/pil/pkl/str_int...: hand the bytes to a user decoder.
    return data


# ----------------------------------------------------------------------------
# The dataset.


@dataclass(frozen=True)
class _FieldPlan:
    """How to produce one field of one sample."""

    name: str
    offset: int
    length: int
    gpu: bool
    kind: str  # "bytes", "npy", "mds:<encoding>", "raw"


class _ShardState:
    """A shard open in this process: its descriptor and parsed index."""

    def __init__(self, path: str, fd: int, index: dict[str, Any]) -> None:
        self.path, self.fd, self.index = path, fd, index

    def close(self) -> None:
        os.close(self.fd)


def _rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _EpochBox:
    """A plain stand-in for the shared epoch value."""

    def __init__(self, value: int) -> None:
        self.value = value


class GDSShardDataset(torch.utils.data.IterableDataset):
    """An IterableDataset over WebDataset tars, MDS shards or .npy/raw files
    whose gpu_keys fields the gdsfs daemon reads into GPU (or host) memory.

    Workers never touch CUDA: fields named in gpu_keys arrive as TensorRefs,
    collated lazily by collate() and materialized by GDSBatch.pin_memory()
    (DataLoader pin_memory=True) or materialize(). Other fields are read with
    pread and decoded on the CPU. When the shards are not on a gdsfs mount
    (or the daemon cannot serve), the dataset warns once (GDSFallbackWarning)
    and reads everything with pread; strict=True raises GDSUnavailableError.

    Each epoch's sample order is fixed by (seed, epoch); it is cut into one
    contiguous block per (rank, worker), so every sample is read exactly once
    per epoch. state_dict()/load_state_dict() resume mid-epoch exactly (the
    same world size and num_workers are required).

    Args:
        shards: shard paths, brace patterns ("train-{000..099}.tar"), glob
            patterns ("train-*.tar", sorted), or an MDS dataset directory
            (with index.json).
        format: "auto" (by extension), "wds"/"tar", "mds", "npy" or "raw".
        gpu_keys: fields delivered as tensors from daemon memory: tar member
            extensions ("x.npy", "jpg"), MDS columns, "npy"/"raw" for files.
        decode: CPU decoder for other fields: a callable(field, bytes) or a
            mapping {field: callable(bytes)}; default: by extension (cls ->
            int, txt -> str, json -> object, npy -> tensor, else bytes).
        field_spec: {field: (dtype, shape)} for gpu fields of raw bytes
            (default: 1-D uint8).
        shuffle: shuffle shard order and samples within shards per epoch.
        seed: shuffle seed.
        split_by_node: split samples across torch.distributed ranks.
        split_by_worker: split samples across DataLoader workers.
        device: where the daemon reads gpu fields: a CUDA ordinal or device,
            "cpu"/-1 for host memory; default LOCAL_RANK or 0 when the daemon
            has GPUs, host memory otherwise.
        strict: raise GDSUnavailableError instead of falling back.
        read_ahead: most samples planned and read together (one daemon
            request per shard per group).
        read_ahead_bytes: most gpu-field bytes read together (at least one
            sample): bounds the daemon memory a worker holds ahead of its
            batches.
    """

    def __init__(
        self,
        shards: Union[str, Sequence[str]],
        *,
        format: str = "auto",
        gpu_keys: Optional[Sequence[str]] = None,
        decode: Union[Callable[[str, bytes], Any], Mapping[str, Callable[[bytes], Any]], None] = None,
        field_spec: Optional[Mapping[str, tuple[torch.dtype, tuple[int, ...]]]] = None,
        shuffle: bool = False,
        seed: int = 0,
        split_by_node: bool = True,
        split_by_worker: bool = True,
        device: Union[int, str, torch.device, None] = None,
        strict: bool = False,
        read_ahead: int = 64,
        read_ahead_bytes: int = 64 << 20,
    ) -> None:
        super().__init__()
        self.shards = self._expand(shards)
        if not self.shards:
            raise ValueError(f"gdsfs: no shards in {shards!r}")
        fmt = {"wds": "tar", "webdataset": "tar"}.get(format, format)
        if fmt not in ("auto", "tar", "mds", "npy", "raw"):
            raise ValueError(f"gdsfs: format {format!r} is not one of auto, wds, mds, npy, raw")
        self.format = fmt
        self.gpu_keys = tuple(gpu_keys or ())
        self.decode = decode
        self.field_spec = dict(field_spec or {})
        self.shuffle, self.seed = shuffle, int(seed)
        self.split_by_node, self.split_by_worker = split_by_node, split_by_worker
        self.strict = strict
        if read_ahead < 1:
            raise ValueError(f"gdsfs: read_ahead {read_ahead} must be >= 1")
        self.read_ahead = read_ahead
        if read_ahead_bytes < 1:
            raise ValueError(f"gdsfs: read_ahead_bytes {read_ahead_bytes} must be >= 1")
        self.read_ahead_bytes = read_ahead_bytes
        # Shared memory, so that set_epoch() reaches persistent workers.
        self._epoch: Any = multiprocessing.RawValue("q", 0)
        self._resume: dict[int, int] = {}
        self._resume_epoch = 0
        self._consumed: dict[int, int] = {}
        self._slots_seen = 0
        self._lock = threading.Lock()
        mounts = {_core.find_mount(p) for p in self.shards}
        self._session: Optional[Session] = None
        if len(mounts) > 1:
            warn_fallback(f"shards lie on {len(mounts)} different mounts ({sorted(map(str, mounts))})", strict=strict)
        else:
            self._session = Session.open(self.shards[0], device=self._pick_device(device, self.shards[0]), strict=strict)
        self._open: "OrderedDict[int, _ShardState]" = OrderedDict()
        self._open_pid = os.getpid()
        self.counts = [self._count(i) for i in range(len(self.shards))]

    # -- configuration ------------------------------------------------------

    @staticmethod
    def _expand(shards: Union[str, Sequence[str]]) -> list[str]:
        pats = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
        out: list[str] = []
        for p in pats:
            p = os.fspath(p)
            if os.path.isdir(p) and os.path.exists(os.path.join(p, "index.json")):
                out.extend(GDSShardDataset._mds_dir(p))
                continue
            for q in expand_braces(p):
                if any(c in q for c in "*?["):
                    found = sorted(glob.glob(q))
                    if not found:
                        raise FileNotFoundError(f"gdsfs: no shard matches {q!r}: check the pattern")
                    out.extend(found)
                    continue
                if not os.path.exists(q):
                    raise FileNotFoundError(f"gdsfs: shard {q!r} does not exist: check the path or brace pattern")
                out.append(q)
        return out

    @staticmethod
    def _mds_dir(d: str) -> list[str]:
        with open(os.path.join(d, "index.json")) as f:
            idx = json.load(f)
        out = []
        for s in idx.get("shards", []):
            raw = s.get("raw_data") or {}
            if not raw.get("basename") or not os.path.exists(os.path.join(d, raw["basename"])):
                z = (s.get("zip_data") or {}).get("basename")
                raise ValueError(f"gdsfs: MDS shard {z!r} in {d!r} is compressed and has no raw copy: only uncompressed shards can be read by range")
            out.append(os.path.join(d, raw["basename"]))
        return out

    @staticmethod
    def _pick_device(device: Union[int, str, torch.device, None], path: str) -> Optional[int]:
        if isinstance(device, (str, torch.device)):
            d = torch.device(device)
            if d.type != "cuda":
                return -1
            return d.index if d.index is not None else 0
        if device is not None:
            return device
        lr = os.environ.get("LOCAL_RANK")
        if lr is None:
            return None
        try:
            caps = _core.capabilities(path)
        except GDSUnavailableError:
            return None
        return int(lr) if caps.devices else None

    @property
    def session(self) -> Optional[Session]:
        """The gdsfs session (None when reading with plain pread)."""
        return self._session

    @property
    def gds(self) -> bool:
        """True when gpu_keys fields come from daemon memory."""
        return self._session is not None

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all of its workers together)."""
        total = sum(self.counts)
        rank, world = _rank_world() if self.split_by_node else (0, 1)
        return (rank + 1) * total // world - rank * total // world

    def _close_shards(self) -> None:
        if self._open_pid == os.getpid():
            for st in self._open.values():
                st.close()
        self._open = OrderedDict()
        self._open_pid = os.getpid()

    def close(self) -> None:
        """Close shard descriptors and the session: no new reads through
        gdsfs from now on. The session ends, and every lease of the dataset
        (also those of batches never delivered, e.g. by a killed worker)
        returns to the pool, once no sample, batch or view of it is held in
        this process any more (docs/pytorch.md, "Lease ownership").
        Idempotent."""
        self._close_shards()
        if self._session is not None and self._session._owner_pid == os.getpid():
            self._session.close()

    def reclaim(self) -> None:
        """Continue with a fresh session and close the old one: its leases
        return to the pool once nothing here holds them (samples and
        batches still in use stay valid). Call it after a failed or
        abandoned iteration, when its workers are gone."""
        s = self._session
        if s is None or s._owner_pid != os.getpid():
            return
        self._close_shards()
        s.close()
        self._session = Session(s.mount, device=s.device)

    def __enter__(self) -> "GDSShardDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def epoch(self) -> int:
        """The current epoch (set_epoch)."""
        return int(self._epoch.value)

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self._epoch.value = int(epoch)

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_open"] = OrderedDict()
        st["_lock"] = None
        if multiprocessing.context.get_spawning_popen() is None:
            # Pickled for something other than starting a worker: the
            # shared epoch cannot travel, its value does.
            st["_epoch"] = _EpochBox(self.epoch)
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        self._lock = threading.Lock()
        self._open_pid = os.getpid()

    # -- epochs and resume --------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch (mixed into the shuffle), like DistributedSampler."""
        self.epoch = int(epoch)
        with self._lock:
            self._consumed = {}

    def _slots(self) -> tuple[int, int, int]:
        """(slot, slots, num_workers) of the calling process."""
        rank, world = _rank_world() if self.split_by_node else (0, 1)
        wi = torch.utils.data.get_worker_info()
        wid, nw = (wi.id, wi.num_workers) if (wi is not None and self.split_by_worker) else (0, 1)
        return rank * nw + wid, world * nw, nw

    def state_dict(self) -> dict[str, Any]:
        """Progress in the current epoch: samples handed out per slot.

        In a worker (StatefulDataLoader) it covers that worker; in the main
        process it covers what it iterated itself or what gdsfs.torch.DataLoader
        delivered."""
        with self._lock:
            return {"version": 1, "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle, "slots": self._slots_seen, "consumed": dict(self._consumed)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume: the next iteration of state["epoch"] skips what state says
        was consumed. Requires the same world size and num_workers."""
        if state.get("version") != 1:
            raise ValueError(f"gdsfs: dataset state version {state.get('version')!r} is not 1: was it saved by gdsfs.torch.GDSShardDataset?")
        if int(state["seed"]) != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ValueError(f"gdsfs: state was saved with seed={state['seed']} shuffle={state['shuffle']}, this dataset has seed={self.seed} shuffle={self.shuffle}")
        self.epoch = int(state["epoch"])
        with self._lock:
            self._resume = {int(k): int(v) for k, v in dict(state["consumed"]).items()}
            self._resume_epoch = self.epoch
            self._consumed = dict(self._resume)
            self._slots_seen = int(state.get("slots", 0))

    def _main_iteration_starting(self) -> None:
        """gdsfs.torch.DataLoader starts an iteration: count delivered
        samples afresh (from the resume point, if one is pending)."""
        with self._lock:
            pending = bool(self._resume) and self._resume_epoch == self.epoch
            self._consumed = dict(self._resume) if pending else {}

    def _main_iteration_started(self) -> None:
        """The workers of the new iteration hold their copy of the resume
        state: later iterations start from the beginning."""
        with self._lock:
            self._resume = {}

    def _observe(self, epoch: int, progress: Mapping[int, int], slots: int) -> None:
        with self._lock:
            if epoch != self.epoch:
                return
            if slots:
                self._slots_seen = slots
            for k, v in progress.items():
                self._consumed[k] = max(self._consumed.get(k, 0), v)

    # -- shards -------------------------------------------------------------

    def _shard_format(self, path: str) -> str:
        return _layout.detect_format(path) if self.format == "auto" else self.format

    def _index_of(self, path: str, fd: int) -> dict[str, Any]:
        fmt = self._shard_format(path)
        if fmt == "raw":
            return {"format": "raw", "file_size": os.fstat(fd).st_size}
        if self._session is not None:
            try:
                doc = json.loads(_core._paged(fd, proto.INDEX, proto.INDEX_SIZE, "INDEX"))
            except OSError as e:
                err = _core._daemon_error("INDEX", e, repr(path))
                if self.strict:
                    raise err from e
                warn_fallback(str(err))
                return _layout.local_index(path, fmt)
            if doc.get("format") != fmt:
                raise ValueError(f"gdsfs: {path!r} is indexed as {doc.get('format')!r}, expected {fmt!r}: pass format= explicitly")
            return doc
        return _layout.local_index(path, fmt)

    def _shard(self, i: int) -> _ShardState:
        if self._open_pid != os.getpid():
            # Forked: descriptors are shared with the parent; reopen ours.
            self._open = OrderedDict()
            self._open_pid = os.getpid()
        st = self._open.get(i)
        if st is not None:
            self._open.move_to_end(i)
            return st
        path = self.shards[i]
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            st = _ShardState(path, fd, self._index_of(path, fd))
        except BaseException:
            os.close(fd)
            raise
        self._open[i] = st
        while len(self._open) > 8:
            _, old = self._open.popitem(last=False)
            old.close()
        return st

    def _count(self, i: int) -> int:
        idx = self._shard(i).index
        f = idx["format"]
        if f in ("tar", "mds"):
            return len(idx["samples"])
        return 1

    def _fields(self, st: _ShardState, idx: int) -> tuple[str, list[_FieldPlan]]:
        """Key and field plans of sample idx of a shard."""
        x = st.index
        f = x["format"]
        plans: list[_FieldPlan] = []
        if f == "tar":
            s = x["samples"][idx]
            for name, m in s["fields"].items():
                gpu = name in self.gpu_keys
                kind = "npy" if (gpu and name.rsplit(".", 1)[-1] == "npy" and name not in self.field_spec) else "bytes"
                plans.append(_FieldPlan(name, int(m["offset"]), int(m["length"]), gpu, kind))
            return s["key"], plans
        if f == "mds":
            s = x["samples"][idx]
            for c in x["columns"]:
                r = s["columns"][c["name"]]
                plans.append(_FieldPlan(c["name"], int(r["offset"]), int(r["length"]), c["name"] in self.gpu_keys, "mds:" + c["encoding"]))
            return f"{os.path.basename(st.path)}/{idx}", plans
        stem = os.path.basename(st.path)
        key, _, ext = stem.partition(".")
        ext = ext or "raw"
        if f == "npy":
            gpu = ext in self.gpu_keys or "npy" in self.gpu_keys
            plans.append(_FieldPlan(ext, 0, int(x["file_size"]), gpu, "npyfile"))
        else:
            gpu = ext in self.gpu_keys or "raw" in self.gpu_keys
            plans.append(_FieldPlan(ext, 0, int(x["file_size"]), gpu, "bytes"))
        return key, plans

    def _tensor_geometry(self, st: _ShardState, fp: _FieldPlan) -> tuple[int, int, torch.dtype, tuple[int, ...], bool]:
        """(data offset, data bytes, dtype, shape, fortran) of a gpu field.
        Reads at most a small header with pread; never the payload."""
        if fp.name in self.field_spec:
            dt, shape = self.field_spec[fp.name]
            return fp.offset, _numel(shape) * torch.empty((), dtype=dt).element_size(), dt, tuple(shape), False
        if fp.kind == "npyfile":
            x = st.index
            shape = tuple(int(v) for v in x["shape"])
            dt = _torch_dtype(x["dtype"])
            return int(x["data_offset"]), int(x["data_length"]), dt, shape, bool(x.get("fortran_order"))
        if fp.kind == "npy":
            head = os.pread(st.fd, min(fp.length, 4096), fp.offset)
            h = _layout.parse_npy_header(head)
            dt = _torch_dtype(h.dtype)
            nb = _numel(h.shape) * torch.empty((), dtype=dt).element_size()
            return fp.offset + h.data_offset, nb, dt, h.shape, h.fortran_order
        if fp.kind.startswith("mds:"):
            enc = fp.kind[4:]
            if enc in _layout.MDS_FIXED:
                return fp.offset, fp.length, _torch_dtype(enc), (), False
            if enc == "bytes":
                return fp.offset, fp.length, torch.uint8, (fp.length,), False
            if enc.startswith("ndarray"):
                dtype, shape = _layout.mds_ndarray_spec(enc)
                if dtype is not None and shape is not None:
                    return fp.offset, fp.length, _torch_dtype(dtype), shape, False
                at, dname, shp = _layout.mds_ndarray_prefix(enc, os.pread(st.fd, min(fp.length, 1 + 1 + 8 * 64), fp.offset))
                return fp.offset + at, fp.length - at, _torch_dtype(dname), shp, False
            raise ValueError(f"gdsfs: MDS column {fp.name!r} has encoding {enc!r}, which cannot be a gpu_keys tensor (bytes, numeric scalars and ndarray can)")
        return fp.offset, fp.length, torch.uint8, (fp.length,), False

    def _decode_cpu(self, fp: _FieldPlan, data: bytes) -> Any:
        d = self.decode
        if isinstance(d, Mapping) and fp.name in d:
            return d[fp.name](data)
        if callable(d):
            return d(fp.name, data)
        if fp.kind.startswith("mds:"):
            return _mds_decode(fp.kind[4:], data)
        if fp.kind == "npyfile":
            return _npy_tensor(data)
        return _default_decode(fp.name, data)

    def _plain_tensor(self, st: _ShardState, fp: _FieldPlan) -> torch.Tensor:
        off, nb, dt, shape, fortran = self._tensor_geometry(st, fp)
        data = bytearray(os.pread(st.fd, nb, off))
        if len(data) != nb:
            raise ValueError(f"gdsfs: {st.path!r}: field {fp.name!r} is truncated ({len(data)} of {nb} bytes)")
        t = torch.frombuffer(data, dtype=torch.uint8) if nb else torch.empty(0, dtype=torch.uint8)
        return _view_as(t, dt, shape, fortran)

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[GDSSample]:
        slot, slots, _nw = self._slots()
        with self._lock:
            skip = self._resume.get(slot, 0) if self._resume_epoch == self.epoch else 0
            if self._resume and self._slots_seen and self._slots_seen != slots:
                raise ValueError(f"gdsfs: state was saved with {self._slots_seen} (rank, worker) slots, this run has {slots}: resume with the same world size and num_workers")
            self._resume = {}
            self._slots_seen = slots
            self._consumed = {slot: skip}
        plan = EpochPlan(self.counts, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, slots=slots)
        epoch = self.epoch
        pending: list[tuple[int, int, int]] = []
        for item in plan.positions(slot, skip):
            pending.append(item)
            if len(pending) >= self.read_ahead:
                yield from self._emit(pending, slot, plan, epoch)
                pending = []
        if pending:
            yield from self._emit(pending, slot, plan, epoch)

    def _emit(self, items: list[tuple[int, int, int]], slot: int, plan: EpochPlan, epoch: int) -> Iterator[GDSSample]:
        """Plan every sample of a chunk, then read it in groups of at most
        read_ahead_bytes of gpu fields with one daemon request per shard."""
        lo = plan.block(slot)[0]
        planned: list[tuple[int, int, _ShardState, str, list[_FieldPlan], dict[str, tuple[int, int, torch.dtype, tuple[int, ...], bool]]]] = []
        for pos, shard, idx in items:
            st = self._shard(shard)
            key, fields = self._fields(st, idx)
            geo = {fp.name: self._tensor_geometry(st, fp) for fp in fields if fp.gpu and self._session is not None}
            planned.append((pos, shard, st, key, fields, geo))
        start = 0
        while start < len(planned):
            end, acc = start, 0
            while end < len(planned):
                nb = sum(g[1] for g in planned[end][5].values())
                if end > start and acc + nb > self.read_ahead_bytes:
                    break
                acc += nb
                end += 1
            yield from self._read_group(planned[start:end], slot, lo, plan.slots, epoch)
            start = end

    def _read_group(self, group: list[Any], slot: int, lo: int, slots: int, epoch: int) -> Iterator[GDSSample]:
        wanted: dict[int, list[tuple[int, int]]] = {}
        for _pos, shard, _st, _key, fields, geo in group:
            for fp in fields:
                if fp.name in geo:
                    g = geo[fp.name]
                    wanted.setdefault(shard, []).append((g[0], g[1]))
        refs: dict[int, list[Ref]] = {}
        session = self._session
        held: dict[int, Ref] = {}  # lease id -> Ref, of samples not yet handed out
        try:
            for shard, ranges in wanted.items():
                assert session is not None
                try:
                    refs[shard] = session.read(self._shard(shard).fd, ranges)
                except GDSUnavailableError as e:
                    # The daemon cannot serve this shard now: plain reads
                    # (warned once per process), unless strict.
                    warn_fallback(f"the daemon cannot serve {self.shards[shard]!r}: {e}", strict=self.strict)
                    continue
                held.update((r.lease, r) for r in refs[shard] if r.lease)
            cursor = {s: 0 for s in refs}
            out: list[GDSSample] = []
            for pos, shard, st, key, fields, geo in group:
                sample = GDSSample(__key__=key, __url__=st.path)
                for fp in fields:
                    if fp.name in geo and shard in refs:
                        _off, nb, dt, shape, fortran = geo[fp.name]
                        r = refs[shard][cursor[shard]]
                        cursor[shard] += 1
                        if r.valid < nb:
                            raise ValueError(f"gdsfs: {st.path!r}: field {fp.name!r} of sample {key!r} is truncated ({r.valid} of {nb} bytes)")
                        sample[fp.name] = TensorRef(r, dt, shape, 0, fortran, field=fp.name, sample=key, path=st.path)
                    elif fp.gpu:
                        sample[fp.name] = self._plain_tensor(st, fp)
                    else:
                        sample[fp.name] = self._decode_cpu(fp, os.pread(st.fd, fp.length, fp.offset))
                sample.progress = (slot, pos - lo + 1, slots)
                sample.epoch = epoch
                sample.gpu_fields = self.gpu_keys
                out.append(sample)
            for sample in out:
                with self._lock:
                    self._consumed[slot] = sample.progress[1]  # type: ignore[index]
                # Handed out: its leases are the consumer's from the yield
                # on, also when the consumer closes (or drops) this
                # generator while it waits at the yield.
                for v in sample.values():
                    if isinstance(v, TensorRef):
                        held.pop(v.ref.lease, None)
                yield sample
        finally:
            # Samples read but never handed out (an error, or the consumer
            # stopped early): give their leases back now.
            if held and session is not None:
                try:
                    session.release(list(held.values()))
                except GDSUnavailableError:
                    pass


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader with gdsfs defaults and bookkeeping.

    Defaults collate_fn=gdsfs.torch.collate and pin_memory=True when CUDA is
    available; everything else passes through. It adds what a stock
    DataLoader cannot do for an IterableDataset: batches it yields are always
    materialized (also on CPU-only machines, where pin_memory is off),
    state_dict()/load_state_dict() resume mid-epoch exactly, and a failed
    iteration (e.g. a killed worker) returns its leases to the pool.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("collate_fn", collate)
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        super().__init__(dataset, *args, **kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.dataset
        gds = isinstance(ds, GDSShardDataset)
        if gds:
            ds._main_iteration_starting()
        it = super().__iter__()
        if gds and self.num_workers > 0:
            ds._main_iteration_started()
        ok = False
        try:
            for batch in it:
                if isinstance(batch, GDSBatch):
                    if not batch.materialized:
                        batch = batch.materialize()
                    if isinstance(ds, GDSShardDataset):
                        ds._observe(batch.epoch, batch.progress, batch.slots)
                yield batch
            ok = True
        finally:
            if not ok and isinstance(ds, GDSShardDataset) and not self.persistent_workers:
                # Leases the workers took for batches never delivered would
                # otherwise stay until the session ends: stop the workers,
                # then start over with a fresh session.
                shutdown = getattr(it, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
                del it
                ds.reclaim()

    def state_dict(self) -> dict[str, Any]:
        """The dataset's resume state (samples delivered per slot)."""
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from state_dict() (same world size and num_workers)."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def StatefulDataLoader(dataset: torch.utils.data.Dataset, *args: Any, **kwargs: Any) -> Any:
    """torchdata's StatefulDataLoader with collate_fn=gdsfs.torch.collate and
    pin_memory=True when CUDA is available (everything else passes through).
    It saves and restores GDSShardDataset's state in each worker."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader as _SDL
    except ImportError as e:
        raise ImportError(f"gdsfs: StatefulDataLoader needs torchdata ({e}): pip install torchdata, or use gdsfs.torch.DataLoader") from e
    kwargs.setdefault("collate_fn", collate)
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    return _SDL(dataset, *args, **kwargs)
