"""Crash safety: SIGKILL a process that keeps saving, at random moments; the checkpoint on the mount
must then be the old one or the new one, complete and loadable, never torn.

The saver runs in a forkserver child (torch imported once in the server, so each kill round costs
milliseconds, not an interpreter start) and saves the same new checkpoint in a loop, so a random
kill time lands inside a save most of the time: in the tensor writes through the daemon, the
metadata writes, the fsync or the rename.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import warnings

import pytest
import torch

from _ckpt_helpers import flat_state, save_loop
from gdsfs._ckpt import stformat

NBYTES = 8 << 20
ROUNDS = 6


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch", "gdsfs.checkpoint", "gdsfs.safetensors", "_ckpt_helpers"])
    return c


def _load(kind: str, path: str) -> dict[str, torch.Tensor]:
    if kind == "checkpoint":
        return torch.load(path)  # torch's own reader: what users will run after a crash
    with open(path, "rb") as f:
        hdr = stformat.read_header(f, os.path.getsize(path))  # strict: sizes, holes, file length
    import gdsfs.safetensors as gst

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gst.load_file(path, device="cpu") if hdr.tensors else {}


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a) if set(a) == set(b) else False


@pytest.mark.parametrize("kind", ["checkpoint", "safetensors"])
def test_kill_during_save_leaves_old_or_new(gdsfs_mount, ctx, kind):
    d = gdsfs_mount.path("kill", kind)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "ckpt.pt" if kind == "checkpoint" else "ckpt.safetensors")
    old = flat_state(100, NBYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "checkpoint":
            import gdsfs.checkpoint as gck

            gck.save(old, path)
        else:
            import gdsfs.safetensors as gst

            gst.save_file(old, path)
    outcomes = {"old": 0, "new": 0}
    rng = random.Random(1234)
    for r in range(ROUNDS):
        seed = 200 + r
        new = flat_state(seed, NBYTES)
        parent, child = ctx.Pipe()
        p = ctx.Process(target=save_loop, args=(kind, path, seed, NBYTES, child), daemon=True)
        p.start()
        try:
            started = parent.poll(120)
            if started:
                parent.recv()
                time.sleep(rng.uniform(0.0, 0.4))
        finally:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(30)
        assert started, f"saver did not start (exit code {p.exitcode})"
        assert p.exitcode == -signal.SIGKILL, f"saver died on its own (exit code {p.exitcode})"
        got = _load(kind, path)
        if _same(got, new):
            outcomes["new"] += 1
            old = new  # the next round's "old" checkpoint
        else:
            assert _same(got, old), f"round {r}: checkpoint is neither the old nor the new one"
            outcomes["old"] += 1
        leftovers = [n for n in os.listdir(d) if ".gdsfs-tmp-" in n]
        for n in leftovers:  # a crash may leave its temp file; it never replaces the checkpoint
            os.unlink(os.path.join(d, n))
    assert sum(outcomes.values()) == ROUNDS
    assert gdsfs_mount.wait_leases(0) == 0, "a killed saver's leases were not returned to the pool"
