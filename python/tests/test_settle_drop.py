"""Batches dropped midway through settled() (plain Python iteration, no workers) give every lease
back without the program calling gc.collect(): when the consumer drops them by reference count,
and when it drops them inside a reference cycle (then closing the dataset collects it: a cycle
that only the garbage collector frees must not keep a closed session's leases). The daemon's
STATUS is the oracle; on a failure the message says which leases are left and what still refers
to their Holds (_lease_diag.report)."""

from __future__ import annotations

import gc
import itertools
import types
import weakref

import pytest

import _lease_diag
from test_settle import _raw_batches


@pytest.fixture
def no_gc():
    """The garbage collector off for the test (it would free cycles at a moment of its own
    choosing); back on after it."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _stop_after_one(gen, stop: str) -> list:
    if stop == "islice":
        return list(itertools.islice(gen, 1))
    got = []
    for b in gen:
        got.append(b)
        break
    return got


@pytest.mark.parametrize("stop", ["islice", "break", "del"])
def test_settled_batches_dropped_midway_go_by_reference_count(gdsfs_mount, monkeypatch, no_gc, stop: str) -> None:
    """With the garbage collector off, dropping the generator (islice, break, del) and the batches
    frees every Hold at once (nothing but a reference cycle could keep one), and closing the
    dataset then returns every lease. This is where a cycle on another Python or torch shows
    itself: the message names what refers to the Holds left."""
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "SETTLE_BATCHES", 2)
    ds, raws, truth = _raw_batches(gdsfs_mount, "settle-refcount")
    weak = [weakref.ref(h) for r in raws for h in r["x.npy"].holds if h is not None]
    assert len(weak) == 16
    gen = _tensors.settled(iter(raws), ready=lambda: True)
    got = _stop_after_one(gen, stop)
    assert got[0]._pending is None
    assert [got[0]["x.npy"][i].cpu().numpy().tobytes() for i in range(4)] == [truth[k] for k in got[0]["__key__"]]
    if stop == "del":
        del gen
    else:
        gen.close()
    del raws, got
    left = [w for w in weak if w() is not None]
    assert not left, f"{len(left)} Holds outlived their batches:\n" + _lease_diag.report(gdsfs_mount)
    ds.close()
    n = gdsfs_mount.wait_leases(0)
    assert n == 0, _lease_diag.report(gdsfs_mount)


def test_batches_dropped_in_a_reference_cycle_return_their_leases_at_close(gdsfs_mount, monkeypatch, no_gc) -> None:
    """settled() stopped after one batch of a group of 2; the consumer's state (the generator and
    the batches it never took) sits in an object that refers to itself, and is dropped: only the
    garbage collector can free it, and the program never calls it. Closing the dataset still
    returns every lease, its own and those of the batches settled() never took."""
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "SETTLE_BATCHES", 2)
    ds, raws, truth = _raw_batches(gdsfs_mount, "settle-cycle")
    gen = _tensors.settled(iter(raws), ready=lambda: True)
    state = types.SimpleNamespace(batches=raws, gen=gen, got=_stop_after_one(gen, "islice"))
    state.me = state  # a back-reference: the cycle
    b = state.got[0]
    assert b._pending is None
    assert [b["x.npy"][i].cpu().numpy().tobytes() for i in range(4)] == [truth[k] for k in b["__key__"]]
    gen.close()
    del raws, gen, state, b
    ds.close()
    n = gdsfs_mount.wait_leases(0)
    assert n == 0, _lease_diag.report(gdsfs_mount)


@pytest.mark.parametrize("stop", ["islice", "break"])
def test_a_closed_settled_generator_lets_go_of_what_it_never_took(no_gc, stop: str) -> None:
    """settled() stopped after one item and closed while the consumer still holds the generator
    (a variable of its own): the source iterator and the items settled() never took are freed at
    once, not when that variable goes. CPython 3.12.3 (Ubuntu 24.04's) kept a closed generator's
    locals when its yield sat outside every try block (gh-118272), and with them the batches never
    taken and their leases (scripts/gpu/gen_close_probe.py shows which Pythons do)."""
    from gdsfs import _tensors

    class Item:
        pass

    items = [Item() for _ in range(4)]
    weak = [weakref.ref(x) for x in items]
    gen = _tensors.settled(iter(items), ready=lambda: True)
    got = _stop_after_one(gen, stop)
    assert got == items[:1]
    gen.close()
    del items, got
    assert [w() for w in weak] == [None] * 4


def _yields_outside_try(fn) -> list[int]:
    """Lines of fn's own yields that sit outside every try block."""
    import ast
    import inspect
    import textwrap

    src = textwrap.dedent(inspect.getsource(fn))
    first = inspect.getsourcelines(fn)[1]
    tree = ast.parse(src).body[0]
    out: list[int] = []

    def walk(node: ast.AST, in_try: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(ch, (ast.Yield, ast.YieldFrom)) and not in_try:
                out.append(first + ch.lineno - 1)
            walk(ch, in_try or isinstance(ch, ast.Try))

    walk(tree, False)
    return out


def test_generators_that_hold_leases_yield_inside_a_try() -> None:
    """The generators that hand out or hold back leased batches and samples yield only inside a
    try block, so that close() unwinds them and frees their locals on every Python, CPython 3.12.3
    included (see the test above: its behaviour shows only on that Python)."""
    import gdsfs.torch as gt
    from gdsfs import _tensors

    for fn in (_tensors.settled, gt.GDSShardDataset.__iter__, gt.DataLoader.__iter__):
        assert _yields_outside_try(fn) == [], f"{fn.__qualname__} yields outside a try block"


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fails", ["source", "lease"])
def test_a_kept_error_of_settled_keeps_not_its_source(no_gc, grouped: bool, fails: str) -> None:
    """settled() over a source that fails after two items (a DataLoader whose worker died), or
    whose second item fails to settle (a GDSLeaseError mid-group): the items before come out, then
    that very exception. A consumer that keeps the exception (a retry loop's last error, a log
    record, the REPL's sys.last_value) keeps its traceback, and with it settled()'s frame: that
    frame must not keep the source (a DataLoader iterator: its workers and the leases of the
    batches they hold) nor an item nor the exception itself (a cycle only the collector breaks)."""
    import gdsfs
    from gdsfs import _tensors

    class Item:
        pass

    items = [Item(), Item()]
    weak = [weakref.ref(x) for x in items]
    boom = RuntimeError("DataLoader worker (pid(s) 1234) exited unexpectedly")

    def source():
        yield from items
        if fails == "source":
            raise boom

    src = source()
    weak_src = weakref.ref(src)
    want = 2
    if fails == "lease":
        boom = gdsfs.GDSLeaseError(7, "the daemon no longer had it")
        real = _tensors._settle_group
        want = 1

        def settle(group):
            errs = real(group)
            return [boom if x is items[1] else err for x, err in zip(group, errs)]
        _tensors._settle_group, restore = settle, real
    try:
        gen = _tensors.settled(src, ready=(lambda: True) if grouped else None)
        got = []
        with pytest.raises(type(boom)) as e:
            for x in gen:
                got.append(x)
    finally:
        if fails == "lease":
            _tensors._settle_group = restore
    assert got == items[:want] and e.value is boom
    kept = e.value  # the consumer keeps the error, and with it the traceback
    assert list(gen) == []
    items.clear()
    del got, src, gen, e
    x = None
    assert weak_src() is None, "a kept error of settled() keeps its source alive (through settled()'s frame)"
    assert [w() for w in weak] == [None, None], "a kept error of settled() keeps its items alive"
    frames = [tb.tb_frame for tb in _walk_tb(kept.__traceback__) if tb.tb_frame.f_code is _tensors.settled.__code__]
    assert frames, "settled() is not in the traceback"
    for f in frames:
        assert not any(v is kept for v in f.f_locals.values()), "settled()'s frame keeps the exception it raised (a cycle)"


def _walk_tb(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next
