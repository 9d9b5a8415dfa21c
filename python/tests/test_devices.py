"""gdsfs._devices.parse_device: one spelling, one device, in every module that takes one."""

from __future__ import annotations

import os

import pytest
import torch

import gdsfs.checkpoint as gck
import gdsfs.safetensors as gst
import gdsfs.torch as gt
from gdsfs._devices import parse_device

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("device, want", [
    ("cpu", torch.device("cpu")),
    (torch.device("cpu"), torch.device("cpu")),
])
def test_cpu_spellings(device, want) -> None:
    assert parse_device(device) == want


@pytest.mark.parametrize("device", ["meta", "mps", torch.device("meta")])
def test_devices_the_daemon_cannot_serve_are_refused(device) -> None:
    with pytest.raises(ValueError, match=r"is not supported; use 'cpu', 'cuda' or 'cuda:N'"):
        parse_device(device)
    with pytest.raises(ValueError, match=r"map_location .* is not supported"):
        parse_device(device, what="map_location")


@pytest.mark.skipif(not NO_CUDA, reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1", 0, 3, torch.device("cuda", 0)])
def test_a_cuda_device_that_does_not_exist_raises(device) -> None:
    with pytest.raises(RuntimeError, match=r"names a CUDA device that does not exist: torch sees 0 CUDA device\(s\); pass device='cpu'"):
        parse_device(device)


@pytest.mark.skipif(NO_CUDA, reason="needs CUDA")
def test_cuda_spellings() -> None:
    cur = torch.cuda.current_device()
    assert parse_device("cuda") == torch.device("cuda", cur)
    assert parse_device(0) == parse_device("cuda:0") == parse_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match="does not exist"):
        parse_device(n)


def test_every_module_parses_devices_alike(tmp_path) -> None:
    """safetensors' device=, checkpoint's map_location= and materialize's device= refuse the same
    devices with the same message (off a mount: the parse comes before any I/O)."""
    p = os.path.join(tmp_path, "t.safetensors")
    q = os.path.join(tmp_path, "t.pt")
    with pytest.warns(Warning):
        gst.save_file({"a": torch.arange(3)}, p)
        gck.save({"a": torch.arange(3)}, q)
    calls = {
        "safetensors.load_file": lambda d: gst.load_file(p, device=d),
        "safetensors.safe_open": lambda d: gst.safe_open(p, framework="pt", device=d),
        "checkpoint.load": lambda d: gck.load(q, map_location=d),
        "torch.materialize": lambda d: gt.GDSBatch({"x": torch.zeros(1)}, gpu_fields=("x",)).materialize(d),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="is not supported"):
            call("meta")
        if NO_CUDA:
            with pytest.raises(RuntimeError, match="names a CUDA device that does not exist"):
                call("cuda:1")
