"""PyTorch integration: tensors from gdsfs leases and a GDS-aware IterableDataset.

DataLoader workers never touch CUDA: they ask the daemon (an ioctl on the
shard they opened) to read sample fields into its slabs and yield small
picklable TensorRefs. The main process, which has the CUDA context, turns
them into tensors: in the DataLoader's pin-memory thread (GDSBatch.pin_memory)
or with materialize(). In host mode (a mount without GPU) the same API yields
CPU tensors from the daemon's shared host memory.

Example:
    >>> ds = gdsfs.torch.GDSShardDataset("/mnt/data/train-{000..009}.tar",
    ...                                  gpu_keys=["x.npy"], shuffle=True, seed=17)
    >>> dl = torch.utils.data.DataLoader(ds, batch_size=64, num_workers=8,
    ...                                  pin_memory=True, collate_fn=gdsfs.torch.collate)
    >>> for batch in dl:
    ...     batch["x.npy"]          # a CUDA tensor
"""

from __future__ import annotations

import json
import os
import struct
import threading
import weakref
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

__all__ = [
    "DataLoader",
    "GDSBatch",
    "GDSSample",
    "GDSShardDataset",
    "TensorRef",
    "collate",
    "materialize",
    "tensor_from_ref",
    "writable_view",
]

Device = Union[int, str, torch.device, None]

_DTYPES: dict[str, torch.dtype] = {
    "b1": torch.bool, "u1": torch.uint8, "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
    "f2": torch.float16, "f4": torch.float32, "f8": torch.float64, "c8": torch.complex64, "c16": torch.complex128,
}
_NAMED: dict[str, torch.dtype] = {
    "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "float16": torch.float16, "float32": torch.float32, "float64": torch.float64, "bool": torch.bool,
    "bfloat16": torch.bfloat16, "int": torch.int64,
}
_SIGNED_OK = {"uint16": torch.int16, "uint32": torch.int32, "uint64": torch.int64}


def _torch_dtype(descr: str) -> torch.dtype:
    """torch dtype of a numpy descr ("<f4") or a name ("float32")."""
    if descr in _NAMED:
        return _NAMED[descr]
    if descr in _SIGNED_OK:
        # torch 1.13 has no uint16/32/64: same-width signed bytes, documented.
        return getattr(torch, descr, _SIGNED_OK[descr])
    order, code = descr[:1], descr[1:]
    if order not in "<|=" or code not in _DTYPES:
        if order == ">":
            raise ValueError(f"gdsfs: big-endian dtype {descr!r} cannot be viewed on this machine: convert the data to little-endian")
        raise ValueError(f"gdsfs: dtype {descr!r} has no torch equivalent")
    return _DTYPES[code]


def _device(device: Device) -> Optional[torch.device]:
    if device is None or device == "":
        return None
    if isinstance(device, int):
        return torch.device("cuda", device)
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


# ----------------------------------------------------------------------------
# Slabs as tensors (per process, cached).


_slab_lock = threading.Lock()


def _slab_tensor(session: Session, slab: int) -> torch.Tensor:
    """A uint8 tensor over a whole slab: mapped once per process."""
    key = (session.mount, session.hello.daemon_pid, slab)
    t = _core._slabs.cuda.get(key)
    if t is not None:
        return t
    d = session.slab_info(slab)
    with _slab_lock:
        t = _core._slabs.cuda.get(key)
        if t is not None:
            return t
        if d.kind == proto.SLAB_KIND_HOST:
            m = session._host_mapping(slab)
            t = torch.frombuffer(m.view[m.base : m.base + m.size], dtype=torch.uint8)
        elif d.kind == proto.SLAB_KIND_CUDA:
            from . import _cuda

            torch.cuda.init()
            with torch.cuda.device(d.device):
                ptr = _cuda.open_ipc_handle(d.handle, d.device)
                arr = _cuda.CudaArray(ptr + d.map_offset, d.size)
                t = torch.as_tensor(arr, device=torch.device("cuda", d.device))
        else:
            raise GDSUnavailableError(f"gdsfs: slab {slab} has unknown kind {d.kind}: upgrade the gdsfs Python package")
        _core._slabs.cuda[key] = t
    return t


def _ref_bytes(ref: Ref, start: int, nbytes: int, session: Optional[Session] = None) -> torch.Tensor:
    """uint8 view of bytes [start, start+nbytes) of ref's valid data."""
    if start < 0 or start + nbytes > ref.valid:
        raise ValueError(f"gdsfs: bytes [{start}, {start + nbytes}) outside lease {ref.lease} of {ref.valid} valid bytes")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    slab = _slab_tensor(session or _core.session_for(ref), ref.slab)
    return slab[ref.offset + start : ref.offset + start + nbytes]


