"""torch.save / torch.load through gdsfs.

``gdsfs.checkpoint.save(obj, f)`` writes a standard torch.save zip whose storage records start on
4096-byte boundaries; the storage bytes go from the tensors' memory (GPU or host) to the file
through the daemon's write path, and the file replaces ``f`` atomically and durably.
``gdsfs.checkpoint.load(f, map_location=...)`` reads any torch.save zip (torch's default 64-byte
alignment included): the pickle is decoded here, every storage is fetched in one batched request
straight into memory on the target device, and tensors are rebuilt exactly as torch.load does.

Off a gdsfs mount, or when the daemon cannot serve, both fall back (with the one-time
GDSFallbackWarning) to plain I/O: ``load`` to ``torch.load`` itself, ``save`` to the same writer
with ``pwrite``, still atomic. File objects (not paths) always go to torch.save/torch.load.

Example:
    import gdsfs.checkpoint as ckpt
    ckpt.save(model.state_dict(), "/mnt/gdsfs/ckpt/step_1000.pt")
    sd = ckpt.load("/mnt/gdsfs/ckpt/step_1000.pt", map_location="cuda")
"""

from __future__ import annotations

import inspect
import os
import pickle
import threading
from typing import IO, Any, BinaryIO, Callable, Union

import torch

from gdsfs._ckpt import atomic, torchzip, zipfmt
from gdsfs._ckpt.tensorio import BUFFER as _BUFFER, PosixMover, transfer
from gdsfs._core import on_gdsfs
from gdsfs._devices import parse_device
from gdsfs._errors import warn_fallback

__all__ = ["save", "load"]

FILE_LIKE = Union[str, os.PathLike, BinaryIO, IO[bytes]]
MAP_LOCATION = Union[Callable[[torch.Tensor, str], torch.Tensor], torch.device, str, dict, None]

_DEFAULT_PROTOCOL = 2
_OFF_MOUNT = "off-mount checkpoint"


def _torch_load_params() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(torch.load).parameters)


def _default_weights_only() -> bool:
    """torch.load's own default: False before 2.6, True from 2.6 (unless the env overrides)."""
    p = _torch_load_params().get("weights_only")
    if p is None:
        return False
    if p.default is None:  # 2.6+: resolved at call time
        if os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "0") not in ("0", ""):
            return False
        return True
    return bool(p.default)


def _as_path(f: FILE_LIKE) -> str | None:
    """f as a path, None for a file object."""
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else None


def _stock_load(f: FILE_LIKE, map_location: MAP_LOCATION, pickle_module: Any, weights_only: bool,
                mmap: bool | None, pickle_load_args: dict[str, Any]) -> Any:
    params = _torch_load_params()
    kw: dict[str, Any] = dict(pickle_load_args)
    if "weights_only" in params:
        kw["weights_only"] = weights_only
    if mmap is not None:
        if "mmap" not in params:
            raise TypeError(f"gdsfs: torch {torch.__version__} has no torch.load(mmap=...); drop the mmap argument")
        kw["mmap"] = mmap
    return torch.load(f, map_location, pickle_module, **kw)


def _map_device(loc: Any) -> torch.device:
    return parse_device(loc if isinstance(loc, (int, torch.device)) else str(loc), what="map_location")


def _restorer(map_location: MAP_LOCATION) -> Callable[[str], torch.device] | None:
    """A location -> device function for the supported map_location forms, None for callables."""
    if map_location is None:
        return _map_device
    if isinstance(map_location, (str, torch.device)):
        fixed = _map_device(map_location)
        return lambda _loc: fixed
    if isinstance(map_location, dict):
        table = dict(map_location)
        return lambda loc: _map_device(table.get(loc, loc))
    return None


def load(
    f: FILE_LIKE,
    map_location: MAP_LOCATION = None,
    pickle_module: Any = None,
    *,
    weights_only: bool | None = None,
    mmap: bool | None = None,
    strict: bool = False,
    **pickle_load_args: Any,
) -> Any:
    """Load an object saved with torch.save (or :func:`save`), fetching storages through gdsfs.

    Args:
        f: path of the checkpoint. File objects are handed to ``torch.load``.
        map_location: as torch.load: None (saved devices), a device or string, or a dict of
            location strings. A callable goes to ``torch.load``.
        pickle_module: as torch.load; a custom module goes to ``torch.load``.
        weights_only: as torch.load; None means the installed torch's default. True runs the
            installed torch's weights-only unpickler, so exactly the files torch.load accepts load.
        mmap: as torch.load; ``True`` goes to ``torch.load`` (a lazy CPU mapping is not a
            transfer gdsfs can speed up).
        strict: raise GDSUnavailableError instead of falling back to plain reads.
        pickle_load_args: passed to the unpickler (e.g. ``encoding``).

    Returns:
        The unpickled object, tensors on the mapped devices.

    Example:
        sd = gdsfs.checkpoint.load("/mnt/gdsfs/ckpt.pt", map_location="cuda:0")
    """
    if weights_only is None:
        # As torch.load: an explicit pickle_module means the caller trusts the file.
        wo = _default_weights_only() and pickle_module is None
    else:
        wo = bool(weights_only)
    if wo and pickle_module is not None:
        raise RuntimeError("Can not safely load weights when explicit pickle_module is specified")
    if "encoding" not in pickle_load_args:
        pickle_load_args["encoding"] = "utf-8"
    restore = _restorer(map_location)
    path = _as_path(f)
    if path is None or mmap or restore is None or pickle_module is not None:
        return _stock_load(f, map_location, pickle_module, wo, mmap, pickle_load_args)
    if not on_gdsfs(path, strict=strict, cause=_OFF_MOUNT):
        return _stock_load(f, map_location, pickle_module, wo, mmap, pickle_load_args)
    try:
        return _load_path(path, restore, wo, pickle_load_args, strict=strict, via_daemon=True)
    except torchzip.NotAddressable as e:
        if _is_safetensors(path):
            raise ValueError(f"gdsfs: {path!r} is a safetensors file, not a torch.save archive: load it with "
                             "gdsfs.safetensors.load_file") from None
        warn_fallback(f"{path!r} needs torch.load ({e})", strict=strict)
        return _stock_load(f, map_location, pickle_module, wo, mmap, pickle_load_args)


