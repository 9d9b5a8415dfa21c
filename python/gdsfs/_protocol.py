"""Encoding of the gdsfs control-path wire protocol, version 1.

docs/protocol.md is normative; this module mirrors it with struct formats.
Every command is _IOWR and uses one fixed-size buffer that holds the request
on the way in and the reply on the way out.
"""

from __future__ import annotations

import errno as _errno
import os
import socket
import struct
from typing import NamedTuple, Sequence

MAGIC = 0x53464447
VERSION = 1
HEADER_BYTES = 32
MAX_RANGES = 256
MAX_RELEASE = 256
NAMES_BYTES = 12288
PAGE_DATA_OFFSET = 64

DEVICE_HOST = -1

CAP_HOST_SLABS = 1 << 0
CAP_CUDA_SLABS = 1 << 1
CAP_READ_NAMES = 1 << 2
CAP_INDEX = 1 << 3
CAP_WRITE = 1 << 4
CAP_SLAB_FD = 1 << 5  # slab descriptors on the slab socket named in HELLO
CAP_DEVICE_UUIDS = 1 << 6  # STATUS names each CUDA device's UUID (pool.devices[].uuid)
CAP_READ_VERSION = 1 << 7  # INDEX names the file's version; READ at a version is ESTALE once it changed
CAP_INDEX_COLUMNS = 1 << 8  # INDEX flags bit 0: a tar's index in the columns form (docs/index-format.md)

INDEX_FLAG_COLUMNS = 1  # INDEX flags bit 0 (with CAP_INDEX_COLUMNS)
INDEX_FORM_JSON = 0  # Page.form: the JSON document
INDEX_FORM_TAR_COLUMNS = 1  # Page.form: a tar's columns document (gdsfs._indexcols)

READ_FLAG_VERSION = 1  # READ flags bit 0: the request's version field holds INDEX's version

SLAB_KIND_HOST = 1
SLAB_KIND_CUDA = 2  # legacy 64-byte CUDA IPC handle (a bearer capability)
SLAB_KIND_CUDA_FD = 3  # CUDA virtual memory: fetch a descriptor from the slab socket

WRITE_SYNC = 1

ENGINES = {0: "none", 1: "host", 2: "posix", 3: "gds", 4: "gds-compat", 5: "tier"}


