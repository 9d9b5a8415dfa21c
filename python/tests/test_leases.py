"""Lease ownership (issue 11, section 1): once a sample is yielded its leases
belong to the consumer until it materializes them, releases them, or lets
every holder go; closing or collecting a generator, a dataset, a DataLoader
iterator or a Session never frees memory a live TensorRef names, and a
TensorRef whose memory is truly gone raises GDSLeaseError instead of
returning other bytes. Host engine over a real mount."""

from __future__ import annotations

import gc
import io
import itertools
import os
import pickle
import tarfile
from typing import Any

import numpy as np
import pytest
import torch

import gdsfs
import gdsfs.torch as gt
from gdsfs import _leases

NPY = ["npy"]


def _npy(arr: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def write_shard(path: str, prefix: str, n: int, seed: int, nbytes: int = 6000) -> dict[str, np.ndarray]:
    """A WebDataset tar of n samples, each an "npy" field of nbytes random
    uint8 (several pages, so every sample has its own lease) and a "cls"."""
    rng = np.random.default_rng(seed)
    truth: dict[str, np.ndarray] = {}
    with tarfile.open(path, "w") as tf:
        for i in range(n):
            key = f"{prefix}{i:04d}"
            a = rng.integers(0, 256, nbytes, dtype=np.uint8)
            for ext, data in (("cls", str(i % 10).encode()), ("npy", _npy(a))):
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            truth[key] = a
    return truth


class Shards:
    def __init__(self, mount: Any) -> None:
        self.mount = mount
        d = os.path.join(mount.src, "leases")
        os.makedirs(d, exist_ok=True)
        self.truth: dict[str, np.ndarray] = {}
        self.paths: list[str] = []
        for s in range(3):
            name = f"l-{s}.tar"
            self.truth.update(write_shard(os.path.join(d, name), f"l{s}/", 24, seed=100 + s))
            self.paths.append(os.path.join(mount.mnt, "leases", name))

    def check(self, key: str, got: Any) -> None:
        want = self.truth[key]
        g = got.numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        assert g.shape == want.shape and g.tobytes() == want.tobytes(), f"{key}: the bytes are not the file's"


@pytest.fixture(scope="module")
def shards(gdsfs_mount) -> Shards:
    return Shards(gdsfs_mount)


def _idle(shards: Shards) -> None:
    gc.collect()
    _leases.drain()
    assert shards.mount.wait_leases(0) == 0, shards.mount.stats()


def _take(ds: Any, how: str, n: int) -> list[Any]:
    if how == "islice":
        return list(itertools.islice(ds, n))
    if how == "break":
        out = []
        for s in ds:
            out.append(s)
            if len(out) == n:
                break
        return out
    assert how == "next"
    return [next(iter(ds))]


@pytest.mark.parametrize("how", ["islice", "break", "next"])
def test_last_yielded_sample_keeps_its_bytes(shards: Shards, how: str) -> None:
    """The issue's reproduction: the generator is closed at the yield of the
    last sample taken; another dataset then reads into the freed memory."""
    ds = gt.GDSShardDataset(shards.paths[0], gpu_keys=NPY)
    samples = _take(ds, how, 16)
    gc.collect()
    other_ds = gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY)
    other = iter(other_ds)
    [next(other) for _ in range(8)]
    batch = gt.collate(samples).materialize()
    for i, key in enumerate(batch["__key__"]):
        shards.check(key, batch["npy"][i])
    del other, other_ds, samples, batch, ds
    _idle(shards)


def test_dataset_dropped_before_materialize(shards: Shards) -> None:
    """The dataset (and its Session) is collected while its samples live:
    the session must outlive them (before: SLAB ... EPERM)."""
    samples = list(itertools.islice(gt.GDSShardDataset(shards.paths[2], gpu_keys=NPY), 5))
    gc.collect()
    for s in samples:
        shards.check(s["__key__"], s["npy"].materialize())
    del samples
    _idle(shards)