def _sync_and_release(refs: Sequence[Ref]) -> None:
    """Wait for copies out of CUDA slabs, then give the leases back."""
    devs = {r.device for r in refs if r.device >= 0 and r.lease}
    for d in devs:
        torch.cuda.current_stream(d).synchronize()
    by_session: dict[tuple[str, int], list[Ref]] = {}
    for r in refs:
        if r.lease:
            by_session.setdefault((r.mount, r.session), []).append(r)
    for rs in by_session.values():
        _core.session_for(rs[0]).release(rs)


def _release_quietly(ref: Ref) -> None:
    try:
        _core.session_for(ref).release([ref])
    except Exception:  # noqa: BLE001 - runs in finalizers; the session's end frees the lease anyway
        pass


class _ZeroCopyOwner:
    """Releases a lease when the last tensor viewing it is freed."""

    def __init__(self, ref: Ref) -> None:
        self.ref = ref

    def __del__(self) -> None:
        _release_quietly(self.ref)


def _view_as(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], fortran: bool) -> torch.Tensor:
    t = b.view(dtype) if dtype != torch.uint8 else b
    if fortran:
        return t.reshape(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    return t.reshape(tuple(shape))


def tensor_from_ref(
    ref: Ref,
    dtype: torch.dtype = torch.uint8,
    shape: Optional[Sequence[int]] = None,
    device: Device = None,
    *,
    copy: bool = True,
    session: Optional[Session] = None,
    start: int = 0,
    nbytes: Optional[int] = None,
    release: Optional[bool] = None,
) -> torch.Tensor:
    """Materialize bytes of a lease as a tensor in this process.

    Args:
        ref: the lease.
        dtype: element type of the bytes.
        shape: tensor shape (default: 1-D over all bytes).
        device: target device (default: where the slab is: CPU in host mode,
            else the slab's CUDA device).
        copy: True (default) copies into an ordinary tensor; False returns a
            zero-copy view of the slab.
        session: the session the lease belongs to (default: found from ref).
        start: first byte within the lease's valid bytes.
        nbytes: bytes to use (default: the rest of the valid bytes).
        release: give the lease back: with copy=True right after the copy;
            with copy=False when the last view of it is freed. Default: True
            with copy=True, False with copy=False (the caller releases).

    Returns:
        The tensor.
    """
    n = ref.valid - start if nbytes is None else nbytes
    esize = torch.empty((), dtype=dtype).element_size()
    if shape is None:
        shape = (n // esize,)
    b = _ref_bytes(ref, start, n, session)
    target = _device(device) or b.device
    if not copy:
        if target != b.device:
            raise ValueError(f"gdsfs: a zero-copy view lives on {b.device}; ask for that device or copy=True")
        if (b.storage_offset() % esize) != 0:
            raise ValueError(f"gdsfs: bytes at slab offset {ref.offset + start} are not aligned for {dtype}: use copy=True")
        if not release:
            return _view_as(b, dtype, shape, False)
        if b.device.type == "cuda":
            from . import _cuda

            arr = _cuda.CudaArray(b.data_ptr(), n, _ZeroCopyOwner(ref))
            b = torch.as_tensor(arr, device=b.device)
        else:
            base = (session or _core.session_for(ref)).host_buffer(ref)[start : start + n]
            b = torch.frombuffer(base, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
            # torch keeps base alive as long as any view of b exists.
            weakref.finalize(base, _release_quietly, ref)
        return _view_as(b, dtype, shape, False)
    out = torch.empty(n, dtype=torch.uint8, device=target)
    out.copy_(b)
    if release if release is not None else True:
        _sync_and_release([ref])
    return _view_as(out, dtype, shape, False)


def writable_view(session: Session, ref: Ref, dtype: torch.dtype = torch.uint8, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """A tensor view of an allocated lease (Session.alloc) to fill before
    Session.write. CPU in host mode, CUDA on the slab's device otherwise."""
    esize = torch.empty((), dtype=dtype).element_size()
    if shape is None:
        shape = (ref.valid // esize,)
    slab = _slab_tensor(session, ref.slab)
    b = slab[ref.offset : ref.offset + ref.valid]
    return _view_as(b[: esize * _numel(shape)], dtype, shape, False)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ----------------------------------------------------------------------------
# Descriptors that cross the worker -> main process boundary.


@dataclass(frozen=True)
class TensorRef:
    """A sample field in daemon memory, before materialization.

    Picklable and small: what DataLoader workers hand to the main process.

    Attributes:
        ref: the lease holding the bytes.
        dtype: element type.
        shape: tensor shape.
        start: first byte of the tensor within the lease.
        fortran: the bytes are column-major (.npy fortran_order).
    """

    ref: Ref
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = 0
    fortran: bool = False

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def _bytes(self) -> torch.Tensor:
        return _ref_bytes(self.ref, self.start, self.nbytes)

    def materialize(self, device: Device = None, copy: bool = True) -> torch.Tensor:
        """The field as a tensor (see tensor_from_ref). With copy=True the
        lease is released: materialize each TensorRef once."""
        shape = tuple(reversed(self.shape)) if self.fortran else self.shape
        t = tensor_from_ref(self.ref, self.dtype, shape, device, copy=copy, start=self.start, nbytes=self.nbytes, release=True)
        return t.permute(*reversed(range(len(self.shape)))) if self.fortran else t

    def pin_memory(self, device: Device = None) -> torch.Tensor:
        """Materialize (the DataLoader pin-memory thread calls this)."""
        return self.materialize(device)


class GDSSample(dict):
    """One sample: "__key__", "__url__", TensorRef fields, decoded CPU fields."""

    # (slot, samples of the slot handed out including this one, slots) for
    # resume bookkeeping.
    progress: Optional[tuple[int, int, int]] = None
    epoch: int = 0
    gpu_fields: tuple[str, ...] = ()


@dataclass
class _RefColumn:
    """A batched field still in daemon memory: gathered in one copy."""

    refs: list[TensorRef]


def _gather(col: _RefColumn, device: Device, *, pin: bool) -> Union[torch.Tensor, list[torch.Tensor]]:
    """One gather per field: stack the byte views, then reinterpret. Fields
    whose samples differ in dtype or shape become a list of tensors."""
    trs = col.refs
    first = trs[0]
    if not all(t.dtype == first.dtype and t.shape == first.shape and t.fortran == first.fortran for t in trs):
        return [_gather(_RefColumn([t]), device, pin=pin)[0] for t in trs]
    views = [t._bytes() for t in trs]
    src = views[0].device
    target = _device(device) or src
    if src.type == "cpu" and target.type == "cuda":
        host = torch.stack(views)
        if pin:
            host = host.pin_memory()
        out = host.to(target, non_blocking=pin)
    elif src == target:
        out = torch.stack(views)
        if pin and out.device.type == "cpu" and torch.cuda.is_available():
            out = out.pin_memory()
    else:
        out = torch.stack(views).to(target)
    out = out.view(first.dtype) if first.dtype != torch.uint8 else out
    if first.fortran:
        out = out.reshape((len(trs),) + tuple(reversed(first.shape)))
        return out.permute(0, *[len(first.shape) - i for i in range(len(first.shape))])
    return out.reshape((len(trs),) + tuple(first.shape))


class GDSBatch:
    """A collated batch whose GPU fields are still in daemon memory.

    Dict-like (batch["field"], keys(), items()). pin_memory() (called by the
    DataLoader's pin-memory thread when pin_memory=True) and materialize()
    return a new GDSBatch of tensors, gathering each field with one copy and
    releasing the batch's leases with one request.
    """

    def __init__(self, data: dict[str, Any], *, gpu_fields: Sequence[str] = (), progress: Optional[dict[int, int]] = None, epoch: int = 0, slots: int = 0) -> None:
        self.data = data
        self.gpu_fields = tuple(gpu_fields)
        # Resume bookkeeping: samples handed out per (rank, worker) slot
        # after this batch, the epoch and the number of slots.
        self.progress = dict(progress or {})
        self.epoch = epoch
        self.slots = slots

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __contains__(self, key: object) -> bool:
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def keys(self) -> Any:
        return self.data.keys()

    def values(self) -> Any:
        return self.data.values()

    def items(self) -> Any:
        return self.data.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __repr__(self) -> str:
        state = "materialized" if self.materialized else "in daemon memory"
        return f"GDSBatch({list(self.data)}, {state})"

    @property
    def materialized(self) -> bool:
        return not any(isinstance(v, _RefColumn) for v in self.data.values())

    def _refs(self) -> list[Ref]:
        return [t.ref for v in self.data.values() if isinstance(v, _RefColumn) for t in v.refs]

    def materialize(self, device: Device = None, *, pin: bool = False) -> "GDSBatch":
        """Tensors for every field (gpu fields on device, default: where
        the daemon put them), then release the leases.

        Args:
            device: target device for gpu fields.
            pin: also pin CPU tensors (what pin_memory does).
        """
        out: dict[str, Any] = {}
        try:
            for k, v in self.data.items():
                if isinstance(v, _RefColumn):
                    out[k] = _gather(v, device, pin=pin)
                elif k in self.gpu_fields and isinstance(v, torch.Tensor):
                    # Plain-read fallback: deliver gpu fields where asked.
                    tgt = _device(device)
                    if tgt is None and pin and torch.cuda.is_available():
                        tgt = torch.device("cuda", torch.cuda.current_device())
                    if tgt is not None and tgt != v.device:
                        src = v.pin_memory() if pin and tgt.type == "cuda" else v
                        out[k] = src.to(tgt, non_blocking=pin)
                    else:
                        out[k] = v
                elif pin and isinstance(v, torch.Tensor) and torch.cuda.is_available():
                    out[k] = v.pin_memory()
                else:
                    out[k] = v
        finally:
            _sync_and_release(self._refs())
        return GDSBatch(out, gpu_fields=self.gpu_fields, progress=self.progress, epoch=self.epoch, slots=self.slots)

    def pin_memory(self, device: Device = None) -> "GDSBatch":
        """What DataLoader(pin_memory=True) calls in its pin-memory thread:
        gpu fields become CUDA tensors (host mode: pinned CPU tensors), other
        tensors are pinned."""
        return self.materialize(device, pin=True)

    def to(self, device: Device, non_blocking: bool = False) -> "GDSBatch":
        """Materialize, then move every tensor to device."""
        b = self.materialize(device, pin=non_blocking)
        d = _device(device)
        data = {k: (v.to(d, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v) for k, v in b.data.items()}
        return GDSBatch(data, gpu_fields=self.gpu_fields, progress=self.progress, epoch=self.epoch, slots=self.slots)


def collate(samples: Sequence[Mapping[str, Any]]) -> GDSBatch:
    """Collate GDSSamples into a GDSBatch (use as DataLoader collate_fn).

    TensorRef fields stay in daemon memory until pin_memory()/materialize();
    tensors are stacked, numbers become tensors, everything else a list.
    """
    if not samples:
        raise ValueError("gdsfs: collate of an empty batch")
    keys = list(samples[0].keys())
    data: dict[str, Any] = {}
    gpu: list[str] = []
    for k in keys:
        vals = [s[k] for s in samples]
        v0 = vals[0]
        if isinstance(v0, TensorRef):
            data[k] = _RefColumn(list(vals))
            gpu.append(k)
        elif isinstance(v0, torch.Tensor):
            same = all(isinstance(v, torch.Tensor) and v.shape == v0.shape and v.dtype == v0.dtype for v in vals)
            data[k] = torch.stack(vals) if same else vals
        elif isinstance(v0, bool) or not isinstance(v0, (int, float)) or k.startswith("__"):
            data[k] = vals
        else:
            data[k] = torch.tensor(vals)
    progress: dict[int, int] = {}
    epoch = slots = 0
    for s in samples:
        p = getattr(s, "progress", None)
        if p is not None:
            progress[p[0]] = max(progress.get(p[0], 0), p[1])
            slots = p[2]
        epoch = getattr(s, "epoch", epoch)
    gpu_fields = set(gpu)
    for s in samples[:1]:
        gpu_fields.update(getattr(s, "gpu_fields", ()))
    return GDSBatch(data, gpu_fields=sorted(gpu_fields), progress=progress, epoch=epoch, slots=slots)


def materialize(obj: Any, device: Device = None, *, copy: bool = True) -> Any:
    """Materialize every TensorRef/GDSBatch in a nested structure."""
    if isinstance(obj, TensorRef):
        return obj.materialize(device, copy=copy)
    if isinstance(obj, GDSBatch):
        return obj.materialize(device)
    if isinstance(obj, GDSSample):
        out = GDSSample({k: materialize(v, device, copy=copy) for k, v in obj.items()})
        out.progress, out.epoch = obj.progress, obj.epoch
        return out
    if isinstance(obj, Mapping):
        return type(obj)({k: materialize(v, device, copy=copy) for k, v in obj.items()})  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(materialize(v, device, copy=copy) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(materialize(v, device, copy=copy) for v in obj)
    return obj


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
        shards: shard paths, or brace patterns ("train-{000..099}.tar"), or
            an MDS dataset directory (with index.json).
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
        device: CUDA device the daemon reads into (default: LOCAL_RANK or 0
            when the daemon has GPUs; host memory otherwise).
        strict: raise GDSUnavailableError instead of falling back.
        read_ahead: samples read per daemon request (per shard).
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
        device: Optional[int] = None,
        strict: bool = False,
        read_ahead: int = 64,
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
        self.epoch = 0
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
        self._device = device
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
    def _pick_device(device: Optional[int], path: str) -> Optional[int]:
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
        # Samples of one epoch across all ranks and workers.
        return sum(self.counts)

    def _close_shards(self) -> None:
        if self._open_pid == os.getpid():
            for st in self._open.values():
                st.close()
        self._open = OrderedDict()
        self._open_pid = os.getpid()

    def close(self) -> None:
        """Close shard descriptors and end the session: every lease of the
        dataset (also those of batches never delivered, e.g. by a killed
        worker) returns to the pool. Idempotent; the dataset cannot read
        through gdsfs afterwards."""
        self._close_shards()
        if self._session is not None and self._session._owner_pid == os.getpid():
            self._session.close()

    def reclaim(self) -> None:
        """Return every lease of this dataset to the pool and continue with a
        fresh session: call it after a failed or abandoned iteration, when
        its workers are gone and none of its batches is still in use."""
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

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_open"] = OrderedDict()
        st["_lock"] = None
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
                raise _core._daemon_error("INDEX", e, repr(path)) from e
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
        if self._session is None and self.gpu_keys and not self.strict:
            pass  # the fallback warning was issued at construction
        with self._lock:
            skip = self._resume.get(slot, 0) if self._resume_epoch == self.epoch else 0
            if self._resume and self._slots_seen and self._slots_seen != slots:
                raise ValueError(f"gdsfs: state was saved with {self._slots_seen} (rank, worker) slots, this run has {slots}: resume with the same world size and num_workers")
            self._resume = {}
            self._slots_seen = slots
            self._consumed[slot] = skip
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
        lo = plan.block(slot)[0]
        # Plan every field, then one daemon request per shard for the chunk.
        planned: list[tuple[int, _ShardState, str, list[_FieldPlan]]] = []
        wanted: dict[int, list[tuple[int, int]]] = {}
        geo: dict[tuple[int, str], tuple[int, int, torch.dtype, tuple[int, ...], bool]] = {}
        for n, (pos, shard, idx) in enumerate(items):
            st = self._shard(shard)
            key, fields = self._fields(st, idx)
            planned.append((shard, st, key, fields))
            if self._session is None:
                continue
            for fp in fields:
                if fp.gpu:
                    g = self._tensor_geometry(st, fp)
                    geo[(n, fp.name)] = g
                    wanted.setdefault(shard, []).append((g[0], g[1]))
        refs: dict[int, list[Ref]] = {}
        try:
            for shard, ranges in wanted.items():
                refs[shard] = self._session.read(self._shard(shard).fd, ranges) if self._session else []
        except BaseException:
            if self._session is not None:
                got = [r for rs in refs.values() for r in rs]
                if got:
                    self._session.release(got)
            raise
        cursor = {s: 0 for s in refs}
        out: list[GDSSample] = []
        for n, (shard, st, key, fields) in enumerate(planned):
            sample = GDSSample(__key__=key, __url__=st.path)
            for fp in fields:
                if fp.gpu and self._session is not None:
                    off, nb, dt, shape, fortran = geo[(n, fp.name)]
                    r = refs[shard][cursor[shard]]
                    cursor[shard] += 1
                    if r.valid < nb:
                        raise ValueError(f"gdsfs: {st.path!r}: field {fp.name!r} of sample {key!r} is truncated ({r.valid} of {nb} bytes)")
                    sample[fp.name] = TensorRef(r, dt, shape, 0, fortran)
                elif fp.gpu:
                    sample[fp.name] = self._plain_tensor(st, fp)
                else:
                    sample[fp.name] = self._decode_cpu(fp, os.pread(st.fd, fp.length, fp.offset))
            out.append(sample)
        for n, sample in enumerate(out):
            pos = items[n][0]
            sample.progress = (slot, pos - lo + 1, plan.slots)
            sample.epoch = epoch
            sample.gpu_fields = self.gpu_keys
            with self._lock:
                self._consumed[slot] = pos - lo + 1
            yield sample


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
        it = super().__iter__()
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
