"""The per-process lease book: which leases this process still holds, and
for whom.

Ownership (docs/pytorch.md, "Lease ownership"): a lease read for a sample
belongs to the generator that read it until the sample is yielded, then to
the consumer until it is materialized, released explicitly, or every holder
of it in this process (TensorRefs, their unpickled copies, batches,
zero-copy views) is garbage collected. Closing a Session (or a dataset, or
abandoning a DataLoader iterator) stops new reads at once but ends the
session, which frees its leases, only when the last holder here lets go.

A Hold is this process's handle on one lease, shared by all its holders:
each holds a strong reference, so Python's reference count is the holder
count. When the last holder goes, the Hold's finalizer only queues the
lease. The queue is drained (RELEASE ioctls, then ending the sessions
closed meanwhile whose last Hold went) by the next client call and by a
small background thread every DRAIN_PERIOD_S; when a closed session
waits for holders, that thread first runs one garbage collection (a
holder dropped inside a reference cycle counts as collected without the
program calling gc.collect()). Finalizers never issue an
ioctl or take a lock: they run inside the garbage collector, perhaps on a
thread that holds one. Nothing is released in a forked child (its copies
of the parent's Holds are not its own: the parent's are still in use) nor
at interpreter shutdown (the exit of the process ends its sessions).

Lease ids are never reissued by a daemon (gpubuf.Pool numbers them from an
atomic counter), so a RELEASE that answers "released" proves the lease was
still ours when the copy out of it finished: materialize() checks exactly
that, and raises GDSLeaseError otherwise.

This module never imports torch.
"""

from __future__ import annotations

import atexit
import collections
import errno as _errno
import gc
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from ._errors import GDSLeaseError, GDSUnavailableError

if TYPE_CHECKING:
    from ._core import Ref, Session

__all__ = ["Hold", "adopt", "check", "close_when_free", "drain", "end_free_sessions", "held_bytes", "hold", "hold_many", "live", "mark_released", "pin", "release",
           "release_groups", "view"]

# How often the background thread drains the queue of collected leases.
DRAIN_PERIOD_S = 0.1
# Longest a fork waits for a drain in progress.
FORK_WAIT_S = 5.0

# Entry states.
HELD = "held"  # some holder in this process names it
VIEWED = "viewed"  # a zero-copy view owns it: released when the view dies
RELEASED = "released"  # materialized or released explicitly
GONE = "gone"  # every holder was collected; released by a drain

_REASONS = {
    VIEWED: "it was materialized as a zero-copy view (copy=False), which owns it",
    RELEASED: "it was already released (materialized before, or released explicitly)",
    GONE: "every holder of it was garbage collected",
}


class _Entry:
    """The book's record of one lease (outlives its Hold until drained)."""

    __slots__ = ("key", "ref", "session", "state", "gen", "field", "sample", "path")

    def __init__(self, ref: "Ref", session: "Optional[Session]", field: str, sample: str, path: str) -> None:
        self.key = _key(ref)
        self.ref = ref
        self.session = session  # the owning Session of this process, or None
        self.state = HELD
        self.gen = 0  # bumped when a new Hold takes over a collected one's entry
        self.field, self.sample, self.path = field, sample, path

    def error(self, reason: str, hint: str = "") -> GDSLeaseError:
        return GDSLeaseError(self.ref.lease, reason, field=self.field, key=self.sample, path=self.path, hint=hint)


class Hold:
    """This process's handle on one lease; every holder keeps a reference.

    Pickles as the lease's descriptor: the unpickled copy is a Hold of the
    unpickling process's book (the same Hold when that process already has
    one for the lease).
    """

    __slots__ = ("entry", "gen", "pid", "__weakref__")

    def __init__(self, entry: _Entry, gen: int = 0, pid: int = 0) -> None:
        self.entry = entry
        self.gen, self.pid = gen, pid  # the entry's gen and the book's pid when this Hold took it

    def __del__(self) -> None:
        # The last holder let go: queue the lease (a finalizer: it runs
        # inside the garbage collector, so it only queues; see _gone). A
        # __del__ rather than a weakref.finalize per Hold: a sample's
        # handle costs a few microseconds less, and small samples pay it
        # per sample.
        try:
            _gone(self.pid, self.entry, self.gen, "hold")
        except Exception:  # noqa: BLE001 - interpreter teardown: the exit ends the sessions
            pass

    def __reduce__(self) -> Any:
        e = self.entry
        return (adopt, (e.ref, e.field, e.sample, e.path))

    @property
    def state(self) -> str:
        """held, viewed, released or gone."""
        return self.entry.state

    def __repr__(self) -> str:
        return f"Hold(lease={self.entry.ref.lease}, {self.entry.state})"


