"""Issue 15 at 16 KiB: the main process's loop materializes a worker's item of k batches
(gdsfs.torch.DataLoader's batches_per_item) a run of batches at a time: a worker reads an item's
samples of a shard as one range, so one lease, and the item's batches of one field form one
evenly spaced run in it, whose leases are checked and whose run is found once. What the user
sees stays: the same batches as one batch per item, byte for byte (fields, keys, order, dtypes,
shapes); every lease back after islice, break, del, an exception in batch_map (the daemon's
STATUS as the oracle); a batch whose lease was lost is not yielded, the ones before it are. With
_tensors.ITEM_VIEWS (CUDA only by default: docs/benchmarks.md, "One copy per item") a
batch's field is a view of the run's one copy, only where the run holds, and stays right after
later items and after every lease went back (the bytes were copied, not aliased)."""

from __future__ import annotations

import itertools
import os

import pytest

import _lease_diag
from _wds_helpers import fresh_dir, npy, write_tar
from test_settle import _held_here


def _views(on: bool) -> frozenset[str]:
    """_tensors.ITEM_VIEWS: views on every device type, or on none."""
    return frozenset({"cpu", "cuda"}) if on else frozenset()


def _write(mount, name: str, shards: list[list[object]]) -> tuple[list[str], dict[str, object]]:
    """Tars of one .npy array per sample (plus a .cls), shards[s][i] the array of sample i of
    shard s; the arrays by key."""
    src, mnt = fresh_dir(mount, name)
    truth: dict[str, object] = {}
    paths = []
    for s, arrays in enumerate(shards):
        samples = []
        for i, a in enumerate(arrays):
            key = f"s{s}_{i:04d}"
            truth[key] = a
            samples.append((key, {"x.npy": npy(a), "cls": str(i).encode()}))
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
    return paths, truth


def _arrays(n: int, dtype: str, shape: tuple[int, ...], seed: int) -> list[object]:
    import numpy as np

    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind == "f":
        return [rng.standard_normal(shape).astype(dtype) for _ in range(n)]
    return [rng.integers(0, 100, size=shape).astype(dtype) for _ in range(n)]


def _loader(ds, **kw):
    import gdsfs.torch as gt

    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    kw.setdefault("timeout", 60)
    # The host slabs' rows stay on the CPU: on a GPU machine pin_memory (its default there) copies
    # them to the GPU batch by batch, where the item path leaves the batch path alone
    # (test_a_copy_to_the_gpu_from_host_slabs_keeps_the_batch_path).
    kw.setdefault("pin_memory", False)
    return gt.DataLoader(ds, **kw)


class _Segments:
    """Counts the batches the loop's item path gathered together (_materialize_segment)."""

    def __init__(self, monkeypatch) -> None:
        from gdsfs import _tensors

        self.batches = 0
        real = _tensors._materialize_segment

        def spy(bs, *args):
            out = real(bs, *args)
            if out is not None:
                self.batches += len(out)
            return out

        monkeypatch.setattr(_tensors, "_materialize_segment", spy)


def _store(t):
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


def _storage(t) -> int:
    return _store(t).data_ptr()


def _own(t) -> bool:
    """t is its own copy: its storage holds its bytes and nothing else."""
    return _store(t).nbytes() == t.numel() * t.element_size()


def _bytes_of(b) -> list[tuple[object, ...]]:
    """A batch as (field, key order, dtype, shape, bytes) of every field, to compare byte for byte."""
    out = []
    for k, v in b.items():
        if hasattr(v, "numpy"):
            out.append((k, str(v.dtype), tuple(v.shape), v.cpu().contiguous().numpy().tobytes()))
        else:
            out.append((k, repr(v)))
    return out


@pytest.mark.parametrize("dtype,shape,views", [("float32", (4096,), False), ("float32", (4096,), True), ("int16", (8, 64), False),
                                               ("uint8", (1000,), True), ("float64", (2, 3, 5), False), ("int64", (1,), True)])
