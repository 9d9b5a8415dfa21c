"""Errors of gdsfs.torch.GDSShardDataset and friends name what is wrong: the shard path, the
sample key where there is one, and what to do (issue 11, section 2). Each test is what a new
user ran, against the session's host-mode mount."""

from __future__ import annotations

import os
import pydoc
import subprocess
import sys
import traceback
import warnings

import numpy as np
import pytest
import torch

import gdsfs
import gdsfs.checkpoint as gck
import gdsfs.safetensors as gst
import gdsfs.torch as gt
from gdsfs import _errors
from _wds_helpers import fresh_dir, npy, write_tar

HERE = os.path.dirname(os.path.abspath(__file__))


def _good(d: str, name: str = "good.tar", n: int = 4) -> str:
    p = os.path.join(d, name)
    write_tar(p, [(f"g{i}", {"cls": str(i).encode(), "x.npy": npy(np.full((2, 2), i, np.float32))}) for i in range(n)])
    return p


def _corrupt_pair(mount, name: str) -> tuple[str, str, str]:
    """(mount dir, good shard name, bad shard name): the bad one is a good tar cut short."""
    src, mnt = fresh_dir(mount, name)
    _good(src)
    data = open(os.path.join(src, "good.tar"), "rb").read()
    with open(os.path.join(src, "bad.tar"), "wb") as f:
        f.write(data[:1200])  # ends inside the second member's header
    return mnt, os.path.join(mnt, "good.tar"), os.path.join(mnt, "bad.tar")


# -- corrupt shards ------------------------------------------------------------


def test_corrupt_tar_names_the_shard_and_the_daemons_reason(gdsfs_mount) -> None:
    _, good, bad = _corrupt_pair(gdsfs_mount, "corrupt")
    with pytest.raises(gt.GDSShardError) as ei:
        gt.GDSShardDataset([good, bad], gpu_keys=["x.npy"])
    msg = str(ei.value)
    assert "\n" not in msg and "gdsfs: gdsfs:" not in msg, msg
    assert repr(bad) in msg and "not a valid tar" in msg and "truncated" in msg, msg
    assert "warn_and_skip" in msg, msg  # what to do
    assert ei.value.path == bad


def test_corrupt_tar_off_mount_names_the_shard(gdsfs_mount) -> None:
    mnt, _, _ = _corrupt_pair(gdsfs_mount, "corrupt-off")
    src = os.path.join(gdsfs_mount.src, os.path.basename(mnt))
    garbage = os.path.join(src, "garbage.tar")
    with open(garbage, "wb") as f:
        f.write(os.urandom(2048))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gdsfs.GDSFallbackWarning)
        for bad in (os.path.join(src, "bad.tar"), garbage):
            with pytest.raises(gt.GDSShardError, match=r"shard '.*%s' .*not a valid tar" % os.path.basename(bad)):
                gt.GDSShardDataset([os.path.join(src, "good.tar"), bad])


def test_warn_and_skip_skips_a_corrupt_shard(gdsfs_mount) -> None:
    _, good, bad = _corrupt_pair(gdsfs_mount, "skip")
    with pytest.warns(gt.GDSShardWarning, match=r"skipping shard '.*bad.tar'.*not a valid tar"):
        ds = gt.GDSShardDataset([good, bad], gpu_keys=["x.npy"], handler="warn_and_skip")
    with ds:
        assert len(ds) == 4
        keys = [b["__key__"] for b in gt.DataLoader(ds, batch_size=None)]
        assert keys == ["g0", "g1", "g2", "g3"]
    with pytest.raises(ValueError, match="handler"):
        gt.GDSShardDataset([good], handler="ignore")


