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
