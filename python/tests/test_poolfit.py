"""A gdsfs.torch.DataLoader whose workers' batches in flight cannot fit this uid's share of the
daemon's pool says so when its iteration starts, before any worker is started, instead of its
workers' READs waiting 120 s for pool space that never comes (GDSPoolError); one that fits the
batch the loop waits for but not everything in flight warns once (GDSPoolWarning) and works; a
READ that does give up names what to change. And the start hint's default budget is shared by
the DDP ranks of one node (LOCAL_WORLD_SIZE).

The pool: a host pool of 4 MiB in 1 MiB slabs, each uid's share 2 MiB (--uid-share 50%), so that
a second uid can hold its own share beside ours. Samples of 16 KiB (.npy float32) and a .cls."""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

import torch.utils.data
from test_settle import _shards

SHARE = 2 << 20


@pytest.fixture(scope="module")
def pool(gdsfs_bin):
    import conftest

    base = tempfile.mkdtemp(prefix="gdsfs-poolfit-", dir="/tmp")  # reachable by a second uid
    os.chmod(base, 0o755)
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.mkdir(src)
    os.mkdir(mnt)
    m = conftest.mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"), "--host-pool", "4MiB", "--slab-size", "1MiB",
                       "--uid-share", "50%", "--allow-other")
    try:
        yield m
    finally:
        conftest.unmount(gdsfs_bin, m.mnt)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def data(pool):
    """2 shards of 300 samples of 16 KiB: 300 samples per worker of 2."""
    return _shards(pool, "poolfit", nshards=2, per=300)


class _Forks:
    """Counts the iterators torch makes (each starts the loader's workers)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = torch.utils.data.DataLoader._get_iterator

        def counted(loader):
            self.n += 1
            return real(loader)

        monkeypatch.setattr(torch.utils.data.DataLoader, "_get_iterator", counted)


def _leases(pool) -> int:
    return int(pool.stats()["leases"])


@pytest.mark.parametrize("strict", [True, False])
def test_a_batch_larger_than_the_share_fails_before_any_worker_starts(pool, data, monkeypatch, strict: bool) -> None:
    """256 samples x 16 KiB = 4 MiB a batch, on a share of 2 MiB: before, every worker's READ
    waited 120 s for pool space that never came (strict: then GDSUnavailableError; otherwise
    plain reads). Now the first next() raises GDSPoolError naming the numbers and the fix, before
    torch starts a worker, and nothing is leased."""
    import gdsfs.torch as gt
    from gdsfs import GDSUnavailableError
    from gdsfs._errors import GDSPoolError

    paths, _truth = data
    forks = _Forks(monkeypatch)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=strict)
    dl = gt.DataLoader(ds, batch_size=256, num_workers=2, timeout=5)  # timeout: what failed the test before, not 120 s
    with pytest.raises(GDSPoolError) as ei:
        next(iter(dl))
    msg = str(ei.value)
    assert isinstance(ei.value, GDSUnavailableError) and ei.value.errno == errno.EAGAIN
    assert "\n" not in msg
    for want in ("batch_size=256", "KiB leased", "2.0 MiB", "--host-pool", "--uid-share"):
        assert want in msg, (want, msg)
    # 16 KiB and the tar's headers and .cls between two samples' fields, read along (18 KiB), and
    # the part of a 1 MiB slab its leases leave empty: about 20 KiB a sample, so at most 2 MiB /
    # that many samples a batch.
    m = re.search(r"256 samples x (\d+\.\d) KiB leased: (\d+\.\d) MiB\) is larger .* use batch_size <= (\d+),", msg)
    assert m and 16 < float(m[1]) < 24 and 4 < float(m[2]) < 6 and abs(int(m[3]) - SHARE / (float(m[1]) * 1024)) <= 1, msg
    assert forks.n == 0, "a worker was started"
    assert _leases(pool) == 0
    ds.close()


@pytest.mark.parametrize("k", [8, None])
def test_batches_in_flight_that_can_hang_are_an_error(pool, data, monkeypatch, k) -> None:
    """A batch fits, but the other worker can fill the share while the item the loop waits for
    still needs room (the loop takes items in order and releases nothing meanwhile): the hang
    the default k avoided, with an explicit batches_per_item=8 (1 item of 8 x 16 samples a worker, 2.3 MiB),
    and with the default k, which is 1 for batches of 64 samples (1 MiB) and still too much
    (2 items of 1 MiB a worker). GDSPoolError before any worker starts; for the explicit k it
    names the batches_per_item that fits."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolError, GDSPoolWarning

    paths, _truth = data
    forks = _Forks(monkeypatch)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16 if k else 64)
    dl = gt.DataLoader(ds, batch_size=16 if k else 64, num_workers=2, batches_per_item=k, timeout=2)
    with pytest.raises(GDSPoolError, match="can hang on uid") as ei:
        next(iter(dl))
    msg = str(ei.value)
    assert "\n" not in msg and "num_workers" in msg and "--host-pool" in msg
    named = re.search(r"batches_per_item <= (\d+),", msg)
    if k:
        assert "batches_per_item=8" in msg and named and 1 <= int(named[1]) < 8, msg
    else:
        assert "batches_per_item=None (k=1)" in msg and not named, msg
    assert forks.n == 0
    ds.close()
    if k:
        # The k it named works, every sample once.
        assert named
        ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GDSPoolWarning)  # 2 items and the loop's: more than the share
            got = [key for b in gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=int(named[1]), timeout=30) for key in b["__key__"]]
        assert sorted(got) == sorted(_truth)
        ds.close()
    assert pool.wait_leases(0) == 0


