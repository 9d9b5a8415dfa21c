"""dcp.async_save staging into daemon slabs (issue 14, part 1), with the host engine.

- the pool cannot take everything: the tensors it has no room for (EAGAIN) and those larger than
  a slab are staged the stock way, one by one, never the whole dict; one warning per process says
  how many bytes and how to size the pool; the snapshot is exact either way;
- the trainer is SIGKILLed with a staged snapshot (before and while the daemon writes it): the
  previous checkpoint loads intact and every lease goes back to the pool;
- the daemon is SIGKILLed while it writes a staged snapshot: the save fails with an error, the
  previous checkpoint in the backing directory is intact and loads through a new mount.

The save calls follow torch 2.11's dcp.async_save (stage, then dcp.save's calls); without a real
torch.distributed.checkpoint they run against _dcp_standin. DTensor and ShardedTensor staging need
torch 2.x: test_dcp.py's real tests (the GPU machine's pytest section).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import warnings

import pytest
import torch

import _dcp_standin as S
from _ckpt_helpers import read_dcp_raw, same
from conftest import mount, unmount
from gdsfs import GDSFallbackWarning
from gdsfs._errors import _reset_fallback_warning

REAL = S.has_real_dcp()
pytestmark = pytest.mark.skipif(REAL, reason="the real torch.distributed.checkpoint is installed (see test_dcp.py's real tests)")
if not REAL:
    S.install()
import gdsfs.dcp as gdcp  # noqa: E402  (after the stand-in is installed)

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _close_staging():
    """The staging session a snapshot keeps for the next one is closed after each test, so that
    no test's mount is left with an open session."""
    yield
    gdcp.close_staging()


