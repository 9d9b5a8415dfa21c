"""A gdsfs.dcp save is durable and atomic at the disk's rate (issue 14, part 1), host engine.

- order: every data file is fsynced under its temporary name before it is renamed; one
  directory fsync makes every data file's name durable before ``.metadata`` is committed (temp,
  fsync, rename, directory fsync); only then are the replaced checkpoint's files removed;
- space: a save that cannot fit is refused up front, before any file is created, with one line
  naming the directory, the bytes it needs and the bytes available; the previous checkpoint
  stays loadable and no temporary file is left;
- crash: a trainer SIGKILLed after its data files are in place but before ``.metadata`` is
  committed leaves the previous checkpoint loadable.

Without a real torch.distributed.checkpoint the save calls run against _dcp_standin (as in
test_dcp_staging.py).
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time
import warnings

import pytest
import torch

import _dcp_standin as S
from _ckpt_helpers import read_dcp_raw, same
from conftest import mount, unmount

REAL = S.has_real_dcp()
pytestmark = pytest.mark.skipif(REAL, reason="the real torch.distributed.checkpoint is installed (see test_dcp.py's real tests)")
if not REAL:
    S.install()
import gdsfs.dcp as gdcp  # noqa: E402  (after the stand-in is installed)
from gdsfs._ckpt import atomic  # noqa: E402

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _close_staging():
    yield
    gdcp.close_staging()


def tensors(seed: int, n: int = 4, mib3: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(mib3 * MIB // 4, generator=g) for i in range(n)}


@pytest.fixture
def pool_mount(tmp_path, gdsfs_bin):
    """A mount whose pool is eight 4 MiB slabs, all of them one uid's to take."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"),
              "--host-pool", "32MiB", "--slab-size", "4MiB", "--uid-share", "100%")
    try:
        yield m
    finally:
        unmount(gdsfs_bin, m.mnt)


