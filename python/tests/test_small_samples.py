"""Issue 15: small samples. What a worker's batch costs to hand over, and that the faster paths
give the same bytes, every sample once, and keep the lease rules of issue 11."""

from __future__ import annotations

import io
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
