"""docs/pytorch.md's "Example: the options together" runs as written against a live mount:
keys=, map=, batch_map=, handler, interleave, shuffle_buffer, even_ranks and an exact resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DOC = os.path.join(HERE, "..", "..", "docs", "pytorch.md")
README = os.path.join(HERE, "..", "..", "README.md")


def _block_after(text: str, marker: str) -> str:
    at = text.index(marker)
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, at)
    assert m, f"no python block after {marker!r}"
    return m.group(1)


def test_features_example_runs(gdsfs_mount, tmp_path) -> None:
    script = tmp_path / "features.py"
    script.write_text(_block_after(open(DOC).read(), "<!-- tested: python/tests/test_dataset_docs_features.py -->"))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(script), gdsfs_mount.mnt], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"(\d) of 4 batches mixed shards; (\d+) samples, (\d+) distinct, (\d+) expected", r.stdout)
    assert m, r.stdout
    mixed, n, distinct, want = map(int, m.groups())
    assert n == distinct == want == 88 and mixed >= 3, r.stdout
    assert gdsfs_mount.wait_leases(0) == 0


def test_readme_example_uses_the_gdsfs_dataloader() -> None:
    block = _block_after(open(README).read(), "## From PyTorch")
    assert "gt.DataLoader(" in block or "gdsfs.torch.DataLoader(" in block
    compile(block, "README.md", "exec")
