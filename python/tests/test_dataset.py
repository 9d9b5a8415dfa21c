"""gdsfs.torch against a live host-mode mount: GDSShardDataset over
WebDataset tars, MDS shards and .npy files with num_workers 0/2/4, exact
once-per-epoch coverage with byte-identical tensors, resume, a killed worker,
zero-copy views, and the plain-read fallback."""

from __future__ import annotations

import gc
import os
import pickle
import signal
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import gdsfs
import gdsfs.torch as gt
from gdsfs import _errors

WDS_GPU = ["x.npy", "y.npy", "jpg"]
MDS_GPU = ["x", "label", "v"]


def _as_np(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.cpu().numpy()
    return v


def _same(got: Any, want: Any, what: str) -> None:
    if isinstance(want, np.ndarray):
        g = _as_np(got)
        assert isinstance(g, np.ndarray), f"{what}: got {type(got)}"
        assert g.dtype == want.dtype and g.shape == want.shape, f"{what}: {g.dtype}{g.shape} != {want.dtype}{want.shape}"
        assert g.tobytes() == want.tobytes(), f"{what}: bytes differ"
    elif isinstance(want, bytes) and isinstance(got, torch.Tensor):
        assert got.dtype == torch.uint8 and got.cpu().numpy().tobytes() == want, f"{what}: bytes differ"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def _rows(batch: gt.GDSBatch) -> list[dict[str, Any]]:
    """Split a materialized batch back into samples."""
    assert batch.materialized
    keys = batch["__key__"]
    out = []
    for i, k in enumerate(keys):
        row = {}
        for f, v in batch.items():
            row[f] = v[i] if isinstance(v, (list, torch.Tensor)) else v
        row["__key__"] = k
        out.append(row)
    return out


def _check_epoch(loader: Any, truth: dict[str, dict[str, Any]], materialize: bool = True) -> list[str]:
    seen: list[str] = []
    for batch in loader:
        assert isinstance(batch, gt.GDSBatch)
        if materialize:
            batch = batch.materialize()
        for row in _rows(batch):
            key = row["__key__"]
            assert key in truth, key
            for f, want in truth[key].items():
                _same(row[f], want, f"{key}.{f}")
            seen.append(key)
    assert len(seen) == len(set(seen)), "a sample was delivered twice"
    assert set(seen) == set(truth), f"missing {sorted(set(truth) - set(seen))[:5]}"
    return seen


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_wds_every_sample_once_byte_identical(datasets, num_workers: int) -> None:
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, shuffle=True, seed=5)
    assert ds.gds and ds.session is not None and ds.session.host_mode
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=num_workers, collate_fn=gt.collate)
    _check_epoch(dl, datasets.wds)
    assert datasets.mount.wait_leases(0) == 0
    ds.close()


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_mds_every_sample_once_byte_identical(datasets, num_workers: int) -> None:
    ds = gt.GDSShardDataset(datasets.dir("mds"), gpu_keys=MDS_GPU, shuffle=True, seed=9)
    assert ds.gds and len(ds) == len(datasets.mds)
    dl = torch.utils.data.DataLoader(ds, batch_size=5, num_workers=num_workers, collate_fn=gt.collate)
    _check_epoch(dl, datasets.mds)
    assert datasets.mount.wait_leases(0) == 0
    ds.close()


def test_spawned_workers_use_the_pickled_token(datasets) -> None:
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, shuffle=True, seed=1)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=gt.collate, multiprocessing_context="spawn")
    _check_epoch(dl, datasets.wds)
    assert datasets.mount.wait_leases(0) == 0
    ds.close()


def test_npy_files(datasets) -> None:
    shards = sorted(os.path.join(datasets.dir("npy"), f) for f in os.listdir(datasets.dir("npy", False)))
    with gt.GDSShardDataset(shards, gpu_keys=["npy"]) as ds:
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=gt.collate)
        _check_epoch(dl, datasets.npy)
    assert datasets.mount.wait_leases(0) == 0


def test_ranks_split_the_epoch(datasets, monkeypatch) -> None:
    per_rank = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], shuffle=True, seed=3) as ds:
            keys = [k for b in gt.DataLoader(ds, batch_size=5, num_workers=2) for k in b["__key__"]]
            assert len(keys) == len(ds)
            per_rank.append(keys)
    everything = [k for keys in per_rank for k in keys]
    assert sorted(everything) == sorted(datasets.wds)
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 1