def test_a_sample_that_fails_to_decode_names_field_sample_and_shard(gdsfs_mount) -> None:
    src, mnt = fresh_dir(gdsfs_mount, "baddecode")
    write_tar(os.path.join(src, "a.tar"), [("k0", {"cls": b"1"}), ("k1", {"cls": b"one"}), ("k2", {"cls": b"2"})])
    with gt.GDSShardDataset(os.path.join(mnt, "a.tar")) as ds:
        with pytest.raises(gt.GDSShardError, match=r"field 'cls' of sample 'k1' in shard '.*a.tar'.*decode="):
            list(ds)
    with gt.GDSShardDataset(os.path.join(mnt, "a.tar"), handler="warn_and_skip") as ds:
        with pytest.warns(gt.GDSShardWarning, match="'k1'"):
            assert [s["cls"] for s in ds] == [1, 2]
    assert gdsfs_mount.wait_leases(0) == 0


# -- heterogeneous samples -----------------------------------------------------


def test_collate_of_a_sample_missing_a_field_names_sample_and_shard(gdsfs_mount) -> None:
    src, mnt = fresh_dir(gdsfs_mount, "hetero")
    x = npy(np.zeros(3, np.float32))
    write_tar(os.path.join(src, "h.tar"), [("a", {"cls": b"1", "x.npy": x}), ("b", {"x.npy": x}), ("c", {"cls": b"3", "x.npy": x, "txt": b"hi"})])
    with gt.GDSShardDataset(os.path.join(mnt, "h.tar"), gpu_keys=["x.npy"]) as ds:
        samples = list(ds)
        with pytest.raises(ValueError, match=r"sample 'b' of shard '.*h.tar' has no field 'cls'.*missing=") as ei:
            gt.collate(samples[:2])
        assert "\n" not in str(ei.value)
        # An extra field in a later sample is not dropped silently either.
        with pytest.raises(ValueError, match=r"sample 'c' of shard '.*h.tar' has field 'txt'"):
            gt.collate([samples[0], samples[2]])
        # The documented alternative: keep the fields every sample of the batch has.
        b = gt.collate(samples, missing="drop").materialize()
        assert sorted(b.keys()) == ["__key__", "__url__", "x.npy"]
        assert b["x.npy"].shape == (3, 3)
    with pytest.raises(ValueError, match=r"sample 1 of the batch has no field 'b', which sample 0 of the batch has"):
        gt.collate([{"a": 1, "b": 2}, {"a": 3}])
    # A dropped gpu field's lease goes back at once.
    with gt.GDSShardDataset(os.path.join(mnt, "h.tar"), gpu_keys=["x.npy"], map=lambda s: s if s["__key__"] != "a" else {**s, "x.npy": None}) as ds:
        samples = list(ds)
        assert gdsfs_mount.stats()["leases"] == 2
        for s in samples[1:]:
            s["x.npy"].materialize()
        assert gdsfs_mount.wait_leases(0) == 0


# -- shard arguments -----------------------------------------------------------


def test_a_directory_of_tars_expands_to_its_sorted_tars(gdsfs_mount) -> None:
    src, mnt = fresh_dir(gdsfs_mount, "tardir")
    for n in ("b.tar", "a.tar", "c.tar"):
        _good(src, n, 2)
    with open(os.path.join(src, "README"), "w") as f:
        f.write("not a shard")
    with gt.GDSShardDataset(mnt, gpu_keys=["x.npy"]) as ds:
        assert ds.shards == [os.path.join(mnt, n) for n in ("a.tar", "b.tar", "c.tar")]
        assert len(list(ds)) == 6
    empty_src, empty = fresh_dir(gdsfs_mount, "emptydir")
    with pytest.raises(ValueError, match=r"directory '.*emptydir.*' has no index.json and no \.tar"):
        gt.GDSShardDataset(empty)


# -- unbatched loading ---------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_loading(datasets, num_workers: int) -> None:
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy", "y.npy"]) as ds:
        seen = []
        for s in gt.DataLoader(ds, batch_size=None, num_workers=num_workers):
            key = s["__key__"]
            assert isinstance(key, str)
            want = datasets.wds[key]
            assert s["x.npy"].shape == want["x.npy"].shape and s["x.npy"].cpu().numpy().tobytes() == want["x.npy"].tobytes()
            assert np.array_equal(s["y.npy"].cpu().numpy(), want["y.npy"])
            assert s["cls"] == want["cls"]
            seen.append(key)
        assert sorted(seen) == sorted(datasets.wds)
        # A stock DataLoader with gt.collate, too.
        stock = torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=gt.collate)
        first = next(iter(stock)).materialize()
        assert first["x.npy"].shape == (3, 8)
    assert datasets.mount.wait_leases(0) == 0


