"""The torch-free core of the gdsfs client: sessions, leases, slabs.

Core API for other modules (gdsfs.torch, gdsfs.safetensors, gdsfs.checkpoint,
gdsfs.dcp). These signatures are stable; everything not listed is private.

    find_mount(path) -> str | None
        The gdsfs mount root containing path, or None when path is not on a
        gdsfs mount (no exception).

    Session.open(path, *, device=None, strict=False) -> Session | None
        A session of the gdsfs mount that holds path. Returns None (after a
        one-time GDSFallbackWarning) when path is not on a gdsfs mount or the
        daemon cannot serve it; strict=True raises GDSUnavailableError instead.
        device=None targets the daemon's default device (host mode: host
        memory). Sessions are context managers; close() is idempotent, stops
        new reads at once and ends the session (every lease back to the
        pool) when nothing in this process holds one of its leases any more
        (gdsfs._leases; docs/pytorch.md, "Lease ownership"). A Session
        pickles as a small token:
        the unpickled copy (e.g. in a DataLoader worker) can read() but not
        map slabs or release (those stay with the process that opened it).
        CUDA device numbers (device=, Ref.device) are this process's
        (torch's cuda:N); the session names the daemon's ordinal of the
        same GPU, matched by UUID, and pickles that translation along
        (gdsfs._devmap).

    session.host_mode -> bool            True when slabs are host shared memory
    session.device -> int                target device (-1 in host mode)

    session.read(fd, ranges, *, device=None) -> list[Ref]
        Read byte ranges [(offset, length), ...] of an open file on the mount
        (fd: int or an object with fileno()) into slab memory with as few
        ioctls as the protocol allows. One Ref per range, in order; when it
        returns, the bytes are in place. Ref.valid < Ref.length only at EOF.

    session.read_names(fd, names, *, device=None) -> list[Ref]
        The same for index entries by name (tar member path, MDS
        "sample/<i>/<column>", safetensors tensor, zip record, "data" of .npy).

    session.alloc(nbytes, *, device=None) -> Ref
        A writable lease of nbytes (for checkpoint save).

    session.host_buffer(ref) -> memoryview
        Host mode only: a writable memoryview of exactly ref's bytes in the
        mmapped slab (the slab is mapped once per process and cached).

    session.write(fd, ref, offset, nbytes=None, *, lease_offset=0, sync=False) -> int
        Have the daemon write ref's bytes (or the first nbytes) to the open
        file fd (opened writable on the mount) at offset. Returns bytes written.

    session.release(refs, *, check=False) -> None
        Return leases to the pool; their holders here are done with them.
        Releasing twice is an error from the daemon, ignored here unless
        check=True (GDSLeaseError).

    session.slab_info(slab_id) -> SlabInfo
        (kind, size, handle): handle is the shm path (host), empty for CUDA
        virtual memory (kind 3: map it from session.slab_fd), or the 64-byte
        legacy CUDA IPC handle (kind 2, old drivers); cached. gdsfs.torch
        uses it to map slabs.
    session.slab_fd(slab_id) -> (fd, nbytes)
        A descriptor of the slab's memory from the daemon's slab socket,
        handed only to a process of the session's uid (the caller closes it).

    capabilities(path) -> Capabilities      what the daemon serves for path
    layout(path) -> dict                    the daemon's parsed index (JSON)
    status(path) -> dict                    sessions, leases, pool, counters

    gdsfs.torch.tensor_from_ref(ref, dtype, shape, device=None, *, copy=True,
                                session=None, release=None) -> torch.Tensor
        Materialize a Ref as a tensor: CPU tensor from the host slab in host
        mode; a CUDA tensor (D2D copy, or a zero-copy view with copy=False)
        from the IPC-mapped slab otherwise. release defaults to True with
        copy=True (lease released after the copy, the daemon's answer
        checked: GDSLeaseError) and False with copy=False (the caller
        releases; the view keeps the session alive; release=True: the view
        owns the lease, released when it dies).
    gdsfs.torch.writable_view(session, ref, dtype, shape) -> torch.Tensor
        A tensor view of an allocated lease to fill (host or CUDA).

Ref is a frozen, picklable descriptor: it crosses process boundaries, slabs
and file descriptors never do.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import functools
import json
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, Union

from . import _devmap, _leases
from . import _protocol as proto
from ._errors import GDSLeaseError, GDSUnavailableError, warn_fallback

__all__ = [
    "Capabilities",
    "Ref",
    "Session",
    "capabilities",
    "find_mount",
    "is_gdsfs_path",
    "layout",
    "status",
]

PathLike = Union[str, "os.PathLike[str]"]
CONTROL_NAME = ".gdsfs"
INFO_XATTR = "user.gdsfs.info"
INDEX_XATTR = "user.gdsfs.index"
STATS_XATTR = "user.gdsfs.stats"

# How long read()/alloc() retry on EAGAIN (pool full) before giving up. In a
# DataLoader the main process releases leases as it consumes batches, so a
# worker that finds the pool full waits for it to drain.
EAGAIN_TIMEOUT_S = 120.0


def _close_quietly(fd: int) -> None:
    """close(fd); the descriptor is gone even when close reports an error
    (ENOTCONN: the daemon died), and there is nothing left to do about it."""
    try:
        os.close(fd)
    except OSError:
        pass


def _fileno(f: Any) -> int:
    return f if isinstance(f, int) else f.fileno()


def _daemon_error(op: str, err: OSError, what: str = "") -> GDSUnavailableError:
    hint = proto.ERRNO_HINTS.get(err.errno or 0, "see the daemon log")
    name = _errno.errorcode.get(err.errno or 0, str(err.errno))
    where = f" {what}" if what else ""
    return GDSUnavailableError(f"gdsfs: {op}{where} failed: {name}: {hint}", errno=err.errno)


def find_mount(path: PathLike) -> str | None:
    """The root of the gdsfs mount that holds path, or None.

    Args:
        path: any existing path (file or directory).

    Returns:
        The absolute mount root, or None when path is not on a gdsfs mount.

    Raises:
        GDSUnavailableError: path lies under a FUSE mount whose daemon exited (errno ENOTCONN),
            or under a gdsfs mount made without --allow-other by another uid (EACCES), where
            neither the daemon nor plain reads can serve it.
    """
    try:
        p = os.path.realpath(os.fspath(path))
    except (TypeError, ValueError):
        return None
    _raise_if_dead_mount(p)
    if not os.path.exists(p):
        p = os.path.dirname(p)
    while True:
        if os.path.ismount(p):
            ctl = os.path.join(p, CONTROL_NAME)
            try:
                os.getxattr(p, INFO_XATTR)
            except OSError:
                return None
            return p if os.path.exists(ctl) else None
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _gdsfs_mount_points() -> set[str]:
    """The mount points of gdsfs mounts in this process's mount table (/proc/self/mountinfo)."""
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        fields = line.split()
        if "-" in fields[6:] and fields[fields.index("-", 6) + 1:][:1] == ["fuse.gdsfs"]:
            out.add(fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\"))
    return out


def _raise_if_dead_mount(p: str) -> None:
    """Raise GDSUnavailableError when a directory on the way from p to / is a gdsfs mount this
    process cannot use: one answering ENOTCONN (the mount of a daemon that exited, left in place
    until someone cleans it up), or a gdsfs mount answering EACCES (mounted without --allow-other,
    so the kernel refuses every uid but the one that mounted it)."""
    dead, refused = "", ""
    q = p
    while True:
        try:
            os.stat(q)
            break
        except OSError as e:
            if e.errno in (_errno.ENOTCONN, _errno.ECONNABORTED):
                dead = q  # the topmost one is the mount point
            elif e.errno == _errno.EACCES:
                refused = q
        parent = os.path.dirname(q)
        if parent == q:
            break
        q = parent
    if dead:
        raise GDSUnavailableError(
            f"gdsfs: the mount at {dead!r} is not connected (its daemon exited): run `gdsfs mount` on it "
            f"again (that cleans it up), or `gdsfs unmount --force {dead}`", errno=_errno.ENOTCONN)
    if refused and refused in _gdsfs_mount_points():
        raise GDSUnavailableError(
            f"gdsfs: the gdsfs mount at {refused!r} refuses uid {os.geteuid()}: it was mounted without --allow-other; "
            "mount it with `gdsfs mount --allow-other` to let other users in", errno=_errno.EACCES)


def is_gdsfs_path(path: PathLike) -> bool:
    """True when path lies on a gdsfs mount."""
    return find_mount(path) is not None


def on_gdsfs(path: PathLike, *, strict: bool, cause: str, doing: str = "using plain reads") -> bool:
    """True when path lies on a gdsfs mount; else the one-time GDSFallbackWarning and False.

    The check the file-format modules (gdsfs.safetensors, gdsfs.checkpoint, gdsfs.dcp) make
    before using the daemon. Call it from the public function (or method) the user called: the
    warning names that function's caller.

    Args:
        path: the file (or checkpoint directory) about to be read or written.
        strict: raise GDSUnavailableError instead of warning.
        cause: what makes two fallbacks the same, warned about once per process (e.g.
            "off-mount checkpoint").
        doing: what the caller does instead ("using plain reads", "using plain writes").
    """
    if find_mount(path) is not None:
        return True
    warn_fallback(f"{os.fspath(path)!r} is not on a gdsfs mount", strict=strict, stacklevel=4, cause=cause, doing=doing,
                  fix="mount its directory with `gdsfs mount`")
    return False


@dataclass(frozen=True)
class Ref:
    """A picklable descriptor of one lease: bytes the daemon put in a slab.

    Refs cross process boundaries (DataLoader workers hand them to the main
    process); slabs and descriptors never do. The bytes of the range are
    ``[offset, offset + valid)`` of slab ``slab``.

    Attributes:
        mount: root of the gdsfs mount that served the read.
        session: session id of the token the lease belongs to.
        secret: secret of that token.
        daemon_pid: the daemon process (slab ids are unique per daemon run).
        lease: lease id (0 when no memory was needed: valid == 0).
        slab: slab id (0 when lease is 0).
        offset: byte offset in the slab of the first requested byte.
        length: the requested length.
        valid: bytes of file data at offset (< length only at end of file).
        device: -1 for host shared memory, else the CUDA ordinal of the slab's GPU as the
            reading process numbers it (torch's cuda:N; the daemon's own ordinal may differ:
            gdsfs._devmap, docs/pytorch.md "Which GPU").
        engine: name of the engine that moved the bytes (host, posix, gds, ...).
    """

    mount: str
    session: int
    secret: int
    daemon_pid: int
    lease: int
    slab: int
    offset: int
    length: int
    valid: int
    device: int
    engine: str

    @property
    def token(self) -> proto.Token:
        return proto.Token(self.session, self.secret)


@dataclass(frozen=True)
class Capabilities:
    """What the gdsfs daemon serves for a path.

    Attributes:
        mount: the mount root.
        engine: engine serving this path (host, posix, gds, gds-compat).
        reason: why that engine was chosen.
        gds: True when true or compat cuFile serves the path.
        devices: the daemon's CUDA device ordinals with slabs ([] in host mode).
        host_slabs: True when shared host memory slabs are served.
        io_alignment: alignment the daemon widens reads to.
        max_lease: largest range one lease can hold.
        format: index format of the file (tar, mds, safetensors, zip, npy) or "".
        daemon_version: the daemon's version string.
        writable: True when WRITE/ALLOC are served.
        info: the full user.gdsfs.info document.
        device_uuids: the UUID ("GPU-...") of each of the daemon's devices, by its ordinal
            ([] when it does not say: an older daemon, host memory).
    """

    mount: str
    engine: str
    reason: str
    gds: bool
    devices: list[int]
    host_slabs: bool
    io_alignment: int
    max_lease: int
    format: str
    daemon_version: str
    writable: bool
    info: dict[str, Any] = field(default_factory=dict)
    device_uuids: list[str] = field(default_factory=list)


def _require_mount(path: PathLike) -> str:
    mount = find_mount(path)
    if mount is None:
        raise GDSUnavailableError(f"gdsfs: {os.fspath(path)!r} is not on a gdsfs mount: mount its directory with `gdsfs mount`")
    return mount


def capabilities(path: PathLike) -> Capabilities:
    """What the daemon serves for path (which engine, devices, alignment).

    Args:
        path: a file or directory on a gdsfs mount.

    Raises:
        GDSUnavailableError: path is not on a gdsfs mount.

    Example:
        >>> gdsfs.capabilities("/mnt/data/shard-000.tar").engine
        'host'
    """
    mount = _require_mount(path)
    try:
        info = json.loads(os.getxattr(os.fspath(path), INFO_XATTR))
    except OSError as e:
        raise _daemon_error("getxattr user.gdsfs.info", e, repr(os.fspath(path))) from e
    fd = os.open(os.path.join(mount, CONTROL_NAME), os.O_RDONLY)
    try:
        hello = _hello(fd)
    finally:
        os.close(fd)
    engine = str(info.get("engine") or hello.engine)
    uuids: Sequence[str] = ()
    if hello.caps & proto.CAP_DEVICE_UUIDS and hello.devices > 0:
        uuids = _devmap.daemon_uuids(mount, hello.daemon_pid, hello.devices, lambda: status(mount), run=hello.slab_socket) or ()
    return Capabilities(
        mount=mount,
        engine=engine,
        reason=str(info.get("reason", "")),
        gds=engine in ("gds", "gds-compat"),
        devices=list(range(hello.devices)),
        host_slabs=bool(hello.caps & proto.CAP_HOST_SLABS),
        io_alignment=int(info.get("align", hello.align)),
        max_lease=hello.max_lease,
        format=str(info.get("format", "")),
        daemon_version=hello.daemon_version,
        writable=bool(hello.caps & proto.CAP_WRITE),
        info=info,
        device_uuids=[_devmap.spell(u) for u in uuids],
    )


# GDSFS_DEBUG_TIMING=1 (read when a Session is made or unpickled): each Session
# keeps session.timing = {"READ": [requests, seconds, ranges], "RELEASE": [...]}
# of its own READ and RELEASE ioctls (the round trip, as this process sees it);
# session.timing is None otherwise and costs nothing. For profiling
# (scripts/gpu/dataset_check.py --worker-profile); not a stable API.
DEBUG_TIMING_ENV = "GDSFS_DEBUG_TIMING"


def _timing_book() -> dict[str, list[float]] | None:
    return {} if os.environ.get(DEBUG_TIMING_ENV, "") not in ("", "0") else None


def _tally(book: dict[str, list[float]], op: str, t0: float, items: int) -> None:
    row = book.setdefault(op, [0, 0.0, 0])
    row[0] += 1
    row[1] += time.perf_counter() - t0
    row[2] += items


# fcntl.ioctl copies a mutable buffer of more than 1024 bytes into a
# temporary and holds the GIL for the whole call: a 1 GiB READ would stop
# every other Python thread of the process (a data loader, a writer) until
# the daemon answers. Those go through libc's ioctl via ctypes, which
# releases the GIL and works on the buffer in place.
_IOCTL_GIL_FREE_ABOVE = 1024


@functools.lru_cache(maxsize=None)
def _libc_ioctl() -> Any:
    """libc's ioctl through ctypes, looked up once (a race only builds it twice)."""
    f = ctypes.CDLL(None, use_errno=True).ioctl
    f.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


def _ioctl(fd: int, cmd: int, buf: bytearray) -> None:
    """ioctl(fd, cmd, buf) with buf read and written in place; OSError on failure.

    Buffers above 1024 bytes go through ctypes (GIL released), smaller ones
    through fcntl.ioctl (which releases the GIL for those already).
    """
    if len(buf) <= _IOCTL_GIL_FREE_ABOVE:
        fcntl.ioctl(fd, cmd, buf, True)
        return
    f = _libc_ioctl()
    # One c_char at buf's start (its address, and an export that keeps buf where it is): a
    # (c_char * len) type per length was a new class per call, garbage in a cycle for the
    # collector (issue 15: most of a 16 KiB worker's collection time).
    arr = ctypes.c_char.from_buffer(buf)
    try:
        rc = f(fd, cmd, ctypes.addressof(arr))
    finally:
        del arr  # drop the export, so the caller may refill buf
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))  # EINTR becomes InterruptedError, as fcntl's


