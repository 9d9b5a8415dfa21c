"""Shared helpers for the checkpoint tests: reference state dicts, deep equality, a saver to kill."""

from __future__ import annotations

import collections
import os
import warnings
from typing import Any, Iterator

import torch

from gdsfs import GDSFallbackWarning
from gdsfs._errors import _reset_fallback_warning

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")

# Every dtype torch can save whose bytes we move (quantized types need their own rebuilders).
DTYPES = [
    d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
        torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
        getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None),
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    )
    if d is not None
]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Deterministic values of any dtype (via random bytes, so every bit pattern class appears)."""
    n = 1
    for s in shape:
        n *= s
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * esize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    if dtype.is_floating_point or dtype.is_complex:
        # Finite values only, so equality checks are meaningful (NaN != NaN).
        f = torch.randn((n * (2 if dtype.is_complex else 1),), generator=gen) * 10
        if dtype.is_complex:
            return torch.view_as_complex(f.reshape(n, 2)).to(dtype).reshape(shape)
        return f.to(dtype).reshape(shape)
    return raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)


def nested_state(seed: int = 0, scale: int = 1) -> dict[str, Any]:
    """A nested state dict with every dtype, 0-d, empty, views, shared storages, parameters."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, Any] = {}
    for i, dt in enumerate(DTYPES):
        sd[f"dtype.{str(dt).split('.')[-1]}"] = make_tensor(dt, (3, 5 * scale), g)
        sd[f"scalar.{i}"] = make_tensor(dt, (), g)
        sd[f"empty.{i}"] = make_tensor(dt, (0, 4), g)
    base = torch.randn(64 * scale, 48, generator=g)
    model = collections.OrderedDict(
        [("layer.weight", base), ("layer.bias", torch.randn(64, generator=g)),
         ("emb", torch.randn(100, 16, generator=g).to(torch.bfloat16))]
    )
    model._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    sd["model"] = model
    sd["views"] = {
        "strided": base[::2, 1:5],          # non-contiguous view of a shared storage
        "transposed": base.t(),             # shares storage with model.layer.weight
        "offset": base[5],                  # storage offset
        "expand": torch.randn(1, 4, generator=g).expand(3, 4),  # zero stride
    }
    sd["param"] = torch.nn.Parameter(torch.randn(4, 4, generator=g))
    sd["frozen"] = torch.nn.Parameter(torch.randn(2, generator=g), requires_grad=False)
    sd["optim"] = {"step": 17, "lr": 0.1, "betas": (0.9, 0.999), "m": [torch.ones(3), torch.zeros(2, 2)],
                   "name": "adam", "none": None, "flags": {1, 2}}
    return sd


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Deep equality with dtype, shape, strides, storage offsets and requires_grad."""
    assert type(a) is type(b), f"{path}: type {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.stride() == b.stride(), f"{path}: stride {a.stride()} != {b.stride()}"
        assert a.storage_offset() == b.storage_offset(), f"{path}: storage offset"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert torch.equal(_bytes(a), _bytes(b)), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{path}: _metadata"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().cpu().contiguous().reshape(-1)
    return x.view(torch.uint8) if x.numel() else torch.empty(0, dtype=torch.uint8)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The two dicts hold the same keys and byte-identical tensors."""
    return set(a) == set(b) and all(torch.equal(_bytes(a[k]), _bytes(b[k])) for k in a)


def storage_key(t: torch.Tensor) -> int:
    """An identity for the storage under t (shared storages compare equal)."""
    return t.untyped_storage().data_ptr() if hasattr(t, "untyped_storage") else t.storage().data_ptr()


