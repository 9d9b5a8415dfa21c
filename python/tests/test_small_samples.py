"""Issue 15: small samples. What a worker's batch costs to hand over, and that the faster paths
give the same bytes, every sample once, and keep the lease rules of issue 11."""

from __future__ import annotations

import io
import os
import pickle
import signal

import pytest
import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

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
            seen[key] = x[i].cpu().numpy().tobytes()
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
    assert [out["x.npy"][i].cpu().numpy().tobytes() for i in range(16)] == [truth[k] for k in out["__key__"]]
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


def _read_ranges(path: str) -> int:
    import gdsfs

    return int(gdsfs.status(path)["counters"]["read_ranges"])


def _reads(path: str) -> int:
    import gdsfs

    return int(gdsfs.status(path)["counters"]["reads"])


@pytest.mark.parametrize("how", ["dataloader", "map", "stock"])
def test_a_batchs_adjacent_samples_share_one_read_range(gdsfs_mount, how: str) -> None:
    """gdsfs.torch.DataLoader's workers read one range per run of a batch's adjacent samples of
    a shard (one extent for the daemon, one lease for the batch); with map= (a worker may drop
    samples) or a stock DataLoader (the dataset does not know the batches) one per sample.
    Either way every sample arrives once with its bytes, and no lease stays behind."""
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=3, per=40)
    kw = {"map": lambda s: s} if how == "map" else {}
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, **kw)
    if how == "stock":
        dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=gt.collate)
    else:
        dl = gt.DataLoader(ds, batch_size=8, num_workers=2)
    before, reads0 = _read_ranges(paths[0]), _reads(paths[0])
    seen: dict[str, bytes] = {}
    batches = 0
    for b in dl:
        if not b.materialized:
            b = b.materialize()
        batches += 1
        for i, key in enumerate(b["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
    ranges, reads = _read_ranges(paths[0]) - before, _reads(paths[0]) - reads0
    assert seen == truth
    if how == "dataloader":
        # A batch is 8 consecutive samples of a worker's block: one range, two where it
        # crosses from one shard into the next.
        assert ranges <= 2 * batches, (ranges, batches)
    else:
        # One per sample, besides the empty range of each READ that checks a shard's version
        # after the CPU fields' preads (at most one per READ of samples).
        assert len(truth) <= ranges <= len(truth) + reads // 2, (ranges, reads)
    del dl, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_resume_is_exact_with_shared_ranges(gdsfs_mount) -> None:
    """Stopping after some batches and resuming from state_dict() gives every other sample
    once, also when batches share ranges (the resume point falls inside a run of the first
    pass: the second pass plans its own)."""
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=2, per=30)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=12)
    dl = gt.DataLoader(ds, batch_size=5, num_workers=2)
    seen: dict[str, bytes] = {}
    it = iter(dl)
    for _ in range(3):
        b = next(it)
        seen.update((k, b["x.npy"][i].cpu().numpy().tobytes()) for i, k in enumerate(b["__key__"]))
    state = dl.state_dict()
    del it, b
    ds2 = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=7)
    dl2 = gt.DataLoader(ds2, batch_size=4, num_workers=2)
    dl2.load_state_dict(state)
    for b in dl2:
        for i, k in enumerate(b["__key__"]):
            assert k not in seen, f"{k} delivered twice"
            seen[k] = b["x.npy"][i].cpu().numpy().tobytes()
    assert seen == truth
    del dl, dl2, b
    ds.close()
    ds2.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_shared_range_gathers_as_one_strided_copy(gdsfs_mount) -> None:
    """A batch whose samples share one lease at evenly spaced starts (what a gdsfs.torch.DataLoader
    worker collates) gathers with one strided copy out of the slab: the same bytes as a slice
    per sample, in memory of its own (the lease is released after it), and spent afterwards."""
    import itertools

    import gdsfs
    import gdsfs.torch as gt
    from gdsfs import _core, _tensors

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    ds._batched = 8  # as gdsfs.torch.DataLoader tells its workers' copies
    it = iter(ds)
    batches = [gt.collate(list(itertools.islice(it, 8))) for _ in range(2)]
    for b in batches:
        refs = b["x.npy"].refs
        assert len({t.ref.lease for t in refs}) == 1
        run = _tensors._strided_run(refs)
        assert run is not None and run.shape == (8, len(truth[b["__key__"][0]]))
        slab = _tensors._slab_tensor(_core.session_for(refs[0].ref), refs[0].ref.slab)
        out = b.materialize()
        x = out["x.npy"]
        assert not (slab.data_ptr() <= x.data_ptr() < slab.data_ptr() + slab.numel()), "the gather aliases the slab"
        assert [x[i].cpu().numpy().tobytes() for i in range(8)] == [truth[k] for k in out["__key__"]]
        with pytest.raises(gdsfs.GDSLeaseError):
            b.materialize()
    it.close()
    ds.close()
    del batches, b, out, x, refs, run, slab
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_later_epoch_reuses_the_sample_plans(gdsfs_mount, monkeypatch) -> None:
    """A shard still open in a later epoch (a persistent worker's) is not planned again: no
    pread of each .npy header, only the CPU fields' bytes; the samples are the same."""
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=2, per=12)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, shuffle=True)
    for st in ds._open.values():
        st.npy_headers = []  # plan from each header's bytes, as without the index's npy_headers
    calls = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: calls.append(n) or real(fd, n, off))
    epochs = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        calls.clear()
        got = {s["__key__"]: (s["cls"], s["x.npy"].materialize().cpu().numpy().tobytes()) for s in ds}
        epochs.append(len(calls))
        assert {k: v[1] for k, v in got.items()} == truth
    assert epochs == [2 * len(truth), len(truth)], epochs  # header + .cls, then .cls only
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


