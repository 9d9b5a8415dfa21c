"""A shard rewritten in place (same path, same inode) under a running iteration: every sample
the dataset yields is byte-equal to the sample of that key in one version of the shard (its
gpu field and its CPU field from the same version: never a mix, never another sample's bytes),
and what cannot be served any more ends in one GDSShardChangedError naming the shard, with its
leases back in the pool. The backing file, read with tarfile and numpy, is the oracle."""

from __future__ import annotations

import io
import os
import tarfile
import time
from typing import Any, Callable, Iterator

import pytest

N = 48  # samples per shard


def _version(rng: Any, keys: list[str], sizes: list[int]) -> list[tuple[str, dict[str, bytes]]]:
    """Samples (key, fields): x.npy of float32 of the given element counts, txt naming the key
    and the payload's first value (so that a txt of another version or sample shows)."""
    import numpy as np

    from _wds_helpers import npy

    out = []
    for k, n in zip(keys, sizes):
        a = rng.standard_normal(n).astype(np.float32)
        out.append((k, {"txt": f"{k}:{a[0]!r}".encode(), "x.npy": npy(a)}))
    return out


def _tar_bytes(samples: list[tuple[str, dict[str, bytes]]]) -> bytes:
    from _wds_helpers import write_tar

    path = f"/tmp/shardchange-{os.getpid()}-{time.monotonic_ns()}.tar"
    write_tar(path, samples)
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.remove(path)


def _oracle(path: str) -> dict[str, tuple[bytes, str]]:
    """{key: (x payload, txt)} of the tar at path as tarfile and numpy read it."""
    import numpy as np

    out: dict[str, dict[str, Any]] = {}
    with tarfile.open(path) as tf:
        for m in tf:
            f = tf.extractfile(m)
            assert f is not None
            key, _, ext = m.name.partition(".")
            data = f.read()
            out.setdefault(key, {})[ext] = np.load(io.BytesIO(data)).tobytes() if ext == "x.npy" else data.decode()
    return {k: (v["x.npy"], v["txt"]) for k, v in out.items()}


def _old_mtime(path: str) -> None:
    """Shards are written long before they are read: an hour-old mtime (a rewrite within the
    filesystem's timestamp granularity of the first write would not show in size/mtime/ctime)."""
    t = time.time() - 3600
    os.utime(path, (t, t))


def _write_in_place(path: str, data: bytes) -> None:
    """open(p, "r+b"), write, truncate: the same inode with new contents."""
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def _keys(s: int) -> list[str]:
    return [f"s{s}_{i:03d}" for i in range(N)]


def _sizes() -> list[int]:
    return [64 * (1 + i % 5) for i in range(N)]  # 256 B .. 1.25 KiB payloads: several per 4 KiB