def _key(ref: "Ref") -> tuple[str, int, int, int]:
    return (ref.mount, ref.daemon_pid, ref.session, ref.lease)


class _Book:
    """The lease book of one process (replaced in a forked child)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.lock = threading.Lock()  # guards holds, entries, live, closing, entry states
        self.io = threading.Lock()  # held by a drain; a fork waits for it
        self.holds: "weakref.WeakValueDictionary[tuple[str, int, int, int], Hold]" = weakref.WeakValueDictionary()
        self.entries: dict[tuple[str, int, int, int], _Entry] = {}  # entries held or viewed
        self.live: dict[tuple[str, int], int] = {}  # (mount, session) -> owned entries held or viewed
        self.closing: dict[tuple[str, int], "Session"] = {}  # closed sessions waiting for their last holder
        # (entry, gen, why) of collected holders, why = "hold" or "view"
        # (or (session key, 0, "pin")); appended by finalizers (deque.append
        # is atomic and takes no lock), popped by drain().
        self.gone: "collections.deque[tuple[Any, int, str]]" = collections.deque()
        self.thread: Optional[threading.Thread] = None
        self.wake = threading.Event()  # cuts the thread's sleep short (wake)
        self.shutdown = False
        self.forking = False  # the fork hook holds io
        # A closed session waits for holders (close_when_free): the background thread runs one
        # garbage collection before its next drain, so that holders dropped inside a reference
        # cycle (which reference counting never frees) count as collected.
        self.collect = False

    def forget(self, e: _Entry) -> None:
        """Drop e from the live records (lock held)."""
        if self.entries.get(e.key) is e:
            del self.entries[e.key]
        if e.session is not None:
            sk = (e.ref.mount, e.ref.session)
            n = self.live.get(sk, 0) - 1
            if n > 0:
                self.live[sk] = n
            else:
                self.live.pop(sk, None)


_book = _Book()


def _before_fork() -> None:
    # A drain in another thread finishes before the fork, so that no lock
    # a drain takes (the book's, a Session's) is copied into the child
    # while held. Bounded: a daemon that does not answer delays a fork by
    # at most FORK_WAIT_S.
    b = _book
    b.forking = b.io.acquire(timeout=FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    b = _book
    if b.forking:
        b.forking = False
        b.io.release()


def _after_fork_in_child() -> None:
    # The parent's Holds copied into the child are the parent's: a fresh,
    # empty book (the old one, and the finalizers of its Holds, see another
    # pid and do nothing).
    global _book
    _book = _Book()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


@atexit.register
def _at_exit() -> None:
    _book.shutdown = True


def _gone(pid: int, e: Any, gen: int, why: str) -> None:
    # A finalizer: runs inside the garbage collector. Queue only.
    b = _book
    if b.pid == pid and not b.shutdown:
        b.gone.append((e, gen, why))


def _unpinned(pid: int, sk: tuple[str, int], _session: "Session") -> None:
    _gone(pid, sk, 0, "pin")


def _owner(ref: "Ref") -> "Optional[Session]":
    from . import _core

    s = _core._open_sessions.get((ref.mount, ref.session))
    if s is not None and s._owner_pid == os.getpid() and not s._ended and s.hello.daemon_pid == ref.daemon_pid:
        return s
    return None


def _start_thread(b: _Book) -> None:
    if b.thread is not None:
        return
    t = threading.Thread(target=_drainer, args=(b,), name="gdsfs-lease-drain", daemon=True)
    b.thread = t
    t.start()


def _drainer(b: _Book) -> None:
    while b is _book and not b.shutdown:
        b.wake.wait(DRAIN_PERIOD_S)
        b.wake.clear()
        if b.collect:
            # Here, not in close(): a collection of a large heap takes a while, and nothing
            # waits for it. Its finalizers only queue (the drain below releases).
            b.collect = False
            gc.collect()
        if b.gone or b.closing:
            try:
                drain()
            except Exception:  # noqa: BLE001 - a daemon thread has no one to tell; the next call drains again
                pass


def wake() -> None:
    """Let the background thread drain now, without waiting out DRAIN_PERIOD_S (a period made
    longer for a while ends with the sleep under way)."""
    _book.wake.set()


def hold(ref: "Ref", field: str = "", sample: str = "", path: str = "") -> Optional[Hold]:
    """The Hold of ref's lease in this process (made on first use); None
    when ref needed no memory (lease 0). field, sample and path name what
    the bytes are, for GDSLeaseError."""
    return hold_many(((ref, field, sample, path),))[0]


def hold_many(items: Iterable[tuple["Ref", str, str, str]]) -> list[Optional[Hold]]:
    """hold() for each (ref, field, sample, path), in one pass over the book
    (a batch of samples arriving from a worker)."""
    drain()
    b = _book
    out: list[Optional[Hold]] = []
    owners: dict[tuple[str, int, int], Any] = {}
    owned = False
    with b.lock:
        for ref, field, sample, path in items:
            if not ref.lease:
                out.append(None)
                continue
            key = _key(ref)
            h = b.holds.get(key)
            if h is not None:
                held = h.entry
                if not held.field and field:
                    held.field, held.sample, held.path = field, sample, path
                out.append(h)
                continue
            found = b.entries.get(key)
            if found is None:
                sk = (ref.mount, ref.session, ref.daemon_pid)
                if sk not in owners:
                    owners[sk] = _owner(ref)
                e = _Entry(ref, owners[sk], field, sample, path)
                if e.session is not None:
                    lk = (ref.mount, ref.session)
                    b.live[lk] = b.live.get(lk, 0) + 1
                b.entries[key] = e
            else:
                e = found
                # Its last Hold was collected, the release not drained yet: the
                # new holder takes the entry over, the queued release is void.
                e.gen += 1
            h = Hold(e, e.gen, b.pid)
            b.holds[key] = h
            owned = owned or e.session is not None
            out.append(h)
    if owned:
        _start_thread(b)
    return out


def adopt(ref: "Ref", field: str = "", sample: str = "", path: str = "") -> Optional[Hold]:
    """Unpickling of a Hold: this process's Hold of the lease."""
    return hold(ref, field, sample, path)