# ----------------------------------------------------------------------------
# gdsfs.torch.DataLoader's pin-memory thread leaves the RELEASE to the loop's thread.


def _pin_in_loader_thread(batch):
    """batch.pin_memory() as gdsfs.torch.DataLoader's pin-memory thread runs it: in a thread
    the loader marked (gdsfs._tensors.defer_release), whose batches the loop's thread settles."""
    import threading

    from gdsfs import _tensors

    out = []

    def run() -> None:
        out.append(batch.pin_memory())

    t = threading.Thread(target=run)
    _tensors.defer_release(t, True)
    t.start()
    t.join()
    return out[0]


def test_a_batch_pinned_for_the_loader_keeps_its_leases_until_settled(gdsfs_mount) -> None:
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    raw = gt.collate(list(ds))
    out = _pin_in_loader_thread(raw)
    assert out.materialized
    # Copied, not released yet: the RELEASE waits for the loop's thread.
    assert gdsfs_mount.stats()["leases"] == 16
    out._settle()
    assert gdsfs_mount.stats()["leases"] == 0
    out._settle()  # idempotent
    assert [out["x.npy"][i].cpu().numpy().tobytes() for i in range(16)] == [truth[k] for k in out["__key__"]]
    with pytest.raises(gdsfs_lease_error()):
        raw.materialize()  # spent
    del raw, out
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_pinned_batch_dropped_before_settling_returns_its_leases(gdsfs_mount) -> None:
    import gc

    import gdsfs.torch as gt

    paths, _truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    out = _pin_in_loader_thread(gt.collate(list(ds)))
    assert gdsfs_mount.stats()["leases"] == 16
    del out
    gc.collect()
    assert gdsfs_mount.wait_leases(0) == 0
    ds.close()