def test_items_are_counted_as_the_workers_lease_them(pool, data, monkeypatch) -> None:
    """3 workers, batches of 4, batches_per_item=8, read_ahead=32: a worker reads its item of 32
    samples of a shard as one range (GDSShardDataset._runs keyed by item), a lease of 574 KiB, of
    which a 1 MiB slab holds one. Counted by batch (4 samples, 13 leases a slab: 18 KiB a sample)
    the other workers' items and the awaited one fit the 2 MiB share; as leased they take 3 slabs
    of its 2, and the loader hung (DataLoader timeout) without a word. Now GDSPoolError before any
    worker starts, naming a batches_per_item that fits; that k reads every sample."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolError, GDSPoolWarning

    paths, truth = data
    forks = _Forks(monkeypatch)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=32)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=3, batches_per_item=8, timeout=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSPoolWarning)
        with pytest.raises(GDSPoolError, match="can hang on uid") as ei:
            next(iter(dl))
    named = re.search(r"batches_per_item <= (\d+),", str(ei.value))
    assert named and 1 <= int(named[1]) < 8 and forks.n == 0, str(ei.value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSPoolWarning)
        got = [key for b in gt.DataLoader(ds, batch_size=4, num_workers=3, batches_per_item=int(named[1]), timeout=30) for key in b["__key__"]]
    assert sorted(got) == sorted(truth)
    ds.close()
    assert pool.wait_leases(0) == 0


@pytest.mark.parametrize("read_ahead", [48, 64, 95])
def test_items_read_whole_at_the_margin_run(pool, data, read_ahead: int) -> None:
    """Batches of 16, batches_per_item=3 (items of 48 samples, one lease of 864 KiB each: a 1 MiB
    slab apiece), 2 workers, one item in flight each: a worker's chunk is its item whole
    (read_ahead // 48 items, at least one: one here up to read_ahead=95), so no READ reaches past
    an item. The other worker's item and the awaited one fill the 2 MiB share exactly. The check
    priced a READ cut every read_ahead samples, up to 47 samples past each item (another slab),
    and refused it (GDSPoolError "can hang"); run for real, it reads every sample once."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolWarning

    paths, truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=read_ahead)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=3, timeout=20)
    for _epoch in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GDSPoolWarning)  # 3 items with the loop's: more than the share
            seen: dict[str, bytes] = {}
            for b in dl:
                for i, key in enumerate(b["__key__"]):
                    assert key not in seen
                    seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
            del b
        assert seen == truth
    ds.close()
    assert pool.wait_leases(0) == 0


