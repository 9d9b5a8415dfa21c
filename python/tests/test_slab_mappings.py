"""A process's slab mappings belong to the sessions that use them (issue 14).

A session's end retires (or, with GDSFS_SLAB_RETAIN_S=0, drops) only the CUDA virtual-memory slab
mappings no other open session of the process uses: a staging session kept between checkpoint
saves, or a loader's session, must not lose its mappings (and map them again, or hold a second
mapping of a slab) because another session (a load, a short-lived read) closed. CI has no CUDA,
so the mappings are stand-ins recorded the way ``gdsfs._tensors._slab_tensor`` records real ones;
the sessions and their close are real.
"""

from __future__ import annotations

import pytest

import gdsfs
from gdsfs import _core

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