def test_one_daemon_request_per_shard_chunk(datasets) -> None:
    before = datasets.mount.stats()["counters"]["reads"]
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, read_ahead=64) as ds:
        for b in torch.utils.data.DataLoader(ds, batch_size=13, collate_fn=gt.collate):
            b.materialize()
        reads = datasets.mount.stats()["counters"]["reads"] - before
    # 4 shards of 13 samples, one chunk of 52 samples: one READ per shard, and one READ of
    # nothing per shard that checks its version after the CPU fields' preads.
    assert reads == 2 * 4, reads


def test_read_ahead_bytes_bounds_requests(datasets) -> None:
    before = datasets.mount.stats()["counters"]["reads"]
    # Each sample's gpu fields are well over 1 byte: one sample per request (and one version
    # check after its CPU fields' preads).
    with gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"], read_ahead_bytes=1) as ds:
        samples = list(ds)
        assert len(samples) == 13
        assert datasets.mount.stats()["counters"]["reads"] - before == 2 * 13
        assert datasets.mount.stats()["leases"] == 13  # the samples' leases are the consumer's
        for smp in samples:
            smp["x.npy"].materialize()
        assert datasets.mount.stats()["leases"] == 0


def test_stopping_early_returns_unread_leases(datasets) -> None:
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, read_ahead=64) as ds:
        it = iter(ds)
        first = next(it)
        first["x.npy"].materialize()
        first["y.npy"].materialize()
        first["jpg"].materialize()
        it.close()  # the other 51 samples of the chunk were read, never handed out
        assert datasets.mount.wait_leases(0) == 0


def test_pin_memory_hook_is_called_on_batch(datasets) -> None:
    from torch.utils.data._utils.pin_memory import pin_memory

    with gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=WDS_GPU) as ds:
        batch = gt.collate(list(ds)[:3])
        assert not batch.materialized
        pinned = pin_memory(batch)  # what the DataLoader's pin thread does
        assert isinstance(pinned, gt.GDSBatch) and pinned.materialized
        assert batch.engines == pinned.engines == {"host"}
        for row in _rows(pinned):
            _same(row["x.npy"], datasets.wds[row["__key__"]]["x.npy"], "x.npy")
    assert datasets.mount.wait_leases(0) == 0


def test_shard_patterns(datasets) -> None:
    wds = datasets.dir("wds")
    with gt.GDSShardDataset(os.path.join(wds, "train-*.tar")) as a, gt.GDSShardDataset(os.path.join(wds, "train-{000..003}.tar")) as b:
        assert a.shards == b.shards == datasets.wds_shards()
    with pytest.raises(FileNotFoundError, match="no shard matches"):
        gt.GDSShardDataset(os.path.join(wds, "nothing-*.tar"))


def test_shuffle_is_seeded_and_set_epoch_reshuffles(datasets) -> None:
    def keys(seed: int, epoch: int) -> list[str]:
        ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=[], shuffle=True, seed=seed)
        ds.set_epoch(epoch)
        out = [s["__key__"] for s in ds]
        ds.close()
        return out

    assert keys(1, 0) == keys(1, 0)
    assert keys(1, 0) != keys(1, 1)
    assert keys(1, 0) != keys(2, 0)
    assert sorted(keys(1, 1)) == sorted(datasets.wds)


def test_set_epoch_reaches_persistent_workers(datasets) -> None:
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], shuffle=True, seed=8)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    epochs = []
    for e in range(2):
        ds.set_epoch(e)
        epochs.append([k for b in dl for k in b["__key__"]])
    del dl
    ds.close()
    fresh = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"], shuffle=True, seed=8)
    fresh.set_epoch(1)
    want = [k for b in gt.DataLoader(fresh, batch_size=4, num_workers=2) for k in b["__key__"]]
    fresh.close()
    assert epochs[0] != epochs[1]
    assert epochs[1] == want
    assert pickle.loads(pickle.dumps(ds)).epoch == 1


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_continues_exactly(datasets, num_workers: int) -> None:
    kw: dict[str, Any] = dict(gpu_keys=WDS_GPU, shuffle=True, seed=11)
    full_ds = gt.GDSShardDataset(datasets.wds_shards(), **kw)
    full_ds.set_epoch(3)
    full = [k for b in gt.DataLoader(full_ds, batch_size=3, num_workers=num_workers) for k in b["__key__"]]
    full_ds.close()

    ds = gt.GDSShardDataset(datasets.wds_shards(), **kw)
    ds.set_epoch(3)
    dl = gt.DataLoader(ds, batch_size=3, num_workers=num_workers)
    first: list[str] = []
    for i, b in enumerate(dl):
        first.extend(b["__key__"])
        if i == 4:
            break
    state = dl.state_dict()
    ds.close()
    assert state["epoch"] == 3 and sum(state["consumed"].values()) == len(first)

    ds2 = gt.GDSShardDataset(datasets.wds_shards(), **kw)
    dl2 = gt.DataLoader(ds2, batch_size=3, num_workers=num_workers)
    dl2.load_state_dict(state)
    rest = []
    for b in dl2:
        for row in _rows(b):
            _same(row["x.npy"], datasets.wds[row["__key__"]]["x.npy"], "x.npy")
            rest.append(row["__key__"])
    # The resume point applies once: the next pass of the epoch is whole.
    again = [k for b in dl2 for k in b["__key__"]]
    ds2.close()
    assert not set(first) & set(rest)
    assert sorted(first + rest) == sorted(full)
    if num_workers == 0:
        assert first + rest == full
    assert again == full
    assert datasets.mount.wait_leases(0) == 0


