"""Issue 15 at 16 KiB: gdsfs.torch.DataLoader's workers send k batches per torch item
(batches_per_item; chosen from the batch's bytes by default) and its loop materializes them back to
back, then yields them one by one. What the user sees stays: the same batches (batch_size samples,
each worker's last one short unless drop_last), len() exact, every sample exactly once, resume exact
after any batch of an item, and every lease back after islice, break, close(), an exception in the
loop or a killed worker (the daemon's STATUS and this process's Holds as the oracles). What changes
is documented: the order between workers goes round-robin per k batches instead of per batch."""

from __future__ import annotations

import functools
import itertools
import os
import signal
import warnings

import pytest

import _lease_diag
from test_settle import _held_here, _record_pid, _shards


def _slot(b) -> int:
    """The worker (slot) a batch came from: the one slot of its resume progress."""
    (slot,) = b.progress
    return slot


def _runs(batches) -> list[int]:
    """Lengths of the runs of consecutive batches from one worker."""
    return [len(list(g)) for _s, g in itertools.groupby(_slot(b) for b in batches)]


def _loader(ds, **kw):
    import gdsfs.torch as gt

    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    kw.setdefault("timeout", 60)
    return gt.DataLoader(ds, **kw)


@pytest.fixture(scope="module")
def small(gdsfs_mount):
    """3 shards of 41 samples of 16 KiB: 123 samples, 62 and 61 per worker, batches of 4 leave
    each worker a short last batch."""
    return _shards(gdsfs_mount, "kbatch-small", per=41)


