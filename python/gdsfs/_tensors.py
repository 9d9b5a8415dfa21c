"""Tensors from gdsfs leases: TensorRef, GDSBatch, collate, materialize.

Re-exported by gdsfs.torch. Slabs are mapped once per process (host: mmap of
the daemon's shared-memory file; CUDA: IPC handle opened through libcuda)
and cached; materialization copies out of them (one gather per batched
field) and releases the leases, checking that each was still held (see
gdsfs._leases and docs/pytorch.md, "Lease ownership").
"""

from __future__ import annotations

import dataclasses
import os
import select
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.utils.data

from . import _core, _leases
from . import _protocol as proto
from ._core import Ref, Session
from ._devices import parse_device
from ._errors import GDSLeaseError, GDSUnavailableError

__all__ = [
    "GDSBatch",
    "GDSSample",
    "TensorRef",
    "collate",
    "defer_release",
    "materialize",
    "settled",
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
_UNSIGNED_WIDE = ("uint16", "uint32", "uint64")
_UNSIGNED_CODES = {"u2": "uint16", "u4": "uint32", "u8": "uint64"}


def _torch_dtype(descr: str) -> torch.dtype:
    """torch dtype of a numpy descr ("<f4") or a name ("float32")."""
    if descr in _NAMED:
        return _NAMED[descr]
    order, code = descr[:1], descr[1:]
    name = descr if descr in _UNSIGNED_WIDE else _UNSIGNED_CODES.get(code) if order in "<|=" else None
    if name is not None:
        if not hasattr(torch, name):
            raise ValueError(f"gdsfs: dtype {descr!r} needs torch.{name} (torch >= 2.3); this torch is {torch.__version__}")
        return getattr(torch, name)
    if order not in "<|=" or code not in _DTYPES:
        if order == ">":
            raise ValueError(f"gdsfs: big-endian dtype {descr!r} cannot be viewed on this machine: convert the data to little-endian")
        raise ValueError(f"gdsfs: dtype {descr!r} has no torch equivalent")
    return _DTYPES[code]


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    n = _ITEMSIZE.get(dtype)
    if n is None:
        n = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def _target_device(device: Device) -> Optional[torch.device]:
    """The device to materialize on (gdsfs._devices.parse_device); None: where the bytes are."""
    if device is None or device == "":
        return None
    return parse_device(device)


# ----------------------------------------------------------------------------
# Slabs as tensors (per process, cached).


_slab_lock = threading.Lock()


def _slab_tensor(session: Session, slab: int) -> torch.Tensor:
    """A uint8 tensor over a whole slab: mapped once per process."""
    key = (session.mount, session.hello.daemon_pid, slab)
    run = session.hello.slab_socket  # the daemon's run: a restart that reused its pid has another
    t = _core._slabs.cached(key, run, session)
    if t is not None:
        return t
    d = session.slab_info(slab)
    with _slab_lock:
        t = _core._slabs.cached(key, run, session)
        if t is not None:
            return t
        if d.kind == proto.SLAB_KIND_HOST:
            m = session._host_mapping(slab)
            t = torch.frombuffer(m.view[m.base : m.base + m.size], dtype=torch.uint8)
        elif d.kind == proto.SLAB_KIND_CUDA_FD:
            from . import _cuda

            torch.cuda.init()
            dev = session._local_device(d.device)  # the daemon's ordinal -> ours, by UUID
            with torch.cuda.device(dev):
                fd, nbytes = session.slab_fd(slab)
                try:
                    vm = _cuda.import_fd(fd, nbytes, dev)
                finally:
                    os.close(fd)
                # The tensor keeps the mapping: it goes when the last view does.
                arr = _cuda.CudaArray(vm.ptr + d.map_offset, d.size, owner=vm)
                t = torch.as_tensor(arr, device=torch.device("cuda", dev))
            _core._slabs.add_vmm(key, run, t, session)
            return t
        elif d.kind == proto.SLAB_KIND_CUDA:
            from . import _cuda

            torch.cuda.init()
            dev = session._local_device(d.device)
            with torch.cuda.device(dev):
                ptr = _cuda.open_ipc_handle(d.handle, dev)
                arr = _cuda.CudaArray(ptr + d.map_offset, d.size)
                t = torch.as_tensor(arr, device=torch.device("cuda", dev))
        else:
            raise GDSUnavailableError(f"gdsfs: slab {slab} has unknown kind {d.kind}: upgrade the gdsfs Python package")
        _core._slabs.tensors[key] = t
    return t


def _ref_bytes(ref: Ref, start: int, nbytes: int, session: Optional[Session] = None) -> torch.Tensor:
    """uint8 view of bytes [start, start+nbytes) of ref's valid data."""
    if start < 0 or start + nbytes > ref.valid:
        raise ValueError(f"gdsfs: bytes [{start}, {start + nbytes}) outside lease {ref.lease} of {ref.valid} valid bytes")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    slab = _slab_tensor(session or _core.session_for(ref), ref.slab)
    return slab[ref.offset + start : ref.offset + start + nbytes]


def _sync(refs: Sequence[Ref]) -> None:
    """Wait for the copies out of the CUDA slabs of refs."""
    for d in sorted({r.device for r in refs if r.device >= 0 and r.lease}):
        torch.cuda.current_stream(d).synchronize()


def _sync_and_release(holds: Sequence[Optional[_leases.Hold]]) -> None:
    """Wait for the copies out of the holds' leases, then release them,
    checking that the daemon still held each (GDSLeaseError otherwise: the
    bytes copied cannot be trusted)."""
    hs = [h for h in holds if h is not None]
    _sync([h.entry.ref for h in hs])
    _leases.release(hs, check_held=True)


# A thread whose materializations leave the RELEASE to the consumer carries this attribute
# (defer_release): gdsfs.torch.DataLoader's pin-memory thread, whose batches the loop's thread
# settles before it yields them.
_DEFER_ATTR = "_gdsfs_defer_release"


def defer_release(thread: threading.Thread, on: bool) -> None:
    """Let GDSBatch.pin_memory() on thread copy without releasing: the batch it returns carries
    its leases (and an event per CUDA device its copies run on) until GDSBatch._settle(), which
    the consumer calls before the batch is seen (gdsfs.torch.DataLoader, for its pin-memory
    thread: the RELEASE round trip and the wait for the copies leave that serial thread). A
    batch dropped unsettled waits for its copies, then its leases return like any collected
    holder's."""
    if on:
        setattr(thread, _DEFER_ATTR, True)
    elif getattr(thread, _DEFER_ATTR, False):
        delattr(thread, _DEFER_ATTR)


def _defers_release() -> bool:
    return bool(getattr(threading.current_thread(), _DEFER_ATTR, False))


class _Pending:
    """The leases of a batch copied but not yet released (defer_release), with an event per CUDA
    device recorded after the copies; or, record=False (the loop's own copies, settled() settles
    them as a group), only those devices: the group waits once per device for its stream."""

    __slots__ = ("holds", "events", "devices", "pid")

    def __init__(self, holds: Sequence[Optional[_leases.Hold]], record: bool = True) -> None:
        self.holds = [h for h in holds if h is not None]
        self.events: list[Any] = []
        self.devices: list[int] = sorted({h.entry.ref.device for h in self.holds if h.entry.ref.device >= 0})
        if record:
            for d in self.devices:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(d))
                self.events.append(ev)
            self.devices = []
        self.pid = os.getpid()

    def wait(self) -> None:
        """Wait for the copies (idempotent). Copies without an event: every stream of their
        devices (only a batch dropped or pickled before its group settled gets here)."""
        events, self.events = self.events, []
        devices, self.devices = self.devices, []
        for ev in events:
            ev.synchronize()
        for d in devices:
            torch.cuda.synchronize(d)

    def take(self) -> list[_leases.Hold]:
        """The Holds, for one release (after wait())."""
        holds, self.holds = self.holds, []
        return holds

    def settle(self) -> None:
        self.wait()
        _leases.release(self.take(), check_held=True)

    def __del__(self) -> None:
        # Dropped unsettled: the copies finish before the Holds go (they are collected after
        # this, and queue their leases' release). Not in a forked child (CUDA is the parent's).
        if (self.events or self.devices) and self.pid == os.getpid():
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - interpreter teardown: the exit ends the sessions
                pass


