"""Retention of CUDA virtual-memory slab mappings across sessions (gdsfs._core._ProcessSlabs).

Every load_file is a session of its own; a slab mapped by one load is kept for the next within
GDSFS_SLAB_RETAIN_S instead of being imported, mapped and unmapped again. The GPU mapping itself
needs CUDA (scripts/gpu/tier_check.py counts the imports per load); here the cache's rules are
checked with stand-in tensors: a retired mapping serves a later session of the same daemon run,
never one of another run (a restarted daemon that reused its pid, hence its slab ids), and is let
go (so unmapped) once its window passed. Clocks are explicit: no sleeps.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from gdsfs import _core


class Mapping:
    """Stands in for the tensor over a mapped slab: unmapped when collected."""


def key(slab: int, mount: str = "/mnt/a") -> tuple[str, int, int]:
    return (mount, 4242, slab)


@pytest.fixture
def slabs():
    s = _core._ProcessSlabs()
    yield s
    if s.timer is not None:
        s.timer.cancel()


def gone(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_retired_mapping_serves_the_next_session_of_the_same_run(slabs) -> None:
    m = Mapping()
    ref = weakref.ref(m)
    slabs.add_vmm(key(7), "@run-1", m)
    del m
    slabs.drop_vmm("/mnt/a", now=100.0, retain=10.0)  # the load's session ended
    assert slabs.retired == {key(7): 110.0}
    assert slabs.reap(now=109.0) == 0
    assert slabs.cached(key(7), "@run-1") is ref()  # the next load: no import
    assert key(7) not in slabs.retired  # revived
    assert slabs.reap(now=1000.0) == 0 and not gone(ref)


def test_unused_mapping_is_let_go_after_its_window(slabs) -> None:
    m = Mapping()
    ref = weakref.ref(m)
    slabs.add_vmm(key(1), "@run-1", m)
    slabs.descs[key(1)] = object()
    del m
    slabs.drop_vmm("/mnt/a", now=0.0, retain=2.5)
    assert slabs.reap(now=2.5) == 1
    assert gone(ref)
    assert slabs.cached(key(1), "@run-1") is None
    assert key(1) not in slabs.descs and key(1) not in slabs.vmm


def test_mapping_of_another_daemon_run_is_never_used(slabs) -> None:
    # A daemon restarted with the same pid hands out the same slab ids for new memory.
    m = Mapping()
    ref = weakref.ref(m)
    slabs.add_vmm(key(3), "@gdsfs-slabs-4242-aaaa", m)
    slabs.descs[key(3)] = object()
    del m
    assert slabs.cached(key(3), "@gdsfs-slabs-4242-bbbb") is None
    assert gone(ref)
    assert key(3) not in slabs.descs  # its descriptor is of the old run too


@pytest.mark.parametrize("env,want", [
    ("", _core.SLAB_RETAIN_S),
    ("0", 0.0),
    ("-3", -3.0),
    ("2.5", 2.5),
    ("soon", _core.SLAB_RETAIN_S),
    ("nan", _core.SLAB_RETAIN_S),
    ("inf", _core.SLAB_RETAIN_S),
])
def test_retain_window_from_the_environment(monkeypatch, env: str, want: float) -> None:
    monkeypatch.setenv(_core.SLAB_RETAIN_ENV, env)
    assert _core._slab_retain_s() == want


def test_no_window_drops_at_the_session_end(slabs, monkeypatch) -> None:
    monkeypatch.setenv(_core.SLAB_RETAIN_ENV, "0")
    m = Mapping()
    ref = weakref.ref(m)
    slabs.add_vmm(key(5), "@run-1", m)
    del m
    slabs.drop_vmm("/mnt/a")
    assert gone(ref) and not slabs.retired and slabs.timer is None


def test_only_the_ended_mount_is_retired_and_a_timer_serves_it(slabs) -> None:
    a, b = Mapping(), Mapping()
    slabs.add_vmm(key(1, "/mnt/a"), "@r", a)
    slabs.add_vmm(key(1, "/mnt/b"), "@r", b)
    slabs.tensors[key(9, "/mnt/a")] = Mapping()  # legacy IPC / host: never retired
    slabs.drop_vmm("/mnt/a", retain=60.0)
    assert set(slabs.retired) == {key(1, "/mnt/a")}
    assert slabs.timer is not None and slabs.timer.daemon
    assert key(9, "/mnt/a") in slabs.tensors


def test_fork_reset_forgets_everything(slabs) -> None:
    slabs.add_vmm(key(1), "@r", Mapping())
    slabs.drop_vmm("/mnt/a", now=0.0, retain=5.0)
    slabs.reset()
    assert not slabs.vmm and not slabs.retired and not slabs.tensors and slabs.timer is None


def test_a_real_session_end_retires_its_mounts_mappings(gdsfs_mount, monkeypatch) -> None:
    # A load's session (host mode here) ends: a descriptor-mapped slab of its mount is retired,
    # not dropped, and the host slab it mapped by path stays for the life of the process.
    import os

    monkeypatch.setenv(_core.SLAB_RETAIN_ENV, "30")
    with open(os.path.join(gdsfs_mount.src, "retain.bin"), "wb") as f:
        f.write(os.urandom(8192))
    k = (gdsfs_mount.mnt, 4242, 99)
    m = Mapping()
    _core._slabs.add_vmm(k, "@run", m)
    try:
        with _core.Session(gdsfs_mount.mnt) as s, open(gdsfs_mount.path("retain.bin"), "rb") as f:
            [ref] = s.read(f, [(0, 8192)])
            assert bytes(s.host_buffer(ref)[:4])
            s.release([ref])
        assert k in _core._slabs.retired and _core._slabs.cached(k, "@run") is m
        assert (gdsfs_mount.mnt, s.hello.daemon_pid, ref.slab) in _core._slabs.host
    finally:
        with _core._slabs.lock:
            _core._slabs._drop(k)


def test_slab_size_is_asked_once_per_daemon_run(monkeypatch) -> None:
    from types import SimpleNamespace

    from gdsfs._ckpt import tensorio

    monkeypatch.setattr(_core, "_slabs", _core._ProcessSlabs())
    asked = []

    def session(run: str, size: int = 32 << 20) -> SimpleNamespace:
        def status() -> dict:
            asked.append(run)
            return {"pool": {"slab_bytes": size}}
        return SimpleNamespace(mount="/mnt/a", hello=SimpleNamespace(daemon_pid=7, slab_socket=run), status=status)

    assert tensorio.slab_bytes(session("@r1")) == 32 << 20
    assert tensorio.slab_bytes(session("@r1")) == 32 << 20
    assert asked == ["@r1"]  # the second load asked nothing
    assert tensorio.slab_bytes(session("@r2", 16 << 20)) == 16 << 20  # a restarted daemon: asked again
    assert tensorio.slab_bytes(session("@r3", -1)) == tensorio.DEFAULT_SLAB_BYTES  # malformed: the default
    assert tensorio.slab_bytes(session("", 8 << 20)) == 8 << 20  # no run to key on: asked every time
    assert tensorio.slab_bytes(session("", 8 << 20)) == 8 << 20
    assert asked == ["@r1", "@r2", "@r3", "", ""]
