"""The safetensors container: header parsing, validation and a 4 KiB-aligned writer layout.

Format (huggingface/safetensors README): ``u64 LE N`` | ``N`` bytes of UTF-8 JSON | byte buffer.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the buffer start) plus an optional ``"__metadata__"`` map of strings. The buffer must be
covered by the tensors with no holes and no overlap, and ``8 + N + len(buffer)`` must equal the file
size. The JSON may be right-padded with spaces, which is how we put the buffer on a 4096-byte
boundary so the daemon (and GDS) can move it without realigning.

Standard library only, so the daemon-independent format logic is testable without torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Mapping

# Same limit as the Rust implementation (MAX_HEADER_SIZE): a larger header is refused, not read.
MAX_HEADER_BYTES = 100_000_000

# Bytes per element of each safetensors dtype we can move. Sub-byte types (F4, F6_*) are not
# byte-addressable per element and torch has no dtype for them in the releases we support.
DTYPE_BYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}


class SafetensorsError(ValueError):
    """A safetensors file or header that does not follow the format."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: dtype name, shape, and absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements (1 for a 0-d tensor)."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Header:
    """A parsed, validated safetensors header."""

    tensors: dict[str, TensorInfo]  # in file order
    metadata: dict[str, str] | None
    data_start: int  # absolute offset of the byte buffer (8 + N)
    data_bytes: int  # length of the byte buffer


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError(f"safetensors: duplicate key {k!r} in header")
        out[k] = v
    return out


def read_header(f: BinaryIO, file_size: int) -> Header:
    """Read and validate the header of an open safetensors file positioned anywhere.

    Args:
        f: binary file supporting ``seek``/``read``.
        file_size: total file size in bytes, used for the length checks.

    Returns:
        The validated Header.
    """
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) != 8:
        raise SafetensorsError(f"safetensors: file is {file_size} bytes, too short for the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"safetensors: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > file_size:
        raise SafetensorsError(f"safetensors: header length {n} runs past the end of the {file_size}-byte file")
    raw = f.read(n)
    if len(raw) != n:
        raise SafetensorsError(f"safetensors: file ended inside the {n}-byte header")
    return parse_header(raw, file_size)


def parse_header(raw: bytes, file_size: int) -> Header:
    """Validate the JSON header bytes ``raw`` (without the 8-byte length) of a ``file_size``-byte file."""
    if not raw.startswith(b"{"):
        raise SafetensorsError("safetensors: header does not start with '{'")
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"safetensors: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SafetensorsError("safetensors: header is not a JSON object")
    data_start = 8 + len(raw)
    metadata = obj.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise SafetensorsError("safetensors: __metadata__ must map strings to strings")
    infos: list[tuple[int, int, TensorInfo]] = []
    for name, entry in obj.items():
        infos.append(_parse_entry(name, entry, data_start))
    infos.sort(key=lambda t: (t[0], t[1]))
    pos = 0
    for begin, end, info in infos:
        if begin != pos:
            raise SafetensorsError(
                f"safetensors: tensor {info.name!r} starts at buffer offset {begin}, expected {pos} (holes or overlap)"
            )
        pos = end
    if data_start + pos != file_size:
        raise SafetensorsError(
            f"safetensors: header describes {data_start + pos} bytes but the file has {file_size}"
        )
    return Header(
        tensors={info.name: info for _, _, info in infos},
        metadata=metadata,
        data_start=data_start,
        data_bytes=pos,
    )


def _parse_entry(name: str, entry: Any, data_start: int) -> tuple[int, int, TensorInfo]:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"safetensors: entry {name!r} is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise SafetensorsError(f"safetensors: tensor {name!r} has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(f"safetensors: tensor {name!r} has invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SafetensorsError(f"safetensors: tensor {name!r} has invalid data_offsets {offsets!r}")
    info = TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    if info.numel * DTYPE_BYTES[dtype] != info.nbytes:
        raise SafetensorsError(
            f"safetensors: tensor {name!r} is {info.nbytes} bytes but shape {shape} of {dtype} needs "
            f"{info.numel * DTYPE_BYTES[dtype]}"
        )
    return offsets[0], offsets[1], info


@dataclass(frozen=True)
class Entry:
    """One tensor to lay out for writing: name, safetensors dtype name, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this tensor occupies in the buffer."""
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def layout(
    entries: Iterable[Entry], metadata: Mapping[str, str] | None = None, align: int = 4096
) -> tuple[bytes, dict[str, TensorInfo]]:
    """Lay out a safetensors file whose byte buffer starts on an ``align``-byte boundary.

    Tensors are ordered by descending element size, then name (as the Rust writer does), so each
    tensor is naturally aligned for its dtype within the aligned buffer.

    Args:
        entries: the tensors to store.
        metadata: optional ``__metadata__`` (strings to strings).
        align: required alignment of the buffer start; a power of two >= 8.

    Returns:
        ``(head, infos)``: the bytes to write at file offset 0 (length prefix, JSON, space
        padding; ``len(head) % align == 0``) and each tensor's absolute placement.
    """
    if align < 8 or align & (align - 1):
        raise ValueError(f"safetensors: align {align} must be a power of two >= 8")
    ordered = sorted(entries, key=lambda e: (-DTYPE_BYTES[e.dtype], e.name))
    doc: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError("safetensors: metadata must map strings to strings")
        doc["__metadata__"] = dict(metadata)
    pos = 0
    seen: set[str] = set()
    for e in ordered:
        if e.name == "__metadata__" or e.name in seen:
            raise SafetensorsError(f"safetensors: tensor name {e.name!r} is reserved or repeated")
        seen.add(e.name)
        doc[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        pos += e.nbytes
    js = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    total = -(-(8 + len(js)) // align) * align
    n = total - 8
    if n > MAX_HEADER_BYTES:
        raise SafetensorsError(f"safetensors: header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte limit")
    head = struct.pack("<Q", n) + js + b" " * (n - len(js))
    infos = {}
    for e in ordered:
        begin = doc[e.name]["data_offsets"][0]
        infos[e.name] = TensorInfo(e.name, e.dtype, e.shape, total + begin, e.nbytes)
    return head, infos
