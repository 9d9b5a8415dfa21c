"""READs of a DCP load in flight across its data files (issue 14, part 2: resharded loads).

A checkpoint saved by 2 ranks has 2 data files; loading it on one rank (Shard(0) -> Replicate,
2 -> 1 ranks) read them one after the other before, each file's reads starting from an empty
pipeline and ending with an idle daemon (GPU run of 12-01 21:00: 2 -> 1 at 0.68x the matched
load of one file). Now every file's READs go through one tensorio.ReadPipeline: the READs of
the second file start while the first's are in flight. The pipeline itself is tested against
the in-process fake session of test_checkpoint_tensorio (pool rules, EAGAIN, errors); the load
against a live host-engine daemon, byte-equal to the stock reader.
"""

from __future__ import annotations

import errno
import threading
import warnings

import pytest
import torch

import _dcp_standin as S
from _ckpt_helpers import daemon_dir
from test_checkpoint_tensorio import FakeSession, GatedSession, _pieces_file

from gdsfs import GDSUnavailableError
from gdsfs._ckpt import tensorio

REAL = S.has_real_dcp()
if not REAL:
    S.install()
import gdsfs.dcp as gdcp  # noqa: E402  (after the stand-in is installed)

standin_only = pytest.mark.skipif(REAL, reason="the real torch.distributed.checkpoint is installed (dcp_check.py covers it)")


def _two_files(tmp_path, n_pieces, piece):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return _pieces_file(tmp_path / "a", n_pieces, piece), _pieces_file(tmp_path / "b", n_pieces, piece)