def check(holds: Iterable[Optional[Hold]]) -> None:
    """Raise GDSLeaseError for the first Hold whose lease is not held."""
    with _book.lock:
        for h in holds:
            if h is not None and h.entry.state != HELD:
                raise h.entry.error(_REASONS[h.entry.state])


def view(h: Hold, base: Any) -> None:
    """A zero-copy view over base takes h's lease over: released when base
    is collected (or explicitly before). Raises GDSLeaseError when the
    lease is not held."""
    b = _book
    with b.lock:
        e = h.entry
        if e.state != HELD:
            raise e.error(_REASONS[e.state])
        e.state = VIEWED
    # The finalizer's arguments keep the Hold (so the session) alive as
    # long as base lives. An entry is viewed once: its event needs no gen.
    f = weakref.finalize(base, _view_gone, b.pid, e, -1, h)
    f.atexit = False
    if e.session is not None:
        _start_thread(b)


def _view_gone(pid: int, e: _Entry, gen: int, _h: Hold) -> None:
    _gone(pid, e, gen, "view")


def pin(ref: "Ref", base: Any) -> None:
    """A zero-copy view over base of a lease its caller releases: the
    session (when this process owns it) does not end while base lives; the
    lease is not released when base dies."""
    s = _owner(ref)
    if s is None:
        return
    b = _book
    sk = (ref.mount, ref.session)
    with b.lock:
        b.live[sk] = b.live.get(sk, 0) + 1
    f = weakref.finalize(base, _unpinned, b.pid, sk, s)
    f.atexit = False
    _start_thread(b)


