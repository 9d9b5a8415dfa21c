"""Decoding a torch.save pickle without reading storage bytes; weights-only loads by torch's rules.

torch.load fetches each storage record when the unpickler meets its persistent id. We instead
hand the unpickler an empty storage of the right size on the target device and remember where its
bytes live; tensors are rebuilt as views of those storages as usual. After unpickling, the caller
fills every storage with one batched read. Views sharing a storage (``t`` and ``t.t()``) share it
here too, exactly as in torch.load.

``weights_only=True`` runs the installed torch's own weights-only unpickler
(``torch._weights_only_unpickler``, what ``torch.load(weights_only=True)`` runs) with our
``persistent_load``, so a file loads here exactly when torch.load would load it: the same
allowlist of globals for each torch version (storage classes such as ``torch.storage.UntypedStorage``,
dtypes, rebuild functions, containers), the same BUILD/NEWOBJ rules, and the globals a user added
with ``torch.serialization.add_safe_globals``. (A private allowlist of our own drifted from torch's:
torch 2.x pickles tensors of its newer dtypes over ``torch.storage.UntypedStorage``, which it
accepts and ours refused.)
"""

from __future__ import annotations

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
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)  # type: ignore[call-arg]
    except TypeError:  # torch < 2.0 has no _internal
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype)


def _maybe_decode_ascii(x: Any) -> Any:
    return x.decode("ascii") if isinstance(x, bytes) else x


class StorageLoader:
    """``persistent_load`` for torch.save pickles: empty storages now, their byte ranges for later.

    Args:
        restore: maps a saved location string ("cpu", "cuda:0") to the target torch.device.
        records: record name -> byte size of the archive (``data/<key>``), for validation.
    """

    def __init__(self, restore: Callable[[str], torch.device], records: dict[str, int]) -> None:
        self._restore = restore
        self._records = records
        self.pending: dict[str, PendingStorage] = {}

    def persistent_load(self, pid: Any) -> Any:
        """The storage named by a ``("storage", type, key, location, numel)`` persistent id."""
        if not isinstance(pid, tuple) or len(pid) != 5 or _maybe_decode_ascii(pid[0]) != "storage":
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r} in a torch.save pickle")
        _, storage_type, key, location, numel = pid
        key = _maybe_decode_ascii(key)
        location = _maybe_decode_ascii(location)
        if storage_type is torch.UntypedStorage:
            dtype = torch.uint8  # numel counts bytes (torch 2.x: tensors of the newer dtypes)
        else:
            # torch.serialization.StorageType (torch 2.x) or a legacy class (torch.FloatStorage).
            found = getattr(storage_type, "dtype", None)
            if not isinstance(found, torch.dtype):
                raise pickle.UnpicklingError(f"unknown storage type {storage_type!r} for record {key!r}")
            dtype = found
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


class _FullUnpickler(pickle.Unpickler):
    """torch.load's unpickler for ``weights_only=False``: any global, storage names mapped."""

    def find_class(self, module: str, name: str) -> Any:
        if type(name) is str and "Storage" in name:
            try:
                return torch.serialization.StorageType(name)
            except KeyError:
                pass
        if module == "torch.tensor":  # renamed module (pytorch#51633), as torch.load maps it
            module = "torch._tensor"
        return super().find_class(module, name)


def unpickle(
    data: bytes,
    restore: Callable[[str], torch.device],
    records: dict[str, int],
    *,
    weights_only: bool,
    **kwargs: Any,
) -> tuple[Any, dict[str, PendingStorage]]:
    """Unpickle torch.save's ``data.pkl``, deferring every storage's bytes.

    Args:
        data: the pickle bytes.
        restore: maps a saved location string to the target torch.device.
        records: record name -> byte size of the archive, for validation.
        weights_only: load under torch's weights-only rules (torch's own unpickler).
        kwargs: extra unpickler arguments, as torch.load's ``pickle_load_args`` (``encoding``, ...).

    Returns:
        (the object, record key -> storage still to fill).
    """
    loader = StorageLoader(restore, records)
    if weights_only:
        from torch import _weights_only_unpickler

        up: Any = _weights_only_unpickler.Unpickler(io.BytesIO(data), **kwargs)
    else:
        up = _FullUnpickler(io.BytesIO(data), **kwargs)
    up.persistent_load = loader.persistent_load
    return up.load(), loader.pending