# gdsfs.torch.DataLoader's loop (settled): the most batches it settles with one RELEASE, and the
# most bytes of their gpu fields it holds back meanwhile (copies, not yet yielded).
SETTLE_BATCHES = 8
SETTLE_BYTES = 64 << 20


def _ready_probe(it: Any) -> Optional[Callable[[], bool]]:
    """A cheap test of whether the DataLoader iterator it has another batch waiting (torch's data
    queue: the workers' result pipe, or the pin-memory thread's queue), or None when it cannot be
    known. A wrong True only delays a batch until the next one comes; a wrong False only settles
    a smaller group."""
    q = getattr(it, "_data_queue", None)
    if q is None:
        return None
    reader = getattr(q, "_reader", None)  # a multiprocessing queue: poll its pipe
    if reader is not None and hasattr(reader, "fileno"):
        try:
            p = select.poll()
            p.register(reader.fileno(), select.POLLIN)
        except (OSError, ValueError):
            return None
        return lambda: bool(p.poll(0))
    qsize: Optional[Callable[[], int]] = getattr(q, "qsize", None)
    if qsize is None:
        return None
    size: Callable[[], int] = qsize
    return lambda: size() > 0


def _batch_bytes(b: Any) -> int:
    return sum(v.numel() * v.element_size() for k, v in b.data.items() if k in b.gpu_fields and isinstance(v, torch.Tensor))


def _settle_group(batches: Sequence[Any]) -> list[Optional[GDSLeaseError]]:
    """Settle the GDSBatches of batches (GDSBatch._settle) with one RELEASE request: wait for
    every copy, release every batch's leases, and return per batch None or the GDSLeaseError its
    own _settle() would have raised (the bytes copied cannot be trusted)."""
    pend: list[_Pending] = []
    at: list[int] = []
    for i, b in enumerate(batches):
        p = getattr(b, "_pending", None) if isinstance(b, GDSBatch) else None
        if p is not None:
            b._pending = None
            pend.append(p)
            at.append(i)
    # The loop's own copies of a group were issued one after the other on the current stream of
    # each device (no user code ran between them): one wait per device covers them all.
    for d in sorted({d for p in pend for d in p.devices}):
        torch.cuda.current_stream(d).synchronize()
    for p in pend:
        p.devices = []
        p.wait()
    errs: list[Optional[GDSLeaseError]] = [None] * len(batches)
    for i, e in zip(at, _leases.release_groups([p.take() for p in pend])):
        errs[i] = e
    return errs


# gdsfs.torch.DataLoader(batches_per_item=None): workers send k = KBATCH_BYTES // (a batch's
# bytes) batches per torch item, at most KBATCH_MAX (k=1, one batch per item, from a batch of
# KBATCH_BYTES up). The loop's cost per item is mostly fixed (about 200 us to materialize a 1 or
# a 4 MiB batch on the H200, 2026-12-02 13:45), so items of up to 16 MiB: k=8 for batches of 16
# x 16 or 64 KiB, 3 for 16 x 256 KiB, 1 for 16 x 1 MiB and more.
KBATCH_BYTES = 16 << 20
KBATCH_MAX = 8
# ...and a smaller k while the workers' batches in flight would be more than 1/KBATCH_SHARE_PART
# of the uid's share of the pool (the daemon's max_lease).
KBATCH_SHARE_PART = 4


class _Batches(list):  # type: ignore[type-arg]
    """The batches of one DataLoader item (a worker's k batches, gdsfs.torch.DataLoader's
    batches_per_item): settled() materializes them back to back and yields them one by one."""

    __slots__ = ()


def _release_unmaterialized(batches: Sequence[Any], kept: Sequence[Any] = ()) -> None:
    """Give back the leases of an item's batches the loop never materialized (one failed before
    them): they are never yielded. Leases that batches of kept (materialized, not yet settled)
    also hold stay for their settle: an item's batches may share one lease (one run of the item)."""
    keep = {id(h.entry) for b in kept if isinstance(b, GDSBatch) and b._pending is not None for h in b._pending.holds}
    hs = [h for b in batches if isinstance(b, GDSBatch) for h in b._holds() if id(h.entry) not in keep]
    _leases.release(hs, check_held=False)