def test_stateful_dataloader_resume(datasets) -> None:
    pytest.importorskip("torchdata.stateful_dataloader", reason="torchdata (StatefulDataLoader) is not installed here")
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, shuffle=True, seed=2)
    dl = gt.StatefulDataLoader(ds, batch_size=4, num_workers=2)
    first = []
    for i, b in enumerate(dl):
        first.extend(b.materialize()["__key__"])
        if i == 3:
            break
    state = dl.state_dict()
    ds2 = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, shuffle=True, seed=2)
    dl2 = gt.StatefulDataLoader(ds2, batch_size=4, num_workers=2)
    dl2.load_state_dict(state)
    rest = [k for b in dl2 for k in b.materialize()["__key__"]]
    assert sorted(first + rest) == sorted(datasets.wds)


def test_stateful_dataloader_without_torchdata_says_what_to_do() -> None:
    import importlib.util

    if importlib.util.find_spec("torchdata") is not None:
        pytest.skip("torchdata is installed")
    with pytest.raises(ImportError, match="needs torchdata"):
        gt.StatefulDataLoader(None)
    with pytest.raises(ImportError, match="needs torchdata"):
        gt.stateful_dataloader(None)
    assert gt.StatefulDataLoader is gt.stateful_dataloader


def test_resume_with_other_worker_count_is_refused(datasets) -> None:
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=[])
    dl = gt.DataLoader(ds, batch_size=2, num_workers=2)
    for i, _ in enumerate(dl):
        if i == 1:
            break
    state = dl.state_dict()
    ds2 = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=[])
    ds2.load_state_dict(state)
    with pytest.raises(ValueError, match="same world size and num_workers"):
        next(iter(ds2))
    ds.close()
    ds2.close()