def _session_of(e: _Entry) -> "Session":
    if e.session is not None:
        return e.session
    from . import _core

    return _core.session_for(e.ref)


# What to do when the daemon that held a lease is gone: the mount is dead until `gdsfs mount`
# runs again, and a new daemon knows none of the old one's leases.
DAEMON_GONE_HINT = ("run `gdsfs mount` on the mountpoint again (`gdsfs status` tells whether it serves), then "
                    "read the samples from a new iterator (or resume from the dataset's state_dict)")


def _release_entries(entries: Sequence[_Entry]) -> list[tuple[_Entry, str, str]]:
    """RELEASE the entries' leases, one request per session; (entry, why,
    hint) for each lease the daemon did not release."""
    by: dict[tuple[str, int, int], list[_Entry]] = {}
    for e in entries:
        by.setdefault((e.ref.mount, e.ref.daemon_pid, e.ref.session), []).append(e)
    bad: list[tuple[_Entry, str, str]] = []
    for es in by.values():
        try:
            status = _session_of(es[0])._release_ids([e.ref.lease for e in es])
        except (GDSUnavailableError, OSError) as err:
            if getattr(err, "errno", None) in (_errno.ECONNABORTED, _errno.ENOTCONN):
                why = f"the gdsfs daemon exited (pid {es[0].ref.daemon_pid}) and its leases with it"
                bad.extend((e, why, DAEMON_GONE_HINT) for e in es)
            else:
                bad.extend((e, f"the daemon refused to release it ({err}): its session ended", "") for e in es)
            continue
        for e, st in zip(es, status):
            if st != 0:
                bad.append((e, "the daemon no longer had it when it was released after the copy "
                               "(its session ended or it was released elsewhere), so the bytes copied cannot be trusted", ""))
    return bad


def release(holds: Iterable[Optional[Hold]], *, check_held: bool = True) -> None:
    """Release the leases of holds now (after a copy out of them). Leases a
    zero-copy view owns, or already released, are left alone.

    With check_held, raise GDSLeaseError (naming lease, field, sample and
    shard) when a lease was not held here any more (then none is released),
    or the daemon says it did not hold it: the bytes just copied are not to
    be trusted.
    """
    err = release_groups([list(holds)], check_held=check_held)[0]
    if err is not None:
        raise err


def release_groups(groups: Sequence[Sequence[Optional[Hold]]], *, check_held: bool = True) -> list[Optional[GDSLeaseError]]:
    """release(holds) of several groups of holds (the batches a loader settles together) with one
    RELEASE request per session for all of them. For each group: None, or (with check_held) the
    GDSLeaseError that release() would have raised for it alone (a lease not held here any more:
    then none of that group's leases is released, as release() releases none; or one the daemon
    did not hold). A lease in several groups is released once, for the first."""
    drain()
    b = _book
    errs: list[Optional[GDSLeaseError]] = [None] * len(groups)
    todo: list[_Entry] = []
    group_of: dict[int, int] = {}  # id(entry) -> the group that releases it
    with b.lock:
        for gi, holds in enumerate(groups):
            hs = [h for h in holds if h is not None]
            if check_held:
                bad = next((h for h in hs if h.entry.state != HELD and id(h.entry) not in group_of), None)
                if bad is not None:
                    errs[gi] = bad.entry.error(_REASONS[bad.entry.state])
                    continue
            for h in hs:
                e = h.entry
                if id(e) in group_of or e.state != HELD:
                    continue  # spent, or a zero-copy view owns it
                group_of[id(e)] = gi
                e.state = RELEASED
                b.forget(e)
                todo.append(e)
    bad_entries = _release_entries(todo) if todo else []
    for e in todo:
        e.session = None  # a spent holder keeps no session alive
    end_free_sessions()
    if check_held:
        for e, why, hint in bad_entries:
            gi = group_of[id(e)]
            if errs[gi] is None:
                errs[gi] = e.error(why, hint)
    return errs