# settled()'s item path: the batches of one item whose gpu fields continue one evenly spaced run
# of one lease (a worker's item read as one range per field: GDSShardDataset._runs) are checked
# and their run found once, then gathered with a copy per batch; on the device types named here
# ("cpu", "cuda"), with one copy per field for all of them, each batch's field a view of its rows.
# CUDA only: its caching allocator reuses item-sized blocks, and the loop alone took 0.80x the
# time of a copy per batch on the H200 (2026-12-02 13:45); on the CPU one item-sized allocation
# per field gets fresh pages and cost more than the copies it saves (docs/benchmarks.md, "One
# copy per item").
ITEM_VIEWS: frozenset[str] = frozenset({"cuda"})


def _run_sig(b: Any) -> Optional[tuple[Any, ...]]:
    """What batches of one item must share to be gathered together (_item_segments): per gpu
    field of b still in daemon memory, its one lease (its Hold) and one geometry; None when b is
    not an unmaterialized GDSBatch of such fields."""
    if type(b) is not GDSBatch or b._pending is not None:
        return None
    sig: list[Any] = []
    for k, v in b.data.items():
        if isinstance(v, _RefColumn):
            if len(v.holds) != 1 or len(v.geos) != 1 or v.holds[0] is None or not v.idx:
                return None
            sig.append((k, id(v.holds[0]), v.geos[0]))
    return tuple(sig) if sig else None


def _item_segments(parts: Sequence[Any]) -> dict[int, int]:
    """lo -> hi of each run of at least two consecutive batches of an item with one _run_sig."""
    segs: dict[int, int] = {}
    lo, sig = 0, None
    for i, b in enumerate(parts):
        s = _run_sig(b)
        if s is None or s != sig:
            if sig is not None and i - lo >= 2:
                segs[lo] = i
            lo, sig = i, s
    if sig is not None and len(parts) - lo >= 2:
        segs[lo] = len(parts)
    return segs


def _materialize_segment(bs: Sequence["GDSBatch"], device: Optional[torch.device], pin: bool) -> Optional[list["GDSBatch"]]:
    """materialize(device, pin=pin, _defer=True, _parsed=True, _record=False) of each batch of
    bs (one _run_sig) at once, when each gpu field's samples of all of them are one evenly
    spaced run of their lease that _gather would copy in one typed clone: the lease check, the
    run and the _Pending once for all of them, then each batch's rows cloned (on a device type
    in ITEM_VIEWS: one clone per field, each batch's field a view of its rows). The first batch
    carries the _Pending of their leases (the same for all), the others none. None when that
    does not apply, or anything fails (nothing was released: the caller materializes them one
    by one, which raises what that batch's own materialize raises)."""
    try:
        first = bs[0]
        tgt = device
        if tgt is None and pin and torch.cuda.is_available():
            tgt = torch.device("cuda", torch.cuda.current_device())
        holds = first._holds()
        _leases.check(holds)
        whole: dict[str, torch.Tensor] = {}
        views: dict[str, bool] = {}
        for k, v in first.data.items():
            if not isinstance(v, _RefColumn):
                continue
            starts = [s for b in bs for s in b.data[k].starts]
            col = _RefColumn.__new__(_RefColumn)
            col._refs = None
            col.leases, col.holds, col.geos, col.starts = v.leases, v.holds, v.geos, starts
            col.idx = col.gidx = [0] * len(starts)
            col.fields = col.samples = col.paths = []
            typed = _typed_run(col)
            if typed is None or (tgt is not None and tgt != typed.device) or (pin and typed.device.type == "cpu" and torch.cuda.is_available()):
                return None
            views[k] = typed.device.type in ITEM_VIEWS
            whole[k] = typed.clone(memory_format=torch.contiguous_format) if views[k] else typed
        out: list[GDSBatch] = []
        at = 0
        for b in bs:
            data: dict[str, Any] = {}
            rows = 0
            for k, v in b.data.items():
                if isinstance(v, _RefColumn):
                    rows = len(v.idx)
                    t = whole[k][at : at + rows]
                    data[k] = t if views[k] else t.clone(memory_format=torch.contiguous_format)
                else:
                    data[k] = _plain_field(k, v, b.gpu_fields, tgt, pin)
            at += rows
            out.append(GDSBatch(data, gpu_fields=b.gpu_fields, progress=b.progress, epoch=b.epoch, slots=b.slots, engines=b.engines))
    except Exception:  # noqa: BLE001 - the batches one by one then raise what applies
        return None
    out[0]._pending = _Pending(holds, record=False)
    return out


