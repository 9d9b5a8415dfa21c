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
import tempfile
import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import gdsfs
import gdsfs.torch as gt
from gdsfs import _leases

import conftest

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
        g = got.cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
        assert g.shape == want.shape and g.tobytes() == want.tobytes(), f"{key}: the bytes are not the file's"


@pytest.fixture(scope="module")
def shards(gdsfs_bin: str) -> Iterator[Shards]:
    # A mount of its own: lease counts are then about this module only.
    base = tempfile.mkdtemp(prefix="gdsfs-leases-")
    src, mnt = os.path.join(base, "src"), os.path.join(base, "mnt")
    os.mkdir(src)
    os.mkdir(mnt)
    m = conftest.mount(gdsfs_bin, src, mnt, os.path.join(base, "daemon.log"))
    try:
        yield Shards(m)
    finally:
        conftest.unmount(gdsfs_bin, mnt)


def _idle(shards: Shards) -> None:
    gc.collect()
    _leases.drain()
    assert shards.mount.wait_leases(0) == 0, shards.mount.stats()


def _wait_sessions(m: Any, most: int, timeout_s: float = 10.0) -> int:
    """Poll until the daemon counts at most `most` sessions (a session ends
    when the kernel's FUSE RELEASE arrives, shortly after the last close)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = int(m.stats()["sessions"])
        if n <= most or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


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
    before = int(shards.mount.stats()["leases"])
    ds = gt.GDSShardDataset(shards.paths[0], gpu_keys=NPY)
    samples = _take(ds, how, 16)
    gc.collect()
    _leases.drain()
    # Every sample we hold is still leased (the rest of the read-ahead
    # group, read but never yielded, went back to the pool).
    assert shards.mount.stats()["leases"] == before + len(samples)
    other_ds = gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY)
    other = iter(other_ds)
    [next(other) for _ in range(8)]  # the 8; then the rest, to reach every freed byte
    more = list(other)
    batch = gt.collate(samples).materialize()
    for i, key in enumerate(batch["__key__"]):
        shards.check(key, batch["npy"][i])
    del other, other_ds, samples, batch, ds, more
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


def test_materialize_twice_raises_naming_the_sample(shards: Shards) -> None:
    with gt.GDSShardDataset(shards.paths[0], gpu_keys=NPY) as ds:
        a, b = list(itertools.islice(ds, 2))
        shards.check(a["__key__"], a["npy"].materialize())
        with pytest.raises(gdsfs.GDSLeaseError, match=r"lease \d+ of field 'npy' of sample 'l0/0000' from '.*l-0.tar'") as ei:
            a["npy"].materialize()
        assert ei.value.key == "l0/0000" and ei.value.field == "npy" and ei.value.path == shards.paths[0]
        batch = gt.collate([b])
        batch.materialize()
        with pytest.raises(gdsfs.GDSLeaseError, match="l0/0001"):
            batch.materialize()
        # A zero-copy view owns its lease: the TensorRef is spent.
        c = next(iter(ds))
        view = c["npy"].materialize(copy=False)
        with pytest.raises(gdsfs.GDSLeaseError, match="zero-copy view"):
            c["npy"].materialize()
        del view
    _idle(shards)


def _child_reads(path: str, conn: Any) -> None:
    # A process that reads samples into its own session, hands them over
    # pickled, and exits: its session ends with it.
    ds = gt.GDSShardDataset(path, gpu_keys=NPY)
    conn.send_bytes(pickle.dumps(list(itertools.islice(ds, 4))))
    conn.close()


def test_lease_of_an_ended_session_raises_never_returns_bytes(shards: Shards) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    mine = gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY)
    warm = next(iter(mine))  # maps this uid's slabs here first
    shards.check(warm["__key__"], warm["npy"].materialize())
    r, w = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child_reads, args=(shards.paths[0], w))
    p.start()
    w.close()
    theirs = pickle.loads(r.recv_bytes())
    p.join()
    assert p.exitcode == 0
    # The child is gone, and its session with it; our reads may now land
    # in the memory its leases had.
    refill = list(itertools.islice(mine, 8))
    for s in theirs:
        with pytest.raises(gdsfs.GDSLeaseError, match=f"sample '{s['__key__']}'"):
            s["npy"].materialize()
    with pytest.raises(gdsfs.GDSLeaseError):
        gt.collate(theirs).materialize()
    for s in refill:
        shards.check(s["__key__"], s["npy"].materialize())
    mine.close()
    del theirs, refill, warm, mine
    _idle(shards)


def test_close_stops_reads_and_ends_the_session_with_its_last_holder(shards: Shards) -> None:
    m = shards.mount
    _idle(shards)
    sessions0 = int(m.stats()["sessions"])
    ds = gt.GDSShardDataset(shards.paths[2], gpu_keys=NPY)
    s = ds.session
    samples = list(itertools.islice(ds, 3))
    ds.close()
    assert s.closed
    with pytest.raises(gdsfs.GDSUnavailableError, match="session is closed"):
        with open(shards.paths[2], "rb") as f:
            s.read(f, [(0, 512)])
    copy = pickle.loads(pickle.dumps(samples[2]))  # an unpickled copy holds the lease too
    other = list(itertools.islice(gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY), 6))
    assert int(m.stats()["sessions"]) >= sessions0 + 1
    shards.check(samples[0]["__key__"], samples[0]["npy"].materialize())
    del samples
    gc.collect()
    _leases.drain()
    assert m.stats()["leases"] >= 1  # the copy still holds sample 2
    shards.check(copy["__key__"], copy["npy"].materialize())
    for o in other:
        shards.check(o["__key__"], o["npy"].materialize())
    del copy, other
    _idle(shards)
    del ds
    gc.collect()
    assert _wait_sessions(m, sessions0) <= sessions0


def test_zero_copy_view_outlives_dataset_and_tensorref(shards: Shards) -> None:
    ds = gt.GDSShardDataset(shards.paths[0], gpu_keys=NPY)
    smp = next(iter(ds))
    key = smp["__key__"]
    view = smp["npy"].materialize(copy=False)[10:]
    del smp
    ds.close()
    del ds
    gc.collect()
    _leases.drain()
    other = list(itertools.islice(gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY), 8))
    assert view.cpu().numpy().tobytes() == shards.truth[key].tobytes()[10:]
    assert shards.mount.stats()["leases"] >= 1
    for o in other:
        o["npy"].release()
    del view, other
    _idle(shards)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("loader", ["stock", "gdsfs"])
def test_abandoned_dataloader_iterator_keeps_delivered_batches(shards: Shards, loader: str) -> None:
    ds = gt.GDSShardDataset(shards.paths, gpu_keys=NPY, read_ahead=4)
    if loader == "stock":
        dl: Any = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=gt.collate)
        it = iter(dl)
        batches = [next(it), next(it)]
    else:
        # gdsfs.torch.DataLoader materializes; keep zero-copy-free batches
        # of the stock loader's kind by stopping after the first.
        dl = gt.DataLoader(ds, batch_size=4, num_workers=2)
        it = iter(dl)
        batches = [next(it)]
    del it
    gc.collect()
    ds.close()
    other = list(itertools.islice(gt.GDSShardDataset(shards.paths[2], gpu_keys=NPY), 8))
    for b in batches:
        if not b.materialized:
            b = b.materialize()
        for i, key in enumerate(b["__key__"]):
            shards.check(key, b["npy"][i])
    for o in other:
        shards.check(o["__key__"], o["npy"].materialize())
    del batches, other, dl, ds
    _idle(shards)


def test_checkpoint_loads_check_their_releases(shards: Shards, monkeypatch) -> None:
    """A load copies out of each lease, then releases it and checks the
    daemon's answer: a lease lost meanwhile (its session ended, here:
    released behind the loader's back) fails the load, never returns it."""
    import gdsfs.checkpoint as gck
    import gdsfs.safetensors as gst
    from gdsfs._ckpt import tensorio

    tensors = {"a": torch.arange(3000, dtype=torch.float32), "b": torch.ones(5, 7, dtype=torch.int16)}
    p = os.path.join(shards.mount.mnt, "leases", "ck.safetensors")
    gst.save_file(tensors, p)
    got = gst.load_file(p, device="cpu")
    assert all(torch.equal(got[k], v) for k, v in tensors.items())
    q = os.path.join(shards.mount.mnt, "leases", "ck.pt")
    gck.save(tensors, q)

    real = tensorio.DaemonMover.lease_view

    def lose_it(self: Any, ref: Any, n: int) -> torch.Tensor:
        v = real(self, ref, n)
        self._s._release_ids([ref.lease])  # as a session that ended under the load would
        return v

    monkeypatch.setattr(tensorio.DaemonMover, "lease_view", lose_it)
    with pytest.raises(gdsfs.GDSLeaseError, match="not held any more"):
        gst.load_file(p, device="cpu")
    with pytest.raises(gdsfs.GDSLeaseError, match="not held any more"):
        gck.load(q, map_location="cpu")
    monkeypatch.undo()
    _idle(shards)


