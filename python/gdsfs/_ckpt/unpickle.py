"""Decoding a torch.save pickle without reading storage bytes, and the weights-only allowlist.

torch.load fetches each storage record when the unpickler meets its persistent id. We instead
hand the unpickler an empty storage of the right size on the target device and remember where its
bytes live; tensors are rebuilt as views of those storages as usual. After unpickling, the caller
fills every storage with one batched read. Views sharing a storage (``t`` and ``t.t()``) share it
here too, exactly as in torch.load.

``weights_only=True`` restricts globals to an allowlist of tensor-rebuilding functions, torch
value types and plain containers, like torch's weights-only unpickler: a pickle that names any
other callable is refused before anything is called.
"""

from __future__ import annotations

import _compat_pickle
import codecs
import collections
import functools
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gdsfs._ckpt.tensorio import storage_bytes, untyped_storage


@dataclass
class PendingStorage:
    """One storage the pickle referenced: its record key, bytes, and the empty storage to fill."""

    key: str
    nbytes: int
    location: str
    device: torch.device
    storage: Any  # untyped storage of nbytes on device
    dest: torch.Tensor  # flat uint8 view of storage


def _typed(untyped: Any, dtype: torch.dtype) -> Any:
    try:
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)
    except TypeError:  # torch < 2.0 has no _internal
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype)


def _maybe_decode_ascii(x: Any) -> Any:
    return x.decode("ascii") if isinstance(x, bytes) else x


def _rebuild_from_type_v2_checked(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    if func not in _allowlist()[1] or new_type not in (torch.Tensor, torch.nn.Parameter):
        raise pickle.UnpicklingError(
            f"weights-only load: refusing to rebuild {getattr(new_type, '__name__', new_type)!r} with {func!r}"
        )
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


@functools.lru_cache(maxsize=1)
def _allowlist() -> tuple[dict[tuple[str, str], Any], frozenset[Any]]:
    """(module, name) -> object allowed under weights_only, and the tensor rebuilders among them.

    Built once per process from torch's own module dictionary (never dir()/getattr on torch,
    which would import lazily-loaded subsystems such as torch._dynamo).
    """
    out: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "bytearray"): bytearray,
        ("builtins", "complex"): complex,
        ("_codecs", "encode"): codecs.encode,  # protocol-2 pickles of bytes
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2_checked,
    }
    rebuilders = set()
    utils = vars(torch._utils)
    for name in (
        "_rebuild_tensor_v2",
        "_rebuild_tensor_v3",
        "_rebuild_parameter",
        "_rebuild_parameter_with_state",
        "_rebuild_meta_tensor_no_storage",
        "_rebuild_sparse_tensor",
        "_rebuild_qtensor",
        "_rebuild_nested_tensor",
    ):
        fn = utils.get(name)
        if fn is not None:
            out[("torch._utils", name)] = fn
            rebuilders.add(fn)
    layout = vars(torch.serialization).get("_get_layout")
    if layout is not None:
        out[("torch.serialization", "_get_layout")] = layout
    for n, v in list(vars(torch).items()):
        if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
            out[("torch", n)] = v
    return out, frozenset(rebuilders)


class TorchUnpickler(pickle.Unpickler):
    """Unpickles torch.save's ``data.pkl``, deferring every storage's bytes.

    Args:
        data: the pickle bytes.
        restore: maps a saved location string ("cpu", "cuda:0") to the target torch.device.
        records: record name -> byte size of the archive (``data/<key>``), for validation.
        weights_only: restrict globals to the allowlist.
        kwargs: extra ``pickle.Unpickler`` arguments (``encoding``, ...).
    """

    def __init__(
        self,
        data: bytes,
        restore: Callable[[str], torch.device],
        records: dict[str, int],
        *,
        weights_only: bool,
        **kwargs: Any,
    ) -> None:
        super().__init__(io.BytesIO(data), **kwargs)
        self._restore = restore
        self._records = records
        self._weights_only = weights_only
        self._allowed = _allowlist()[0] if weights_only else None
        self.pending: dict[str, PendingStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        if type(name) is str and "Storage" in name:
            try:
                return torch.serialization.StorageType(name)
            except KeyError:
                pass
        # Protocol-2 pickles name Python 2 modules (__builtin__.set); map them as pickle does.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if module == "torch.tensor":  # renamed module (pytorch#51633), as torch.load maps it
            module = "torch._tensor"
        if self._allowed is not None:
            if (module, name) == ("torch", "UntypedStorage"):
                return torch.UntypedStorage
            got = self._allowed.get((module, name))
            if got is None:
                raise pickle.UnpicklingError(
                    f"weights-only load refuses global {module}.{name}; load with weights_only=False "
                    "only if you trust the file"
                )
            return got
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) != 5 or _maybe_decode_ascii(pid[0]) != "storage":
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r} in a torch.save pickle")
        _, storage_type, key, location, numel = pid
        key = _maybe_decode_ascii(key)
        location = _maybe_decode_ascii(location)
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8
        else:
            dtype = getattr(storage_type, "dtype", None)
            if not isinstance(dtype, torch.dtype):
                raise pickle.UnpicklingError(f"unknown storage type {storage_type!r} for record {key!r}")
        if not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"malformed storage id {pid!r}")
        p = self.pending.get(key)
        if p is None:
            nbytes = numel * torch._utils._element_size(dtype)
            have = self._records.get(f"data/{key}")
            if have is None:
                raise pickle.UnpicklingError(f"storage record data/{key} is missing from the archive")
            if have != nbytes:
                raise pickle.UnpicklingError(f"storage record data/{key} has {have} bytes, the pickle expects {nbytes}")
            device = self._restore(str(location))
            buf = torch.empty((nbytes,), dtype=torch.uint8, device=device)
            st = untyped_storage(buf)
            p = PendingStorage(key, nbytes, str(location), device, st, storage_bytes(st, 0, nbytes))
            self.pending[key] = p
        return _typed(p.storage, dtype)