def _ioctl_eintr(fd: int, cmd: int, buf: bytearray) -> None:
    """ioctl, redone when a signal interrupted it.

    For the requests that are safe to repeat (HELLO, STATUS pages, SLAB,
    RELEASE: its per-id status makes a second pass harmless). A signal that
    lands on the calling thread makes the kernel interrupt the FUSE request
    and the daemon abandon it with EINTR; that is no reason to fall back.
    """
    template = bytes(buf)
    while True:
        try:
            _ioctl(fd, cmd, buf)
            return
        except InterruptedError:
            buf[:] = template


def _paged(fd: int, cmd: int, size: int, op: str) -> bytes:
    return _paged_version(fd, cmd, size, op)[0]


def _paged_version(fd: int, cmd: int, size: int, op: str) -> tuple[bytes, int]:
    """A paged document and its first page's version (INDEX with CAP_READ_VERSION, else 0)."""
    doc, version, _form = _paged_form(fd, cmd, size, op, 0)
    return doc, version


def _paged_index(fd: int, *, columns: bool) -> tuple[bytes, int, int]:
    """fd's INDEX document, its version and its form (proto.INDEX_FORM_*); columns: ask for
    a tar's columns form (only with CAP_INDEX_COLUMNS: an older daemon refuses the flag)."""
    return _paged_form(fd, proto.INDEX, proto.INDEX_SIZE, "INDEX", proto.INDEX_FLAG_COLUMNS if columns else 0)