def settled(it: Iterable[Any], *, pin: bool = False, device: Device = None, ready: Optional[Callable[[], bool]] = None) -> Iterator[Any]:
    """The batches of it (a DataLoader iterator), each GDSBatch materialized (gpu fields on device;
    with pin, CPU tensors pinned, as GDSBatch.pin_memory does) and settled before it is yielded:
    its copies waited for, its leases released and the daemon's answer checked, exactly as a
    synchronous materialize(); what differs is that while ready() says another batch is waiting
    (up to SETTLE_BATCHES batches, SETTLE_BYTES bytes of gpu fields), the batches are copied first
    and settled together with one RELEASE, then yielded in order. An item of several batches
    (_Batches: a worker's k batches) is materialized whole, back to back, before any of its
    batches is yielded (its batches that continue one run of one lease together:
    _materialize_segment); its batches after one whose materialize failed return their leases
    unmaterialized (but for leases that batches before it share). A batch whose settling fails is
    not yielded: the ones before it are, then its GDSLeaseError is raised. At a yield every batch
    taken from it is settled (nothing of a group is left unreleased when the consumer stops); an
    exception from it (a worker that died) comes after the batches taken before it."""
    # Every yield sits inside this try: close() then throws GeneratorExit in and unwinds the frame.
    # CPython 3.12.3 (Ubuntu 24.04's) closes a generator paused at a yield outside every try block
    # without unwinding it and keeps its locals (gh-118272): the source with the batches never
    # taken, and their leases, stayed until the consumer dropped the generator itself.
    try:
        src = iter(it)
        tgt = _target_device(device)
        group: list[Any] = []
        held = 0
        failed: Optional[BaseException] = None
        item: Any = None
        done: Optional[list[Any]] = None
        b: Any = None
        while True:
            try:
                item = next(src)
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - raised again once the batches before it are out
                failed = e
                break
            parts = item if isinstance(item, _Batches) else (item,)
            item = None
            segs = _item_segments(parts) if len(parts) > 1 else {}
            i = 0
            while i < len(parts):
                hi = segs.get(i, 0)
                done = _materialize_segment(parts[i:hi], tgt, pin) if hi else None
                if done is not None:
                    # Batches i..hi-1 of the item at once: one run of one lease per field.
                    for b in done:
                        group.append(b)
                        held += _batch_bytes(b)
                    i, done = hi, None
                    continue
                b = parts[i]
                try:
                    if isinstance(b, GDSBatch) and not b.materialized:
                        b = b.materialize(tgt, pin=pin, _defer=True, _parsed=True, _record=False)
                except Exception as e:  # noqa: BLE001 - raised again once the batches before it are out
                    failed = e
                    _release_unmaterialized(parts[i + 1 :], group)
                    break
                group.append(b)
                if isinstance(b, GDSBatch):
                    held += _batch_bytes(b)
                i += 1
            parts, b, done = (), None, None
            if failed is not None:
                break
            if not group:
                continue  # an item whose one short batch drop_last left out
            if len(group) < SETTLE_BATCHES and held < SETTLE_BYTES and ready is not None and ready():
                continue
            errs = _settle_group(group)
            out, group, held = group, [], 0
            for b, err in zip(out, errs):
                if err is not None:
                    raise err
                yield b
            del out, b
        if group:
            errs = _settle_group(group)
            for b, err in zip(group, errs):
                if err is not None:
                    raise err
                yield b
        if failed is not None:
            try:
                raise failed
            finally:
                failed = None  # no cycle from this frame through the traceback to the exception
    finally:
        # Nothing for a traceback's frame to keep: a consumer that keeps the exception raised here
        # (a GDSLeaseError mid-group, a dead worker's error) keeps this frame through its
        # traceback; the frame must not keep the source (it is src: a DataLoader iterator, its
        # workers and the leases of the batches they hold; ready may be a closure over it), the
        # batches, nor the exception itself (err: a cycle through the traceback).
        it = src = iter(())
        ready = None
        group, out, errs, b, err, item, parts, done = [], [], [], None, None, None, (), None


def _lease_error(h: Optional[_leases.Hold], ref: Ref, err: Exception) -> GDSLeaseError:
    reason = f"its memory cannot be mapped any more ({err}): its session ended"
    if h is not None:
        return h.entry.error(reason)
    return GDSLeaseError(ref.lease, reason)


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
        release: this call owns the lease: with copy=True it is released
            right after the copy, and the daemon's answer checked
            (GDSLeaseError when it no longer held it: the copy is not
            returned); with copy=False the view owns it, released when the
            last tensor over the view is collected. Default: True with
            copy=True, False with copy=False: the caller releases the lease
            (Session.release); the view then only keeps the session from
            ending while it lives.

    Returns:
        The tensor.

    Raises:
        GDSLeaseError: release is on and the lease is not held any more
            (materialized before, released, or its session ended).
    """
    return _tensor_from_ref(ref, dtype, shape, device, copy=copy, session=session, start=start, nbytes=nbytes, release=release, hold=None)


def _tensor_from_ref(
    ref: Ref,
    dtype: torch.dtype,
    shape: Optional[Sequence[int]],
    device: Device,
    *,
    copy: bool,
    session: Optional[Session],
    start: int,
    nbytes: Optional[int],
    release: Optional[bool],
    hold: Optional[_leases.Hold],
) -> torch.Tensor:
    n = ref.valid - start if nbytes is None else nbytes
    esize = torch.empty((), dtype=dtype).element_size()
    if shape is None:
        shape = (n // esize,)
    owns = (copy if release is None else release) and ref.lease != 0
    h = (hold or _leases.hold(ref)) if owns else None
    if h is not None:
        _leases.check([h])  # before touching memory that may be another's
    try:
        b = _ref_bytes(ref, start, n, session)
    except GDSUnavailableError as e:
        if owns:
            raise _lease_error(h, ref, e) from e
        raise
    target = _target_device(device) or b.device
    if not copy:
        if target != b.device:
            raise ValueError(f"gdsfs: a zero-copy view lives on {b.device}; ask for that device or copy=True")
        if (b.storage_offset() % esize) != 0:
            raise ValueError(f"gdsfs: bytes at slab offset {ref.offset + start} are not aligned for {dtype}: use copy=True")
        if n == 0:
            if h is not None:
                _leases.release([h], check_held=False)
            return _view_as(b, dtype, shape, False)
        # A base object per view, whose life is the life of every tensor
        # over it: torch keeps it alive as long as any view of b exists.
        if b.device.type == "cuda":
            from . import _cuda

            base: Any = _cuda.CudaArray(b.data_ptr(), n)
            b = torch.as_tensor(base, device=b.device)
        else:
            base = (session or _core.session_for(ref)).host_buffer(ref)[start : start + n]
            b = torch.frombuffer(base, dtype=torch.uint8)
        if h is not None:
            _leases.view(h, base)
        else:
            _leases.pin(ref, base)
        return _view_as(b, dtype, shape, False)
    out = torch.empty(n, dtype=torch.uint8, device=target)
    out.copy_(b)
    if h is not None:
        _sync_and_release([h])
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
    It holds its lease (docs/pytorch.md, "Lease ownership"): the lease
    stays this process's until the TensorRef is materialized, released, or
    it and every copy of it (unpickled copies, batches) are collected.

    Attributes:
        ref: the lease holding the bytes.
        dtype: element type.
        shape: tensor shape.
        start: first byte of the tensor within the lease.
        fortran: the bytes are column-major (.npy fortran_order).
        field: the sample field it is ("" when unknown), for errors.
        sample: the sample key ("" when unknown), for errors.
        path: the shard the bytes came from ("" when unknown), for errors.
    """

    ref: Ref
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int = 0
    fortran: bool = False
    field: str = dataclasses.field(default="", compare=False)
    sample: str = dataclasses.field(default="", compare=False)
    path: str = dataclasses.field(default="", compare=False)
    # This process's Hold of the lease (pickles as the lease: the unpickled
    # copy holds it in the unpickling process).
    _hold: Optional[_leases.Hold] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self._hold is None and self.ref.lease:
            object.__setattr__(self, "_hold", _leases.hold(self.ref, self.field, self.sample, self.path))

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)

    @property
    def held(self) -> bool:
        """True while this process holds the lease (not yet materialized,
        released, or lost with its session)."""
        return self._hold is None or self._hold.state == _leases.HELD

    def _bytes(self) -> torch.Tensor:
        try:
            return _ref_bytes(self.ref, self.start, self.nbytes)
        except GDSUnavailableError as e:
            raise _lease_error(self._hold, self.ref, e) from e

    def materialize(self, device: Device = None, copy: bool = True) -> torch.Tensor:
        """The field as a tensor (see tensor_from_ref). With copy=True the
        bytes are copied and the lease released (the daemon's answer
        checked); with copy=False the view holds the lease until it is
        collected. Either way the TensorRef is spent: materialize it once.

        Raises:
            GDSLeaseError: the lease is not held any more (materialized
                before, released, or its session ended); no bytes are
                returned.
        """
        shape = tuple(reversed(self.shape)) if self.fortran else self.shape
        t = _tensor_from_ref(self.ref, self.dtype, shape, device, copy=copy, session=None, start=self.start, nbytes=self.nbytes, release=True, hold=self._hold)
        return t.permute(*reversed(range(len(self.shape)))) if self.fortran else t

    def release(self) -> None:
        """Give the lease back now, without materializing (idempotent)."""
        if self._hold is not None:
            _leases.release([self._hold], check_held=False)

    def pin_memory(self, device: Device = None) -> torch.Tensor:
        """Materialize (the DataLoader pin-memory thread calls this)."""
        return self.materialize(device)


