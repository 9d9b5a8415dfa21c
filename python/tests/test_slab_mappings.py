"""A process's slab mappings belong to the sessions that use them (issue 14).

A session's end retires (or, with GDSFS_SLAB_RETAIN_S=0, drops) only the CUDA virtual-memory slab
mappings no other open session of the process uses: a staging session kept between checkpoint
saves, or a loader's session, must not lose its mappings (and map them again, or hold a second
mapping of a slab) because another session (a load, a short-lived read) closed. CI has no CUDA,
so the mappings are stand-ins recorded the way ``gdsfs._tensors._slab_tensor`` records real ones;
the sessions and their close are real.
"""

from __future__ import annotations

import struct

import pytest
from conftest import mount, unmount

import gdsfs
from gdsfs import _core
from gdsfs import _protocol as proto

BASE = 1 << 40  # slab ids no daemon hands out in this run


def _mapped(session: gdsfs.Session, slab: int) -> tuple[str, int, int]:
    """Record a stand-in mapping of ``slab`` made for ``session``; returns its cache key."""
    key = (session.mount, session.hello.daemon_pid, slab)
    _core._slabs.add_vmm(key, session.hello.slab_socket, object(), session)
    return key


def _cached(key: tuple[str, int, int]) -> bool:
    return key in _core._slabs.tensors and key not in _core._slabs.retired


@pytest.fixture
def no_retention(monkeypatch):
    monkeypatch.setenv(_core.SLAB_RETAIN_ENV, "0")  # a session's end drops what it alone used


def test_closing_a_session_keeps_the_mappings_other_sessions_use(gdsfs_mount, no_retention) -> None:
    a = gdsfs.Session(gdsfs_mount.mnt)
    b = gdsfs.Session(gdsfs_mount.mnt)
    only_a, only_b, shared = _mapped(a, BASE + 1), _mapped(b, BASE + 2), _mapped(a, BASE + 3)
    # b finds the shared slab already mapped (a cache hit): it uses it too.
    assert _core._slabs.cached(shared, b.hello.slab_socket, b) is not None
    try:
        a.close()
        assert not _cached(only_a), "the mapping only the closed session used must go"
        assert _cached(only_b), "closing a session dropped a mapping only another session uses"
        assert _cached(shared), "closing a session dropped a mapping another session still uses"
    finally:
        b.close()
    assert not any(k in _core._slabs.tensors for k in (only_a, only_b, shared)), "mappings outlived every session using them"


def test_closing_the_last_session_of_a_mount_drops_its_mappings(gdsfs_mount, no_retention) -> None:
    s = gdsfs.Session(gdsfs_mount.mnt)
    key = _mapped(s, BASE + 10)
    with gdsfs.Session(gdsfs_mount.mnt):
        pass  # a session that used no slab: its end drops nothing of s
    assert _cached(key)
    s.close()
    assert key not in _core._slabs.tensors


def test_a_retention_window_retires_only_what_no_open_session_uses(gdsfs_mount) -> None:
    slabs = _core._ProcessSlabs()  # explicit clock: no timer, no sleeps
    a = gdsfs.Session(gdsfs_mount.mnt)
    b = gdsfs.Session(gdsfs_mount.mnt)
    try:
        ka, kb = (a.mount, 1, BASE + 20), (a.mount, 1, BASE + 21)
        slabs.add_vmm(ka, "@r", object(), a)
        slabs.add_vmm(kb, "@r", object(), b)
        slabs.drop_vmm(a.mount, a.token.session, now=0.0, retain=5.0)
        assert set(slabs.retired) == {ka}
        slabs.drop_vmm(a.mount, b.token.session, now=1.0, retain=5.0)
        assert set(slabs.retired) == {ka, kb}
        assert slabs.reap(now=6.5) == 2 and not slabs.retired and not slabs.tensors
    finally:
        a.close()
        b.close()


def test_a_daemon_restarted_under_the_same_pid_never_serves_the_old_runs_slabs(gdsfs_bin, tmp_path, monkeypatch) -> None:
    # A daemon restarted in a fresh container (pid namespace) often gets its old pid again, and
    # the trainer's long-lived process opens a session of the new run at the same mount path.
    # Slab ids start again at 1: a slab descriptor or mapping cached from the old run must not
    # stand for the new run's slab of the same id (it would hand out the old run's bytes).
    real = _core._ioctl

    def same_pid(fd: int, cmd: int, buf: bytearray) -> None:
        real(fd, cmd, buf)
        if cmd == proto.HELLO:
            struct.pack_into("<I", buf, 96, 4242)  # both runs are pid 4242 in their namespace

    monkeypatch.setattr(_core, "_ioctl", same_pid)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for run, fill in enumerate((b"a", b"b")):
        src = tmp_path / f"src{run}"
        src.mkdir()
        (src / "f.bin").write_bytes(fill * 8192)
        mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / f"log{run}"))
        try:
            with gdsfs.Session(str(mnt)) as s, open(mnt / "f.bin", "rb") as f:
                assert s.hello.daemon_pid == 4242
                (r,) = s.read(f, [(0, 8192)])
                got = bytes(s.host_buffer(r))
                s.release([r])
        finally:
            unmount(gdsfs_bin, str(mnt))
        assert got == fill * 8192, f"run {run}: a session of the daemon's run {run} read another run's slab bytes"