def test_items_are_the_one_batch_per_item_batches_byte_for_byte(gdsfs_mount, monkeypatch, dtype, shape, views: bool) -> None:
    """batches_per_item=3 (and the default) give the batches of batches_per_item=1, field for
    field, key for key, in the same order per worker, byte for byte; the item path gathered
    most of them (every full item of a shard's run: 2 shards of 26 samples, 2 workers, batches
    of 4, each worker's last batch short)."""
    from gdsfs import _tensors
    import gdsfs.torch as gt

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(views))
    paths, truth = _write(gdsfs_mount, f"itemcopy-eq-{dtype}", [_arrays(26, dtype, shape, s) for s in range(2)])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)

    def per_worker(k):
        out: dict[int, list[object]] = {}
        for b in _loader(ds, batches_per_item=k):
            (slot,) = b.progress
            out.setdefault(slot, []).append(_bytes_of(b))
        return out

    want = per_worker(1)
    seg = _Segments(monkeypatch)
    for k in (3, None):
        assert per_worker(k) == want, k
    assert sum(len(v) for v in want.values()) == 14
    assert seg.batches >= 14, f"the item path gathered {seg.batches} of 2 x 14 batches"
    for bs in want.values():
        for fields in bs:
            for f in fields:
                if f[0] == "x.npy":
                    assert f[1] == f"torch.{dtype}" and f[2][1:] == shape
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def _one_worker_batches(gdsfs_mount, monkeypatch, name: str, shards, **kw):
    from gdsfs import _tensors
    import gdsfs.torch as gt

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(True))
    paths, truth = _write(gdsfs_mount, name, shards)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    got = list(_loader(ds, num_workers=1, batches_per_item=3, **kw))
    return ds, got, truth


def _check(got, truth) -> None:
    import numpy as np

    for b in got:
        for i, key in enumerate(b["__key__"]):
            assert np.array_equal(b["x.npy"][i].cpu().numpy(), truth[key]), key


def test_a_run_of_an_item_is_one_tensor_its_batches_views(gdsfs_mount, monkeypatch) -> None:
    """ITEM_VIEWS: one shard of 24 equal samples, one worker, items of 3 batches of 4: each item's
    batches view one tensor (their rows of it, in order), other items' another; the last item's
    short batch too (drop_last=False)."""
    ds, got, truth = _one_worker_batches(gdsfs_mount, monkeypatch, "itemcopy-views", [_arrays(22, "float32", (4096,), 1)])
    assert [len(b["__key__"]) for b in got] == [4, 4, 4, 4, 4, 2]
    st = [_storage(b["x.npy"]) for b in got]
    assert st[0] == st[1] == st[2] and st[3] == st[4] == st[5] and st[0] != st[3]
    for b in got:
        assert not _own(b["x.npy"]) and b["x.npy"].is_contiguous()
    _check(got, truth)
    del got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_an_item_larger_than_read_ahead_is_one_read(gdsfs_mount, monkeypatch) -> None:
    """read_ahead=10 samples, items of 3 batches of 4 (12 samples): the worker reads in chunks of
    whole items, so each item's batches are one run of one lease (ITEM_VIEWS: one tensor), not
    split where a chunk of 10 would end."""
    from gdsfs import _tensors
    import gdsfs.torch as gt

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(True))
    paths, truth = _write(gdsfs_mount, "itemcopy-chunk", [_arrays(36, "float32", (4096,), 9)])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=10)
    got = list(_loader(ds, num_workers=1, batches_per_item=3))
    st = [_storage(b["x.npy"]) for b in got]
    assert len(got) == 9 and [len(set(st[i : i + 3])) for i in range(0, 9, 3)] == [1, 1, 1] and len(set(st)) == 3
    _check(got, truth)
    del got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("case", ["lengths", "shards", "drop_last", "off"])
