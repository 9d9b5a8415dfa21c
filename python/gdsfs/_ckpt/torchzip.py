"""torch.save archives as gdsfs builds and reads them: pickle + planned zip + storage byte lists.

Shared by gdsfs.checkpoint (one archive per file) and gdsfs.dcp (one archive per tensor item,
several per ``.distcp`` file). Building gives the metadata bytes to write with pwrite and the
storage byte ranges to hand to a Mover; reading decodes the pickle with storages left empty and
gives the byte ranges to fill them from.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import sys
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

import torch

from gdsfs._ckpt import zipfmt
from gdsfs._ckpt.tensorio import storage_bytes
from gdsfs._ckpt.unpickle import unpickle


def storage_info(obj: Any) -> tuple[Any, torch.dtype, Any, int] | None:
    """(untyped storage, dtype, pickled storage type, numel) for storages, as torch.save sees them."""
    if isinstance(obj, torch.storage.TypedStorage):
        untyped = getattr(obj, "_untyped_storage", None)
        if untyped is None:
            untyped = obj._storage  # torch < 2.0
        type_str = obj._pickle_storage_type() if hasattr(obj, "_pickle_storage_type") else obj.pickle_storage_type()
        numel = obj._size() if hasattr(obj, "_size") else obj.size()
        return untyped, obj.dtype, getattr(torch, type_str), numel
    if torch.is_storage(obj):
        return obj, torch.uint8, torch.serialization.normalize_storage_type(type(obj)), obj.nbytes()
    return None


def pickle_obj(obj: object, pickle_module: Any = pickle, protocol: int = 2,
               location: str | None = None) -> tuple[dict[str, Any], bytes]:
    """Pickle ``obj`` with torch.save's persistent ids.

    Args:
        location: record this location for every storage instead of its device's tag (DCP
            items say "cpu" because stock DCP moves tensors to the host before saving).

    Returns:
        (key -> untyped storage, data.pkl bytes).
    """
    storages: dict[str, Any] = {}
    id_map: dict[int, str] = {}
    dtypes: dict[int, torch.dtype] = {}

    class _Pickler(pickle_module.Pickler):
        def persistent_id(self, o: Any) -> Any:
            info = storage_info(o)
            if info is None:
                return None
            untyped, dtype, storage_type, numel = info
            if untyped.device.type == "meta":
                raise ValueError("gdsfs: cannot save a tensor on the meta device (it has no data)")
            ptr = untyped.data_ptr()
            if ptr != 0 and dtypes.setdefault(ptr, dtype) != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
            key = id_map.setdefault(untyped._cdata, str(len(id_map)))
            storages[key] = untyped
            loc = location if location is not None else torch.serialization.location_tag(untyped)
            return ("storage", storage_type, key, loc, numel)

    buf = io.BytesIO()
    _Pickler(buf, protocol=protocol).dump(obj)
    return storages, buf.getvalue()


@dataclass
class Archive:
    """A planned torch.save archive: its zip plan and the storages behind its data records."""

    plan: zipfmt.Plan
    storages: list[tuple[zipfmt.Record, Any]]

    @property
    def size(self) -> int:
        """Bytes of the finished archive."""
        return self.plan.total_size()

    def data_items(self, base: int, *, crc: bool = True) -> list[tuple[int, torch.Tensor]]:
        """(absolute offset, uint8 tensor) of every non-empty storage, archive placed at ``base``.

        With ``crc``, sets the CRC of records whose bytes are in host memory (else call
        :meth:`compute_crcs` before :meth:`metadata_writes`); device-resident records keep CRC 0
        (torch.save's ``compute_crc32=False`` output; torch.load does not check it).
        """
        out = []
        for rec, st in self.storages:
            if rec.size == 0:
                continue
            out.append((base + rec.data_offset, storage_bytes(st, 0, rec.size)))
        if crc:
            self.compute_crcs()
        return out

    def compute_crcs(self) -> None:
        """Set the CRC of every record whose bytes are in host memory. zlib releases the GIL, so
        a thread running this overlaps the transfer of the same bytes (both only read them)."""
        for rec, st in self.storages:
            if rec.size and st.device.type == "cpu":
                rec.crc = zlib.crc32(memoryview(storage_bytes(st, 0, rec.size).numpy()))

    def metadata_writes(self, base: int) -> list[tuple[int, bytes]]:
        """(absolute offset, bytes) of headers, small records and central directory; call after
        :meth:`data_items` so CRCs are final."""
        out = []
        for r in self.plan.records:
            out.append((base + r.header_offset, self.plan.local_header(r) + (r.data or b"")))
        out.append((base + self.plan.central_offset, self.plan.central_directory()))
        return out


def build(obj: object, archive: str, *, pickle_module: Any = pickle, protocol: int = 2, alignment: int = 4096,
          byteorder_record: bool = True, location: str | None = None) -> Archive:
    """Pickle ``obj`` and plan its archive with storage records on ``alignment`` boundaries."""
    if alignment < 64 or alignment & (alignment - 1):
        raise ValueError(f"gdsfs: storage_alignment {alignment} must be a power of two >= 64")
    storages, data_pkl = pickle_obj(obj, pickle_module, protocol, location)
    records = [zipfmt.Record("data.pkl", len(data_pkl), data_pkl)]
    small = [(".format_version", b"1"), (".storage_alignment", str(alignment).encode())]
    if byteorder_record:
        small.append(("byteorder", sys.byteorder.encode()))
    records += [zipfmt.Record(n, len(b), b) for n, b in small]
    data = []
    for k in sorted(storages, key=int):
        rec = zipfmt.Record(f"data/{k}", storages[k].nbytes(), None, align=alignment)
        records.append(rec)
        data.append((rec, storages[k]))
    records.append(zipfmt.Record("version", 2, b"3\n"))
    sid = "".join(secrets.choice("0123456789") for _ in range(40)).encode()
    records.append(zipfmt.Record(".data/serialization_id", len(sid), sid))
    return Archive(zipfmt.plan(archive, records), data)


def pwrite_all(fd: int, b: bytes, off: int) -> None:
    """pwrite every byte of ``b`` at ``off``."""
    mv = memoryview(b)
    while mv:
        n = os.pwrite(fd, mv, off)
        mv = mv[n:]
        off += n


class SubFile(io.RawIOBase):
    """A read-only, seekable window ``[base, base+length)`` of an open binary file."""

    def __init__(self, f: BinaryIO, base: int, length: int) -> None:
        super().__init__()
        self._f = f
        self._base = base
        self._len = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, off: int, whence: int = 0) -> int:
        if whence == 0:
            pos = off
        elif whence == 1:
            pos = self._pos + off
        else:
            pos = self._len + off
        if pos < 0:
            raise ValueError("gdsfs: negative seek position")
        self._pos = pos
        return pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._base + self._pos)
        with memoryview(b) as mv, mv[:n] as part:  # released here, not by a traceback later
            got = self._f.readinto(part)  # type: ignore[attr-defined]  # typing.BinaryIO omits it; binary files have it
        self._pos += got or 0
        return got or 0


@dataclass
class Decoded:
    """A torch.save archive decoded with empty storages: the object and what fills them."""

    obj: Any
    items: list[tuple[int, torch.Tensor]]  # (absolute file offset, uint8 dest) per storage


class NotAddressable(Exception):
    """The archive must go through torch.load (legacy format, TorchScript, foreign byte order)."""


def decode(f: BinaryIO, base: int, length: int, restore: Callable[[str], torch.device], *, weights_only: bool,
           pickle_load_args: dict[str, Any] | None = None) -> Decoded:
    """Decode the archive at ``[base, base+length)`` of ``f`` without reading storage bytes.

    Raises:
        NotAddressable: the caller must use torch.load for this archive.
    """
    sub = SubFile(f, base, length)
    if sub.read(4) != b"PK\x03\x04":
        raise NotAddressable("not a zip archive (legacy torch.save format)")
    sub.seek(0)
    _, recs = zipfmt.locate(sub)  # type: ignore[arg-type]
    if "constants.pkl" in recs or "data.pkl" not in recs:
        raise NotAddressable("TorchScript archive")
    if "byteorder" in recs:
        order = _read(sub, recs["byteorder"])
        if order not in (b"little", b"big"):
            raise zipfmt.ZipFormatError(f"zip: byteorder record holds {order[:16]!r}, not 'little' or 'big'")
        if order.decode() != sys.byteorder:
            raise NotAddressable("saved in the other byte order")
    try:
        obj, pending = unpickle(
            _read(sub, recs["data.pkl"]),
            restore,
            {name: r.size for name, r in recs.items()},
            weights_only=weights_only,
            **(pickle_load_args or {"encoding": "utf-8"}),
        )
    except Exception as e:
        # As torch.load: under weights_only every failure of the pickle is an UnpicklingError
        # (a corrupt or hostile file is an error, never a crash); otherwise errors pass through.
        if weights_only:
            raise pickle.UnpicklingError(f"Weights only load failed: {type(e).__name__}: {e}") from None
        raise
    items = [(base + recs[f"data/{p.key}"].offset, p.dest) for p in pending.values() if p.nbytes]
    return Decoded(obj, items)


def _read(f: Any, r: zipfmt.Located) -> bytes:
    f.seek(r.offset)
    b = f.read(r.size)
    if len(b) != r.size:
        raise EOFError(f"gdsfs: archive ends inside record {r.name!r}")
    return b
