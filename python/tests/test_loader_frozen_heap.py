"""Review of the loader's frozen heap (review4): whatever goes wrong while the workers start,
the parent's objects leave the permanent generation; persistent workers and later epochs
deliver every sample and leave nothing frozen."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from test_small_samples import _small_shards

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")


def _failing_init(_worker_id: int) -> None:
    raise RuntimeError("worker_init_fn fails")


def _dataset(mount, per: int):
    import gdsfs.torch as gt

    paths, _truth = _small_shards(mount, nshards=2, per=per)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    if gc.get_freeze_count():
        ds.close()
        pytest.skip("objects are frozen already (by another test)")
    return ds


def test_starting_workers_fails_unfreezes(gdsfs_mount, monkeypatch) -> None:
    import gdsfs.torch as gt

    ds = _dataset(gdsfs_mount, 8)
    seen: list[int] = []

    def broken(self):  # torch's iterator fails to start (a worker that cannot be forked)
        seen.append(gc.get_freeze_count())
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(torch.utils.data.DataLoader, "_get_iterator", broken)
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork")
    with pytest.raises(OSError):
        next(iter(dl))
    assert seen and seen[0] > 0, "frozen while the workers start"
    assert gc.get_freeze_count() == 0
    monkeypatch.undo()
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0


def test_failing_worker_init_unfreezes(gdsfs_mount) -> None:
    import gdsfs.torch as gt

    ds = _dataset(gdsfs_mount, 8)
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="fork", worker_init_fn=_failing_init)
    with pytest.raises(RuntimeError, match="worker_init_fn fails"):
        for _ in dl:
            pass
    assert gc.get_freeze_count() == 0
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0


def test_persistent_workers_two_epochs(gdsfs_mount) -> None:
    import gdsfs.torch as gt

    ds = _dataset(gdsfs_mount, 8)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork", persistent_workers=True)
    for epoch in range(2):
        keys = [k for b in dl for k in b["__key__"]]
        assert len(keys) == 16 and len(set(keys)) == 16, (epoch, keys)
        assert gc.get_freeze_count() == 0, epoch
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0


def test_unpicklable_under_spawn_says_so_and_freezes_nothing(gdsfs_mount) -> None:
    import gdsfs.torch as gt

    ds = _dataset(gdsfs_mount, 4)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context="spawn", worker_init_fn=lambda w: None)
    with pytest.raises(TypeError, match="worker_init_fn"):
        next(iter(dl))
    assert gc.get_freeze_count() == 0
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0