@pytest.fixture
def small_mount(tmp_path, gdsfs_bin):
    """A mount whose pool is four 4 MiB slabs, all of them one uid's to take."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"),
              "--host-pool", "16MiB", "--slab-size", "4MiB", "--uid-share", "100%")
    try:
        yield m
    finally:
        unmount(gdsfs_bin, m.mnt)


def tensors(seed: int, mib3: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"small": torch.randn(1000, generator=g)}
    for i in range(mib3):
        out[f"w{i}"] = torch.randn(3 * MIB // 4, generator=g)  # 3 MiB: one per 4 MiB slab
    out["big"] = torch.randn(5 * MIB // 4, generator=g)  # larger than a slab
    out["int"] = torch.arange(100, dtype=torch.int64)
    return out


def test_staging_falls_back_per_tensor_when_the_pool_is_full(small_mount):
    d = small_mount.path("ckpt")
    src = tensors(1)
    want = {k: v.clone() for k, v in src.items()}
    total = sum(v.numel() * v.element_size() for v in src.values())
    _reset_fallback_warning()
    w = gdcp.GDSFileSystemWriter(d)
    with pytest.warns(GDSFallbackWarning) as rec:
        staged = w.stage(src)
    st = w.stage_stats
    assert st["slab_tensors"] >= 2, f"too little went into slabs: {st}"
    assert st["stock_tensors"] >= 2, f"the full pool and the big tensor must stage the stock way: {st}"
    assert st["slab_tensors"] + st["stock_tensors"] == len(src)
    assert st["slab_bytes"] + st["stock_bytes"] == total
    assert len(w._staged) == st["slab_tensors"]
    assert staged["big"].data_ptr() not in w._staged, "a tensor larger than a slab went into a lease"
    msg = str(rec[0].message)
    assert f"{st['stock_bytes'] / MIB:.1f} MiB" in msg and "--gpu-pool" in msg and "--slab-size" in msg, msg
    assert "pool was full" in msg and "larger than a slab" in msg, msg
    for v in src.values():
        v.zero_()  # training goes on: neither kind of staged copy may change
    assert same(staged, want)
    S.save(staged, w)
    assert small_mount.wait_leases(0) == 0
    assert same(read_dcp_raw(d), want)
    # The warning is issued once per process; a second save stages the same way, silently.
    w2 = gdcp.GDSFileSystemWriter(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected an existing checkpoint")
            staged2 = w2.stage(tensors(2))
            S.save(staged2, w2)
    assert w2.stage_stats == st
    assert same(read_dcp_raw(d), tensors(2))
    assert small_mount.wait_leases(0) == 0


def test_staging_with_room_uses_slabs_for_every_tensor(small_mount):
    d = small_mount.path("ckpt-fits")
    src = {k: v for k, v in tensors(3, mib3=2).items() if k != "big"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        w = gdcp.GDSFileSystemWriter(d)
        staged = w.stage(src)
    assert w.stage_stats["stock_bytes"] == 0 and w.stage_stats["slab_tensors"] == len(src)
    S.save(staged, w)
    assert same(read_dcp_raw(d), src)
    assert small_mount.wait_leases(0) == 0


# --- crashes -----------------------------------------------------------------------------------


def _staged_saver(path: str, seed: int, moment: str, conn) -> None:
    """Stage a new snapshot of ``tensors(seed)`` into slabs and start writing it; tell the parent
    (who SIGKILLs us) once at ``moment``: "staged" (before any write) or "writing" (after the
    daemon wrote the first lease)."""
    import gdsfs._core as core

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    w = gdcp.GDSFileSystemWriter(path)
    staged = w.stage(tensors(seed, mib3=3))
    assert w._staged, "nothing staged into slabs"
    if moment == "staged":
        conn.send(len(w._staged))
        time.sleep(600)
    real = core.Session.write

    def write(self, *a, **k):
        n = real(self, *a, **k)
        conn.send(len(w._staged))
        time.sleep(600)
        return n

    core.Session.write = write
    S.save(staged, w)


@pytest.mark.parametrize("moment", ["staged", "writing"])
def test_trainer_killed_during_staged_save(gdsfs_mount, moment):
    d = gdsfs_mount.path("staging-kill", moment)
    old = tensors(10, mib3=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.save(old, gdcp.GDSFileSystemWriter(d))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "_dcp_standin", "gdsfs.dcp"])
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_staged_saver, args=(d, 11, moment, child), daemon=True)
    p.start()
    try:
        assert parent.poll(120), f"the saver never got to {moment!r} (exit code {p.exitcode})"
        assert parent.recv() > 0
        assert gdsfs_mount.stats()["leases"] > 0, "the staged snapshot holds no leases"
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert gdsfs_mount.wait_leases(0) == 0, "a killed trainer's staged leases were not returned"
    assert same(read_dcp_raw(d), old), "the previous checkpoint does not load intact"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = {k: torch.zeros_like(v) for k, v in old.items()}
        S.load(got, [], gdcp.GDSFileSystemReader(d))
    assert same(got, old)


def test_daemon_killed_during_staged_save(tmp_path, gdsfs_bin):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"))
    m2 = None
    try:
        d = m.path("ckpt")
        old = tensors(20, mib3=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            S.save(old, gdcp.GDSFileSystemWriter(d))
        w = gdcp.GDSFileSystemWriter(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            staged = w.stage(tensors(21, mib3=3))
        assert w._staged
        pid = w._stage_session.hello.daemon_pid
        import gdsfs._core as core

        real = core.Session.write
        calls = []

        def write(self, *a, **k):
            calls.append(1)
            if len(calls) == 2:  # one lease written, then the daemon dies under the next
                os.kill(pid, signal.SIGKILL)
            return real(self, *a, **k)

        core.Session.write = write
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with pytest.raises(BaseException) as err:
                    S.save(staged, w)
        finally:
            core.Session.write = real
        assert not isinstance(err.value, (KeyboardInterrupt, SystemExit)), err.value
        unmount(gdsfs_bin, m.mnt)
        # The backing directory holds the previous checkpoint, complete (what the stock reader
        # reads after the crash, without any daemon).
        assert same(read_dcp_raw(str(src / "ckpt")), old), f"after {err.value!r}, the previous checkpoint is torn"
        m2 = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon2.log"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = {k: torch.zeros_like(v) for k, v in old.items()}
            S.load(got, [], gdcp.GDSFileSystemReader(m2.path("ckpt")))
        assert same(got, old)
        assert m2.wait_leases(0) == 0
    finally:
        unmount(gdsfs_bin, str(mnt))


def test_next_snapshot_reuses_the_kept_session(small_mount, monkeypatch):
    """A second snapshot, of a new writer, stages through the session the first one kept (its
    slab mappings with it) instead of opening another; close_staging closes it."""
    import gdsfs._core as core

    opened = []
    real = core.Session.open
    monkeypatch.setattr(core.Session, "open", classmethod(lambda cls, *a, **k: (opened.append(a), real(*a, **k))[1]))
    sessions0 = int(small_mount.stats()["sessions"])
    src = {k: v for k, v in tensors(4, mib3=2).items() if k != "big"}
    for i in range(3):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected an existing checkpoint")
            w = gdcp.GDSFileSystemWriter(small_mount.path(f"reuse-{i}"))
            S.save(w.stage(src), w)
        assert same(read_dcp_raw(small_mount.path(f"reuse-{i}")), src)
    assert len(opened) == 1, f"{len(opened)} staging sessions for 3 snapshots"
    assert small_mount.wait_leases(0) == 0
    gdcp.close_staging()
    deadline = time.monotonic() + 10
    while int(small_mount.stats()["sessions"]) != sessions0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert int(small_mount.stats()["sessions"]) == sessions0


@pytest.mark.parametrize("files_max,want", [(None, 4), (8, 8)])
def test_large_staged_snapshot_goes_to_parallel_files(gdsfs_mount, monkeypatch, files_max, want):
    """A staged snapshot of at least 2 x _STAGED_FILE_BYTES is written to up to 4 data files in
    parallel (one file's writeback is slower than the disk), or to up to _files_max (the layout
    A/B of scripts/gpu/dcp_check.py); the stock and gdsfs readers load it."""
    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)
    d = gdsfs_mount.path(f"staging-files-{files_max}")
    src = {k: v for k, v in tensors(5, mib3=9).items() if k != "big"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        w = gdcp.GDSFileSystemWriter(d)
        w._files_max = files_max
        staged = w.stage(src)
        assert w.stage_stats["stock_bytes"] == 0
        S.save(staged, w)
    names = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))
    assert names == sorted(f"__0_{i}.distcp" for i in range(want)), names
    assert same(read_dcp_raw(d), src)
    got = {k: torch.zeros_like(v) for k, v in src.items()}
    S.load(got, [], gdcp.GDSFileSystemReader(d))
    assert same(got, src)
    assert gdsfs_mount.wait_leases(0) == 0


def test_staged_files_start_writing_before_the_last_is_laid_out(gdsfs_mount, monkeypatch):
    """With room for the save by an upper bound of its size, the first data file's writes start
    while the later files are still being laid out (before: every file was laid out, for the
    space check, before any write began). The checkpoint is exact."""
    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)
    d = gdsfs_mount.path("staging-streamed")
    src = {k: v for k, v in tensors(7, mib3=8).items() if k != "big"}
    started = threading.Event()
    order: list[str] = []
    real_layout, real_write = gdcp.GDSFileSystemWriter._layout_file, gdcp.GDSFileSystemWriter._write_file

    def layout(self, name, items, planner):
        if name.startswith("__0_3"):
            order.append(f"waited for a write: {started.wait(5)}")
        return real_layout(self, name, items, planner)

    def write(self, path, lay):
        started.set()
        return real_write(self, path, lay)

    monkeypatch.setattr(gdcp.GDSFileSystemWriter, "_layout_file", layout)
    monkeypatch.setattr(gdcp.GDSFileSystemWriter, "_write_file", write)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        w = gdcp.GDSFileSystemWriter(d)
        S.save(w.stage(src), w)
    assert order == ["waited for a write: True"], order
    assert sorted(n for n in os.listdir(d) if n.endswith(".distcp")) == [f"__0_{i}.distcp" for i in range(4)]
    assert same(read_dcp_raw(d), src)
    assert gdsfs_mount.wait_leases(0) == 0


def test_strict_writer_refuses_stock_staging(small_mount):
    """strict=True: a snapshot the pool cannot hold raises instead of staging some tensors the
    stock way, and gives back the leases it took."""
    from gdsfs import GDSUnavailableError

    w = gdcp.GDSFileSystemWriter(small_mount.path("strict"), strict=True)
    with pytest.raises(GDSUnavailableError, match="the stock way"):
        w.stage(tensors(6))
    assert small_mount.wait_leases(0) == 0


@pytest.mark.parametrize("direct_io", ["auto", "never"])
def test_staged_leases_written_direct_are_not_flushed(tmp_path, gdsfs_bin, monkeypatch, direct_io):
    """The daemon writes staged leases of >= 1 MiB around the page cache (--direct-io auto, its
    STATUS says from what size): the writer starts no writeback flushes for them, only the final
    fsync; with --direct-io never the leases land in the page cache and it flushes as it goes.
    The checkpoint is exact either way, and save_times says where the save's time went."""
    from gdsfs._ckpt import tensorio

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"),
              "--host-pool", "16MiB", "--slab-size", "4MiB", "--uid-share", "100%", "--direct-io", direct_io)
    flushers: list[object] = []

    class Recording(tensorio._Flusher):
        def __init__(self, fd: int, every: int) -> None:
            flushers.append(self)
            super().__init__(fd, every)

    monkeypatch.setattr(tensorio, "_Flusher", Recording)
    monkeypatch.setattr(gdcp, "_STAGED_FLUSH_BYTES", 2 * MIB)  # flush every 2 MiB of cached bytes
    try:
        d = m.path("ckpt")
        data = {k: v for k, v in tensors(5, mib3=3).items() if k.startswith("w")}  # 3 x 3 MiB
        with warnings.catch_warnings():
            warnings.simplefilter("error", GDSFallbackWarning)
            w = gdcp.GDSFileSystemWriter(d)
            staged = w.stage(data)
            S.save(staged, w)
        assert w._direct_min == (MIB if direct_io == "auto" else None)
        if direct_io == "auto":
            assert not flushers, "the writer flushed leases the daemon wrote with O_DIRECT"
        else:
            assert flushers, "leases written through the page cache were never flushed before the fsync"
        assert same(read_dcp_raw(d), data)
        for k in ("stage_s", "t_write_data", "lease_writes_s", "commit_s", "finish_s", "t_written"):
            assert k in w.save_times, (k, w.save_times)
        assert m.wait_leases(0) == 0
    finally:
        gdcp.close_staging()
        unmount(gdsfs_bin, m.mnt)