# -- construction-time checks --------------------------------------------------


def test_decode_for_a_gpu_key_and_unknown_keys_are_refused(datasets) -> None:
    shards = datasets.wds_shards()
    with pytest.raises(ValueError, match=r"decode=\{'jpg': \.\.\.\} names a gpu_keys field"):
        gt.GDSShardDataset(shards, gpu_keys=["jpg"], decode={"jpg": bytes})
    with pytest.raises(ValueError, match=r"gpu_keys field 'x\.nyp' is in no sample of .*train-000.tar.*fields: cls, jpg, x\.npy, y\.npy"):
        gt.GDSShardDataset(shards, gpu_keys=["x.nyp"])
    with pytest.raises(ValueError, match=r"keys= field 'label' is in no sample"):
        gt.GDSShardDataset(shards, keys=["x.npy", "label"])
    with pytest.raises(ValueError, match=r"gpu_keys field 'jpg' is not in keys="):
        gt.GDSShardDataset(shards, gpu_keys=["jpg"], keys=["x.npy"])
    with pytest.raises(ValueError, match=r"MDS column 'y' is in no shard of .*columns: label, raw, v, x"):
        gt.GDSShardDataset(datasets.dir("mds"), gpu_keys=["y"])


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_state_dict_under_a_stock_loader_with_workers_says_what_to_use(datasets) -> None:
    with gt.GDSShardDataset(datasets.wds_shards(), gpu_keys=["x.npy"]) as ds:
        dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=gt.collate)
        for i, b in enumerate(dl):
            b.materialize()
            if i == 2:
                break
        del dl
        with pytest.raises(RuntimeError, match=r"workers of a torch.utils.data.DataLoader.*gdsfs.torch.DataLoader"):
            ds.state_dict()
        # Iterating in this process, or through gdsfs.torch.DataLoader, counts again.
        for i, b in enumerate(gt.DataLoader(ds, batch_size=4, num_workers=2)):
            if i == 1:
                break
        assert sum(ds.state_dict()["consumed"].values()) == 8
        stock0 = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0, collate_fn=gt.collate)
        next(iter(stock0)).materialize()
        assert sum(ds.state_dict()["consumed"].values()) >= 4


# -- fallback warnings ---------------------------------------------------------


def test_fallback_warns_once_per_cause_and_says_what_it_does(datasets, tmp_path) -> None:
    _errors._reset_fallback_warning()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        gt.GDSShardDataset(datasets.wds_shards(on_mount=False), gpu_keys=["x.npy"])
        gt.GDSShardDataset(datasets.dir("mds", on_mount=False), gpu_keys=["x"])  # same cause: quiet
        gck.save({"w": torch.ones(2)}, str(tmp_path / "a.pt"))  # another cause: writes
        gck.save({"w": torch.ones(2)}, str(tmp_path / "b.pt"))
        gst.save_file({"w": torch.ones(2)}, str(tmp_path / "c.safetensors"))
    msgs = [str(x.message) for x in w if issubclass(x.category, gdsfs.GDSFallbackWarning)]
    assert len(msgs) == 3, msgs  # the dataset, gdsfs.checkpoint, gdsfs.safetensors
    assert "not on a gdsfs mount" in msgs[0] and "plain reads" in msgs[0]
    assert "a.pt" in msgs[1] and "plain writes" in msgs[1] and "plain reads" not in msgs[1], msgs[1]
    assert "c.safetensors" in msgs[2] and "plain writes" in msgs[2], msgs[2]
    assert not any("gdsfs: gdsfs:" in m for m in msgs)


