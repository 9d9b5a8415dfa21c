"""docs/pytorch.md's complete example runs as written against a live mount."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