def _new_tensor_ref(ref: Ref, dtype: torch.dtype, shape: tuple[int, ...], start: int, fortran: bool, field: str, sample: str, path: str,
                    hold: Optional[_leases.Hold]) -> TensorRef:
    """TensorRef(ref, ..., _hold=hold) of a lease whose Hold the caller took (None: lease 0),
    without the frozen dataclass's __init__ (one object.__setattr__ per attribute): a dataset
    makes one per gpu field per sample."""
    t = object.__new__(TensorRef)
    t.__dict__.update(ref=ref, dtype=dtype, shape=shape, start=start, fortran=fortran, field=field, sample=sample, path=path, _hold=hold)
    return t


class GDSSample(dict):
    """One sample: "__key__", "__url__", TensorRef fields, decoded CPU fields."""

    # (slot, samples of the slot handed out including this one, slots) for
    # resume bookkeeping.
    progress: Optional[tuple[int, int, int]] = None
    epoch: int = 0
    gpu_fields: tuple[str, ...] = ()


class _RefColumn:
    """A batched field still in daemon memory: gathered in one copy.

    Kept compact: the distinct leases once each with this process's Hold of each, the distinct
    geometries (dtype, shape, fortran) once each, and per sample the index of its lease, of its
    geometry and its start in the lease (with its field, key and shard for errors). It pickles
    (a worker's batch on its way to the main process) as exactly that, and unpickling takes this
    process's Holds of the distinct leases in one pass over the lease book
    (_leases.hold_many); the per-sample TensorRefs are made only when asked for (refs): a
    gather and a release work on the leases directly.
    """

    __slots__ = ("_refs", "leases", "holds", "geos", "idx", "gidx", "starts", "fields", "samples", "paths")

    def __init__(self, refs: Sequence[TensorRef]) -> None:
        self._refs: Optional[list[TensorRef]] = list(refs)
        at: dict[Ref, int] = {}
        geo_at: dict[tuple[Any, ...], int] = {}
        self.leases: list[Ref] = []
        self.holds: list[Optional[_leases.Hold]] = []
        self.geos: list[tuple[torch.dtype, tuple[int, ...], bool]] = []
        self.idx: list[int] = []
        self.gidx: list[int] = []
        ts = self._refs
        self.starts = [t.start for t in ts]
        self.fields = [t.field for t in ts]
        self.samples = [t.sample for t in ts]
        self.paths = [t.path for t in ts]
        t0 = ts[0] if ts else None
        if t0 is not None and all(t.ref is t0.ref and t.dtype is t0.dtype and t.shape == t0.shape and t.fortran == t0.fortran for t in ts):
            # A batch's samples of one shared range and one geometry (the common case).
            self.leases, self.holds, self.geos = [t0.ref], [t0._hold], [(t0.dtype, t0.shape, t0.fortran)]
            self.idx, self.gidx = [0] * len(ts), [0] * len(ts)
            return
        last_ref: Optional[Ref] = None
        last_geo: tuple[Any, ...] = ()
        i = j = 0
        for t in ts:
            # A batch's samples of one range share its Ref object, and usually one geometry:
            # compare with the previous sample's before hashing.
            if t.ref is not last_ref:
                last_ref = t.ref
                found = at.get(t.ref)
                if found is None:
                    found = at[t.ref] = len(self.leases)
                    self.leases.append(t.ref)
                    self.holds.append(t._hold)
                i = found
            if not last_geo or t.dtype is not last_geo[0] or t.shape != last_geo[1] or t.fortran != last_geo[2]:
                last_geo = (t.dtype, t.shape, t.fortran)
                g = geo_at.get(last_geo)
                if g is None:
                    g = geo_at[last_geo] = len(self.geos)
                    self.geos.append(last_geo)
                j = g
            self.idx.append(i)
            self.gidx.append(j)

    def __len__(self) -> int:
        return len(self.idx)

    @property
    def refs(self) -> list[TensorRef]:
        """The column's TensorRefs, one per sample (made on first use in an unpickled column)."""
        if self._refs is None:
            self._refs = [TensorRef(self.leases[i], self.geos[g][0], self.geos[g][1], s, self.geos[g][2], f, k, p, self.holds[i])
                          for i, g, s, f, k, p in zip(self.idx, self.gidx, self.starts, self.fields, self.samples, self.paths)]
        return self._refs

    def __reduce__(self) -> Any:
        return (_rebuild_column, ([tuple(getattr(r, n) for n in _REF_FIELDS) for r in self.leases], self.geos, self.idx, self.gidx,
                                  self.starts, self.fields, self.samples, self.paths))


