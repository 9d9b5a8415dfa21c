"""What scripts/gpu/checkpoint_check.py reports when a save fails.

The 2026-12-01 18:30 GPU run's stock ``dcp.save`` row failed with ``RuntimeError: [enforce fail
at inline_container.cc:672] . unexpected pos 704 vs 598``. That message is torch's, not the
failure: when a write into torch.save's file fails, the zip writer's ``__exit__`` still writes
the end of the archive, finds its position (past the local header it had written) ahead of
miniz's (the start of that record) and raises, hiding the write's own error as ``__context__``;
DCP's CheckpointException then prints only that RuntimeError. These tests pin the script's
unmasking of it with a real failing write (RLIMIT_FSIZE: the kernel refuses the bytes, EFBIG)
through the stand-in's stock writer path (torch.save of each tensor item into the data file).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "gpu", "checkpoint_check.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("checkpoint_check_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Run in a child: torch 1.13's PyTorchStreamWriter destructor writes the end of the archive again
# after the failure and aborts the process (pytorch#87997, fixed in torch 2.0), so the child
# prints what it found and leaves with os._exit before anything is destroyed.
_CHILD = textwrap.dedent(
    r"""
    import errno, json, os, resource, signal, sys, warnings
    sys.path[:0] = [{script_dir!r}, {tests_dir!r}]
    warnings.simplefilter("ignore")
    import torch
    import _dcp_standin as dcp
    import checkpoint_check as cc

    out = {{}}
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    sd = {{"w": torch.zeros(1024, 1024)}}  # 4 MiB of tensor bytes, the file may hold 1 MiB
    try:
        dcp.save(sd, storage_writer=dcp.FileSystemWriter({ckpt!r}))
        out["raised"] = None
    except BaseException as e:
        out["raised"] = f"{{type(e).__name__}}: {{e}}".splitlines()[0]
        rc = cc.root_cause(e)
        out["cause"] = [type(rc).__name__, getattr(rc, "errno", None)]
        out["described"] = cc.describe_error(e)
        # The same error wrapped as DCP wraps a rank's failure ({{rank: (exception, traceback)}}).
        class CheckpointException(BaseException):
            def __init__(self, msg, failures):
                super().__init__(msg)
                self.failures = failures
        w = CheckpointException("CheckpointException ranks:dict_keys([0])", {{0: (e, None)}})
        rc = cc.root_cause(w)
        out["wrapped_cause"] = [type(rc).__name__, getattr(rc, "errno", None)]
    print(json.dumps(out), flush=True)
    os._exit(0)
    """
)


def test_root_cause_unmasks_torch_zip_writer_error(tmp_path):
    code = _CHILD.format(script_dir=os.path.dirname(SCRIPT), tests_dir=HERE, ckpt=str(tmp_path / "ck"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"child printed nothing: rc {p.returncode}\n{p.stdout}\n{p.stderr[-2000:]}"
    import json

    out = json.loads(lines[-1])
    # torch's own message hides the write's error (what the GPU run printed) ...
    assert out["raised"] is not None and "unexpected pos" in out["raised"], out
    # ... and the script names the write's error instead, wrapped or not.
    assert out["cause"] == ["OSError", 27], out  # EFBIG
    assert out["wrapped_cause"] == ["OSError", 27], out
    assert out["described"].startswith("OSError: [Errno 27]"), out
    assert "unexpected pos" in out["described"], out  # torch's message is kept, after the cause


def test_root_cause_keeps_unrelated_errors():
    cc = _load_script()
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise ValueError("outer, raised while handling another")
    except ValueError as e:
        assert cc.root_cause(e) is e  # only torch's zip-writer mask is looked through
        assert cc.describe_error(e) == "ValueError: outer, raised while handling another"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
