"""GDSShardDataset and gdsfs.torch.DataLoader (re-exported by gdsfs.torch).

Runs in DataLoader workers: plans each epoch's samples for this (rank,
worker) slot, asks the daemon for the gpu fields of a group of samples with
one request per shard, and yields GDSSamples of TensorRefs and decoded CPU
fields. Never touches CUDA.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import gc
import glob
import io
import itertools
import json
import math
import multiprocessing
import multiprocessing.context
import os
import pickle
import struct
import tarfile
import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

import torch
import torch.utils.data

from . import _core, _devmap, _indexcols, _layout, _leases, _starthint, _tensors
from . import _protocol as proto
from ._core import Ref, Session
from ._collate import _KCollate, _release_refs, collate
from ._errors import GDSPoolError, GDSPoolWarning, GDSShardChangedError, GDSShardError, GDSShardWarning, GDSUnavailableError, warn_fallback
from ._plan import EpochPlan, expand_braces
from ._tensors import GDSBatch, GDSSample, TensorRef, _new_tensor_ref, _numel, _torch_dtype, _view_as

if TYPE_CHECKING:
    from torchdata.stateful_dataloader import StatefulDataLoader as _TorchdataLoader

__all__ = ["DataLoader", "GDSShardDataset", "StatefulDataLoader", "default_decode", "stateful_dataloader"]


# ----------------------------------------------------------------------------
# Decoding of CPU fields.


def _npy_tensor(b: bytes) -> torch.Tensor:
    h = _layout.npy_header_cached(b)
    dt = _torch_dtype(h.dtype)
    data = bytearray(b[h.data_offset :])
    t = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return _view_as(t, dt, h.shape, h.fortran_order)


def _pth(data: bytes) -> Any:
    # weights_only: a shard's bytes never run code through pickle (torch >= 1.13 has it).
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def default_decode(field: str, data: bytes) -> Any:
    """Decode a CPU field by its extension (the last dot-separated part of its name), as
    WebDataset does: cls/cls2/index/inx/id -> int, txt/text/transcript -> str (UTF-8),
    json/jsn -> object, npy -> tensor, pth -> torch.load(weights_only=True) on the CPU,
    anything else (images included, unless decode="pil"...) -> bytes."""
    ext = field.rsplit(".", 1)[-1].lower()
    if ext in ("cls", "cls2", "index", "inx", "id"):
        return int(data.decode().strip())
    if ext in ("txt", "text", "transcript"):
        return data.decode()
    if ext in ("json", "jsn"):
        return json.loads(data)
    if ext == "npy":
        return _npy_tensor(data)
    if ext == "pth":
        return _pth(data)
    return data


_default_decode = default_decode


def _cls(data: bytes) -> int:
    return int(data.decode().strip())


def _default_decoder(field: str) -> Callable[[bytes], Any]:
    """default_decode(field, .) as a function of the bytes alone: the one-argument decoder of the
    common integer fields, else default_decode bound to the field's name."""
    if field.rsplit(".", 1)[-1].lower() in ("cls", "cls2", "index", "inx", "id"):
        return _cls
    return functools.partial(_default_decode, field)


IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "ppm", "pgm", "pbm", "pnm", "bmp", "webp", "tif", "tiff", "gif")
# decode="<name>": how image fields are decoded (PIL needed); other fields as default_decode.
IMAGE_DECODERS = ("pil", "torchrgb8", "torchrgb")


def _image(how: str, data: bytes) -> Any:
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    img.load()
    if how == "pil":
        return img
    t = torch.frombuffer(bytearray(img.convert("RGB").tobytes()), dtype=torch.uint8).reshape(img.size[1], img.size[0], 3).permute(2, 0, 1).contiguous()
    return t if how == "torchrgb8" else t.float().div_(255)


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
        _layout.mds_ndarray_check(dtype, shape, len(data) - at)
        buf = bytearray(data[at:])
        t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
        return _view_as(t, _torch_dtype(dtype), shape, False)
    # jpeg/png/pil/pkl/str_int...: hand the bytes to a user decoder.
    return data


# ----------------------------------------------------------------------------
# The dataset.


# A batch's samples adjacent in a shard share one READ range (GDSShardDataset._runs) when the
# bytes between their fields are at most RUN_GAP (read along, never handed out) and the range
# stays within RUN_BYTES; fields above RUN_FIELD_MAX (large samples: the engine moves them at
# full speed one by one) keep a range of their own.
RUN_GAP = 16 << 10
RUN_BYTES = 16 << 20
RUN_FIELD_MAX = 1 << 20
# The most samples DataLoader's pool check plans of its workers' first READs (_lease_plan), all
# workers together: it plans them in the main process at each start of fresh workers.
LEASE_PLAN_SAMPLES = 2048
# A worker reading its shards one after the other from their starts asks for its next shard's
# first NEXT_SHARD_HINT bytes (posix_fadvise WILLNEED through the mount, in WILLNEED_STEP
# calls: the kernel reads at most the mount's max_readahead, 128 KiB, per call) once what is
# left of its current shard is within that distance: the daemon's readahead stops at a file's
# end, so without it the disk sits idle at every shard switch while the loader consumes what
# was read ahead (docs/benchmarks.md, "Cold shard switch").
# GDSFS_SHARD_HINT (bytes; 0: no hint) overrides it, for A/B runs in one session.
NEXT_SHARD_HINT = 4 << 20
NEXT_SHARD_HINT_ENV = "GDSFS_SHARD_HINT"
WILLNEED_STEP = 128 << 10


def _shard_hint_bytes() -> int:
    """GDSFS_SHARD_HINT as bytes (0 or less: no hint); unset or not an integer: the default."""
    return _core.env_bytes(NEXT_SHARD_HINT_ENV, NEXT_SHARD_HINT)