def test_no_view_where_the_run_does_not_hold(gdsfs_mount, monkeypatch, case: str) -> None:
    """Samples of different lengths (a list field), an item across two shards (a batch over both
    has two leases: it gets its own copy, while a shard's run of two batches is still one), a
    drop_last item (its full batches are views, the short one never comes) and ITEM_VIEWS off:
    the batches are right, and no batch's field shares storage with a batch it must not."""
    from gdsfs import _tensors

    if case == "lengths":
        alternate = [x for pair in zip(_arrays(12, "float32", (4096,), 2), _arrays(12, "float32", (4000,), 3)) for x in pair]
        ds, got, truth = _one_worker_batches(gdsfs_mount, monkeypatch, "itemcopy-len", [alternate])
        assert len(got) == 6 and all(isinstance(b["x.npy"], list) for b in got)
        _check(got, truth)
    elif case == "shards":
        # Shards of 10: items of 12 samples; the first item is batches [0-3] [4-7] [8-11], the
        # last of them over both shards.
        ds, got, truth = _one_worker_batches(gdsfs_mount, monkeypatch, "itemcopy-shards", [_arrays(10, "float32", (4096,), s) for s in range(2)])
        st = [_storage(b["x.npy"]) for b in got]
        assert [len(b["__key__"]) for b in got] == [4, 4, 4, 4, 4]
        assert st[0] == st[1], "one shard's two batches are one run of one lease"
        assert st[2] not in (st[0], st[3], st[4]) and _own(got[2]["x.npy"]), "a batch over two shards has its own copy"
        assert st[3] == st[4]
        _check(got, truth)
    elif case == "drop_last":
        ds, got, truth = _one_worker_batches(gdsfs_mount, monkeypatch, "itemcopy-drop", [_arrays(22, "float32", (4096,), 4)], drop_last=True)
        assert [len(b["__key__"]) for b in got] == [4] * 5
        st = [_storage(b["x.npy"]) for b in got]
        assert st[0] == st[1] == st[2] and st[3] == st[4] and st[0] != st[3]
        _check(got, truth)
    else:
        ds, got, truth = _one_worker_batches(gdsfs_mount, monkeypatch, "itemcopy-off", [_arrays(24, "float32", (4096,), 5)])
        monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(False))
        seg = _Segments(monkeypatch)
        got = list(_loader(ds, num_workers=1, batches_per_item=3))
        assert seg.batches == 6
        st = [_storage(b["x.npy"]) for b in got]
        assert len(set(st)) == 6 and all(_own(b["x.npy"]) for b in got)
        _check(got, truth)
    del got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_views_stay_right_after_later_items_and_every_release(gdsfs_mount, monkeypatch) -> None:
    """ITEM_VIEWS: the first item's batches, kept while the rest of the epoch is materialized
    (the pool's memory reused for later items) and after the dataset closed (every lease back,
    the session ended), still hold their samples' bytes: they were copied out of the slab."""
    from gdsfs import _tensors
    import gdsfs.torch as gt

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(True))
    paths, truth = _write(gdsfs_mount, "itemcopy-keep", [_arrays(48, "float32", (4096,), s) for s in range(2)])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    it = iter(_loader(ds, batches_per_item=4))
    first = [next(it) for _ in range(4)]
    assert len({_storage(b["x.npy"]) for b in first}) == 1
    for b in it:
        pass
    for b in _loader(ds, batches_per_item=4):
        pass
    del it, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
    _check(first, truth)


def _held_samples() -> set[str]:
    from gdsfs import _leases

    return {sample for _lease, state, _f, sample, _p in _leases.live() if state == "held"}


class _Boom(Exception):
    pass


@pytest.mark.parametrize("stop,views", [("islice", False), ("islice", True), ("break", True), ("del", True), ("batch_map", True)])
def test_stopping_mid_item_leaves_no_lease(gdsfs_mount, monkeypatch, stop: str, views: bool) -> None:
    """Stopped after 2 batches of an item of 4 gathered together (islice, break, del of the
    batches and the iterator, an exception in batch_map): no lease of the item is held here, the
    batches taken are right, and once the dataset is closed the daemon holds none."""
    from gdsfs import _tensors
    import gdsfs.torch as gt

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(views))
    seg = _Segments(monkeypatch)
    paths, truth = _write(gdsfs_mount, f"itemcopy-stop-{stop}", [_arrays(32, "float32", (4096,), s) for s in range(2)])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    n = [0]

    def boom(b):
        n[0] += 1
        if n[0] == 3:
            raise _Boom()
        return b

    dl = _loader(ds, batches_per_item=4, batch_map=boom if stop == "batch_map" else None)
    it = iter(dl)
    got = []
    if stop == "islice":
        got = list(itertools.islice(it, 2))
    elif stop == "break":
        for b in it:
            got.append(b)
            if len(got) == 2:
                break
        del b
    elif stop == "del":
        got = [next(it), next(it)]
    else:
        with pytest.raises(_Boom):
            for b in it:
                got.append(b)
        del b
    assert len(got) == 2 and seg.batches >= 4
    item = set(got[0]["__key__"]) | set(got[1]["__key__"])
    assert not _held_samples() & item, "a lease of the item the loop was in is still held"
    _check(got, truth)
    if stop == "del":
        del got
        got = []
    del it
    ds.close()
    del got
    left = gdsfs_mount.wait_leases(0)
    assert left == 0, _lease_diag.report(gdsfs_mount)