def _paged_form(fd: int, cmd: int, size: int, op: str, flags: int) -> tuple[bytes, int, int]:
    """A paged document asked for with flags, and its first page's version and form."""
    for _attempt in range(8):
        buf = proto.encode_page(None, size, 0, flags)
        _ioctl_eintr(fd, cmd, buf)
        first = proto.decode_page(buf)
        parts = [first.data]
        got = len(first.data)
        restart = False
        while got < first.total:
            buf = proto.encode_page(None, size, got, flags)
            _ioctl_eintr(fd, cmd, buf)
            page = proto.decode_page(buf)
            if page.generation != first.generation or page.version != first.version or page.form != first.form:
                restart = True
                break
            if not page.data:
                raise GDSUnavailableError(f"gdsfs: {op}: empty page at offset {got} of {first.total}")
            parts.append(page.data)
            got += len(page.data)
        if not restart:
            return b"".join(parts), first.version, first.form
    raise GDSUnavailableError(f"gdsfs: {op}: the document kept changing while being read; retry")


def layout(path: PathLike) -> dict[str, Any]:
    """The daemon's parsed index of a shard (tar, MDS, safetensors, zip, npy).

    Args:
        path: a file on a gdsfs mount.

    Returns:
        The index document (docs/index-format.md), as parsed JSON.

    Raises:
        GDSUnavailableError: not on a gdsfs mount, or the file has no
            recognised format (errno ENODATA).
    """
    _require_mount(path)
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        return json.loads(_paged(fd, proto.INDEX, proto.INDEX_SIZE, "INDEX"))
    except OSError as e:
        raise _daemon_error("INDEX", e, repr(os.fspath(path))) from e
    finally:
        os.close(fd)


