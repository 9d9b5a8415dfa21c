"""Issue 15: small samples. What a worker's batch costs to hand over, and that the faster paths
give the same bytes, every sample once, and keep the lease rules of issue 11."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
from torch.multiprocessing.reductions import ForkingPickler

from gdsfs import _layout
from gdsfs._tensors import INLINE_TENSOR_BYTES, GDSBatch


def _fork_pickle(obj: object) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


@pytest.mark.parametrize("value", [
    torch.arange(16),
    torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    torch.empty((0, 3), dtype=torch.float32),
    torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
    [torch.ones(3), torch.zeros(2, dtype=torch.uint8)],
])
def test_small_cpu_tensors_of_a_batch_pickle_as_bytes(value) -> None:
    b = GDSBatch({"cls": value, "__key__": ["a", "b"]}, progress={0: 2}, epoch=3, slots=1)
    data = _fork_pickle(b)
    # torch's own reduction would send a shared-memory descriptor (rebuild_storage_fd).
    assert b"rebuild_storage" not in data
    got = pickle.loads(data)
    assert type(got) is GDSBatch and got.progress == {0: 2} and got.epoch == 3 and got["__key__"] == ["a", "b"]
    want = value if isinstance(value, list) else [value]
    have = got["cls"] if isinstance(value, list) else [got["cls"]]
    for w, h in zip(want, have):
        assert h.dtype == w.dtype and h.shape == w.shape and torch.equal(h, w)


def test_large_cpu_tensors_keep_torch_shared_memory() -> None:
    big = torch.zeros(INLINE_TENSOR_BYTES // 4 + 1, dtype=torch.float32)
    assert b"rebuild_storage" in _fork_pickle(GDSBatch({"x": big}))


def test_npy_header_cache_returns_the_parse() -> None:
    import numpy as np

    for arr in (np.zeros((3, 5), dtype="<f4"), np.asfortranarray(np.zeros((2, 7), dtype="<i8")), np.zeros(0, dtype="u1")):
        b = io.BytesIO()
        np.save(b, arr)
        raw = b.getvalue()
        assert _layout.npy_header_cached(raw) == _layout.parse_npy_header(raw)
        assert _layout.npy_header_cached(raw[:200]) == _layout.parse_npy_header(raw)
    with pytest.raises(ValueError):
        _layout.npy_header_cached(b"\x93NUMPY\x01\x00\xff\x00{")


# ----------------------------------------------------------------------------
# A real mount: batches of small samples from DataLoader workers.


def _small_shards(mount, nshards: int = 3, per: int = 40, nbytes: int = 16 << 10) -> tuple[list[str], dict[str, bytes]]:
    import numpy as np

    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(mount, "small")
    truth: dict[str, bytes] = {}
    paths = []
    rng = np.random.default_rng(15)
    for s in range(nshards):
        samples = []
        for i in range(per):
            a = rng.standard_normal(nbytes // 4).astype(np.float32)
            key = f"s{s}_{i:04d}"
            truth[key] = a.tobytes()
            samples.append((key, {"cls": str(i % 7).encode(), "x.npy": npy(a)}))
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
    return paths, truth


@pytest.mark.parametrize("workers", [0, 2])
def test_small_samples_through_a_dataloader_arrive_once_with_their_bytes(gdsfs_mount, workers: int) -> None:
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=workers)
    seen: dict[str, bytes] = {}
    for b in dl:
        x, cls = b["x.npy"], b["cls"]
        assert isinstance(cls, torch.Tensor) and cls.dtype == torch.int64 and x.dtype == torch.float32
        for i, key in enumerate(b["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = x[i].numpy().tobytes()
            assert int(cls[i]) == int(key.rsplit("_", 1)[1]) % 7
    assert seen == truth
    del dl, b, x
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_batch_column_pickles_compactly_and_holds_its_leases(gdsfs_mount) -> None:
    import gc

    import gdsfs.torch as gt
    from gdsfs import _leases

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    batch = gt.collate(list(ds))
    data = _fork_pickle(batch)
    # One row of numbers per sample (key and shard path memoized), not a dataclass per field.
    assert len(data) < 16 * 150, len(data)
    copy = pickle.loads(data)
    refs, crefs = batch["x.npy"].refs, copy["x.npy"].refs
    # The unpickled copy holds the same leases through this process's Holds.
    assert [t._hold for t in crefs] == [t._hold for t in refs] and all(t._hold is not None for t in crefs)
    del batch, refs
    gc.collect()
    _leases.drain()
    out = copy.materialize()
    assert [out["x.npy"][i].numpy().tobytes() for i in range(16)] == [truth[k] for k in out["__key__"]]
    with pytest.raises(gdsfs_lease_error()):
        copy.materialize()  # spent: never bytes twice
    ds.close()
    del copy, crefs
    gc.collect()
    _leases.drain()
    assert gdsfs_mount.wait_leases(0) == 0


def gdsfs_lease_error() -> type:
    import gdsfs

    return gdsfs.GDSLeaseError