_REF_FIELDS = tuple(f.name for f in dataclasses.fields(Ref))


def _new_ref(values: Sequence[Any]) -> Ref:
    """Ref(*values) without the frozen dataclass's __init__ (one attribute set at a time through
    object.__setattr__): one is made per lease of every batch a worker sends."""
    if len(values) != len(_REF_FIELDS):
        return Ref(*values)
    r = object.__new__(Ref)
    r.__dict__.update(zip(_REF_FIELDS, values))
    return r


def _rebuild_column(leases: list[tuple[Any, ...]], geos: list[tuple[Any, ...]], idx: list[int], gidx: list[int], starts: list[int],
                    fields: list[str], samples: list[str], paths: list[str]) -> _RefColumn:
    col = _RefColumn.__new__(_RefColumn)
    col._refs = None
    col.leases = [_new_ref(r) for r in leases]
    first: dict[int, int] = {}  # lease index -> its first sample (names it in errors)
    for row, i in enumerate(idx):
        if i not in first:
            first[i] = row
    col.holds = _leases.hold_many([(col.leases[i], fields[r], samples[r], paths[r]) for i, r in sorted(first.items())])
    col.geos = [(dt, tuple(shape), bool(fortran)) for dt, shape, fortran in geos]
    col.idx, col.gidx, col.starts, col.fields, col.samples, col.paths = idx, gidx, starts, fields, samples, paths
    return col


def _slab_of(r: Ref, h: Optional[_leases.Hold], slabs: dict[tuple[str, int, int], torch.Tensor]) -> torch.Tensor:
    k = (r.mount, r.daemon_pid, r.slab)
    slab = slabs.get(k)
    if slab is None:
        try:
            slab = slabs[k] = _slab_tensor(_core.session_for(r), r.slab)
        except GDSUnavailableError as e:
            raise _lease_error(h, r, e) from e
    return slab


def _byte_views(col: _RefColumn) -> list[torch.Tensor]:
    """uint8 views of the column's bytes, one per sample (the slab lookups shared)."""
    slabs: dict[tuple[str, int, int], torch.Tensor] = {}
    sizes = [_numel(shape) * _itemsize(dt) for dt, shape, _f in col.geos]
    out = []
    for i, g, start in zip(col.idx, col.gidx, col.starts):
        r = col.leases[i]
        n = sizes[g]
        if start < 0 or start + n > r.valid:
            raise ValueError(f"gdsfs: bytes [{start}, {start + n}) outside lease {r.lease} of {r.valid} valid bytes")
        if n == 0:
            out.append(torch.empty(0, dtype=torch.uint8))
            continue
        slab = _slab_of(r, col.holds[i], slabs)
        at = r.offset + start
        out.append(slab[at : at + n])
    return out


def _host_rows(col: _RefColumn) -> Optional[torch.Tensor]:
    """A (len(col), nbytes) uint8 copy of a one-geometry column whose samples all lie in host
    (CPU) slabs, at any starts (a lease per sample: an in-process iteration, a stock DataLoader's
    workers): one new tensor, each sample's bytes copied into its row through numpy (a slice
    assignment per sample, no tensor per sample and no stack). None when a sample is empty, on
    a CUDA slab or numpy is missing (_byte_views then). Checks each sample's range and slab as
    _byte_views does, in the same order, before copying anything."""
    rows = len(col.idx)
    if not rows or len(col.geos) != 1:
        return None
    dt, shape, _fortran = col.geos[0]
    n = _numel(shape) * _itemsize(dt)
    if n == 0:
        return None
    slabs: dict[tuple[str, int, int], torch.Tensor] = {}
    arrays: dict[tuple[str, int, int], Any] = {}  # slab -> its numpy view (once per distinct slab of the column)
    leases, holds = col.leases, col.holds
    srcs: list[tuple[Any, int]] = []
    last: Optional[tuple[str, int, int]] = None
    a: Any = None
    for i, start in zip(col.idx, col.starts):
        r = leases[i]
        if start < 0 or start + n > r.valid:
            raise ValueError(f"gdsfs: bytes [{start}, {start + n}) outside lease {r.lease} of {r.valid} valid bytes")
        key = (r.mount, r.daemon_pid, r.slab)
        if key != last:  # a batch's leases are mostly in one slab: look it up once
            a = arrays.get(key)
            if a is None:
                slab = _slab_of(r, holds[i], slabs)
                if slab.device.type != "cpu":
                    return None
                try:
                    a = arrays[key] = slab.numpy()
                except RuntimeError:  # a torch built without numpy: the views then
                    return None
            last = key
        srcs.append((a, r.offset + start))
    out = torch.empty((rows, n), dtype=torch.uint8)
    o = out.numpy()
    for k, (a, at) in enumerate(srcs):
        o[k] = a[at : at + n]
    return out


def _run_of(col: _RefColumn) -> Optional[tuple[torch.Tensor, int, int, int]]:
    """(slab, storage offset of the first sample's bytes, step, nbytes) when every sample of the
    column views the same lease, with one geometry, at starts evenly spaced by at least nbytes (a
    batch's samples of one shared range, a tar's samples of one size: GDSShardDataset._runs),
    else None. Makes no view: _strided_run and _typed_run make the one they need."""
    rows = len(col.idx)
    if rows < 2 or len(col.leases) != 1 or len(col.geos) != 1:
        return None
    r = col.leases[0]
    if not r.lease:
        return None
    dt, shape, _fortran = col.geos[0]
    n = _numel(shape) * _itemsize(dt)
    s0 = col.starts[0]
    step = col.starts[1] - s0
    if n == 0 or step < n:
        return None
    if col.starts != list(range(s0, s0 + rows * step, step)):
        return None
    last = s0 + (rows - 1) * step
    if s0 < 0 or last + n > r.valid:
        raise ValueError(f"gdsfs: bytes [{last}, {last + n}) outside lease {r.lease} of {r.valid} valid bytes")
    slab = _slab_of(r, col.holds[0], {})
    return slab, _slab_base(slab) + r.offset + s0, step, n


