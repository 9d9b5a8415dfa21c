"""A process's slab mappings belong to the sessions that use them (issue 14).

Closing one session of a process drops only the CUDA virtual-memory slab mappings no other open
session of the process uses: a staging session kept between checkpoint saves, or a loader's
session, must not have to map its slabs again because another session (a load, a short-lived
read) closed. CI has no CUDA, so the mappings are stand-ins recorded the way
``gdsfs._tensors._slab_tensor`` records real ones; the sessions and their close are real.
"""

from __future__ import annotations

import gdsfs
from gdsfs import _core


def _mapped(session: gdsfs.Session, slab: int) -> tuple[str, int, int]:
    """Record a stand-in mapping of ``slab`` made for ``session``; returns its cache key."""
    key = (session.mount, session.hello.daemon_pid, slab)
    _core._slabs.keep_vmm(key, object(), session)
    return key


def _cached(key: tuple[str, int, int]) -> bool:
    return key in _core._slabs.tensors


def test_closing_a_session_keeps_the_mappings_other_sessions_use(gdsfs_mount) -> None:
    a = gdsfs.Session(gdsfs_mount.mnt)
    b = gdsfs.Session(gdsfs_mount.mnt)
    base = 1 << 40  # slab ids no daemon hands out in this run
    only_a, only_b, shared = _mapped(a, base + 1), _mapped(b, base + 2), _mapped(a, base + 3)
    # b finds the shared slab already mapped (a cache hit): it uses it too.
    assert _core._slabs.vmm_tensor(shared, b) is not None
    try:
        a.close()
        assert not _cached(only_a), "the mapping only the closed session used must go"
        assert _cached(only_b), "closing a session dropped a mapping only another session uses"
        assert _cached(shared), "closing a session dropped a mapping another session still uses"
    finally:
        b.close()
    assert not any(_cached(k) for k in (only_a, only_b, shared)), "mappings outlived every session using them"


def test_closing_the_last_session_of_a_mount_drops_its_mappings(gdsfs_mount) -> None:
    s = gdsfs.Session(gdsfs_mount.mnt)
    key = _mapped(s, (1 << 40) + 10)
    with gdsfs.Session(gdsfs_mount.mnt):
        pass  # a session that used no slab: its close drops nothing of s
    assert _cached(key)
    s.close()
    assert not _cached(key)