def test_items_read_two_at_once_past_the_margin_hang_and_are_refused(pool, data, monkeypatch) -> None:
    """read_ahead=96, one past that margin: a worker's chunk is 2 items, one READ of 2 slabs, so
    a worker holds its share whole at its first READ and the other's first READ never fits (the
    loop returns nothing until that worker's item comes). Without the check it does hang (torch's
    timeout fires: the READ would wait 120 s); the check refuses it before any worker starts."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolError

    paths, _truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=96)
    forks = _Forks(monkeypatch)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=3, timeout=2)
    with pytest.raises(GDSPoolError, match="can hang on uid") as ei:
        next(iter(dl))
    assert "read ahead" in str(ei.value) and forks.n == 0, str(ei.value)
    monkeypatch.setattr(gt.DataLoader, "_check_pool_fit", lambda self: None)
    with pytest.raises(RuntimeError, match="timed out"):
        for _b in dl:
            pass
    ds.close()
    assert pool.wait_leases(0) == 0


def _record_reads(out_dir: str):
    """GDSShardDataset._read_versioned that also appends each READ's (shard, ranges) to a file of
    the calling process's in out_dir (a worker's, forked with it); a READ of nothing (a version
    check) is left out."""
    import json

    from gdsfs._dataset import GDSShardDataset

    real = GDSShardDataset._read_versioned

    def spy(self, session, shard, st, ranges):
        if list(ranges) != [(0, 0)]:
            with open(os.path.join(out_dir, str(os.getpid())), "a") as f:
                f.write(json.dumps([shard, [list(r) for r in ranges]]) + "\n")
        return real(self, session, shard, st, ranges)
    return spy


@pytest.mark.parametrize("read_ahead, k, read_ahead_bytes, shuffle, resume", [
    (64, 3, 64 << 20, False, 0),  # an item of 48 a chunk
    (96, 3, 64 << 20, False, 0),  # 2 items a chunk, one READ
    (64, 1, 64 << 20, False, 0),  # 4 batches a chunk
    (16, 8, 700 << 10, False, 0),  # an item of 128 in READs of 38 samples (700 KiB)
    (64, 3, 64 << 20, True, 0),
    (64, 3, 64 << 20, False, 37),  # resumed mid-item: items and chunks from the resume point
    (40, 2, 64 << 20, True, 45),
])
def test_the_check_plans_the_reads_the_workers_make(gdsfs_mount, monkeypatch, tmp_path, read_ahead, k, read_ahead_bytes, shuffle, resume) -> None:
    """The pool check prices the READs the workers will make, planned by the workers' own code
    (chunks of whole items, READ groups by read_ahead_bytes, one range per field of an item's
    samples of a shard): its plan of the first worker's READs is, range for range, what that
    worker then READs first, in order; with shuffle, and resumed mid-item."""
    import json

    import gdsfs.torch as gt
    from gdsfs._dataset import GDSShardDataset
    from test_settle import _shards as shards

    paths, truth = shards(gdsfs_mount, f"poolfit-plan-{read_ahead}-{k}-{shuffle}-{resume}", nshards=3, per=100)
    plans = []
    real_plan = GDSShardDataset._lease_plan

    def spy_plan(self, *a, **kw):
        lp = real_plan(self, *a, **kw)
        plans.append(lp)
        return lp

    monkeypatch.setattr(GDSShardDataset, "_lease_plan", spy_plan)
    monkeypatch.setattr(GDSShardDataset, "_read_versioned", _record_reads(str(tmp_path)))
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=read_ahead, read_ahead_bytes=read_ahead_bytes, shuffle=shuffle, seed=3)
    if resume:
        ds.load_state_dict({"version": 1, "epoch": 0, "seed": 3, "shuffle": shuffle, "slots": 2, "consumed": {0: resume, 1: resume}})
    got = [key for b in gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=k, timeout=30) for key in b["__key__"]]
    assert len(got) == len(set(got)) == len(truth) - 2 * resume
    ds.close()
    assert plans and plans[0] is not None and plans[0].reads
    want = [(sh, [tuple(r) for r in rs]) for sh, rs in plans[0].reads]
    # The first worker's READs (slot 0: the one that READ the first planned range).
    files = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    reads = {f: [(sh, [tuple(r) for r in rs]) for sh, rs in map(json.loads, open(f))] for f in files}
    first = [r for r in reads.values() if r and r[0] == want[0]]
    assert len(first) == 1, f"no worker READ the planned first range {want[0]}"
    assert first[0][: len(want)] == want
    assert gdsfs_mount.wait_leases(0) == 0


def test_batches_in_flight_over_the_share_warn_once_and_every_sample_comes(pool, data) -> None:
    """prefetch_factor=4: 2 workers x 4 batches of 16 x 16 KiB (and the batch the loop copies)
    are more than the 2 MiB share with the daemon's alignment, but the batch the loop waits for
    always finds room (1.25 MiB at most are held then): one GDSPoolWarning for the loader, then
    two epochs of every sample once with its bytes (the workers waited for the loop's releases,
    never for good)."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolWarning

    paths, truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, prefetch_factor=4, timeout=30)
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            seen: dict[str, bytes] = {}
            for b in dl:
                for i, key in enumerate(b["__key__"]):
                    assert key not in seen
                    seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
            del b
        pw = [x for x in w if issubclass(x.category, GDSPoolWarning)]
        assert len(pw) == (1 if epoch == 0 else 0), [str(x.message) for x in pw]
        if pw:
            msg = str(pw[0].message)
            assert "prefetch_factor=4" in msg and "2.0 MiB" in msg and "--host-pool" in msg and "\n" not in msg, msg
        assert seen == truth
    ds.close()
    assert pool.wait_leases(0) == 0


