"""Issue 15: a batch whose samples each have their own lease (an in-process iteration, a stock
DataLoader's workers) is gathered on host slabs into one tensor with one row copy per sample
(_tensors._host_rows), not a tensor view per sample and a stack: the same bytes as the per-sample
views, in the batch's order whatever the samples' places in the slab, and the same errors."""

from __future__ import annotations

import itertools

import pytest
import torch

from test_small_samples import _small_shards


def _batch(gdsfs_mount, n: int = 16, order=None):
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=2, per=10)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=8)
    it = iter(ds)
    samples = list(itertools.islice(it, n))  # across the two shards: several READs
    it.close()
    if order is not None:
        samples = [samples[i] for i in order]
    return ds, truth, gt.collate(samples)


def _slab_offsets(col) -> list[int]:
    return [col.leases[i].offset + s for i, s in zip(col.idx, col.starts)]


@pytest.mark.parametrize("order", ["read", "shuffled"])
def test_a_lease_per_sample_gathers_each_samples_bytes_into_its_row(gdsfs_mount, order: str) -> None:
    from gdsfs import _core, _tensors

    perm = None if order == "read" else [5, 0, 15, 9, 2, 11, 7, 14, 1, 12, 3, 8, 13, 4, 10, 6]
    ds, truth, b = _batch(gdsfs_mount, order=perm)
    col = b["x.npy"]
    assert len(col.leases) == 16 and _tensors._run_of(col) is None
    offs = _slab_offsets(col)
    if perm is not None:
        assert offs != sorted(offs), "the shuffled batch's rows are not in slab order"
    rows = _tensors._host_rows(col)
    assert rows is not None and rows.shape == (16, 16 << 10) and rows.dtype == torch.uint8
    assert torch.equal(rows, torch.stack(_tensors._byte_views(col))), "the row copy differs from the per-sample views"
    slab = _tensors._slab_tensor(_core.session_for(col.leases[0]), col.leases[0].slab)
    out = b.materialize()
    x = out["x.npy"]
    assert not (slab.data_ptr() <= x.data_ptr() < slab.data_ptr() + slab.numel()), "the gather aliases the slab"
    assert x.dtype == torch.float32 and x.shape == (16, 4096)
    assert [x[i].numpy().tobytes() for i in range(16)] == [truth[k] for k in out["__key__"]]
    del b, out, x, rows, col, slab
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_row_copies_keep_each_samples_start_and_geometry(gdsfs_mount) -> None:
    """Starts that are not the lease's first byte (bytes [2, n) of each sample, uint8) are copied
    from the right place; samples of two geometries in one column become a list, each right."""
    import gdsfs.torch as gt
    from gdsfs import _tensors

    ds, truth, b = _batch(gdsfs_mount, n=8)
    refs = b["x.npy"].refs
    n = refs[0].nbytes
    shifted = _tensors._RefColumn([gt.TensorRef(t.ref, torch.uint8, (n - 2,), t.start + 2, False, t.field, t.sample, t.path, t._hold) for t in refs])
    rows = _tensors._gather(shifted, None, pin=False)
    assert isinstance(rows, torch.Tensor) and [rows[i].numpy().tobytes() for i in range(8)] == [truth[k][2:] for k in b["__key__"]]
    mixed = _tensors._RefColumn([gt.TensorRef(t.ref, torch.int16, (n // 2 - 2,), t.start + 4, False, t.field, t.sample, t.path, t._hold)
                                 if i % 2 else t for i, t in enumerate(refs)])
    got = _tensors._gather(mixed, None, pin=False)
    assert isinstance(got, list) and len(got) == 8
    for i, (k, x) in enumerate(zip(b["__key__"], got)):
        assert x.dtype == (torch.int16 if i % 2 else torch.float32)
        assert x.numpy().tobytes() == (truth[k][4:] if i % 2 else truth[k])
    b.release()
    del b, refs, shifted, mixed, rows, got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_row_copies_refuse_what_the_views_refuse(gdsfs_mount) -> None:
    """A sample whose lease was given back fails the batch (GDSLeaseError, no batch); a start
    past a lease's valid bytes is the same ValueError as the per-sample views raise."""
    import gdsfs
    import gdsfs.torch as gt
    from gdsfs import _tensors

    ds, _truth, b = _batch(gdsfs_mount)
    b["x.npy"].refs[9].release()
    with pytest.raises(gdsfs.GDSLeaseError, match="lease"):
        b.materialize()
    refs = b["x.npy"].refs
    n = refs[0].nbytes
    past = _tensors._RefColumn([gt.TensorRef(t.ref, torch.uint8, (n,), t.start + (8 if i == 3 else 0), False, t.field, t.sample, t.path, t._hold)
                                for i, t in enumerate(refs)])
    with pytest.raises(ValueError, match=r"bytes \[8, .*\) outside lease"):
        _tensors._host_rows(past)
    b.release()
    del b, refs, past
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_without_numpy_a_lease_per_sample_still_gathers(gdsfs_mount, monkeypatch) -> None:
    """A torch without numpy (Tensor.numpy raises) gathers with the per-sample views: the same bytes."""
    from gdsfs import _tensors

    ds, truth, b = _batch(gdsfs_mount)

    def no_numpy(self):
        raise RuntimeError("Numpy is not available")

    monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    assert _tensors._host_rows(b["x.npy"]) is None
    out = b.materialize()
    monkeypatch.undo()
    x = out["x.npy"]
    assert [x[i].numpy().tobytes() for i in range(16)] == [truth[k] for k in out["__key__"]]
    del b, out, x
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype,shape,fortran,shift", [
    (torch.float32, (64, 64), True, 0),    # fortran order, the whole sample
    (torch.int16, (), False, 6),           # 0-d
    (torch.float64, (3,), False, 1),       # a start not aligned for its dtype
    (torch.bool, (100,), False, 3),
    (torch.float16, (2, 4, 8), True, 2),   # fortran, 3-d, unaligned start
    (torch.bfloat16, (10,), False, 8),
    (torch.int64, (1, 5), False, 16),
])
def test_row_copies_equal_the_views_for_every_geometry(gdsfs_mount, monkeypatch, dtype, shape, fortran, shift) -> None:
    """Every dtype and shape the column path supports (fortran order, 0-d, unaligned starts) comes
    out of the row copies as out of the per-sample views and their stack, value for value, in a
    tensor of its own (not a view of a slab, which a later READ into it would change)."""
    import gdsfs.torch as gt
    from gdsfs import _core, _tensors

    ds, truth, b = _batch(gdsfs_mount, n=8)
    refs = b["x.npy"].refs
    col = _tensors._RefColumn([gt.TensorRef(t.ref, dtype, shape, t.start + shift, fortran, t.field, t.sample, t.path, t._hold) for t in refs])
    assert _tensors._host_rows(col) is not None
    rows = _tensors._gather(col, None, pin=False)
    with monkeypatch.context() as m:
        m.setattr(_tensors, "_host_rows", lambda c: None)
        views = _tensors._gather(col, None, pin=False)
    assert isinstance(rows, torch.Tensor) and rows.dtype == dtype and rows.shape == views.shape == (8,) + shape
    assert rows.stride() == views.stride(), "the row copy's layout differs from the views' (fortran order)"
    assert _bytes(rows) == _bytes(views)
    nbytes = rows.element_size() * rows[0].numel()
    for i, k in enumerate(b["__key__"]):
        want = truth[k][shift : shift + nbytes]
        got = rows[i].permute(*reversed(range(len(shape)))).contiguous() if fortran else rows[i].contiguous()
        assert _bytes(got) == want
    for r in col.leases:
        slab = _tensors._slab_tensor(_core.session_for(r), r.slab)
        lo, hi = slab.data_ptr(), slab.data_ptr() + slab.numel()
        p = rows.data_ptr()
        assert not (p < hi and lo < p + rows.numel() * rows.element_size()), "the gather aliases a slab: a later READ into it would change the batch"
    b.release()
    del b, refs, col, views, rows, slab
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