def test_a_fully_staged_save_releases_its_leases_after_every_write(small_mount, monkeypatch):
    """A RELEASE waits for every WRITE of the session in flight and holds back new ones, so a
    save whose tensors all sit in leases (nothing needs pool room mid-save) releases them only
    once every data file is written, not file by file between the other files' writes."""
    from gdsfs import _core

    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)  # 4 data files written in parallel
    events: list[str] = []
    lock = __import__("threading").Lock()
    write, release = _core.Session.write, _core.Session.release

    def recording_write(self, *a, **k):  # type: ignore[no-untyped-def]
        n = write(self, *a, **k)
        with lock:
            events.append("write")
        return n

    def recording_release(self, refs, *a, **k):  # type: ignore[no-untyped-def]
        with lock:
            events.append(f"release {len(list(refs))}")
        return release(self, refs, *a, **k)

    monkeypatch.setattr(_core.Session, "write", recording_write)
    monkeypatch.setattr(_core.Session, "release", recording_release)
    d = small_mount.path("ckpt-all-staged")
    src = {k: v for k, v in tensors(7, mib3=4).items() if k.startswith("w")}  # 4 x 3 MiB, one per slab
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        w = gdcp.GDSFileSystemWriter(d)
        staged = w.stage(src)
        assert w.stage_stats["slab_tensors"] == len(src), w.stage_stats
        events.clear()
        S.save(staged, w)
    assert len([n for n in os.listdir(d) if n.endswith(".distcp")]) == 4
    writes = [i for i, e in enumerate(events) if e == "write"]
    releases = [i for i, e in enumerate(events) if e.startswith("release") and e != "release 0"]
    assert len(writes) == len(src) and releases, events
    assert min(releases) > max(writes), f"leases released between the writes: {events}"
    assert same(read_dcp_raw(d), src)
    assert small_mount.wait_leases(0) == 0