def _rewrites() -> dict[str, Callable[[Any, str], bytes]]:
    """How the shard at a path is changed: returns the new bytes (b"" when cut)."""

    def same_size(rng: Any, path: str) -> bytes:
        # The same members in another order (so the same size), new payloads: every old offset
        # points at another sample's bytes.
        keys = _keys(int(os.path.basename(path)[1]))
        data = _tar_bytes(_version(rng, keys[::-1], _sizes()[::-1]))
        assert len(data) == os.path.getsize(path)
        return data

    def other_size(rng: Any, path: str) -> bytes:
        keys = _keys(int(os.path.basename(path)[1]))
        return _tar_bytes(_version(rng, keys, [n + 128 for n in _sizes()]))

    def half(rng: Any, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()[: os.path.getsize(path) // 2]

    return {"same_size": same_size, "other_size": other_size, "half": half}


def _make(mount: Any, name: str, shards: int = 1, seed: int = 1) -> tuple[list[str], list[str], Any]:
    import numpy as np

    from _wds_helpers import fresh_dir, write_tar

    src, mnt = fresh_dir(mount, name)
    rng = np.random.default_rng(seed)
    backing, paths = [], []
    for s in range(shards):
        b = os.path.join(src, f"s{s}.tar")
        write_tar(b, _version(rng, _keys(s), _sizes()))
        _old_mtime(b)
        backing.append(b)
        paths.append(os.path.join(mnt, f"s{s}.tar"))
    return backing, paths, rng


def _check(samples: Iterator[tuple[str, bytes, str]], versions: list[dict[str, tuple[bytes, str]]]) -> list[str]:
    """Keys of the samples, each checked to be whole in one version."""
    seen = []
    for key, x, txt in samples:
        assert any(v.get(key) == (x, txt) for v in versions), f"sample {key!r} is in no version of its shard: txt {txt!r}"
        seen.append(key)
    return seen


def _plain(it: Iterator[Any]) -> Iterator[tuple[str, bytes, str]]:
    for s in it:
        yield s["__key__"], s["x.npy"].materialize().cpu().numpy().tobytes(), s["txt"]


def _batches(it: Iterator[Any]) -> Iterator[tuple[str, bytes, str]]:
    for b in it:
        x = b["x.npy"]
        for i, key in enumerate(b["__key__"]):
            yield key, x[i].cpu().numpy().tobytes(), b["txt"][i]


def _changed_or_consistent(run: Callable[[], list[str]], *paths: str) -> tuple[list[str], BaseException | None]:
    """run() either finishes (every sample consistent) or raises the one clear error naming
    one of the changed shards."""
    from gdsfs.torch import GDSShardChangedError

    try:
        return run(), None
    except GDSShardChangedError as e:
        msg = str(e)
        assert any(f"shard {p!r} changed while it was being read" in msg for p in paths), msg
        assert "rename" in msg, msg
        return [], e


@pytest.mark.parametrize("how", ["same_size", "other_size", "half"])
@pytest.mark.parametrize("where", ["mount", "backing"])
def test_plain_iteration_never_yields_another_version_mid_shard(gdsfs_mount, how: str, where: str) -> None:
    """Plain Python iteration; the shard rewritten after 8 of its 48 samples (3 of 6 small READ
    groups not yet read). Equal-size sample layouts make a silent wrong read possible."""
    import gdsfs.torch as gt

    backing, paths, rng = _make(gdsfs_mount, f"plain-{how}-{where}")
    old = _oracle(backing[0])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    it = iter(ds)
    got = _check(_plain(s for _, s in zip(range(8), it)), [old])
    data = _rewrites()[how](rng, backing[0])
    _write_in_place(paths[0] if where == "mount" else backing[0], data)
    versions = [old] + ([_oracle(backing[0])] if how != "half" else [])
    rest, err = _changed_or_consistent(lambda: _check(_plain(it), versions), paths[0])
    got += rest
    assert len(got) == len(set(got)), "a sample was yielded twice"
    # A shard cut to half or relaid mid-shard cannot be served exactly once: the error.
    assert err is not None, f"{len(got)} samples after a {how} rewrite, no error"
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("where", ["mount", "backing"])
def test_a_dataloader_with_workers_never_yields_another_version(gdsfs_mount, where: str) -> None:
    """Two workers, one shard each; both shards relaid (same size) after the first batch. One
    batch per worker item: with the default k (8 batches of these small samples) a worker's first
    item is 32 of its shard's samples read at once, and whether the rest is read before the
    rewrite is a race (CI saw all 96 samples read from the old version, no error to assert)."""
    import gdsfs.torch as gt

    backing, paths, rng = _make(gdsfs_mount, f"dl-{where}", shards=2)
    old = [_oracle(b) for b in backing]
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=4, strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=1, batches_per_item=1)
    it = iter(dl)
    got = _check(_batches(b for _, b in zip(range(1), it)), old)
    for s in range(2):
        data = _rewrites()["same_size"](rng, backing[s])
        _write_in_place(paths[s] if where == "mount" else backing[s], data)
    new = [_oracle(b) for b in backing]
    rest, err = _changed_or_consistent(lambda: _check(_batches(it), old + new), *paths)
    if err is None:
        pytest.fail(f"{len(got) + len(rest)} samples after both shards were relaid, no error")
    it = dl = None  # the workers stop
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_shard_rewritten_before_its_first_read_is_planned_anew(gdsfs_mount) -> None:
    """Shard 1 is rewritten (same sample count, another layout) while shard 0 is read: none
    of its samples was yielded yet, so it is planned again from its new index, and every one of
    its samples arrives once with the new version's bytes; no error."""
    import gdsfs.torch as gt

    backing, paths, rng = _make(gdsfs_mount, "boundary", shards=2)
    old0 = _oracle(backing[0])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    it = iter(ds)
    got = _check(_plain(s for _, s in zip(range(8), it)), [old0])
    _write_in_place(backing[1], _rewrites()["same_size"](rng, backing[1]))
    new1 = _oracle(backing[1])
    got += _check(_plain(it), [old0, new1])
    assert sorted(got) == sorted(_keys(0) + _keys(1))
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_resume_after_the_error_is_exact(gdsfs_mount) -> None:
    """The error leaves state_dict() at what was yielded; a new dataset resumed from it reads
    the rest of the epoch (from the new version), each position once."""
    import gdsfs.torch as gt

    backing, paths, rng = _make(gdsfs_mount, "resume")
    old = _oracle(backing[0])
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    it = iter(ds)
    got = _check(_plain(s for _, s in zip(range(8), it)), [old])
    _write_in_place(backing[0], _rewrites()["same_size"](rng, backing[0]))
    new = _oracle(backing[0])
    rest, err = _changed_or_consistent(lambda: _check(_plain(it), [old, new]), paths[0])
    assert err is not None
    got += rest
    state = ds.state_dict()
    assert state["consumed"] == {0: len(got)}
    ds.close()
    ds2 = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    ds2.load_state_dict(state)
    after = _check(_plain(iter(ds2)), [new])
    assert len(got) + len(after) == N
    ds2.close()
    assert gdsfs_mount.wait_leases(0) == 0


@pytest.mark.parametrize("how", ["same_size", "half"])
def test_off_a_mount_plain_reads_see_the_change_too(tmp_path, how: str) -> None:
    """Shards on a plain directory (the fallback: every field read with pread): the worker
    fstat()s the shard after each group's reads, so a rewrite mid-shard is the same error."""
    import warnings

    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import write_tar

    rng = np.random.default_rng(3)
    p = str(tmp_path / "s0.tar")
    write_tar(p, _version(rng, _keys(0), _sizes()))
    _old_mtime(p)
    old = _oracle(p)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GDSFallbackWarning: not on a mount
        ds = gt.GDSShardDataset(p, gpu_keys=["x.npy"], read_ahead=8)
    assert ds.session is None
    it = iter(ds)
    got = _check(((s["__key__"], s["x.npy"].cpu().numpy().tobytes(), s["txt"]) for _, s in zip(range(8), it)), [old])
    _write_in_place(p, _rewrites()[how](rng, p))
    versions = [old] + ([_oracle(p)] if how != "half" else [])
    rest, err = _changed_or_consistent(lambda: _check(((s["__key__"], s["x.npy"].cpu().numpy().tobytes(), s["txt"]) for s in it), versions), p)
    assert err is not None, f"{len(got) + len(rest)} samples after a {how} rewrite, no error"
    ds.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_shard_with_another_sample_count_before_the_epoch_is_the_error(gdsfs_mount, workers: int) -> None:
    """The epoch's plan counts each shard's samples at construction; a shard rewritten before
    the iteration with more samples cannot be planned anew exactly once: the one error, before
    any of its samples (and no IndexError or sample of the wrong position)."""
    import gdsfs.torch as gt
    from gdsfs.torch import GDSShardChangedError

    backing, paths, rng = _make(gdsfs_mount, f"count-{workers}")
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    more = _keys(0) + [f"s0_x{i:03d}" for i in range(8)]
    _write_in_place(backing[0], _tar_bytes(_version(rng, more, [64] * len(more))))
    with pytest.raises(GDSShardChangedError, match="changed while it was being read"):
        for _ in gt.DataLoader(ds, batch_size=4, num_workers=workers):
            pytest.fail("a batch of a shard whose sample count changed")
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_read_that_fails_in_a_later_chunk_keeps_no_lease(gdsfs_mount) -> None:
    """Session.read splits ranges into READs of at most max_ranges: when a later READ fails
    (here a range past the end, as a shard cut short gives), the leases of the earlier READs
    of the call go back too: all or nothing, as one READ."""
    import gdsfs
    from gdsfs import GDSUnavailableError
    from _wds_helpers import fresh_dir

    src, mnt = fresh_dir(gdsfs_mount, "chunks")
    with open(os.path.join(src, "f.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))
    s = gdsfs.Session(mnt, device=-1)
    try:
        fd = os.open(os.path.join(mnt, "f.bin"), os.O_RDONLY)
        ranges = [(i * 4096, 100) for i in range(s.hello.max_ranges)] + [(2 << 20, 100)]
        with pytest.raises(GDSUnavailableError):
            s.read(fd, ranges)
        os.close(fd)
        assert int(gdsfs_mount.stats()["leases"]) == 0
    finally:
        s.close()
    assert gdsfs_mount.wait_leases(0) == 0