def _shared_item(mount, name: str, per: int = 4, n: int = 3):
    """Without workers: n batches of per samples of one shard whose samples were read as one
    range, one lease (what a worker reads for an item: GDSShardDataset._runs), and a batch of
    another shard (its own lease)."""
    import gdsfs.torch as gt

    paths, truth = _write(mount, name, [_arrays(n * per, "float32", (4096,), 7), _arrays(per, "float32", (4096,), 8)])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=n * per)
    ds._batched = n * per  # as in a worker sending items of n batches
    samples = list(ds)
    ds._batched = 0
    shared = [gt.collate(samples[i : i + per]) for i in range(0, n * per, per)]
    other = [gt.collate(samples[n * per :])]
    assert len({r.lease for b in shared for r in b["x.npy"].leases}) == 1
    return ds, shared, other, truth


@pytest.mark.parametrize("how", ["daemon", "shared-after-own", "own-between"])
def test_a_lost_lease_of_an_item_yields_what_was_before_it(gdsfs_mount, monkeypatch, how: str) -> None:
    """Plain Python iteration of settled() over one item: the shared lease of the item's run lost
    behind the session's back (its settle fails: no batch of it is yielded); a batch of its own
    lease released here after the run (the run's batches are yielded, then GDSLeaseError); a
    released batch between two batches of the run (the first is yielded, then the error: the
    run's later batch gives back nothing the first still needs). No lease is left either way."""
    import gdsfs
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "ITEM_VIEWS", _views(True))
    ds, shared, other, truth = _shared_item(gdsfs_mount, f"itemcopy-lost-{how}")
    if how == "daemon":
        item = _tensors._Batches(other[:1] + shared)
        ds.session._release_ids([r.lease for r in shared[0]["x.npy"].leases])
        want = 1
    elif how == "shared-after-own":
        item = _tensors._Batches(shared + other[:1])
        other[0].release()
        want = 3
    else:
        item = _tensors._Batches([shared[0], other[0], shared[1]])
        other[0].release()
        want = 1
    mine = {r.lease for b in shared + other for r in b["x.npy"].leases}
    got = []
    with pytest.raises(gdsfs.GDSLeaseError):
        for b in _tensors.settled(iter([item]), ready=lambda: False):
            got.append(b)
    assert len(got) == want
    _check(got, truth)
    assert not (mine & _held_here()), "a lease of the item is still held"
    del item, got, shared, other
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_copy_to_the_gpu_from_host_slabs_keeps_the_batch_path(gdsfs_mount, monkeypatch) -> None:
    """Where the batch path copies specially (pin with a GPU: host slabs' rows are pinned, then
    copied to the GPU; or a target device other than the slab's), the item path gives the run
    back untouched (CUDA faked: torch.cuda.is_available and current_device, nothing else is
    called), leases still held; without them it gathers the run, its first batch carrying the
    one _Pending of the shared lease, whose settle returns it."""
    import torch

    from gdsfs import _leases, _tensors

    ds, shared, other, truth = _shared_item(gdsfs_mount, "itemcopy-pin")
    mine = {r.lease for b in shared for r in b["x.npy"].leases}
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "current_device", lambda: 0)
        assert _tensors._materialize_segment(shared, None, True) is None
        assert _tensors._materialize_segment(shared, torch.device("cuda", 0), False) is None
        assert _tensors._materialize_segment(shared, torch.device("cpu"), True) is None  # CPU, pinned
    assert mine <= _held_here() and all(not b.materialized for b in shared)
    out = _tensors._materialize_segment(shared, None, False)
    assert out is not None and [b._pending is not None for b in out] == [True, False, False]
    assert [k for b in out for k in b["__key__"]] == [k for b in shared for k in b["__key__"]]
    _check(out, truth)
    assert not _tensors._settle_group(out)[0]
    assert not (mine & _held_here())
    _leases.release(other[0]._holds(), check_held=False)
    del out, shared, other
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
