"""Review of the next-shard hint (review4): a bad GDSFS_SHARD_HINT, a next shard that cannot
be opened (gone, a directory, a FIFO) never fail, block or leak a descriptor in a worker; the
hint is a hint, the shard's own READs report what is wrong."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import gdsfs._dataset as gd


@pytest.mark.parametrize("value,want", [
    (None, gd.NEXT_SHARD_HINT), ("", gd.NEXT_SHARD_HINT), ("abc", gd.NEXT_SHARD_HINT),
    ("4M", gd.NEXT_SHARD_HINT), ("1e6", gd.NEXT_SHARD_HINT), ("-5", 0), ("0", 0),
    (" 65536 ", 65536), ("1048576", 1 << 20),
])
def test_shard_hint_env_values(monkeypatch: pytest.MonkeyPatch, value: str | None, want: int) -> None:
    if value is None:
        monkeypatch.delenv(gd.NEXT_SHARD_HINT_ENV, raising=False)
    else:
        monkeypatch.setenv(gd.NEXT_SHARD_HINT_ENV, value)
    assert gd._shard_hint_bytes() == want


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("kind", ["missing", "directory", "empty", "file", "unadvisable"])
def test_willneed_never_raises_or_leaks(tmp_path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    path = str(tmp_path / "next.tar")
    if kind == "directory":
        os.mkdir(path)
    elif kind in ("empty", "file", "unadvisable"):
        with open(path, "wb") as f:
            f.write(b"" if kind == "empty" else b"x" * (300 << 10))
    if kind == "unadvisable":
        def refuse(*_a: object) -> None:
            raise OSError(22, "refused")
        monkeypatch.setattr(os, "posix_fadvise", refuse)
    before = _fds()
    gd._willneed(path, 4 << 20)
    assert _fds() == before


def test_willneed_on_a_fifo_does_not_block(tmp_path) -> None:
    # A next shard replaced by a FIFO (no writer): an open O_RDONLY without O_NONBLOCK waits for
    # a writer for ever, in the worker's own thread, while its current shard is not done.
    fifo = str(tmp_path / "next.tar")
    os.mkfifo(fifo)
    code = textwrap.dedent(f"""
        import os, gdsfs._dataset as gd
        before = set(os.listdir("/proc/self/fd"))
        gd._willneed({fifo!r}, 4 << 20)
        assert set(os.listdir("/proc/self/fd")) == before
        print("returned")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(gd.__file__)), os.environ.get("PYTHONPATH", "")]))
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("_willneed blocked on a FIFO with no writer")
    assert out.returncode == 0 and "returned" in out.stdout, out.stderr
