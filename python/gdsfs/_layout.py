"""Shard layouts: which byte ranges of a file make up each sample.

The daemon serves a parsed index of every tar, MDS and .npy file (INDEX,
docs/index-format.md). For files not on a gdsfs mount (the plain-read
fallback) this module builds the same document in Python, so the dataset
code has one input format. Standard library only.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import struct
import tarfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["NpyHeader", "npy_header_cached", "parse_npy_header", "local_index", "detect_format", "mds_ndarray_prefix", "mds_ndarray_check", "MDS_FIXED"]

# WebDataset's base_plus_ext: the key is the path up to the first dot of the
# last path component, the field everything after it.
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_RESERVED_RE = re.compile(r"__[^/]*__($|/)")

# Fixed-size MDS scalar encodings: name -> (struct format, size).
MDS_FIXED: dict[str, tuple[str, int]] = {
    "uint8": ("<B", 1), "uint16": ("<H", 2), "uint32": ("<I", 4), "uint64": ("<Q", 8),
    "int8": ("<b", 1), "int16": ("<h", 2), "int32": ("<i", 4), "int64": ("<q", 8),
    "float16": ("<e", 2), "float32": ("<f", 4), "float64": ("<d", 8), "int": ("<q", 8),
}
# MDS ndarray dtype codes and shape dtype codes.
MDS_DTYPE_CODES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_MDS_SHAPE_FMT = {0: ("B", 1), 1: ("H", 2), 2: ("I", 4), 3: ("Q", 8)}
NUMPY_TO_STR = {
    "uint8": "|u1", "int8": "|i1", "uint16": "<u2", "int16": "<i2", "float16": "<f2", "uint32": "<u4",
    "int32": "<i4", "float32": "<f4", "uint64": "<u8", "int64": "<i8", "float64": "<f8",
}


@dataclass(frozen=True)
class NpyHeader:
    """The header of a .npy array: where its data starts (relative to the
    start of the .npy bytes), dtype string (numpy descr), shape, order."""

    data_offset: int
    dtype: str
    shape: tuple[int, ...]
    fortran_order: bool


def npy_header_cached(b: bytes) -> NpyHeader:
    """parse_npy_header, remembering recent headers: the samples of a dataset field usually share
    one header, and parsing it (ast.literal_eval) costs more than reading the sample."""
    if len(b) >= 12 and b[:6] == b"\x93NUMPY" and b[6] in (1, 2, 3):
        end = 10 + struct.unpack_from("<H", b, 8)[0] if b[6] == 1 else 12 + struct.unpack_from("<I", b, 8)[0]
        if end <= len(b):
            return _npy_header_of(bytes(b[:end]))
    return parse_npy_header(b)


@functools.lru_cache(maxsize=256)
def _npy_header_of(header: bytes) -> NpyHeader:
    return parse_npy_header(header)


def parse_npy_header(b: bytes) -> NpyHeader:
    """Parse the header of .npy bytes (at least the header must be present).

    Raises:
        ValueError: not a .npy header, or a structured/object dtype.
    """
    if len(b) < 10 or b[:6] != b"\x93NUMPY":
        raise ValueError("gdsfs: not a .npy header (magic \\x93NUMPY missing)")
    major = b[6]
    if major == 1:
        (hlen,) = struct.unpack_from("<H", b, 8)
        start = 10
    elif major in (2, 3):
        if len(b) < 12:
            raise ValueError("gdsfs: truncated .npy header")
        (hlen,) = struct.unpack_from("<I", b, 8)
        start = 12
    else:
        raise ValueError(f"gdsfs: unsupported .npy version {major}")
    if len(b) < start + hlen:
        raise ValueError(f"gdsfs: .npy header needs {start + hlen} bytes, have {len(b)}")
    text = b[start : start + hlen].decode("latin1" if major < 3 else "utf8")
    try:
        d = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"gdsfs: bad .npy header dict: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("descr"), str):
        raise ValueError("gdsfs: .npy header has no plain dtype (structured dtypes are not supported)")
    shape = tuple(int(x) for x in d.get("shape", ()))
    return NpyHeader(start + hlen, d["descr"], shape, bool(d.get("fortran_order", False)))


def detect_format(path: str) -> str:
    """The shard format by file name: tar, mds, npy, or raw."""
    name = os.path.basename(path)
    if name.endswith(".tar"):
        return "tar"
    if name.endswith(".mds"):
        return "mds"
    if name.endswith(".npy"):
        return "npy"
    return "raw"


def _tar_index(path: str) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    members = 0
    with tarfile.open(path, "r:") as tf:
        for m in tf:
            members += 1
            if not m.isreg():
                continue
            rec = {"name": m.name, "offset": m.offset_data, "length": m.size}
            mt = _KEY_RE.match(m.name)
            if mt is None or _RESERVED_RE.search(m.name):
                other.append(rec)
                continue
            key, fld = mt.group(1), mt.group(2)
            if not samples or samples[-1]["key"] != key:
                samples.append({"key": key, "fields": {}})
            samples[-1]["fields"][fld] = rec
    return {"format": "tar", "version": 1, "file_size": os.path.getsize(path), "members": members, "samples": samples, "other": other}


def _mds_index(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"gdsfs: {path!r} is too short for an MDS shard")
    (n,) = struct.unpack_from("<I", data, 0)
    table_end = 4 + 4 * (n + 1)
    if table_end > len(data):
        raise ValueError(f"gdsfs: {path!r}: MDS offset table runs past the end of the file")
    offs = struct.unpack_from(f"<{n + 1}I", data, 4)
    cfg = json.loads(data[table_end : offs[0]])
    cols = []
    for name, enc, size in zip(cfg["column_names"], cfg["column_encodings"], cfg["column_sizes"]):
        cols.append({"name": name, "encoding": enc, "size": -1 if size is None else int(size)})
    nvar = sum(1 for c in cols if c["size"] < 0)
    samples = []
    for i in range(n):
        lo, hi = offs[i], offs[i + 1]
        sizes = struct.unpack_from(f"<{nvar}I", data, lo) if nvar else ()
        at, v = lo + 4 * nvar, 0
        colr: dict[str, Any] = {}
        for c in cols:
            ln = c["size"]
            if ln < 0:
                ln = sizes[v]
                v += 1
            if at + ln > hi:
                raise ValueError(f"gdsfs: {path!r}: MDS sample {i} column {c['name']!r} runs past the sample")
            colr[c["name"]] = {"offset": at, "length": ln}
            at += ln
        samples.append({"offset": lo, "length": hi - lo, "columns": colr})
    return {"format": "mds", "version": 1, "file_size": len(data), "kind": "shard", "columns": cols, "samples": samples}


def _npy_index(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    h = parse_npy_header(head)
    size = os.path.getsize(path)
    return {"format": "npy", "version": 1, "file_size": size, "dtype": h.dtype, "shape": list(h.shape),
            "fortran_order": h.fortran_order, "data_offset": h.data_offset, "data_length": size - h.data_offset}


def local_index(path: str, fmt: Optional[str] = None) -> dict[str, Any]:
    """Parse a shard in Python into the daemon's index document.

    Args:
        path: a tar, MDS shard or .npy file.
        fmt: "tar", "mds" or "npy"; detected from the name when None.
    """
    fmt = fmt or detect_format(path)
    parsers: dict[str, Callable[[str], dict[str, Any]]] = {"tar": _tar_index, "mds": _mds_index, "npy": _npy_index}
    if fmt not in parsers:
        raise ValueError(f"gdsfs: no index for {path!r} (format {fmt!r}): use .tar, .mds or .npy shards, or raw files with field_spec")
    return parsers[fmt](path)


def mds_ndarray_spec(encoding: str) -> tuple[Optional[str], Optional[tuple[int, ...]]]:
    """(dtype, shape) fixed by an MDS "ndarray[:dtype[:shape]]" encoding;
    None for the parts stored per sample."""
    parts = encoding.split(":")
    dtype = parts[1] if len(parts) > 1 and parts[1] else None
    shape = tuple(int(x) for x in parts[2].split(",")) if len(parts) > 2 and parts[2] else None
    return dtype, shape


def mds_ndarray_prefix(encoding: str, head: bytes) -> tuple[int, str, tuple[int, ...]]:
    """Decode the per-sample prefix of an MDS ndarray value.

    Args:
        encoding: the column encoding ("ndarray", "ndarray:float32", ...).
        head: the first bytes of the value (at least the prefix).

    Returns:
        (prefix bytes, dtype name, shape).

    Raises:
        ValueError: an unknown dtype code, or a prefix longer than head.
    """
    dtype, shape = mds_ndarray_spec(encoding)
    at = 0
    if dtype is None:
        if not head:
            raise ValueError("gdsfs: MDS ndarray value is empty: it lacks the dtype byte its encoding stores per sample")
        code = head[0]
        if code not in MDS_DTYPE_CODES:
            raise ValueError(f"gdsfs: MDS ndarray dtype code {code} is unknown")
        dtype = MDS_DTYPE_CODES[code]
        at = 1
    if shape is None:
        if len(head) <= at:
            raise ValueError(f"gdsfs: MDS ndarray value of {len(head)} bytes lacks the shape its encoding stores per sample")
        magic = head[at]
        ndim, code = magic >> 2, magic & 3
        fmt, size = _MDS_SHAPE_FMT[code]
        if len(head) < at + 1 + ndim * size:
            raise ValueError(f"gdsfs: MDS ndarray value of {len(head)} bytes is shorter than its {ndim}-dimension shape ({at + 1 + ndim * size} bytes)")
        shape = tuple(struct.unpack_from(f"<{ndim}{fmt}", head, at + 1))
        at += 1 + ndim * size
    return at, dtype, shape


def mds_ndarray_check(dtype: str, shape: tuple[int, ...], nbytes: int) -> None:
    """Raise ValueError unless nbytes, an MDS ndarray value's bytes after its prefix, are those
    of shape in dtype (as NDArray.decode's reshape requires; dtypes MDS does not encode are left
    to the tensor view)."""
    size = MDS_FIXED.get(dtype, ("", 0))[1] if dtype in MDS_DTYPE_CODES.values() else 0
    if size:
        n = size
        for d in shape:
            n *= d
        if n != nbytes:
            raise ValueError(f"gdsfs: MDS ndarray value has {nbytes} array bytes, but its header says {dtype} of shape {shape} ({n} bytes)")