class Trace:
    """The durability calls this process makes (fsync, fdatasync, rename, replace, unlink), each
    with the path it concerns, in the order they return."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._fd_call(name, real))
        for name in ("rename", "replace"):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._two_paths("rename", real))
        real_unlink = os.unlink
        monkeypatch.setattr(os, "unlink", self._one_path("unlink", real_unlink))

    def _add(self, *ev: str) -> None:
        with self._lock:
            self.events.append(ev)  # type: ignore[arg-type]

    def _fd_call(self, name, real):  # type: ignore[no-untyped-def]
        def call(fd):  # type: ignore[no-untyped-def]
            fd = fd if isinstance(fd, int) else fd.fileno()
            path = os.readlink(f"/proc/self/fd/{fd}")
            real(fd)
            self._add("fsync", os.path.basename(path), "dir" if os.path.isdir(path) else "file")
        return call

    def _two_paths(self, name, real):  # type: ignore[no-untyped-def]
        def call(a, b, *args, **kw):  # type: ignore[no-untyped-def]
            real(a, b, *args, **kw)
            self._add(name, os.path.basename(os.fspath(a)), os.path.basename(os.fspath(b)))
        return call

    def _one_path(self, name, real):  # type: ignore[no-untyped-def]
        def call(p, *args, **kw):  # type: ignore[no-untyped-def]
            real(p, *args, **kw)
            self._add(name, os.path.basename(os.fspath(p)), "")
        return call


@pytest.mark.parametrize("over_existing", [False, True])
def test_every_data_file_is_durable_before_metadata_is_committed(pool_mount, monkeypatch, over_existing):
    """The save's order of durability calls: each data file fsynced under its temporary name,
    then renamed; one directory fsync after the last data file's rename (not one per file); then
    .metadata's temp fsynced, renamed over, the directory fsynced; the replaced checkpoint's
    files removed only after that."""
    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)  # 4 data files written in parallel
    d = pool_mount.path("ckpt")
    if over_existing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            S.save(tensors(1), gdcp.GDSFileSystemWriter(d))
    old_files = set(os.listdir(d)) - {".metadata"} if over_existing else set()
    src = tensors(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = gdcp.GDSFileSystemWriter(d)
        staged = w.stage(src)
        assert w.stage_stats["stock_bytes"] == 0, w.stage_stats
        trace = Trace(monkeypatch)
        S.save(staged, w)
    ev = trace.events
    monkeypatch.undo()
    data = sorted(n for n in os.listdir(d) if n.endswith(".distcp"))
    assert len(data) == 4, data
    assert same(read_dcp_raw(d), src)

    def index(pred, what: str) -> int:  # type: ignore[no-untyped-def]
        got = [i for i, e in enumerate(ev) if pred(e)]
        assert len(got) == 1, f"{what}: {len(got)} times in {ev}"
        return got[0]

    md = index(lambda e: e[0] == "rename" and e[2] == ".metadata", "the rename of .metadata")
    md_sync = index(lambda e: e[0] == "fsync" and e[1].startswith(".metadata"), "the fsync of .metadata's temp")
    renames = []
    for name in data:
        r = index(lambda e, n=name: e[0] == "rename" and e[2] == n, f"the rename of {name}")
        tmp = ev[r][1]
        assert atomic.TMP_MARKER in tmp, ev[r]
        s = index(lambda e, t=tmp: e[0] in ("fsync",) and e[1] == tmp and e[2] == "file", f"the fsync of {tmp}")
        assert s < r, f"{name} renamed before its fsync: {ev}"
        renames.append(r)
    dirs = [i for i, e in enumerate(ev) if e[0] == "fsync" and e[2] == "dir"]
    assert len(dirs) == 2, f"{len(dirs)} directory fsyncs, want one for the data files and one for .metadata: {ev}"
    assert max(renames) < dirs[0] < md_sync < md < dirs[1], f"durability calls out of order: {ev}"
    unlinks = [i for i, e in enumerate(ev) if e[0] == "unlink" and e[1] in old_files]
    assert len(unlinks) == len(old_files), (old_files, ev)
    assert all(i > dirs[1] for i in unlinks), f"the replaced checkpoint's files went before the commit: {ev}"
    assert pool_mount.wait_leases(0) == 0


@pytest.fixture
def tiny_disk(tmp_path, gdsfs_bin):
    """A mount over a 24 MiB filesystem (tmpfs with a size limit: the backing disk of this test)."""
    src, mnt = tmp_path / "small-src", tmp_path / "small-mnt"
    src.mkdir()
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "gdsfs-test-tiny", str(src)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")
    try:
        m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"),
                  "--host-pool", "32MiB", "--slab-size", "4MiB", "--uid-share", "100%")
        try:
            yield m
        finally:
            unmount(gdsfs_bin, m.mnt)
    finally:
        subprocess.run(["umount", "-l", str(src)], capture_output=True)


@pytest.mark.parametrize("staged", [True, False])
def test_a_save_that_cannot_fit_is_refused_up_front(tiny_disk, monkeypatch, staged):
    """On a filesystem without room for the save: an OSError(ENOSPC) before any data file is
    created, one line naming the directory and the bytes needed and available; no temporary
    file left; the previous checkpoint loads intact."""
    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)
    d = tiny_disk.path("ckpt")
    old = tensors(3, n=2)  # 6 MiB
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.save(old, gdcp.GDSFileSystemWriter(d))
    big = tensors(4, n=8)  # 24 MiB: more than the 18 MiB left
    creates: list[str] = []
    real_replace = atomic.replace

    def recording_replace(dest, *a, **k):  # type: ignore[no-untyped-def]
        creates.append(os.fspath(dest))
        return real_replace(dest, *a, **k)

    monkeypatch.setattr(atomic, "replace", recording_replace)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = gdcp.GDSFileSystemWriter(d)
        snap = w.stage(big) if staged else big
        with pytest.raises(OSError) as ei:
            S.save(snap, w)
    e = ei.value
    assert e.errno == errno.ENOSPC, repr(e)
    msg = str(e)
    assert "\n" not in msg and repr(d) in msg, msg
    got = re.search(r"needs ([0-9.]+) MiB .* has ([0-9.]+) MiB available", msg)
    assert got, msg
    need, have = float(got[1]), float(got[2])
    assert need >= sum(v.numel() * v.element_size() for v in big.values()) / MIB > have, msg
    assert creates == [], f"data files were created before the space check: {creates}"
    left = [n for n in os.listdir(d) if atomic.TMP_MARKER in n or n.endswith(".tmp")]
    assert left == [], left
    assert same(read_dcp_raw(d), old), "the previous checkpoint does not load intact"
    assert tiny_disk.wait_leases(0) == 0


def _saver_killed_before_commit(path: str, seed: int, conn) -> None:  # type: ignore[no-untyped-def]
    """Save a staged snapshot of ``tensors(seed)`` over ``path``; tell the parent (who SIGKILLs
    us) once every data file is written and renamed into place, before .metadata is committed."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    gdcp._STAGED_FILE_BYTES = 2 * MIB
    w = gdcp.GDSFileSystemWriter(path)
    staged = w.stage(tensors(seed))

    def finish(*a, **k):  # type: ignore[no-untyped-def]
        conn.send(sorted(os.listdir(path)))
        time.sleep(600)

    w.finish = finish  # type: ignore[method-assign]
    S.save(staged, w)


