"""safetensors.torch through gdsfs: ``load_file``, ``save_file``, ``safe_open``, ``save_model``, ``load_model``.

Loads read every tensor of the file through the daemon in one batched request, straight into
memory on the target device (one device-to-device copy per tensor). Saves write a safetensors file
whose byte buffer starts on a 4096-byte boundary (the JSON header is padded with spaces, which
the format allows), with tensor bytes going from GPU or host memory to the file through the
daemon's write path, atomically (temp name, fsync, rename, directory fsync). The files are
ordinary safetensors files: the safetensors library reads what we write and we read what it
writes.

Off a gdsfs mount ``load_file`` is the safetensors library's own (our format layer with plain
reads where the library is not installed), after the one-time GDSFallbackWarning; when the daemon
cannot serve, plain reads and writes take over. Saves stay atomic everywhere. ``strict=True``
raises GDSUnavailableError instead of falling back.

Example:
    from gdsfs.safetensors import load_file, save_file
    save_file(model.state_dict(), "/mnt/gdsfs/model.safetensors")
    sd = load_file("/mnt/gdsfs/model.safetensors", device="cuda:0")
    save_model(model, "/mnt/gdsfs/tied.safetensors")   # shared (tied) tensors stored once
    missing, unexpected = load_model(model, "/mnt/gdsfs/tied.safetensors")

The signatures and defaults are safetensors' own (``load_file``'s device is "cpu"), so swapping the
import changes nothing else.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from gdsfs._ckpt import atomic, stformat
from gdsfs._ckpt.tensorio import BUFFER as _BUFFER, PosixMover, byte_view, transfer, untyped_storage
from gdsfs._core import on_gdsfs
from gdsfs._devices import parse_device

__all__ = ["load_file", "save_file", "safe_open", "load", "save", "save_model", "load_model"]

_OFF_MOUNT = "off-mount safetensors"

_TO_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
# Only dtypes the installed torch has (uint16/32/64 arrived in 2.3, float8 in 2.1).
_TO_TORCH: dict[str, torch.dtype] = {
    k: getattr(torch, v) for k, v in _TO_TORCH_NAMES.items() if isinstance(getattr(torch, v, None), torch.dtype)
}
_FROM_TORCH: dict[torch.dtype, str] = {v: k for k, v in _TO_TORCH.items()}


def _torch_dtype(name: str, tensor: str) -> torch.dtype:
    dt = _TO_TORCH.get(name)
    if dt is None:
        raise TypeError(
            f"gdsfs: tensor {tensor!r} has dtype {name}, which torch {torch.__version__} cannot represent"
        )
    return dt


def _read_header(fh: Any, path: str) -> stformat.Header:
    try:
        return stformat.read_header(fh, os.fstat(fh.fileno()).st_size)
    except stformat.SafetensorsError as e:
        why = str(e).removeprefix("safetensors: ")
        raise stformat.SafetensorsError(f"gdsfs: {path!r} is not a valid safetensors file ({why}): it is truncated or "
                                        "corrupt; save it again, or check that it is the file you meant") from None


def _load_tensors(path: str, fh: Any, infos: Sequence[stformat.TensorInfo], dev: torch.device,
                  via_daemon: bool, strict: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    items = []
    for info in infos:
        t = torch.empty(info.shape, dtype=_torch_dtype(info.dtype, info.name), device=dev)
        out[info.name] = t
        if info.nbytes:
            items.append((info.offset, byte_view(t)))
    if via_daemon:
        transfer(path, fh.fileno(), items, write=False, strict=strict)
    else:
        PosixMover().read_into(fh.fileno(), items)
    return out


def load_file(
    filename: str | os.PathLike,
    device: str | int | torch.device = "cpu",
    *,
    backend: str = "mmap",
    strict: bool = False,
) -> dict[str, torch.Tensor]:
    """Load a safetensors file into tensors on ``device``, all bytes in one batched request.

    Args:
        filename: path of the file (on a gdsfs mount for the fast path).
        device: target device: "cpu" (the default, as safetensors), "cuda" (the current GPU),
            "cuda:N" or N. A CUDA device that does not exist raises RuntimeError.
        backend: safetensors' choice of how the file is read; on a gdsfs mount the daemon reads
            it, and off a mount it is passed to safetensors (where its version takes it).
        strict: raise GDSUnavailableError instead of falling back to plain reads.

    Returns:
        Tensor name -> tensor, in file order.

    Example:
        sd = load_file("/mnt/gdsfs/model.safetensors", device="cuda:0")
    """
    path = os.fspath(filename)
    dev = parse_device(device)
    on = on_gdsfs(path, strict=strict, cause=_OFF_MOUNT)
    if not on:
        real = _real_library()
        if real is not None:  # off gdsfs: the stock implementation, where it is installed
            if backend != "mmap":
                return real.load_file(path, device=str(dev), backend=backend)
            return real.load_file(path, device=str(dev))
    with open(path, "rb", buffering=_BUFFER) as fh:
        header = _read_header(fh, path)
        return _load_tensors(path, fh, list(header.tensors.values()), dev, on, strict)


def _real_library() -> Any:
    """safetensors.torch when the safetensors library is installed, else None."""
    try:
        import safetensors.torch as real
    except ImportError:
        return None
    return real


def load(data: bytes, device: str | int | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Decode safetensors bytes held in memory (mirrors ``safetensors.torch.load``; no daemon)."""
    import io

    fh = io.BytesIO(data)
    header = stformat.read_header(fh, len(data))
    dev = parse_device(device)
    out = {}
    for info in header.tensors.values():
        dt = _torch_dtype(info.dtype, info.name)
        raw = bytearray(data[info.offset : info.offset + info.nbytes])
        t = torch.frombuffer(raw, dtype=dt) if info.nbytes else torch.empty((0,), dtype=dt)
        out[info.name] = t.reshape(info.shape).to(dev)
    return out