@pytest.mark.parametrize("k", [1, 3, None])
def test_a_pass_is_every_sample_once_in_the_same_batches(gdsfs_mount, small, k) -> None:
    """batches_per_item=k (None: chosen, 8 here: a batch of 4 x 16 KiB is small): the batches are
    the same as with one batch per item (batch_size samples, each worker's last one short), len()
    is exact, every sample comes once, batch_map sees each batch; the order between workers goes
    round-robin per k batches."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    mapped = []
    dl = _loader(ds, batches_per_item=k, batch_map=lambda b: mapped.append(b) or b)
    got = list(dl)
    assert [id(b) for b in mapped] == [id(b) for b in got], "batch_map runs once per batch, in order"
    per_slot: dict[int, list[tuple[str, ...]]] = {}
    seen: dict[str, bytes] = {}
    for b in got:
        assert b._pending is None and b.materialized
        per_slot.setdefault(_slot(b), []).append(tuple(b["__key__"]))
        for i, key in enumerate(b["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
    assert seen == truth
    assert len(got) == len(dl) == 16 + 16
    for slot, bs in per_slot.items():
        assert [len(x) for x in bs] == [4] * (len(bs) - 1) + [len(bs[-1])], (slot, [len(x) for x in bs])
    # Each worker's 16 batches come in items of k (its last item shorter), round-robin per item.
    want = {1: 1, 3: 3, None: 8}[k]
    assert _runs(got) == _expected_runs(16, 16, want), _runs(got)
    mapped.clear()
    del got, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def _expected_runs(n0: int, n1: int, k: int) -> list[int]:
    """Run lengths of two workers' batches (n0 and n1 of them) sent k per item, round-robin per
    item (a worker out of items is skipped)."""
    a = [min(k, n0 - i) for i in range(0, n0, k)]
    b = [min(k, n1 - i) for i in range(0, n1, k)]
    order = [(w, r) for x, y in itertools.zip_longest(a, b) for w, r in ((0, x), (1, y)) if r]
    out: list[list[int]] = []
    for w, r in order:
        if out and out[-1][0] == w:
            out[-1][1] += r
        else:
            out.append([w, r])
    return [r for _w, r in out]


def test_prefetch_counts_items_so_batches_in_flight_stay(gdsfs_mount, small) -> None:
    """prefetch_factor counts batches: with k per item torch is asked for ceil(prefetch_factor / k)
    items per worker (at least one), so about as many batches wait as with one per item; the
    loader's own settings read as given. Persistent workers keep k over epochs, every sample once."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    for k, pf, items in ((1, 2, 2), (2, 4, 2), (3, 4, 2), (4, 2, 1)):
        dl = _loader(ds, batches_per_item=k, prefetch_factor=pf, persistent_workers=True)
        for _epoch in range(2):
            got = list(dl)
            assert sorted(x for b in got for x in b["__key__"]) == sorted(truth)
            assert len(got) == len(dl) == 32 and _runs(got) == _expected_runs(16, 16, k)
        assert dl._iterator._prefetch_factor == items, (k, pf, dl._iterator._prefetch_factor)
        assert dl.prefetch_factor == pf and dl.drop_last is False and dl.collate_fn is gt.collate and dl.batch_size == 4
        dl._iterator._shutdown_workers()
        del dl, got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_large_batches_keep_one_batch_per_item(gdsfs_mount) -> None:
    """The default chooses k from the batch's bytes: batches of 8 samples of an eighth of
    KBATCH_BYTES (16 MiB) stay one per item, round-robin per batch as before."""
    from gdsfs import _tensors
    import gdsfs.torch as gt

    paths, truth = _shards(gdsfs_mount, "kbatch-large", nshards=2, per=12, nbytes=_tensors.KBATCH_BYTES // 8)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    got = list(_loader(ds, batch_size=8))
    assert _runs(got) == _expected_runs(2, 2, 1)
    assert sorted(k for b in got for k in b["__key__"]) == sorted(truth)
    del got
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("k", [1, 3, None])
def test_drop_last_drops_only_each_workers_short_batch(gdsfs_mount, small, k) -> None:
    """drop_last with k per item: each worker's full batches, its short last one dropped (not the
    whole last item), len() exact."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = _loader(ds, batches_per_item=k, drop_last=True)
    got = [tuple(b["__key__"]) for b in dl]
    assert len(got) == len(dl) == 15 + 15
    assert all(len(x) == 4 for x in got)
    assert len(set(itertools.chain(*got))) == 120
    ref = {tuple(b["__key__"]) for b in _loader(ds, batches_per_item=1, drop_last=True)}
    assert set(got) == ref
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("after", [1, 4, 6, 9])
@pytest.mark.parametrize("k,k2", [(3, 3), (3, 1), (1, 3), (None, None)])
def test_resume_after_any_batch_of_an_item(gdsfs_mount, small, k, k2, after: int) -> None:
    """A state taken after `after` batches (mid-item or at an item's end: items of 3 or 8) resumes
    at the next batch of each worker, also with another batches_per_item: per worker, the batches
    before and after together are exactly an uninterrupted pass's."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    full: dict[int, list[tuple[str, ...]]] = {}
    for b in _loader(ds, batches_per_item=1):
        full.setdefault(_slot(b), []).append(tuple(b["__key__"]))
    dl = _loader(ds, batches_per_item=k)
    before: dict[int, list[tuple[str, ...]]] = {}
    for b in itertools.islice(dl, after):
        before.setdefault(_slot(b), []).append(tuple(b["__key__"]))
    state = dl.state_dict()
    del b
    ds.close()
    ds2 = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl2 = _loader(ds2, batches_per_item=k2)
    dl2.load_state_dict(state)
    n_left = len(dl2)
    after_: dict[int, list[tuple[str, ...]]] = {}
    for b in dl2:
        after_.setdefault(_slot(b), []).append(tuple(b["__key__"]))
    assert sum(len(v) for v in after_.values()) == n_left == 32 - after
    for slot, bs in full.items():
        assert before.get(slot, []) + after_.get(slot, []) == bs, slot
    del b
    ds2.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("how", ["loader", "dataset"])
@pytest.mark.parametrize("k", [3, 1])
def test_a_state_loaded_while_persistent_workers_run_resumes_exactly(gdsfs_mount, small, k, how: str) -> None:
    """persistent_workers=True, a pass stopped mid-item (5 batches, items of 3), its state loaded
    back into the same loader (or its dataset) and the loader iterated again: the next pass
    resumes at the state, each worker at its next batch, every sample of the epoch exactly once
    with the ones before. Before, the running workers kept the resume point of their fork (none)
    and started the epoch over: the 20 samples before the state came again (while the loader's
    own count started at the state); now the loader starts fresh workers at it, and the old
    ones' leases go back."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = _loader(ds, batches_per_item=k, persistent_workers=True)
    it = iter(dl)
    before = [key for b in itertools.islice(it, 5) for key in b["__key__"]]
    state = dl.state_dict()
    del it
    (dl if how == "loader" else ds).load_state_dict(state)
    after = [key for b in dl for key in b["__key__"]]
    assert len(before) == 20 and sorted(before + after) == sorted(truth)
    # The next epoch of the same loader: every sample once again, in the running workers.
    ds.set_epoch(1)
    again = [key for b in dl for key in b["__key__"]]
    assert sorted(again) == sorted(truth)
    del dl
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


class _Boom(Exception):
    pass


@pytest.fixture(scope="module")
def small_batches(gdsfs_mount, small) -> dict[int, list[tuple[str, ...]]]:
    """Per worker (slot), the keys of its batches of 4 in an uninterrupted pass of `small`."""
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(small[0], gpu_keys=["x.npy"], strict=True)
    out: dict[int, list[tuple[str, ...]]] = {}
    for b in _loader(ds, batches_per_item=1):
        out.setdefault(_slot(b), []).append(tuple(b["__key__"]))
    ds.close()
    return out


def _item_keys(full: dict[int, list[tuple[str, ...]]], got, k: int = 4) -> set[str]:
    """The samples of the item of k batches got[0] came in (its worker's first item)."""
    slot = _slot(got[0])
    keys = set(itertools.chain(*full[slot][:k]))
    assert set(got[0]["__key__"]) <= keys and set(got[1]["__key__"]) <= keys
    return keys


def _held_samples() -> set[str]:
    from gdsfs import _leases

    return {sample for _lease, state, _f, sample, _p in _leases.live() if state == "held"}


@pytest.mark.parametrize("stop", ["islice", "break", "close", "raise", "kill"])
def test_stopping_mid_item_returns_every_lease(gdsfs_mount, small, small_batches, tmp_path, stop: str) -> None:
    """Stopped after 2 batches of an item of 4 (islice, break, close() of the iterator, an
    exception in the loop's body, a killed worker): no lease of a batch yielded or materialized
    ahead is held here, and once the dataset is closed the daemon holds none."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = _loader(ds, batches_per_item=4, worker_init_fn=functools.partial(_record_pid, str(tmp_path)))
    it = iter(dl)
    got = []
    if stop == "islice":
        got = list(itertools.islice(it, 2))
        assert not _held_samples() & _item_keys(small_batches, got), "a lease of a batch materialized ahead is still held"
        it.close()
    elif stop == "break":
        for b in it:
            got.append(b)
            if len(got) == 2:
                break
        assert not _held_samples() & _item_keys(small_batches, got), "a lease of a batch materialized ahead is still held"
        del b
    elif stop == "close":
        got = [next(it), next(it)]
        it.close()
    elif stop == "raise":
        with pytest.raises(_Boom):
            for b in it:
                got.append(b)
                if len(got) == 2:
                    raise _Boom()
        del b
    else:
        got = list(itertools.islice(it, 2))
        for pid in os.listdir(tmp_path):
            os.kill(int(pid), signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) [0-9, ]+\) exited unexpectedly|killed by signal"):
            for b in it:
                got.append(b)
        # The batches of the item it was in come first: then the dead worker's error.
    assert len(got) >= 2 and _runs(got[:2]) == [2]
    for b in got:
        assert b._pending is None
        for i, key in enumerate(b["__key__"]):
            assert b["x.npy"][i].cpu().numpy().tobytes() == truth[key]
    # Out-of-order items torch's iterator took from the workers and keeps (not ours to release
    # before the iterator goes) may hold leases here; those of the item the loop was in do not.
    assert not _held_samples() & _item_keys(small_batches, got)
    del it, got, b
    ds.close()
    n = gdsfs_mount.wait_leases(0)
    assert n == 0, _lease_diag.report(gdsfs_mount)


def _raw_item(mount, name: str, n: int = 3, per: int = 4):
    """An item of n collated batches of per samples straight from the dataset (no workers)."""
    import gdsfs.torch as gt
    from gdsfs import _tensors

    paths, truth = _shards(mount, name, nshards=1, per=n * per)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=n * per)
    samples = list(ds)
    return ds, _tensors._Batches(gt.collate(samples[i : i + per]) for i in range(0, n * per, per)), truth


@pytest.mark.parametrize("how", ["daemon", "here"])
def test_a_lost_lease_mid_item_yields_the_batches_before_and_returns_the_rest(gdsfs_mount, how: str) -> None:
    """Plain Python iteration of settled() over one item of 3 batches whose second lost its lease
    (behind the session's back: its settle fails; or released here: its materialize fails): the
    first is yielded, then GDSLeaseError; the third batch's leases (never materialized, in the
    second case) return."""
    import gdsfs
    from gdsfs import _tensors

    ds, item, truth = _raw_item(gdsfs_mount, f"kbatch-lost-{how}")
    if how == "daemon":
        ds.session._release_ids([r.lease for r in item[1]["x.npy"].leases])
    else:
        item[1].release()
    third = {r.lease for r in item[2]["x.npy"].leases}
    mine = {r.lease for b in item for r in b["x.npy"].leases}
    got = []
    with pytest.raises(gdsfs.GDSLeaseError):
        for b in _tensors.settled(iter([item]), ready=lambda: False):
            got.append(b)
    assert len(got) == 1 and [b["x.npy"][0].cpu().numpy().tobytes() for b in got] == [truth[got[0]["__key__"][0]]]
    assert not (third & _held_here()), "the unmaterialized batch's leases are still held"
    assert not (mine & _held_here()), "a lease of the item is still held"
    del item, got, b
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("stop", ["islice", "close", "del"])
def test_settled_items_stopped_midway_return_every_lease(gdsfs_mount, stop: str) -> None:
    """Plain Python iteration of settled() over one item of 3 batches, stopped after one: the
    two materialized ahead hold no lease, and nothing is left once the dataset closes."""
    from gdsfs import _tensors

    ds, item, truth = _raw_item(gdsfs_mount, "kbatch-drop")
    mine = {r.lease for b in item for r in b["x.npy"].leases}
    gen = _tensors.settled(iter([item]), ready=lambda: False)
    got = list(itertools.islice(gen, 1))
    assert not (mine & _held_here()), "batches materialized ahead still hold their leases"
    assert [got[0]["x.npy"][i].cpu().numpy().tobytes() for i in range(4)] == [truth[k] for k in got[0]["__key__"]]
    if stop == "del":
        del gen
    else:
        gen.close()
    del item, got
    ds.close()
    n = gdsfs_mount.wait_leases(0)
    assert n == 0, _lease_diag.report(gdsfs_mount)


def _plain_collate(samples):
    return [s["__key__"] for s in samples]


def test_other_collate_and_batch_size_none_are_untouched(gdsfs_mount, small) -> None:
    """batches_per_item applies only to gdsfs.torch.collate batches: a collate_fn of the user's
    gets batch_size samples per call and its items come round-robin per batch; batch_size=None
    yields samples one by one."""
    import gdsfs.torch as gt

    paths, truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    got = list(_loader(ds, batches_per_item=4, collate_fn=_plain_collate))
    assert all(isinstance(x, list) and 1 <= len(x) <= 4 for x in got)
    assert sorted(itertools.chain(*got)) == sorted(truth) and len(got) == 32
    one = list(_loader(ds, batches_per_item=4, batch_size=None))
    assert len(one) == len(truth) and sorted(s["__key__"] for s in one) == sorted(truth)
    del one
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4", True])
def test_a_bad_batches_per_item_says_what_to_pass(gdsfs_mount, small, bad) -> None:
    import gdsfs.torch as gt

    paths, _truth = small
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    with pytest.raises(ValueError, match=r"batches_per_item=.* is not a whole number >= 1"):
        gt.DataLoader(ds, batch_size=4, num_workers=2, batches_per_item=bad)
    ds.close()


@pytest.fixture(scope="module")
def small_pool(gdsfs_bin, tmp_path_factory):
    """A mount whose host pool (4 MiB of 1 MiB slabs, all of it this uid's) holds what 2 workers
    keep in flight at one batch of 16 x 16 KiB per item, not what they would at 7."""
    yield from _host_pool_mount(gdsfs_bin, tmp_path_factory, "kbatch-pool", "4MiB")


def _pass_keys(dl, truth: dict[str, bytes]) -> list[str]:
    """The keys of one full pass of dl, each sample's x.npy bytes checked against truth; no batch
    is kept past the pass (their leases go with them)."""
    seen: list[str] = []
    for b in dl:
        for i, key in enumerate(b["__key__"]):
            assert b["x.npy"][i].cpu().numpy().tobytes() == truth[key]
        seen.extend(b["__key__"])
        del b
    return seen


def _host_pool_mount(gdsfs_bin, tmp_path_factory, name: str, size: str):
    """A mount of its own whose host pool is `size` of 1 MiB slabs, all of it this uid's."""
    import conftest

    base = tmp_path_factory.mktemp(name)
    src, mnt = base / "src", base / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = conftest.mount(gdsfs_bin, str(src), str(mnt), str(base / "daemon.log"), "--host-pool", size, "--slab-size", "1MiB", "--uid-share", "100%")
    try:
        yield m
    finally:
        conftest.unmount(gdsfs_bin, m.mnt)


def test_the_default_k_fits_a_pool_that_one_batch_per_item_fits(small_pool) -> None:
    """A loader that works at batches_per_item=1 on a small pool works at the default too (its k
    bounded by the uid's share of the pool), instead of every worker waiting for pool space that
    the items the loop waits for hold (a timeout, a hang without one)."""
    import gdsfs.torch as gt

    paths, truth = _shards(small_pool, "kbatch-pool", nshards=8, per=64)
    for k in (1, None):
        ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
        dl = _loader(ds, batch_size=16, batches_per_item=k, timeout=20)
        assert sorted(_pass_keys(dl, truth)) == sorted(truth), k
        ds.close()
    assert small_pool.wait_leases(0) == 0


@pytest.fixture(scope="module")
def mid_pool(gdsfs_bin, tmp_path_factory):
    """A mount whose host pool (32 MiB of 1 MiB slabs, all of it this uid's) lets the default k be
    8 for batches of 16 x 16 KiB (2 workers: 8 batches in flight each fit a quarter of it)."""
    yield from _host_pool_mount(gdsfs_bin, tmp_path_factory, "kbatch-midpool", "32MiB")


@pytest.mark.parametrize("held,batch", [(28, 16), (24, 32)])
def test_the_default_k_fits_what_this_process_leaves_of_the_share(mid_pool, held: int, batch: int) -> None:
    """The program already holds most of its share (samples of another dataset it keeps: 28 or
    24 of its 32 MiB), then starts a loader of 2 workers, batches of 16 (or 32) x 16 KiB. At
    batches_per_item=1 it runs without a word; the default k runs the same way (a k low enough
    for the room left), instead of a GDSPoolError ("can hang", which names no batches_per_item
    to pass, since the user set none) or a GDSPoolWarning that batches_per_item=1 does not get:
    the default bounded k by a quarter of the whole share, the check by what this process
    leaves of it."""
    import numpy as np

    import gdsfs.torch as gt
    from gdsfs import _leases
    from gdsfs._errors import GDSPoolWarning
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(mid_pool, f"kbatch-held-{held}-{batch}")
    write_tar(os.path.join(src, "big.tar"), [(f"big{i}", {"x.npy": npy(np.zeros((1 << 20) // 4 - 32, np.float32))}) for i in range(held)])
    big = gt.GDSShardDataset([os.path.join(mnt, "big.tar")], gpu_keys=["x.npy"], strict=True, read_ahead=1)
    g = iter(big)
    kept = list(itertools.islice(g, held))  # one 1 MiB slab each, held while kept
    paths, truth = _shards(mid_pool, f"kbatch-held-data-{held}-{batch}", nshards=3, per=200)
    try:
        assert _leases.held_bytes(mid_pool.mnt, -1) >= held << 20
        for k in (1, None):
            with gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True) as ds:
                dl = _loader(ds, batch_size=batch, batches_per_item=k, timeout=20)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", GDSPoolWarning)
                    seen = _pass_keys(dl, truth)
                assert sorted(seen) == sorted(truth), k
                if k is None:  # lowered from the default's bound by the whole share (8 and 7)
                    assert 1 <= dl._kbatch < {16: 8, 32: 7}[batch], dl._kbatch
    finally:
        del kept
        g.close()
        big.close()
    assert mid_pool.wait_leases(0) == 0


@pytest.mark.parametrize("k", [1, 3])
def test_timeout_keeps_counting_per_batch(gdsfs_mount, small, k) -> None:
    """timeout= is the most a batch may take to come from the workers (torch's own words): with
    k batches per item, torch waits for each item k times as long (a worker makes k batches for
    it), so a loader whose batches each came in time does not time out at the default k; the
    loader's own timeout is unchanged."""
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(small[0], gpu_keys=["x.npy"], strict=True)
    dl = _loader(ds, batches_per_item=k, timeout=7)
    it = dl._get_iterator()
    try:
        assert it._timeout == 7 * k and dl.timeout == 7
    finally:
        it._shutdown_workers()
        del it
        ds.close()