def _iowr(nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (0x47 << 8) | nr


HELLO_SIZE = 256
SLAB_SIZE = 640
ALLOC_SIZE = 128
RELEASE_SIZE = 2112
STATUS_SIZE = 16320
READ_SIZE = 12352
WRITE_SIZE = 128
INDEX_SIZE = 16320
PIN_SIZE = 128

HELLO = _iowr(0x01, HELLO_SIZE)
SLAB = _iowr(0x02, SLAB_SIZE)
ALLOC = _iowr(0x03, ALLOC_SIZE)
RELEASE = _iowr(0x04, RELEASE_SIZE)
STATUS = _iowr(0x05, STATUS_SIZE)
READ = _iowr(0x10, READ_SIZE)
READ_NAMES = _iowr(0x11, READ_SIZE)
WRITE = _iowr(0x12, WRITE_SIZE)
INDEX = _iowr(0x13, INDEX_SIZE)
PIN = _iowr(0x14, PIN_SIZE)
PIN_UNPIN = 1  # PIN flags bit 0: drop the file from the daemon's memory tier

_HEADER = struct.Struct("<IHHQQQ")
_LEASE = struct.Struct("<QQQQQII")
LEASE_BYTES = _LEASE.size  # 48


class Token(NamedTuple):
    """A session token: (session id, secret)."""

    session: int
    secret: int


class Hello(NamedTuple):
    """The HELLO reply."""

    version: int
    uid: int
    caps: int
    token: Token
    max_ranges: int
    max_names_bytes: int
    align: int
    devices: int
    max_lease: int
    page: int
    daemon_pid: int
    engine: str
    daemon_version: str
    slab_socket: str = ""  # with CAP_SLAB_FD: "@name" (abstract) or a path


class LeaseDesc(NamedTuple):
    """A lease descriptor (READ, READ_NAMES and ALLOC replies)."""

    lease: int
    slab: int
    offset: int
    length: int
    valid: int
    engine: int


class SlabDesc(NamedTuple):
    """The SLAB reply: how to map a slab."""

    slab: int
    size: int
    map_offset: int
    kind: int
    device: int
    handle: bytes


class Page(NamedTuple):
    """One page of a STATUS or INDEX document."""

    total: int
    generation: int
    data: bytes
    version: int = 0  # INDEX, with CAP_READ_VERSION: the file's version the index was parsed from
    form: int = 0  # INDEX: INDEX_FORM_JSON, or INDEX_FORM_TAR_COLUMNS (asked with INDEX_FLAG_COLUMNS)


def request(size: int, token: Token | None = None) -> bytearray:
    """A zeroed request buffer of size bytes with the common header filled."""
    buf = bytearray(size)
    s, k = token if token is not None else (0, 0)
    _HEADER.pack_into(buf, 0, MAGIC, VERSION, 0, s, k, 0)
    return buf


def _cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("ascii", "replace")


def decode_hello(buf: bytes) -> Hello:
    version, uid, caps, sess, secret, max_ranges, max_names, align, devices = struct.unpack_from("<IIQQQIIII", buf, 32)
    max_lease, page, pid = struct.unpack_from("<QQI", buf, 80)
    return Hello(
        version=version,
        uid=uid,
        caps=caps,
        token=Token(sess, secret),
        max_ranges=max_ranges,
        max_names_bytes=max_names,
        align=align,
        devices=devices,
        max_lease=max_lease,
        page=page,
        daemon_pid=pid,
        engine=_cstr(buf[104:136]),
        daemon_version=_cstr(buf[136:168]),
        slab_socket=_cstr(buf[168:256]),
    )


def encode_slab(token: Token | None, slab: int) -> bytearray:
    buf = request(SLAB_SIZE, token)
    struct.pack_into("<Q", buf, 32, slab)
    return buf


def decode_slab(buf: bytes) -> SlabDesc:
    slab, size, map_offset, kind, device, handle_len = struct.unpack_from("<QQQIiI", buf, 32)
    if handle_len > 512:
        raise ValueError(f"gdsfs: SLAB reply handle_len {handle_len} > 512")
    return SlabDesc(slab, size, map_offset, kind, device, bytes(buf[128 : 128 + handle_len]))


# The slab socket (docs/protocol.md, "Slab descriptors"): SOCK_SEQPACKET,
# one request message, one reply message with one descriptor (SCM_RIGHTS).
SLAB_FD_REQUEST = struct.Struct("<IHHQQQQ")  # magic, version 1, op 1, session, secret, slab, reserved
SLAB_FD_REPLY = struct.Struct("<IHHIIQQ")  # magic, version, reserved, errno, reserved, slab, bytes


def fetch_slab_fd(addr: str, daemon_pid: int, token: Token, slab: int, timeout: float = 30.0) -> tuple[int, int]:
    """A descriptor of slab's memory from the daemon's slab socket, and the
    bytes to map through it. The caller closes the descriptor.

    The daemon hands it only to a process of the session's uid whose
    session holds a lease in the slab (it checks SO_PEERCRED); we check in
    turn that the socket is served by the daemon's pid, so a name left by a
    daemon that exited cannot be squatted to collect tokens.

    Raises:
        OSError: errno of the daemon's refusal (EPERM, ENOENT, ...) or of
            the connection.
    """
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout)
        s.connect("\0" + addr[1:] if addr.startswith("@") else addr)
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        if daemon_pid and pid != daemon_pid:
            raise OSError(_errno.EPERM, f"gdsfs: the slab socket {addr!r} is served by pid {pid}, not the daemon (pid {daemon_pid}): refusing it")
        s.sendall(SLAB_FD_REQUEST.pack(MAGIC, 1, 1, token.session, token.secret, slab, 0))
        msg, fds, flags, _addr = socket.recv_fds(s, SLAB_FD_REPLY.size + 1, 4, socket.MSG_CMSG_CLOEXEC)
        try:
            if not msg and not fds:
                raise OSError(_errno.ECONNRESET, "gdsfs: the daemon closed the slab socket without a reply (too many connections of this uid at once? retry)")
            if flags & socket.MSG_CTRUNC:
                raise OSError(_errno.EBADMSG, "gdsfs: slab socket reply carried more descriptors than one")
            if len(msg) != SLAB_FD_REPLY.size:
                raise OSError(_errno.EBADMSG, f"gdsfs: slab socket reply of {len(msg)} bytes")
            magic, version, _r0, err, _r1, got_slab, nbytes = SLAB_FD_REPLY.unpack(msg)
            if magic != MAGIC or version != 1:
                raise OSError(_errno.EBADMSG, "gdsfs: slab socket reply with a bad magic or version")
            if err:
                raise OSError(err, f"gdsfs: the daemon refused slab {slab}: {os.strerror(err)}")
            if len(fds) != 1 or got_slab != slab:
                raise OSError(_errno.EBADMSG, f"gdsfs: slab socket reply for slab {got_slab} with {len(fds)} descriptors")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds[0], nbytes
    finally:
        s.close()


