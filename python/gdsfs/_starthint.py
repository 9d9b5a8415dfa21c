"""The start hint of a cold epoch (issue 15): while torch starts a DataLoader's workers (fork,
imports, each worker's index loading and planning: 50-100 ms before their first READs), a
thread of the main process asks the kernel for the bytes each worker's plan reads first, so
that the disk is busy from the moment the loop starts the iterator and the workers' first
READs find those bytes in the page cache (docs/benchmarks.md, "Cold start").

What it reads ahead is exactly the plan's: each worker's slot, its resume point, the epoch's
seed and shuffle, interleave and shuffle buffer (EpochPlan.positions), and of each sample the
fields its keys= select, in the order the worker reads them; bounded by GDSFS_START_HINT
bytes for all the loader's workers together (by default shared by the DDP ranks of one node). posix_fadvise(WILLNEED) through the mount, on the
thread's own descriptors (O_NONBLOCK: a path replaced by a FIFO never holds it; only regular
files are advised), so a slow daemon holds the thread, never the loop. A hint: every error
ends it quietly (the workers' READs report what is wrong).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import mmap
import os
import stat
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from . import _core, _indexcols
from . import _protocol as proto

if TYPE_CHECKING:
    from ._dataset import GDSShardDataset, _ShardState

# All the workers' hints of one iteration's start together (bytes): about what a fast disk
# reads while 8 workers start (0.1 s at 1.3 GB/s); each worker's share at most
# START_HINT_WORKER (the daemon's largest readahead window: its own readahead takes over from
# the worker's first READs on). The ranks of one node share it (LOCAL_WORLD_SIZE: each gets
# START_HINT / that). GDSFS_START_HINT (bytes; 0: no hint) overrides it, per process.
START_HINT = 128 << 20
START_HINT_WORKER = 32 << 20
START_HINT_ENV = "GDSFS_START_HINT"
# At most this many chunks of each worker (as it reads them: whole items) are planned and
# hinted: the thread's planning holds the GIL, which the fork loop of the main thread needs, and
# at small samples (16 KiB: 1,024 samples a worker for 16 MiB) it would cost more than the disk
# gains.
START_HINT_CHUNKS = 4
# One posix_fadvise call reads at most the mount's max_readahead (128 KiB): calls are cut at
# its multiples. Ranges of a worker closer than a page are one (a tar's headers and padding
# between a sample's members: no page of the gap is added).
WILLNEED_STEP = 128 << 10
PAGE = 4096
# How much of a worker's first bytes is probed for residency (its first page and the last).
PROBE_BYTES = 1 << 20


# torchrun's count of the ranks on this node, each of which starts its own loaders' hints.
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"


def local_world_size(devices: int = 0) -> int:
    """The ranks of this node that start hints of their own: torchrun's LOCAL_WORLD_SIZE (a whole
    number >= 1; anything else is ignored), else with torch.distributed initialized its world
    size, at most the daemon's GPUs (`devices`: the ranks of one node use one GPU each; none:
    host memory, 1), else 1."""
    v = os.environ.get(LOCAL_WORLD_ENV, "").strip()
    if v:
        try:
            return max(1, int(v))
        except ValueError:
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return max(1, min(int(dist.get_world_size()), devices))
    except (ImportError, RuntimeError, ValueError):
        pass
    return 1


def start_hint_bytes(devices: int = 0) -> int:
    """GDSFS_START_HINT as bytes, for this process (0 or less: no hint); unset or not an
    integer: START_HINT shared by the node's ranks (local_world_size(devices)), so that k
    ranks together ask for START_HINT, not k times it."""
    v = os.environ.get(START_HINT_ENV, "")
    try:
        return max(0, int(v)) if v else START_HINT // local_world_size(devices)
    except ValueError:
        return START_HINT // local_world_size(devices)


class _HintFds:
    """The descriptors start-hint threads hold open, closed in a forked child (a worker forked
    while a hint runs must not keep its descriptor of a shard for its whole life).

    A descriptor is opened and registered (closed and unregistered) under lock, which a fork
    takes first (before_fork): a fork never falls between the open's return and the
    registration, where the child would get a descriptor it does not know to close. A fork
    waits at most FORK_WAIT for it (a hint thread inside a slow daemon's open: a fork while
    the open is still in the kernel copies no descriptor of it), and not at all while a hint
    thread has kept it that long (stuck, until that open returns)."""

    FORK_WAIT = 0.5

    def __init__(self) -> None:
        self.fds: set[int] = set()
        self.lock = threading.Lock()
        self.held: dict[int, bool] = {}  # forking thread -> whether its fork took lock
        self.stuck = False

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self.lock:
            try:
                yield
            finally:
                self.stuck = False  # forks wait for the lock again

    def open(self, path: str, flags: int) -> int:
        with self._locked():
            fd = os.open(path, flags)
            self.fds.add(fd)
            return fd

    def close(self, fd: int) -> None:
        with self._locked():
            self.fds.discard(fd)
            try:
                os.close(fd)
            except OSError:
                pass

    def before_fork(self) -> None:
        took = self.lock.acquire(blocking=False) or (not self.stuck and self.lock.acquire(timeout=self.FORK_WAIT))
        if not took:
            self.stuck = True
        self.held[threading.get_ident()] = took

    def after_fork_in_parent(self) -> None:
        if self.held.pop(threading.get_ident(), False):
            self.lock.release()

    def after_fork_in_child(self) -> None:
        self.lock, self.held, self.stuck = threading.Lock(), {}, False
        fds, self.fds = self.fds, set()
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


_fds = _HintFds()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_fds.before_fork, after_in_parent=_fds.after_fork_in_parent, after_in_child=_fds.after_fork_in_child)


Range = tuple[int, int, int, int]  # (shard, offset, end, chunk)


def _merge(out: list[Range], shard: int, off: int, end: int, chunk: int) -> None:
    if end <= off:
        return
    if out:
        s, o, e, c = out[-1]
        if s == shard and c == chunk and o <= off and off - e < PAGE:
            out[-1] = (s, o, max(e, end), c)
            return
    out.append((shard, off, end, chunk))


def worker_ranges(ds: "GDSShardDataset", state: Callable[[int], Any], plan: Any, slot: int, skip: int,
                  budget: int, batched: int = 0) -> tuple[list[Range], bool]:
    """The byte ranges (shard, offset, end, read) that slot's worker reads first, in its order,
    at most budget bytes and START_HINT_CHUNKS chunks: the fields keys= selects of its samples
    from position skip on (a range at the budget is cut there), each tagged with the worker's
    READ it belongs to (0, 1, ...), cut as the worker cuts them: its chunks (_chunks: whole items
    of `batched` samples, its self._batched; 0: read_ahead samples), each in READ groups
    (_group_end); the worker yields nothing of a READ before it is whole. state(shard): the
    shard's parsed state, None when it cannot be read (the ranges stop there: what follows would
    not be what the worker reads first). Also whether the budget cut the first READ."""
    out: list[Range] = []
    total = 0
    read = 0
    for c, (chunk, _last) in enumerate(ds._chunks(plan.positions(slot, skip), batched)):
        if c >= START_HINT_CHUNKS:
            break
        # Planned up to one sample past the budget: enough for the groups up to where it ends.
        planned: list[Any] = []
        nbytes = total
        for pos, shard, idx in chunk:
            st = state(shard)
            if st is None:
                break
            p = ds._plan_sample(st, pos, shard, idx)
            planned.append(p)
            if nbytes >= budget:
                break
            nbytes += sum(fp.length for fp in p[4])
        start = 0
        while start < len(planned):
            end = ds._group_end(planned, start)
            for n in range(start, end):
                whole = True  # every byte of this sample's fields within the budget
                for fp in sorted(planned[n][4], key=lambda f: f.offset):
                    k = min(fp.length, budget - total)
                    whole = whole and k == fp.length
                    if k <= 0:
                        break
                    _merge(out, planned[n][1], fp.offset, fp.offset + k, read)
                    total += k
                if total >= budget:
                    # Stopped inside the first READ: samples of it are left, or bytes of this one.
                    return out, read == 0 and (n < end - 1 or not whole)
            read += 1
            start = end
        if len(planned) < len(chunk):
            break
    return out, False


def _head(rs: list[Range], nbytes: int) -> list[Range]:
    """The ranges of rs that hold its first nbytes (the last one cut there)."""
    out: list[Range] = []
    for s, o, e, c in rs:
        if nbytes <= 0:
            break
        out.append((s, o, min(e, o + nbytes), c))
        nbytes -= e - o
    return out


@functools.lru_cache(maxsize=1)
def _libc() -> Optional[ctypes.CDLL]:
    """libc with mmap, munmap and mincore typed, for _page_resident (None: not loadable).
    Loaded by StartHints.start in the thread that starts the hints, never first in the hint
    thread: a fork while it held the dynamic loader's lock would leave the child's held."""
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return lib


def _page_resident(fd: int, off: int) -> bool:
    """Whether the page of fd at off is in the page cache (mincore of a shared mapping of that
    page, which reads nothing: with FUSE passthrough, the backing file's page); False when it
    cannot be told."""
    lib = _libc()
    if lib is None:
        return False
    try:
        page = off - off % PAGE
        addr = lib.mmap(None, PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, page)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return False
        try:
            vec = ctypes.c_ubyte(0)
            if lib.mincore(addr, PAGE, ctypes.byref(vec)) != 0:
                return False
            return bool(vec.value & 1)
        finally:
            lib.munmap(addr, PAGE)
    except (OSError, ValueError):
        return False


# The daemon's descriptors one open of a shard by the hint costs this uid (the open, and the
# control path's duplicate its INDEX makes: docs/operations.md, "Open files").
OPEN_COST = 2


def _budget_leaves_room(mount: str) -> bool:
    """Whether this uid's opens on the mount, with one more shard of the hint's, hold at most half
    of its budget of the daemon's descriptors (--max-open-per-user), and every uid's together at
    most half of what the daemon lets users hold: the hint never takes descriptors that the
    loader's own workers, or another user, opening files while it runs may need (an EMFILE or
    ENFILE of theirs would be the hint's doing). True when the daemon does not say."""
    try:
        return _room(json.loads(os.getxattr(mount, "user.gdsfs.stats")).get("open_files") or {}, os.getuid())
    except (OSError, ValueError, TypeError, AttributeError):
        return True


def _room(of: dict[str, Any], uid: int) -> bool:
    """_budget_leaves_room of the daemon's open_files figures (docs/operations.md, "Open files")."""
    per = int(of.get("per_uid", 0))
    mine = sum(int(u.get("open", 0)) for u in of.get("uids") or () if u.get("uid") == uid)
    users = int(of.get("limit", 0)) - int(of.get("reserve", 0))
    if per > 0 and mine + OPEN_COST > per // 2:
        return False
    return int(of.get("limit", 0)) <= 0 or int(of.get("open", 0)) + OPEN_COST <= users // 2


class StartHints:
    """One iteration start's hints, run by a daemon thread (start()); stop() ends them at the
    next call."""

    def __init__(self, ds: "GDSShardDataset", slots: int, workers: Sequence[tuple[int, int]], budget: int,
                 known: dict[int, "_ShardState"], batched: int = 0) -> None:
        self.ds, self.slots, self.workers, self.budget = ds, slots, list(workers), budget
        self.batched = batched  # the workers' items (their self._batched): they read whole ones
        self.known = known  # the main process's open shards (their indexes), at the start
        self.stop_event = threading.Event()
        self.thread: Optional[threading.Thread] = None
        self.ranges: list[list[tuple[str, int, int]]] = []  # per worker, as hinted (path, offset, end): tests read it
        self._fds: dict[int, int] = {}  # shard -> the thread's descriptor of it
        self._states: dict[int, Any] = {}

    def start(self) -> None:
        _libc()
        self.thread = threading.Thread(target=self.run, name="gdsfs-start-hint", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception:  # noqa: BLE001 - a hint: the workers' own reads report what is wrong
            pass
        finally:
            for fd in self._fds.values():
                _fds.close(fd)
            self._fds.clear()

    def _run(self) -> None:
        ds = self.ds
        plan = ds._plan(self.slots)
        per = min(START_HINT_WORKER, self.budget // max(1, len(self.workers)))
        if per <= 0:
            return
        # Each worker's chunks in the order the loop consumes them: torch takes the workers'
        # batches in turn, and a worker yields a chunk's batches once its READ is done. Its
        # first chunk right after its planning: the disk starts on it while the next worker's
        # ranges are planned.
        later: list[list[list[Range]]] = []
        for slot, skip in self.workers:
            if self.stop_event.is_set():
                return
            # Planned first from the indexes the main process holds, opening nothing: a worker
            # left without a hint costs no open, no INDEX and no residency probe (12-02 07:35,
            # 4 MiB samples, every worker's first chunk over its share: the first batch still
            # 50-150 ms later with the hint on than off, from those opens on a cold disk racing
            # the forks for the lock they share).
            rs, cut = worker_ranges(ds, self._plan_state, plan, slot, skip, per, self.batched)
            if not rs or cut or not self._open_all(rs):
                # cut: its first chunk (the first READ, which yields nothing before it is whole)
                # is more than its share: large samples. A part of it only reorders the
                # workers' first READs against the order the loop takes them, and a READ that
                # large keeps the disk busy by itself (12-02 05:48, 4 MiB samples: the first
                # batch 70-240 ms later with such hints, 0.98x the disk against 1.06x without).
                self.ranges.append([])
                continue
            if self._resident(_head(rs, min(per, PROBE_BYTES))):
                # Its first bytes in the page cache already (a warm epoch): nothing to ask for.
                self.ranges.append([])
                continue
            self.ranges.append([(ds.shards[s], o, e) for s, o, e, _c in rs])
            chunks: list[list[Range]] = []
            for r in rs:
                if not chunks or chunks[-1][-1][3] != r[3]:
                    chunks.append([])
                chunks[-1].append(r)
            self._advise(chunks[0])
            later.append(chunks[1:])
        for c in range(max((len(x) for x in later), default=0)):
            for chunks in later:
                if self.stop_event.is_set():
                    return
                if c < len(chunks):
                    self._advise(chunks[c])

    def _plan_state(self, shard: int) -> Any:
        """Shard's state for planning without opening it where the main process has its index
        (its _ShardState; _open_all checks later that the file is still the one indexed), else
        _state's."""
        known = self.known.get(shard)
        return known if known is not None else self._state(shard)

    def _open_all(self, rs: list[Range]) -> bool:
        """Open (as _state does) the shards of rs that planning did not open; False when one
        cannot be, is not a regular file, or is not the file the main process indexed (the
        ranges planned from that index would not be what the worker reads)."""
        from ._dataset import _file_ident

        for shard in dict.fromkeys(r[0] for r in rs):
            if shard in self._fds:
                continue
            if self.stop_event.is_set():
                return False
            session = self.ds._session
            if session is not None and not _budget_leaves_room(session.mount):
                return False
            try:
                fd = _fds.open(self.ds.shards[shard], os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                return False
            self._fds[shard] = fd
            if not stat.S_ISREG(os.fstat(fd).st_mode) or self.known[shard].ident != _file_ident(fd):
                return False
        return True

    def _resident(self, rs: list[Range]) -> bool:
        """Whether the first page of rs and its last one are in the page cache."""
        first, last = rs[0], rs[-1]
        return _page_resident(self._fds[first[0]], first[1]) and _page_resident(self._fds[last[0]], last[2] - 1)

    def _advise(self, rs: list[Range]) -> None:
        """posix_fadvise(WILLNEED) of rs, in calls cut at WILLNEED_STEP's multiples (errors
        ignored: a hint)."""
        for shard, off, end, _c in rs:
            fd = self._fds.get(shard)
            while fd is not None and off < end and not self.stop_event.is_set():
                nxt = min(end, (off // WILLNEED_STEP + 1) * WILLNEED_STEP)
                try:
                    os.posix_fadvise(fd, off, nxt - off, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass
                off = nxt

    def _state(self, shard: int) -> Any:
        """Shard's state for planning (the main process's where its file is unchanged, else
        its INDEX read anew on the thread's own descriptor); None: it cannot be opened, is not
        a regular file, or the daemon has no index of it."""
        if shard in self._states:
            return self._states[shard]
        self._states[shard] = None
        if self.stop_event.is_set():
            return None
        path = self.ds.shards[shard]
        session = self.ds._session
        if session is not None and not _budget_leaves_room(session.mount):
            return None
        try:
            fd = _fds.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        self._fds[shard] = fd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        from ._dataset import _file_ident, _sample_count, _ShardState

        known = self.known.get(shard)
        state: Any
        if known is not None and known.ident == _file_ident(fd):
            state = known  # read only here (_sample_fields reads its index, caches field kinds)
        else:
            index = self._index(path, fd)
            if index is None or _sample_count(index) != self.ds.counts[shard]:
                return None
            # Planned from, never read through (the thread's descriptor is its own): no fd.
            state = _ShardState(path, -1, index, _file_ident(fd))
        self._states[shard] = state
        return state

    def _index(self, path: str, fd: int) -> Optional[dict[str, Any]]:
        """The daemon's index of the open shard fd, or None (a raw file needs none)."""
        ds = self.ds
        fmt = ds._shard_format(path)
        if fmt == "raw":
            return {"format": "raw", "file_size": os.fstat(fd).st_size}
        session = ds._session
        if session is None:
            return None
        cols = bool(session.hello.caps & proto.CAP_INDEX_COLUMNS)
        try:
            raw, _version, form = _core._paged_index(fd, columns=cols)
        except OSError:
            return None  # no index (the daemon could not parse it, or serves no control path)
        if form == proto.INDEX_FORM_JSON:
            doc = json.loads(raw)
        elif form == proto.INDEX_FORM_TAR_COLUMNS:
            doc = _indexcols.decode(raw, path)
        else:
            return None
        return doc if isinstance(doc, dict) and doc.get("format") == fmt else None


# Samples of each shard the main process holds open that _every_first_chunk_over looks at.
FLOOR_SAMPLES = 4


def _every_first_chunk_over(ds: "GDSShardDataset", known: dict[int, "_ShardState"], per: int, batched: int) -> bool:
    """Whether a worker's first READ, of samples of the smallest size the main process's open
    shards show (the fields keys= selects of their first FLOOR_SAMPLES samples), is more than a
    worker's share: then no worker's first READ fits it and the hint would give nothing (large
    samples). Told
    from indexes this process holds, before any thread starts: such a hint opens no shard,
    asks for no INDEX and no stats while torch forks the workers (12-02 13:45, 4 MiB samples in
    16 shards: the hint opened and indexed the 4 shards the main process had closed, and the
    first batch came ~100 ms later than with it off). False when it cannot be told (no open
    shard, an index that does not plan): the thread plans each worker."""
    if per <= 0:
        return True
    floor = -1
    try:
        for shard, st in known.items():
            for idx in range(min(FLOOR_SAMPLES, ds.counts[shard])):
                n = sum(fp.length for fp in ds._sample_fields(st, idx)[1])
                floor = n if floor < 0 else min(floor, n)
    except Exception:  # noqa: BLE001 - not told: the thread plans from the indexes as before
        return False
    if floor < 0:
        return False
    # A worker's first READ: its first chunk (whole items of `batched` samples:
    # GDSShardDataset._chunk_samples), cut at read_ahead_bytes (_group_end), as samples of that
    # size would make it.
    group = min(ds._chunk_samples(batched), max(1, ds.read_ahead_bytes // max(1, floor)))
    return floor * group > per


# Python 3.12's warning at a fork while other threads run (os.fork, a DeprecationWarning).
_FORK_WARNING = r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks in the child"


@contextlib.contextmanager
def forking(hints: Optional[StartHints]) -> Iterator[None]:
    """While torch forks a loader's workers: Python 3.12's warning that the process is
    multi-threaded is not shown while the start hint's thread runs (a program that turns
    warnings into errors would otherwise fail to start its workers). That thread is fork-safe:
    it holds no lock a child could need (plain system calls, libc loaded before it started; its
    one lock, _HintFds.lock, a fork takes first and the child makes anew), and its descriptors
    are closed in the child (_HintFds)."""
    if hints is None or hints.thread is None or not hints.thread.is_alive():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FORK_WARNING, category=DeprecationWarning)
        yield


def start(ds: "GDSShardDataset", num_workers: int, previous: Optional[StartHints], batched: int = 0) -> Optional[StartHints]:
    """The hints of a DataLoader iteration that starts num_workers fresh workers over ds (called
    in the main process before torch starts them, after ds._main_iteration_starting): previous
    while its thread still runs (never two at once), else new ones, or None: no hint
    (GDSFS_START_HINT=0, no daemon session, a resume state the workers will refuse, or samples
    so large that no worker's first READ fits its share: _every_first_chunk_over).
    batched: the samples of the workers' items (batch_size x batches_per_item; 0: ds._batched),
    which they read whole."""
    if previous is not None and previous.thread is not None and previous.thread.is_alive():
        return previous
    budget = start_hint_bytes(ds._session.hello.devices if ds._session is not None else 0)
    if budget <= 0 or num_workers <= 0 or ds._session is None:
        return None
    layout = ds._loader_slots(num_workers)
    if layout is None:
        return None
    slots, workers = layout
    known = dict(ds._open) if ds._open_pid == os.getpid() else {}
    batched = batched or ds._batched
    if _every_first_chunk_over(ds, known, min(START_HINT_WORKER, budget // max(1, len(workers))), batched):
        return None
    h = StartHints(ds, slots, workers, budget, known, batched)
    h.start()
    return h
