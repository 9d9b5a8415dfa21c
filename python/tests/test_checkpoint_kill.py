"""Crash safety: a saver dies at every durable step, and at random moments; the checkpoint on the
mount must then be the old one or the new one, complete and loadable, never torn.

Two tests per kind (torch.save file, safetensors file, DCP directory):

- every step: a saver dies (os._exit) just before each fsync/rename/unlink of a save, in turn;
- random: a saver that saves in a loop is SIGKILLed at random moments (in the tensor writes
  through the daemon, the metadata writes, ...).

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

from _ckpt_helpers import crash_save, read_dcp_raw, save_loop, saver, state_for
from gdsfs._ckpt import stformat

NBYTES = 8 << 20
ROUNDS = 4
KINDS = ["checkpoint", "safetensors", "dcp"]


@pytest.fixture(scope="module")
def ctx():
    c = multiprocessing.get_context("forkserver")
    c.set_forkserver_preload(["torch", "gdsfs.checkpoint", "gdsfs.safetensors", "_ckpt_helpers", "_dcp_standin"])
    return c


def _load(kind: str, path: str) -> dict[str, torch.Tensor]:
    if kind == "dcp":
        return read_dcp_raw(path)
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


def _path(gdsfs_mount, kind: str, test: str) -> str:
    d = gdsfs_mount.path("kill", test, kind)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, {"checkpoint": "ckpt.pt", "safetensors": "ckpt.safetensors", "dcp": "ckpt.dcp"}[kind])


def _clean_temps(kind: str, path: str) -> None:
    where = path if kind == "dcp" else os.path.dirname(path)
    for n in os.listdir(where):  # a crash may leave temp files; they never replace the checkpoint
        if ".gdsfs-tmp-" in n or n.endswith(".tmp"):
            os.unlink(os.path.join(where, n))


@pytest.mark.parametrize("kind", KINDS)
def test_crash_at_every_step_leaves_old_or_new(gdsfs_mount, ctx, kind):
    path = _path(gdsfs_mount, kind, "steps")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver(kind, path)(state_for(kind, 300, NBYTES // 8))
    current = state_for(kind, 300, NBYTES // 8)

    def run(seed: int, crash_before: int) -> tuple[int | None, list[str] | None]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=crash_save, args=(kind, path, seed, NBYTES // 8, crash_before, child), daemon=True)
        p.start()
        p.join(120)
        steps = parent.recv() if parent.poll(0) else None
        return p.exitcode, steps

    code, steps = run(301, 0)  # a full save, counting its steps
    assert code == 0 and steps, f"counting save failed (exit code {code})"
    current = state_for(kind, 301, NBYTES // 8)
    assert _same(_load(kind, path), current)
    for k in range(1, len(steps) + 1):
        seed = 302 + k
        code, _ = run(seed, k)
        assert code == 77, f"saver did not die before step {k} ({steps[k - 1]}), exit code {code}"
        got = _load(kind, path)
        new = state_for(kind, seed, NBYTES // 8)
        if _same(got, new):
            current = new
        else:
            assert _same(got, current), f"dying before step {k} ({steps[k - 1]}) of {steps} tore the checkpoint"
        _clean_temps(kind, path)
    assert gdsfs_mount.wait_leases(0) == 0, "a dead saver's leases were not returned to the pool"


@pytest.mark.parametrize("kind", KINDS)
def test_kill_during_save_leaves_old_or_new(gdsfs_mount, ctx, kind):
    path = _path(gdsfs_mount, kind, "random")
    old = state_for(kind, 100, NBYTES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver(kind, path)(old)
    outcomes = {"old": 0, "new": 0}
    rng = random.Random(1234)
    for r in range(ROUNDS):
        seed = 200 + r
        new = state_for(kind, seed, NBYTES)
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
        _clean_temps(kind, path)
    assert sum(outcomes.values()) == ROUNDS
    assert gdsfs_mount.wait_leases(0) == 0, "a killed saver's leases were not returned to the pool"
