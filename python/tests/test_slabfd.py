"""The slab socket from the Python client, against a live host-mode mount:
the session's own process gets a descriptor of its slab's memory; a process
of another uid presenting the session's token and slab id, or a forged
token, gets the daemon's EPERM and no descriptor."""

from __future__ import annotations

import errno
import mmap
import os

import pytest

import gdsfs
from gdsfs import _protocol as proto

OTHER_UID = 10002


def _file(gdsfs_mount, name: str, n: int) -> bytes:
    data = os.urandom(n)
    with open(os.path.join(gdsfs_mount.src, name), "wb") as f:
        f.write(data)
    return data


def test_hello_names_the_slab_socket(gdsfs_mount) -> None:
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        assert s.hello.caps & proto.CAP_SLAB_FD
        assert s.hello.slab_socket.startswith("@gdsfs-slabs-") or s.hello.slab_socket.startswith("/")


def test_own_slab_by_descriptor(gdsfs_mount) -> None:
    data = _file(gdsfs_mount, "slabfd-own.bin", 200000)
    with gdsfs.Session(gdsfs_mount.mnt, device=proto.DEVICE_HOST) as s, open(gdsfs_mount.path("slabfd-own.bin"), "rb") as f:
        [ref] = s.read(f, [(777, 150000)])
        fd, nbytes = s.slab_fd(ref.slab)
        try:
            m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with m:
            assert m[ref.offset : ref.offset + ref.valid] == data[777 : 777 + 150000]
        s.release([ref])
        # Released: the session holds no lease in the slab any more.
        with pytest.raises(gdsfs.GDSUnavailableError) as e:
            s.slab_fd(ref.slab)
        assert e.value.errno == errno.EPERM


def _as_other_uid(fn) -> int:
    """Run fn() in a forked child as OTHER_UID; return its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setresgid(OTHER_UID, OTHER_UID, OTHER_UID)
            os.setresuid(OTHER_UID, OTHER_UID, OTHER_UID)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
@pytest.mark.parametrize("forge", [False, True], ids=["stolen token", "forged token"])
def test_other_uid_gets_nothing(gdsfs_mount, forge: bool) -> None:
    _file(gdsfs_mount, "slabfd-victim.bin", 100000)
    with gdsfs.Session(gdsfs_mount.mnt, device=proto.DEVICE_HOST) as s, open(gdsfs_mount.path("slabfd-victim.bin"), "rb") as f:
        [ref] = s.read(f, [(0, 100000)])
        tok = proto.Token(s.token.session, s.token.secret ^ 1) if forge else s.token

        def steal() -> int:
            try:
                fd, _ = proto.fetch_slab_fd(s.hello.slab_socket, s.hello.daemon_pid, tok, ref.slab)
            except OSError as e:
                return 0 if e.errno == errno.EPERM else 3
            os.close(fd)
            return 2  # handed a descriptor: the leak this test is about

        assert _as_other_uid(steal) == 0
        # The owner still gets its slab.
        fd, _ = s.slab_fd(ref.slab)
        os.close(fd)
        s.release([ref])


def test_refuses_a_socket_not_served_by_the_daemon(gdsfs_mount) -> None:
    with gdsfs.Session(gdsfs_mount.mnt) as s:
        with pytest.raises(OSError) as e:
            proto.fetch_slab_fd(s.hello.slab_socket, s.hello.daemon_pid + 1, s.token, 1)
        assert "not the daemon" in str(e.value)


def test_token_only_session_maps_by_descriptor(gdsfs_mount) -> None:
    """A Ref that reaches a process which never saw the session's HELLO (a
    pickled descriptor) still maps its slab: the token-only session learns
    the slab socket from a HELLO of its own."""
    import pickle

    from gdsfs import _core

    data = _file(gdsfs_mount, "slabfd-token.bin", 60000)
    with gdsfs.Session(gdsfs_mount.mnt, device=proto.DEVICE_HOST) as s, open(gdsfs_mount.path("slabfd-token.bin"), "rb") as f:
        [ref] = s.read(f, [(100, 50000)])
        blob = pickle.dumps(ref)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _core._open_sessions.clear()  # as in a process that never opened it
                r = pickle.loads(blob)
                t = _core.session_for(r)
                assert not t.hello.slab_socket
                fd, n = t.slab_fd(r.slab)
                with mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                    code = 0 if m[r.offset : r.offset + r.valid] == data[100:50100] else 2
                os.close(fd)
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        s.release([ref])
