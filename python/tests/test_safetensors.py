"""gdsfs.safetensors: format layer, loads and saves through the control path, fallbacks.

The safetensors library is not in Debian 12, so files written by it (fixtures/dtypes.safetensors,
fixtures/model.safetensors, made by safetensors 0.8 with torch 2.11, see fixtures/generate.py) are
the reference; the same tensors were torch.saved into fixtures/*.pt by the same script, which
gives independent expected values. Where the library is importable, we also check it reads our
files and we read its files.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
import struct
import warnings

import pytest
import torch

from _ckpt_helpers import counters, daemon_dir, FIXTURES, flat_state
from gdsfs import GDSFallbackWarning, GDSUnavailableError
from gdsfs._ckpt import stformat
from gdsfs._errors import _reset_fallback_warning
import gdsfs.safetensors as gst

try:
    import safetensors.torch as real_st  # type: ignore[import-not-found]
except ImportError:
    real_st = None

SAFETENSORS_DTYPES = [
    d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool)
]


@pytest.fixture
def mdir(gdsfs_mount, request):
    yield from daemon_dir(gdsfs_mount, request, "st")


def all_dtypes(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(SAFETENSORS_DTYPES):
        shape = [(3, 5), (17,), (2, 3, 4), (), (0,), (1, 1), (7, 3), (4,), (2, 2), (5,), (0, 3)][i]
        t = torch.randn(shape, generator=g) * 10
        if dt == torch.complex64:
            t = torch.complex(t, -t)
        out[f"t_{str(dt).split('.')[-1]}"] = (t > 0) if dt == torch.bool else t.to(dt)
    return out


# --- format layer (no daemon) ----------------------------------------------------------------


def test_layout_pads_header_to_alignment():
    entries = [stformat.Entry("b", "F32", (3, 5)), stformat.Entry("a", "I64", (2,)), stformat.Entry("z", "U8", (0,))]
    for align in (8, 64, 4096, 1 << 16):
        head, infos = stformat.layout(entries, {"k": "v"}, align)
        assert len(head) % align == 0
        (n,) = struct.unpack("<Q", head[:8])
        assert 8 + n == len(head)
        total = len(head) + sum(i.nbytes for i in infos.values())
        hdr = stformat.parse_header(head[8:], total)
        assert hdr.data_start == len(head)
        assert hdr.metadata == {"k": "v"}
        assert {k: (v.dtype, v.shape, v.offset, v.nbytes) for k, v in hdr.tensors.items()} == {
            k: (v.dtype, v.shape, v.offset, v.nbytes) for k, v in infos.items()
        }
        # Larger element sizes first: every tensor naturally aligned.
        assert [i.name for i in hdr.tensors.values() if i.nbytes] == ["a", "b"]


@pytest.mark.parametrize("name", ["dtypes.safetensors", "model.safetensors"])
def test_parse_fixture_headers(name):
    p = os.path.join(FIXTURES, name)
    with open(p, "rb") as f:
        hdr = stformat.read_header(f, os.path.getsize(p))
    assert hdr.data_start + hdr.data_bytes == os.path.getsize(p)
    assert hdr.tensors


def _header_file(doc, pad: bytes = b"", data: bytes = b"", n: int | None = None) -> bytes:
    js = (json.dumps(doc).encode() if not isinstance(doc, bytes) else doc) + pad
    return struct.pack("<Q", len(js) if n is None else n) + js + data


BAD_HEADERS = {
    "not-json": _header_file(b"{nope"),
    "not-object-start": _header_file(b'["a"]'),
    "unknown-dtype": _header_file({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 1]}}, data=b"\0"),
    "negative-shape": _header_file({"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, data=b"\0"),
    "size-mismatch": _header_file({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, data=b"\0" * 4),
    "hole": _header_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}, data=b"\0\0"),
    "overlap": _header_file(
        {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "b": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}},
        data=b"\0\0",
    ),
    "trailing-bytes": _header_file({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, data=b"\0\0"),
    "short-file": _header_file({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}, data=b"\0"),
    "duplicate-key": _header_file(
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', data=b"\0"
    ),
    "bad-metadata": _header_file({"__metadata__": {"k": 1}}),
    "header-past-eof": struct.pack("<Q", 1000) + b"{}",
    "header-too-big": struct.pack("<Q", stformat.MAX_HEADER_BYTES + 1) + b"{}",
    "too-short": b"\x01\x02",
    "offsets-reversed": _header_file({"a": {"dtype": "U8", "shape": [0], "data_offsets": [1, 0]}}, data=b"\0"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_malformed_headers_are_refused(case, tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(BAD_HEADERS[case])
    with pytest.raises(stformat.SafetensorsError):
        with open(p, "rb") as f:
            stformat.read_header(f, os.path.getsize(p))


def test_mutated_headers_never_crash():
    """Seeded random mutations of a real header: only SafetensorsError, never another exception."""
    with open(os.path.join(FIXTURES, "dtypes.safetensors"), "rb") as f:
        good = f.read()
    (n,) = struct.unpack("<Q", good[:8])
    rng = random.Random(7)
    for _ in range(3000):
        b = bytearray(good[8 : 8 + n])
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            i = rng.randrange(len(b))
            if op < 0.5:
                b[i] = rng.randrange(256)
            elif op < 0.75:
                del b[i : i + rng.randint(1, 8)]
            else:
                b[i:i] = bytes(rng.choice(b'{}[]",:0123456789-e') for _ in range(rng.randint(1, 4)))
        try:
            stformat.parse_header(bytes(b), 8 + len(b) + rng.randint(0, 300))
        except stformat.SafetensorsError:
            pass


# --- through the mount -----------------------------------------------------------------------


@pytest.mark.parametrize("st_name,pt_name", [("dtypes.safetensors", "dtypes_default.pt"), ("model.safetensors", "model_align4096.pt")])
def test_load_fixture_written_by_safetensors(gdsfs_mount, mdir, st_name, pt_name):
    dst = os.path.join(mdir, st_name)
    shutil.copyfile(os.path.join(FIXTURES, st_name), dst)
    want = torch.load(os.path.join(FIXTURES, pt_name))
    before = counters(gdsfs_mount)["read_bytes"]
    got = gst.load_file(dst, device="cpu")
    assert list(sorted(got)) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    payload = sum(t.numel() * t.element_size() for t in want.values())
    assert counters(gdsfs_mount)["read_bytes"] - before >= payload, "tensor bytes did not go through the daemon"


def test_round_trip_all_dtypes(gdsfs_mount, mdir):
    sd = all_dtypes()
    p = os.path.join(mdir, "rt.safetensors")
    before = counters(gdsfs_mount)["write_bytes"]
    gst.save_file(sd, p, metadata={"format": "pt", "step": "3"})
    payload = sum(t.numel() * t.element_size() for t in sd.values())
    assert counters(gdsfs_mount)["write_bytes"] - before >= payload, "tensor bytes did not go through the daemon"
    with open(p, "rb") as f:
        hdr = stformat.read_header(f, os.path.getsize(p))
    assert hdr.data_start % 4096 == 0
    assert hdr.metadata == {"format": "pt", "step": "3"}
    # The bytes on disk are the tensors' bytes (read back without gdsfs, from the backing dir).
    raw = open(os.path.join(gdsfs_mount.src, os.path.relpath(p, gdsfs_mount.mnt)), "rb").read()
    for name, info in hdr.tensors.items():
        t = sd[name]
        want = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        assert raw[info.offset : info.offset + info.nbytes] == want, name
    got = gst.load_file(p, device="cpu")
    assert list(got) == list(hdr.tensors)
    for k, t in sd.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    if real_st is not None:
        ref = real_st.load_file(p)
        assert all(torch.equal(ref[k], sd[k]) for k in sd)


def test_load_file_default_device_is_cpu_as_safetensors(gdsfs_mount, mdir):
    # safetensors.torch.load_file(filename, device="cpu"): the same default, so swapping the
    # import changes nothing else (the old default "cuda" fell back to cpu with a warning).
    assert inspect.signature(gst.load_file).parameters["device"].default == "cpu"
    p = os.path.join(mdir, "d.safetensors")
    gst.save_file({"a": torch.arange(5)}, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        got = gst.load_file(p)
    assert got["a"].device.type == "cpu" and torch.equal(got["a"], torch.arange(5))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="does not exist"):
            gst.load_file(p, device="cuda")


def test_large_file_batches_and_splits(gdsfs_mount, mdir, monkeypatch):
    """Pieces larger than one lease are split and batches refilled: force tiny limits."""
    import gdsfs._ckpt.tensorio as tio

    monkeypatch.setattr(tio, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(tio, "BATCH_BYTES", 256 << 10)
    sd = flat_state(3, 6 << 20)
    p = os.path.join(mdir, "big.safetensors")
    gst.save_file(sd, p)
    got = gst.load_file(p, device="cpu")
    assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_safe_open_and_slices(gdsfs_mount, mdir):
    g = torch.Generator().manual_seed(1)
    sd = {"w": torch.randn(10, 6, generator=g), "b": torch.randn(6, generator=g), "s": torch.tensor(2.5)}
    p = os.path.join(mdir, "so.safetensors")
    gst.save_file(sd, p, metadata={"m": "1"})
    with gst.safe_open(p, framework="pt", device="cpu") as f:
        assert f.keys() == ["b", "s", "w"]
        assert f.metadata() == {"m": "1"}
        assert torch.equal(f.get_tensor("w"), sd["w"])
        sl = f.get_slice("w")
        assert sl.get_shape() == [10, 6] and sl.get_dtype() == "F32"
        for idx in [slice(2, 5), (slice(1, 9, 3), slice(0, 2)), 4, -1, (slice(None), 3), (slice(3, 3),)]:
            assert torch.equal(sl[idx], sd["w"][idx]), idx
        assert torch.equal(f.get_slice("s")[...], sd["s"])
        with pytest.raises(KeyError):
            f.get_tensor("missing")
    with pytest.raises(RuntimeError):
        f.get_tensor("w")


def test_save_refuses_what_safetensors_refuses(mdir):
    base = torch.randn(4, 4)
    with pytest.raises(ValueError, match="non contiguous"):
        gst.save_file({"t": base.t()}, os.path.join(mdir, "x.safetensors"))
    with pytest.raises(RuntimeError, match="share memory"):
        gst.save_file({"a": base, "b": base[1]}, os.path.join(mdir, "x.safetensors"))
    gst.save_file({"a": base[:2], "b": base[2:]}, os.path.join(mdir, "x.safetensors"))  # disjoint parts are fine
    assert not [n for n in os.listdir(mdir) if ".gdsfs-tmp-" in n], "temp file left after a refused save"


def test_save_replaces_atomically(gdsfs_mount, mdir):
    p = os.path.join(mdir, "a.safetensors")
    gst.save_file({"v": torch.zeros(3)}, p)
    ino = os.stat(p).st_ino
    gst.save_file({"v": torch.ones(3)}, p)
    assert os.stat(p).st_ino != ino, "save wrote in place instead of renaming a new file over"
    assert torch.equal(gst.load_file(p, device="cpu")["v"], torch.ones(3))
    assert os.listdir(mdir) == ["a.safetensors"]


def test_bytes_api_round_trip():
    sd = all_dtypes(2)
    b = gst.save(sd, metadata={"x": "y"})
    got = gst.load(b)
    assert all(torch.equal(got[k], sd[k]) for k in sd)


# --- off gdsfs -------------------------------------------------------------------------------


def test_off_gdsfs_warns_once_and_works(tmp_path):
    _reset_fallback_warning()
    p = str(tmp_path / "off.safetensors")
    sd = all_dtypes(1)
    with pytest.warns(GDSFallbackWarning, match="not on a gdsfs mount"):
        gst.save_file(sd, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)  # once per process
        got = gst.load_file(p, device="cpu")
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    with pytest.raises(GDSUnavailableError):
        gst.load_file(p, device="cpu", strict=True)


def assert_mirrors(ours, theirs, *, same_names: bool) -> None:
    """Every parameter of ``theirs`` is one of ``ours`` of the same name, position, kind and
    default, so a call written for the library means the same with ours; ours' extra parameters
    have defaults. same_names: the positional names are exactly theirs (no extra ones)."""
    a = [p for p in inspect.signature(ours).parameters.values() if p.kind is not p.KEYWORD_ONLY]
    b = [p for p in inspect.signature(theirs).parameters.values() if p.kind is not p.KEYWORD_ONLY]
    if same_names:
        assert [p.name for p in a] == [p.name for p in b], theirs.__name__
    else:
        assert [p.name for p in a[:len(b)]] == [p.name for p in b], theirs.__name__
    mine = inspect.signature(ours).parameters
    for p in inspect.signature(theirs).parameters.values():
        assert p.name in mine, f"{theirs.__name__} lacks {p.name}"
        q = mine[p.name]
        assert (q.kind, q.default) == (p.kind, p.default), f"{theirs.__name__}({p.name}): ours {q.kind} {q.default!r}, theirs {p.kind} {p.default!r}"
    for q in mine.values():
        if q.name not in inspect.signature(theirs).parameters and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            assert q.default is not q.empty, f"{theirs.__name__}: our extra parameter {q.name} needs a default"


@pytest.mark.skipif(real_st is None, reason="safetensors is not installed (not in Debian 12)")
def test_signatures_mirror_safetensors():
    for ours, theirs in [(gst.load_file, real_st.load_file), (gst.save_file, real_st.save_file)]:
        assert_mirrors(ours, theirs, same_names=True)
    # Ours may add (defaulted) parameters to these: gdsfs.safetensors.load takes device= too.
    for name in ("load", "save", "save_model", "load_model"):
        assert_mirrors(getattr(gst, name), getattr(real_st, name), same_names=False)