def test_lease_views_keep_their_session(shards: Shards) -> None:
    """A zero-copy view the checkpoint code makes (DaemonMover.lease_view)
    keeps its session from ending while it lives."""
    from gdsfs._ckpt import tensorio

    s = gdsfs.Session(shards.mount.mnt)
    with open(shards.paths[0], "rb") as f:
        [ref] = s.read(f, [(512, 6000)])
        want = os.pread(f.fileno(), 6000, 512)
    view = tensorio.DaemonMover(s).lease_view(ref, 6000)
    s.close()
    assert s.closed and not s._ended
    other = list(itertools.islice(gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY), 8))
    assert view.cpu().numpy().tobytes() == want
    s.release([ref], check=True)
    del view
    for o in other:
        o["npy"].release()
    del other
    _idle(shards)
    assert s._ended


def test_docs_lease_ownership_example_runs(shards: Shards) -> None:
    """docs/pytorch.md's "Lease ownership" example runs as written."""
    import re
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(here, "..", "..", "docs", "pytorch.md")).read()
    section = text.split("## Lease ownership", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```python\n(.*?)```", section, re.S)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", block, shards.mount.mnt], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "as expected: gdsfs: lease" in r.stdout and "lease ownership ok" in r.stdout, r.stdout
    assert shards.mount.wait_leases(0) == 0


