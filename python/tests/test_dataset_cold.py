"""Issue 15, cold: small samples read with the page cache dropped. The daemon reads ahead of a
worker's sequential READs (ctlserver/readahead.go); every sample must still arrive once with
the backing file's bytes, also after the file was rewritten in place behind the mount."""

from __future__ import annotations

import io
import os
import tarfile

import gdsfs


def _drop(paths: list[str]) -> None:
    """Drops these files' pages from the page cache (this test's files only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _backing_samples(paths: list[str]) -> dict[str, bytes]:
    """Each sample's x.npy payload as the backing tar holds it (tarfile and numpy: the oracle)."""
    import numpy as np

    out: dict[str, bytes] = {}
    for p in paths:
        with tarfile.open(p) as tf:
            for m in tf:
                if m.name.endswith(".x.npy"):
                    f = tf.extractfile(m)
                    assert f is not None
                    out[m.name[: -len(".x.npy")]] = np.load(io.BytesIO(f.read())).tobytes()
    return out


def _pass(paths: list[str], workers: int) -> dict[str, bytes]:
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    seen: dict[str, bytes] = {}
    for b in gt.DataLoader(ds, batch_size=16, num_workers=workers):
        x = b["x.npy"]
        for i, key in enumerate(b["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = x[i].cpu().numpy().tobytes()
    ds.close()
    return seen


def _counters(path: str) -> dict[str, int]:
    c = gdsfs.status(path)["counters"]
    return {k: int(c.get(k, 0)) for k in ("readaheads", "readahead_bytes", "readahead_dropped")}


def test_cold_small_samples_arrive_once_with_the_files_bytes(gdsfs_mount, monkeypatch) -> None:
    import numpy as np

    # The daemon's own readahead is asserted on: the loader's start hint (which would read each
    # worker's first bytes, here its whole shard, ahead of it) off.
    monkeypatch.setenv("GDSFS_START_HINT", "0")

    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "cold")
    rng = np.random.default_rng(151)
    backing, paths = [], []
    for s in range(2):  # 2 shards of 1,200 samples of 16 KiB: about 21 MiB each
        samples = [(f"c{s}_{i:05d}", {"cls": str(i % 10).encode(), "x.npy": npy(rng.standard_normal(4096).astype(np.float32))}) for i in range(1200)]
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        backing.append(os.path.join(src, f"shard-{s}.tar"))
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
    truth = _backing_samples(backing)
    _pass(paths[:1], 0)  # the daemon parses the indexes (reading every tar header) first

    _drop(backing + paths)
    before = _counters(paths[0])
    assert _pass(paths, 2) == truth
    after = _counters(paths[0])
    # Each worker READ its shard from the start, one batch after the other: the daemon read
    # ahead of them (windows growing to well past the kernel's own readahead).
    assert after["readaheads"] > before["readaheads"], (before, after)
    assert after["readahead_bytes"] > before["readahead_bytes"], (before, after)

    # Rewritten in place behind the mount (new payloads, same layout) while the old bytes, read
    # ahead, may still be cached: readahead is only a hint, the READs return the new bytes.
    new: dict[str, bytes] = {}
    with open(backing[0], "r+b") as f, tarfile.open(backing[0]) as tf:
        for m in tf:
            if m.name.endswith(".x.npy"):
                a = rng.standard_normal(4096).astype(np.float32)
                raw = npy(a)
                assert len(raw) == m.size
                f.seek(m.offset_data)
                f.write(raw)
                new[m.name[: -len(".x.npy")]] = a.tobytes()
    want = dict(truth, **new)
    assert _backing_samples(backing) == want
    assert _pass(paths, 2) == want
    # And cold again, the rewritten file's pages dropped.
    _drop(backing + paths)
    assert _pass(paths, 2) == want
    assert gdsfs_mount.wait_leases(0) == 0


def _record_pid(piddir: str, _worker_id: int) -> None:
    open(os.path.join(piddir, str(os.getpid())), "w").close()


def _storage_reads(pid: int) -> int:
    """Bytes process pid had the storage layer read for it (/proc/PID/io read_bytes)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("read_bytes:"))


def test_cold_workers_leave_the_disk_to_the_daemon(gdsfs_mount, tmp_path) -> None:
    """A cold pass of small samples with a small CPU field (a WebDataset .cls): each group's
    READ goes before its CPU fields' preads, so the disk sees the READs' large ranges (and the
    daemon's readahead after them), and the workers' preads find the bytes cached; the other
    order sent one synchronous 4 KiB read per sample to the disk from the workers themselves
    (kernel FUSE passthrough reads in the reader's process), ahead of every READ of a cold
    stretch."""
    import functools

    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir, npy, write_tar

    pt = gdsfs.status(gdsfs_mount.mnt).get("passthrough") or {}
    if not pt.get("enabled"):
        import pytest

        pytest.skip("no kernel FUSE passthrough: the workers' preads are the daemon's reads either way")
    src, mnt = fresh_dir(gdsfs_mount, "cold-cpu")
    rng = np.random.default_rng(152)
    backing, paths = [], []
    for s in range(2):  # 2 shards of 256 samples of 64 KiB: about 16 MiB each
        samples = [(f"p{s}_{i:05d}", {"cls": str(i % 10).encode(), "x.npy": npy(rng.standard_normal(16384).astype(np.float32))}) for i in range(256)]
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        backing.append(os.path.join(src, f"shard-{s}.tar"))
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
    truth = _backing_samples(backing)
    _pass(paths[:1], 0)  # the daemon parses the indexes first
    _drop(backing + paths)
    piddir = tmp_path / "pids"
    piddir.mkdir()
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=16, num_workers=2, persistent_workers=True, worker_init_fn=functools.partial(_record_pid, str(piddir)))
    seen: dict[str, bytes] = {}
    cls: dict[str, int] = {}
    for b in dl:
        for i, key in enumerate(b["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen[key] = b["x.npy"][i].cpu().numpy().tobytes()
            cls[key] = int(b["cls"][i])
    pids = [int(p) for p in os.listdir(piddir)]
    assert len(pids) == 2
    own = {pid: _storage_reads(pid) for pid in pids}  # the workers are still alive (persistent)
    del dl
    ds.close()
    assert seen == truth
    assert all(cls[k] == int(k.rsplit("_", 1)[1]) % 10 for k in cls)
    # 512 samples: the other order read 4 KiB per sample of a cold stretch (the first READ
    # group of each shard, 64 samples, at least: 512 KiB). Now at most a page or two per shard
    # (a batch's first .cls lies before its range).
    assert sum(own.values()) <= 64 << 10, own
    assert gdsfs_mount.wait_leases(0) == 0
