"""The torch.save zip container: a writer with aligned stored records, and a record locator.

torch.save writes an uncompressed ("stored") zip whose entries all live under one folder, the
archive name (``data.pkl``, ``data/<key>``, ``version``, ...). Readers (torch's miniz-based
PyTorchStreamReader, Python's zipfile) take sizes from the central directory and find each record's
bytes at ``local header offset + 30 + name length + extra length``. torch pads the local header's
extra field (id ``FB``) so record data starts on an alignment boundary; we do the same with 4096 so
the daemon moves storages without realigning.

Unlike torch we write sizes and CRCs in the local headers (no data descriptors): every byte is
placed with positional writes after the data is in the file, so nothing is streamed. A record whose
bytes never pass through host memory (GPU -> daemon -> file) gets CRC 0, exactly what torch.save
writes with ``compute_crc32=False``; torch.load does not check record CRCs.

Standard library only.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import BinaryIO

_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_EOCD_SIG = 0x06054B50
_EOCD64_SIG = 0x06064B50
_LOCATOR64_SIG = 0x07064B50
_LOCAL_FIXED = 30
_CENTRAL_FIXED = 46
_U32_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF
# 1980-01-01 00:00: the earliest valid DOS date; torch writes zeros, which some tools reject.
_DOS_DATE = (0 << 9) | (1 << 5) | 1
_DOS_TIME = 0
_FLAG_UTF8 = 0x0800


class ZipFormatError(ValueError):
    """An archive that is not a torch.save zip we can address."""


@dataclass
class Record:
    """One stored record: its name inside the archive folder, size, and (once known) CRC-32.

    ``data`` holds the bytes of small records written by the planner itself (``data.pkl``,
    ``version``, ...); storage records leave it ``None`` and their bytes are written by the caller
    at ``data_offset``.
    """

    name: str
    size: int
    data: bytes | None = None
    align: int = 64
    crc: int = 0
    header_offset: int = field(default=0, init=False)
    data_offset: int = field(default=0, init=False)
    _extra: bytes = field(default=b"", init=False, repr=False)


@dataclass
class Plan:
    """The placement of every record of one archive; produced by :func:`plan`."""

    archive: str
    records: list[Record]
    central_offset: int  # where the central directory starts (= end of the last record)

    def local_header(self, r: Record) -> bytes:
        """The local file header of ``r`` (with its alignment padding), to write at ``r.header_offset``."""
        fname = _fullname(self.archive, r.name)
        big = r.size >= _U32_MAX
        return struct.pack(
            "<IHHHHHIIIHH",
            _LOCAL_SIG,
            45 if big else 20,
            _flags(fname),
            0,
            _DOS_TIME,
            _DOS_DATE,
            r.crc,
            _U32_MAX if big else r.size,
            _U32_MAX if big else r.size,
            len(fname),
            len(r._extra),
        ) + fname + r._extra

    def central_directory(self) -> bytes:
        """Central directory and end records; write at ``central_offset`` after every CRC is set."""
        out = bytearray()
        for r in self.records:
            fname = _fullname(self.archive, r.name)
            z64 = b""
            if r.size >= _U32_MAX:
                z64 += struct.pack("<QQ", r.size, r.size)
            if r.header_offset >= _U32_MAX:
                z64 += struct.pack("<Q", r.header_offset)
            extra = struct.pack("<HH", 1, len(z64)) + z64 if z64 else b""
            out += struct.pack(
                "<IHHHHHHIIIHHHHHII",
                _CENTRAL_SIG,
                45 if z64 else 20,
                45 if z64 else 20,
                _flags(fname),
                0,
                _DOS_TIME,
                _DOS_DATE,
                r.crc,
                _U32_MAX if r.size >= _U32_MAX else r.size,
                _U32_MAX if r.size >= _U32_MAX else r.size,
                len(fname),
                len(extra),
                0,
                0,
                0,
                0,
                min(r.header_offset, _U32_MAX),
            )
            out += fname + extra
        cd_size = len(out)
        n = len(self.records)
        cd_off = self.central_offset
        if n >= _U16_MAX or cd_size >= _U32_MAX or cd_off >= _U32_MAX:
            eocd64_off = cd_off + cd_size
            out += struct.pack("<IQHHIIQQQQ", _EOCD64_SIG, 44, 45, 45, 0, 0, n, n, cd_size, cd_off)
            out += struct.pack("<IIQI", _LOCATOR64_SIG, 0, eocd64_off, 1)
        out += struct.pack(
            "<IHHHHIIH",
            _EOCD_SIG,
            0,
            0,
            min(n, _U16_MAX),
            min(n, _U16_MAX),
            min(cd_size, _U32_MAX),
            min(cd_off, _U32_MAX),
            0,
        )
        return bytes(out)

    def total_size(self) -> int:
        """File size of the finished archive."""
        return self.central_offset + len(self.central_directory())


def _fullname(archive: str, name: str) -> bytes:
    return f"{archive}/{name}".encode("utf-8")


def _flags(fname: bytes) -> int:
    return 0 if fname.isascii() else _FLAG_UTF8


def plan(archive: str, records: list[Record]) -> Plan:
    """Place ``records`` in order, each record's data on a multiple of its ``align``.

    Args:
        archive: folder name every entry lives under (torch uses the file stem).
        records: records in file order; ``align`` must be a power of two.

    Returns:
        The Plan; every record's ``header_offset`` and ``data_offset`` are set.
    """
    if not archive or "/" in archive:
        raise ValueError(f"zip: archive name {archive!r} must be non-empty and contain no '/'")
    pos = 0
    for r in records:
        if r.align <= 0 or r.align & (r.align - 1):
            raise ValueError(f"zip: alignment {r.align} of {r.name!r} must be a power of two")
        if r.data is not None:
            if len(r.data) != r.size:
                raise ValueError(f"zip: record {r.name!r} has {len(r.data)} bytes but size {r.size}")
            r.crc = zlib.crc32(r.data)
        fname = _fullname(archive, r.name)
        z64 = struct.pack("<HHQQ", 1, 16, r.size, r.size) if r.size >= _U32_MAX else b""
        base = pos + _LOCAL_FIXED + len(fname) + len(z64) + 4  # 4: the FB extra's own header
        pad = (-base) % r.align
        r._extra = z64 + struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # 0x4246 == b"FB" little-endian
        r.header_offset = pos
        r.data_offset = base + pad
        pos = r.data_offset + r.size
    return Plan(archive, records, pos)


@dataclass(frozen=True)
class Located:
    """A record found in an existing archive: absolute data offset and size."""

    name: str  # without the archive folder
    offset: int
    size: int


def locate(f: BinaryIO) -> tuple[str, dict[str, Located]]:
    """Find every record of the torch.save zip open as ``f``.

    Returns:
        ``(archive, records)``: the archive folder name and each record by its name inside it.
        Only stored (uncompressed) records are addressable; others raise ZipFormatError.
    """
    try:
        zf = zipfile.ZipFile(f)
        infos = zf.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, struct.error, OverflowError,
            NotImplementedError) as e:  # ValueError covers UnicodeDecodeError of mangled names
        raise ZipFormatError(f"zip: not a torch.save archive: {e}") from None
    if not infos:
        raise ZipFormatError("zip: archive has no records")
    archive = infos[0].filename.split("/", 1)[0]
    end = f.seek(0, 2)
    out: dict[str, Located] = {}
    for info in infos:
        head, sep, rest = info.filename.partition("/")
        if not sep:
            continue
        try:
            f.seek(info.header_offset)
            lh = f.read(_LOCAL_FIXED)
        except (ValueError, OSError) as e:
            raise ZipFormatError(f"zip: cannot read the local header of {info.filename!r}: {e}") from None
        if len(lh) != _LOCAL_FIXED or struct.unpack_from("<I", lh)[0] != _LOCAL_SIG:
            raise ZipFormatError(f"zip: bad local header for {info.filename!r} at {info.header_offset}")
        name_len, extra_len = struct.unpack_from("<HH", lh, 26)
        if info.compress_type != zipfile.ZIP_STORED and rest.startswith("data/"):
            raise ZipFormatError(f"zip: record {info.filename!r} is compressed; only stored records are supported")
        loc = Located(rest, info.header_offset + _LOCAL_FIXED + name_len + extra_len, info.file_size)
        if loc.offset + loc.size > end:
            raise ZipFormatError(f"zip: record {info.filename!r} runs past the end of the {end}-byte archive")
        out[rest] = loc
    return archive, out