def _reads_all_without_warning(paths: list[str], truth: list[str]) -> None:
    """Batches of 16, 2 workers, read_ahead=16 over paths: every sample of truth, no GDSPoolWarning."""
    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolWarning

    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSPoolWarning)
        got = [key for b in gt.DataLoader(ds, batch_size=16, num_workers=2, timeout=30) for key in b["__key__"]]
    assert sorted(got) == sorted(truth)
    ds.close()


def test_what_fits_says_nothing(pool, data) -> None:
    """Batches of 16, k chosen (1 here), read_ahead=16: 2 items a worker and the loop's, 1.4 MiB:
    no warning, no error."""
    _reads_all_without_warning(*data)


def test_what_this_process_holds_counts(pool, data) -> None:
    """A sample of 1 MiB this process keeps (a TensorRef, its lease held) leaves 1 MiB of the
    share: a batch of 80 x 16 KiB (1.25 MiB) then cannot fit, and the error says what is held;
    once it is released, that batch fits."""
    import numpy as np

    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolError
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(pool, "poolfit-big")
    write_tar(os.path.join(src, "big.tar"), [("big", {"x.npy": npy(np.zeros((1 << 20) // 4 - 32, np.float32)), "cls": b"0"})])
    big = gt.GDSShardDataset([os.path.join(mnt, "big.tar")], gpu_keys=["x.npy"], strict=True)
    kept = next(iter(big))
    paths, _truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=80, num_workers=2, timeout=5)
    with pytest.raises(GDSPoolError, match=r"larger than uid \d+'s share .*\(2\.0 MiB, 1\.0 MiB of it held by this process\)"):
        next(iter(dl))
    kept["x.npy"].release()
    del kept
    with pytest.raises(GDSPoolError) as ei:  # 2 items of 1.25 MiB a worker still can hang, but the batch fits
        next(iter(dl))
    assert "can hang" in str(ei.value) and "held by this process" not in str(ei.value), str(ei.value)
    ds.close()
    big.close()
    assert pool.wait_leases(0) == 0


@pytest.mark.parametrize("k,read_ahead", [(None, 16), (3, 64)])
def test_after_a_killed_worker_the_next_pass_fits_and_reads_everything(pool, data, tmp_path, k, read_ahead: int) -> None:
    """A worker killed mid-pass on the small pool: torch's error, then the loader's next pass
    (fresh workers, the session reclaimed) is checked and runs as before: the dead pass's leases
    are not counted against it, nothing hangs, every sample comes once. Also for items of 3
    batches read whole at the margin of the share (test_items_read_whole_at_the_margin_run),
    killed mid-item: the items torch took ahead die with its iterator, their Holds' finalizers
    queue their leases' release (maybe in a later garbage collection); before, the check counted
    them held until the lease book's thread got to them: a false GDSPoolError in about half the
    runs (test_leases_dropped_but_not_yet_released_are_not_counted is the deterministic case)."""
    import functools
    import signal

    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolWarning
    from test_settle import _record_pid

    paths, truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=read_ahead)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, timeout=30, batches_per_item=k, worker_init_fn=functools.partial(_record_pid, str(tmp_path)))
    it = iter(dl)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSPoolWarning)  # k=3: the workers wait for the loop (said once per loader)
        next(it)
    next(it)
    for pid in os.listdir(tmp_path):
        os.kill(int(pid), signal.SIGKILL)
        os.unlink(os.path.join(tmp_path, pid))
    with pytest.raises(RuntimeError, match=r"exited unexpectedly|killed by signal"):
        for _b in it:
            pass
    del it
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSPoolWarning)
        got = [key for b in dl for key in b["__key__"]]
    assert sorted(got) == sorted(truth)
    ds.close()
    assert pool.wait_leases(0) == 0


@pytest.mark.parametrize("how", ["dropped", "cycle"])
def test_leases_dropped_but_not_yet_released_are_not_counted(pool, data, monkeypatch, how: str) -> None:
    """A sample this process read and then dropped (its Hold's finalizer queued the release, or it
    sits in a reference cycle that only the garbage collector frees) holds no pool space the
    program can use: the check of a loader at the margin of the share (items of 3 batches read
    whole, test_items_read_whole_at_the_margin_run) does not count it. Before, it counted it held
    until the lease book's thread (every DRAIN_PERIOD_S; here put to sleep, and the automatic
    collector off) released it: a false GDSPoolError, as after a killed worker."""
    from gdsfs import _leases

    paths, truth = data
    monkeypatch.setattr(_leases, "DRAIN_PERIOD_S", 30.0)
    try:
        _leases_dropped_check(pool, paths, truth, how)
    finally:
        # The thread's 30 s sleep must not outlive this test: later tests count on it collecting
        # closed sessions' holders within its usual period (test_settle_drop's cycle failed in CI).
        monkeypatch.setattr(_leases, "DRAIN_PERIOD_S", 0.1)
        _leases.wake()


def _leases_dropped_check(pool, paths, truth, how: str) -> None:
    import gc
    import time

    import gdsfs.torch as gt
    from gdsfs import _leases
    from gdsfs._errors import GDSPoolWarning

    time.sleep(3 * 0.1)  # the thread's sleep of the old period ends: it drains once more, then sleeps 30 s
    one = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=1)
    g = iter(one)
    sample = next(g)
    g.close()
    assert _leases.held_bytes(pool.mnt, -1) > 0
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=64)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=3, timeout=20)
    gc.disable()
    try:
        if how == "cycle":
            box: list[object] = [sample]
            box.append(box)
            del box
        del sample
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GDSPoolWarning)
            got = [key for b in dl for key in b["__key__"]]
    finally:
        gc.enable()
    assert sorted(got) == sorted(truth)
    ds.close()
    one.close()
    assert pool.wait_leases(0, timeout_s=40) == 0


