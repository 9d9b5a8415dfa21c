"""Issue 15: the main process's cost per batch. gdsfs.torch.DataLoader's loop settles several
batches with one RELEASE (gdsfs._tensors.settled); held to the lease rules of issue 11: no batch
is yielded before its leases were released and the daemon's answer checked, a yielded batch's
bytes never change after its leases returned and the daemon reused their memory, and every lease
returns after islice, break, del or a killed worker (the daemon's STATUS as the oracle)."""

from __future__ import annotations

import functools
import itertools
import os
import signal

import pytest

import _lease_diag


def _shards(mount, name: str, nshards: int = 3, per: int = 40, nbytes: int = 16 << 10, seed: int = 15) -> tuple[list[str], dict[str, bytes]]:
    import numpy as np

    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(mount, name)
    truth: dict[str, bytes] = {}
    paths = []
    rng = np.random.default_rng(seed)
    for s in range(nshards):
        samples = []
        for i in range(per):
            a = rng.standard_normal(nbytes // 4).astype(np.float32)
            key = f"s{s}_{i:04d}"
            truth[key] = a.tobytes()
            samples.append((key, {"x.npy": npy(a), "cls": str(i).encode()}))
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
    return paths, truth


class _Recorder:
    """What the main process sees: the leases of every batch column it unpickles (by sample key)
    and its RELEASE requests."""

    def __init__(self, monkeypatch) -> None:
        from gdsfs import _core, _tensors

        self.leases: dict[str, tuple[int, int, int, int]] = {}  # sample -> (lease, slab, offset, length)
        self.releases = 0
        real_rebuild, real_release = _tensors._rebuild_column, _core.Session._release_ids
        pid = os.getpid()

        @functools.wraps(real_rebuild)  # pickled by name by the workers (the module's attribute is this)
        def rebuild(*args):
            col = real_rebuild(*args)
            if os.getpid() == pid:
                for i, key in zip(col.idx, col.samples):
                    r = col.leases[i]
                    self.leases[key] = (r.lease, r.slab, r.offset, r.valid)
            return col

        def release(sess, ids):
            if os.getpid() == pid:
                self.releases += 1
            return real_release(sess, ids)

        monkeypatch.setattr(_tensors, "_rebuild_column", rebuild)
        monkeypatch.setattr(_core.Session, "_release_ids", release)


def _record_pid(d: str, _worker_id: int) -> None:
    open(os.path.join(d, str(os.getpid())), "w").close()


def _held_here() -> set[int]:
    from gdsfs import _leases

    return {lease for lease, state, *_ in _leases.live() if state == "held"}


@pytest.mark.parametrize("stop", ["islice", "break", "del", "kill"])
def test_the_loader_settles_several_batches_with_one_release(gdsfs_mount, monkeypatch, tmp_path, stop: str) -> None:
    """With more batches ready than it yields (forced here: the loader always finds one waiting),
    the loop settles up to SETTLE_BATCHES batches with one RELEASE; each batch it yields is settled
    (its leases released, the daemon's answer checked), and after islice, break or del of its
    iterator, or a killed worker, every lease returns."""
    import gdsfs.torch as gt
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "_ready_probe", lambda it: (lambda: True))
    rec = _Recorder(monkeypatch)
    paths, truth = _shards(gdsfs_mount, "settle-group")
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, timeout=60, worker_init_fn=functools.partial(_record_pid, str(tmp_path)))
    it = iter(dl)
    got = []
    if stop == "kill":
        got = list(itertools.islice(it, 3))
        os.kill(int(sorted(os.listdir(tmp_path))[-1]), signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) [0-9, ]+\) exited unexpectedly|killed by signal"):
            for b in it:
                assert b._pending is None
    else:
        for b in it:
            got.append(b)
            if len(got) == 3:
                break
    for b in got:
        assert b._pending is None, "a batch was yielded before its leases were released"
        mine = {rec.leases[k][0] for k in b["__key__"]}
        assert not (mine & _held_here()), "a yielded batch's lease is still held"
        for i, key in enumerate(b["__key__"]):
            assert b["x.npy"][i].cpu().numpy().tobytes() == truth[key]
    # Three batches out, one RELEASE: the loop settled a group of them before the first.
    assert rec.releases < len(got), rec.releases
    if stop == "del":
        del it
    else:
        it.close()
    del got, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_whole_pass_settles_in_groups_every_sample_once(gdsfs_mount, monkeypatch) -> None:
    import gdsfs.torch as gt
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "_ready_probe", lambda it: (lambda: True))
    rec = _Recorder(monkeypatch)
    paths, truth = _shards(gdsfs_mount, "settle-pass")
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    seen: dict[str, bytes] = {}
    nb = 0
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, timeout=60)
    for b in dl:
        assert b._pending is None
        nb += 1
        for i, key in enumerate(b["__key__"]):
            assert key not in seen
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
    assert seen == truth
    assert nb == len(dl) and rec.releases <= -(-nb // _tensors.SETTLE_BATCHES) + 2, (nb, rec.releases)
    del b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_yielded_batch_keeps_its_bytes_after_its_leases_return(gdsfs_mount, monkeypatch) -> None:
    """Batches settled in a group are copies: after their leases returned and the daemon read other
    bytes into the same slab memory, every batch kept still has its own samples' bytes."""
    import gdsfs.torch as gt
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "_ready_probe", lambda it: (lambda: True))
    rec = _Recorder(monkeypatch)
    paths_a, truth_a = _shards(gdsfs_mount, "settle-a", seed=1)
    paths_b, truth_b = _shards(gdsfs_mount, "settle-b", seed=2)
    ds = gt.GDSShardDataset(paths_a, gpu_keys=["x.npy"], strict=True)
    kept = list(gt.DataLoader(ds, batch_size=8, num_workers=2, timeout=60))
    ds.close()
    where_a = {k: v for k, v in rec.leases.items() if k in truth_a}
    rec.leases.clear()
    assert gdsfs_mount.wait_leases(0) == 0
    ds2 = gt.GDSShardDataset(paths_b, gpu_keys=["x.npy"], strict=True)
    for _b in gt.DataLoader(ds2, batch_size=8, num_workers=2, timeout=60):
        pass
    ds2.close()
    # The second pass's reads landed in memory the first pass's leases had (else the check below proves nothing).
    spans_a = [(slab, off, off + n) for _l, slab, off, n in where_a.values()]
    reused = sum(any(s == slab and off < e and b < off + n for s, b, e in spans_a) for _l, slab, off, n in rec.leases.values())
    assert reused > 0, "the daemon gave the second pass other memory"
    for b in kept:
        for i, key in enumerate(b["__key__"]):
            assert b["x.npy"][i].cpu().numpy().tobytes() == truth_a[key], f"batch bytes of {key} changed after its lease returned"
    assert len(truth_b) == len(truth_a)
    del kept, b, _b
    assert gdsfs_mount.wait_leases(0) == 0