def encode_alloc(token: Token | None, device: int, length: int) -> bytearray:
    buf = request(ALLOC_SIZE, token)
    struct.pack_into("<iIQ", buf, 32, device, 0, length)
    return buf


def decode_lease(buf: bytes, off: int) -> LeaseDesc:
    lease, slab, offset, length, valid, engine, _ = _LEASE.unpack_from(buf, off)
    return LeaseDesc(lease, slab, offset, length, valid, engine)


def encode_release(token: Token | None, ids: Sequence[int]) -> bytearray:
    if not 1 <= len(ids) <= MAX_RELEASE:
        raise ValueError(f"gdsfs: RELEASE of {len(ids)} ids (1..{MAX_RELEASE})")
    buf = request(RELEASE_SIZE, token)
    struct.pack_into("<I", buf, 32, len(ids))
    struct.pack_into(f"<{len(ids)}Q", buf, 64, *ids)
    return buf


def decode_release(buf: bytes, count: int) -> tuple[int, list[int]]:
    (released,) = struct.unpack_from("<I", buf, 32)
    return released, list(struct.unpack_from(f"<{count}i", buf, 64))


def encode_page(token: Token | None, size: int, offset: int, flags: int = 0) -> bytearray:
    """A STATUS/INDEX page request; flags: INDEX only (INDEX_FLAG_COLUMNS)."""
    buf = request(size, token)
    struct.pack_into("<QI", buf, 32, offset, flags)
    return buf


def decode_page(buf: bytes) -> Page:
    total, generation, n = struct.unpack_from("<QQI", buf, 32)
    if n > len(buf) - PAGE_DATA_OFFSET:
        raise ValueError(f"gdsfs: page len {n} exceeds the buffer")
    (form,) = struct.unpack_from("<I", buf, 52)
    (version,) = struct.unpack_from("<Q", buf, 56)
    return Page(total, generation, bytes(buf[PAGE_DATA_OFFSET : PAGE_DATA_OFFSET + n]), version, form)