def test_trainer_killed_before_metadata_commit_leaves_previous_loadable(pool_mount):
    d = pool_mount.path("kill-before-commit")
    old = tensors(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.save(old, gdcp.GDSFileSystemWriter(d))
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "_dcp_standin", "gdsfs.dcp"])
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_saver_killed_before_commit, args=(d, 6, child), daemon=True)
    p.start()
    try:
        assert parent.poll(120), f"the saver never got to its commit (exit code {p.exitcode})"
        names = parent.recv()
        assert len([n for n in names if n.endswith(".distcp")]) == 5, f"the new data files are not in place: {names}"
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(30)
    assert p.exitcode == -signal.SIGKILL
    assert pool_mount.wait_leases(0) == 0
    assert same(read_dcp_raw(d), old), "the previous checkpoint does not load intact"
    got = {k: torch.zeros_like(v) for k, v in old.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.load(got, [], gdcp.GDSFileSystemReader(d))
    assert same(got, old)
    # The next save over it removes what the killed one left (files no .metadata names).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        S.save(tensors(7), gdcp.GDSFileSystemWriter(d))
    assert same(read_dcp_raw(d), tensors(7))
    assert len([n for n in os.listdir(d) if n.endswith(".distcp")]) == 1


def _save_dir(pool_mount, monkeypatch, name: str, over_existing: bool):  # type: ignore[no-untyped-def]
    """A directory for a save that will fail, split into several data files: fresh, or holding a
    previous checkpoint of tensors(8). Returns it, that checkpoint's tensors and its listing."""
    monkeypatch.setattr(gdcp, "_STAGED_FILE_BYTES", 2 * MIB)  # several data files
    d = pool_mount.path(name)
    old = tensors(8)
    if over_existing:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            S.save(old, gdcp.GDSFileSystemWriter(d))
    else:
        os.makedirs(d)
    return d, old, sorted(os.listdir(d))


@pytest.mark.parametrize("over_existing", [False, True], ids=["fresh", "over-existing"])
@pytest.mark.parametrize("staged", [True, False], ids=["staged", "plain"])
def test_a_save_that_fails_midway_leaves_none_of_its_files(pool_mount, monkeypatch, over_existing, staged):
    """The disk fills up (or a write fails) after some of a save's data files are written and
    renamed into place: the save raises, and the directory holds only what it held before (no
    data file of the failed save under its final name, no temporary file); a previous checkpoint
    loads intact. Before, the files already renamed stayed behind: in a fresh directory, data
    files with no .metadata, a half-written checkpoint."""
    d, old, before = _save_dir(pool_mount, monkeypatch, f"midway-{over_existing}-{staged}", over_existing)
    real_write = gdcp.GDSFileSystemWriter._write_file
    written: list[str] = []
    lock = threading.Lock()

    def failing_write(self, path, lay):  # type: ignore[no-untyped-def]
        with lock:
            n = len(written)
            written.append(path)
        if n >= 2:
            time.sleep(0.2)  # the first two are renamed into place first
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, path, lay)

    monkeypatch.setattr(gdcp.GDSFileSystemWriter, "_write_file", failing_write)
    new = tensors(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Plain: a file per item (single_file_per_rank=False), so that there are several.
        w = gdcp.GDSFileSystemWriter(d) if staged else gdcp.GDSFileSystemWriter(d, single_file_per_rank=False)
        snap = w.stage(new) if staged else new
        with pytest.raises(OSError) as ei:
            S.save(snap, w)
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)
    assert len(written) >= 3, f"the test wrote {len(written)} data files: it needs 3 or more"
    assert sorted(os.listdir(d)) == before, f"the failed save left files behind: {sorted(set(os.listdir(d)) - set(before))}"
    if over_existing:
        assert same(read_dcp_raw(d), old), "the previous checkpoint does not load intact"
    assert pool_mount.wait_leases(0) == 0