def _raw_batches(mount, name: str, n: int = 4, per: int = 4):
    """n collated batches of per samples straight from the dataset (plain iteration, no workers)."""
    import gdsfs.torch as gt

    paths, truth = _shards(mount, name, nshards=1, per=n * per)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=n * per)
    samples = list(ds)
    return ds, [gt.collate(samples[i : i + per]) for i in range(0, n * per, per)], truth


def test_a_lost_lease_in_a_group_yields_the_batches_before_it(gdsfs_mount) -> None:
    """Plain Python iteration of settled(): a group whose third batch's lease the session lost
    behind its back yields the first two, then raises GDSLeaseError; no lease stays."""
    import gdsfs
    from gdsfs import _tensors

    ds, raws, truth = _raw_batches(gdsfs_mount, "settle-lost")
    lost = [r.lease for r in raws[2]["x.npy"].leases]
    ds.session._release_ids(lost)
    got = []
    with pytest.raises(gdsfs.GDSLeaseError) as e:
        for b in _tensors.settled(iter(raws), ready=lambda: True):
            got.append(b)
    assert "no longer had it" in str(e.value)
    assert len(got) == 2
    for b in got:
        assert b._pending is None
        for i, key in enumerate(b["__key__"]):
            assert b["x.npy"][i].cpu().numpy().tobytes() == truth[key]
    del raws, got, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("stop", ["islice", "break", "del"])
def test_settled_batches_dropped_midway_return_every_lease(gdsfs_mount, monkeypatch, stop: str) -> None:
    """Plain Python iteration of settled() in groups of 2, stopped after one batch: the batches it
    settled, the one it yielded and those it never took return their leases."""
    from gdsfs import _tensors

    monkeypatch.setattr(_tensors, "SETTLE_BATCHES", 2)
    ds, raws, truth = _raw_batches(gdsfs_mount, "settle-drop")
    assert gdsfs_mount.stats()["leases"] > 0
    gen = _tensors.settled(iter(raws), ready=lambda: True)
    if stop == "islice":
        got = list(itertools.islice(gen, 1))
    else:
        got = []
        for b in gen:
            got.append(b)
            break
    assert got[0]._pending is None
    assert [got[0]["x.npy"][i].cpu().numpy().tobytes() for i in range(4)] == [truth[k] for k in got[0]["__key__"]]
    if stop == "del":
        del gen
    else:
        gen.close()
    del raws, got
    if stop == "break":
        del b
    ds.close()
    n = gdsfs_mount.wait_leases(0)
    assert n == 0, _lease_diag.report(gdsfs_mount)  # which leases are left, and what refers to their Holds


