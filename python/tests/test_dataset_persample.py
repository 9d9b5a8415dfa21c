"""Issue 15, 16 KiB samples: what a DataLoader worker pays per sample (helper small16). The
cheaper paths must give the same batches, every sample once, the same resume point, and keep
the lease rules."""

from __future__ import annotations

import gc
import multiprocessing
import os

import pytest

from test_small_samples import _small_shards


def _record_freeze(path: str, _worker_id: int) -> None:
    """worker_init_fn: what a worker's garbage collector holds frozen, written to path.PID."""
    with open(f"{path}.{os.getpid()}", "w") as f:
        f.write(str(gc.get_freeze_count()))


def _worker_freezes(out: str) -> list[int]:
    d, base = os.path.split(out)
    return [int(open(os.path.join(d, n)).read()) for n in sorted(os.listdir(d)) if n.startswith(base + ".")]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_forked_workers_inherit_the_parents_heap_frozen(gdsfs_mount, tmp_path) -> None:
    """A worker forked by gdsfs.torch.DataLoader gets the parent's objects in the collector's
    permanent generation (its collections never walk them); the parent's are back in the
    collected generations once the workers are started."""
    import gdsfs.torch as gt

    paths, _truth = _small_shards(gdsfs_mount, nshards=2, per=16)
    out = str(tmp_path / "freeze")
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    if gc.get_freeze_count():
        ds.close()
        pytest.skip("objects are frozen already (by another test): the loader leaves a program's own freeze alone")
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork", worker_init_fn=lambda w: _record_freeze(out, w))
    n = sum(len(b["__key__"]) for b in dl)
    assert n == 32
    assert gc.get_freeze_count() == 0, "the parent's heap stays frozen"
    freezes = _worker_freezes(out)
    assert len(freezes) == 2 and all(f > 1000 for f in freezes), freezes
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
def test_a_programs_own_freeze_is_left_alone(gdsfs_mount, tmp_path) -> None:
    """A program that froze objects itself keeps them frozen: the loader neither freezes more
    nor unfreezes them."""
    import gdsfs.torch as gt

    paths, _truth = _small_shards(gdsfs_mount, nshards=2, per=8)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        dl = gt.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
        assert sum(len(b["__key__"]) for b in dl) == 16
        # Frozen objects freed by their last reference leave the count (torch 2.11 frees one
        # here), so the count may fall by a few; an unfreeze would empty it, a second freeze
        # would add the thousands of objects made since.
        after = gc.get_freeze_count()
        assert frozen // 2 < after <= frozen, (frozen, after)
    finally:
        gc.unfreeze()
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_cheaply_made_tensorref_is_a_tensorref(gdsfs_mount) -> None:
    """The TensorRefs a dataset makes without the dataclass's __init__ equal, hash, pickle and
    materialize as ones made the ordinary way."""
    import copy
    import itertools
    import pickle

    import gdsfs.torch as gt
    from gdsfs import _tensors

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=4)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    samples = list(itertools.islice(iter(ds), 4))
    for s in samples:
        t = s["x.npy"]
        plain = gt.TensorRef(t.ref, t.dtype, t.shape, t.start, t.fortran, t.field, t.sample, t.path, t._hold)
        fast = _tensors._new_tensor_ref(t.ref, t.dtype, t.shape, t.start, t.fortran, t.field, t.sample, t.path, t._hold)
        assert type(t) is gt.TensorRef and fast == plain and hash(fast) == hash(plain) and repr(fast) == repr(plain)
        assert pickle.loads(pickle.dumps(fast)) == plain
        with pytest.raises(Exception):
            fast.start = 1  # frozen
        assert copy.copy(fast) == plain
    got = {s["__key__"]: s["x.npy"].materialize().numpy().tobytes() for s in samples}
    assert got == {k: truth[k] for k in got}
    ds.close()
    del samples, s, t, plain, fast
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_shared_range_column_is_the_general_columns(gdsfs_mount) -> None:
    """A column whose samples share one Ref object (a worker's batch run) is built without the
    per-sample loop: the same leases, Holds, geometries, rows and names as the general path
    (the same refs through copies of the Ref, which only compare equal)."""
    import copy
    import dataclasses
    import itertools

    import gdsfs.torch as gt
    from gdsfs import _tensors

    paths, _truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    ds._batched = 8  # as gdsfs.torch.DataLoader tells its workers' copies
    it = iter(ds)
    for _ in range(2):
        refs = [s["x.npy"] for s in itertools.islice(it, 8)]
        assert len({id(t.ref) for t in refs}) == 1
        fast = _tensors._RefColumn(refs)
        general = _tensors._RefColumn([dataclasses.replace(t, ref=copy.copy(t.ref)) for t in refs])
        for name in ("leases", "geos", "idx", "gidx", "starts", "fields", "samples", "paths"):
            assert getattr(fast, name) == getattr(general, name), name
        assert fast.holds == [refs[0]._hold] and len(general.holds) == 1
        mixed = _tensors._RefColumn(refs[:4] + [dataclasses.replace(t, shape=(t.shape[0] // 2,)) for t in refs[4:]])
        assert mixed.gidx == [0] * 4 + [1] * 4 and len(mixed.geos) == 2 and mixed.idx == [0] * 8
        _tensors.GDSBatch({"x.npy": fast}).release()
    it.close()
    ds.close()
    del refs, fast, general, mixed
    assert gdsfs_mount.wait_leases(0) == 0


def _positions_by_at(plan, slot: int, skip: int) -> list[tuple[int, int, int]]:
    """EpochPlan.positions as it was: at() of every position of the slot's interleaved runs."""
    lo, hi = plan.block(slot)
    k = min(plan.interleave, max(1, hi - lo))
    runs = [range(lo + j * (hi - lo) // k, lo + (j + 1) * (hi - lo) // k) for j in range(k)]
    longest = max(len(r) for r in runs)
    order = [plan.at(r[i]) for i in range(longest) for r in runs if i < len(r)]
    return [(lo + n, s, i) for n, (s, i) in enumerate(order) if n >= skip]


@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [1], [0, 4], [13, 13, 1, 0, 9]])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("even,world,slots", [(None, 1, 1), (None, 1, 3), ("pad", 2, 4), ("drop", 2, 6), ("pad", 3, 3)])
def test_the_walk_over_shard_stretches_gives_the_positions_at_gives(counts, shuffle, even, world, slots) -> None:
    """A slot's positions without interleaving come one shard's stretch at a time: the same
    (position, shard, index) as at() of each position, from any resume point, and the same
    sample permutations kept afterwards."""
    from gdsfs._plan import EpochPlan

    def plan():
        return EpochPlan(counts, seed=7, epoch=2, shuffle=shuffle, slots=slots, world=world, even=even)

    for slot in range(slots):
        for skip in (0, 1, 2, 5, 100):
            a, b = plan(), plan()
            assert list(a.positions(slot, skip)) == _positions_by_at(b, slot, skip), (slot, skip)
            assert dict(a._perms) == dict(b._perms) and list(a._perms) == list(b._perms)