class _Boom(Exception):
    pass


def _worker_0_late(worker_id: int) -> None:
    """worker_init_fn: worker 0 starts after the others have sent their first items (torch keeps
    those, out of order, until worker 0's first comes)."""
    import time

    if worker_id == 0:
        time.sleep(1.0)


@pytest.mark.parametrize("stop", ["batch_map", "killed"])
@pytest.mark.parametrize("k", [3, 1])
def test_a_failed_pass_whose_error_is_kept_holds_no_lease(pool, data, tmp_path, k, stop: str) -> None:
    """A pass fails (batch_map raises at the first batch; a worker is killed) while torch's
    iterator holds another worker's items out of order, and the program keeps the exception (its
    traceback holds the loader's frame): the dead pass holds no lease of the small pool, so the
    loader's next pass is checked against the whole share and reads every sample once. Before,
    that frame's local `shutdown` (the bound method that stopped the workers) kept torch's
    iterator, and with it those items' Holds: the old session and every lease of the dead pass
    stayed until the exception went."""
    import signal

    import gdsfs.torch as gt
    from gdsfs._errors import GDSPoolWarning
    from test_settle import _record_pid

    paths, truth = data

    def boom(b):
        raise _Boom()

    def init(worker_id: int) -> None:
        _record_pid(str(tmp_path), worker_id)
        _worker_0_late(worker_id)

    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, batches_per_item=k, timeout=30, worker_init_fn=init,
                       batch_map=boom if stop == "batch_map" else None)
    err = _Boom if stop == "batch_map" else RuntimeError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSPoolWarning)
        with pytest.raises(err) as ei:
            it = iter(dl)
            next(it)  # batch_map: raises; killed: the first batch, worker 0's (worker 1's items wait in torch)
            for pid in os.listdir(tmp_path):
                os.kill(int(pid), signal.SIGKILL)
            for _b in it:
                pass
    kept = ei.value  # with its traceback
    assert kept.__traceback__ is not None
    del it
    assert pool.wait_leases(0) == 0, "the dead pass's leases are held while its exception is kept"
    dl.batch_map = None
    dl.worker_init_fn = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GDSPoolWarning)
        got = [key for b in dl for key in b["__key__"]]
    assert sorted(got) == sorted(truth)
    del kept, ei
    ds.close()
    assert pool.wait_leases(0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as another uid")
def test_a_second_user_holding_its_share_changes_nothing_for_ours(pool, data) -> None:
    """uid 10001 holds its whole 2 MiB share of the 4 MiB pool: our loader's check is by our own
    share (no error, no warning), and it reads every sample."""
    code = f"""
import sys
import gdsfs
s = gdsfs.Session({pool.mnt!r}, device=-1)
r = s.alloc({SHARE})
print("held", flush=True)
sys.stdin.read()
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = subprocess.Popen(["setpriv", "--reuid=10001", "--regid=10001", "--clear-groups", sys.executable, "-c", code],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = other.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == "held", line + other.stderr.read()  # type: ignore[union-attr]
        _reads_all_without_warning(*data)
    finally:
        other.communicate(timeout=30)
    assert pool.wait_leases(0) == 0


def test_a_read_that_gives_up_says_what_to_change(pool, data) -> None:
    """The pool full (this process holding the whole share), a READ that waits 0 s: the error names
    the share, what this process holds, the loader's settings and the mount flags."""
    import gdsfs.torch as gt
    from gdsfs import GDSUnavailableError

    paths, _truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    s = ds.session
    fd = os.open(paths[0], os.O_RDONLY)
    try:
        full = s.read(fd, [(0, SHARE - 8192)])
        with pytest.raises(GDSUnavailableError) as ei:
            s.read(fd, [(0, 64 << 10)], timeout=0)
        msg = str(ei.value)
        assert ei.value.errno == errno.EAGAIN and "\n" not in msg
        for want in ("stayed full", f"is {SHARE} bytes", "num_workers", "batch_size", "prefetch_factor", "batches_per_item",
                     "--host-pool", "--uid-share"):
            assert want in msg, (want, msg)
        s.release(full)
    finally:
        os.close(fd)
        ds.close()


# ---- the start hint shared by the ranks of one node ----------------------------------------


@pytest.mark.parametrize("local, env, want", [
    (None, None, 128 << 20),
    ("4", None, 32 << 20),  # torchrun, 4 ranks on the node: 128 MiB together
    ("8", None, 16 << 20),
    ("4", str(64 << 20), 64 << 20),  # an explicit GDSFS_START_HINT stays per process
    ("4", "0", 0),
    ("x", None, 128 << 20),  # a malformed LOCAL_WORLD_SIZE is ignored
    ("0", None, 128 << 20),
    ("-3", None, 128 << 20),
    ("2", "4M", 64 << 20),  # a malformed GDSFS_START_HINT: the default, shared
])
def test_the_start_hint_is_shared_by_the_ranks_of_a_node(pool, data, monkeypatch, local, env, want) -> None:
    import gdsfs._starthint as sh
    import gdsfs.torch as gt

    for name, v in ((sh.LOCAL_WORLD_ENV, local), (sh.START_HINT_ENV, env)):
        if v is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, v)
    assert sh.start_hint_bytes() == want
    paths, _truth = data
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    ds._main_iteration_starting(16)
    h = sh.start(ds, 2, None)
    try:
        assert (h.budget if h is not None else 0) == want
    finally:
        if h is not None:
            h.stop()
            h.thread.join(30)  # type: ignore[union-attr]
        ds.close()


def test_torch_distributed_without_torchrun_shares_the_hint_by_the_daemons_gpus(monkeypatch) -> None:
    """torch.distributed initialized without LOCAL_WORLD_SIZE (mp.spawn): the ranks of a node are
    at most its GPUs (the daemon's); a host-memory daemon (no GPU): the hint is the process's."""
    import torch.distributed as dist

    import gdsfs._starthint as sh

    monkeypatch.delenv(sh.LOCAL_WORLD_ENV, raising=False)
    monkeypatch.delenv(sh.START_HINT_ENV, raising=False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 16)
    assert sh.start_hint_bytes(devices=8) == 16 << 20
    assert sh.start_hint_bytes(devices=0) == 128 << 20
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert sh.start_hint_bytes(devices=8) == 64 << 20