def test_view_of_a_repickled_sample_still_releases(shards: Shards) -> None:
    """A lease whose TensorRef died while its view lives, then came back
    (unpickled again), is still released when the view dies; releasing
    the TensorRef does not pull the memory from under the view."""
    with gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY) as ds:
        smp = next(iter(ds))
        key = smp["__key__"]
        blob = pickle.dumps(smp)
        view = smp["npy"].materialize(copy=False)
        del smp
        gc.collect()
        again = pickle.loads(blob)
        again["npy"].release()  # the view owns it: a no-op
        other = list(itertools.islice(gt.GDSShardDataset(shards.paths[2], gpu_keys=NPY), 8))
        assert view.cpu().numpy().tobytes() == shards.truth[key].tobytes()
        with pytest.raises(gdsfs.GDSLeaseError, match="zero-copy view"):
            again["npy"].materialize()
        for o in other:
            o["npy"].release()
        del view, again, other
    _idle(shards)


def test_forked_child_never_releases_its_parents_leases(shards: Shards) -> None:
    """A forked child's copies of the parent's samples are the parent's:
    collecting them there (and the child's gdsfs calls) releases nothing."""
    ds = gt.GDSShardDataset(shards.paths[0], gpu_keys=NPY)
    samples = list(itertools.islice(ds, 6))
    before = int(shards.mount.stats()["leases"])
    pid = os.fork()
    if pid == 0:  # the child: drop everything, make gdsfs calls, exit
        code = 1
        try:
            del samples[:]
            gc.collect()
            _leases.drain()
            list(itertools.islice(gt.GDSShardDataset(shards.paths[1], gpu_keys=NPY), 2))
            gc.collect()
            _leases.drain()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert int(shards.mount.stats()["leases"]) == before
    for s in samples:
        shards.check(s["__key__"], s["npy"].materialize())
    del samples, ds
    _idle(shards)


def test_exit_with_live_samples_is_quiet(shards: Shards) -> None:
    """Nothing is released at interpreter shutdown: a process that exits
    holding samples (and views) exits cleanly; its sessions end with it."""
    import subprocess
    import sys

    code = (
        "import itertools, sys, gdsfs.torch as gt\n"
        "ds = gt.GDSShardDataset(sys.argv[1], gpu_keys=['npy'])\n"
        "KEEP = list(itertools.islice(ds, 5))\n"
        "VIEW = KEEP[0]['npy'].materialize(copy=False)\n"
        "ds.close()\n"
        "print('exiting')\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(here))
    r = subprocess.run([sys.executable, "-c", code, shards.paths[2]], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "exiting" in r.stdout, r.stdout + r.stderr
    assert "Exception" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    _idle(shards)


def test_daemon_gone_raises_never_returns_bytes(gdsfs_bin: str, tmp_path: Any) -> None:
    """The daemon dies (a restart): samples read from it, whose slabs are
    still mapped here, raise GDSLeaseError instead of returning bytes."""
    import signal

    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    m = conftest.mount(gdsfs_bin, str(src), str(mnt), str(tmp_path / "daemon.log"))
    try:
        write_shard(str(src / "d.tar"), "d/", 6, seed=5)
        ds = gt.GDSShardDataset(m.path("d.tar"), gpu_keys=NPY)
        samples = list(itertools.islice(ds, 4))
        samples[0]["npy"].materialize()  # maps the slab here
        os.kill(int(m.stats()["daemon_pid"]), signal.SIGKILL)
        for s in samples[1:]:
            with pytest.raises(gdsfs.GDSLeaseError, match=f"sample '{s['__key__']}'") as ei:
                s["npy"].materialize()
            # What to do is the daemon's remount and a new pass, not reading the sample again
            # from a daemon that is gone (the hint for a lease released twice).
            msg = str(ei.value)
            assert "the gdsfs daemon exited" in msg and "gdsfs mount" in msg, msg
            assert "read the sample again" not in msg, msg
            assert "\n" not in msg, msg
        with pytest.raises(gdsfs.GDSLeaseError):
            gt.collate(samples[1:]).materialize()
        del samples, ds, s
        gc.collect()
    finally:
        conftest.unmount(gdsfs_bin, str(mnt))
