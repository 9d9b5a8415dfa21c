"""A shard rewritten in place between a group's READ and its CPU fields' preads (the window the
READ-first order opened): the READ's own check has passed, the preads read the new bytes, and
only the version check after them stands between the group and a sample whose gpu field is of
one version and whose txt is of another. The rewrite is made from inside Session.read, right
after the group's data READ returns, so the window is hit on every run."""

from __future__ import annotations

import os

import pytest

from test_dataset_shardchange import _changed_or_consistent, _check, _make, _oracle, _plain, _rewrites, _write_in_place


@pytest.mark.parametrize("how", ["same_size", "other_size"])
def test_a_rewrite_between_the_read_and_the_preads_is_caught(gdsfs_mount, monkeypatch, how: str) -> None:
    import gdsfs._core as core
    import gdsfs.torch as gt

    backing, paths, rng = _make(gdsfs_mount, f"window-{how}")
    old = _oracle(backing[0])
    data = _rewrites()[how](rng, backing[0])
    real = core.Session.read
    reads: list[list[tuple[int, int]]] = []

    def read(self, fd, ranges, **kw):
        got = real(self, fd, ranges, **kw)
        reads.append(list(ranges))
        if [any(n for _, n in r) for r in reads].count(True) == 2 and any(n for _, n in ranges):
            # The second group's data READ has passed its checks: rewrite now, before its
            # preads (the first group's samples were yielded from the old version).
            _write_in_place(backing[0], data)
        return got

    monkeypatch.setattr(core.Session, "read", read)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], read_ahead=8, strict=True)
    versions = [old, _oracle_of(data, backing[0])]
    got, err = _changed_or_consistent(lambda: _check(_plain(iter(ds)), versions), paths[0])
    # Caught either way: the error, or (nothing of the old version yielded yet) the shard
    # planned anew and every sample once, from one version.
    assert err is not None or sorted(got) == sorted(old), f"{len(got)} samples, {len(set(got))} keys"
    assert len(got) == len(set(got)), "a sample was yielded twice"
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def _oracle_of(data: bytes, like: str) -> dict:
    """The oracle of a version not yet written (written to a scratch copy)."""
    p = like + ".next"
    with open(p, "wb") as f:
        f.write(data)
    try:
        return _oracle(p)
    finally:
        os.remove(p)
