"""The tar columns form of a shard index (docs/index-format.md, "Tar columns").

With CAP_INDEX_COLUMNS the daemon serves a tar's index as a head (the JSON document with
"samples" empty) and the samples as packed integer columns. decode() reads each column in one
pass (array.frombytes) and checks every count, end and id up front; the samples then come out
of a TarSamples sequence one at a time, each as the same dict the JSON form has, and a planner
reads a sample's fields from it without building those dicts (TarSamples.fields).
"""

from __future__ import annotations

import array
import json
import operator
import struct
import sys
from collections.abc import Sequence
from itertools import islice
from typing import Any, Iterator, Optional, Union, overload

from ._errors import GDSUnavailableError

try:  # the checks of a column in one vectorised pass where numpy is there (torch's)
    import numpy as _np
except ImportError:  # pragma: no cover - torch installs without numpy are rare
    _np = None  # type: ignore[assignment]

MAGIC = b"GDXC"
VERSION = 1
HEADER = 48
MAX_COUNT = 1 << 22  # samples, fields, names, links (the daemon's colsMaxCount)
_MAX_I64 = (1 << 63) - 1

# Column widths in the header (bytes 40..47), in this order.
_KEY_END, _FIELD_END, _NAME_ID, _OFFSET, _LENGTH, _NPY, _NAME_END, _LINK = range(8)


def _typecodes() -> dict[int, str]:
    out: dict[int, str] = {}
    for tc in "BHILQ":
        out.setdefault(array.array(tc).itemsize, tc)
    return out


_TYPECODE = _typecodes()


class _Bad(Exception):
    """A malformed document: why (decode() turns it into GDSUnavailableError)."""


def _column(doc: bytes, off: int, n: int, width: int) -> "array.array[int]":
    a = array.array(_TYPECODE[width])
    a.frombytes(doc[off : off + n * width])
    if sys.byteorder == "big":
        a.byteswap()
    return a


def _view(a: "array.array[int]") -> Any:
    """a as a numpy array without a copy (numpy is there)."""
    assert _np is not None
    return _np.frombuffer(a, dtype=f"u{a.itemsize}")


def _check_ends(a: "array.array[int]", total: int, what: str) -> None:
    """Cumulative ends: non-decreasing, the last one total (none: total 0)."""
    if len(a) == 0:
        if total:
            raise _Bad(f"{what} ends at 0, not at {total}")
        return
    if a[-1] != total:
        raise _Bad(f"{what} ends at {a[-1]}, not at {total}")
    if _np is not None:
        v = _view(a)
        ordered = bool((v[1:] >= v[:-1]).all())
    else:
        ordered = all(map(operator.le, a, islice(a, 1, None)))
    if not ordered:
        raise _Bad(f"{what} ends are out of order")


def _check_fields(ids: "array.array[int]", names: int, npys: "array.array[int]", npy_headers: int,
                  offsets: "array.array[int]", lengths: "array.array[int]") -> None:
    """Every field's name id below names, npy id at most npy_headers, offset + length within
    a signed 64-bit integer (checked only where the widths can get there)."""
    if not len(ids):
        return
    wide = offsets.itemsize == 8 or lengths.itemsize == 8
    if _np is not None:
        bad = int(_view(ids).max()) >= names or int(_view(npys).max()) > npy_headers
        if not bad and wide:
            o, n = _view(offsets).astype("u8"), _view(lengths).astype("u8")
            bad = bool((o > _MAX_I64).any() or (n > _np.uint64(_MAX_I64) - o).any())
    else:
        bad = max(ids) >= names or max(npys) > npy_headers
        if not bad and wide:
            bad = max(offsets) > _MAX_I64 or max(map(operator.add, offsets, lengths)) > _MAX_I64
    if bad:
        raise _Bad(f"a field's name id, npy id or range is out of bounds ({names} names, {npy_headers} npy headers)")


