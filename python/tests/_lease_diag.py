"""What a test that finds leases left in the daemon reports: the daemon's counts, this process's
lease book (queued releases, sessions waiting to end, the drain's lock), the Holds still alive and
what refers to each (gc.get_referrers, walked up to a frame, a module or a cycle), and whether a
garbage collection frees them (a reference cycle) or not (a live reference)."""

from __future__ import annotations

import gc
import os
import sys
import types
from typing import Any, Iterable, Optional

_MAX_STEPS = 16


def _describe(o: Any) -> str:
    if isinstance(o, types.FrameType):
        gen = " (a generator's)" if o.f_code.co_flags & 0x20 else ""
        return f"frame {o.f_code.co_name}{gen} at {os.path.basename(o.f_code.co_filename)}:{o.f_lineno}"
    if isinstance(o, dict):
        keys = [k for k in list(o)[:6]]
        return f"dict keys={keys!r}"
    if isinstance(o, (list, tuple, set)):
        return f"{type(o).__name__} of {len(o)}"
    if isinstance(o, types.ModuleType):
        return f"module {o.__name__}"
    if isinstance(o, BaseException):
        return f"exception {type(o).__name__}: {str(o)[:80]}"
    if isinstance(o, types.TracebackType):
        return f"traceback of {_describe(o.tb_frame)}"
    return f"{type(o).__module__}.{type(o).__qualname__}"


def _own_frame(o: Any) -> bool:
    return isinstance(o, types.FrameType) and o.f_code in (_chain.__code__, report.__code__)


def _chain(start: Any, ignore: set[int]) -> list[str]:
    """One path of referrers up from start: each step the first referrer that is not the
    diagnostics' own; ends at a module, an object seen before (a cycle), or one nothing refers
    to. (No nested scopes here: their cells would refer to the objects walked.)"""
    out: list[str] = []
    seen = {id(start)}
    o: Any = start
    cand: Optional[list[Any]] = None
    for _ in range(_MAX_STEPS):
        cand = None
        refs = gc.get_referrers(o)
        cand = []
        for r in refs:
            if id(r) not in ignore and r is not refs and r is not out and not _own_frame(r):
                cand.append(r)
        del refs
        if not cand:
            out.append("(nothing else refers to it)")
            break
        nxt = None
        for r in cand:
            if id(r) not in seen:
                nxt = r
                break
        kinds = sorted(set(map(_describe, cand)))[:5]
        if nxt is None:
            out.append(f"<- CYCLE back to an object already on this path ({'; '.join(kinds)})")
            break
        first = _describe(nxt)
        others = [k for k in kinds if k != first]
        out.append(f"<- {first}" + (f"   [also: {'; '.join(others)}]" if others else ""))
        if isinstance(nxt, types.ModuleType) or (isinstance(nxt, dict) and "__builtins__" in nxt):
            break
        seen.add(id(nxt))
        o = nxt
        r = nxt = None
    return out


def report(mount: Any, watched: Optional[Iterable[Any]] = None) -> str:
    """A multi-line account of the leases left: call it where a test finds some (before any
    gc.collect(): it collects last, and says what that freed)."""
    from gdsfs import _leases

    lines: list[str] = []
    try:
        import torch

        lines.append(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.cuda.is_available()}, gc enabled {gc.isenabled()}")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        lines.append(f"python {sys.version.split()[0]} (torch: {e})")
    try:
        st = mount.stats()
        lines.append("daemon: " + ", ".join(f"{k}={v}" for k, v in st.items() if any(w in k for w in ("lease", "session", "slab", "held"))))
    except OSError as e:
        lines.append(f"daemon: STATUS failed: {e}")
    b = _leases._book
    lines.append(f"book: pid ok {b.pid == os.getpid()}, shutdown {b.shutdown}, queued releases {len(b.gone)}, sessions waiting to end "
                 f"{sorted(k[1] for k in b.closing)}, live per session {dict((k[1], n) for k, n in b.live.items())}, drain lock held "
                 f"{b.io.locked()}, drain thread alive {bool(b.thread and b.thread.is_alive())}")
    by_state: dict[str, list[int]] = {}
    for lease, state, _f, _s, _p in _leases.live():
        by_state.setdefault(state, []).append(lease)
    lines.append("book entries: " + (", ".join(f"{s}: {sorted(v)}" for s, v in by_state.items()) or "none"))
    holds = [o for o in gc.get_objects() if isinstance(o, _leases.Hold)]
    alive = [h for h in holds if h.entry.state == _leases.HELD]
    lines.append(f"Holds alive: {len(holds)}, of leases still held: {len(alive)} {sorted(h.entry.ref.lease for h in alive)[:32]}")
    ignore = {id(holds), id(alive), id(lines), id(by_state)}
    if watched is not None:
        watched = list(watched)
        ignore.add(id(watched))
    shown: set[str] = set()
    for h in alive:
        chain = _chain(h, ignore)
        key = "\n".join(chain)
        if key in shown:
            continue
        shown.add(key)
        lines.append(f"referrers of the Hold of lease {h.entry.ref.lease} (sample {h.entry.sample!r}):")
        lines.extend("    " + c for c in chain)
        if len(shown) >= 3:
            break
    n_alive = len(alive)
    del holds, alive, h
    freed = gc.collect()
    after = sum(1 for o in gc.get_objects() if isinstance(o, _leases.Hold) and o.entry.state == _leases.HELD)
    lines.append(f"gc.collect() freed {freed} objects; Holds of held leases alive after it: {after} (before: {n_alive})")
    left = mount.wait_leases(0, timeout_s=2.0)
    verdict = "a reference cycle: the garbage collector frees them" if left == 0 and n_alive else (
        "still referenced after gc (a live reference: see the referrers)" if left else "gone after gc.collect()")
    lines.append(f"daemon leases after gc.collect() and a drain: {left} -> {verdict}")
    return "\n".join(lines)