def _slab_base(slab: torch.Tensor) -> int:
    """slab.storage_offset(), cached on the slab's tensor (a tensor call less per gather)."""
    off = slab.__dict__.get("_gdsfs_base")
    if off is None:
        off = slab.__dict__["_gdsfs_base"] = slab.storage_offset()
    return off


def _strided_run(col: Union[_RefColumn, Sequence[TensorRef]]) -> Optional[torch.Tensor]:
    """A (len(col), nbytes) uint8 view over the slab of a column _run_of finds evenly spaced in
    one lease, else None. One strided copy of it replaces a slice per sample and their stack."""
    if not isinstance(col, _RefColumn):
        col = _RefColumn(col)
    run = _run_of(col)
    if run is None:
        return None
    slab, off, step, n = run
    return slab.as_strided((len(col.idx), n), (step, 1), off)


def _typed_run(col: _RefColumn) -> Optional[torch.Tensor]:
    """_strided_run already shaped and typed: a (len(col),) + shape view of dtype over the slab
    (one as_strided of the slab's typed view, the only tensor call), when the starts, their
    spacing and the slab offset are aligned for dtype and the bytes are C-ordered; else None. Its
    clone is the field."""
    run = _run_of(col)
    if run is None:
        return None
    slab, off, step, _n = run
    dtype, shape, fortran = col.geos[0]
    size = _itemsize(dtype)
    if fortran or off % size or step % size or not all(int(d) > 0 for d in shape):
        return None
    base = slab if dtype == torch.uint8 else _typed_view(slab, dtype)
    if base is None:
        return None
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= int(d)
    return base.as_strided((len(col.idx),) + tuple(shape), (step // size,) + tuple(reversed(strides)), off // size)


def _typed_view(slab: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The whole slab viewed as dtype, or None when its size or start is not a multiple of
    dtype's. Cached on the slab's tensor itself, so it lives exactly as long as that mapping
    does (_core._ProcessSlabs.drop_vmm lets a closed session's mappings go)."""
    typed = slab.__dict__.setdefault("_gdsfs_typed", {})
    t = typed.get(dtype)
    if t is None:
        size = _itemsize(dtype)
        if slab.numel() % size or slab.storage_offset() % size:
            return None
        t = typed[dtype] = slab.view(dtype)
    return t


def _gather(col: _RefColumn, device: Device, *, pin: bool, parsed: bool = False) -> Union[torch.Tensor, list[torch.Tensor]]:
    """One gather per field: stack the byte views (or copy one strided view of a shared
    range), then reinterpret. Fields whose samples differ in dtype or shape become a list of
    tensors. parsed: device is already a torch.device from _target_device (or None)."""
    if len(col.geos) != 1:
        return [_gather(_RefColumn([t]), device, pin=pin, parsed=parsed)[0] for t in col.refs]
    dtype, shape, fortran = col.geos[0]
    rows = len(col.idx)
    target0: Optional[torch.device] = device if (parsed and not isinstance(device, (int, str))) else _target_device(device)
    typed = _typed_run(col)
    if typed is not None and (target0 is None or target0 == typed.device) and not (pin and typed.device.type == "cpu" and torch.cuda.is_available()):
        # The field in one copy, already typed and shaped (the lease is released after it).
        return typed.clone(memory_format=torch.contiguous_format)
    run = _strided_run(col)
    rows_out = _host_rows(col) if run is None else None
    views = [run] if run is not None else [rows_out] if rows_out is not None else _byte_views(col)
    src = views[0].device

    def stacked() -> torch.Tensor:
        # Always a copy: the lease is released once the gather is done.
        if rows_out is not None:
            return rows_out
        return run.clone(memory_format=torch.contiguous_format) if run is not None else torch.stack(views)

    target = target0 or src
    if src.type == "cpu" and target.type == "cuda":
        host = stacked()
        if pin:
            host = host.pin_memory()
        out = host.to(target, non_blocking=pin)
    elif src == target:
        out = stacked()
        if pin and out.device.type == "cpu" and torch.cuda.is_available():
            out = out.pin_memory()
    else:
        out = stacked().to(target)
    out = out.view(dtype) if dtype != torch.uint8 else out
    if fortran:
        out = out.reshape((rows,) + tuple(reversed(shape)))
        return out.permute(0, *[len(shape) - i for i in range(len(shape))])
    return out.reshape((rows,) + tuple(shape))


# CPU tensors up to this size cross processes (a worker's batch to the main process) as their
# bytes in the pickle: torch's own reduction sends each one as a shared-memory descriptor, which
# costs a socket connection with a challenge per tensor (~0.4 ms on the CPU test machine, more than
# a whole small batch's payload).
INLINE_TENSOR_BYTES = 256 << 10


class _InlineTensor:
    """A small CPU tensor pickled as its bytes (see INLINE_TENSOR_BYTES)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __reduce__(self) -> Any:
        t = self.t.contiguous()
        return (_rebuild_tensor, (t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"", str(t.dtype)[len("torch."):], tuple(t.shape)))


def _rebuild_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if not data:
        return torch.empty(shape, dtype=dt)
    # One tensor call for the common 1-D case (labels, ids): each releases and retakes the GIL.
    t = torch.frombuffer(bytearray(data), dtype=dt)
    return t if len(shape) == 1 and shape[0] == t.numel() else t.reshape(shape)


def _inlinable(v: Any) -> bool:
    return (type(v) is torch.Tensor and v.device.type == "cpu" and not v.requires_grad and v.layout == torch.strided
            and not v.is_quantized and not v.is_complex() and v.dtype != torch.bool and v.numel() * v.element_size() <= INLINE_TENSOR_BYTES)


def _pack(v: Any) -> Any:
    if _inlinable(v):
        return _InlineTensor(v)
    if type(v) is list and v and _inlinable(v[0]):
        return [_InlineTensor(x) if _inlinable(x) else x for x in v]
    return v


def _rebuild_batch(cls: "type[GDSBatch]", data: dict[str, Any], state: dict[str, Any]) -> "GDSBatch":
    b = cls.__new__(cls)
    b.__dict__.update(state)
    b.data = data
    return b


class GDSBatch:
    """A collated batch whose GPU fields are still in daemon memory.

    Dict-like (batch["field"], keys(), items()). pin_memory() (called by the
    DataLoader's pin-memory thread when pin_memory=True) and materialize()
    return a new GDSBatch of tensors, gathering each field with one copy and
    releasing the batch's leases with one request.
    """

    # A materialization whose release the loop's thread finishes (defer_release, _settle).
    _pending: "Optional[_Pending]" = None

    def __init__(self, data: dict[str, Any], *, gpu_fields: Sequence[str] = (), progress: Optional[dict[int, int]] = None,
                 epoch: int = 0, slots: int = 0, engines: Iterable[str] = ()) -> None:
        self.data = data
        self.gpu_fields = tuple(gpu_fields)
        # Engines that moved the gpu fields' bytes ("host", "posix", "gds",
        # ...); empty when every field was read with plain pread.
        self.engines = frozenset(engines)
        # Resume bookkeeping: samples handed out per (rank, worker) slot
        # after this batch, the epoch and the number of slots.
        self.progress = dict(progress or {})
        self.epoch = epoch
        self.slots = slots

    def __reduce__(self) -> Any:
        # Pickled by a DataLoader worker for the main process: small CPU tensors as bytes.
        self._settle()  # a copy of bytes not yet checked never leaves
        state = {k: v for k, v in self.__dict__.items() if k not in ("data", "_pending")}
        return (_rebuild_batch, (type(self), {k: _pack(v) for k, v in self.data.items()}, state))

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
        return [r for v in self.data.values() if isinstance(v, _RefColumn) for r in v.leases]

    def _holds(self) -> list[_leases.Hold]:
        return [h for v in self.data.values() if isinstance(v, _RefColumn) for h in v.holds if h is not None]

    def release(self) -> None:
        """Give the batch's leases back without materializing (idempotent)."""
        _leases.release(self._holds(), check_held=False)

    def _settle(self) -> None:
        """Finish a materialization whose release was deferred (defer_release): wait for the
        copies, release the leases and check the daemon's answer (GDSLeaseError: the bytes
        copied cannot be trusted). A no-op otherwise; idempotent."""
        p = self._pending
        if p is not None:
            self._pending = None
            p.settle()

    def materialize(self, device: Device = None, *, pin: bool = False, _defer: bool = False, _parsed: bool = False,
                    _record: bool = True) -> "GDSBatch":
        """Tensors for every field (gpu fields on device, default: where
        the daemon put them), then release the leases.

        Args:
            device: target device for gpu fields.
            pin: also pin CPU tensors (what pin_memory does).

        Raises:
            GDSLeaseError: a lease of the batch is not held any more
                (materialized before, released, or its session ended); no
                batch is returned.
        """
        holds = self._holds()
        _leases.check(holds)
        out: dict[str, Any] = {}
        # _parsed: settled() parsed the device once per iteration.
        tgt: Optional[torch.device] = device if _parsed and not isinstance(device, (int, str)) else _target_device(device)
        if tgt is None and pin and torch.cuda.is_available():
            # The pin-memory thread: gpu fields go to the current GPU, also
            # from host-memory slabs and plain-read fallbacks.
            tgt = torch.device("cuda", torch.cuda.current_device())
        for k, v in self.data.items():
            if isinstance(v, _RefColumn):
                out[k] = _gather(v, tgt, pin=pin, parsed=True)
            else:
                out[k] = _plain_field(k, v, self.gpu_fields, tgt, pin)
        done = GDSBatch(out, gpu_fields=self.gpu_fields, progress=self.progress, epoch=self.epoch, slots=self.slots, engines=self.engines)
        if _defer:
            # The loop's thread settles it (_settle) before anyone sees it.
            done._pending = _Pending(holds, record=_record)
            return done
        # The copies are done (waited for): release, and trust them only if
        # the daemon still held every lease.
        _sync_and_release(holds)
        return done

    def pin_memory(self, device: Device = None) -> "GDSBatch":
        """What DataLoader(pin_memory=True) calls in its pin-memory thread:
        gpu fields become CUDA tensors on device (default: the current GPU;
        CPU tensors where there is no GPU), other tensors are pinned."""
        return self.materialize(device, pin=True, _defer=_defers_release())

    def to(self, device: Device, non_blocking: bool = False) -> "GDSBatch":
        """Materialize, then move every tensor to device."""
        b = self.materialize(device, pin=non_blocking)
        d = _target_device(device)
        data = {k: (v.to(d, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v) for k, v in b.data.items()}
        return GDSBatch(data, gpu_fields=self.gpu_fields, progress=self.progress, epoch=self.epoch, slots=self.slots, engines=self.engines)


def _plain_field(k: str, v: Any, gpu_fields: Sequence[str], tgt: Optional[torch.device], pin: bool) -> Any:
    """A materialized batch's field k from v, not in daemon memory: a gpu field's tensor moved to
    tgt, with pin other tensors pinned, anything else as it is."""
    if k in gpu_fields and isinstance(v, torch.Tensor):
        if tgt is not None and tgt != v.device:
            src = v.pin_memory() if pin and tgt.type == "cuda" else v
            return src.to(tgt, non_blocking=pin)
        return v
    if pin and isinstance(v, torch.Tensor) and torch.cuda.is_available():
        return v.pin_memory()
    return v


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
    engines = {r.engine for v in data.values() if isinstance(v, _RefColumn) for r in v.leases if r.lease}
    return GDSBatch(data, gpu_fields=sorted(gpu_fields), progress=progress, epoch=epoch, slots=slots, engines=sorted(engines))


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