def decode(doc: bytes, path: str = "") -> dict[str, Any]:
    """The index document (docs/index-format.md) of a tar columns document: its head, with
    "samples" a TarSamples.

    Raises:
        GDSUnavailableError: the document is malformed (one line naming path and why).
    """
    try:
        return _decode(doc)
    except _Bad as e:
        raise GDSUnavailableError(
            f"gdsfs: INDEX {path!r}: malformed index columns ({e}): the daemon answers what this client cannot decode; "
            "run a gdsfs client and daemon of the same version") from None


def _decode(doc: bytes) -> dict[str, Any]:
    if len(doc) < HEADER or doc[:4] != MAGIC:
        raise _Bad(f"no {MAGIC.decode()!r} header")
    h = struct.unpack_from("<9I", doc, 4)
    if h[0] != VERSION:
        raise _Bad(f"version {h[0]}, this client knows {VERSION}")
    for i, v in enumerate(h[1:], 1):
        if v > len(doc) or (2 <= i <= 5 and v > MAX_COUNT):
            raise _Bad(f"header field {i} ({v}) exceeds the document or the bound {MAX_COUNT}")
    head_len, ns, nf, nn, nl, key_bytes, name_bytes, link_bytes = h[1:]
    w = doc[40:48]
    for i, v in enumerate(w):
        if v not in (1, 2, 4, 8):
            raise _Bad(f"column {i} has width {v} (1, 2, 4 or 8)")
    if ns > nf or nn > nf or nl > nf:
        raise _Bad(f"{ns} samples, {nn} names, {nl} links for {nf} fields")
    sizes = (head_len, nn * w[_NAME_END], name_bytes, ns * w[_KEY_END], key_bytes, ns * w[_FIELD_END],
             nf * w[_NAME_ID], nf * w[_OFFSET], nf * w[_LENGTH], nf * w[_NPY], nl * w[_LINK], nl * w[_LINK], link_bytes)
    if HEADER + sum(sizes) != len(doc):
        raise _Bad(f"{len(doc)} bytes, the columns need {HEADER + sum(sizes)}")
    at = [HEADER]
    for s in sizes:
        at.append(at[-1] + s)
    head = doc[at[0] : at[1]]
    name_end = _column(doc, at[1], nn, w[_NAME_END])
    name_blob = doc[at[2] : at[3]]
    key_end = _column(doc, at[3], ns, w[_KEY_END])
    key_blob = doc[at[4] : at[5]]
    field_end = _column(doc, at[5], ns, w[_FIELD_END])
    name_ids = _column(doc, at[6], nf, w[_NAME_ID])
    offsets = _column(doc, at[7], nf, w[_OFFSET])
    lengths = _column(doc, at[8], nf, w[_LENGTH])
    npys = _column(doc, at[9], nf, w[_NPY])
    link_field = _column(doc, at[10], nl, w[_LINK])
    link_end = _column(doc, at[11], nl, w[_LINK])
    link_blob = doc[at[12] : at[13]]
    _check_ends(name_end, name_bytes, "name")
    _check_ends(key_end, key_bytes, "key")
    _check_ends(field_end, nf, "sample fields")
    _check_ends(link_end, link_bytes, "link")
    keys: Union[str, list[str]]
    if key_blob.isascii():
        keys = key_blob.decode("ascii")  # one str, sliced per key
    else:
        try:
            keys = [key_blob[a:b].decode("utf-8") for a, b in zip([0, *key_end[:-1]], key_end)]
        except UnicodeDecodeError:
            raise _Bad("keys are not UTF-8") from None
    try:
        meta = json.loads(head)
    except ValueError as e:
        raise _Bad(f"head: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != "tar" or meta.get("version") != 1 or meta.get("samples") != []:
        raise _Bad("head is not a version 1 tar index with no samples")
    npy_headers = meta.get("npy_headers", [])
    if not isinstance(npy_headers, list):
        raise _Bad("head's npy_headers is not a list")
    _check_fields(name_ids, nn, npys, len(npy_headers), offsets, lengths)
    try:
        names = [name_blob[a:b].decode("utf-8") for a, b in zip([0, *name_end[:-1]], name_end)]
        links: dict[int, str] = {}
        prev_f, prev_e = -1, 0
        for fi, end in zip(link_field, link_end):
            if fi >= nf or fi <= prev_f or end == prev_e:
                raise _Bad(f"link of field {fi} is out of order, past {nf} fields or empty")
            links[fi] = link_blob[prev_e:end].decode("utf-8")
            prev_f, prev_e = fi, end
    except UnicodeDecodeError:
        raise _Bad("names are not UTF-8") from None
    meta["samples"] = TarSamples(names, keys, key_end, field_end, name_ids, offsets, lengths, npys, links)
    return meta


class TarSamples(Sequence):  # type: ignore[type-arg]
    """The samples of a tar index in the columns form: a sequence of the JSON form's sample
    dicts ({"key", "fields": {field: {"name", "offset", "length", ["link"], ["npy"]}}}), each
    built when asked for; fields() gives a planner a sample's fields without them."""

    form = "columns"

    def __init__(self, names: list[str], keys: Union[str, list[str]], key_end: "array.array[int]", field_end: "array.array[int]",
                 name_ids: "array.array[int]", offsets: "array.array[int]", lengths: "array.array[int]", npys: "array.array[int]",
                 links: dict[int, str]) -> None:
        self.names = names  # the field names of the shard's samples (each at least once)
        self._keys, self._key_end, self._field_end = keys, key_end, field_end
        self._ids, self._off, self._len, self._npy, self._links = name_ids, offsets, lengths, npys, links

    def __len__(self) -> int:
        return len(self._field_end)

    def _pos(self, i: int) -> int:
        n = len(self._field_end)
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"sample {i} of {n}")
        return j

    def key(self, i: int) -> str:
        """Sample i's key."""
        if not 0 <= i < len(self._key_end):
            i = self._pos(i)
        keys = self._keys
        if isinstance(keys, list):
            return keys[i]
        ke = self._key_end
        return keys[ke[i - 1] if i else 0 : ke[i]]

    def span(self, i: int) -> tuple[str, int, int]:
        """Sample i's key and the range [start, end) of its fields in the columns (field j:
        names[name_ids[j]], offsets[j], lengths[j], npys[j] - 1), for a planner's loop."""
        if not 0 <= i < len(self._field_end):
            i = self._pos(i)
        fe = self._field_end
        return self.key(i), fe[i - 1] if i else 0, fe[i]

    @property
    def columns(self) -> tuple[list[str], "array.array[int]", "array.array[int]", "array.array[int]", "array.array[int]"]:
        """(names, name_ids, offsets, lengths, npys): the field columns span() indexes (npys:
        1 + the index in npy_headers, 0 for none)."""
        return self.names, self._ids, self._off, self._len, self._npy

    def fields(self, i: int) -> tuple[str, list[tuple[str, int, int, int]]]:
        """Sample i's key and its fields in archive order: (field, offset, length, npy), npy
        the field's index in the head's npy_headers or -1."""
        if not 0 <= i < len(self._field_end):
            i = self._pos(i)
        fe = self._field_end
        a = fe[i - 1] if i else 0
        names, ids, off, ln, npy = self.names, self._ids, self._off, self._len, self._npy
        return self.key(i), [(names[ids[j]], off[j], ln[j], npy[j] - 1) for j in range(a, fe[i])]

    def _sample(self, i: int) -> dict[str, Any]:
        key, fs = self.fields(i)
        a = self._field_end[i - 1] if i else 0
        out: dict[str, Any] = {}
        for j, (name, off, ln, npy) in enumerate(fs, a):
            m: dict[str, Any] = {"name": f"{key}.{name}", "offset": off, "length": ln}
            link = self._links.get(j)
            if link is not None:
                m["link"] = link
            if npy >= 0:
                m["npy"] = npy
            out[name] = m
        return {"key": key, "fields": out}

    @overload
    def __getitem__(self, i: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, i: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[dict[str, Any], list[dict[str, Any]]]:
        if isinstance(i, slice):
            return [self._sample(j) for j in range(*i.indices(len(self)))]
        return self._sample(self._pos(operator.index(i)))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self._sample(i)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, TarSamples)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<TarSamples: {len(self)} samples, fields {self.names}>"


def is_columns(samples: Optional[object]) -> bool:
    """Whether a tar index's "samples" is the columns form."""
    return isinstance(samples, TarSamples)
