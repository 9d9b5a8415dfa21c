"""MDS shards for tests, encoded as mosaicml-streaming's MDSWriter encodes them
(streaming/base/format/mds/{writer,encodings}.py, /work/shared/reference/anchors-pytorch.md a.2),
with any columns, and an oracle that decodes a shard from its own bytes."""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping, Sequence

import numpy as np

# NDArray's dtype codes (encodings.py _dtype2int) and shape dtype codes (_int2shape_dtype).
DTYPE_CODES = {"uint8": 8, "int8": 9, "uint16": 16, "int16": 17, "float16": 18, "uint32": 32, "int32": 33, "float32": 34,
               "uint64": 64, "int64": 65, "float64": 66}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
SHAPE_CODES = [("uint8", 1 << 8), ("uint16", 1 << 16), ("uint32", 1 << 32), ("uint64", 1 << 64)]
SCALARS = {"uint8": "<B", "uint16": "<H", "uint32": "<I", "uint64": "<Q", "int8": "<b", "int16": "<h", "int32": "<i", "int64": "<q",
           "float16": "<e", "float32": "<f", "float64": "<d"}


def _spec(encoding: str) -> tuple[str | None, tuple[int, ...] | None]:
    parts = encoding.split(":")
    dtype = parts[1] if len(parts) > 1 and parts[1] else None
    shape = tuple(int(x) for x in parts[2].split(",")) if len(parts) > 2 and parts[2] else None
    return dtype, shape


def ndarray_value(encoding: str, arr: np.ndarray) -> bytes:
    """NDArray(dtype, shape).encode(arr): [dtype code][ndim<<2|shape code, dims][C-order data]."""
    dtype, shape = _spec(encoding)
    out = b""
    if dtype is None:
        out += bytes([DTYPE_CODES[arr.dtype.name]])
    else:
        assert arr.dtype.name == dtype
    if shape is None:
        assert 1 <= arr.ndim < 64 and min(arr.shape) > 0
        code, name = next((c, n) for c, (n, lim) in enumerate(SHAPE_CODES) if max(arr.shape) < lim)
        out += bytes([(arr.ndim << 2) | code]) + np.array(arr.shape, name).tobytes()
    else:
        assert arr.shape == shape
    return out + np.ascontiguousarray(arr).tobytes()


def column_size(encoding: str) -> int | None:
    """The column's fixed size (MDSWriter's column_sizes), None for variable ones."""
    if encoding in SCALARS:
        return struct.calcsize(SCALARS[encoding])
    if encoding.startswith("ndarray"):
        dtype, shape = _spec(encoding)
        if dtype is not None and shape is not None:
            return int(np.prod(shape)) * np.dtype(dtype).itemsize
    return None


def encode(encoding: str, value: Any) -> bytes:
    if encoding in SCALARS:
        return struct.pack(SCALARS[encoding], value)
    if encoding.startswith("ndarray"):
        return value if isinstance(value, bytes) else ndarray_value(encoding, value)
    assert isinstance(value, bytes)
    return value


def shard_bytes(columns: Mapping[str, str], samples: Sequence[Mapping[str, Any]]) -> bytes:
    """MDSWriter.encode_joint_shard of samples ({column: value}; an ndarray value may be given
    already encoded, as bytes): u32 count, u32 offsets, config JSON, samples of [u32 size of each
    variable column][values], columns sorted by name."""
    names = sorted(columns)
    encs = [columns[n] for n in names]
    sizes = [column_size(e) for e in encs]
    cfg = {"column_encodings": encs, "column_names": names, "column_sizes": sizes, "compression": None, "format": "mds",
           "hashes": [], "size_limit": 1 << 26, "version": 2}
    blobs = []
    for s in samples:
        vals = [encode(e, s[n]) for n, e in zip(names, encs)]
        prefix = b"".join(struct.pack("<I", len(v)) for v, sz in zip(vals, sizes) if sz is None)
        blobs.append(prefix + b"".join(vals))
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    at = 4 + 4 * (len(blobs) + 1) + len(cfg_bytes)
    offs = [at]
    for b in blobs:
        offs.append(offs[-1] + len(b))
    return struct.pack(f"<{len(offs) + 1}I", len(blobs), *offs) + cfg_bytes + b"".join(blobs)


def write_dataset(d: str, columns: Mapping[str, str], shards: Sequence[Sequence[Mapping[str, Any]]]) -> list[str]:
    """index.json and shard.NNNNN.mds files in d; the shard paths."""
    os.makedirs(d, exist_ok=True)
    entries, paths = [], []
    names = sorted(columns)
    for i, samples in enumerate(shards):
        data = shard_bytes(columns, samples)
        base = f"shard.{i:05d}.mds"
        with open(os.path.join(d, base), "wb") as f:
            f.write(data)
        paths.append(os.path.join(d, base))
        entries.append({"column_encodings": [columns[n] for n in names], "column_names": names,
                        "column_sizes": [column_size(columns[n]) for n in names], "compression": None, "format": "mds",
                        "hashes": [], "raw_data": {"basename": base, "bytes": len(data), "hashes": {}}, "samples": len(samples),
                        "size_limit": 1 << 26, "version": 2, "zip_data": None})
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump({"shards": entries, "version": 2}, f, sort_keys=True)
    return paths


def decode_shard(path: str) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, tuple[int, int]]]]:
    """The oracle: (columns, samples, value ranges) decoded from the file's own bytes as
    MDSReader + NDArray.decode do (ndarray values as numpy arrays, others as bytes/scalars)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<I", data, 0)
    offs = struct.unpack_from(f"<{n + 1}I", data, 4)
    cfg = json.loads(data[4 + 4 * (n + 1):offs[0]])
    names, encs, sizes = cfg["column_names"], cfg["column_encodings"], cfg["column_sizes"]
    samples, ranges = [], []
    for i in range(n):
        at = offs[i]
        nvar = sum(1 for s in sizes if s is None)
        lens = list(struct.unpack_from(f"<{nvar}I", data, at))
        at += 4 * nvar
        row, where = {}, {}
        for name, enc, size in zip(names, encs, sizes):
            ln = size if size is not None else lens.pop(0)
            raw = data[at:at + ln]
            where[name] = (at, ln)
            at += ln
            if enc in SCALARS:
                row[name] = struct.unpack(SCALARS[enc], raw)[0]
            elif enc.startswith("ndarray"):
                dtype, shape = _spec(enc)
                k = 0
                if dtype is None:
                    dtype, k = CODE_DTYPES[raw[0]], 1
                if shape is None:
                    ndim, code = raw[k] >> 2, raw[k] & 3
                    sname = SHAPE_CODES[code][0]
                    shape = tuple(int(v) for v in np.frombuffer(raw, sname, ndim, k + 1))
                    k += 1 + ndim * np.dtype(sname).itemsize
                row[name] = np.frombuffer(raw[k:], dtype).reshape(shape)
            else:
                row[name] = raw
        samples.append(row)
        ranges.append(where)
    return dict(zip(names, encs)), samples, ranges
