"""gdsfs.safetensors.save_model / load_model: safetensors' API for models with shared (tied)
tensors, same signatures and file contents convention (each dropped name recorded in
``__metadata__`` as ``{dropped: kept}``), through the session's host-mode mount."""

from __future__ import annotations

import inspect
import json
import os
import struct

import pytest
import torch

import gdsfs.safetensors as gst
from _wds_helpers import fresh_dir


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight  # tied, as language models do
        self.norm = torch.nn.LayerNorm(4)


def _header(path: str) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_save_model_stores_tied_weights_once_and_load_model_restores_them(gdsfs_mount) -> None:
    _, d = fresh_dir(gdsfs_mount, "model")
    torch.manual_seed(0)
    m = Tied()
    p = os.path.join(d, "tied.safetensors")
    with pytest.raises(RuntimeError, match="save_model"):
        gst.save_file(m.state_dict(), p)
    gst.save_model(m, p, metadata={"format": "pt"})
    h = _header(p)
    assert sorted(k for k in h if k != "__metadata__") == ["emb.weight", "norm.bias", "norm.weight"]
    assert h["__metadata__"] == {"format": "pt", "head.weight": "emb.weight"}
    fresh = Tied()
    missing, unexpected = gst.load_model(fresh, p)
    assert missing == [] and unexpected == []
    assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()
    for k, v in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # Strict loading names what is missing.
    gst.save_file({"emb.weight": m.emb.weight.detach().clone()}, os.path.join(d, "part.safetensors"))
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "norm.bias", "norm.weight"'):
        gst.load_model(Tied(), os.path.join(d, "part.safetensors"))
    missing, _ = gst.load_model(Tied(), os.path.join(d, "part.safetensors"), strict=False)
    assert missing == ["norm.bias", "norm.weight"]


def test_save_model_force_contiguous(gdsfs_mount) -> None:
    _, d = fresh_dir(gdsfs_mount, "model-nc")
    m = torch.nn.Linear(3, 5)
    m.weight = torch.nn.Parameter(torch.randn(3, 5).t())  # not contiguous
    p = os.path.join(d, "nc.safetensors")
    with pytest.raises(ValueError, match="force_contiguous=True"):
        gst.save_model(m, p, force_contiguous=False)
    gst.save_model(m, p)  # force_contiguous=True by default, as safetensors' save_model
    got = torch.nn.Linear(3, 5)
    gst.load_model(got, p)
    assert torch.equal(got.weight, m.weight)


def test_signatures_match_safetensors() -> None:
    assert list(inspect.signature(gst.save_model).parameters) == ["model", "filename", "metadata", "force_contiguous"]
    # As safetensors' own (checked against the real library by test_safetensors.py's mirror
    # test where it is installed): backend= is keyword-only.
    assert list(inspect.signature(gst.load_model).parameters) == ["model", "filename", "strict", "device", "backend"]
    assert inspect.signature(gst.load_model).parameters["backend"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.signature(gst.load_model).parameters["device"].default == "cpu"