def flat_state(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    """A flat dict of float32 tensors of about nbytes in total (for safetensors and kill tests)."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // 8 // 4)
    return {f"w{i}": torch.randn(per, generator=g) for i in range(8)}


def dcp_state(seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    """Like flat_state, but the tensor sizes depend on the seed, so the item offsets of two
    checkpoints differ and any mix of old metadata and new data files would not load."""
    g = torch.Generator().manual_seed(seed)
    per = max(1, nbytes // 8 // 4)
    return {f"w{i}": torch.randn(per + 1000 * (seed % 7) + 17 * i, generator=g) for i in range(8)}


def state_for(kind: str, seed: int, nbytes: int) -> dict[str, torch.Tensor]:
    """The checkpoint contents the kill test saves for ``seed``."""
    return dcp_state(seed, nbytes) if kind == "dcp" else flat_state(seed, nbytes)


def saver(kind: str, path: str) -> Any:
    """A function saving a state dict to ``path`` with gdsfs's ``kind`` of checkpoint."""
    if kind == "checkpoint":
        from gdsfs.checkpoint import save

        return lambda sd: save(sd, path)
    if kind == "safetensors":
        from gdsfs.safetensors import save_file

        return lambda sd: save_file(sd, path, metadata={"n": str(len(sd))})
    import _dcp_standin as S

    real = S.has_real_dcp()
    if not real:
        S.install()
    import gdsfs.dcp as gdcp

    if real:
        import torch.distributed.checkpoint as dcp

        return lambda sd: dcp.save(sd, storage_writer=gdcp.GDSFileSystemWriter(path))

    def save_dcp(sd: dict[str, torch.Tensor]) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected an existing checkpoint")
            S.save(sd, gdcp.GDSFileSystemWriter(path))  # dcp.save's calls, torch 2.11's order

    return save_dcp


def read_dcp_raw(path: str) -> dict[str, torch.Tensor]:
    """Every tensor item of a DCP checkpoint, read the way the stock reader does (the .metadata
    pickle, then torch.load of each item's byte range), keyed by fqn."""
    import io
    import pickle

    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    out = {}
    for idx, info in md.storage_data.items():
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        assert len(raw) == info.length, f"{info.relative_path} is shorter than its items"
        out[idx.fqn] = torch.load(io.BytesIO(raw))
    return out


def save_loop(kind: str, path: str, seed: int, nbytes: int, ready: Any) -> None:
    """Save the same new checkpoint over and over until killed (run in a child process)."""
    torch.set_num_threads(1)
    import warnings

    warnings.simplefilter("ignore")
    sd = state_for(kind, seed, nbytes)
    once = saver(kind, path)
    ready.send(True)
    while True:
        once(sd)


def crash_save(kind: str, path: str, seed: int, nbytes: int, crash_before: int, conn: Any) -> None:
    """Save once, dying (os._exit) just before the ``crash_before``-th durable file-system step
    (fsync, rename, replace, unlink); 0 never dies and sends the list of steps taken."""
    torch.set_num_threads(1)
    import warnings

    warnings.simplefilter("ignore")
    sd = state_for(kind, seed, nbytes)
    once = saver(kind, path)
    steps: list[str] = []

    def wrap(name: str, real: Any) -> Any:
        def step(*a: Any, **k: Any) -> Any:
            steps.append(name)
            if len(steps) == crash_before:
                os._exit(77)
            return real(*a, **k)

        return step

    for name in ("fsync", "rename", "replace", "unlink"):
        setattr(os, name, wrap(name, getattr(os, name)))
    once(sd)
    conn.send(steps)


def daemon_dir(mount: Any, request: Any, sub: str) -> Iterator[str]:
    """Body of the ``mdir`` fixtures: a fresh directory on the mount for one test, in which a
    GDSFallbackWarning is an error (on the mount nothing may fall back silently), and after
    which no lease is left and the daemon answered no request with an error."""
    d = mount.path(sub, request.node.name.replace("/", "_"))
    os.makedirs(d, exist_ok=True)
    _reset_fallback_warning()
    with warnings.catch_warnings():
        warnings.simplefilter("error", GDSFallbackWarning)
        errors = daemon_errors(mount)
        yield d
    assert mount.wait_leases(0) == 0, "leases left behind"
    assert daemon_errors(mount) == errors, "the daemon answered requests with errors"


def daemon_errors(m: Any) -> dict:
    """The daemon's error counters by errno. ENOTTY aside: every plain open() of a file on the
    mount asks isatty(), a TCGETS ioctl the daemon refuses (torch.load and shutil do that)."""
    return {k: v for k, v in m.stats()["counters"].get("errors", {}).items() if k != "ENOTTY"}


def counters(m: Any) -> dict:
    """The daemon's control-path counters (reads, read_bytes, writes, write_bytes, errors)."""
    return m.stats()["counters"]