def test_a_failed_save_whose_cleanup_fails_raises_the_save_error(pool_mount, monkeypatch):
    """A save's write fails after some of its data files are in place, and removing those fails
    too (the filesystem went read-only after the write error, as ext4's errors=remount-ro does):
    the save raises the write's error, the one that says what went wrong, not the cleanup's."""
    d = pool_mount.path("midway-cleanup-fails")
    os.makedirs(d)
    real_write = gdcp.GDSFileSystemWriter._write_file
    written: list[str] = []

    def failing_write(self, path, lay):  # type: ignore[no-untyped-def]
        written.append(path)
        if len(written) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, path, lay)

    def readonly_unlink(path, *a, **k):  # type: ignore[no-untyped-def]
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    monkeypatch.setattr(gdcp.GDSFileSystemWriter, "_write_file", failing_write)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = gdcp.GDSFileSystemWriter(d, single_file_per_rank=False)  # a file per item: several
        monkeypatch.setattr(gdcp.os, "unlink", readonly_unlink)
        with pytest.raises(OSError) as ei:
            S.save(tensors(9), w)
        monkeypatch.undo()
    assert len(written) >= 3, f"the test wrote {len(written)} data files: it needs 3 or more"
    assert ei.value.errno == errno.ENOSPC, repr(ei.value)


@pytest.mark.parametrize("over_existing", [False, True], ids=["fresh", "over-existing"])
def test_a_save_whose_directory_fsync_fails_leaves_none_of_its_files(pool_mount, monkeypatch, over_existing):
    """Every data file is written, fsynced and renamed into place, and then the directory fsync
    that makes their names durable fails (EIO: the disk went away): the save raises that error
    and the directory holds what it held before, as after a failed write: no data file that no
    .metadata names, and a previous checkpoint loads intact."""
    d, old, before = _save_dir(pool_mount, monkeypatch, f"dirsync-fails-{over_existing}", over_existing)

    def failing_fsync_dir(path, *a, **k):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(atomic, "fsync_dir", failing_fsync_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = gdcp.GDSFileSystemWriter(d)
        with pytest.raises(OSError) as ei:
            S.save(w.stage(tensors(9)), w)
    monkeypatch.undo()
    assert ei.value.errno == errno.EIO, repr(ei.value)
    assert sorted(os.listdir(d)) == before, f"the failed save left files behind: {sorted(set(os.listdir(d)) - set(before))}"
    if over_existing:
        assert same(read_dcp_raw(d), old), "the previous checkpoint does not load intact"
    assert pool_mount.wait_leases(0) == 0