def mark_released(refs: Iterable["Ref"]) -> None:
    """Session.release was called for refs: their holders (if any) are
    done with them; the caller issues the RELEASE."""
    b = _book
    with b.lock:
        for r in refs:
            e = b.entries.get(_key(r))
            if e is not None and e.state in (HELD, VIEWED):
                e.state = RELEASED
                b.forget(e)
                e.session = None


def close_when_free(session: "Session") -> None:
    """End session now when no holder here names one of its leases, else
    when the last one lets go (at a drain). Holders left that only the
    garbage collector can free (a reference cycle) are collected by the
    background thread within DRAIN_PERIOD_S: the program need not call
    gc.collect() for a dropped batch's leases to return."""
    drain()
    b = _book
    sk = (session.mount, session.token.session)
    with b.lock:
        if b.live.get(sk, 0) > 0:
            b.closing[sk] = session
            b.collect = True
            _start_thread(b)
            return
        b.closing.pop(sk, None)
    session._end()


def end_free_sessions() -> None:
    """End the closed sessions of which nothing here holds a lease."""
    b = _book
    ends = []
    with b.lock:
        for sk, s in list(b.closing.items()):
            if b.live.get(sk, 0) == 0:
                ends.append(b.closing.pop(sk))
    for s in ends:
        s._end()


def drain(wait: bool = False) -> None:
    """Release the leases whose last holder was collected, then end the
    closed sessions nothing here holds any more. Called by every client
    call and the background thread; a no-op in a forked child's copy of
    its parent's book and at interpreter shutdown. wait: when another
    thread is draining, wait for it (at most FORK_WAIT_S) and drain what
    is left, so that on return nothing queued before the call is counted
    as held (held_bytes)."""
    b = _book
    # Nothing queued first: os.getpid() is a system call, and every client call drains.
    if not (b.gone or b.closing) or b.shutdown or b.pid != os.getpid():
        return
    if not b.io.acquire(blocking=wait, timeout=FORK_WAIT_S if wait else -1):
        return  # another thread is draining (or a fork is starting)
    try:
        todo: list[_Entry] = []
        with b.lock:
            while b.gone:
                e, gen, why = b.gone.popleft()
                if why == "pin":
                    n = b.live.get(e, 0) - 1
                    if n > 0:
                        b.live[e] = n
                    else:
                        b.live.pop(e, None)
                    continue
                if why == "hold" and e.gen != gen:
                    continue  # a newer Hold took the entry over
                if (why == "hold" and e.state == HELD) or (why == "view" and e.state == VIEWED):
                    e.state = GONE
                    b.forget(e)
                    if e.session is not None:
                        todo.append(e)
        if todo:
            _release_entries(todo)  # nobody to tell: the session's end frees them anyway
            for e in todo:
                e.session = None
        end_free_sessions()
    finally:
        b.io.release()


def held_bytes(mount: str, device: int, *, collect: bool = False) -> int:
    """Slab bytes of the leases this process holds or views on mount's device (its uid's, as
    the daemon counts them against the uid's share of that device's pool: each widened to 4 KiB
    pages, as the daemon reads them). Leases whose last holder went are released first (drain),
    not counted; with collect, also those whose holders only a garbage collection frees (a
    reference cycle: a dead DataLoader iterator's items)."""
    if collect:
        gc.collect()
    drain(wait=True)
    with _book.lock:
        refs = [e.ref for e in _book.entries.values() if e.ref.mount == mount and e.ref.device == device]
    return sum(-(-(r.offset + r.length) // 4096) * 4096 - r.offset // 4096 * 4096 for r in refs)


def live() -> list[tuple[int, str, str, str, str]]:
    """(lease, state, field, sample, path) of every lease this process
    holds or views (for diagnostics and tests)."""
    with _book.lock:
        return [(e.ref.lease, e.state, e.field, e.sample, e.path) for e in _book.entries.values()]