def _willneed(path: str, nbytes: int) -> None:
    """Start reading path's first nbytes into the page cache without waiting for them: the
    kernel's readahead of this process's own open of the file (FUSE READs the daemon serves
    from the backing file), a hint, so any error is ignored (the READs report what is wrong).
    O_NONBLOCK: a path replaced by a FIFO meanwhile must not hold the worker in the hint."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return
    try:
        for off in range(0, nbytes, WILLNEED_STEP):
            os.posix_fadvise(fd, off, min(WILLNEED_STEP, nbytes - off), os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class _NextShardHints:
    """Where a slot reading its block shard after shard (no shuffle, interleave or shuffle
    buffer: each shard from its first sample on) moves to its next shard, and the hint of that
    shard's first bytes (_willneed) once per shard, when the samples left of the current one,
    after the chunk about to be read, hold at most nbytes (the hint's size, NEXT_SHARD_HINT by
    default; estimated from the shard's size and sample count) and some of the current shard was read in this iteration
    already (never ahead of a shard's own first READ)."""

    def __init__(self, ds: "GDSShardDataset", plan: EpochPlan, slot: int, first: int, nbytes: int) -> None:
        self.ds, self.first, self.nbytes = ds, first, nbytes
        lo, hi = plan.block(slot)
        # (first position, end position, shard) of each stretch of one shard in the block
        self.stretches: list[tuple[int, int, int]] = []
        pos = lo
        while pos < hi and plan.total:
            p = pos % plan.total
            k = bisect.bisect_right(plan.starts, p) - 1
            shard = plan.shard_order[k]
            n = min(hi - pos, plan.starts[k] + plan.counts[shard] - p)
            self.stretches.append((pos, pos + n, shard))
            pos += n
        self.at = 0  # index of the stretch of the last position seen
        self.bps: dict[int, float] = {}  # shard -> bytes per sample
        self.hinted: set[int] = set()  # stretches hinted (at most once each)

    def before(self, items: list[tuple[int, int, int]]) -> None:
        """Called with each chunk before it is read."""
        p_first, p_last = items[0][0], items[-1][0]
        st = self.stretches
        while self.at < len(st) and st[self.at][1] <= p_last:
            self.at += 1
        j = self.at
        if j + 1 >= len(st) or max(st[j][0], self.first) >= p_first:
            return  # no next shard, or the chunk holds this iteration's first READ of shard j
        shard, nxt = st[j][2], st[j + 1][2]
        if j + 1 in self.hinted or nxt == shard:
            return
        bps = self.bps.get(shard)
        if bps is None:
            try:
                bps = self.bps[shard] = os.stat(self.ds.shards[shard]).st_size / max(1, self.ds.counts[shard])
            except OSError:
                bps = self.bps[shard] = float("inf")
        if (st[j][1] - 1 - p_last) * bps > self.nbytes:
            return
        self.hinted.add(j + 1)
        path = self.ds.shards[nxt]
        try:
            size = os.stat(path).st_size
        except OSError:
            return
        _willneed(path, min(self.nbytes, size))


class _FieldPlan(NamedTuple):
    """How to produce one field of one sample (a NamedTuple: one is made per field per sample,
    and a frozen dataclass costs several times more to build)."""

    name: str
    offset: int
    length: int
    gpu: bool
    kind: str  # "bytes", "npy", "mds:<encoding>", "raw"
    # Its header's geometry in the daemon's index (-1: read it): a tar .npy gpu field's in
    # _ShardState.npy_headers, an MDS ndarray value's in _ShardState.mds_headers.
    npy: int = -1


# A sample's plan as _ShardState.plans keeps it: one flat tuple (key, number of fields, each
# _FieldPlan's values, then each gpu field's name and geometry) of strings, numbers, dtypes and
# the shape tuples the index's headers share: the garbage collector stops tracking it at its first
# collection (a tuple in a tuple can need one collection per level: move_unreachable reorders).
_KeptPlan = tuple[Any, ...]
_FP_LEN = len(_FieldPlan._fields)
_GEO_LEN = 6  # name, then _tensor_geometry's (data offset, data bytes, dtype, shape, fortran)


def _keep_plan(key: str, fields: list[_FieldPlan], geo: dict[str, tuple[int, int, torch.dtype, tuple[int, ...], bool]]) -> _KeptPlan:
    """A sample's (key, field plans, gpu fields' geometry) as _ShardState.plans keeps it."""
    flat: list[Any] = [key, len(fields)]
    for fp in fields:
        flat.extend(fp)
    for name, g in geo.items():
        flat.append(name)
        flat.extend(g)
    return tuple(flat)


def _kept_plan(k: _KeptPlan) -> tuple[str, list[_FieldPlan], dict[str, tuple[int, int, torch.dtype, tuple[int, ...], bool]]]:
    """_keep_plan's (key, fields, geo) back, as new objects (the caller's to keep or change)."""
    end = 2 + k[1] * _FP_LEN
    fields = [_FieldPlan._make(k[i:i + _FP_LEN]) for i in range(2, end, _FP_LEN)]
    return k[0], fields, {k[i]: (k[i + 1], k[i + 2], k[i + 3], k[i + 4], k[i + 5]) for i in range(end, len(k), _GEO_LEN)}


def _tar_tail_error(path: str, size: int) -> str:
    """Why the bytes after a tar's last member are not its end-of-archive blocks (Python's
    tarfile stops quietly at a header cut short or garbage), or ""."""
    with tarfile.open(path, "r:") as tf:
        for _ in tf:
            pass
        end = tf.offset
    with open(path, "rb") as f:
        f.seek(end)
        at = end
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                return ""
            if chunk.strip(b"\0"):
                first = at + len(chunk) - len(chunk.lstrip(b"\0"))
                return f"header at offset {first} is cut short or not a tar header (file of {size} bytes: truncated or corrupt)"
            at += len(chunk)


class _BadField:
    """Stands for a field that could not be read or decoded (handler="warn_and_skip"): the
    sample holding it is skipped with a GDSShardWarning."""

    def __init__(self, error: GDSShardError) -> None:
        self.error = error


class _ShardState:
    """A shard open in this process: its descriptor, parsed index, and the plans of the samples
    read from it so far (key, field plans, gpu fields' geometry: derived from the index and the
    .npy headers, so they live exactly as long as the index does; a later epoch of a persistent
    worker reuses them instead of planning and pread-ing each header again). A plan is kept as
    one flat tuple of strings, numbers and dtypes (_keep_plan), which the garbage collector stops
    tracking at its first collection; _plan_items makes the _FieldPlans and dict back from it. As
    NamedTuples, a list, a dict and a tuple they were five tracked objects per sample that every
    full collection of a DataLoader worker walked (issue 15 at 16 KiB)."""

    def __init__(self, path: str, fd: int, index: dict[str, Any], ident: Optional[tuple[int, int, int, int, int]] = None, version: int = 0) -> None:
        self.path, self.fd, self.index = path, fd, index
        # The file's identity from before its index was read (a rewrite in between then shows).
        self.ident = ident if ident is not None else _file_ident(fd)
        # The daemon's name of the file version the index was parsed from (INDEX, with
        # CAP_READ_VERSION; 0: none): every READ of the shard names it, and the daemon answers
        # ESTALE once the file is at another version (docs/protocol.md, READ).
        self.version = version
        self.plans: dict[int, _KeptPlan] = {}
        # A tar's .npy geometries as the daemon's index gives them (its "npy_headers", parsed
        # from the same header bytes as _layout.parse_npy_header would be, docs/index-format.md):
        # planning a sample then reads no header of the shard. _npy_geo: their (header length,
        # bytes, dtype) once converted.
        self.npy_headers = [_layout.NpyHeader(int(h["header_length"]), str(h["dtype"]), tuple(int(d) for d in h["shape"]), bool(h["fortran_order"]))
                            for h in index.get("npy_headers", ())]
        self._npy_geo: dict[int, tuple[int, int, torch.dtype]] = {}
        self.field_kinds: dict[str, tuple[bool, str]] = {}  # a tar field name's (gpu, plan kind), columns form
        # An MDS shard's ndarray geometries, likewise (its "ndarray_headers": the values of
        # columns whose encoding leaves dtype or shape to each sample): (header length, dtype
        # name, shape).
        self.mds_headers = [(int(h["header_length"]), str(h["dtype"]), tuple(int(d) for d in h["shape"]))
                            for h in index.get("ndarray_headers", ())]

    def npy_geometry(self, k: int) -> tuple[_layout.NpyHeader, int, torch.dtype]:
        """(header, data bytes, torch dtype) of npy_headers[k]; the dtype's error as
        _tensor_geometry gives it for a header it reads itself."""
        g = self._npy_geo.get(k)
        h = self.npy_headers[k]
        if g is None:
            dt = _torch_dtype(h.dtype)
            g = self._npy_geo[k] = (h.data_offset, _numel(h.shape) * _tensors._itemsize(dt), dt)
        return h, g[1], g[2]

    def changed(self) -> bool:
        """Whether the file is not the one indexed any more (rewritten in place: size, mtime,
        ctime), so that its index and plans are stale."""
        try:
            return _file_ident(self.fd) != self.ident
        except OSError:
            return True

    def close(self) -> None:
        _core._close_quietly(self.fd)  # a read-only shard: nothing is lost when close reports ENOTCONN


class _ShardChanged(Exception):
    """Shard i changed since it was planned (a READ at its version was ESTALE, or its identity
    differs after plain reads): raised by _read_group before it yields any sample of the group."""

    def __init__(self, shard: int) -> None:
        super().__init__(shard)
        self.shard = shard


def _sample_count(index: Mapping[str, Any]) -> int:
    """Samples in a shard's index (a file of the npy and raw formats is one)."""
    return len(index["samples"]) if index["format"] in ("tar", "mds") else 1


def _changed_error(path: str) -> GDSShardChangedError:
    return GDSShardChangedError(
        f"gdsfs: shard {path!r} changed while it was being read (rewritten in place: its size, mtime or ctime is not the planned one's); "
        "restart the epoch (or resume from a state_dict), and write shards under a new name and rename them into place",
        path=path, reason="changed while it was being read")


# One planned sample: (position, shard, state, key, field plans, gpu fields' geometry).
_Planned = tuple[int, int, _ShardState, str, list[_FieldPlan], dict[str, tuple[int, int, torch.dtype, tuple[int, ...], bool]]]


def _file_ident(fd: int) -> tuple[int, int, int, int, int]:
    """The file's identity as the daemon keys its index (internal/fileid)."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


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
    (or the daemon cannot serve), the dataset warns once per cause
    (GDSFallbackWarning) and reads everything with pread; strict=True raises
    GDSUnavailableError.

    Each epoch's sample order is fixed by (seed, epoch); it is cut into one
    contiguous block per (rank, worker), so every sample is read exactly once
    per epoch. state_dict()/load_state_dict() resume mid-epoch exactly (the
    same world size and num_workers are required).

    Args:
        shards: shard paths, brace patterns ("train-{000..099}.tar"), glob
            patterns ("train-*.tar", sorted), an MDS dataset directory (with
            index.json) or a directory of tars (its *.tar, sorted).
        format: "auto" (by extension), "wds"/"tar", "mds", "npy" or "raw".
        gpu_keys: fields delivered as tensors from daemon memory: tar member
            extensions ("x.npy", "jpg"), MDS columns, "npy"/"raw" for files.
            A name that no shard has is an error.
        keys: the fields to read (gpu_keys among them); the others are never
            read. Default: every field.
        decode: CPU decoder for other fields: a callable(field, bytes), a
            mapping {field: callable(bytes)} (fields it does not name are
            decoded by default_decode), or the name of an image decoder
            ("pil", "torchrgb8": uint8 CHW tensor, "torchrgb": float CHW in
            [0, 1]; needs Pillow) used for image fields with default_decode
            for the rest. Default: default_decode (cls -> int, txt -> str,
            json -> object, npy -> tensor, pth -> torch.load, else bytes).
        field_spec: {field: (dtype, shape)} for gpu fields of raw bytes
            (default: 1-D uint8).
        map: a function applied to each sample in the worker, after CPU
            decoding (gpu fields are still TensorRefs): returns the sample (a
            mapping) to yield, or None to drop it. Resume stays exact.
        handler: "raise" (default): a corrupt shard or a sample that cannot
            be read or decoded raises GDSShardError; "warn_and_skip": it is
            skipped with a GDSShardWarning (a corrupt shard at construction,
            a bad sample when it is read).
        shuffle: shuffle shard order and samples within shards per epoch.
        seed: shuffle seed.
        shuffle_buffer: also pass each worker's samples through a shuffle
            buffer of this many samples (seeded by seed, epoch and worker),
            mixing samples of the shards it reads. It shuffles positions, not
            data: it holds no memory and resume stays exact.
        interleave: shards each worker reads at a time, taking samples from
            them in turn (1: one shard after the other).
        split_by_node: split samples across torch.distributed ranks.
        split_by_worker: split samples across DataLoader workers.
        even_ranks: None (ranks differ by at most one sample), "drop" (every
            rank reads len(dataset) // world_size samples, the rest of the
            epoch is left out) or "pad" (every rank reads the ceiling, the
            epoch's first samples are read twice), so that DDP ranks run the
            same number of steps.
        device: where the daemon reads gpu fields: a CUDA ordinal or device,
            "cpu"/-1 for host memory; default LOCAL_RANK or 0 when the daemon
            has GPUs, host memory otherwise. A CUDA device the daemon does not
            have raises RuntimeError.
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
        keys: Optional[Sequence[str]] = None,
        decode: Union[Callable[[str, bytes], Any], Mapping[str, Callable[[bytes], Any]], str, None] = None,
        field_spec: Optional[Mapping[str, tuple[torch.dtype, tuple[int, ...]]]] = None,
        map: Optional[Callable[[GDSSample], Optional[Mapping[str, Any]]]] = None,
        handler: str = "raise",
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 0,
        interleave: int = 1,
        split_by_node: bool = True,
        split_by_worker: bool = True,
        even_ranks: Optional[str] = None,
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
        for name, val in (("gpu_keys", gpu_keys), ("keys", keys)):
            if isinstance(val, (str, bytes)):  # tuple("x.npy") would name the fields 'x', '.', 'n', ...
                raise TypeError(f"gdsfs: {name}={val!r} is a string, not a list of field names: pass {name}=[{val!r}]")
        self.gpu_keys = tuple(gpu_keys or ())
        self.keys = None if keys is None else tuple(keys)
        if isinstance(decode, str):
            if decode not in IMAGE_DECODERS:
                raise ValueError(f"gdsfs: decode={decode!r} is not an image decoder ({', '.join(IMAGE_DECODERS)}), a callable or a mapping")
            try:
                import PIL.Image  # noqa: F401
            except ImportError as e:
                raise ImportError(f"gdsfs: decode={decode!r} needs Pillow ({e}): pip install pillow (Debian: apt-get install python3-pil)") from e
        self.decode = decode
        self.field_spec = dict(field_spec or {})
        if map is not None and not callable(map):
            raise TypeError(f"gdsfs: map={map!r} is not callable: pass a function of one sample")
        self.map = map
        if handler not in ("raise", "warn_and_skip"):
            raise ValueError(f"gdsfs: handler {handler!r} is not 'raise' or 'warn_and_skip'")
        self.handler = handler
        self.shuffle, self.seed = shuffle, int(seed)
        if int(shuffle_buffer) < 0:
            raise ValueError(f"gdsfs: shuffle_buffer {shuffle_buffer} must be >= 0 (samples; 0: none)")
        if int(interleave) < 1:
            raise ValueError(f"gdsfs: interleave {interleave} must be >= 1 (shards read at a time per worker)")
        self.shuffle_buffer, self.interleave = int(shuffle_buffer), int(interleave)
        self.split_by_node, self.split_by_worker = split_by_node, split_by_worker
        if even_ranks not in (None, "drop", "pad"):
            raise ValueError(f"gdsfs: even_ranks {even_ranks!r} is not None, 'drop' or 'pad'")
        self.even_ranks = even_ranks
        self.strict = strict
        if read_ahead < 1:
            raise ValueError(f"gdsfs: read_ahead {read_ahead} must be >= 1")
        self.read_ahead = read_ahead
        if read_ahead_bytes < 1:
            raise ValueError(f"gdsfs: read_ahead_bytes {read_ahead_bytes} must be >= 1")
        self.read_ahead_bytes = read_ahead_bytes
        # Shared memory, so that set_epoch() reaches persistent workers.
        self._epoch: Any = multiprocessing.RawValue("q", 0)
        # Set by workers that iterate: ds.state_dict() in the main process then
        # cannot know what they delivered unless gdsfs.torch.DataLoader counted.
        self._worker_iterated: Any = multiprocessing.RawValue("b", 0)
        self._counting = False
        # Set in a DataLoader worker's copy by gdsfs.torch.DataLoader (see _main_iteration_starting):
        # the samples of one torch item it sends (the batch size, times k with batches_per_item),
        # so that one item's adjacent samples of a shard share one READ range and lease (0: one
        # range per field per sample).
        self._batched = 0
        # A tar field's default decoder by field name (_decode_field, decode=None).
        self._default_decoders: dict[str, Callable[[bytes], Any]] = {}
        self._resume: dict[int, int] = {}
        self._resume_epoch = 0
        self._consumed: dict[int, int] = {}
        self._slots_seen = 0
        self._lock = threading.Lock()
        mounts = {_core.find_mount(p) for p in self.shards}
        self._session: Optional[Session] = None
        if len(mounts) > 1:
            warn_fallback(f"shards lie on {len(mounts)} different mounts ({sorted(str(m) for m in mounts)})", strict=strict, cause="several mounts")
        else:
            self._session = Session.open(self.shards[0], device=self._pick_device(device, self.shards[0], next(iter(mounts))), strict=strict)
            if self._session is not None and self.gpu_keys:
                # Here, not in the workers (which never touch CUDA): they read with what this
                # process's cuda:N is on the daemon (gdsfs._devmap), carried in the session.
                self._session._device_map()
        self._open: "OrderedDict[int, _ShardState]" = OrderedDict()
        self._open_pid = os.getpid()
        self._bad: set[int] = set()
        self._errors: dict[tuple[str, str], GDSShardError] = {}
        self.counts = [self._count(i) for i in range(len(self.shards))]
        self._check_fields()

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
            if os.path.isdir(p):
                tars = sorted(glob.glob(os.path.join(glob.escape(p), "*.tar")))
                if not tars:
                    _check_listable(p)
                    raise ValueError(f"gdsfs: directory {p!r} has no index.json and no .tar files: pass shard files, a pattern, or an MDS directory")
                out.extend(tars)
                continue
            for q in expand_braces(p):
                if any(c in q for c in "*?["):
                    found = sorted(glob.glob(q))
                    if not found:
                        _core.find_mount(q)
                        _check_listable(os.path.dirname(q) or ".")
                        raise FileNotFoundError(f"gdsfs: no shard matches {q!r}: check the pattern")
                    out.extend(found)
                    continue
                if not os.path.exists(q):
                    _core.find_mount(q)  # a mount whose daemon exited: its own error, not "does not exist"
                    _check_listable(os.path.dirname(q) or ".", list_it=False)
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
    def _pick_device(device: Union[int, str, torch.device, None], path: str, mount: Optional[str] = None) -> Optional[int]:
        if isinstance(device, (str, torch.device)):
            d = torch.device(device)
            if d.type not in ("cpu", "cuda"):
                raise ValueError(f"gdsfs: device={device!r}: GDSShardDataset reads gpu_keys fields into CPU or CUDA memory "
                                 "only; pass device='cpu' or 'cuda[:N]' (move batches elsewhere with batch_map=)")
            if d.type != "cuda":
                return -1
            return GDSShardDataset._cuda_device(d.index if d.index is not None else 0, path, mount)
        if device is not None:
            if int(device) < 0:
                return int(device)
            return GDSShardDataset._cuda_device(int(device), path, mount)
        lr = os.environ.get("LOCAL_RANK")
        if lr is None:
            return None
        try:
            caps = _core.capabilities(path)
        except GDSUnavailableError:
            return None
        return int(lr) if caps.devices else None

    @staticmethod
    def _cuda_device(index: int, path: str, mount: Optional[str]) -> int:
        """index, when CUDA device index exists where gpu fields are read (the daemon's GPUs
        on a mount, this process's off one); else the error torch would give, with advice."""
        if mount is not None:
            try:
                caps = _core.capabilities(path)
            except GDSUnavailableError:
                return index  # the session's own fallback decides
            devices = list(caps.devices)
            if caps.device_uuids:
                m = _devmap.resolve(caps.mount, lambda: _devmap.normalized(caps.device_uuids))
                if m is not None:
                    m.to_daemon(index)  # raises when the daemon does not serve this process's cuda:index
                    return index
            where = f"the gdsfs daemon at {mount!r} has " + (f"CUDA devices {devices}" if devices else "no GPU (host engine)")
        else:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = list(range(n))
            where = f"torch sees {n} CUDA device(s)"
        if index not in devices:
            raise RuntimeError(f"gdsfs: device {f'cuda:{index}'!r} does not exist: {where}; pass device='cpu' (host memory) or an existing CUDA device")
        return index

    @property
    def session(self) -> Optional[Session]:
        """The gdsfs session (None when reading with plain pread)."""
        return self._session

    @property
    def gds(self) -> bool:
        """True when gpu_keys fields come from daemon memory."""
        return self._session is not None

    def __len__(self) -> int:
        """Samples this rank reads per epoch (all of its workers together; fewer when map=
        drops some or handler="warn_and_skip" skips bad samples)."""
        total = sum(self.counts)
        rank, world = _rank_world() if self.split_by_node else (0, 1)
        if self.even_ranks is not None:
            return EpochPlan(self.counts, seed=self.seed, epoch=0, shuffle=False, slots=world, world=world, even=self.even_ranks).per_rank() if total else 0
        return (rank + 1) * total // world - rank * total // world

    def _worker_counts(self, num_workers: int) -> list[int]:
        """Samples each DataLoader worker of this rank reads this epoch (one entry for
        num_workers=0), after a pending resume point."""
        nw = max(1, num_workers) if self.split_by_worker else 1
        rank, world = _rank_world() if self.split_by_node else (0, 1)
        plan = self._plan(world * nw)
        with self._lock:
            resume = dict(self._resume) if self._resume_epoch == self.epoch else {}
        out = []
        for w in range(nw):
            lo, hi = plan.block(rank * nw + w)
            out.append(max(0, hi - lo - resume.get(rank * nw + w, 0)))
        if not self.split_by_worker and num_workers > 1:
            out = out * num_workers  # every worker reads the rank's whole share
        return out

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
        self._session = None
        try:
            self._session = Session(s.mount, device=s.device)
        except (OSError, GDSUnavailableError) as e:
            # Called from a loader's cleanup, often inside a generator's
            # close() run by the garbage collector, where an exception
            # would only be printed: say so once, and go on with plain
            # reads (the daemon died or the mount went away).
            warn_fallback(f"cannot open a new session on {s.mount} after an abandoned iteration ({e}); "
                          "restart the gdsfs daemon (gdsfs mount) for GPU-direct reads",
                          cause=f"reclaim {s.mount}")

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
            st["_worker_iterated"] = _EpochBox(0)
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

    def _loader_slots(self, num_workers: int) -> Optional[tuple[int, list[tuple[int, int]]]]:
        """(slots, [(slot, resume point)] of each of this rank's workers) of an iteration that
        num_workers fresh workers make, as their _samples will plan it; None when the resume
        state pending was saved with other slots (the workers refuse it)."""
        rank, world = _rank_world() if self.split_by_node else (0, 1)
        nw = num_workers if self.split_by_worker else 1
        slots = world * nw
        with self._lock:
            pending = self._resume if self._resume_epoch == self.epoch else {}
            if pending and self._slots_seen and self._slots_seen != slots:
                return None
            return slots, [(rank * nw + w, int(pending.get(rank * nw + w, 0))) for w in range(nw)]

    def state_dict(self) -> dict[str, Any]:
        """Progress in the current epoch: samples handed out per slot.

        In a worker (StatefulDataLoader) it covers that worker; in the main
        process it covers what it iterated itself or what gdsfs.torch.DataLoader
        delivered. After the workers of a stock torch DataLoader iterated it,
        the main process cannot know their progress: RuntimeError."""
        if self._worker_iterated.value and torch.utils.data.get_worker_info() is None:
            raise RuntimeError(
                "gdsfs: ds.state_dict() in the main process cannot see what the workers of a torch.utils.data.DataLoader "
                "(or StatefulDataLoader) read: iterate with gdsfs.torch.DataLoader and save its state_dict(), or save "
                "torchdata's StatefulDataLoader.state_dict() (gdsfs.torch.StatefulDataLoader)")
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

    def _resume_pending(self) -> bool:
        """Whether a state loaded (load_state_dict) waits for the next iteration to resume at."""
        with self._lock:
            return bool(self._resume) and self._resume_epoch == self.epoch

    def _main_iteration_starting(self, batched: int = 0) -> None:
        """gdsfs.torch.DataLoader starts an iteration: count delivered
        samples afresh (from the resume point, if one is pending). batched:
        the batch size its workers collate samples in with gdsfs.torch.collate
        (0: not known), for their copies (see _runs)."""
        with self._lock:
            pending = bool(self._resume) and self._resume_epoch == self.epoch
            self._consumed = dict(self._resume) if pending else {}
        self._worker_iterated.value = 0
        self._counting = True  # the workers' copies: this process counts for them
        self._batched = batched

    def _main_iteration_started(self) -> None:
        """The workers of the new iteration hold their copy of the resume
        state: later iterations start from the beginning."""
        self._counting = False
        self._batched = 0  # this process's own iterations hand out samples one by one
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

    def _index_of(self, path: str, fd: int) -> tuple[dict[str, Any], int]:
        """The shard's index and the daemon's version of the file it was parsed from (0: none)."""
        fmt = self._shard_format(path)
        if fmt == "raw":
            return {"format": "raw", "file_size": os.fstat(fd).st_size}, 0
        if self._session is not None:
            try:
                doc, version = self._daemon_index(path, fd)
            except OSError as e:
                why = self._index_error(path) if e.errno == errno.ENODATA else ""
                if why:
                    # The daemon parsed the shard and found it corrupt: an error, not a fallback.
                    raise self._bad_shard(path, why) from None
                err = _core._daemon_error("INDEX", e, repr(path))
                if self.strict:
                    raise err from e
                warn_fallback(str(err), cause=f"INDEX {self._session.mount} errno {e.errno}")
                return self._local_index(path, fmt), 0
            if doc.get("format") != fmt:
                raise ValueError(f"gdsfs: {path!r} is indexed as {doc.get('format')!r}, expected {fmt!r}: pass format= explicitly")
            return doc, version if self._session.hello.caps & proto.CAP_READ_VERSION else 0
        return self._local_index(path, fmt), 0

    def _daemon_index(self, path: str, fd: int) -> tuple[dict[str, Any], int]:
        """INDEX: a tar's in the columns form where the daemon has it (CAP_INDEX_COLUMNS: one
        pass per column, no dict per sample until it is planned), else the JSON. A malformed
        columns document raises GDSUnavailableError; with strict=False it warns and the shard
        is indexed here."""
        assert self._session is not None
        cols = bool(self._session.hello.caps & proto.CAP_INDEX_COLUMNS)
        raw, version, form = _core._paged_index(fd, columns=cols)
        if form == proto.INDEX_FORM_JSON:
            return json.loads(raw), version
        try:
            if form != proto.INDEX_FORM_TAR_COLUMNS:
                raise GDSUnavailableError(f"gdsfs: INDEX {path!r}: the daemon answered index form {form}, which this client does not know; "
                                          "run a gdsfs client and daemon of the same version")
            return _indexcols.decode(raw, path), version
        except GDSUnavailableError as e:
            if self.strict:
                raise
            warn_fallback(str(e), cause=f"INDEX columns {self._session.mount}")
            return self._local_index(path, self._shard_format(path)), 0

    @staticmethod
    def _index_error(path: str) -> str:
        """Why the daemon has no index for path (user.gdsfs.info's index_error), or ""."""
        try:
            info = json.loads(os.getxattr(path, _core.INFO_XATTR))
        except (OSError, ValueError):
            return ""
        why = str(info.get("index_error") or "") if isinstance(info, dict) else ""
        return why[len("cache: "):] if why.startswith("cache: ") else why

    def _bad_shard(self, path: str, why: str) -> GDSShardError:
        return GDSShardError(f"gdsfs: shard {path!r} cannot be read: {why}: rewrite or remove it, or pass handler='warn_and_skip' to skip bad shards", path=path, reason=why)

    def _local_index(self, path: str, fmt: str) -> dict[str, Any]:
        """The index parsed here; a shard that does not parse, or whose members run past its
        end, is a GDSShardError naming it."""
        try:
            doc = _layout.local_index(path, fmt)
        except (tarfile.TarError, ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
            if isinstance(e, ValueError) and "no index for" in str(e):
                raise
            why = str(e).replace("\n", " ")
            if why.startswith("gdsfs: "):
                why = why[len("gdsfs: "):]
            raise self._bad_shard(path, f"not a valid {fmt}: {why}") from None
        size = int(doc.get("file_size", 0))
        if fmt == "tar":
            for s in doc["samples"]:
                for name, m in s["fields"].items():
                    if int(m["offset"]) + int(m["length"]) > size:
                        raise self._bad_shard(path, f"not a valid tar: member {s['key']}.{name} runs past the end of the file at {size} bytes (truncated)")
            why = _tar_tail_error(path, size)
            if why:
                raise self._bad_shard(path, f"not a valid tar: {why}")
        return doc

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
            ident = _file_ident(fd)
            index, version = self._index_of(path, fd)
            st = _ShardState(path, fd, index, ident, version)
            counts = getattr(self, "counts", None)  # None while the constructor counts
            if counts is not None and i not in self._bad and _sample_count(index) != counts[i]:
                # Rewritten since the epoch's plan was made from its sample count.
                raise _changed_error(path)
        except BaseException:
            os.close(fd)
            raise
        self._open[i] = st
        while len(self._open) > max(8, self.interleave + 1):
            _, old = self._open.popitem(last=False)
            old.close()
        return st

    def _count(self, i: int) -> int:
        try:
            idx = self._shard(i).index
        except GDSShardError as e:
            if self.handler != "warn_and_skip":
                raise
            warnings.warn(f"gdsfs: skipping shard {self.shards[i]!r}: {e.reason}", GDSShardWarning, stacklevel=4)
            self._bad.add(i)
            return 0
        return _sample_count(idx)

    def _shard_field_names(self, i: int, wanted: frozenset[str] = frozenset()) -> set[str]:
        """Field names of shard i's samples (tar: stops once every wanted name was seen)."""
        x = self._shard(i).index
        f = x["format"]
        if f == "tar":
            if _indexcols.is_columns(x["samples"]):
                return set(x["samples"].names)
            names: set[str] = set()
            for s in x["samples"]:
                names.update(s["fields"])
                if wanted and wanted <= names:
                    break
            return names
        if f == "mds":
            return {c["name"] for c in x["columns"]}
        ext = os.path.basename(self.shards[i]).partition(".")[2] or "raw"
        return {ext, "npy" if f == "npy" else "raw"}

    def _check_fields(self) -> None:
        """Refuse, at construction, names that select nothing: gpu_keys or keys= fields no
        shard has, gpu_keys outside keys=, a decode= entry for a gpu field."""
        good = [i for i in range(len(self.shards)) if i not in self._bad]
        wanted = frozenset(self.gpu_keys) | frozenset(self.keys or ())
        have: set[str] = set()
        for i in good:
            # Stop once every name is found: construction stays O(shards) on large datasets.
            have |= self._shard_field_names(i, frozenset(wanted - have))
            if wanted and wanted <= have:
                break
        if not wanted <= have:
            for i in good:  # a name is missing: list every field the shards have
                have |= self._shard_field_names(i)
        mds = bool(good) and self._shard(good[0]).index["format"] == "mds"
        first = self.shards[good[0]] if good else ""
        where = (f"MDS column {{!r}} is in no shard of {os.path.dirname(first)!r} (columns: {', '.join(sorted(have))})" if mds
                 else f"{{}} is in no sample of {first!r}" + (f" or the other {len(good) - 1} shard(s)" if len(good) > 1 else "")
                 + f" (fields: {', '.join(sorted(have))})")
        hint = ": check the name (a tar member's name after the sample key, e.g. 'x.npy' or 'jpg')"
        if good:
            for k in self.gpu_keys:
                if k not in have:
                    raise ValueError("gdsfs: " + (where.format(k) if mds else where.format(f"gpu_keys field {k!r}")) + hint)
            for k in self.keys or ():
                if k not in have:
                    raise ValueError("gdsfs: " + (where.format(k) if mds else where.format(f"keys= field {k!r}")) + hint)
        if self.keys is not None:
            for k in self.gpu_keys:
                if k not in self.keys:
                    raise ValueError(f"gdsfs: gpu_keys field {k!r} is not in keys={list(self.keys)}: add it there, or leave keys= out to read every field")
        if isinstance(self.decode, Mapping):
            for k in self.decode:
                if k in self.gpu_keys:
                    raise ValueError(f"gdsfs: decode={{{k!r}: ...}} names a gpu_keys field, which arrives as a tensor and is never decoded: "
                                     f"remove {k!r} from gpu_keys or from decode")

    def _sample_fields(self, st: _ShardState, idx: int) -> tuple[str, list[_FieldPlan]]:
        """Key and field plans of sample idx of a shard (only the fields keys= names)."""
        key, plans = self._all_fields(st, idx)
        if self.keys is not None:
            plans = [fp for fp in plans if fp.name in self.keys]
        return key, plans

    def _all_fields(self, st: _ShardState, idx: int) -> tuple[str, list[_FieldPlan]]:
        x = st.index
        f = x["format"]
        plans: list[_FieldPlan] = []
        if f == "tar" and _indexcols.is_columns(x["samples"]):
            # The columns form: no dict per sample; each field name's (gpu, kind) worked out once.
            key, a, b = x["samples"].span(idx)
            names, ids, offs, lens, npys = x["samples"].columns
            kinds = st.field_kinds
            for j in range(a, b):
                name = names[ids[j]]
                k = kinds.get(name)
                if k is None:
                    gpu = name in self.gpu_keys
                    k = kinds[name] = (gpu, "npy" if (gpu and name.rsplit(".", 1)[-1] == "npy" and name not in self.field_spec) else "bytes")
                plans.append(_FieldPlan(name, offs[j], lens[j], k[0], k[1], npys[j] - 1 if k[1] == "npy" else -1))
            return key, plans
        if f == "tar":
            s = x["samples"][idx]
            for name, m in s["fields"].items():
                gpu = name in self.gpu_keys
                kind = "npy" if (gpu and name.rsplit(".", 1)[-1] == "npy" and name not in self.field_spec) else "bytes"
                plans.append(_FieldPlan(name, int(m["offset"]), int(m["length"]), gpu, kind, int(m.get("npy", -1)) if kind == "npy" else -1))
            return s["key"], plans
        if f == "mds":
            s = x["samples"][idx]
            for c in x["columns"]:
                r = s["columns"][c["name"]]
                plans.append(_FieldPlan(c["name"], int(r["offset"]), int(r["length"]), c["name"] in self.gpu_keys, "mds:" + c["encoding"], int(r.get("ndarray", -1))))
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

    def _tensor_geometry(self, st: _ShardState, fp: _FieldPlan, read: bool = True) -> tuple[int, int, torch.dtype, tuple[int, ...], bool]:
        """(data offset, data bytes, dtype, shape, fortran) of a gpu field.
        Reads at most a small header with pread; never the payload. read=False: reads nothing;
        a field whose header the index does not hold is then its member's bytes (the start
        hint's sizing of a READ: _plan_sample)."""
        if fp.name in self.field_spec:
            dt, shape = self.field_spec[fp.name]
            return fp.offset, _numel(shape) * torch.empty((), dtype=dt).element_size(), dt, tuple(shape), False
        if fp.kind == "npyfile":
            x = st.index
            shape = tuple(int(v) for v in x["shape"])
            dt = _torch_dtype(x["dtype"])
            return int(x["data_offset"]), int(x["data_length"]), dt, shape, bool(x.get("fortran_order"))
        if fp.kind == "npy":
            if 0 <= fp.npy < len(st.npy_headers):
                h, nb, dt = st.npy_geometry(fp.npy)
                return fp.offset + h.data_offset, nb, dt, h.shape, h.fortran_order
            if not read:
                return fp.offset, fp.length, torch.uint8, (fp.length,), False
            head = os.pread(st.fd, min(fp.length, 4096), fp.offset)
            h = _layout.npy_header_cached(head)
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
                nd_dtype, nd_shape = _layout.mds_ndarray_spec(enc)
                if nd_dtype is not None and nd_shape is not None:
                    return fp.offset, fp.length, _torch_dtype(nd_dtype), nd_shape, False
                try:
                    if 0 <= fp.npy < len(st.mds_headers):
                        at, dname, shp = st.mds_headers[fp.npy]  # the daemon's parse of the same header
                    elif not read:
                        return fp.offset, fp.length, torch.uint8, (fp.length,), False
                    else:
                        at, dname, shp = _layout.mds_ndarray_prefix(enc, os.pread(st.fd, min(fp.length, 1 + 1 + 8 * 64), fp.offset))
                    _layout.mds_ndarray_check(dname, shp, fp.length - at)
                    dt = _torch_dtype(dname)
                except ValueError as e:
                    raise ValueError(f"gdsfs: MDS column {fp.name!r}: {str(e).removeprefix('gdsfs: ')}") from None
                return fp.offset + at, fp.length - at, dt, shp, False
            raise ValueError(f"gdsfs: MDS column {fp.name!r} has encoding {enc!r}, which cannot be a gpu_keys tensor (bytes, numeric scalars and ndarray can)")
        return fp.offset, fp.length, torch.uint8, (fp.length,), False

    def _decode_cpu(self, fp: _FieldPlan, data: bytes, st: Optional[_ShardState] = None, key: str = "") -> Any:
        """The decoded field; a decoder failure is a GDSShardError naming field, sample and
        shard (with handler="warn_and_skip": a _BadField that __iter__ skips)."""
        if fp.kind == "error" and st is not None:
            return _BadField(self._errors.pop((st.path, key)))
        try:
            return self._decode_field(fp, data)
        except Exception as e:  # noqa: BLE001 - any decoder failure is the sample's error
            if st is None:
                raise
            what = "decode=" if self.decode is not None else "the default decoder"
            err = GDSShardError(
                f"gdsfs: field {fp.name!r} of sample {key!r} in shard {st.path!r} does not decode ({type(e).__name__}: {e}): "
                f"fix the data, pass decode={{{fp.name!r}: ...}} (or a decode= function), or handler='warn_and_skip'",
                path=st.path, key=key, reason=f"{what} failed on field {fp.name!r}: {type(e).__name__}: {e}")
            if self.handler == "warn_and_skip":
                return _BadField(err)
            raise err from e

    def _decode_field(self, fp: _FieldPlan, data: bytes) -> Any:
        d = self.decode
        if d is None and fp.kind == "bytes":
            # The default decoder of a tar field, picked once per field name (its extension
            # parsed once, not per sample).
            f = self._default_decoders.get(fp.name)
            if f is None:
                f = self._default_decoders[fp.name] = _default_decoder(fp.name)
            return f(data)
        if isinstance(d, Mapping) and fp.name in d:
            return d[fp.name](data)
        if isinstance(d, str):
            if fp.name.rsplit(".", 1)[-1].lower() in IMAGE_EXTENSIONS:
                return _image(d, data)
        elif callable(d):
            return d(fp.name, data)
        if fp.kind.startswith("mds:"):
            return _mds_decode(fp.kind[4:], data)
        if fp.kind == "npyfile":
            return _npy_tensor(data)
        return _default_decode(fp.name, data)

    def _plain_tensor(self, st: _ShardState, fp: _FieldPlan, key: str = "") -> Any:
        try:
            off, nb, dt, shape, fortran = self._tensor_geometry(st, fp)
        except ValueError as e:
            err = e if isinstance(e, GDSShardError) else GDSShardError(
                f"gdsfs: field {fp.name!r} of sample {key!r} in shard {st.path!r}: {e}", path=st.path, key=key, reason=str(e))
            if self.handler == "warn_and_skip":
                return _BadField(err)
            raise err from None
        data = bytearray(os.pread(st.fd, nb, off))
        if len(data) != nb:
            err = GDSShardError(f"gdsfs: field {fp.name!r} of sample {key!r} in shard {st.path!r} is truncated ({len(data)} of {nb} bytes): "
                                "rewrite the shard, or pass handler='warn_and_skip'", path=st.path, key=key, reason=f"field {fp.name!r} is truncated")
            if self.handler == "warn_and_skip":
                return _BadField(err)
            raise err
        t = torch.frombuffer(data, dtype=torch.uint8) if nb else torch.empty(0, dtype=torch.uint8)
        return _view_as(t, dt, shape, fortran)

    def _lease_plan(self, batched: int, per: int, slab: int, num_workers: int, most: int = LEASE_PLAN_SAMPLES) -> Optional["_LeasePlan"]:
        """What the workers of a DataLoader iteration of num_workers fresh workers lease of the
        daemon's pool, as the pool counts it: each worker's first samples (from its resume point,
        in its plan's order) cut into its chunks (_chunks) and READ groups (_group_end), each
        group's ranges as the worker makes them (_runs: items of `batched` samples, the worker's
        self._batched), each range widened to the daemon's alignment (HELLO align) and with the
        pool's slabs of `slab` bytes (0: not known) the part of a slab that leases of that size
        leave empty (a slab holds slab // lease of them; a larger one gets its own). Per worker
        its first `per` + one chunk's items (torch's items in flight, and the READ that reads past
        them), up to `most` samples for all the workers together (the first worker's at least).
        The geometry is the main process's: of a shard it holds open, its own; of another, the
        sample at the same index of an open one (or of the first readable shard), whose layout
        the shards of a dataset share. None: not known (no daemon session, no gpu_keys, nothing
        readable, or a resume state the workers refuse)."""
        session = self._session
        if session is None or not self.gpu_keys or self._open_pid != os.getpid():
            return None
        layout = self._loader_slots(num_workers)
        if layout is None:
            return None
        slots, workers = layout
        opened = dict(self._open)
        if not opened:
            good = [i for i in range(len(self.shards)) if i not in self._bad and self.counts[i] > 0]
            try:
                opened = {good[0]: self._shard(good[0])} if good else {}
            except (OSError, GDSShardError, GDSUnavailableError, ValueError):
                return None
        if not opened:
            return None
        reps = list(opened.values())
        align = max(1, session.hello.align or 4096)

        def cost(off: int, n: int) -> float:
            c = -(-(off + n) // align) * align - off // align * align
            return slab / (slab // c) if 0 < c <= slab else float(c)

        def planned(pos: int, shard: int, idx: int) -> Optional[_Planned]:
            st = opened.get(shard)
            if st is None:
                st = reps[shard % len(reps)]
                idx %= max(1, _sample_count(st.index))
            known = st.plans.get(idx)
            if known is not None:
                return (pos, shard, st, *_kept_plan(known))
            try:
                key, fields = self._sample_fields(st, idx)
                geo = {fp.name: self._tensor_geometry(st, fp) for fp in fields if fp.gpu}
            except (GDSShardError, ValueError, OSError, KeyError, IndexError):
                return None  # a bad sample: the workers report it
            st.plans[idx] = _keep_plan(key, fields, geo)
            return (pos, shard, st, key, fields, geo)

        plan = self._plan(slots)
        item = max(1, batched)
        chunk = self._chunk_samples(batched)
        window = -(-max(1, per) * item // chunk) * chunk + chunk  # whole chunks: `per` items and one chunk more
        out = _LeasePlan()
        left = most
        for n, (slot, skip) in enumerate(workers):
            if n and left < window:
                break  # the workers after it are planned alike
            take = min(window, max(1, left))
            costs: dict[int, float] = {}  # item -> its leases
            over: dict[int, tuple[float, int]] = {}  # item -> (leases, samples) its last READ group read past it
            ends: set[int] = set()  # items whose every sample was planned
            done = 0  # the worker's samples planned (its positions in this iteration: 0, 1, ...)
            for chunk_items, _last in self._chunks(itertools.islice(plan.positions(slot, skip), take), batched):
                pairs = [(done + i, p) for i, p in enumerate(planned(*x) for x in chunk_items)]
                group = [p for _i, p in pairs if p is not None]
                at = [i for i, p in pairs if p is not None]  # a bad sample is skipped (its worker reports it)
                done += len(chunk_items)
                start = 0
                while start < len(group):
                    end = self._group_end(group, start)
                    # _read_group's READ of these samples: samples i of the iteration are in item i // item.
                    wanted, _names, where = self._runs(group[start:end], at[start], batched)
                    leases: list[tuple[int, float]] = []  # (item, pool bytes) of each range
                    seen: set[tuple[int, int]] = set()
                    for i in range(start, end):
                        shard = group[i][1]
                        out.fields += sum(g[1] for g in group[i][5].values())
                        for j, _off in where[i - start]:
                            if (shard, j) not in seen:
                                seen.add((shard, j))
                                r = wanted[shard][j]
                                leases.append((at[i] // item, cost(r[0], r[1])))
                    for it, c in leases:
                        costs[it] = costs.get(it, 0.0) + c
                    if n == 0:
                        out.reads.extend((sh, list(rs)) for sh, rs in wanted.items())
                    last = at[end - 1] + 1  # the sample after the group's last
                    for p in at[start:end]:
                        if (p + 1) % item == 0 or (p + 1 == done and done < take):
                            it = p // item  # its last sample in this READ (done < take: the worker's last)
                            ends.add(it)
                            over[it] = (sum(c for i2, c in leases if i2 > it), last - p - 1)
                    start = end
            left -= done
            out.samples += done
            out.leased += sum(costs.values())
            if not ends:
                continue
            # Items in flight before the worker's first (it holds `per` of them once it runs), and
            # any not planned whole: as its largest one planned.
            top = max(costs.get(it, 0.0) for it in ends)
            for it in ends:
                past, past_n = over[it]
                out.hold = max(out.hold, sum(costs.get(j, 0.0) if j in ends else top for j in range(it - max(1, per) + 1, it + 1)) + past)
                out.awaited = max(out.awaited, costs.get(it, 0.0) + past)
                out.item = max(out.item, costs.get(it, 0.0))
                out.over = max(out.over, past_n)
        if out.samples == 0 or out.leased <= 0:
            return None
        out.fields /= out.samples
        out.leased /= out.samples
        if out.item <= 0:
            # No item whole within `most` samples (items that large): its leases by the samples planned.
            out.item = out.awaited = out.leased * item
            out.hold = out.leased * item * max(1, per)
        return out

    # -- iteration ----------------------------------------------------------

    def __iter__(self) -> Iterator[GDSSample]:
        if torch.utils.data.get_worker_info() is None:
            self._worker_iterated.value = 0  # this process counts what it hands out
            self._counting = False
        elif not self._counting:
            self._worker_iterated.value = 1
        samples = self._samples()
        try:
            if self.map is None and self.handler != "warn_and_skip":
                # Nothing to skip or map (a _BadField is only made for warn_and_skip): the
                # samples as they come, without a pass over each one's fields.
                yield from samples
                return
            for sample in samples:
                bad = [v for v in sample.values() if isinstance(v, _BadField)]
                if bad:
                    warnings.warn(f"gdsfs: skipping sample {sample['__key__']!r} of shard {sample['__url__']!r}: {bad[0].error.reason}", GDSShardWarning, stacklevel=2)
                    _release_refs(v for v in sample.values() if isinstance(v, TensorRef))
                    continue
                if self.map is not None:
                    mapped = self._mapped(sample)
                    if mapped is None:
                        continue
                    sample = mapped
                yield sample
        finally:
            # Closing this generator (islice, break, close) closes the reader
            # now, not whenever the garbage collector gets to it (Python 3.12
            # keeps it alive past this frame): it gives the leases of samples
            # read but never handed out back at once.
            samples.close()

    def _mapped(self, sample: GDSSample) -> Optional[GDSSample]:
        """map(sample) as a GDSSample that keeps the resume bookkeeping; leases of TensorRefs
        it dropped (all of them when it returns None) go back to the pool."""
        refs = [v for v in sample.values() if isinstance(v, TensorRef)]
        out = self.map(sample)  # type: ignore[misc]
        if out is None:
            _release_refs(refs)
            return None
        if not isinstance(out, Mapping):
            raise TypeError(f"gdsfs: map= returned {type(out).__name__} for sample {sample.get('__key__')!r} of shard {sample.get('__url__')!r}: "
                            "return the sample (a mapping) or None to drop it")
        if not isinstance(out, GDSSample):
            out = GDSSample(out)
        out.progress, out.epoch, out.gpu_fields = sample.progress, sample.epoch, sample.gpu_fields
        kept = {id(v) for v in out.values() if isinstance(v, TensorRef)}
        _release_refs(r for r in refs if id(r) not in kept)
        return out

    def _plan(self, slots: int) -> EpochPlan:
        world = _rank_world()[1] if self.split_by_node else 1
        return EpochPlan(self.counts, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, slots=slots,
                         world=world if slots % world == 0 else 1, even=self.even_ranks if slots % world == 0 else None,
                         buffer=self.shuffle_buffer, interleave=self.interleave)

    def _drop_changed_shards(self) -> None:
        """Forget open shards rewritten since they were indexed (a persistent worker's, from
        an earlier epoch): they are indexed and planned anew when next read."""
        if self._open_pid != os.getpid():
            return
        for i, st in list(self._open.items()):
            if st.changed():
                del self._open[i]
                st.close()

    def _samples(self) -> Generator[GDSSample, None, None]:
        self._drop_changed_shards()
        slot, slots, _nw = self._slots()
        with self._lock:
            skip = self._resume.get(slot, 0) if self._resume_epoch == self.epoch else 0
            if self._resume and self._slots_seen and self._slots_seen != slots:
                raise ValueError(f"gdsfs: state was saved with {self._slots_seen} (rank, worker) slots, this run has {slots}: resume with the same world size and num_workers")
            self._resume = {}
            self._slots_seen = slots
            self._consumed = {slot: skip}
        plan = self._plan(slots)
        epoch = self.epoch
        it = _Iteration(resumed=skip > 0)
        hint = _shard_hint_bytes()
        hints = (_NextShardHints(self, plan, slot, plan.block(slot)[0] + skip, hint)
                 if hint and self._session is not None and not self.shuffle and plan.interleave == 1 and plan.buffer <= 1 else None)
        count = 0  # samples of this iteration before the chunk's first
        for chunk, last in self._chunks(plan.positions(slot, skip), self._batched):
            if hints is not None and not last:
                hints.before(chunk)
            yield from self._emit(chunk, slot, plan, epoch, count, it)
            count += len(chunk)

    def _chunk_samples(self, batched: int) -> int:
        """Samples a worker plans and reads as one chunk: read_ahead, or in a worker that hands out
        torch items of `batched` samples (a batch, or k of them: self._batched) whole items, as
        many as read_ahead holds and at least one: an item is then one READ per shard, so one
        run per field (_runs), also when it is larger than read_ahead. What the pool check
        (_lease_plan) and the start hint (_starthint.worker_ranges) plan by too."""
        return max(1, self.read_ahead // batched) * batched if batched > 0 else self.read_ahead

    def _chunks(self, positions: Iterable[tuple[int, int, int]], batched: int) -> Iterator[tuple[list[tuple[int, int, int]], bool]]:
        """positions cut into the worker's chunks (_chunk_samples), each with whether it is the
        last (a short one at the end; a full last one is not known to be last)."""
        per = self._chunk_samples(batched)
        pending: list[tuple[int, int, int]] = []
        for item in positions:
            pending.append(item)
            if len(pending) >= per:
                yield pending, False
                pending = []
        if pending:
            yield pending, True

    def _group_end(self, planned: Sequence[_Planned], start: int) -> int:
        """The end of the READ group of planned (a chunk's samples, _plan_items) that starts at
        start: at most read_ahead_bytes of gpu fields' data, at least one sample."""
        limit = self.read_ahead_bytes
        end, acc = start, 0
        while end < len(planned):
            nb = 0
            for g in planned[end][5].values():
                nb += g[1]
            if end > start and acc + nb > limit:
                break
            acc += nb
            end += 1
        return end

    def _plan_items(self, items: list[tuple[int, int, int]]) -> list[_Planned]:
        """(position, shard, state, key, field plans, gpu geometry) of each item."""
        planned: list[_Planned] = []
        daemon = self._session is not None
        last = -1
        st: Optional[_ShardState] = None
        for pos, shard, idx in items:
            if shard != last or st is None:
                # Once per run of one shard's samples: the same open shards, in the same LRU order.
                st, last = self._shard(shard), shard
            known = st.plans.get(idx) if daemon else None
            if known is not None:
                planned.append((pos, shard, st, *_kept_plan(known)))
                continue
            key, fields = self._sample_fields(st, idx)
            try:
                geo = {fp.name: self._tensor_geometry(st, fp) for fp in fields if fp.gpu and daemon}
                if daemon:
                    st.plans[idx] = _keep_plan(key, fields, geo)
            except (GDSShardError, ValueError) as e:
                why = str(e).removeprefix("gdsfs: ")
                err = e if isinstance(e, GDSShardError) else GDSShardError(
                    f"gdsfs: sample {key!r} of shard {st.path!r} cannot be read: {why}: rewrite or remove the shard, "
                    "or pass handler='warn_and_skip' to skip bad samples", path=st.path, key=key, reason=why)
                if self.handler != "warn_and_skip":
                    raise err from None
                # Read nothing of it; the reading loop yields it as bad, and __iter__ skips it.
                fields, geo = [_FieldPlan("__error__", 0, 0, False, "error")], {}
                self._errors[(st.path, key)] = err
            planned.append((pos, shard, st, key, fields, geo))
        return planned

    def _plan_sample(self, st: _ShardState, pos: int, shard: int, idx: int) -> _Planned:
        """Sample idx of st planned as _plan_items plans it, from what st holds already (its kept
        plan, else the index), reading nothing: for the start hint's thread, which plans the
        workers' first READs (_starthint.worker_ranges). Raises what planning it raises."""
        known = st.plans.get(idx)
        if known is not None:
            return (pos, shard, st, *_kept_plan(known))
        key, fields = self._sample_fields(st, idx)
        return (pos, shard, st, key, fields, {fp.name: self._tensor_geometry(st, fp, read=False) for fp in fields if fp.gpu})

    def _emit(self, items: list[tuple[int, int, int]], slot: int, plan: EpochPlan, epoch: int, first: int = 0, it: Optional["_Iteration"] = None) -> Iterator[GDSSample]:
        """Plan every sample of a chunk, then read it in groups of at most
        read_ahead_bytes of gpu fields with one daemon request per shard. A shard that
        changed since it was planned (_ShardChanged: nothing of the group was yielded) is
        planned once more from its new index when no sample of it was yielded in this
        iteration yet and it has as many samples as before; else GDSShardChangedError."""
        it = it if it is not None else _Iteration(resumed=False)
        lo = plan.block(slot)[0]
        planned = self._plan_items(items)
        start = 0
        while start < len(planned):
            end = self._group_end(planned, start)
            try:
                yield from self._read_group(planned[start:end], slot, lo, plan.slots, epoch, first + start, it)
            except _ShardChanged as e:
                self._replan(e.shard, it)
                planned[start:] = self._plan_items(items[start:])
                continue
            start = end

    def _replan(self, shard: int, it: "_Iteration") -> None:
        """Open shard anew after it changed, or raise GDSShardChangedError when the epoch
        cannot go on exactly once (some of its samples were yielded, it was planned anew
        already, the iteration resumed mid-epoch, or its sample count changed)."""
        path = self.shards[shard]
        st = self._open.pop(shard, None)
        if st is not None:
            st.close()
        if shard in it.yielded or shard in it.replanned or it.resumed:
            raise _changed_error(path)
        it.replanned.add(shard)
        try:
            self._shard(shard)  # GDSShardChangedError when its sample count changed
        except GDSShardChangedError:
            raise
        except (OSError, GDSShardError, ValueError, KeyError):
            raise _changed_error(path) from None

    def _runs(self, group: Sequence[Any], first: int,
              batched: Optional[int] = None) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[str, str, str]]], list[list[tuple[int, int]]]]:
        """The READ ranges of a group: per shard the ranges and the (field, sample, shard) each
        is named by in errors, and per sample of the group (range index, start in it) of each gpu
        field. In a DataLoader worker that knows its batch size (self._batched) and drops no
        sample (no map=, handler="raise"), one field of a batch's samples that lie one after the
        other in a shard (gaps up to RUN_GAP bytes: a tar's headers and small members) is one
        range, and so one lease, shared by those samples: they are collated into one torch item
        (a batch, or k of them: _tensors.settled materializes an item's batches together) and
        released together. Sample i of the iteration is in item i // batch. batched: the item's
        samples in place of self._batched (the pool check's plan of a worker, _lease_plan)."""
        batched = self._batched if batched is None else batched
        batch = batched if (self.map is None and self.handler == "raise" and self._session is not None) else 0
        cap = min(RUN_BYTES, self._session.max_lease - 2 * 4096) if batch and self._session is not None else 0
        wanted: dict[int, list[tuple[int, int]]] = {}
        names: dict[int, list[tuple[str, str, str]]] = {}
        where: list[list[tuple[int, int]]] = []
        open_runs: dict[tuple[int, str, int], int] = {}  # (shard, field, batch) -> index of its last range
        for k, (_pos, shard, st_, key_, fields, geo) in enumerate(group):
            locs: list[tuple[int, int]] = []
            for fp in fields:
                if fp.name not in geo:
                    continue
                off, nb = geo[fp.name][0], geo[fp.name][1]
                rs = wanted.setdefault(shard, [])
                if batch and nb <= RUN_FIELD_MAX:
                    rk = (shard, fp.name, (first + k) // batch)
                    j = open_runs.get(rk)
                    if j is not None:
                        r0, n0 = rs[j]
                        if r0 + n0 <= off <= r0 + n0 + RUN_GAP and off + nb - r0 <= cap:
                            rs[j] = (r0, off + nb - r0)
                            locs.append((j, off - r0))
                            continue
                    open_runs[rk] = len(rs)
                locs.append((len(rs), 0))
                rs.append((off, nb))
                names.setdefault(shard, []).append((fp.name, key_, st_.path))
            where.append(locs)
        return wanted, names, where

    def _read_versioned(self, session: Any, shard: int, st: Any, ranges: Sequence[tuple[int, int]]) -> Optional[list[Any]]:
        """session.read of ranges of shard at the version it was planned at (a READ of nothing
        checks the version alone). A shard changed since raises _ShardChanged; any other refusal
        is None: plain reads of it (warned once per mount and errno), unless strict."""
        try:
            return session.read(st.fd, ranges, version=st.version)
        except GDSUnavailableError as e:
            if e.errno == errno.ESTALE:
                raise _ShardChanged(shard) from None
            warn_fallback(f"the daemon cannot serve {self.shards[shard]!r}: {e}", strict=self.strict, cause=f"READ {session.mount} errno {e.errno}")
            return None

    def _read_group(self, group: list[Any], slot: int, lo: int, slots: int, epoch: int, first: int = 0, it: Optional["_Iteration"] = None) -> Iterator[GDSSample]:
        """Read and yield a group's samples: the gpu fields with one READ per shard at the
        version of the shard's index first, then the CPU fields with pread, then, for a shard
        with CPU fields, a READ of nothing that checks that version again: the daemon answers
        ESTALE unless the shard is still at it, before and after reading, so the last check
        covers the preads. The READ goes first so that a cold shard meets the disk with its
        large ranges (and the daemon's readahead after them), not with a synchronous 4 KiB
        read per CPU field ahead of them: a batch run's range holds the small members between
        its samples, so their preads then find them cached. A shard that is checked by nobody
        (plain reads) is fstat()ed after its reads. A change raises _ShardChanged before any
        sample is yielded; the leases read so far go back."""
        wanted, names, where = self._runs(group, first)
        refs: dict[int, list[Ref]] = {}
        holds: dict[int, list[Optional[_leases.Hold]]] = {}
        session = self._session
        held: dict[int, Ref] = {}  # lease id -> Ref, of samples not yet handed out
        checked: set[int] = set()  # shards whose version the daemon checked after the preads
        try:
            states = {shard: st for (_p, shard, st, *_r) in group}
            served: set[int] = set()  # shards the daemon READ for this group
            for shard, st in states.items():
                if session is None:
                    break
                ranges = wanted.get(shard)
                if ranges is None:
                    continue
                got = self._read_versioned(session, shard, st, ranges)
                if got is None:
                    continue
                served.add(shard)
                refs[shard] = got
                held.update((r.lease, r) for r in got if r.lease)
                # This process's Holds of the group's leases, in one pass over the lease book.
                holds[shard] = _leases.hold_many([(r, *n) for r, n in zip(got, names[shard])])
            # The CPU fields' bytes (decoded once the shard's version is checked: stale bytes
            # would fail to decode with a misleading error, or decode into wrong values).
            cpu: list[dict[str, bytes]] = []
            with_cpu: set[int] = set()
            pread = os.pread
            for (_pos, shard, st, _key, fields, _geo) in group:
                got_cpu: dict[str, bytes] = {}
                for fp in fields:
                    if not fp.gpu:
                        got_cpu[fp.name] = pread(st.fd, fp.length, fp.offset)
                if got_cpu:
                    with_cpu.add(shard)
                cpu.append(got_cpu)
            for shard, st in states.items():
                if session is None:
                    break
                if not st.version:
                    continue
                if shard in served and shard not in with_cpu:
                    checked.add(shard)  # the READ's own check after reading covers it all
                    continue
                if shard not in served and shard in wanted:
                    continue  # fell back to plain reads above: fstat()ed below
                if self._read_versioned(session, shard, st, [(0, 0)]) is None:
                    continue
                checked.add(shard)
            try:
                out, leases = self._assemble(group, where, cpu, refs, holds, slot, lo, slots, epoch)
            except GDSShardError:
                # Plain reads of a shard rewritten meanwhile fail as "truncated" or "not npy":
                # the change is the error.
                self._raise_if_changed(states, checked)
                raise
            self._raise_if_changed(states, checked)
            for sample, (_pos, _shard, st, key, fields, _geo) in zip(out, group):
                for fp in fields:
                    if not fp.gpu:
                        sample[fp.name] = self._decode_cpu(fp, sample[fp.name], st, key)
            yielded = it.yielded if it is not None else set()
            lock, consumed = self._lock, self._consumed
            for sample, (_pos, shard, *_r), lids in zip(out, group, leases):
                with lock:
                    consumed[slot] = sample.progress[1]  # type: ignore[index]
                # Handed out: its leases are the consumer's from the yield
                # on, also when the consumer closes (or drops) this
                # generator while it waits at the yield.
                for lid in lids:
                    held.pop(lid, None)
                yielded.add(shard)
                yield sample
        finally:
            # Samples read but never handed out (an error, a changed shard, or the consumer
            # stopped early): give their leases back now.
            if held and session is not None:
                try:
                    session.release(list(held.values()))
                except GDSUnavailableError:
                    pass

    @staticmethod
    def _raise_if_changed(states: dict[int, _ShardState], checked: set[int]) -> None:
        """_ShardChanged for a shard of the group the daemon did not check that fstat() shows
        rewritten since its index was read."""
        for shard, st in states.items():
            if shard not in checked and st.changed():
                raise _ShardChanged(shard)

    def _assemble(self, group: list[Any], where: list[list[tuple[int, int]]], cpu: list[dict[str, bytes]], refs: dict[int, list[Ref]],
                  holds: dict[int, list[Optional[_leases.Hold]]], slot: int, lo: int, slots: int, epoch: int) -> tuple[list[GDSSample], list[list[int]]]:
        """The group's samples: gpu fields as TensorRefs of the READs (plain reads where the
        daemon did not serve), CPU fields as the bytes read (decoded by the caller); and per
        sample the lease ids of its TensorRefs."""
        out: list[GDSSample] = []
        leases: list[list[int]] = []
        gpu_keys = self.gpu_keys
        for (pos, shard, st, key, fields, geo), locs, values in zip(group, where, cpu):
            sample = GDSSample(__key__=key, __url__=st.path)
            lids: list[int] = []
            at = 0
            for fp in fields:
                if fp.name in geo and shard in refs:
                    _off, nb, dt, shape, fortran = geo[fp.name]
                    j, start = locs[at]
                    at += 1
                    r, h = refs[shard][j], holds[shard][j]
                    if r.valid < start + nb:
                        got = max(0, r.valid - start)
                        raise GDSShardError(f"gdsfs: field {fp.name!r} of sample {key!r} in shard {st.path!r} is truncated ({got} of {nb} bytes): "
                                            "rewrite the shard", path=st.path, key=key, reason=f"field {fp.name!r} is truncated")
                    sample[fp.name] = _new_tensor_ref(r, dt, shape, start, fortran, fp.name, key, st.path, h)
                    if r.lease:
                        lids.append(r.lease)
                elif fp.gpu:
                    sample[fp.name] = self._plain_tensor(st, fp, key)
                else:
                    sample[fp.name] = values[fp.name]  # decoded by the caller
            sample.progress = (slot, pos - lo + 1, slots)
            sample.epoch = epoch
            sample.gpu_fields = gpu_keys
            out.append(sample)
            leases.append(lids)
        return out, leases


class _LeasePlan:
    """What a DataLoader's workers lease of the daemon's pool (GDSShardDataset._lease_plan), in
    pool bytes: a slab's share of each lease, each range widened to the daemon's alignment."""

    __slots__ = ("samples", "fields", "leased", "item", "hold", "awaited", "over", "reads")

    def __init__(self) -> None:
        self.samples = 0  # samples planned
        self.fields = 0.0  # gpu fields' bytes per sample
        self.leased = 0.0  # pool bytes per sample
        self.item = 0.0  # the most one item's leases take
        self.hold = 0.0  # the most one worker holds: `per` items in flight and what its READ read past the last
        self.awaited = 0.0  # the most an item needs while the loop waits for it: it, and what its READ reads past it
        self.over = 0  # the most samples a READ group reads past the end of an item
        self.reads: list[tuple[int, list[tuple[int, int]]]] = []  # the first worker's READs planned: (shard, ranges)


class _Iteration:
    """One iteration's record of the shards it yielded samples of and planned anew, for
    _emit's choice between planning a changed shard again and GDSShardChangedError."""

    __slots__ = ("resumed", "yielded", "replanned")

    def __init__(self, resumed: bool) -> None:
        self.resumed = resumed
        self.yielded: set[int] = set()
        self.replanned: set[int] = set()


def _check_listable(d: str, *, list_it: bool = True) -> None:
    """Raise PermissionError when this uid cannot search directory d (nor, with list_it, list
    it), or cannot reach it: the reason shards there look missing, which "does not exist" would
    misname."""
    if any(c in d for c in "*?["):
        return  # a pattern's directory part: glob said what it could
    try:
        os.stat(d)
    except PermissionError:
        raise PermissionError(errno.EACCES, f"gdsfs: {d!r} cannot be reached by uid {os.geteuid()}: a directory above it "
                              "is not searchable (x); ask its owner for access, or use shards you can read") from None
    except OSError:
        return
    need, bits = (os.R_OK | os.X_OK, "r and x") if list_it else (os.X_OK, "x")
    if os.path.isdir(d) and not os.access(d, need):
        raise PermissionError(errno.EACCES, f"gdsfs: directory {d!r} is not open to uid {os.geteuid()} (it needs {bits}): "
                              "ask its owner for access, or use shards you can read")


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader with gdsfs defaults and bookkeeping.

    Defaults collate_fn=gdsfs.torch.collate and pin_memory=True when CUDA is
    available; everything else passes through. It adds what a stock
    DataLoader cannot do for an IterableDataset: batches it yields are always
    materialized (also on CPU-only machines, where pin_memory is off),
    state_dict()/load_state_dict() resume mid-epoch exactly, len() is the
    number of batches it yields (each worker's last batch may be short), and
    a failed iteration (e.g. a killed worker) returns its leases to the pool.
    batch_size=None yields one sample at a time (a GDSBatch without the batch
    dimension).

    With a GDSShardDataset, workers and gdsfs.torch.collate, each worker sends
    several batches per torch item (batches_per_item): torch's per-item work
    and the loop's first, cold materialize are paid once per item. The
    batches are the same (batch_size samples; each worker's last one short,
    or dropped with drop_last), len() and resume stay exact; what changes is
    the order between workers, round-robin per item instead of per batch.

    Args:
        dataset: the dataset (a GDSShardDataset for the bookkeeping).
        batch_map: a function applied to each materialized batch in this
            process (gpu fields already on their device), returning what the
            loop gets; it runs after the resume bookkeeping, so
            state_dict() stays exact.
        batches_per_item: batches a worker sends per torch item. None
            (default): KBATCH_BYTES (16 MiB) // the batch's bytes (estimated
            from the shards' sizes), at most KBATCH_MAX (8): 8 for batches
            of 16 x 16 or 64 KiB in tars, 3 for 16 x 256 KiB, 1 once a batch
            is over 8 MiB; 1: one batch per item,
            torch's own way. Only where it applies (above); elsewhere one
            batch per item. prefetch_factor keeps counting batches: torch is
            asked for ceil(prefetch_factor / k) items per worker (at least
            one).
        *args, **kwargs: as torch.utils.data.DataLoader.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, *args: Any, batch_map: Optional[Callable[[Any], Any]] = None,
                 batches_per_item: Optional[int] = None, **kwargs: Any) -> None:
        if batch_map is not None and not callable(batch_map):
            raise TypeError(f"gdsfs: batch_map={batch_map!r} is not callable: pass a function of one batch")
        if batches_per_item is not None and (isinstance(batches_per_item, bool) or not isinstance(batches_per_item, int) or batches_per_item < 1):
            raise ValueError(f"gdsfs: batches_per_item={batches_per_item!r} is not a whole number >= 1: pass None (chosen from "
                             "the batch's bytes), 1 (one batch per worker item) or more")
        kwargs.setdefault("collate_fn", collate)
        kwargs.setdefault("pin_memory", torch.cuda.is_available())
        super().__init__(dataset, *args, **kwargs)
        self.batch_map = batch_map
        self.batches_per_item = batches_per_item
        self._kbatch = 1  # batches per item of the workers of the last iterator made (_get_iterator)
        self._sample_bytes = -1  # the shards' bytes per sample (_per_item), once known

    def __len__(self) -> int:
        """Batches one pass yields: for a GDSShardDataset, counted per worker
        (a worker's last batch may be short, or dropped with drop_last)."""
        ds = self.dataset
        if not isinstance(ds, GDSShardDataset):
            return super().__len__()
        counts = ds._worker_counts(self.num_workers)
        if self.batch_size is None:
            return sum(counts)
        if self.drop_last:
            return sum(n // self.batch_size for n in counts)
        return sum(math.ceil(n / self.batch_size) for n in counts)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds = self.dataset
        if isinstance(ds, GDSShardDataset):
            if self.persistent_workers and getattr(self, "_iterator", None) is not None and ds._resume_pending():
                # A state loaded since the persistent workers were forked: they hold their copy of
                # the dataset from then (no resume point) and would start the epoch over. Fresh
                # workers start at the state; the running ones stop, and their leases go back.
                self._stop_persistent_workers()
            if self.num_workers > 0 and not (self.persistent_workers and getattr(self, "_iterator", None) is not None):
                # Fresh workers: what they will hold of the pool fits this uid's share, or the
                # iteration fails now, before any worker waits (GDSPoolError), or warns once.
                self._check_pool_fit()
            # Workers that collate with gdsfs.torch.collate hand out whole batches: their
            # copies may let a batch's adjacent samples share a lease (GDSShardDataset._runs).
            batched = self.batch_size if (self.num_workers > 0 and self.batch_size and self.collate_fn is collate) else 0
            ds._main_iteration_starting(batched or 0)
            if self.num_workers > 0 and not (self.persistent_workers and getattr(self, "_iterator", None) is not None):
                # Fresh workers: the disk reads their first bytes while torch starts them (their first
                # READs: of whole items, k batches each, _items_of).
                self._start_hints = _starthint.start(ds, self.num_workers, getattr(self, "_start_hints", None), batched * self._per_item())
        try:
            it = super().__iter__()
        except BaseException as e:
            if isinstance(ds, GDSShardDataset):
                ds._batched = 0  # never in this process's own iterations
            if self.num_workers > 0 and isinstance(e, (AttributeError, TypeError, pickle.PicklingError)) and "pickle" in str(e):
                raise self._unpicklable(e) from None
            raise
        if isinstance(ds, GDSShardDataset) and self.num_workers > 0:
            ds._main_iteration_started()
        # A pin-memory thread (CUDA, a collate_fn other than gdsfs.torch.collate) copies each
        # batch and leaves its RELEASE (and the wait for its copies) to this thread. This thread
        # settles every batch before yielding it, several with one RELEASE while more wait
        # (_tensors.settled); with gdsfs.torch.collate it also copies them itself (_get_iterator).
        pin_thread = getattr(it, "_pin_memory_thread", None)
        if isinstance(pin_thread, threading.Thread):
            _tensors.defer_release(pin_thread, True)
        pin = self._loop_pins()
        device = torch.device("cuda", torch.cuda.current_device()) if pin else None
        ok = False
        try:
            for batch in _tensors.settled(it, pin=pin, device=device, ready=self._ready_probe(it)):
                if isinstance(batch, GDSBatch) and isinstance(ds, GDSShardDataset):
                    ds._observe(batch.epoch, batch.progress, batch.slots)
                if self.batch_map is not None:
                    batch = self.batch_map(batch)
                yield batch
            ok = True
        finally:
            hints = getattr(self, "_start_hints", None)
            if hints is not None:
                hints.stop()
            if isinstance(pin_thread, threading.Thread):
                _tensors.defer_release(pin_thread, False)
            if not ok and isinstance(ds, GDSShardDataset) and not self.persistent_workers:
                # Leases the workers took for batches never delivered would
                # otherwise stay until the session ends: stop the workers,
                # then start over with a fresh session. Nothing of this frame may keep
                # torch's iterator (a bound method of it would): a program that keeps the
                # exception keeps the frame, and the iterator holds the items it took out of
                # order, whose Holds keep the old session and all of its leases.
                if hasattr(it, "_shutdown_workers"):
                    it._shutdown_workers()
                del it
                ds.reclaim()

    def _stop_persistent_workers(self) -> None:
        """Stop the persistent workers of this loader's last iterator, so that the next iteration
        forks fresh ones, and reclaim the leases they held (GDSShardDataset.reclaim)."""
        it = self._iterator
        self._iterator = None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        del it
        if isinstance(self.dataset, GDSShardDataset):
            self.dataset.reclaim()

    def _ready_probe(self, it: Any) -> Optional[Callable[[], bool]]:
        """settled()'s test of whether the next batch waits: torch's data queue has something
        (_tensors._ready_probe), or, where the pool is tight (_check_pool_fit: the batches that
        settled() copies ahead, unreleased, could hold the room that the item after them needs),
        only whether torch already holds the next item in order. The queue's item may be another
        worker's, out of order: torch keeps it and waits on for the next one, which can never
        come while its worker waits for the pool space the group holds."""
        probe = _tensors._ready_probe(it)
        if probe is None or not getattr(self, "_pool_tight", False):
            return probe
        info = getattr(it, "_task_info", None)
        if not isinstance(info, dict) or not hasattr(it, "_rcvd_idx"):
            return None
        received: dict[int, tuple[Any, ...]] = info

        def in_order() -> bool:
            return len(received.get(it._rcvd_idx, ())) == 2  # (worker, data): received
        return in_order

    def _unpicklable(self, err: BaseException) -> TypeError:
        """The one-line error for workers that could not be started because what they are sent
        (collate_fn, worker_init_fn, the dataset with its map=/decode=) does not pickle, as under
        the spawn and forkserver start methods, which pickle it; fork does not."""
        ctx = self.multiprocessing_context
        method = ctx.get_start_method() if ctx is not None else multiprocessing.get_start_method()
        what = "what they run"
        for name, obj in (("collate_fn", self.collate_fn), ("worker_init_fn", self.worker_init_fn),
                          ("the dataset (its map=, decode= or another function it holds)", self.dataset)):
            try:
                pickle.dumps(obj)
            except Exception:
                what = name if name.startswith("the") else f"{name}={getattr(obj, '__qualname__', obj)!r}"
                break
        return TypeError(f"gdsfs: DataLoader workers started with {method!r} are sent {what} by pickle, and it cannot be "
                         f"pickled ({err}): define it with def at module level (a lambda or nested function cannot be "
                         "pickled), or pass multiprocessing_context='fork'")

    def _loop_pins(self) -> bool:
        """Batches of gdsfs.torch.collate are pinned (copied to the GPU) by this loader's own loop,
        not by torch's pin-memory thread: one thread does the whole of the main process's work
        per batch, with no second thread to hand the GIL to at each tensor call and queue."""
        return bool(self.pin_memory) and not getattr(self, "pin_memory_device", "") and self.collate_fn is collate and torch.cuda.is_available()

    def _per_item(self) -> int:
        """Batches per torch item for the next iterator's workers (batches_per_item): more than one
        only for a GDSShardDataset's gdsfs.torch.collate batches, made by workers, that no
        pin-memory thread of torch's handles (it would see items, not batches)."""
        ds = self.dataset
        if not (isinstance(ds, GDSShardDataset) and self.num_workers > 0 and self.batch_size and self.collate_fn is collate):
            return 1
        if self.pin_memory and not self._loop_pins():
            return 1  # a pin-memory thread of torch's may run (pin_memory_device=, a CPU-only torch's "cpu")
        if self.batches_per_item is not None:
            return self.batches_per_item
        if self._sample_bytes < 0:
            self._sample_bytes = _shard_bytes_per_sample(ds)
        if self._sample_bytes <= 0:
            return 1
        batch = self._sample_bytes * self.batch_size
        k = max(1, min(_tensors.KBATCH_MAX, _tensors.KBATCH_BYTES // batch))
        # The batches in flight (torch's ceil(prefetch_factor / k) items of k batches a worker)
        # within a part of this uid's share of the pool: on a pool that holds what k=1 keeps in
        # flight, a larger k must not make the workers wait for pool space that the batches
        # the loop waits for hold (a loader that worked at k=1 would hang).
        share = ds._session.hello.max_lease if ds._session is not None else 0
        while k > 1 and share > 0 and self.num_workers * self._items_prefetched(k) * k * batch > share // _tensors.KBATCH_SHARE_PART:
            k -= 1
        # ...and within what this process leaves of the share, as the pool check of this start
        # of fresh workers found it (_check_pool_fit, _default_k_within; 0: no bound).
        fit = getattr(self, "_pool_k", 0)
        return min(k, fit) if fit > 0 else k

    def _pool_plan(self, k: int, slab: int) -> Optional[_LeasePlan]:
        """What the fresh workers of an iteration with k batches per item lease at once
        (GDSShardDataset._lease_plan of their items of batch_size x k samples and torch's
        ceil(prefetch_factor / k) of them in flight), once per check and k (_check_pool_fit)."""
        ds = self.dataset
        assert isinstance(ds, GDSShardDataset)
        plans = self.__dict__.setdefault("_pool_plans", {})
        if k not in plans:
            plans[k] = ds._lease_plan(int(self.batch_size or 0) * k, self._items_prefetched(k), slab, self.num_workers)
        return plans[k]

    def _pool_need(self, lp: _LeasePlan) -> tuple[float, float]:
        """(pool bytes held while the item the loop waits for is read, pool bytes the workers and
        the loop can hold at once) for the workers' leases lp. A worker holds its items in flight
        and what its last READ group read past them; the loop, the item it copies. The loop takes
        items in order and returns no lease until the next one comes: while that item's worker
        reads it, it holds at most the item and what its READ reads past it, the others all
        they may."""
        w = self.num_workers
        return (w - 1) * lp.hold + lp.awaited, w * lp.hold + lp.item

    def _check_pool_fit(self) -> None:
        """GDSPoolError when what the loader's fresh workers need of the daemon's pool at once
        cannot fit this uid's share of it (the daemon's max_lease, less what this process holds):
        one batch larger than that, or batches in flight that can fill it while the item the loop
        waits for still needs room (the loop takes items in order and returns nothing meanwhile:
        a hang until a READ gives up after EAGAIN_TIMEOUT_S). GDSPoolWarning, once per loader,
        when the batches in flight are more than that but the awaited item always finds room: the
        workers wait for the loop's releases. Bytes as the workers lease them (_pool_plan)."""
        ds = self.dataset
        session = ds._session if isinstance(ds, GDSShardDataset) else None
        self._pool_tight = False
        self._pool_plans: dict[int, Optional[_LeasePlan]] = {}
        self._pool_k = 0
        if session is None or self.collate_fn is not collate or not session.hello.max_lease:
            return
        assert isinstance(ds, GDSShardDataset)
        k = self._per_item()
        slab = _slab_bytes(session.mount)
        lp = self._pool_plan(k, slab)
        if lp is None:
            return
        s = lp.leased
        most = max(ds._worker_counts(self.num_workers), default=0)  # a worker's samples this epoch: no batch is longer
        b = max(1, min(int(self.batch_size or 1), most)) if most > 0 else int(self.batch_size or 1)
        need, total = self._pool_need(lp)
        held = _leases.held_bytes(session.mount, session.device)
        if held > 0 and max(need, total, b * s) > session.hello.max_lease - held:
            # What this process holds decides: only what it really holds (a dead iterator's
            # items, dropped in a reference cycle, free nothing until a collection).
            held = _leases.held_bytes(session.mount, session.device, collect=True)
        avail = session.hello.max_lease - held
        room = avail * (1 + 1e-9)  # what exactly fills the share fits (s is a quotient)
        if self.batches_per_item is None and k > 1 and total > room:
            # The default k is the loader's own choice, bounded by a quarter of the whole share
            # (_per_item): where this process holds much of it already, a smaller k whose
            # batches in flight all fit what it leaves, so that the default neither fails nor
            # makes the workers wait where a smaller k would not.
            j = self._default_k_within(k, slab, room, need > room)
            lj = self._pool_plan(j, slab) if j != k else None
            if lj is not None:
                k, lp, self._pool_k = j, lj, j
                s = lp.leased
                need, total = self._pool_need(lp)
        # settled() copies up to SETTLE_BATCHES batches (an item's k at once) ahead before it
        # releases them: with those held too, the item after them could not be read.
        self._pool_tight = need + (_tensors.SETTLE_BATCHES + k - 1) * b * s > room
        flag = "--host-pool" if session.device < 0 else "--gpu-pool"
        fix = f"have root mount with a larger {flag} (or --uid-share)"
        where = (f"uid {session.hello.uid}'s share of the gdsfs pool at {session.mount!r} ({_size(session.hello.max_lease)}"
                 + (f", {_size(held)} of it held by this process" if held > 0 else "") + ")")
        setting = (f"DataLoader(num_workers={self.num_workers}, batch_size={self.batch_size}, prefetch_factor={self.prefetch_factor}, "
                   f"batches_per_item={self.batches_per_item if self.batches_per_item is not None else f'None (k={k})'})")
        per = self._items_prefetched(k)
        if b * s > room:
            fit = int(room // s)
            raise GDSPoolError(f"gdsfs: one batch of {setting} ({b} samples x {_size(s)} leased: {_size(b * s)}) is larger than {where}, "
                               "so its workers would wait for pool space that never comes; use "
                               + (f"batch_size <= {fit}" if fit >= 1 else "smaller samples") + f", or {fix}", errno=errno.EAGAIN)
        if need > room:
            def fits(j: int) -> bool:
                p = self._pool_plan(j, slab)
                return p is not None and self._pool_need(p)[0] <= room

            alt = next((j for j in range(k - 1, 0, -1) if fits(j)), 0)
            raise GDSPoolError(
                f"gdsfs: {setting} can hang on {where}: its other workers can hold {_size(need - lp.awaited)} in flight "
                f"({per} item(s) of {k} batch(es) of {b} samples x {_size(s)} leased each, and up to {lp.over} samples "
                f"read ahead) while the item the loop waits for still needs {_size(lp.awaited)}, and the loop returns no pool "
                "space until it comes; use " + (f"batches_per_item <= {alt}, " if alt and self.batches_per_item is not None else "")
                + f"fewer num_workers, a smaller prefetch_factor, batch_size or read_ahead, or {fix}", errno=errno.EAGAIN)
        if total > room and not getattr(self, "_pool_warned", False):
            self._pool_warned = True
            warnings.warn(f"gdsfs: {setting} keeps up to {_size(total)} in flight ({self.num_workers} workers x "
                          f"{per} item(s) of {k} batch(es) of {b} samples x {_size(s)} leased, up to {lp.over} samples "
                          f"read ahead each, and the item the loop copies), more than {where}: the workers will wait for the loop to "
                          "return pool space (the item it waits for always finds room); for full speed use fewer num_workers, a "
                          f"smaller prefetch_factor, batches_per_item or batch_size, or {fix}", GDSPoolWarning, stacklevel=3)

    def _default_k_within(self, k: int, slab: int, room: float, hangs: bool) -> int:
        """The default k for room pool bytes (_check_pool_fit): the largest k' < k whose workers'
        batches in flight and the loop's item all fit at once (no GDSPoolWarning, and away from
        the margin where the check's plan of slab use decides a hang); else, where k can hang
        (hangs), 1 if one batch per item cannot (the default is never worse than
        batches_per_item=1); else k (the check then says what to change)."""
        for j in range(k - 1, 0, -1):
            p = self._pool_plan(j, slab)
            if p is None:
                continue
            need, total = self._pool_need(p)
            if total <= room or (j == 1 and hangs and need <= room):
                return j
        return k

    @property
    def _index_sampler(self) -> Any:
        # What torch's iterator asks its workers for per item: k batches' worth of samples.
        if getattr(self, "_kbatch", 1) > 1 and self._auto_collation:
            return torch.utils.data.BatchSampler(self.sampler, int(self.batch_size or 1) * self._kbatch, False)
        return super()._index_sampler

    def _items_prefetched(self, k: int) -> int:
        """torch's prefetch_factor for items of k batches: prefetch_factor keeps counting
        batches, ceil(prefetch_factor / k) items a worker, at least one."""
        return max(1, -(-int(self.prefetch_factor or 2) // k))

    @contextlib.contextmanager
    def _items_of(self, k: int) -> Iterator[None]:
        """While torch makes an iterator (and starts its workers): items of k batches. Its workers
        collate k batches per item (_KCollate), torch drops no short item (_KCollate drops the short
        batch), prefetch_factor counts items, and torch waits k times timeout for one. The loader's
        own settings are back afterwards."""
        self._kbatch = k
        if k <= 1:
            yield
            return
        ds = self.dataset
        if isinstance(ds, GDSShardDataset) and ds._batched:
            ds._batched *= k  # the workers' runs span an item (_runs); reset once they started
        saved = (self.collate_fn, self.prefetch_factor, self.drop_last, self.timeout)
        self.collate_fn = _KCollate(int(self.batch_size or 1), k, bool(self.drop_last))
        self.prefetch_factor = self._items_prefetched(k)
        object.__setattr__(self, "drop_last", False)  # torch forbids setting it once made: restored below
        if self.timeout and self.timeout > 0:
            self.timeout = self.timeout * k  # torch waits per item: timeout= keeps counting per batch
        try:
            yield
        finally:
            self.collate_fn, self.prefetch_factor, self.timeout = saved[0], saved[1], saved[3]
            object.__setattr__(self, "drop_last", saved[2])

    def _get_iterator(self) -> Any:
        loop_pins = self._loop_pins()
        with _frozen_heap(self), self._items_of(self._per_item()), _starthint.forking(getattr(self, "_start_hints", None)):
            if not loop_pins:
                return super()._get_iterator()
            self.pin_memory = False  # torch starts no pin-memory thread for this iterator (see __iter__)
            try:
                return super()._get_iterator()
            finally:
                self.pin_memory = True

    def state_dict(self) -> dict[str, Any]:
        """The dataset's resume state (samples delivered per slot)."""
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from state_dict() (same world size and num_workers)."""
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]


def _shard_bytes_per_sample(ds: GDSShardDataset, most: int = 64) -> int:
    """The bytes per sample of (up to most of) ds's shards, by their sizes (0: not known): what
    DataLoader's batches_per_item=None sizes batches by."""
    size = n = 0
    for path, count in itertools.islice(zip(ds.shards, ds.counts), most):
        try:
            size += os.stat(path).st_size
        except OSError:
            continue
        n += count
    return size // n if n else 0


def _slab_bytes(mount: str) -> int:
    """The size of the daemon's slabs (user.gdsfs.stats pool.slab_bytes; 0: not known)."""
    try:
        doc = json.loads(os.getxattr(mount, _core.STATS_XATTR))
        return max(0, int(doc["pool"]["slab_bytes"]))
    except (OSError, ValueError, TypeError, KeyError):
        return 0


def _size(n: float) -> str:
    """n bytes for a message: KiB below 1 MiB, else MiB (GiB from 1 GiB)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


@contextlib.contextmanager
def _frozen_heap(loader: torch.utils.data.DataLoader) -> Iterator[None]:
    """While torch forks a loader's workers (its iterator starts them): this process's objects
    in the garbage collector's permanent generation (gc.freeze), moved back once they are
    started (gc.unfreeze). A forked worker inherits them frozen, so its collections never
    traverse the parent's heap: a worker's first full collection otherwise walks every object
    torch and the program made before the fork and writes to each one's header, which copies
    those pages into the worker (measured here: 60-200 ms of a fresh worker's first 4,096
    samples, 25-45% of its time). What Python's gc documentation recommends for forked
    workers. Not done when the workers are not forked (spawn, forkserver) or when the program
    froze objects itself (their unfreezing is the program's)."""
    ctx = loader.multiprocessing_context
    # Without a context torch uses the default one; its method, without fixing it (the first of
    # get_all_start_methods() is the platform's default).
    method = ctx.get_start_method() if ctx is not None else (multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0])
    if loader.num_workers <= 0 or method != "fork" or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def stateful_dataloader(dataset: torch.utils.data.Dataset, *args: Any, **kwargs: Any) -> "_TorchdataLoader":
    """torchdata's StatefulDataLoader with collate_fn=gdsfs.torch.collate and
    pin_memory=True when CUDA is available (everything else passes through).
    It saves and restores GDSShardDataset's state in each worker.

    ``gdsfs.torch.StatefulDataLoader`` is the same function under the name
    the documentation has always used.

    Raises:
        ImportError: torchdata is not installed (the message says what to do).
    """
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader as _SDL
    except ImportError as e:
        raise ImportError(f"gdsfs: StatefulDataLoader needs torchdata ({e}): pip install torchdata, or use gdsfs.torch.DataLoader") from e
    kwargs.setdefault("collate_fn", collate)
    kwargs.setdefault("pin_memory", torch.cuda.is_available())
    return _SDL(dataset, *args, **kwargs)


# The documented name (a factory, not a class: torchdata is optional and
# imported only when called).
StatefulDataLoader = stateful_dataloader