class _KillWorker:
    """A decoder that SIGKILLs DataLoader worker 1 at its 6th sample."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, field: str, data: bytes) -> Any:
        wi = torch.utils.data.get_worker_info()
        if wi is not None and wi.id == 1 and field == "cls":
            self.n += 1
            if self.n == 6:
                os.kill(os.getpid(), signal.SIGKILL)
        return int(data) if field == "cls" else data


@pytest.mark.parametrize("loader", ["stock", "gdsfs"])
def test_killed_worker_fails_loader_and_leaks_nothing(datasets, loader: str) -> None:
    mount = datasets.mount
    ds = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=WDS_GPU, decode=_KillWorker(), read_ahead=16)
    if loader == "stock":
        dl = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=gt.collate)
    else:
        dl = gt.DataLoader(ds, batch_size=2, num_workers=2)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) [0-9, ]+\) exited unexpectedly|killed by signal"):
        for b in dl:
            if isinstance(b, gt.GDSBatch) and not b.materialized:
                b.materialize()
    del dl
    gc.collect()
    if loader == "stock":
        # The dead worker's leases (samples it read but never delivered)
        # belong to the dataset's session until the dataset lets go of it.
        assert mount.stats()["leases"] > 0
        ds.close()
    assert mount.wait_leases(0) == 0, mount.stats()
    if loader == "gdsfs":
        # The dataset carries on with a fresh session.
        ds.decode = None
        keys = [k for b in gt.DataLoader(ds, batch_size=4, num_workers=2) for k in b["__key__"]]
        assert sorted(keys) == sorted(datasets.wds)
        ds.close()
        assert mount.wait_leases(0) == 0


def test_zero_copy_view_holds_lease_until_freed(datasets) -> None:
    mount = datasets.mount
    with gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"]) as ds:
        it = iter(ds)
        sample = next(it)
        rest = list(it)
        for s in rest:
            s["x.npy"].materialize()
        tref = sample["x.npy"]
        assert isinstance(tref, gt.TensorRef)
        view = tref.materialize(copy=False)
        _same(view, datasets.wds[sample["__key__"]]["x.npy"], "x.npy view")
        assert mount.stats()["leases"] == 1
        part = view[1:]  # a view of the view keeps the lease
        del view
        gc.collect()
        assert mount.stats()["leases"] == 1
        del part
        gc.collect()
        assert mount.wait_leases(0) == 0


def test_fallback_warns_once_and_matches(datasets) -> None:
    _errors._reset_fallback_warning()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = gt.GDSShardDataset(datasets.wds_shards(on_mount=False), gpu_keys=WDS_GPU, shuffle=True, seed=5)
        ds2 = gt.GDSShardDataset(datasets.dir("mds", on_mount=False), gpu_keys=MDS_GPU)
    got = [x for x in w if issubclass(x.category, gdsfs.GDSFallbackWarning)]
    assert len(got) == 1 and "not on a gdsfs mount" in str(got[0].message)
    assert not ds.gds and not ds2.gds
    _check_epoch(torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=gt.collate), datasets.wds)
    _check_epoch(torch.utils.data.DataLoader(ds2, batch_size=4, num_workers=0, collate_fn=gt.collate), datasets.mds)
    with pytest.raises(gdsfs.GDSUnavailableError, match="not on a gdsfs mount"):
        gt.GDSShardDataset(datasets.wds_shards(on_mount=False), gpu_keys=WDS_GPU, strict=True)


def test_daemon_refusal_falls_back_or_raises_when_strict(datasets) -> None:
    from gdsfs import _protocol as proto

    for strict in (False, True):
        ds = gt.GDSShardDataset(datasets.wds_shards()[:2], gpu_keys=WDS_GPU, strict=strict)
        good = ds.session.token
        ds.session.token = proto.Token(good.session, good.secret ^ 1)  # the daemon answers EPERM
        _errors._reset_fallback_warning()
        if strict:
            with pytest.raises(gdsfs.GDSUnavailableError, match="EPERM"):
                next(iter(ds))
        else:
            with pytest.warns(gdsfs.GDSFallbackWarning, match="cannot serve"):
                samples = list(ds)
            assert len(samples) == 26
            for smp in samples:
                assert isinstance(smp["x.npy"], torch.Tensor)
                _same(smp["x.npy"], datasets.wds[smp["__key__"]]["x.npy"], "x.npy")
        ds.session.token = good
        ds.close()
    assert datasets.mount.wait_leases(0) == 0


def test_gds_and_fallback_yield_the_same_order(datasets) -> None:
    a = gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=[], shuffle=True, seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gdsfs.GDSFallbackWarning)
        b = gt.GDSShardDataset(datasets.wds_shards(on_mount=False), gpu_keys=[], shuffle=True, seed=4)
    assert [s["__key__"] for s in a] == [s["__key__"] for s in b]
    a.close()


@pytest.mark.parametrize("descr,want", [("<f4", torch.float32), ("|u1", torch.uint8), ("<i8", torch.int64), ("float16", torch.float16), ("|b1", torch.bool)])
def test_dtype_names(descr: str, want: torch.dtype) -> None:
    from gdsfs._tensors import _torch_dtype

    assert _torch_dtype(descr) == want


def test_unrepresentable_dtypes_are_refused() -> None:
    from gdsfs._tensors import _torch_dtype

    with pytest.raises(ValueError, match="big-endian"):
        _torch_dtype(">f4")
    if not hasattr(torch, "uint16"):
        with pytest.raises(ValueError, match="torch >= 2.3"):
            _torch_dtype("<u2")


def test_device_cpu_means_host_memory(datasets) -> None:
    with gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"], device="cpu") as ds:
        assert ds.session is not None and ds.session.host_mode
        s = next(iter(ds))
        _same(s["x.npy"].materialize(), datasets.wds[s["__key__"]]["x.npy"], "x.npy")


def test_bad_arguments_say_what_to_do(datasets, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gt.GDSShardDataset(str(tmp_path / "nope-{000..001}.tar"))
    with pytest.raises(ValueError, match="format"):
        gt.GDSShardDataset(datasets.wds_shards(), format="parquet")
    with gt.GDSShardDataset(datasets.dir("mds"), gpu_keys=["raw"]) as ds:
        batch = gt.collate(list(ds)[:2]).materialize()
        assert isinstance(batch["raw"], list)  # variable-size fields stay a list