def status(path: PathLike) -> dict[str, Any]:
    """The daemon's status document (sessions, leases, pool, counters).

    Args:
        path: any path on the mount (its root is used).
    """
    mount = _require_mount(path)
    fd = os.open(os.path.join(mount, CONTROL_NAME), os.O_RDONLY)
    try:
        return json.loads(_paged(fd, proto.STATUS, proto.STATUS_SIZE, "STATUS"))
    except OSError as e:
        raise _daemon_error("STATUS", e) from e
    finally:
        os.close(fd)


def _hello(fd: int) -> proto.Hello:
    buf = proto.request(proto.HELLO_SIZE)
    try:
        _ioctl_eintr(fd, proto.HELLO, buf)
    except OSError as e:
        raise _daemon_error("HELLO", e) from e
    h = proto.decode_hello(buf)
    if h.version != proto.VERSION:
        raise GDSUnavailableError(f"gdsfs: daemon speaks protocol {h.version}, this client {proto.VERSION}: upgrade the gdsfs Python package")
    return h


class _HostMapping:
    """One host slab mmapped into this process."""

    def __init__(self, desc: proto.SlabDesc) -> None:
        path = desc.handle.decode()
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, desc.size + desc.map_offset, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.base = desc.map_offset
        self.size = desc.size
        self.view = memoryview(self.mm)


def env_bytes(name: str, default: int) -> int:
    """The environment variable name as a byte count (0 or less: 0, i.e. off); unset, empty or
    not an integer: default. For the hints' sizes, which a bad value must never turn into an
    error."""
    v = os.environ.get(name, "")
    try:
        return max(0, int(v)) if v else default
    except ValueError:
        return default


# How long a CUDA virtual-memory slab mapping outlives the end of the last
# session of its mount in this process, in seconds (GDSFS_SLAB_RETAIN_S, 0
# to unmap at once). Every load_file and checkpoint load is a session of its
# own: a load that follows within the window (the next shard, the next
# load) finds its slabs still mapped, instead of importing, mapping and
# unmapping every slab again (H200, 8 GiB safetensors file from the memory
# tier: 49 slab imports, 1.5 ms each, made a load take 240 ms instead of 168).
SLAB_RETAIN_ENV = "GDSFS_SLAB_RETAIN_S"
SLAB_RETAIN_S = 10.0


def _slab_retain_s() -> float:
    """The retention window of GDSFS_SLAB_RETAIN_S: a number of seconds
    (0 or less: none); anything else, the default."""
    v = os.environ.get(SLAB_RETAIN_ENV, "")
    if not v:
        return SLAB_RETAIN_S
    try:
        x = float(v)
    except ValueError:
        return SLAB_RETAIN_S
    return x if x == x and x < 86400 else SLAB_RETAIN_S  # NaN, inf: the default