def encode_read(token: Token, device: int, ranges: Sequence[tuple[int, int]], version: int = 0) -> bytearray:
    """A READ request; version (INDEX's, non-zero) asks for ESTALE unless the file is at it."""
    n = len(ranges)
    if not 1 <= n <= MAX_RANGES:
        raise ValueError(f"gdsfs: READ of {n} ranges (1..{MAX_RANGES})")
    buf = request(READ_SIZE, token)
    struct.pack_into("<iII", buf, 32, device, READ_FLAG_VERSION if version else 0, n)
    if version:
        struct.pack_into("<Q", buf, 48, version)
    flat: list[int] = []
    for off, length in ranges:
        flat.append(off)
        flat.append(length)
    struct.pack_into(f"<{2 * n}Q", buf, 64, *flat)
    return buf


def encode_read_names(token: Token, device: int, names: Sequence[str]) -> bytearray:
    n = len(names)
    if not 1 <= n <= MAX_RANGES:
        raise ValueError(f"gdsfs: READ_NAMES of {n} names (1..{MAX_RANGES})")
    area = b"".join(name.encode() + b"\0" for name in names)
    if len(area) > NAMES_BYTES:
        raise ValueError(f"gdsfs: READ_NAMES names take {len(area)} bytes (max {NAMES_BYTES})")
    buf = request(READ_SIZE, token)
    struct.pack_into("<iIII", buf, 32, device, 0, n, len(area))
    buf[64 : 64 + len(area)] = area
    return buf


def decode_read(buf: bytes, count: int) -> list[LeaseDesc]:
    return [decode_lease(buf, 64 + i * LEASE_BYTES) for i in range(count)]


def encode_write(token: Token, lease: int, lease_offset: int, file_offset: int, length: int, *, sync: bool = False) -> bytearray:
    buf = request(WRITE_SIZE, token)
    struct.pack_into("<QQQQI", buf, 32, lease, lease_offset, file_offset, length, WRITE_SYNC if sync else 0)
    return buf


def decode_write(buf: bytes) -> tuple[int, int]:
    written, engine = struct.unpack_from("<QI", buf, 32)
    return written, engine


class PinReply(NamedTuple):
    """The PIN reply (docs/protocol.md 3.9): the file and the daemon's memory tier."""

    size: int
    cached: int
    filled: int
    chunk: int
    budget: int
    used: int
    yours: int
    share: int


def encode_pin(token: Token | None, offset: int, length: int, *, unpin: bool = False) -> bytearray:
    """PIN carries no session (the token is ignored: None sends zeros)."""
    buf = request(PIN_SIZE, token)
    struct.pack_into("<QQI", buf, 32, offset, length, PIN_UNPIN if unpin else 0)
    return buf


def decode_pin(buf: bytes) -> PinReply:
    return PinReply(*struct.unpack_from("<8Q", buf, 32))


ERRNO_HINTS = {
    _errno.EAGAIN: "the daemon's buffer pool is full: release leases (consume batches), or have root mount with a larger --gpu-pool/--host-pool (or --uid-share)",
    _errno.E2BIG: "a range is larger than one slab: split it",
    _errno.EPERM: "the session token is not valid for this process (session ended, or another uid)",
    _errno.ENODEV: "the daemon has no slabs for that device",
    _errno.ENOTTY: "the file is not on a gdsfs mount, or the daemon does not speak this command",
    _errno.EPROTO: "the daemon speaks another protocol version: upgrade the gdsfs Python package",
    _errno.EROFS: "the mount is read-only",
    _errno.EBADF: "the file is not open for writing",
    _errno.EOPNOTSUPP: "the entry is not one plain byte range (compressed zip record, sparse tar member): read it with plain I/O",
    _errno.ENODATA: "the file has no recognised format (tar, MDS, safetensors, torch zip, npy)",
    _errno.ESTALE: "the file changed (rewritten in place) since its index was read: read its index again",
    _errno.ENOTCONN: "the gdsfs daemon exited: run `gdsfs mount` on the mountpoint again, then reopen files and sessions",
    _errno.ECONNABORTED: "the gdsfs daemon exited: run `gdsfs mount` on the mountpoint again, then reopen files and sessions",
}
