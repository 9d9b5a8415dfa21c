"""Issue 15, cold shard switch: a worker asks the kernel for its next shard's first bytes
(posix_fadvise WILLNEED on its own descriptor of the shard through the mount) while it reads the
end of its current shard, so that the disk does not sit idle while the loader consumes what the
daemon read ahead and the next shard's first READ meets the cold disk (docs/benchmarks.md,
"Cold shard switch"). Order is asserted on the calls, never on time."""

from __future__ import annotations

import os
from typing import Any

import pytest

import gdsfs
import gdsfs._dataset as gd


def _shards(mount: Any, n: int, per_shard: int, floats: int) -> tuple[list[str], set[str]]:
    import numpy as np

    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(mount, "switch")
    rng = np.random.default_rng(1515)
    paths, keys = [], set()
    for s in range(n):
        samples = [(f"s{s}_{i:04d}", {"cls": b"1", "x.npy": npy(rng.standard_normal(floats).astype(np.float32))}) for i in range(per_shard)]
        write_tar(os.path.join(src, f"shard-{s}.tar"), samples)
        paths.append(os.path.join(mnt, f"shard-{s}.tar"))
        keys.update(k for k, _ in samples)
    return paths, keys


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, int]]:
    """Records ("hint", path, bytes) for each next-shard hint and ("read", path, offset) for
    each READ of the dataset's session, in order."""
    events: list[tuple[str, str, int]] = []
    willneed = gd._willneed

    def hint(path: str, nbytes: int) -> None:
        events.append(("hint", path, nbytes))
        willneed(path, nbytes)

    read = gdsfs._core.Session.read

    def traced(self: Any, fd: Any, ranges: Any, **kw: Any) -> Any:
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        if ranges and ranges[0][1]:
            events.append(("read", path, int(ranges[0][0])))
        return read(self, fd, ranges, **kw)

    monkeypatch.setattr(gd, "_willneed", hint)
    monkeypatch.setattr(gdsfs._core.Session, "read", traced)
    return events


def _iterate(ds: Any) -> set[str]:
    seen: set[str] = set()
    for s in ds:
        assert s["__key__"] not in seen, f"{s['__key__']} delivered twice"
        seen.add(s["__key__"])
    return seen


def test_next_shard_hinted_before_its_first_read(gdsfs_mount, monkeypatch) -> None:
    # 4 shards of 48 samples of 64 KiB (3 MiB each, under the hint's window): one process
    # reads them one after the other, 16 samples at a time.
    monkeypatch.delenv(gd.NEXT_SHARD_HINT_ENV, raising=False)
    paths, keys = _shards(gdsfs_mount, 4, 48, 16384)
    events = _record(monkeypatch)
    ds = gd.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=16)
    try:
        assert _iterate(ds) == keys
    finally:
        ds.close()
    real = [os.path.realpath(p) for p in paths]
    hints = [(p, n) for (what, p, n) in events if what == "hint"]
    # Each shard after the first is hinted once, its first window (here the whole shard).
    assert [p for p, _ in hints] == [os.path.realpath(p) for p in real[1:]]
    assert all(n == min(gd.NEXT_SHARD_HINT, os.path.getsize(p)) for p, n in hints)
    for i in range(1, 4):
        at = events.index(("hint", real[i], hints[i - 1][1]))
        before = [p for (what, p, _n) in events[:at] if what == "read"]
        after = [p for (what, p, _n) in events[at:] if what == "read"]
        # Hinted while shard i-1 is read (after its first READ), before shard i's first READ.
        assert real[i - 1] in before and real[i] not in before
        assert after and after[0] == real[i - 1], "the hint goes out before the current shard's last READ"


def test_next_shard_hint_in_workers_keeps_every_sample_once(gdsfs_mount, monkeypatch) -> None:
    import gdsfs.torch as gt

    paths, keys = _shards(gdsfs_mount, 4, 40, 4096)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    seen: set[str] = set()
    try:
        for b in gt.DataLoader(ds, batch_size=8, num_workers=2):
            for k in b["__key__"]:
                assert k not in seen
                seen.add(k)
    finally:
        ds.close()
    assert seen == keys


@pytest.mark.parametrize("kw", [{"shuffle": True}, {"interleave": 2}, {"shuffle_buffer": 8}, {}], ids=["shuffle", "interleave", "buffer", "env-off"])
def test_no_next_shard_hint_where_reads_are_not_sequential(gdsfs_mount, monkeypatch, kw) -> None:
    # A shuffled or interleaved order does not read a shard from its start: its first window
    # would be bytes read much later or never soon; no hint. GDSFS_SHARD_HINT=0: none either.
    if kw:
        monkeypatch.delenv(gd.NEXT_SHARD_HINT_ENV, raising=False)
    else:
        monkeypatch.setenv(gd.NEXT_SHARD_HINT_ENV, "0")
    paths, keys = _shards(gdsfs_mount, 3, 24, 4096)
    events = _record(monkeypatch)
    ds = gd.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=8, **kw)
    try:
        assert _iterate(ds) == keys
    finally:
        ds.close()
    assert [e for e in events if e[0] == "hint"] == []


def test_resume_hints_from_the_resumed_position(gdsfs_mount, monkeypatch) -> None:
    paths, keys = _shards(gdsfs_mount, 3, 32, 4096)
    ds = gd.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=8)
    first: set[str] = set()
    it = iter(ds)
    for _ in range(40):  # into the second shard
        first.add(next(it)["__key__"])
    state = ds.state_dict()
    it.close()
    ds.close()
    monkeypatch.delenv(gd.NEXT_SHARD_HINT_ENV, raising=False)
    events = _record(monkeypatch)
    ds2 = gd.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True, read_ahead=8)
    ds2.load_state_dict(state)
    try:
        rest = _iterate(ds2)
    finally:
        ds2.close()
    assert not rest & first and rest | first == keys
    assert [os.path.basename(p) for (what, p, _n) in events if what == "hint"] == ["shard-2.tar"]