def _check_tensors(tensors: dict[str, torch.Tensor]) -> None:
    if not isinstance(tensors, dict):
        raise ValueError(f"gdsfs: expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    spans: dict[Any, list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise ValueError(f"gdsfs: key {name!r} must be a str mapping to a torch.Tensor, not {type(t)}")
        if t.layout != torch.strided:
            raise ValueError(f"gdsfs: tensor {name!r} is {t.layout}; only dense tensors can be saved")
        if not t.is_contiguous():
            raise ValueError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. It either means "
                "you are trying to save tensors which are reference of each other in which case it's recommended "
                "to save only the full tensors, and reslice at load time, or simply call `.contiguous()` on your "
                "tensor to pack it before saving."
            )
        if t.dtype not in _FROM_TORCH:
            raise ValueError(f"gdsfs: tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        n = t.numel() * t.element_size()
        if n == 0:
            continue
        st = untyped_storage(t)
        start = st.data_ptr() + t.storage_offset() * t.element_size()
        spans.setdefault((t.device, st.data_ptr()), []).append((start, start + n, name))
    for group in spans.values():
        group.sort()
        for (a0, a1, an), (b0, _b1, bn) in zip(group, group[1:]):
            if b0 < a1:
                raise RuntimeError(
                    f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
                    f"differences when loading them again: [{{{an!r}, {bn!r}}}]. A potential way to correctly "
                    "save your model is to use `save_model`. More information at "
                    "https://huggingface.co/docs/safetensors/torch_shared_tensors"
                )


def save_file(
    tensors: dict[str, torch.Tensor],
    filename: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    *,
    align: int = 4096,
    sync: bool = True,
    strict: bool = False,
) -> None:
    """Save tensors as a safetensors file whose byte buffer starts ``align``-aligned, atomically.

    Args:
        tensors: name -> contiguous, non-overlapping tensor (any device).
        filename: destination path.
        metadata: optional ``__metadata__`` of strings.
        align: alignment of the byte buffer (power of two >= 8).
        sync: fsync file and directory (durability).
        strict: raise GDSUnavailableError instead of falling back to plain writes.

    Example:
        save_file({"w": torch.randn(4, 4, device="cuda")}, "/mnt/gdsfs/w.safetensors", {"step": "7"})
    """
    _check_tensors(tensors)
    path = os.fspath(filename)
    entries = [stformat.Entry(n, _FROM_TORCH[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    head, infos = stformat.layout(entries, metadata, align)
    on = on_gdsfs(path, strict=strict, cause=_OFF_MOUNT, doing="using plain writes")
    with atomic.replace(path, sync=sync) as (tmp, fd):
        items = [(infos[n].offset, byte_view(t)) for n, t in tensors.items() if infos[n].nbytes]
        if on:
            transfer(tmp, fd, items, write=True, strict=strict, sync=sync)
        else:
            PosixMover().write_from(fd, items)
        mv = memoryview(head)
        off = 0
        while off < len(mv):
            off += os.pwrite(fd, mv[off:], off)
        # Through the mount, after the daemon's writes: sets the size the kernel caches for the
        # file (and gives a file of empty tensors its full length).
        os.ftruncate(fd, len(head) + sum(i.nbytes for i in infos.values()))


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """Encode tensors as safetensors bytes in memory (mirrors ``safetensors.torch.save``; no daemon)."""
    _check_tensors(tensors)
    entries = [stformat.Entry(n, _FROM_TORCH[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    head, infos = stformat.layout(entries, metadata, 8)
    out = bytearray(head)
    out += bytes(sum(i.nbytes for i in infos.values()))
    for n, t in tensors.items():
        i = infos[n]
        if i.nbytes:
            out[i.offset : i.offset + i.nbytes] = memoryview(byte_view(t.detach().cpu()).numpy())
    return bytes(out)


class _Slice:
    """A lazily-read tensor of a safe_open file (mirrors safetensors' PySafeSlice)."""

    def __init__(self, owner: "safe_open", info: stformat.TensorInfo) -> None:
        self._owner = owner
        self._info = info

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The safetensors dtype name (e.g. "F32")."""
        return self._info.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        info = self._info
        idx = index if isinstance(index, tuple) else (index,)
        if not info.shape or not idx or idx[0] is Ellipsis:
            return self._owner.get_tensor(info.name)[index]
        first = idx[0]
        rows = info.shape[0]
        if isinstance(first, int):
            r = first + rows if first < 0 else first
            if not 0 <= r < rows:
                raise IndexError(f"index {first} is out of bounds for dimension 0 with size {rows}")
            lo, hi, rest = r, r + 1, (0,) + idx[1:]
        elif isinstance(first, slice):
            start, stop, step = first.indices(rows)
            if step <= 0:
                raise ValueError("gdsfs: slices with a non-positive step are not supported")
            lo, hi = start, max(start, stop)
            rest = (slice(0, hi - lo, step),) + idx[1:]
        else:
            return self._owner.get_tensor(info.name)[index]
        row_bytes = info.nbytes // rows if rows else 0
        block = self._owner._read(info, lo * row_bytes, (hi - lo) * row_bytes, (hi - lo,) + info.shape[1:])
        return block[rest]


class safe_open:
    """Open a safetensors file for lazy, per-tensor loads (mirrors ``safetensors.safe_open``).

    Args:
        filename: path of the file.
        framework: "pt" (torch), the only framework supported.
        device: where tensors are loaded ("cpu", "cuda", "cuda:N" or an index).

    Example:
        with safe_open("/mnt/gdsfs/model.safetensors", framework="pt", device="cuda") as f:
            w = f.get_tensor("layer.weight")
    """

    def __init__(self, filename: str | os.PathLike, framework: str, device: str | int = "cpu", *, strict: bool = False) -> None:
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"gdsfs: framework {framework!r} is not supported; use 'pt'")
        self._path = os.fspath(filename)
        self._dev = parse_device(device)
        self._strict = strict
        self._on = on_gdsfs(self._path, strict=strict, cause=_OFF_MOUNT)
        self._fh: Any = open(self._path, "rb", buffering=_BUFFER)
        try:
            self._header = _read_header(self._fh, self._path)
        except BaseException:
            self._fh.close()
            raise

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Close the file; idempotent."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _file(self) -> Any:
        if self._fh is None:
            raise RuntimeError("gdsfs: safe_open file is closed")
        return self._fh

    def keys(self) -> list[str]:
        """Tensor names, sorted (as safetensors returns them)."""
        return sorted(self._header.tensors)

    def offset_keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self._header.tensors)

    def metadata(self) -> dict[str, str] | None:
        """The ``__metadata__`` map, or None."""
        return None if self._header.metadata is None else dict(self._header.metadata)

    def _info(self, name: str) -> stformat.TensorInfo:
        info = self._header.tensors.get(name)
        if info is None:
            raise KeyError(f"gdsfs: no tensor {name!r} in {self._path!r}")
        return info

    def get_tensor(self, name: str) -> torch.Tensor:
        """Load one tensor to the device."""
        fh = self._file()
        return _load_tensors(self._path, fh, [self._info(name)], self._dev, self._on, self._strict)[name]

    def get_tensors(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Load several tensors in one batched request."""
        fh = self._file()
        return _load_tensors(self._path, fh, [self._info(n) for n in names], self._dev, self._on, self._strict)

    def get_slice(self, name: str) -> _Slice:
        """A lazy handle whose indexing reads only the rows it needs."""
        return _Slice(self, self._info(name))

    def _read(self, info: stformat.TensorInfo, rel: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        sub = stformat.TensorInfo(info.name, info.dtype, shape, info.offset + rel, nbytes)
        return _load_tensors(self._path, self._file(), [sub], self._dev, self._on, self._strict)[info.name]


# --- shared tensors (safetensors.torch.save_model / load_model) -----------------------------


def _storage_span(t: torch.Tensor) -> tuple[Any, int, int]:
    """(device, storage address, storage bytes) of a tensor: equal for tensors sharing memory."""
    st = untyped_storage(t)
    return (t.device, st.data_ptr(), st.nbytes())


def _covers_storage(t: torch.Tensor) -> bool:
    """True when t views its whole storage, from its first byte."""
    st = untyped_storage(t)
    return t.data_ptr() == st.data_ptr() and t.numel() * t.element_size() == st.nbytes()


def _shared_groups(state_dict: dict[str, torch.Tensor]) -> list[set[str]]:
    """Names of tensors that overlap in memory, grouped (singletons left out)."""
    by_storage: dict[Any, set[str]] = {}
    for name, t in state_dict.items():
        if t.device.type == "meta" or untyped_storage(t).data_ptr() == 0 or untyped_storage(t).nbytes() == 0:
            continue
        by_storage.setdefault(_storage_span(t), set()).add(name)
    groups: list[set[str]] = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        # Views of disjoint parts of one storage are not shared: split into overlapping runs.
        spans = sorted((state_dict[n].data_ptr(), state_dict[n].data_ptr() + state_dict[n].numel() * state_dict[n].element_size(), n)
                       for n in names)
        run: set[str] = set()
        end = -1
        for lo, hi, n in spans:
            if run and lo >= end:
                if len(run) > 1:
                    groups.append(run)
                run = set()
            run.add(n)
            end = max(end, hi)
        if len(run) > 1:
            groups.append(run)
    return groups


def _names_to_remove(state_dict: dict[str, torch.Tensor], preferred: Sequence[str] = ()) -> dict[str, list[str]]:
    """For each group of shared tensors: the name kept (one covering the whole storage, a
    preferred one first, else the first in sorted order) -> the names dropped."""
    pref = set(preferred)
    out: dict[str, list[str]] = {}
    for group in _shared_groups(state_dict):
        complete = sorted(n for n in group if _covers_storage(state_dict[n]))
        if not complete:
            raise RuntimeError(
                f"gdsfs: tensors {sorted(group)} share memory but none covers the whole storage, so saving "
                "one would store more (or less) than the model has: save a copy of each "
                "(.clone()) and use save_file; see https://huggingface.co/docs/safetensors/torch_shared_tensors"
            )
        keep = next((n for n in complete if n in pref), complete[0])
        out[keep] = [n for n in sorted(group) if n != keep]
    return out


def save_model(model: torch.nn.Module, filename: str | os.PathLike, metadata: dict[str, str] | None = None,
               force_contiguous: bool = True) -> None:
    """Save a model's state dict, storing tensors that share memory (tied weights) once
    (mirrors ``safetensors.torch.save_model``): each dropped name is recorded in the metadata as
    ``{dropped: kept}``, which ``load_model`` uses.

    Args:
        model: the module.
        filename: destination path.
        metadata: optional ``__metadata__`` of strings (entries of the same name are kept).
        force_contiguous: make every tensor contiguous first (may copy).
    """
    state_dict = model.state_dict()
    for kept, dropped in _names_to_remove(state_dict).items():
        for name in dropped:
            if metadata is None:
                metadata = {}
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    try:
        save_file(state_dict, filename, metadata=metadata)
    except ValueError as e:
        raise ValueError(f"{e}. Or use save_model(..., force_contiguous=True), read the docs for potential caveats.") from None


def load_model(model: torch.nn.Module, filename: str | os.PathLike, strict: bool = True,
               device: str | int | torch.device = "cpu", *, backend: str = "mmap") -> tuple[list[str], list[str]]:
    """Load a file written by ``save_model`` (or ``save_file``) into a model (mirrors
    ``safetensors.torch.load_model``): tied names the file stores once are filled by the model's
    own sharing.

    Args:
        model: the module to fill.
        filename: the file.
        strict: raise RuntimeError on missing or unexpected names.
        device: where the tensors are loaded first.
        backend: passed on to load_file (safetensors' reader choice, used off a mount).

    Returns:
        (missing, unexpected) names.
    """
    state_dict = load_file(filename, device=device, backend=backend)
    to_remove = _names_to_remove(model.state_dict(), preferred=list(state_dict))
    missing_keys, unexpected = model.load_state_dict(state_dict, strict=False)
    missing = set(missing_keys)
    unexpected = list(unexpected)
    for dropped in to_remove.values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = f"Error(s) in loading state_dict for {model.__class__.__name__}:"
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in sorted(unexpected))
        raise RuntimeError(error)
    return sorted(missing), unexpected
