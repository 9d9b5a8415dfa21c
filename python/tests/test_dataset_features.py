"""What WebDataset / torchdata users expect of gdsfs.torch.GDSShardDataset (issue 11, section
3): map hooks, keys=, decoders, shuffle buffer and shard interleaving with exact resume,
even_ranks and len(), against the session's host-mode mount."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
import pytest
import torch

import gdsfs.torch as gt
from _wds_helpers import fresh_dir, npy, write_tar

WDS_GPU = ["x.npy", "y.npy", "jpg"]


def _shard_of(key: str) -> str:
    return key.split("/")[0]


def _keys(loader: Any) -> list[str]:
    return [k for b in loader for k in b["__key__"]]


# -- map hooks -------------------------------------------------------------------


class _AddPid:
    """A per-sample map: records the process it ran in and derives a field."""

    def __call__(self, s: Any) -> Any:
        s["pid"] = os.getpid()
        s["cls2"] = s["cls"] * 2
        return None if s["cls"] == 0 else s  # None drops the sample


def _double(batch: Any) -> Any:
    batch.data["x2"] = batch["x.npy"] * 2
    return batch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_map_per_sample_in_workers_and_per_batch_after_materialize(datasets, num_workers: int) -> None:
    want = {k for k, v in datasets.wds.items() if v["cls"] != 0}
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], map=_AddPid()) as ds:
        seen = []
        for b in gt.DataLoader(ds, batch_size=4, num_workers=num_workers, batch_map=_double):
            assert b.materialized and torch.equal(b["x2"], b["x.npy"] * 2)
            assert torch.equal(b["cls2"], b["cls"] * 2)
            if num_workers:
                assert os.getpid() not in b["pid"].tolist()
            seen.extend(b["__key__"])
        assert sorted(seen) == sorted(want)
    # The leases of dropped samples went back (the map dropped them in the workers).
    assert datasets.mount.wait_leases(0) == 0
    with pytest.raises(TypeError, match="map="):
        gt.GDSShardDataset(datasets.wds_shards(), map=3)


def test_map_keeps_resume_exact(datasets) -> None:
    kw: dict[str, Any] = dict(gpu_keys=["x.npy"], shuffle=True, seed=3, map=_AddPid())
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as full_ds:
        full = _keys(gt.DataLoader(full_ds, batch_size=3))
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        dl = gt.DataLoader(ds, batch_size=3)
        first = []
        for i, b in enumerate(dl):
            first.extend(b["__key__"])
            if i == 3:
                break
        state = dl.state_dict()
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds2:
        dl2 = gt.DataLoader(ds2, batch_size=3)
        dl2.load_state_dict(state)
        assert first + _keys(dl2) == full


# -- keys= -------------------------------------------------------------------------


def test_keys_reads_only_the_named_fields(datasets) -> None:
    counters = lambda: datasets.mount.stats()["counters"]  # noqa: E731
    shards = datasets.wds_shards()
    with gt.GDSShardDataset(shards, gpu_keys=WDS_GPU) as ds:
        before = counters()
        for b in gt.DataLoader(ds, batch_size=13):
            pass
        every = {k: counters()[k] - before[k] for k in ("reads", "read_ranges", "read_bytes")}
    with gt.GDSShardDataset(shards, gpu_keys=["x.npy"], keys=["x.npy", "cls"]) as ds:
        before = counters()
        rows = 0
        for b in gt.DataLoader(ds, batch_size=13):
            assert sorted(b.keys()) == ["__key__", "__url__", "cls", "x.npy"]
            for i, k in enumerate(b["__key__"]):
                assert b["x.npy"][i].cpu().numpy().tobytes() == datasets.wds[k]["x.npy"].tobytes()
                assert int(b["cls"][i]) == datasets.wds[k]["cls"]
                rows += 1
        some = {k: counters()[k] - before[k] for k in ("reads", "read_ranges", "read_bytes")}
    assert rows == len(datasets.wds)
    # Every sample had three gpu ranges (x.npy, y.npy, jpg), now one; both read in the same READs
    # (and the same version checks after the CPU fields' preads: one empty range each).
    assert every["reads"] == some["reads"], (every, some)
    assert every["read_ranges"] - some["read_ranges"] == 2 * len(datasets.wds), (every, some)
    assert some["read_ranges"] - len(datasets.wds) < some["reads"], (every, some)
    assert some["read_bytes"] < every["read_bytes"]


# -- decoders ----------------------------------------------------------------------


def test_default_decoders(gdsfs_mount) -> None:
    src, mnt = fresh_dir(gdsfs_mount, "decoders")
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    pth = io.BytesIO()
    torch.save({"t": torch.tensor([1.5, 2.5])}, pth)
    fields = {"cls": b" 7\n", "txt": "héllo".encode(), "json": json.dumps({"a": [1, 2]}).encode(), "npy": npy(arr),
              "pth": pth.getvalue(), "bin": b"\x00\x01"}
    write_tar(os.path.join(src, "d.tar"), [("s0", fields)])
    with gt.GDSShardDataset(os.path.join(mnt, "d.tar")) as ds:
        (s,) = list(ds)
    assert s["cls"] == 7 and s["txt"] == "héllo" and s["json"] == {"a": [1, 2]} and s["bin"] == b"\x00\x01"
    assert torch.equal(s["npy"], torch.from_numpy(arr))
    assert torch.equal(s["pth"]["t"], torch.tensor([1.5, 2.5]))
    # A mapping names decoders per field; the others keep the defaults.
    with gt.GDSShardDataset(os.path.join(mnt, "d.tar"), decode={"txt": lambda b: b.decode().upper()}) as ds:
        (s,) = list(ds)
    assert s["txt"] == "HÉLLO" and s["cls"] == 7
    assert gt.default_decode("x.cls", b"3") == 3


def test_image_decoding_through_pil(gdsfs_mount) -> None:
    Image = pytest.importorskip("PIL.Image", reason="PIL is not installed here")
    src, mnt = fresh_dir(gdsfs_mount, "images")
    img = Image.fromarray(np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3))
    png = io.BytesIO()
    img.save(png, format="PNG")
    write_tar(os.path.join(src, "i.tar"), [("s0", {"png": png.getvalue()})])
    with gt.GDSShardDataset(os.path.join(mnt, "i.tar"), decode="pil") as ds:
        (s,) = list(ds)
    assert s["png"].size == (3, 2) and np.array_equal(np.asarray(s["png"]), np.asarray(img))
    with gt.GDSShardDataset(os.path.join(mnt, "i.tar"), decode="torchrgb8") as ds:
        (s,) = list(ds)
    assert s["png"].shape == (3, 2, 3) and s["png"].dtype == torch.uint8
    with gt.GDSShardDataset(os.path.join(mnt, "i.tar")) as ds:
        (s,) = list(ds)
    assert s["png"] == png.getvalue()  # images stay bytes unless asked


def test_unknown_decode_name_is_refused(datasets) -> None:
    with pytest.raises(ValueError, match="decode='jpeg'.*pil"):
        gt.GDSShardDataset(datasets.wds_shards(), decode="jpeg")


# -- cross-shard shuffling -----------------------------------------------------------


def _mixing(batches: list[list[str]]) -> float:
    return sum(len({_shard_of(k) for k in b}) > 1 for b in batches) / len(batches)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_buffer_and_interleave_mix_shards_every_sample_once(datasets, num_workers: int) -> None:
    kw: dict[str, Any] = dict(gpu_keys=["x.npy"], shuffle=True, seed=4)
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        plain = [b["__key__"] for b in gt.DataLoader(ds, batch_size=4, num_workers=num_workers)]
    with gt.GDSShardDataset(datasets.wds_shards(), shuffle_buffer=8, interleave=2, **kw) as ds:
        mixed = [b["__key__"] for b in gt.DataLoader(ds, batch_size=4, num_workers=num_workers)]
        again = [b["__key__"] for b in gt.DataLoader(ds, batch_size=4, num_workers=num_workers)]
    flat = [k for b in mixed for k in b]
    assert sorted(flat) == sorted(datasets.wds) and len(flat) == len(set(flat))
    assert mixed == again  # seeded
    assert _mixing(mixed) >= 0.75 and _mixing(mixed) > _mixing(plain), (_mixing(plain), _mixing(mixed))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_buffer_resume_is_exact(datasets, num_workers: int) -> None:
    kw: dict[str, Any] = dict(gpu_keys=["x.npy"], shuffle=True, seed=6, shuffle_buffer=10, interleave=3)
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        ds.set_epoch(2)
        full = _keys(gt.DataLoader(ds, batch_size=3, num_workers=num_workers))
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        ds.set_epoch(2)
        dl = gt.DataLoader(ds, batch_size=3, num_workers=num_workers)
        first: list[str] = []
        for i, b in enumerate(dl):
            first.extend(b["__key__"])
            if i == 4:
                break
        state = dl.state_dict()
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        dl = gt.DataLoader(ds, batch_size=3, num_workers=num_workers)
        dl.load_state_dict(state)
        rest = _keys(dl)
    assert sorted(first + rest) == sorted(full) and len(set(first + rest)) == len(full)  # every sample exactly once
    if num_workers == 0:
        assert first + rest == full
    assert datasets.mount.wait_leases(0) == 0


def test_features_with_spawned_workers(datasets) -> None:
    kw: dict[str, Any] = dict(gpu_keys=["x.npy"], keys=["x.npy", "cls"], map=_AddPid(), shuffle=True, seed=2, shuffle_buffer=6, interleave=2)
    want = sorted(k for k, v in datasets.wds.items() if v["cls"] != 0)
    with gt.GDSShardDataset(datasets.wds_shards(), **kw) as ds:
        dl = gt.DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
        got = []
        for b in dl:
            assert sorted(b.keys()) == ["__key__", "__url__", "cls", "cls2", "pid", "x.npy"]
            for i, k in enumerate(b["__key__"]):
                assert b["x.npy"][i].cpu().numpy().tobytes() == datasets.wds[k]["x.npy"].tobytes()
            got.extend(b["__key__"])
    assert sorted(got) == want
    assert datasets.mount.wait_leases(0) == 0


def test_shuffle_arguments_are_checked(datasets) -> None:
    with pytest.raises(ValueError, match="shuffle_buffer"):
        gt.GDSShardDataset(datasets.wds_shards(), shuffle_buffer=-1)
    with pytest.raises(ValueError, match="interleave"):
        gt.GDSShardDataset(datasets.wds_shards(), interleave=0)


# -- DDP: equal length per rank, len() -----------------------------------------------


@pytest.mark.parametrize("even", ["drop", "pad"])
def test_even_ranks_give_every_rank_the_same_batches(datasets, monkeypatch, even: str) -> None:
    total = len(datasets.wds)  # 52: 17.33 per rank of 3
    per_rank, batches = [], []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], shuffle=True, seed=3, even_ranks=even) as ds:
            dl = gt.DataLoader(ds, batch_size=4, num_workers=2)
            got = [b["__key__"] for b in dl]
            assert len(got) == len(dl)
            assert sum(map(len, got)) == len(ds)
            per_rank.append([k for b in got for k in b])
            batches.append(len(got))
    assert len(set(batches)) == 1, batches
    n = total // 3 if even == "drop" else -(-total // 3)
    assert [len(k) for k in per_rank] == [n, n, n]
    everything = [k for keys in per_rank for k in keys]
    if even == "drop":
        assert len(set(everything)) == len(everything) == 3 * n
    else:
        assert set(everything) == set(datasets.wds)
    with pytest.raises(ValueError, match="even_ranks"):
        gt.GDSShardDataset(datasets.wds_shards(), even_ranks="equal")


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers,batch_size,drop_last", [(0, 5, False), (2, 5, False), (3, 4, True), (2, None, False)])
def test_len_of_the_loader_matches_what_it_yields(datasets, num_workers: int, batch_size: Any, drop_last: bool) -> None:
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"]) as ds:
        dl = gt.DataLoader(ds, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
        assert len(dl) == sum(1 for _ in dl)