def test_pipeline_reads_of_two_files_are_in_flight_together(tmp_path, monkeypatch):
    """One batch per file (what a 512 MiB data file is with a large pool): the second file's READ
    starts before the first's ends (read_into per file: one at a time), and every byte lands."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 64 << 10)
    sess = GatedSession(1 << 20, 1 << 20)
    (pa, da), (pb, db) = _two_files(tmp_path, 1, 32 << 10)
    dests = [torch.empty(32 << 10, dtype=torch.uint8) for _ in range(2)]
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        try:
            pipe.add(fa.fileno(), [(0, dests[0])])
            pipe.add(fb.fileno(), [(0, dests[1])])
            pipe.drain()
        finally:
            pipe.close()
    assert bytes(dests[0].numpy()) == da[: 32 << 10] and bytes(dests[1].numpy()) == db[: 32 << 10]
    assert sess.max_inflight == 2, f"{sess.max_inflight} READ(s) in flight at once over two files, want 2"
    assert not sess.leases


def test_pipeline_splits_one_file_into_reads_in_flight(tmp_path, monkeypatch):
    """One file alone (a matched load) is cut into READ_DEPTH READs at least, run together."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    sess = GatedSession(1 << 20, 1 << 20)
    p, data = _pieces_file(tmp_path, 8, 16 << 10)
    dests = [torch.empty(16 << 10, dtype=torch.uint8) for _ in range(8)]
    with open(p, "rb") as f:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        try:
            pipe.add(f.fileno(), [(i * (16 << 10), d) for i, d in enumerate(dests)])
            pipe.drain()
        finally:
            pipe.close()
    for i, d in enumerate(dests):
        assert bytes(d.numpy()) == data[i * (16 << 10) : (i + 1) * (16 << 10)]
    assert sess.calls == 2 and sess.max_inflight == 2
    assert not sess.leases


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_pipeline_error_releases_every_lease(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", 32 << 10)
    sess = GatedSession(1 << 20, 1 << 20, fail_at=fail_at, fail=GDSUnavailableError("EIO", errno=errno.EIO))
    (pa, _), (pb, _) = _two_files(tmp_path, 6, 16 << 10)
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        with pytest.raises(GDSUnavailableError):
            try:
                for f in (fa, fb):
                    pipe.add(f.fileno(), [(i * (16 << 10), torch.empty(16 << 10, dtype=torch.uint8)) for i in range(6)])
                pipe.drain()
            finally:
                pipe.close()
    assert not sess.leases


def test_pipeline_finishes_one_at_a_time_on_a_full_pool(tmp_path, monkeypatch):
    """EAGAIN from a READ in flight: what is in flight is finished, the rest goes one batch at a
    time (read_into's path that waits or shrinks), bytes exact, every lease back."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    monkeypatch.setattr(tensorio, "BATCH_BYTES", 32 << 10)
    sess = GatedSession(1 << 20, 1 << 20, fail_at=3, fail=GDSUnavailableError("pool full", errno=errno.EAGAIN))
    (pa, da), (pb, db) = _two_files(tmp_path, 6, 16 << 10)
    dests = {k: [torch.empty(16 << 10, dtype=torch.uint8) for _ in range(6)] for k in "ab"}
    with open(pa, "rb") as fa, open(pb, "rb") as fb:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        try:
            for k, f in (("a", fa), ("b", fb)):
                pipe.add(f.fileno(), [(i * (16 << 10), d) for i, d in enumerate(dests[k])])
            pipe.drain()
        finally:
            pipe.close()
    for k, data in (("a", da), ("b", db)):
        for i, d in enumerate(dests[k]):
            assert bytes(d.numpy()) == data[i * (16 << 10) : (i + 1) * (16 << 10)], f"file {k} piece {i}"
    assert not sess.leases
    assert sess.calls > 3


def test_pipeline_stays_inside_the_pool(tmp_path, monkeypatch):
    """Many files' reads queued at once hold no more than read_into's pipeline would."""
    monkeypatch.setattr(tensorio, "READ_DEPTH", 2)
    monkeypatch.setattr(tensorio, "PIECE_BYTES", 16 << 10)
    sess = FakeSession(1 << 20, 192 << 10)  # max_lease 192 KiB: batches of 32 KiB, 96 KiB held at most
    files = []
    for k in range(4):
        (tmp_path / str(k)).mkdir()
        files.append(_pieces_file(tmp_path / str(k), 8, 16 << 10))
    dests = [[torch.empty(16 << 10, dtype=torch.uint8) for _ in range(8)] for _ in files]
    opened = [open(p, "rb") for p, _ in files]
    try:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        try:
            for f, ds in zip(opened, dests):
                pipe.add(f.fileno(), [(i * (16 << 10), d) for i, d in enumerate(ds)])
            pipe.drain()
        finally:
            pipe.close()
    finally:
        for f in opened:
            f.close()
    for (_, data), ds in zip(files, dests):
        for i, d in enumerate(ds):
            assert bytes(d.numpy()) == data[i * (16 << 10) : (i + 1) * (16 << 10)]
    assert sess.max_live <= 96 << 10, f"{sess.max_live} bytes held at once"
    assert not sess.leases


def test_pipeline_side_streams_wait_for_later_work(tmp_path, monkeypatch):
    """CUDA only, through a fake stream: a side stream made for an earlier add waits, at the next
    add, for the work queued on the current stream since (a resharded read's temporary is
    allocated there after the side stream began)."""
    waited = []

    class FakeStream:
        def wait_stream(self, other):
            waited.append(other)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda gpu=None: f"current:{gpu}")
    sess = FakeSession(1 << 20, 1 << 20)
    p, _ = _pieces_file(tmp_path, 1, 4096)
    with open(p, "rb") as f:
        pipe = tensorio.ReadPipeline(tensorio.DaemonMover(sess))
        pipe._streams._streams[0] = FakeStream()  # as _CopyStreams.get left it for GPU 0
        pipe.add(f.fileno(), [(0, torch.empty(4096, dtype=torch.uint8))])
        assert waited == ["current:0"]
        pipe._streams._streams = {}  # drain would make the fake's current stream wait on it
        pipe.drain()
        pipe.close()
    assert not sess.leases


# -- through gdsfs.dcp, against a live daemon ---------------------------------------------------


@pytest.fixture
def mdir(gdsfs_mount, request):
    yield from daemon_dir(gdsfs_mount, request, "dcp-pipeline")


def _save_two_ranks(d, tensors):
    """Shard(0) over 2 ranks: rank r saves the r-th half of every tensor (file __r_0.distcp)."""
    per_rank = []
    for r in range(2):
        mine = {}
        for fqn, t in tensors.items():
            h = t.shape[0] // 2
            offs = (r * h,) + (0,) * (t.dim() - 1)
            size = (h if r == 0 else t.shape[0] - h,) + tuple(t.shape[1:])
            mine[fqn] = {(offs, size): t[r * h : r * h + size[0]].contiguous()}
        per_rank.append(mine)
    S.save_ranks(per_rank, lambda r: gdcp.GDSFileSystemWriter(d))


def _load_whole(d, tensors, reader):
    """2 -> 1 ranks: every tensor whole on one rank (what Replicate asks for)."""
    targets = {k: torch.full_like(t, -3) for k, t in tensors.items()}
    items = []
    for fqn, t in tensors.items():
        h = t.shape[0] // 2
        saved = [((0,) * t.dim(), (h,) + tuple(t.shape[1:])),
                 ((h,) + (0,) * (t.dim() - 1), (t.shape[0] - h,) + tuple(t.shape[1:]))]
        items += S.read_items(fqn, saved, ((0,) * t.dim(), tuple(t.shape)))
    S.load_items(targets, items, reader)
    return targets


def _tensors():
    g = torch.Generator().manual_seed(11)
    return {f"w{i}": torch.randn(64, 256, generator=g) for i in range(3)}


@standin_only
def test_two_rank_load_reads_both_files_at_once(gdsfs_mount, mdir, monkeypatch):
    """Shard(0) 2 ranks -> 1 rank: the second data file's READ is sent while the first's is in
    flight (before: the files were read one after the other), and the result is the stock
    reader's, byte for byte."""
    from gdsfs import _core

    tensors = _tensors()
    _save_two_ranks(mdir, tensors)
    real = _core.Session.read
    lock = threading.Lock()
    state = {"now": 0, "most": 0}
    both = threading.Barrier(2, timeout=5)

    def read(self, fd, ranges, **k):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        try:
            try:
                both.wait()  # released when a second READ is in flight; a lone READ waits 5 s
            except threading.BrokenBarrierError:
                pass
            return real(self, fd, ranges, **k)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(_core.Session, "read", read)
    got = _load_whole(mdir, tensors, gdcp.GDSFileSystemReader(mdir, strict=True))
    monkeypatch.setattr(_core.Session, "read", real)
    ref = _load_whole(mdir, tensors, S.FileSystemReader(mdir))
    for k, t in tensors.items():
        assert torch.equal(got[k], ref[k]) and torch.equal(got[k], t), k
    assert state["most"] >= 2, "the two data files were read one after the other"
    assert gdsfs_mount.wait_leases(0) == 0


@standin_only
def test_daemon_failing_mid_load_falls_back_to_plain_reads(gdsfs_mount, mdir, monkeypatch):
    """A READ failing (not EAGAIN) while another file's is in flight: the whole call is read with
    plain I/O after the one-time warning, bytes exact, no lease left; strict=True raises."""
    from gdsfs import _core, _errors

    tensors = _tensors()
    _save_two_ranks(mdir, tensors)
    real = _core.Session.read
    calls = {"n": 0}

    def read(self, fd, ranges, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise GDSUnavailableError("gdsfs: injected EIO", errno=errno.EIO)
        return real(self, fd, ranges, **k)

    monkeypatch.setattr(_core.Session, "read", read)
    monkeypatch.setattr(_errors, "_warned", set(), raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _load_whole(mdir, tensors, gdcp.GDSFileSystemReader(mdir))
    for k, t in tensors.items():
        assert torch.equal(got[k], t), k
    calls["n"] = 0
    with pytest.raises(GDSUnavailableError):
        _load_whole(mdir, tensors, gdcp.GDSFileSystemReader(mdir, strict=True))
    assert gdsfs_mount.wait_leases(0) == 0


@standin_only
def test_temporaries_flushed_at_the_budget(gdsfs_mount, mdir, monkeypatch):
    """Span reads (Shard(0) saved, a column block loaded) hold temporaries; past _BATCH_TEMP the
    reads so far are finished and copied out before more are planned. Bytes as the stock reader's."""
    tensors = _tensors()
    _save_two_ranks(mdir, tensors)
    monkeypatch.setattr(gdcp, "_BATCH_TEMP", 8 << 10)
    flushes = []
    real = gdcp._Reads.flush
    monkeypatch.setattr(gdcp._Reads, "flush", lambda self: (flushes.append(self.held), real(self))[1])
    for cols in ((0, 128), (128, 128)):
        targets = {k: torch.zeros(64, cols[1]) for k in tensors}
        ref = {k: torch.zeros(64, cols[1]) for k in tensors}
        items = []
        for fqn, t in tensors.items():
            saved = [((0, 0), (32, 256)), ((32, 0), (32, 256))]
            items += S.read_items(fqn, saved, ((0, cols[0]), (64, cols[1])))
        S.load_items(targets, items, gdcp.GDSFileSystemReader(mdir, strict=True))
        S.load_items(ref, items, S.FileSystemReader(mdir))
        for k, t in tensors.items():
            assert torch.equal(targets[k], ref[k]) and torch.equal(targets[k], t[:, cols[0]:cols[0] + cols[1]]), k
    assert len(flushes) > 2, "the temporaries were never flushed before the end of the call"
    assert gdsfs_mount.wait_leases(0) == 0
