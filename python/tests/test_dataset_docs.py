"""docs/pytorch.md's examples run as written against a live mount."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "..", "..", "docs", "pytorch.md")


def test_complete_example_runs(gdsfs_mount, tmp_path) -> None:
    text = open(DOC).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/pytorch.md has no python example"
    script = tmp_path / "train.py"
    script.write_text(blocks[0])
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(script), gdsfs_mount.mnt], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "engine='host'" in r.stdout
    assert re.search(r"epoch 1: loss [0-9.]+", r.stdout), r.stdout
    assert gdsfs_mount.wait_leases(0) == 0


def _complete_examples() -> list[tuple[int, str]]:
    """docs/pytorch.md's python blocks that are whole scripts (they start with an import): every
    one but the first (test_complete_example_runs) and those marked ``<!-- tested: FILE -->`` (run
    by that file) runs as written, with the mount as argv[1]."""
    found = re.findall(r"(<!-- tested: [^>]*-->\n)?```python\n(.*?)```", open(DOC).read(), re.S)
    return [(i, b) for i, (mark, b) in enumerate(found) if i > 0 and not mark and b.startswith(("import ", "from "))]


@pytest.mark.parametrize("i,block", _complete_examples(), ids=[f"block{i}" for i, _ in _complete_examples()])
def test_every_complete_example_runs(gdsfs_mount, tmp_path, i, block) -> None:
    script = tmp_path / f"example{i}.py"
    script.write_text(block)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(script), gdsfs_mount.mnt], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, f"docs/pytorch.md example {i}:\n{block}\n{r.stdout}{r.stderr}"
    assert gdsfs_mount.wait_leases(0) == 0
