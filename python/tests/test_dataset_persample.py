"""Issue 15, 16 KiB samples: what a DataLoader worker pays per sample (helper small16). The
cheaper paths must give the same batches, every sample once, the same resume point, and keep
the lease rules."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os

import pytest
import torch

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
    assert gc.get_freeze_count() == 0
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
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
    ds.close()
    del dl
    assert gdsfs_mount.wait_leases(0) == 0
