"""Moving tensor bytes between a file and tensors: through the daemon, or with plain I/O.

A :class:`Mover` has two jobs, both positional (offsets given, so order does not matter):

- ``read_into(fd, items)``: fill each destination tensor from its file offset;
- ``write_from(fd, items)``: write each source tensor's bytes at its file offset.

Items are ``(file_offset, tensor)`` with ``tensor`` a flat, contiguous ``uint8`` tensor on any
device (see :func:`byte_view`). :class:`DaemonMover` batches every item of a call into as few
daemon requests as the pool allows (ranges longer than a lease are split, batches shrink on
EAGAIN), copies each lease into its destination with one device-to-device (or host) copy and
releases the leases. :class:`PosixMover` is the stock path: ``preadv``/``pwrite`` through host
memory, used off gdsfs and when the daemon cannot serve.
"""

from __future__ import annotations

import errno as _errno
import os
import threading
from typing import Any, Protocol, Sequence

import torch

from gdsfs import _leases
from gdsfs import _protocol as proto
from gdsfs._core import Ref, Session
from gdsfs._errors import GDSUnavailableError

# Largest piece one lease carries; longer ranges are split. The daemon's slab size and a quarter
# of its max_lease cap it further (DaemonMover.__init__).
PIECE_BYTES = 256 << 20
# Bytes of one read batch (one daemon request of up to max_ranges ranges). Two batches are in
# flight: the copies out of one overlap the daemon filling the next.
BATCH_BYTES = 1 << 30
# READs in flight at once while the pool has room (each from a helper thread; the ioctl releases the
# GIL): the daemon fills the next batch while this process copies out of the last and releases it,
# so it never waits on the copies, the releases or Python (GPU run 1: one READ at a time loaded
# 17.8 GB/s from the memory tier, gdsfs read of the same file 44.8). 1: one at a time.
READ_DEPTH = 2
# Buffer size for the small (header, pickle) reads of checkpoint files. Given explicitly so that
# open() skips its isatty() probe, an ioctl the daemon would otherwise see (and count) on every open.
BUFFER = 1 << 16
# The daemon's default slab size (gpubuf.DefaultSlabBytes), used when its status does not say.
DEFAULT_SLAB_BYTES = 64 << 20
# The daemon's alignment: lease and piece sizes are multiples of it.
ALIGN = 4096
# Writer threads (each with its own lease) per device in one write_from call.
WRITE_THREADS = 4
# Host staging for the plain path (CUDA destinations go through it in chunks).
STAGING_BYTES = 64 << 20
# A durable save starts the file's writeback (fdatasync from a helper thread) every time this many
# more bytes were written: the daemon's buffered writes land in the page cache, and without it the
# whole file waits for the final fsync, the disk idle while the cache fills and the copies idle
# while the disk drains. With it the disk writes while later leases are filled.
FLUSH_BYTES = 512 << 20


def untyped_storage(t: torch.Tensor) -> Any:
    """The untyped storage under ``t`` (torch 1.13 and 2.x spell it differently)."""
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage()
    return t.storage().untyped()


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of the bytes of the contiguous tensor ``t`` (no copy)."""
    if not t.is_contiguous():
        raise ValueError("gdsfs: byte_view needs a contiguous tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return torch.empty((0,), dtype=torch.uint8, device=t.device)
    return storage_bytes(untyped_storage(t), t.storage_offset() * t.element_size(), n)


def storage_bytes(storage: Any, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``nbytes`` bytes of an untyped storage from ``offset``."""
    if nbytes is None:
        nbytes = storage.nbytes() - offset
    out = torch.empty((0,), dtype=torch.uint8, device=storage.device)
    if nbytes == 0:
        return out
    return out.set_(storage, offset, (nbytes,), (1,))