def _is_safetensors(path: str) -> bool:
    """True when path starts like a safetensors file: a little-endian u64 header length, then '{'."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return False
    return len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < 100_000_000


def _load_path(path: str, restore: Callable[[str], torch.device], weights_only: bool,
               pickle_load_args: dict[str, Any], *, strict: bool, via_daemon: bool) -> Any:
    """Decode the archive at ``path`` and fill its storages in one batched transfer."""
    with open(path, "rb", buffering=_BUFFER) as fh:
        try:
            dec = torchzip.decode(fh, 0, os.fstat(fh.fileno()).st_size, restore, weights_only=weights_only,
                                  pickle_load_args=pickle_load_args)
        except zipfmt.ZipFormatError as e:
            why = str(e).removeprefix("zip: ")
            raise zipfmt.ZipFormatError(f"gdsfs: {path!r} is not a readable torch.save archive ({why}): it is truncated "
                                        "or corrupt; save it again, or check that it is the file you meant") from None
        if via_daemon:
            transfer(path, fh.fileno(), dec.items, write=False, strict=strict)
        else:
            PosixMover().read_into(fh.fileno(), dec.items)
    torch._utils._validate_loaded_sparse_tensors()
    return dec.obj


def save(
    obj: object,
    f: FILE_LIKE,
    pickle_module: Any = pickle,
    pickle_protocol: int = _DEFAULT_PROTOCOL,
    _use_new_zipfile_serialization: bool = True,
    _disable_byteorder_record: bool = False,
    *,
    storage_alignment: int = 4096,
    sync: bool = True,
    strict: bool = False,
) -> None:
    """Save ``obj`` like torch.save, storage bytes moving through gdsfs, atomically.

    The result is a standard torch.save zip (loadable by ``torch.load``) whose storage records
    start on ``storage_alignment`` boundaries. It is written under a temporary name in the same
    directory, fsynced, renamed over ``f`` and the directory fsynced: a crash leaves the old file
    or the new one.

    Args:
        obj: what to save (anything torch.save accepts).
        f: destination path. File objects are handed to ``torch.save`` (no atomic replace).
        pickle_module, pickle_protocol, _use_new_zipfile_serialization, _disable_byteorder_record:
            as torch.save.
        storage_alignment: alignment of every storage record (a power of two >= 64).
        sync: fsync file and directory (durability); False leaves it to the OS.
        strict: raise GDSUnavailableError instead of falling back to plain writes.

    Example:
        gdsfs.checkpoint.save({"model": model.state_dict(), "step": 1000}, "/mnt/gdsfs/ckpt.pt")
    """
    path = _as_path(f)
    if path is None or not _use_new_zipfile_serialization:
        kw: dict[str, Any] = {}
        if _disable_byteorder_record:
            kw["_disable_byteorder_record"] = True
        torch.save(obj, f, pickle_module, pickle_protocol, _use_new_zipfile_serialization, **kw)
        return
    arc = torchzip.build(obj, _archive_name(path), pickle_module=pickle_module, protocol=pickle_protocol,
                         alignment=storage_alignment, byteorder_record=not _disable_byteorder_record)
    via_daemon = on_gdsfs(path, strict=strict, cause=_OFF_MOUNT, doing="using plain writes")
    with atomic.replace(path, sync=sync) as (tmp, fd):
        # CRCs of host-memory storages (a full read of them) run alongside the transfer.
        items = arc.data_items(0, crc=False)
        crc_error: list[BaseException] = []

        def crc32s() -> None:
            try:
                arc.compute_crcs()
            except BaseException as e:  # raised below, in the saving thread
                crc_error.append(e)

        crcs = threading.Thread(target=crc32s, name="gdsfs-crc32", daemon=True)
        crcs.start()
        try:
            if via_daemon:
                transfer(tmp, fd, items, write=True, strict=strict, sync=sync)
            else:
                PosixMover().write_from(fd, items)
        finally:
            crcs.join()
        if crc_error:
            raise crc_error[0]
        # Metadata last, through the mount: the central directory ends the file, so this write
        # (not the daemon's) sets the size the kernel caches for it.
        for off, b in arc.metadata_writes(0):
            torchzip.pwrite_all(fd, b, off)


def _archive_name(path: str) -> str:
    """torch names the archive folder after the file stem; non-ASCII stems become "archive"."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return stem if stem and stem.isascii() and "/" not in stem else "archive"
