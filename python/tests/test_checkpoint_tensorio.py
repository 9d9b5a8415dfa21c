"""gdsfs._ckpt.tensorio.DaemonMover against an in-process session with a small, strict pool.

The fake session keeps the protocol's rules that matter to the mover (docs/protocol.md): a range
longer than max_lease is refused, the pool is finite (a full pool raises EAGAIN at once when
timeout=0, as the core does after its wait), leases must be released, and a WRITE may not run past
its lease. This pins down batching, splitting and the EAGAIN back-off without a daemon; the mount
tests cover the real one.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass

import pytest
import torch

from gdsfs import GDSUnavailableError
from gdsfs._ckpt import tensorio


@dataclass(frozen=True)
class FakeRef:
    lease: int
    slab: int
    offset: int
    length: int
    valid: int
    device: int = -1
    engine: str = "fake"


class FakeSession:
    host_mode = True

    def __init__(self, pool_bytes: int, max_lease: int) -> None:
        self.max_lease = max_lease
        self.pool = bytearray(pool_bytes)
        self.free = [(0, pool_bytes)]
        self.leases: dict[int, tuple[int, int]] = {}
        self.next_id = 1
        self.reads = 0
        self.eagain = 0
        self.max_live = 0
        self.lock = threading.RLock()  # the mover reads from helper threads

    def _take(self, n: int, timeout: float | None) -> int:
        for i, (off, size) in enumerate(self.free):
            if size >= n:
                self.free[i] = (off + n, size - n)
                return off
        self.eagain += 1
        raise GDSUnavailableError("pool full", errno=errno.EAGAIN)

    def read(self, fd, ranges, *, device=None, timeout=None):
        with self.lock:
            return self._read(fd, ranges, timeout)

    def _read(self, fd, ranges, timeout):
        self.reads += 1
        need = sum(n for _, n in ranges)
        if sum(s for _, s in self.free) < need or not any(s >= need for _, s in self.free):
            self.eagain += 1
            raise GDSUnavailableError("pool full", errno=errno.EAGAIN)
        refs = []
        for off, n in ranges:
            assert n <= self.max_lease, "range longer than one lease"
            at = self._take(n, timeout)
            data = os.pread(fd, n, off)
            self.pool[at : at + len(data)] = data
            lid = self.next_id
            self.next_id += 1
            self.leases[lid] = (at, n)
            refs.append(FakeRef(lid, 1, at, n, len(data)))
        self.max_live = max(self.max_live, sum(n for _, n in self.leases.values()))
        return refs

    def alloc(self, n, *, device=None, timeout=None):
        with self.lock:
            return self._alloc(n, timeout)

    def _alloc(self, n, timeout):
        assert n <= self.max_lease
        at = self._take(n, timeout)
        lid = self.next_id
        self.next_id += 1
        self.leases[lid] = (at, n)
        return FakeRef(lid, 1, at, n, n)

    def write(self, fd, ref, offset, nbytes=None):
        at, n = self.leases[ref.lease]
        k = n if nbytes is None else nbytes
        assert k <= n, "write past the lease"
        return os.pwrite(fd, bytes(self.pool[at : at + k]), offset)

    def release(self, refs):
        with self.lock:
            self._release(refs)

    def _release(self, refs):
        for r in refs:
            at, n = self.leases.pop(r.lease)
            self.free.append((at, n))
        # Coalesce so freed space is usable as one block again.
        self.free.sort()
        merged = []
        for off, size in self.free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            elif size:
                merged.append((off, size))
        self.free = merged

    def host_buffer(self, ref):
        at, _ = self.leases[ref.lease]
        return memoryview(self.pool)[at : at + ref.valid]


@pytest.mark.parametrize(
    "pool,max_lease,piece,batch",
    [
        (1 << 20, 1 << 20, 256 << 20, 1 << 30),   # defaults: everything fits in one request
        (256 << 10, 64 << 10, 256 << 20, 1 << 30),  # pieces cut to max_lease; batches shrink on EAGAIN
        (96 << 10, 32 << 10, 16 << 10, 64 << 10),   # double-buffered batches barely fit
    ],
)
def test_read_into_and_write_from(tmp_path, monkeypatch, pool, max_lease, piece, batch):
    monkeypatch.setattr(tensorio, "PIECE_BYTES", piece)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", batch)
    g = torch.Generator().manual_seed(0)
    sizes = [0, 1, 4095, 4096, 70000, 150000, 33]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    offs, pos = [], 0
    for n in sizes:
        offs.append(pos)
        pos += n + 123  # unaligned, with gaps
    p = tmp_path / "f.bin"
    sess = FakeSession(pool, max_lease)
    with open(p, "wb+") as f:
        tensorio.DaemonMover(sess).write_from(f.fileno(), list(zip(offs, srcs)))
        assert not sess.leases, "write leases not released"
        raw = open(p, "rb").read()
        for o, t in zip(offs, srcs):
            assert raw[o : o + t.numel()] == t.cpu().numpy().tobytes()
        dests = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        tensorio.DaemonMover(sess).read_into(f.fileno(), list(zip(offs, dests)))
    assert not sess.leases, "read leases not released"
    assert sess.max_live <= pool
    for s, d in zip(srcs, dests):
        assert torch.equal(s, d)


def test_pool_too_small_for_one_piece_raises(tmp_path):
    sess = FakeSession(1 << 10, 4 << 10)
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 8192)
    with open(p, "rb") as f, pytest.raises(GDSUnavailableError):
        tensorio.DaemonMover(sess).read_into(f.fileno(), [(0, torch.empty(4096, dtype=torch.uint8))])
    assert not sess.leases


def test_short_file_is_eof(tmp_path):
    sess = FakeSession(1 << 20, 1 << 20)
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 100)
    with open(p, "rb") as f, pytest.raises(EOFError):
        tensorio.DaemonMover(sess).read_into(f.fileno(), [(50, torch.empty(100, dtype=torch.uint8))])
    assert not sess.leases


def test_transfer_falls_back_when_the_daemon_fails(tmp_path, monkeypatch):
    """A daemon failure part way: the whole transfer is redone with plain I/O, after the warning."""
    from gdsfs import GDSFallbackWarning
    from gdsfs._errors import _reset_fallback_warning

    class Broken(FakeSession):
        def read(self, *a, **k):
            raise GDSUnavailableError("EIO", errno=errno.EIO)

        def close(self):
            pass

    monkeypatch.setattr(tensorio, "open_mover", lambda path, strict=False: tensorio._SessionMover(Broken(1 << 20, 1 << 20)))
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)))
    d = torch.empty(16, dtype=torch.uint8)
    _reset_fallback_warning()
    with open(p, "rb") as f:
        with pytest.warns(GDSFallbackWarning):
            assert tensorio.transfer(str(p), f.fileno(), [(16, d)], write=False) == "posix-client"
        assert torch.equal(d, torch.arange(16, 32, dtype=torch.uint8))
        with pytest.raises(GDSUnavailableError):
            tensorio.transfer(str(p), f.fileno(), [(16, d)], write=False, strict=True)


@pytest.fixture(scope="module")
def small_pool_mount(tmp_path_factory, gdsfs_bin):
    """A host-mode mount whose whole pool (48 MiB) is smaller than the checkpoints below."""
    from conftest import mount, unmount

    base = tmp_path_factory.mktemp("smallpool")
    (base / "src").mkdir()
    (base / "mnt").mkdir()
    m = mount(gdsfs_bin, str(base / "src"), str(base / "mnt"), str(base / "daemon.log"),
              "--host-pool", "48MiB", "--slab-size", "16MiB")
    try:
        yield m
    finally:
        unmount(gdsfs_bin, m.mnt)


@pytest.mark.parametrize("kind", ["safetensors", "checkpoint"])
def test_checkpoints_larger_than_the_pool(small_pool_mount, kind):
    """100 MiB through a 48 MiB pool: pieces, batches and write leases must fit, nothing may wait
    for memory it holds itself, and every lease comes back."""
    import warnings

    import gdsfs.checkpoint as gck
    import gdsfs.safetensors as gst
    from gdsfs import GDSFallbackWarning

    g = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(5 << 20, generator=g) for i in range(5)}  # 5 x 20 MiB
    p = small_pool_mount.path(f"big.{kind}")
    before = small_pool_mount.stats()["counters"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        if kind == "safetensors":
            gst.save_file(sd, p)
            got = gst.load_file(p, device="cpu")
        else:
            gck.save(sd, p)
            got = gck.load(p)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    after = small_pool_mount.stats()["counters"]
    assert after["write_bytes"] - before["write_bytes"] >= 100 << 20
    assert after["read_bytes"] - before["read_bytes"] >= 100 << 20
    assert small_pool_mount.wait_leases(0) == 0


def test_storage_errors_are_not_fallbacks(tmp_path, monkeypatch):
    """ENOSPC from the daemon's WRITE is the user's disk, not a daemon failure: an OSError, no retry."""

    class Full(FakeSession):
        def write(self, *a, **k):
            raise GDSUnavailableError("WRITE failed: ENOSPC", errno=errno.ENOSPC)

        def close(self):
            pass

    monkeypatch.setattr(tensorio, "open_mover", lambda path, strict=False: tensorio._SessionMover(Full(1 << 20, 1 << 20)))
    p = tmp_path / "f.bin"
    with open(p, "wb") as f, pytest.raises(OSError) as ei:
        tensorio.transfer(str(p), f.fileno(), [(0, torch.ones(10, dtype=torch.uint8))], write=True)
    assert ei.value.errno == errno.ENOSPC and not isinstance(ei.value, GDSUnavailableError)
    assert os.path.getsize(p) == 0, "the write was retried with plain I/O"


def _flush_case(tmp_path, monkeypatch, fail: bool):
    """write_from(flush_every=...) against the fake session, os.fdatasync recorded (or failing)."""
    synced: list[int] = []
    real = os.fdatasync

    def fdatasync(fd):
        synced.append(fd)
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(tensorio.os, "fdatasync", fdatasync)
    srcs = [torch.full((64 << 10,), i, dtype=torch.uint8) for i in range(16)]
    items = [(i * (64 << 10), t) for i, t in enumerate(srcs)]
    sess = FakeSession(1 << 20, 1 << 20)
    p = tmp_path / "f.bin"
    with open(p, "wb+") as f:
        tensorio.DaemonMover(sess).write_from(f.fileno(), items, flush_every=128 << 10)
        return synced, f.fileno(), sess, open(p, "rb").read(), srcs


def test_durable_writes_start_writeback_as_they_go(tmp_path, monkeypatch):
    synced, fd, sess, raw, srcs = _flush_case(tmp_path, monkeypatch, fail=False)
    # 1 MiB written, a flush wanted every 128 KiB: several ran (requests during one coalesce).
    assert synced and set(synced) == {fd}
    assert not sess.leases
    assert raw == b"".join(t.cpu().numpy().tobytes() for t in srcs)


def test_a_failed_writeback_is_raised(tmp_path, monkeypatch):
    # fdatasync reports a writeback error once per descriptor: swallowing it here would leave the
    # caller's final fsync silent about lost data.
    with pytest.raises(OSError) as e:
        _flush_case(tmp_path, monkeypatch, fail=True)
    assert e.value.errno == errno.EIO


def test_read_pieces_fit_a_slab_once_widened(tmp_path):
    """The daemon widens every range to 4 KiB: a piece of a whole slab at an unaligned offset (a
    safetensors tensor) would need a slab of its own, allocated and mapped anew for every lease."""
    slab = 1 << 20

    class SlabSession(FakeSession):
        ranges: list = []

        def status(self):
            return {"pool": {"slab_bytes": slab}}

        def read(self, fd, ranges, **k):
            self.ranges.extend(ranges)
            return super().read(fd, ranges, **k)

    sess = SlabSession(16 << 20, 64 << 20)
    p = tmp_path / "f.bin"
    data = os.urandom(3 * slab + 500)
    p.write_bytes(data)
    dest = torch.empty(3 * slab, dtype=torch.uint8)
    with open(p, "rb") as f:
        tensorio.DaemonMover(sess).read_into(f.fileno(), [(100, dest)])
    assert bytes(dest.numpy()) == data[100 : 100 + 3 * slab]
    align = 4096
    for off, n in sess.ranges:
        widened = -(-(off + n) // align) * align - off // align * align
        assert widened <= slab, f"range ({off}, {n}) widens to {widened} bytes, more than a {slab}-byte slab"


class GatedSession(FakeSession):
    """Counts READs in flight at once; READ number ``fail_at`` (1-based) raises ``fail``."""

    def __init__(self, pool_bytes, max_lease, fail_at=0, fail=None):
        super().__init__(pool_bytes, max_lease)
        self.fail_at, self.fail = fail_at, fail
        self.calls = 0
        self.inflight = 0
        self.max_inflight = 0
        self.both = threading.Barrier(2, timeout=5)

    def read(self, fd, ranges, **k):
        with self.lock:
            self.calls += 1
            call = self.calls
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            if call <= 2:
                self.both.wait()  # the first two READs must be in flight together
            if call == self.fail_at:
                raise self.fail
            return super().read(fd, ranges, **k)
        finally:
            with self.lock:
                self.inflight -= 1


def _pieces_file(tmp_path, n_pieces, piece):
    data = os.urandom(n_pieces * piece + 777)
    p = tmp_path / "f.bin"
    p.write_bytes(data)
    return p, data


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_reads_in_flight_keep_order(tmp_path, monkeypatch, depth):
    """READ_DEPTH READs at once: every destination gets its own bytes, every lease comes back, and
    what is held stays inside the pool."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", depth)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", 48 << 10)
    sess = (GatedSession if depth > 1 else FakeSession)(1 << 20, 1 << 20)
    p, data = _pieces_file(tmp_path, 40, 16 << 10)
    offs = [13 + i * (16 << 10) for i in range(40)]
    dests = [torch.empty((16 << 10) - (i % 3), dtype=torch.uint8) for i in range(40)]
    with open(p, "rb") as f:
        tensorio.DaemonMover(sess).read_into(f.fileno(), list(zip(offs, dests)))
    for o, d in zip(offs, dests):
        assert bytes(d.numpy()) == data[o : o + d.numel()]
    assert not sess.leases
    assert sess.reads > depth
    if depth > 1:
        assert 2 <= sess.max_inflight <= depth, f"{sess.max_inflight} READs in flight at once, want 2..{depth}"


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_reads_in_flight_release_leases_on_error(tmp_path, monkeypatch, fail_at):
    """A READ failing while others are in flight: the error reaches the caller and no lease stays
    held (those of READs still running are released when they finish)."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", 32 << 10)
    sess = GatedSession(1 << 20, 1 << 20, fail_at=fail_at, fail=GDSUnavailableError("EIO", errno=errno.EIO))
    p, _ = _pieces_file(tmp_path, 12, 16 << 10)
    items = [(i * (16 << 10), torch.empty(16 << 10, dtype=torch.uint8)) for i in range(12)]
    with open(p, "rb") as f, pytest.raises(GDSUnavailableError):
        tensorio.DaemonMover(sess).read_into(f.fileno(), items)
    assert not sess.leases


def test_reads_in_flight_fall_back_on_a_full_pool(tmp_path, monkeypatch):
    """EAGAIN from a READ in flight: the pipeline stops, and the one-at-a-time path (which waits or
    shrinks its batches) finishes the job, bytes exact, every lease back."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", 32 << 10)
    sess = GatedSession(1 << 20, 1 << 20, fail_at=4, fail=GDSUnavailableError("pool full", errno=errno.EAGAIN))
    p, data = _pieces_file(tmp_path, 12, 16 << 10)
    dests = [torch.empty(16 << 10, dtype=torch.uint8) for _ in range(12)]
    with open(p, "rb") as f:
        tensorio.DaemonMover(sess).read_into(f.fileno(), [(i * (16 << 10), d) for i, d in enumerate(dests)])
    for i, d in enumerate(dests):
        assert bytes(d.numpy()) == data[i * (16 << 10) : (i + 1) * (16 << 10)]
    assert not sess.leases
    assert sess.calls > 4, "the rest was not read after the EAGAIN"