class _ProcessSlabs:
    """Per-process cache of slab descriptors and host mappings.

    A slab is mapped once per process (CUDA forbids opening an IPC handle
    twice in one process) and kept for the life of the process: slab ids are
    not reused while a daemon runs, and keys include the daemon's pid (a
    later run under the same pid clears them first: note_run).

    Slabs mapped from descriptors (CUDA virtual memory) are kept while a
    session of their mount is open here, and retired when one ends: a
    retired mapping still serves a later session of the same daemon run
    (the slab id names the same memory for the whole run, and slabs are per
    uid, so it is this uid's), and is dropped from the cache once it was not
    used for the retention window (the mapping then goes with the last
    tensor over it). A mapping made in another run of the daemon (a restart
    that reused its pid, hence its slab ids) is never used: its key carries
    the run (the daemon's slab socket name, unique per run) and is dropped
    on sight.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.descs: dict[tuple[str, int, int], proto.SlabDesc] = {}
        self.host: dict[tuple[str, int, int], _HostMapping] = {}
        self.tensors: dict[tuple[str, int, int], Any] = {}  # slab -> torch tensor (gdsfs.torch)
        # Slabs mapped from descriptors (CUDA virtual memory), with the
        # daemon run that handed them out (legacy IPC mappings stay for the
        # life of the process: CUDA cannot open one handle twice in one).
        self.vmm: dict[tuple[str, int, int], str] = {}
        # Retired vmm slabs: key -> monotonic deadline, after which reap drops them.
        self.retired: dict[tuple[str, int, int], float] = {}
        self.timer: threading.Timer | None = None
        self.timer_at = 0.0
        # The pool's slab size per daemon run (mount, pid, slab socket): one STATUS per run.
        self.slab_sizes: dict[tuple[str, int, str], int] = {}
        # The ids of this process's open sessions that used each vmm slab: a
        # session's end retires only the slabs no other open session used
        # (it would map them again, or hold a second mapping of one).
        self.users: dict[tuple[str, int, int], set[int]] = {}
        # The daemon run (slab socket name) last seen per (mount, pid): see note_run.
        self.runs: dict[tuple[str, int], str] = {}

    def note_run(self, mount: str, pid: int, run: str) -> None:
        """A session of daemon run ``run`` (its slab socket name) of pid ``pid`` opened on mount:
        forget everything cached for an earlier run of that pid there. A daemon restarted in a
        fresh pid namespace often has its old pid again, and its slab ids start again at 1: an old
        run's descriptor would name another file's memory, and its host mapping (of a file the old
        run removed) raises SIGBUS when touched. Tensors the user still holds over old mappings
        keep them alive; only the cache lets go."""
        if not run:
            return  # a session rebuilt from a Ref, or a daemon without a slab socket: cannot tell
        gone: list[Any] = []
        with self.lock:
            if self.runs.get((mount, pid), run) != run:
                caches: tuple[dict[tuple[str, int, int], Any], ...] = (
                    self.descs, self.host, self.tensors, self.vmm, self.retired, self.users)
                for d in caches:
                    for k in [k for k in d if k[0] == mount and k[1] == pid]:
                        gone.append(d.pop(k))
            self.runs[(mount, pid)] = run
        del gone  # let go of old mappings outside the lock (unmapping synchronizes the GPU)

    def add_vmm(self, key: tuple[str, int, int], run: str, tensor: Any, session: "Session | None" = None) -> None:
        """Cache tensor, the mapping of a slab from a descriptor of daemon run ``run``, made for
        ``session``."""
        with self.lock:
            self.vmm[key] = run
            self.retired.pop(key, None)
            self.tensors[key] = tensor
            if session is not None:
                self.users.setdefault(key, set()).add(session.token.session)

    def cached(self, key: tuple[str, int, int], run: str, session: "Session | None" = None) -> Any:
        """The cached tensor of a slab, or None; ``session`` now uses it too. A retired vmm
        mapping is revived; one of another daemon run is dropped (and None returned)."""
        with self.lock:
            t = self.tensors.get(key)
            if t is None or key not in self.vmm:
                return t
            if self.vmm[key] != run:
                stale = self._drop(key)
            else:
                self.retired.pop(key, None)
                if session is not None:
                    self.users.setdefault(key, set()).add(session.token.session)
                return t
        del stale  # unmapped (when no view is left) outside the lock
        return None

    def _drop(self, key: tuple[str, int, int]) -> Any:
        """Forget a vmm slab (caller holds lock); returns its tensor, for the
        caller to let go of outside the lock (unmapping synchronizes the GPU)."""
        self.vmm.pop(key, None)
        self.retired.pop(key, None)
        self.descs.pop(key, None)
        self.users.pop(key, None)
        return self.tensors.pop(key, None)

    def drop_vmm(self, mount: str, session: int | None = None, *, now: float | None = None,
                 retain: float | None = None) -> None:
        """A session of mount (id ``session``; None: any) ended in this process: retire the
        mount's vmm slabs that no other open session of the process used (dropped after the
        retention window unless used again), or drop them at once when the window is 0."""
        window = _slab_retain_s() if retain is None else retain
        gone = []
        with self.lock:
            keys = []
            for k in [k for k in self.vmm if k[0] == mount]:
                users = self.users.get(k)
                if users is not None and session is not None:
                    users.discard(session)
                    if users:
                        continue  # another open session of this process uses it
                keys.append(k)
            if window <= 0:
                gone = [self._drop(k) for k in keys]
            elif keys:
                deadline = (time.monotonic() if now is None else now) + window
                for k in keys:
                    self.retired[k] = deadline
                if now is None:
                    self._schedule(deadline)
        del gone

    def _schedule(self, deadline: float) -> None:
        """Have reap run at deadline (caller holds lock): one timer thread at
        a time, for the earliest deadline it must serve."""
        if self.timer is not None and self.timer_at <= deadline:
            return
        if self.timer is not None:
            self.timer.cancel()
        t = threading.Timer(max(0.0, deadline - time.monotonic()) + 0.05, self.reap)
        t.daemon = True
        t.name = "gdsfs-slab-retire"
        self.timer, self.timer_at = t, deadline
        t.start()

    def reap(self, now: float | None = None) -> int:
        """Drop the retired vmm slabs whose window passed; returns how many."""
        clock = time.monotonic() if now is None else now
        with self.lock:
            if now is None:
                self.timer = None
            due = [k for k, d in self.retired.items() if d <= clock]
            gone = [self._drop(k) for k in due]
            if now is None and self.retired:
                self._schedule(min(self.retired.values()))
        n = len(gone)
        del gone
        return n

    def reset(self) -> None:
        # After fork: CUDA mappings do not survive, host mmaps do but a child
        # maps what it needs itself. The parent's timer thread is not here.
        self.lock = threading.Lock()
        self.descs = {}
        self.host = {}
        self.tensors = {}
        self.vmm = {}
        self.retired = {}
        self.timer = None
        self.timer_at = 0.0
        self.slab_sizes = {}
        self.users = {}
        self.runs = {}


_slabs = _ProcessSlabs()
# Open sessions of this process by (mount, session id), so that a Ref that
# arrives from a worker finds the control descriptor it needs for SLAB and
# RELEASE without opening another one.
_open_sessions: "weakref.WeakValueDictionary[tuple[str, int], Session]" = weakref.WeakValueDictionary()
# Token-only sessions this process made for Refs it was handed.
_token_sessions: dict[tuple[str, int], Session] = {}


def _reset_session_locks() -> None:
    # After fork: a Session lock another thread of the parent held (a
    # pin-memory thread releasing, the lease drain) would stay held in the
    # child forever; the child's copies start unlocked.
    for s in list(_open_sessions.values()) + list(_token_sessions.values()):
        s._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_slabs.reset)
    os.register_at_fork(after_in_child=_reset_session_locks)


class Session:
    """A session of the gdsfs daemon: the owner of leases (slab memory).

    Open it in the main process; it pickles as a small token, so DataLoader
    workers (forked or spawned) can read() into the same session, while the
    main process maps slabs and releases leases. Closing the session stops
    new reads; it ends (every lease back to the pool) once nothing in this
    process holds one of its leases, or at the exit of the process.

    Args:
        mount: the gdsfs mount root (see find_mount) or any path on it.
        device: target device for reads: -1 for host memory, a CUDA ordinal
            of this process (torch's cuda:N, whatever the daemon calls that
            GPU: docs/pytorch.md "Which GPU"), or None for the default
            (cuda:0 when the daemon has CUDA slabs, else host memory).

    Example:
        >>> with gdsfs.Session("/mnt/data") as s, open("/mnt/data/a.bin", "rb") as f:
        ...     [ref] = s.read(f, [(0, 4096)])
        ...     bytes(s.host_buffer(ref)[:4])
    """

    def __init__(self, mount: PathLike, *, device: int | None = None) -> None:
        root = _require_mount(mount)
        self.mount = root
        self._cfd: int | None = os.open(os.path.join(root, CONTROL_NAME), os.O_RDONLY)
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()
        self._devmap: Any = _devmap.UNRESOLVED  # this process's CUDA devices vs the daemon's
        try:
            self.hello = _hello(self._cfd)
            self.token = self.hello.token
            _slabs.note_run(root, self.hello.daemon_pid, self.hello.slab_socket)
            self.device = self._default_device(device)
        except BaseException:
            os.close(self._cfd)
            raise
        self._closed = False  # no new reads
        self._ended = False  # control descriptor closed: the session is over here
        self._finalizer: weakref.finalize | None = weakref.finalize(self, _close_quietly, self._cfd)
        self.timing = _timing_book()
        _open_sessions[(root, self.token.session)] = self

    @classmethod
    def open(cls, path: PathLike, *, device: int | None = None, strict: bool = False) -> "Session | None":
        """A session of the mount holding path, or None (with a one-time
        GDSFallbackWarning) when path is not on a gdsfs mount or the daemon
        cannot serve it; strict=True raises GDSUnavailableError instead."""
        mount = find_mount(path)
        if mount is None:
            warn_fallback(f"{os.fspath(path)!r} is not on a gdsfs mount", strict=strict, cause="off-mount",
                          fix="mount its directory with `gdsfs mount`")
            return None
        try:
            return cls(mount, device=device)
        except (GDSUnavailableError, OSError) as e:
            why = str(e).removeprefix("gdsfs: ")
            warn_fallback(f"the gdsfs daemon at {mount!r} cannot serve: {why}", strict=strict, cause=f"daemon {mount}")
            return None

    def _default_device(self, device: int | None) -> int:
        if device is not None:
            if device == proto.DEVICE_HOST:
                if not self.hello.caps & proto.CAP_HOST_SLABS:
                    raise GDSUnavailableError(f"gdsfs: the daemon at {self.mount!r} serves no host memory: ask for a CUDA device")
            elif not 0 <= self._wire_device(device) < self.hello.devices:
                raise GDSUnavailableError(f"gdsfs: the daemon at {self.mount!r} has no slabs on CUDA device {device} ({self.hello.devices} devices)")
            return device
        return 0 if self.hello.devices > 0 else proto.DEVICE_HOST

    # Pickling: only the token travels, and the device translation (resolved here, where CUDA
    # is: a DataLoader worker never asks CUDA itself).
    def __getstate__(self) -> dict[str, Any]:
        devmap = self._devmap if self.host_mode else self._device_map()
        return {"mount": self.mount, "hello": tuple(self.hello), "device": self.device, "devmap": devmap}

    def __setstate__(self, state: dict[str, Any]) -> None:
        h = list(state["hello"])
        h[3] = proto.Token(*h[3])
        self.hello = proto.Hello(*h)
        self.mount = state["mount"]
        self.token = self.hello.token
        self.device = state["device"]
        self._devmap = state.get("devmap", _devmap.UNRESOLVED)
        self._cfd = None
        self._owner_pid = -1
        self._lock = threading.Lock()
        self._closed = False
        self._ended = False
        self._finalizer = None
        self.timing = _timing_book()

    def _device_map(self, *, force: bool = False) -> "_devmap.DeviceMap | None":
        """This process's CUDA devices matched with the daemon's by UUID (gdsfs._devmap), or
        None: ordinals as they are. Resolved once, in the process that opened the session (or,
        force, in one about to map the daemon's CUDA memory); a copy elsewhere (a DataLoader
        worker) uses the map it was handed, never asking CUDA itself."""
        m = self._devmap
        if m is _devmap.UNRESOLVED:
            if not force and self._owner_pid != os.getpid():
                return None
            h = self.hello
            if h.caps == 0:  # a session rebuilt from a Ref has not seen HELLO
                h = _hello(self._control_fd()[0])
            m = None
            if h.caps & proto.CAP_DEVICE_UUIDS and h.devices > 0:
                def theirs() -> Any:
                    return _devmap.daemon_uuids(self.mount, h.daemon_pid, h.devices, lambda: status(self.mount), run=h.slab_socket)
                m = _devmap.resolve(self.mount, theirs)
            self._devmap = m
        return m

    def _wire_device(self, dev: int) -> int:
        """The daemon's ordinal of this process's CUDA device dev, for READ/ALLOC (-1: host).

        Raises:
            GDSUnavailableError (errno ENODEV): the daemon does not serve that GPU.
        """
        if dev < 0:
            return dev
        m = self._device_map()
        return dev if m is None else m.to_daemon(dev)

    def _local_device(self, dev: int) -> int:
        """This process's CUDA ordinal of the daemon's device dev (a SLAB reply's), to map it on."""
        if dev < 0:
            return dev
        m = self._device_map(force=True)
        return dev if m is None else m.to_local(dev)

    @property
    def host_mode(self) -> bool:
        """True when this session reads into host shared memory."""
        return self.device == proto.DEVICE_HOST

    @property
    def engine(self) -> str:
        """The daemon's default engine name."""
        return self.hello.engine

    @property
    def max_lease(self) -> int:
        """Largest range one lease can hold."""
        return self.hello.max_lease

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session(mount={self.mount!r}, session={self.token.session}, device={self.device}, engine={self.engine!r})"

    def close(self) -> None:
        """Close the session: no new reads from now on. In the process that
        opened it, the session ends (every lease it holds returns to the
        pool) once nothing in this process holds one of its leases any
        more (TensorRefs, batches, zero-copy views: see docs/pytorch.md,
        "Lease ownership"); at once when nothing does. Idempotent. In other
        processes it only drops this process's control descriptor."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._owner_pid == os.getpid():
            _leases.close_when_free(self)
        else:
            self._end()

    def _end(self) -> None:
        """Close the control descriptor (ends the session in the process
        that opened it, unless a forked child still holds a copy)."""
        with self._lock:
            self._closed = True
            if self._ended:
                return
            self._ended = True
            if self._finalizer is not None:
                self._finalizer()
            elif self._cfd is not None:
                _close_quietly(self._cfd)
            self._cfd = None
        _slabs.drop_vmm(self.mount, self.token.session)

    @property
    def closed(self) -> bool:
        """True once close() was called (the session may live on while
        leases of it are held in this process)."""
        return self._closed

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise GDSUnavailableError("gdsfs: the session is closed: open a new Session")

    def _control_fd(self) -> tuple[int, proto.Token | None]:
        """A control descriptor and the token to name on it: our own open
        (token 0,0) where we have it, else a private open naming our token."""
        if self._ended:
            raise GDSUnavailableError("gdsfs: the session has ended: open a new Session")
        with self._lock:
            if self._cfd is None:
                self._cfd = os.open(os.path.join(self.mount, CONTROL_NAME), os.O_RDONLY)
                self._finalizer = weakref.finalize(self, _close_quietly, self._cfd)
                return self._cfd, self.token
            if self._owner_pid == os.getpid():
                return self._cfd, None
            return self._cfd, self.token

    def _make_ref(self, d: proto.LeaseDesc, device: int) -> Ref:
        return Ref(
            mount=self.mount,
            session=self.token.session,
            secret=self.token.secret,
            daemon_pid=self.hello.daemon_pid,
            lease=d.lease,
            slab=d.slab,
            offset=d.offset,
            length=d.length,
            valid=d.valid,
            device=device,
            engine=proto.ENGINES.get(d.engine, str(d.engine)),
        )

    def _ioctl_retry(self, fd: int, cmd: int, buf: bytearray, op: str, deadline_s: float) -> None:
        """ioctl that waits (with backoff) while the pool is full."""
        delay = 0.001
        start = time.monotonic()
        template = bytes(buf)
        while True:
            try:
                _ioctl(fd, cmd, buf)
                return
            except OSError as e:
                if e.errno == _errno.EINTR or (e.errno == _errno.EAGAIN and time.monotonic() - start < deadline_s):
                    buf[:] = template
                    time.sleep(delay)
                    delay = min(delay * 2, 0.05)
                    continue
                raise

    def read(self, fd: Any, ranges: Sequence[tuple[int, int]], *, device: int | None = None, timeout: float = EAGAIN_TIMEOUT_S, version: int = 0) -> list[Ref]:
        """Read byte ranges of an open file on the mount into slab memory.

        Args:
            fd: a descriptor (int) or file object opened on this mount.
            ranges: (offset, length) pairs; any number (split into READs of
                at most max_ranges).
            device: override the session's target device.
            timeout: seconds to wait for pool space when the pool is full.
            version: the file's version from INDEX (CAP_READ_VERSION; 0:
                any): a file no longer at it is GDSUnavailableError with
                errno ESTALE, and no lease of the call remains.

        Returns:
            One Ref per range, in order. The bytes are in place on return.

        Raises:
            GDSUnavailableError: the daemon refused (errno and a hint in the
                message), or the pool stayed full for timeout seconds.
        """
        _leases.drain()
        self._refuse_if_closed()
        dev = self.device if device is None else device
        fdn = _fileno(fd)
        for off, length in ranges:
            if length > self.hello.max_lease:
                raise ValueError(f"gdsfs: range ({off}, {length}) is longer than one slab ({self.hello.max_lease} bytes): split it")
        out: list[Ref] = []
        step = max(1, min(self.hello.max_ranges or proto.MAX_RANGES, proto.MAX_RANGES))
        try:
            for i in range(0, len(ranges), step):
                self._read_chunk(fdn, list(ranges[i : i + step]), dev, timeout, out, version)
        except BaseException:
            if out:  # all or nothing: the leases of the READs that succeeded go back
                try:
                    self.release(out)
                except GDSUnavailableError:
                    pass
            raise
        return out

    def _read_chunk(self, fd: int, ranges: list[tuple[int, int]], dev: int, timeout: float, out: list[Ref], version: int = 0) -> None:
        buf = proto.encode_read(self.token, self._wire_device(dev), ranges, version)
        t0 = time.perf_counter() if self.timing is not None else 0.0
        try:
            self._ioctl_retry(fd, proto.READ, buf, "READ", timeout)
            if self.timing is not None:
                _tally(self.timing, "READ", t0, len(ranges))
        except OSError as e:
            if e.errno == _errno.E2BIG and len(ranges) > 1:
                # Together larger than the pool: read in halves.
                half = len(ranges) // 2
                self._read_chunk(fd, ranges[:half], dev, timeout, out, version)
                self._read_chunk(fd, ranges[half:], dev, timeout, out, version)
                return
            if e.errno == _errno.EAGAIN:
                raise self._pool_full("READ", f"of {len(ranges)} ranges ({sum(n for _o, n in ranges)} bytes)", timeout, dev) from e
            raise _daemon_error("READ", e, f"of {len(ranges)} ranges") from e
        out.extend(self._make_ref(d, dev) for d in proto.decode_read(buf, len(ranges)))

    def _pool_full(self, op: str, what: str, waited: float, dev: int) -> GDSUnavailableError:
        """The error of a request that found the pool full for `waited` seconds: this uid's
        share, what this process holds of it, and what to change."""
        held = _leases.held_bytes(self.mount, dev)
        flag = "--host-pool" if dev < 0 else "--gpu-pool"
        return GDSUnavailableError(
            f"gdsfs: {op} {what} failed: EAGAIN: the pool stayed full for {waited:g} s: uid {self.hello.uid}'s share of it at {self.mount!r} "
            f"is {self.hello.max_lease} bytes ({held} held by this process); in a DataLoader its workers keep more in flight than that: "
            "use fewer num_workers or a smaller batch_size, prefetch_factor, batches_per_item or read_ahead_bytes, release leases "
            f"(materialize or drop batches), or have root mount with a larger {flag} (or --uid-share)", errno=_errno.EAGAIN)

    def read_names(self, fd: Any, names: Sequence[str], *, device: int | None = None, timeout: float = EAGAIN_TIMEOUT_S) -> list[Ref]:
        """Read index entries by name (tar member path, MDS "sample/field",
        safetensors tensor, zip record, "data" of an .npy) into slabs."""
        _leases.drain()
        self._refuse_if_closed()
        dev = self.device if device is None else device
        fdn = _fileno(fd)
        out: list[Ref] = []
        i = 0
        names = list(names)
        while i < len(names):
            n, used = 0, 0
            while i + n < len(names) and n < proto.MAX_RANGES and used + len(names[i + n].encode()) + 1 <= proto.NAMES_BYTES:
                used += len(names[i + n].encode()) + 1
                n += 1
            if n == 0:
                raise ValueError(f"gdsfs: name {names[i][:64]!r}... is longer than the names area")
            buf = proto.encode_read_names(self.token, self._wire_device(dev), names[i : i + n])
            try:
                self._ioctl_retry(fdn, proto.READ_NAMES, buf, "READ_NAMES", timeout)
            except OSError as e:
                raise _daemon_error("READ_NAMES", e, f"of {n} names") from e
            out.extend(self._make_ref(d, dev) for d in proto.decode_read(buf, n))
            i += n
        return out

    def alloc(self, nbytes: int, *, device: int | None = None, timeout: float = EAGAIN_TIMEOUT_S) -> Ref:
        """A writable lease of nbytes (for writes to files on the mount)."""
        _leases.drain()
        self._refuse_if_closed()
        dev = self.device if device is None else device
        fd, tok = self._control_fd()
        buf = proto.encode_alloc(tok, self._wire_device(dev), nbytes)
        try:
            self._ioctl_retry(fd, proto.ALLOC, buf, "ALLOC", timeout)
        except OSError as e:
            raise _daemon_error("ALLOC", e, f"of {nbytes} bytes") from e
        return self._make_ref(proto.decode_lease(buf, 32), dev)

    def write(self, fd: Any, ref: Ref, offset: int, nbytes: int | None = None, *, lease_offset: int = 0, sync: bool = False) -> int:
        """Write a lease's bytes to an open (writable) file on the mount.

        Args:
            fd: descriptor or file object opened for writing on the mount.
            ref: a lease of this session (from alloc() or read()).
            offset: file offset to write at.
            nbytes: bytes to write (default: ref.valid - lease_offset).
            lease_offset: first byte of the lease to write.
            sync: fdatasync the file before returning.

        Returns:
            Bytes written.
        """
        n = ref.valid - lease_offset if nbytes is None else nbytes
        buf = proto.encode_write(self.token, ref.lease, lease_offset, offset, n, sync=sync)
        try:
            # A signal that lands on this thread (any thread can take a
            # process-directed one, SIGCHLD say) makes the kernel interrupt
            # the FUSE request and the daemon abandon it with EINTR. WRITE is
            # idempotent (the same bytes to the same offset): retry it.
            self._ioctl_retry(_fileno(fd), proto.WRITE, buf, "WRITE", 0.0)
        except OSError as e:
            raise _daemon_error("WRITE", e, f"of {n} bytes at {offset}") from e
        written, _engine = proto.decode_write(buf)
        return written

    def release(self, refs: Iterable[Ref | int], *, check: bool = False) -> None:
        """Return leases to the pool; whoever in this process held them
        (TensorRefs, views) is done with them.

        Args:
            refs: Refs or lease ids of this session.
            check: raise GDSLeaseError when the daemon did not hold one of
                them (never held, already released, or the session ended):
                what was copied out of it before cannot be trusted. Without
                check such ids are ignored.
        """
        _leases.drain()
        refs = list(refs)
        _leases.mark_released([r for r in refs if isinstance(r, Ref)])
        ids = [r if isinstance(r, int) else r.lease for r in refs]
        ids = [i for i in ids if i]
        if not ids:
            return
        if self._ended:
            if check:
                raise GDSLeaseError(ids[0], "its session has ended")
            return
        try:
            status = self._release_ids(ids)
        finally:
            _leases.end_free_sessions()
        if check:
            for i, st in zip(ids, status):
                if st != 0:
                    raise GDSLeaseError(i, "the daemon did not hold it at release (released twice, or its session ended)")

    def _release_ids(self, ids: Sequence[int]) -> list[int]:
        """RELEASE ids; the daemon's status per id (0, or ENOENT when the
        session did not hold it). Raises GDSUnavailableError when the
        request fails as a whole (EPERM: the session ended)."""
        fd, tok = self._control_fd()
        out: list[int] = []
        for i in range(0, len(ids), proto.MAX_RELEASE):
            chunk = list(ids[i : i + proto.MAX_RELEASE])
            buf = proto.encode_release(tok, chunk)
            t0 = time.perf_counter() if self.timing is not None else 0.0
            try:
                _ioctl_eintr(fd, proto.RELEASE, buf)
            except OSError as e:
                raise _daemon_error("RELEASE", e, f"of {len(chunk)} leases") from e
            if self.timing is not None:
                _tally(self.timing, "RELEASE", t0, len(chunk))
            out.extend(proto.decode_release(buf, len(chunk))[1])
        return out

    def slab_info(self, slab: int) -> proto.SlabDesc:
        """How to map a slab (cached per process)."""
        key = (self.mount, self.hello.daemon_pid, slab)
        d = _slabs.descs.get(key)
        if d is not None:
            return d
        fd, tok = self._control_fd()
        buf = proto.encode_slab(tok, slab)
        try:
            _ioctl_eintr(fd, proto.SLAB, buf)
        except OSError as e:
            raise _daemon_error("SLAB", e, f"of slab {slab}") from e
        d = proto.decode_slab(buf)
        with _slabs.lock:
            _slabs.descs[key] = d
        return d

    def slab_fd(self, slab: int) -> tuple[int, int]:
        """A descriptor of slab's memory and the bytes to map through it,
        from the daemon's slab socket (CAP_SLAB_FD). The daemon gives it
        only to a process of this session's uid, while the session holds a
        lease in the slab. The caller closes the descriptor; a mapping made
        from it stays valid (and keeps its memory) after that."""
        fd, _ = self._control_fd()
        addr, pid = self.hello.slab_socket, self.hello.daemon_pid
        if not addr:
            # A session rebuilt from a token (a Ref from another process)
            # has not seen the daemon's HELLO: ask it on our descriptor.
            h = _hello(fd)
            addr, pid = h.slab_socket, h.daemon_pid
            if not (h.caps & proto.CAP_SLAB_FD) or not addr:
                raise GDSUnavailableError(f"gdsfs: the daemon at {self.mount!r} serves no slab socket: upgrade the gdsfs daemon")
        try:
            return proto.fetch_slab_fd(addr, pid, self.token, slab)
        except OSError as e:
            raise _daemon_error("slab socket", e, f"for slab {slab}") from e

    def _host_mapping(self, slab: int) -> _HostMapping:
        key = (self.mount, self.hello.daemon_pid, slab)
        m = _slabs.host.get(key)
        if m is not None:
            return m
        d = self.slab_info(slab)
        if d.kind != proto.SLAB_KIND_HOST:
            raise GDSUnavailableError(f"gdsfs: slab {slab} is CUDA memory (device {d.device}): materialize it with gdsfs.torch")
        with _slabs.lock:
            m = _slabs.host.get(key)
            if m is None:
                m = _HostMapping(d)
                _slabs.host[key] = m
        return m

    def host_buffer(self, ref: Ref) -> memoryview:
        """A writable memoryview of ref's valid bytes in its host slab."""
        if ref.lease == 0:
            return memoryview(bytearray(0))
        m = self._host_mapping(ref.slab)
        start = m.base + ref.offset
        if ref.offset + ref.valid > m.size:
            raise GDSUnavailableError(f"gdsfs: lease {ref.lease} [{ref.offset}, +{ref.valid}) lies outside slab {ref.slab} of {m.size} bytes")
        return m.view[start : start + ref.valid]

    def status(self) -> dict[str, Any]:
        """The daemon's status document."""
        return status(self.mount)


def session_for(ref: Ref) -> Session:
    """The session of this process that a Ref belongs to: the open one when
    this process opened it, else a token-only session for its mount."""
    s = _open_sessions.get((ref.mount, ref.session))
    if s is not None and not s._ended and s.hello.daemon_pid == ref.daemon_pid:
        return s
    s = _token_sessions.get((ref.mount, ref.session))
    if s is not None:
        return s
    s = Session.__new__(Session)
    hello = (proto.VERSION, os.getuid(), 0, (ref.session, ref.secret), proto.MAX_RANGES, proto.NAMES_BYTES,
             4096, 0, 1 << 62, 16256, ref.daemon_pid, "", "")
    s.__setstate__({"mount": ref.mount, "hello": hello, "device": ref.device})
    _token_sessions[(ref.mount, ref.session)] = s
    return s
