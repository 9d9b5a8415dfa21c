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


def test_cold_small_samples_arrive_once_with_the_files_bytes(gdsfs_mount) -> None:
    import numpy as np

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