def test_daemon_refusal_warns_although_an_other_cause_warned_before(datasets) -> None:
    from gdsfs import _protocol as proto

    _errors._reset_fallback_warning()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gdsfs.GDSFallbackWarning)
        gt.GDSShardDataset(datasets.wds_shards(on_mount=False), gpu_keys=["x.npy"])
    ds = gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"])
    good = ds.session.token
    ds.session.token = proto.Token(good.session, good.secret ^ 1)
    with pytest.warns(gdsfs.GDSFallbackWarning, match="cannot serve") as rec:
        assert len(list(ds)) == 13
    assert not any("gdsfs: gdsfs:" in str(r.message) for r in rec)
    ds.session.token = good
    ds.close()


# -- devices -------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_explicit_cuda_device_that_does_not_exist_raises(datasets, tmp_path) -> None:
    for dev in ("cuda:1", "cuda", torch.device("cuda", 0), 0):
        with pytest.raises(RuntimeError, match=r"device .*cuda.* does not exist.*device='cpu'"):
            gt.GDSShardDataset(datasets.wds_shards()[:1], gpu_keys=["x.npy"], device=dev)
    p = os.path.join(datasets.mount.mnt, "dev.safetensors")
    gst.save_file({"a": torch.arange(3)}, p)
    for dev in ("cuda:1", "cuda", 0):
        with pytest.raises(RuntimeError, match=r"does not exist.*device='cpu'"):
            gst.load_file(p, device=dev)
        with pytest.raises(RuntimeError, match=r"does not exist"):
            gst.safe_open(p, framework="pt", device=dev)
    os.unlink(p)


# -- the rest ------------------------------------------------------------------


def test_the_shared_tensor_error_recommends_a_function_that_exists(tmp_path) -> None:
    w = torch.ones(4, 4)
    with pytest.raises(RuntimeError, match="save_model") as ei:
        gst.save({"a": w, "b": w})
    assert "save_model" in str(ei.value) and callable(getattr(gst, "save_model", None))


def test_import_gdsfs_dcp_on_an_old_torch_says_which_torch() -> None:
    import _dcp_standin

    if _dcp_standin.has_real_dcp():
        pytest.skip(f"torch {torch.__version__} has torch.distributed.checkpoint")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    r = subprocess.run([sys.executable, "-c", "import gdsfs.dcp"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: gdsfs.dcp needs torch >= 2") and torch.__version__ in last, r.stderr


def test_help_shows_the_public_api_only() -> None:
    text = pydoc.render_doc(gt.GDSShardDataset, renderer=pydoc.plaintext)
    for private in ("_read_group", "_emit", "_shard_format", "_tensor_geometry", "_index_of"):
        assert private not in text, private
    for public in ("state_dict", "set_epoch", "close", "reclaim"):
        assert public in text, public


# -- the daemon gone mid-iteration -----------------------------------------------


def test_abandoning_a_loader_after_the_daemon_died_raises_nothing_unraisable(gdsfs_bin, tmp_path) -> None:
    """A trainer whose gdsfs daemon was killed (or the mount taken away) breaks out of its
    DataLoader loop: the loader's cleanup (stop the workers, continue with a fresh session)
    must not raise from a finalizer, where Python can only print "Exception ignored"."""
    from conftest import mount, unmount

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    for i in range(2):
        _good(str(src), f"s{i}.tar", n=8)
    m = mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"))
    seen: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: seen.append(f"{u.exc_type.__name__}: {u.exc_value} in {u.object!r} at " + "".join(traceback.format_tb(u.exc_traceback)))
    try:
        ds = gt.GDSShardDataset([os.path.join(m.mnt, "s0.tar"), os.path.join(m.mnt, "s1.tar")],
                                gpu_keys=["x.npy"], device="cpu")
        loader = gt.DataLoader(ds, batch_size=2, num_workers=0)
        it = iter(loader)
        next(it)
        assert ds._session is not None, "the dataset on a gdsfs mount opened no session"
        os.kill(ds._session.hello.daemon_pid, 9)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            del it  # the loop ends: the generator closes, the loader cleans up
            import gc
            gc.collect()
        assert seen == [], f"the loader's cleanup raised where nobody can catch it: {seen}"
        ds.close()
    finally:
        sys.unraisablehook = old_hook
        unmount(gdsfs_bin, m.mnt)