def test_the_ready_probe_sees_a_waiting_batch() -> None:
    """_ready_probe on the queues a DataLoader iterator reads: a multiprocessing pipe (the workers'
    results), a thread queue (a pin-memory thread's); None when there is none to look at."""
    import multiprocessing
    import queue
    import types

    from gdsfs import _tensors

    mq = multiprocessing.SimpleQueue()
    tq: queue.Queue = queue.Queue()
    for q in (mq, tq):
        ready = _tensors._ready_probe(types.SimpleNamespace(_data_queue=q))
        assert ready is not None and not ready()
        q.put(("batch", 1))
        assert ready()
        q.get()
        assert not ready()
    assert _tensors._ready_probe(object()) is None
    mq.close()


def test_with_cuda_the_loop_copies_batches_without_torchs_pin_thread(gdsfs_mount, monkeypatch) -> None:
    """On a GPU machine (faked: torch.cuda says one device; the copies themselves run on the CPU)
    gdsfs.torch.DataLoader(pin_memory=True) with gdsfs.torch.collate starts no pin-memory thread:
    its loop materializes each batch for the current GPU, pinning, and settles it; dl.pin_memory
    stays True. With another collate_fn torch's pin-memory thread is asked for as before."""
    import torch
    import torch.utils.data

    import gdsfs.torch as gt
    from gdsfs import _tensors

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    calls = []
    real = _tensors.GDSBatch.materialize
    pid = os.getpid()

    def materialize(self, device=None, *, pin=False, _defer=False, **private):
        if os.getpid() == pid:
            calls.append((str(device), pin, _defer))
        return real(self, None, pin=False, _defer=_defer)  # the copy on the CPU: there is no GPU

    monkeypatch.setattr(_tensors.GDSBatch, "materialize", materialize)
    made = []
    real_get = torch.utils.data.DataLoader._get_iterator

    def get_iterator(self):
        made.append(self.pin_memory)
        if self.pin_memory:
            raise RuntimeError("torch would start its pin-memory thread")
        return real_get(self)

    monkeypatch.setattr(torch.utils.data.DataLoader, "_get_iterator", get_iterator)
    paths, truth = _shards(gdsfs_mount, "settle-cuda", nshards=2, per=16)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=8, num_workers=2, timeout=60)
    assert dl.pin_memory
    seen = {}
    for b in dl:
        assert b._pending is None
        for i, key in enumerate(b["__key__"]):
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
    assert seen == truth
    assert made == [False] and dl.pin_memory
    assert calls and set(calls) == {("cuda:0", True, True)}, calls
    other = gt.DataLoader(ds, batch_size=8, num_workers=2, collate_fn=lambda s: gt.collate(s), timeout=60)
    with pytest.raises(RuntimeError, match="pin-memory thread"):
        next(iter(other))
    del b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


class _FakeCuda:
    """The torch.cuda calls _Pending and _settle_group make, recorded (CUDA slabs on a CPU box)."""

    def __init__(self, monkeypatch) -> None:
        import torch

        self.calls: list[tuple] = []
        fake = self

        class Stream:
            def __init__(self, d: int) -> None:
                self.d = d

            def synchronize(self) -> None:
                fake.calls.append(("stream sync", self.d))

        class Event:
            def record(self, stream) -> None:
                fake.calls.append(("record", stream.d))

            def synchronize(self) -> None:
                fake.calls.append(("event sync",))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: Stream(d))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: fake.calls.append(("device sync", d)))


def _cuda_holds(n: int, device: int = 0):
    from gdsfs import _leases
    from gdsfs._core import Ref

    refs = [Ref("/nonexistent-mount", 7, 1, 4242, 9000 + i, 1, 0, 16, 16, device, "posix") for i in range(n)]
    return [_leases.hold(r) for r in refs]


def test_the_loops_copies_wait_once_per_group_for_their_stream(monkeypatch) -> None:
    """Copies out of CUDA slabs (faked): a pin-memory thread's batch records an event per device
    after its copies (as before); the loop's own copies record none, and their group waits once
    per device for its current stream before the one release; one dropped before its group
    settled waits for its device before its Holds go."""
    from gdsfs import _leases, _tensors

    cuda = _FakeCuda(monkeypatch)
    released: list[list] = []
    monkeypatch.setattr(_leases, "release_groups", lambda groups: released.append([len(g) for g in groups]) or [None] * len(groups))
    p = _tensors._Pending(_cuda_holds(1))
    assert cuda.calls == [("record", 0)]
    cuda.calls.clear()
    batches = []
    for i in range(3):
        b = _tensors.GDSBatch({})
        b._pending = _tensors._Pending(_cuda_holds(2), record=False)
        batches.append(b)
    pinned = _tensors.GDSBatch({})
    pinned._pending = p
    assert cuda.calls == []
    assert _tensors._settle_group(batches + [pinned]) == [None] * 4
    assert cuda.calls == [("stream sync", 0), ("event sync",)], cuda.calls
    assert released == [[2, 2, 2, 1]]
    assert all(b._pending is None for b in batches + [pinned])
    cuda.calls.clear()
    dropped = _tensors._Pending(_cuda_holds(1, device=1), record=False)
    del dropped
    assert cuda.calls == [("device sync", 1)]