class Mover(Protocol):
    """Moves bytes between one open file and tensors. Not safe for concurrent calls."""

    engine: str

    def read_into(self, fd: int, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Fill every ``(file_offset, dest)``; short files raise EOFError."""

    def write_from(self, fd: int, items: Sequence[tuple[int, torch.Tensor]], *, flush_every: int = 0) -> None:
        """Write every ``(file_offset, src)``; ``flush_every`` > 0: start writeback (fdatasync)
        each time that many more bytes were written (the caller still fsyncs at the end)."""


class PosixMover:
    """Plain ``preadv``/``pwrite`` through host memory: the path off gdsfs."""

    engine = "posix-client"

    def read_into(self, fd: int, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        staging: torch.Tensor | None = None
        for off, dest in items:
            n = dest.numel()
            if n == 0:
                continue
            if dest.device.type == "cpu":
                _pread_full(fd, memoryview(dest.numpy()), off)
                continue
            if staging is None:
                staging = torch.empty((min(STAGING_BYTES, n),), dtype=torch.uint8)
                if torch.cuda.is_available():
                    staging = staging.pin_memory()
            pos = 0
            while pos < n:
                k = min(staging.numel(), n - pos)
                _pread_full(fd, memoryview(staging[:k].numpy()), off + pos)
                dest[pos : pos + k].copy_(staging[:k])
                pos += k

    def write_from(self, fd: int, items: Sequence[tuple[int, torch.Tensor]], *, flush_every: int = 0) -> None:
        del flush_every  # plain writes from one thread: the caller's final fsync does it all
        for off, src in items:
            n = src.numel()
            pos = 0
            while pos < n:
                k = min(STAGING_BYTES, n - pos) if src.device.type != "cpu" else n - pos
                chunk = src[pos : pos + k]
                if chunk.device.type != "cpu":
                    chunk = chunk.cpu()
                _pwrite_full(fd, memoryview(chunk.numpy()), off + pos)
                pos += k


def _pread_full(fd: int, buf: memoryview, off: int) -> None:
    pos = 0
    while pos < len(buf):
        got = os.preadv(fd, [buf[pos:]], off + pos)
        if got == 0:
            raise EOFError(f"gdsfs: file ends at {off + pos}, {len(buf) - pos} bytes short of a tensor")
        pos += got


def _pwrite_full(fd: int, buf: memoryview, off: int) -> None:
    pos = 0
    while pos < len(buf):
        pos += os.pwrite(fd, buf[pos:], off + pos)


class DaemonMover:
    """Batched reads and leased writes through a gdsfs session (see gdsfs._core)."""

    def __init__(self, session: Any) -> None:
        self._s = session
        # max_lease is the most one lease may hold: the pool of a device, at most. Keep what one
        # call holds well inside it: pieces of a quarter, read batches of a third (two in flight),
        # write leases of half in all. A READ asking for more than the whole pool would be split
        # by the core, and a split READ is no longer all-or-nothing.
        cap = int(getattr(session, "max_lease", 0) or 0) or PIECE_BYTES * 8
        # A lease larger than one slab gets a slab of its own, allocated for it and freed with
        # it (and mapped anew by this process every time): keep pieces within a regular slab.
        # The daemon widens each range to 4 KiB (one page more at an unaligned offset, as
        # safetensors tensors are): a piece of slab - ALIGN bytes still fits one slab.
        slab = slab_bytes(session)
        self._piece = max(ALIGN, min(PIECE_BYTES, slab - ALIGN, cap // 4) // ALIGN * ALIGN)
        self._batch = max(self._piece, min(BATCH_BYTES, cap // 3))
        # Pipelined reads hold READ_DEPTH batches in flight and one being copied out: together at
        # most half of max_lease, the rest left to other sessions.
        self._depth = max(1, READ_DEPTH)
        self._deep_batch = max(self._piece, min(BATCH_BYTES, cap // (2 * (self._depth + 1))) // ALIGN * ALIGN)
        self._write_lease = max(ALIGN, min(self._piece, cap // (2 * WRITE_THREADS)) // ALIGN * ALIGN)
        self._max_ranges = int(getattr(getattr(session, "hello", None), "max_ranges", 0) or 256)
        self.engine = "gdsfs"
        # The smallest aligned WRITE the daemon writes with O_DIRECT (None: none), asked once.
        self._direct_min: int | None = None
        self._direct_known = False

    def lease_view(self, ref: Any, n: int) -> torch.Tensor:
        """A uint8 tensor over the first ``n`` bytes of a lease, without copying.

        The caller releases the lease; the view keeps its session from ending while it lives
        (gdsfs._leases.pin), so closing the session cannot free memory it names.
        """
        if ref.device == -1:
            # Host slab: the core maps it once per process; wrap the bytes in place.
            base = self._s.host_buffer(ref)
            if isinstance(ref, Ref):
                _leases.pin(ref, base)
            return torch.frombuffer(base, dtype=torch.uint8)[:n]
        from gdsfs import _tensors  # CUDA slabs: IPC mapping lives there

        return _tensors.tensor_from_ref(ref, torch.uint8, (ref.valid,), copy=False, session=self._s)[:n]

    def device_for(self, t: torch.Tensor) -> int | None:
        """The daemon device whose slabs should hold bytes for ``t`` (None: the session's default).

        CUDA tensors want slabs on their own GPU, CPU tensors host slabs. In host mode (no GPU in
        the daemon) everything is host memory, the session's default.
        """
        if getattr(self._s, "host_mode", True):
            return None
        if t.device.type == "cuda":
            return t.device.index if t.device.index is not None else torch.cuda.current_device()
        hello = getattr(self._s, "hello", None)
        if hello is not None and int(hello.caps) & proto.CAP_HOST_SLABS:
            return proto.DEVICE_HOST
        return None

    def _pieces(self, items: Sequence[tuple[int, torch.Tensor]], size: int = 0) -> list[tuple[int, torch.Tensor]]:
        size = size or self._piece
        out = []
        for off, t in items:
            n = t.numel()
            for pos in range(0, n, size):
                out.append((off + pos, t[pos : pos + size]))
        return out

    def read_into(self, fd: int, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        pieces = self._pieces(items)
        # Group by target device: one request names one device.
        by_dev: dict[int | None, list[tuple[int, torch.Tensor]]] = {}
        for p in pieces:
            by_dev.setdefault(self.device_for(p[1]), []).append(p)
        streams = _CopyStreams()
        try:
            for dev, group in by_dev.items():
                self._read_group(fd, dev, group, streams)
        finally:
            streams.close()

    def _batches(self, pieces: list[tuple[int, torch.Tensor]], budget: int) -> list[list[tuple[int, torch.Tensor]]]:
        """Consecutive pieces cut into requests of at most ``budget`` bytes and max_ranges ranges."""
        out: list[list[tuple[int, torch.Tensor]]] = []
        size = 0
        for off, t in pieces:
            if not out or len(out[-1]) >= self._max_ranges or size + t.numel() > budget:
                out.append([])
                size = 0
            out[-1].append((off, t))
            size += t.numel()
        return out

    def _read_pipelined(self, fd: int, dev: int | None, pieces: list[tuple[int, torch.Tensor]],
                        streams: "_CopyStreams") -> int:
        """Read ``pieces`` with up to READ_DEPTH READs in flight, copying each batch out (in order)
        while the next ones are read. Returns how many leading pieces are done: all of them, or,
        when the pool ran full (EAGAIN), those before the batch it refused, for the one-at-a-time
        path to finish. Every lease is released before it returns or raises."""
        from concurrent.futures import Future, ThreadPoolExecutor

        batches = self._batches(pieces, self._deep_batch)
        starts = [0]
        for b in batches:
            starts.append(starts[-1] + len(b))
        inflight: list[tuple[int, Future]] = []
        pending = _Copies([])  # the batch whose copies may still be running
        ex = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="gdsfs-read")

        def submit(k: int) -> None:
            ranges = [(off, t.numel()) for off, t in batches[k]]
            # timeout=0: a full pool answers EAGAIN at once rather than wait on memory we hold.
            inflight.append((k, ex.submit(self._read_mapped, fd, ranges, dev)))

        nxt = 0
        try:
            while nxt < len(batches) and len(inflight) < self._depth:
                submit(nxt)
                nxt += 1
            while inflight:
                k, fut = inflight.pop(0)
                try:
                    refs = fut.result()
                except GDSUnavailableError as e:
                    if e.errno != _errno.EAGAIN:
                        raise
                    return starts[k]  # the finally below releases what later READs got
                done, pending = pending, _Copies(list(refs))
                self._finish(done)  # raising, it leaves refs to the finally below, not done again
                if nxt < len(batches):
                    submit(nxt)
                    nxt += 1
                self._copy_out(pending, batches[k], streams)
            return len(pieces)
        finally:
            try:
                self._finish(pending)
            finally:
                # READs still in flight (an error, or EAGAIN, stopped us): wait, release their leases.
                for _, fut in inflight:
                    try:
                        refs = fut.result()
                    except BaseException:  # noqa: BLE001 - the first error is already on its way
                        continue
                    self._release_quietly(refs)
                ex.shutdown(wait=True)

    def _read_mapped(self, fd: int, ranges: list[tuple[int, int]], dev: int | None) -> list[Any]:
        """One READ of the pipeline (in a helper thread), then the mapping of the CUDA slabs its
        leases landed in that this process has not mapped yet: a process's first load imports
        its slabs here, beside the copy-out of the previous batch, not in front of it (GPU run:
        1.5 ms an import). A mapping that fails is left for the copy-out to report."""
        # timeout=0: a full pool answers EAGAIN at once rather than wait on memory we hold.
        refs = self._s.read(fd, ranges, device=dev, timeout=0)
        if isinstance(self._s, Session):
            try:
                from gdsfs import _tensors

                for slab in dict.fromkeys(int(r.slab) for r in refs if int(r.device) >= 0 and r.lease):
                    _tensors._slab_tensor(self._s, slab)
            except Exception:  # noqa: BLE001 - lease_view maps again and raises what it meets
                pass
        return refs

    def _copy_out(self, copies: "_Copies", batch: list[tuple[int, torch.Tensor]], streams: "_CopyStreams") -> None:
        """Start the copies of a READ's leases into their tensors (asynchronous: each GPU's on a
        side stream of this call, an event recorded after them in ``copies``; _finish waits)."""
        touched: dict[int, Any] = {}
        try:
            for ref, (off, t) in zip(copies.refs, batch):
                n = t.numel()
                if n == 0:
                    continue
                if int(ref.valid) < n:
                    raise EOFError(f"gdsfs: file ends inside the tensor bytes at offset {off} (+{n})")
                view = self.lease_view(ref, n)
                gpu = t.device.index if t.device.type == "cuda" else None
                if gpu is None and int(getattr(ref, "device", -1)) >= 0:
                    gpu = int(ref.device)  # a GPU slab into host memory: that GPU copies
                if gpu is None:
                    t.copy_(view)
                    continue
                stream = streams.get(gpu)
                touched[gpu] = stream
                with torch.cuda.stream(stream):
                    t.copy_(view, non_blocking=True)
        finally:
            # Even when a copy failed to start, those started are waited for before any release.
            for gpu, stream in touched.items():
                copies.events.append(streams.record(gpu, stream))

    def _release_quietly(self, refs: list[Any]) -> None:
        """Release leases nothing was copied out of (cleanup on an error path)."""
        live = [r for r in refs if int(getattr(r, "lease", 1) or 0) != 0]
        if live:
            try:
                self._s.release(live)
            except (OSError, GDSUnavailableError):
                pass  # the session's end releases them; the caller sees the first error

    def _read_group(self, fd: int, dev: int | None, pieces: list[tuple[int, torch.Tensor]],
                    streams: "_CopyStreams") -> None:
        if self._depth > 1 and len(self._batches(pieces, self._deep_batch)) > 1:
            done = self._read_pipelined(fd, dev, pieces, streams)
            if done == len(pieces):
                return
            pieces = pieces[done:]
        budget = self._batch
        pending = _Copies([])  # refs whose copies may still be running
        i = 0
        try:
            while i < len(pieces):
                batch: list[tuple[int, torch.Tensor]] = []
                size = 0
                while i + len(batch) < len(pieces) and len(batch) < self._max_ranges:
                    off, t = pieces[i + len(batch)]
                    if batch and size + t.numel() > budget:
                        break
                    batch.append((off, t))
                    size += t.numel()
                ranges = [(off, t.numel()) for off, t in batch]
                # Fail fast on a full pool while we hold the previous batch or could ask for less;
                # only a single-piece request waits for other sessions to free memory.
                alone = not pending.refs and budget <= self._piece
                try:
                    refs = self._s.read(fd, ranges, device=dev, **({} if alone else {"timeout": 0}))
                except GDSUnavailableError as e:
                    if e.errno != _errno.EAGAIN or alone:
                        raise
                    if pending.refs:  # free the previous batch, then retry at the same size
                        self._finish(pending)
                        pending = _Copies([])
                        continue
                    budget = max(self._piece, budget // 2)
                    continue
                self._finish(pending)
                pending = _Copies(list(refs))
                self._copy_out(pending, batch, streams)
                i += len(batch)
        finally:
            self._finish(pending)

    def _finish(self, copies: "_Copies") -> None:
        """Wait for the copies out of a batch's leases (its events: the host waits for those
        copies only, not for the rest of the GPU's work), then release the leases, checking the
        daemon's answer: a lease it no longer held (its session ended meanwhile) raises
        GDSLeaseError, since the bytes copied out of it cannot be trusted."""
        refs = copies.refs
        if not refs:
            return
        for ev in copies.events:
            ev.synchronize()
        live = [r for r in refs if int(getattr(r, "lease", 1) or 0) != 0]
        if live:
            if isinstance(self._s, Session):
                self._s.release(live, check=True)
            else:
                self._s.release(live)

    def write_from(self, fd: int, items: Sequence[tuple[int, torch.Tensor]], *, flush_every: int = 0) -> None:
        pieces = [p for p in self._pieces(items, self._write_lease) if p[1].numel() > 0]
        by_dev: dict[int | None, list[tuple[int, torch.Tensor]]] = {}
        for p in pieces:
            by_dev.setdefault(self.device_for(p[1]), []).append(p)
        for d in {t.device for _, t in pieces if t.device.type == "cuda"}:
            torch.cuda.current_stream(d).synchronize()  # the producers' work is done before we copy
        if flush_every > 0 and not self._direct_known:
            self._direct_min, self._direct_known = direct_write_min(self._s), True
        # Pieces the daemon writes with O_DIRECT leave nothing in the page cache to flush.
        cached = sum(t.numel() for off, t in pieces if not written_direct(off, t.numel(), self._direct_min))
        flusher = _Flusher(fd, flush_every) if flush_every > 0 and cached >= flush_every else None
        try:
            for dev, group in by_dev.items():
                self._write_group(fd, dev, group, flusher)
        finally:
            if flusher is not None:
                flusher.close()
        if flusher is not None and flusher.error is not None:
            raise flusher.error

    def _write_group(self, fd: int, dev: int | None, pieces: list[tuple[int, torch.Tensor]],
                     flusher: "_Flusher | None" = None) -> None:
        # Several leases, one writer thread each: the WRITE ioctl releases the GIL (its buffer is
        # small), so copies into one lease overlap the daemon writing another.
        size = min(self._write_lease, max(t.numel() for _, t in pieces))
        leases = [self._s.alloc(size, device=dev)]  # waits for room: we need at least one
        try:
            while len(leases) < min(WRITE_THREADS, len(pieces)):
                try:
                    leases.append(self._s.alloc(size, device=dev, timeout=0))
                except GDSUnavailableError as e:
                    if e.errno != _errno.EAGAIN:
                        raise
                    break
            # Map every lease here, not in the writer threads: slab mapping (CUDA IPC) is done
            # once per process and wants the thread that owns the CUDA context.
            views = [self.lease_view(ref, size) for ref in leases]
            streams = [torch.cuda.Stream(v.device) if v.device.type == "cuda" else None for v in views]
            work = list(reversed(pieces))
            lock = threading.Lock()
            errors: list[BaseException] = []

            def writer(k: int) -> None:
                ref, stream = leases[k], streams[k]
                try:
                    while True:
                        with lock:
                            if not work or errors:
                                return
                            off, t = work.pop()
                        n = t.numel()
                        view = views[k][:n]
                        if stream is not None:
                            with torch.cuda.stream(stream):
                                view.copy_(t, non_blocking=True)
                            stream.synchronize()
                        else:
                            view.copy_(t)
                        self._s.write(fd, ref, off, n)
                        if flusher is not None and not written_direct(off, n, self._direct_min):
                            flusher.wrote(n)
                except BaseException as e:  # handed to the caller below
                    with lock:
                        errors.append(e)

            threads = [threading.Thread(target=writer, args=(k,), daemon=True) for k in range(1, len(leases))]
            for th in threads:
                th.start()
            writer(0)
            for th in threads:
                th.join()
            if errors:
                raise errors[0]
        finally:
            self._s.release(leases)


class ReadPipeline:
    """READs of several files (or several calls' items) through one DaemonMover, in flight together.

    ``add(fd, items)`` cuts the items into batches (at least READ_DEPTH of them when the items
    allow) and starts READs at once, up to READ_DEPTH in flight, copying out those already done;
    ``drain()`` waits until every byte added so far is in its destination. So the READs of one
    file run while the caller decodes the next file's headers, and the READs of two files overlap
    (one read_into call per file reads them one after the other, each call starting and ending its
    own pipeline). Leases in flight stay within what ``read_into`` holds (its pipelined batches).

    On EAGAIN (a full pool) what is in flight is finished first, then the rest goes through
    read_into's one-at-a-time path (which waits or shrinks its batches). Any other error releases
    every lease before it reaches the caller (``close`` after a failed ``add``/``drain`` is safe).
    Not safe for concurrent calls.
    """

    def __init__(self, mover: "DaemonMover") -> None:
        self._m = mover
        self._depth = max(1, READ_DEPTH)
        self._queue: list[tuple[int, int | None, list[tuple[int, torch.Tensor]]]] = []  # (fd, dev, batch)
        self._inflight: list[tuple[int, int | None, list[tuple[int, torch.Tensor]], Any]] = []
        self._pending = _Copies([])  # the last batch copied out, whose copies may still run
        self._streams = _CopyStreams()
        self._ex: Any = None
        self._serial = False  # a READ saw EAGAIN: the rest goes one at a time

    def add(self, fd: int, items: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Queue the reads of ``items`` (``(file offset, uint8 dest)``) of ``fd`` and start them."""
        m = self._m
        # Destinations made since the side streams were (a resharded read's temporaries) were
        # allocated on the current stream: later copies wait for its work up to now, too.
        self._streams.resync()
        by_dev: dict[int | None, list[tuple[int, torch.Tensor]]] = {}
        for p in m._pieces(items):
            if p[1].numel() > 0:
                by_dev.setdefault(m.device_for(p[1]), []).append(p)
        for dev, pieces in by_dev.items():
            total = sum(t.numel() for _, t in pieces)
            # At least _depth READs for these items when they are large enough, so that one file
            # alone (a matched load) also has READs in flight together.
            size = min(m._deep_batch, max(m._piece, -(-total // self._depth)))
            self._queue.extend((fd, dev, b) for b in m._batches(pieces, size))
        self._pump(wait=False)

    def drain(self) -> None:
        """Wait until everything added is in its destination (visible to the caller's stream)."""
        self._pump(wait=True)
        self._m._finish(self._pending)
        self._pending = _Copies([])
        self._streams.close()

    def _submit(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if self._ex is None:
            self._ex = ThreadPoolExecutor(max_workers=self._depth, thread_name_prefix="gdsfs-read")
        fd, dev, batch = self._queue.pop(0)
        ranges = [(off, t.numel()) for off, t in batch]
        # timeout=0: a full pool answers EAGAIN at once rather than wait on memory we hold.
        self._inflight.append((fd, dev, batch, self._ex.submit(self._m._read_mapped, fd, ranges, dev)))

    def _fill(self) -> None:
        while self._queue and not self._serial and len(self._inflight) < self._depth:
            self._submit()

    def _pump(self, wait: bool) -> None:
        m = self._m
        while True:
            self._fill()
            if self._inflight and (wait or self._inflight[0][3].done()):
                fd, dev, batch, fut = self._inflight.pop(0)
                try:
                    refs = fut.result()
                except GDSUnavailableError as e:
                    if e.errno != _errno.EAGAIN:
                        raise
                    self._serial = True
                    self._queue.insert(0, (fd, dev, batch))
                    continue
                done, self._pending = self._pending, _Copies(list(refs))
                m._finish(done)  # raising, it leaves refs to close(), not done again
                self._fill()  # the next READ runs while this batch is copied out
                m._copy_out(self._pending, batch, self._streams)
                continue
            if self._serial and not self._inflight and self._queue and wait:
                # The pool ran full: finish one batch at a time, as read_into does after EAGAIN.
                m._finish(self._pending)
                self._pending = _Copies([])
                fd, dev, batch = self._queue.pop(0)
                m._read_group(fd, dev, batch, self._streams)
                continue
            return

    def close(self) -> None:
        """Release every lease still held (after an error) and stop the helper threads."""
        try:
            self._m._finish(self._pending)
        finally:
            self._pending = _Copies([])
            for _, _, _, fut in self._inflight:
                try:
                    refs = fut.result()
                except BaseException:  # noqa: BLE001 - the first error is already on its way
                    continue
                self._m._release_quietly(refs)
            self._inflight = []
            self._queue = []
            if self._ex is not None:
                self._ex.shutdown(wait=True)
                self._ex = None
            self._streams.close()


class _Copies:
    """A READ's leases and the events recorded after the copies out of them (one per GPU)."""

    __slots__ = ("refs", "events")

    def __init__(self, refs: list[Any]) -> None:
        self.refs = refs
        self.events: list[Any] = []


class _CopyStreams:
    """The side streams one read_into call copies out of slabs on, one per GPU.

    Each starts after the work queued on its GPU's current stream (the destinations were
    allocated, maybe last used, there) and, at close, that current stream waits for it, so the
    caller's later work sees the bytes. Copies on a stream of their own overlap the caller's work,
    and each batch is waited for by its event, not by a synchronize of the whole device.
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}

    def get(self, gpu: int) -> Any:
        s = self._streams.get(gpu)
        if s is None:
            s = torch.cuda.Stream(device=gpu)
            s.wait_stream(torch.cuda.current_stream(gpu))
            self._streams[gpu] = s
        return s

    def resync(self) -> None:
        """Have every side stream wait for the work queued on its GPU's current stream so far."""
        for gpu, s in self._streams.items():
            s.wait_stream(torch.cuda.current_stream(gpu))

    @staticmethod
    def record(gpu: int, stream: Any) -> Any:
        ev = torch.cuda.Event()
        with torch.cuda.device(gpu):
            ev.record(stream)
        return ev

    def close(self) -> None:
        for gpu, s in self._streams.items():
            torch.cuda.current_stream(gpu).wait_stream(s)
        self._streams = {}


class _Flusher:
    """Starts the writeback of a file being written as the bytes accumulate.

    One helper thread runs ``fdatasync`` whenever ``every`` more bytes were written since the last
    one began (a request arriving while one runs is served when it ends). fdatasync reports a
    writeback error once per descriptor, so its error is kept and raised by the writer: a failed
    intermediate flush must not leave the final fsync silent.
    """

    def __init__(self, fd: int, every: int) -> None:
        self._fd = fd
        self._every = every
        self._pending = 0
        self._cv = threading.Condition()
        self._want = False
        self._done = False
        self.error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="gdsfs-flush", daemon=True)
        self._thread.start()

    def wrote(self, n: int) -> None:
        with self._cv:
            self._pending += n
            if self._pending >= self._every:
                self._pending = 0
                self._want = True
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._want and not self._done:
                    self._cv.wait()
                if not self._want:
                    return
                self._want = False
            try:
                os.fdatasync(self._fd)
            except OSError as e:
                with self._cv:
                    if self.error is None:
                        self.error = e
                    self._done = True
                return

    def close(self) -> None:
        """Stop once the flush asked for last has run (its error, if any, is kept)."""
        with self._cv:
            self._done = True
            self._cv.notify()
        self._thread.join()


def slab_bytes(session: Any) -> int:
    """The daemon's regular slab size (from its status document), or its default.

    Asked once per daemon run in a process (it is fixed for the run): a STATUS opens the control
    file (a session of its own in the daemon) and pages the whole status document, for every
    load otherwise.
    """
    from gdsfs import _core

    hello = getattr(session, "hello", None)
    run = getattr(hello, "slab_socket", "") if hello is not None else ""
    key = (str(getattr(session, "mount", "")), int(getattr(hello, "daemon_pid", 0) or 0), run) if run else None
    if key is not None:
        n = _core._slabs.slab_sizes.get(key)
        if n:
            return n
    try:
        n = int(session.status()["pool"]["slab_bytes"])
    except (AttributeError, KeyError, TypeError, ValueError, OSError, GDSUnavailableError):
        return DEFAULT_SLAB_BYTES
    if n <= 0:
        return DEFAULT_SLAB_BYTES
    if key is not None:
        _core._slabs.slab_sizes[key] = n
    return n


def open_mover(path: str, *, strict: bool = False, device: int | None = None) -> Mover:
    """A DaemonMover when ``path`` is on a gdsfs mount that can serve, else a PosixMover.

    Off gdsfs (or when the daemon cannot serve) the core issues the one-time
    GDSFallbackWarning; ``strict=True`` raises GDSUnavailableError instead.
    """
    from gdsfs._core import Session

    s = Session.open(path, device=device, strict=strict)
    if s is None:
        return PosixMover()
    return _SessionMover(s)


class _SessionMover(DaemonMover):
    """A DaemonMover that owns its session and closes it."""

    def close(self) -> None:
        self._s.close()


def close_mover(m: Mover) -> None:
    """Release what a mover from :func:`open_mover` holds."""
    close = getattr(m, "close", None)
    if close is not None:
        close()


# Errors of the backing file system itself, passed through by WRITE (protocol section 4).
_STORAGE_ERRNOS = frozenset({_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG, _errno.EROFS})


def transfer(path: str, fd: int, items: Sequence[tuple[int, torch.Tensor]], *, write: bool, strict: bool = False,
             sync: bool = False) -> str:
    """Read into (or write from) every item of one operation, falling back to plain I/O.

    Opens a session for ``path`` (the file ``fd`` refers to), moves everything in one batched
    call, and closes the session. When the daemon cannot serve, part way included, the whole
    transfer is redone with plain I/O after the one-time GDSFallbackWarning (positional I/O makes
    the redo safe); ``strict=True`` raises GDSUnavailableError instead. ``sync=True`` (a write the
    caller will fsync) starts the file's writeback while it is written (FLUSH_BYTES).

    Returns:
        The engine that moved the bytes ("gdsfs" or "posix-client").
    """
    from gdsfs._errors import warn_fallback

    mover = open_mover(path, strict=strict)
    try:
        try:
            if write:
                mover.write_from(fd, items, flush_every=FLUSH_BYTES if sync else 0)
            else:
                mover.read_into(fd, items)
            return mover.engine
        except GDSUnavailableError as e:
            if e.errno in _STORAGE_ERRNOS:
                # The file system refused (full, quota, too big, read-only): plain writes would
                # hit the same wall. Say so as the OSError a plain write would raise.
                raise OSError(e.errno, f"gdsfs: writing {path!r}: {os.strerror(e.errno)}") from e
            if strict or isinstance(mover, PosixMover):
                raise
            warn_fallback(f"the daemon could not serve {path!r} ({e})", cause=f"transfer errno {e.errno}",
                          doing="using plain writes" if write else "using plain reads")
    finally:
        close_mover(mover)
    plain = PosixMover()
    if write:
        plain.write_from(fd, items)
    else:
        plain.read_into(fd, items)
    return plain.engine


def direct_write_min(session: Any) -> int | None:
    """The smallest 4 KiB-aligned WRITE the daemon writes around the page cache (O_DIRECT), from
    its status document; None when it does not say (an older daemon) or writes buffered."""
    try:
        n = int(session.status().get("direct_write_min_bytes") or 0)
    except (AttributeError, KeyError, TypeError, ValueError, OSError, GDSUnavailableError):
        return None
    return n if n > 0 else None


def written_direct(off: int, n: int, direct_min: int | None) -> bool:
    """Whether the daemon writes ``n`` bytes at file offset ``off`` around the page cache: the
    write starts 4 KiB-aligned and is at least ``direct_min`` (direct_write_min) bytes."""
    return direct_min is not None and off % ALIGN == 0 and n >= direct_min