def test_settling_checks_that_the_daemon_still_held_the_leases(gdsfs_mount) -> None:
    import gdsfs.torch as gt

    paths, _truth = _small_shards(gdsfs_mount, nshards=1, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    raw = gt.collate(list(ds))
    refs = [t.ref for t in raw["x.npy"].refs]
    out = _pin_in_loader_thread(raw)
    ds.session._release_ids([r.lease for r in refs])  # lost behind the batch's back
    with pytest.raises(gdsfs_lease_error()) as e:
        out._settle()
    assert "no longer had it" in str(e.value)
    del raw, out
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("stop", ["islice", "break", "del", "kill"])
def test_the_loader_settles_what_its_pin_thread_deferred(gdsfs_mount, monkeypatch, stop: str) -> None:
    """gdsfs.torch.DataLoader marks its pin-memory thread (CUDA only: simulated here by a thread
    that pins each batch as torch's does), settles every batch it yields, and after islice, break
    or del of its iterator, or a killed worker, every lease returns."""
    import itertools
    import queue
    import threading

    import gdsfs.torch as gt
    import torch.utils.data

    real_iter = torch.utils.data.DataLoader.__iter__

    class PinningIter:
        def __init__(self, loader):
            self.inner = real_iter(loader)
            self.q: queue.Queue = queue.Queue(maxsize=2)
            self.stop = False
            self._pin_memory_thread = threading.Thread(target=self.pin_loop, daemon=True)
            self._pin_memory_thread.start()

        def put(self, item) -> None:
            while not self.stop:
                try:
                    self.q.put(item, timeout=0.05)
                    return
                except queue.Full:
                    continue

        def pin_loop(self) -> None:
            try:
                for raw in self.inner:
                    out = raw.pin_memory()
                    deferred.append(out._pending is not None)
                    self.put(out)
                    del raw, out
                    if self.stop:
                        break
            except Exception as e:  # noqa: BLE001 - handed to the loop, as torch's pin thread does
                self.put(e)
                return
            self.put(None)

        def __iter__(self):
            return self

        def __next__(self):
            b = self.q.get()
            if b is None:
                raise StopIteration
            if isinstance(b, Exception):
                raise b
            return b

        def _shutdown_workers(self) -> None:
            self.stop = True
            self._pin_memory_thread.join()
            shutdown = getattr(self.inner, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    deferred: list[bool] = []
    made: list[PinningIter] = []
    monkeypatch.setattr(torch.utils.data.DataLoader, "__iter__", lambda self: made.append(PinningIter(self)) or made[-1])
    paths, truth = _small_shards(gdsfs_mount, nshards=3, per=40)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    # pin_memory=False: torch's own pin-memory thread (CUDA present) would materialize before ours.
    # batches_per_item=1: what the loader chooses where torch's pin thread runs (it sees items).
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, pin_memory=False, batches_per_item=1)
    seen = {}
    it = iter(dl)
    if stop == "islice":
        got = list(itertools.islice(it, 3))
    elif stop == "kill":
        got = list(itertools.islice(it, 3))
        os.kill(made[-1].inner._workers[1].pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) [0-9, ]+\) exited unexpectedly|killed by signal"):
            for _b in it:
                pass
    else:
        got = []
        for b in it:
            got.append(b)
            if len(got) == 3:
                break
    for b in got:
        assert b._pending is None, "a batch was yielded before its leases were released"
        for i, key in enumerate(b["__key__"]):
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
    assert seen and all(truth[k] == v for k, v in seen.items())
    if stop == "del":
        del it
    else:
        it.close()
    made.clear()  # the test's own reference to the stopped iterator (and the batches it queued)
    del got, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
    # A whole pass through the same loader: every sample once.
    ds2 = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    whole = {}
    for b in gt.DataLoader(ds2, batch_size=8, num_workers=2, pin_memory=False, batches_per_item=1):
        assert b._pending is None
        for i, key in enumerate(b["__key__"]):
            assert key not in whole
            whole[key] = b["x.npy"][i].cpu().numpy().tobytes()
    assert whole == truth
    assert sum(deferred) >= len(deferred) // 2, deferred  # the loader marked its pin thread
    del b
    ds2.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_single_sample_batch_pinned_for_the_loader_settles(gdsfs_mount) -> None:
    """batch_size=None: the one-sample batch keeps its pending release through its reshaping."""
    import gdsfs.torch as gt

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=2)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    sample = next(iter(ds))
    out = _pin_in_loader_thread(gt.collate(sample))
    assert out._pending is not None and out["x.npy"].cpu().numpy().tobytes() == truth[out["__key__"]]
    out._settle()
    assert out._pending is None
    del sample, out
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_shared_range_gathers_typed_or_bytewise_by_alignment(gdsfs_mount) -> None:
    """A shared range's column is copied as one typed strided view when its starts and spacing
    are aligned for its dtype, else byte-wise and reinterpreted: the same bytes either way."""
    import itertools

    import gdsfs.torch as gt
    from gdsfs import _tensors

    paths, truth = _small_shards(gdsfs_mount, nshards=1, per=8)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=8)
    ds._batched = 8
    it = iter(ds)
    b = gt.collate(list(itertools.islice(it, 8)))
    refs = b["x.npy"].refs
    n = refs[0].nbytes
    aligned = _tensors._RefColumn(refs)
    assert _tensors._typed_run(aligned) is not None
    shifted = _tensors._RefColumn([gt.TensorRef(t.ref, torch.float32, (n // 4 - 1,), t.start + 2, False, t.field, t.sample, t.path, t._hold)
                                   for t in refs])
    assert _tensors._strided_run(shifted) is not None and _tensors._typed_run(shifted) is None
    for col, lo in ((aligned, 0), (shifted, 2)):
        x = _tensors._gather(col, None, pin=False)
        want = [truth[k][lo : lo + x.shape[1] * 4] for k in b["__key__"]]
        assert x.dtype == torch.float32 and [x[i].cpu().numpy().tobytes() for i in range(8)] == want
    it.close()
    b.release()
    del b, refs, aligned, shifted, x
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
