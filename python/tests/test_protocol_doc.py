"""gdsfs._protocol against docs/protocol.md, the normative text.

The document's tables are parsed (command numbers of section 1.1, message
sizes of the section headings, the field offsets and types of every request
and reply layout) and the Python mirror is checked against them by what it
does: each encoder must put every field it is given at the document's
offset with the document's width and touch no other byte, and each decoder
must read every field from there. A size, offset or number that drifts on
either side fails here (ctl.TestLayoutsMatchProtocolDoc checks the Go side).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import pytest

from gdsfs import _protocol as proto

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"

_HEADING = re.compile(r"^#+ ([0-9]+(?:\.[0-9]+)*)\.? ")
_ROW = re.compile(r"^\| ([0-9]+) \| ([^|]*?) \| `([a-z_]+)(?:\[[a-z0-9]+\])?`")
_INLINE = re.compile(r"`([0-9]+) ([ui][0-9]+) ([a-z_]+)")
_COMMAND = re.compile(r"^\| `([A-Z_]+)` \| 0x([0-9a-f]+) \| ([0-9]+) \| `0x([0-9A-F]+)` \| (control|data) file \|")
_SIZED = re.compile(r"`([A-Z_]+)` \((control|data) file, ([0-9]+) bytes\)")


class Field(NamedTuple):
    off: int
    typ: str  # "u32", "i32", "u64", "32 bytes", "16 bytes × 256", ...


class Command(NamedTuple):
    name: str
    nr: int
    size: int
    cmd: int
    file: str  # "control" or "data"


class Doc(NamedTuple):
    layouts: Dict[str, Dict[str, Field]]  # "3.6 request" -> field name -> Field
    commands: List[Command]  # section 1.1's table
    headings: Dict[str, Tuple[str, int]]  # command name -> (file kind, size) of its section heading


def _read_doc() -> Doc:
    layouts: Dict[str, Dict[str, Field]] = {}
    commands: List[Command] = []
    headings: Dict[str, Tuple[str, int]] = {}
    section, part = "", ""

    def add(off: str, typ: str, name: str) -> None:
        fields = layouts.setdefault(f"{section} {part}", {})
        fields.setdefault(name, Field(int(off), typ.strip()))

    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = _HEADING.match(line)
        if m:
            section, part = m.group(1), ""
            for name, kind, size in _SIZED.findall(line):
                headings[name] = (kind, int(size))
            continue
        if line.startswith("Request:") or ". Request:" in line or line.startswith("Request ("):
            part = "request"
        elif line.startswith("Reply:") or line.startswith("Reply ("):
            part = "reply"
        c = _COMMAND.match(line)
        if c:
            commands.append(Command(c.group(1), int(c.group(2), 16), int(c.group(3)), int(c.group(4), 16), c.group(5)))
            continue
        r = _ROW.match(line)
        if r:
            add(r.group(1), r.group(2), r.group(3))
            continue
        for off, typ, name in _INLINE.findall(line):
            add(off, typ, name)
    return Doc(layouts, commands, headings)


@pytest.fixture(scope="module")
def doc() -> Doc:
    return _read_doc()


# The module's size constant of each command (READ_NAMES shares READ's buffer).
_SIZE_NAME = {"READ_NAMES": "READ_SIZE"}


def test_command_numbers(doc: Doc) -> None:
    """Section 1.1: every command's number and size, and nothing else."""
    assert [c.name for c in doc.commands] == ["HELLO", "SLAB", "ALLOC", "RELEASE", "STATUS", "READ", "READ_NAMES", "WRITE", "INDEX", "PIN"]
    for c in doc.commands:
        assert c.cmd == (3 << 30) | (c.size << 16) | (0x47 << 8) | c.nr, f"{c.name}: the document's number and its nr/size disagree"
        assert getattr(proto, c.name) == c.cmd, f"{c.name}: _protocol.py has {getattr(proto, c.name):#x}, the document {c.cmd:#x}"
        size = getattr(proto, _SIZE_NAME.get(c.name, c.name + "_SIZE"))
        assert size == c.size, f"{c.name}: _protocol.py's size {size}, the document's {c.size}"


def test_section_headings_sizes(doc: Doc) -> None:
    """Each command's section heading names its file and buffer size as section 1.1 does."""
    assert set(doc.headings) == {c.name for c in doc.commands}
    for c in doc.commands:
        assert doc.headings[c.name] == (c.file, c.size), f"{c.name}: heading says {doc.headings[c.name]}, section 1.1 ({c.file}, {c.size})"
        assert getattr(proto, _SIZE_NAME.get(c.name, c.name + "_SIZE")) == doc.headings[c.name][1]


_INT = {"u16": "<H", "u32": "<I", "i32": "<i", "u64": "<Q"}


def _width(f: Field) -> int:
    if f.typ in _INT:
        return struct.calcsize(_INT[f.typ])
    m = re.fullmatch(r"([0-9]+) bytes(?: × ([0-9]+))?", f.typ)
    assert m, f"unknown field type {f.typ!r}"
    return int(m.group(1)) * int(m.group(2) or 1)


def _value(name: str, f: Field) -> int:
    """A value for field name that no other field shares and that fills most of its width."""
    seed = sum(ord(ch) * (i + 1) for i, ch in enumerate(name)) % 97 + 3
    if f.typ == "i32":
        return -seed
    return {"u16": 0x0100, "u32": 0x01000000, "u64": 0x0100000000000000}[f.typ] * (seed % 7 + 1) + seed


def _put(buf: bytearray, f: Field, v: int) -> None:
    struct.pack_into(_INT[f.typ], buf, f.off, v)


def _get(buf: bytes, f: Field) -> int:
    (v,) = struct.unpack_from(_INT[f.typ], buf, f.off)
    return int(v)


TOKEN = proto.Token(0x0102030405060708, 0x1112131415161718)


def _layout(doc: Doc, key: str) -> Dict[str, Field]:
    assert key in doc.layouts, f"docs/protocol.md has no layout {key!r}"
    return doc.layouts[key]


def _check_encoder(doc: Doc, key: str, buf: bytes, given: Dict[str, int], size: int, arrays: Dict[str, bytes] | None = None) -> None:
    """buf, as an encoder wrote it from the values given, holds each at the
    document's offset, zeros in every field and byte it was not given, and
    the header with TOKEN."""
    fields = _layout(doc, key)
    assert len(buf) == size
    assert set(given) | set(arrays or {}) <= set(fields), f"{key}: fields {set(given) | set(arrays or {})} not all in {sorted(fields)}"
    want = bytearray(size)
    hdr = _layout(doc, "1.3 ")
    for name, v in (("magic", proto.MAGIC), ("version", proto.VERSION), ("session", TOKEN.session), ("secret", TOKEN.secret)):
        _put(want, hdr[name], v)
    for name, v in given.items():
        _put(want, fields[name], v)
    for name, b in (arrays or {}).items():
        f = fields[name]
        # An array of integers (ids[256]) is named by its element's type.
        assert f.typ in _INT or len(b) <= _width(f), f"{key} {name}: {len(b)} bytes in a field of {_width(f)}"
        want[f.off : f.off + len(b)] = b
    for off in range(size):
        assert buf[off] == want[off], f"{key}: byte {off} is {buf[off]:#x}, the document wants {want[off]:#x} (fields {sorted(fields.items(), key=lambda x: x[1].off)})"


def test_header(doc: Doc) -> None:
    hdr = _layout(doc, "1.3 ")
    assert set(hdr) == {"magic", "version", "flags", "session", "secret"}
    assert proto.HEADER_BYTES == max(f.off + _width(f) for f in hdr.values()) + 8  # reserved u64 at 24
    buf = proto.request(64, TOKEN)
    assert (_get(buf, hdr["magic"]), _get(buf, hdr["version"]), _get(buf, hdr["flags"])) == (proto.MAGIC, proto.VERSION, 0)
    assert (_get(buf, hdr["session"]), _get(buf, hdr["secret"])) == TOKEN
    assert not any(buf[24:]), "request() writes past the header's named fields"


def test_lease_descriptor(doc: Doc) -> None:
    f = _layout(doc, "2 ")
    assert set(f) == set(proto.LeaseDesc._fields)
    assert proto.LEASE_BYTES == 48 == max(x.off + _width(x) for x in f.values()) + 4  # reserved u32 at 44
    buf = bytearray(64 + proto.LEASE_BYTES)
    vals = {n: _value(n, x) for n, x in f.items()}
    for n, v in vals.items():
        _put(buf, f[n]._replace(off=f[n].off + 64), v)
    assert proto.decode_lease(bytes(buf), 64)._asdict() == vals
    assert proto.decode_read(bytes(buf[:64] + buf[64:]), 1)[0]._asdict() == vals


def test_hello_reply(doc: Doc) -> None:
    f = _layout(doc, "3.1 reply")
    buf = bytearray(proto.HELLO_SIZE)
    ints = {n: _value(n, x) for n, x in f.items() if x.typ in _INT}
    for n, v in ints.items():
        _put(buf, f[n], v)
    strs = {"engine": "gds-compat", "daemon_version": "9.8.7-test", "slab_socket": "@gdsfs-slabs-12-" + "x" * 60}
    for n, s in strs.items():
        assert len(s) < _width(f[n])
        buf[f[n].off : f[n].off + len(s)] = s.encode()
    assert set(ints) | set(strs) == set(f)
    h = proto.decode_hello(bytes(buf))
    got = h._asdict()
    token = got.pop("token")
    assert token == (ints.pop("session"), ints.pop("secret"))
    want: Dict[str, object] = dict(ints)
    want.update(strs)
    assert got == want


def test_slab(doc: Doc) -> None:
    req = _layout(doc, "3.2 request")
    _check_encoder(doc, "3.2 request", proto.encode_slab(TOKEN, 0x0A0B0C0D), {"slab": 0x0A0B0C0D}, proto.SLAB_SIZE)
    assert set(req) == {"slab"}
    f = _layout(doc, "3.2 reply")
    buf = bytearray(proto.SLAB_SIZE)
    vals = {n: _value(n, x) for n, x in f.items() if x.typ in _INT}
    handle = bytes(range(1, 65))
    vals["handle_len"] = len(handle)
    for n, v in vals.items():
        _put(buf, f[n], v)
    buf[f["handle"].off : f["handle"].off + len(handle)] = handle
    assert _width(f["handle"]) == 512
    d = proto.decode_slab(bytes(buf))._asdict()
    assert d.pop("handle") == handle
    vals.pop("handle_len")
    assert d == vals
    assert set(f) == set(vals) | {"handle", "handle_len"}


def test_slab_socket(doc: Doc) -> None:
    """3.2.3: the slab socket's request and reply as _protocol.py packs and unpacks them."""
    req = _layout(doc, "3.2.3 request")
    assert proto.SLAB_FD_REQUEST.size == 40 == req["slab"].off + 8 + 8  # a reserved u64 ends it
    b = proto.SLAB_FD_REQUEST.pack(proto.MAGIC, 1, 1, TOKEN.session, TOKEN.secret, 0x77, 0)
    want = {"magic": proto.MAGIC, "version": 1, "op": 1, "session": TOKEN.session, "secret": TOKEN.secret, "slab": 0x77}
    assert set(want) == set(req)
    assert {n: _get(b, req[n]) for n in want} == want
    rep = _layout(doc, "3.2.3 reply")
    assert proto.SLAB_FD_REPLY.size == 32 == rep["bytes"].off + 8
    buf = bytearray(32)
    vals = {n: _value(n, x) for n, x in rep.items()}
    for n, v in vals.items():
        _put(buf, rep[n], v)
    magic, version, _r0, err, _r1, slab, nbytes = proto.SLAB_FD_REPLY.unpack(bytes(buf))
    assert (magic, version, err, slab, nbytes) == (vals["magic"], vals["version"], vals["errno"], vals["slab"], vals["bytes"])


def test_alloc(doc: Doc) -> None:
    f = _layout(doc, "3.3 request")
    assert set(f) == {"device", "reserved", "length"}
    _check_encoder(doc, "3.3 request", proto.encode_alloc(TOKEN, -7, 0x0102030405), {"device": -7, "length": 0x0102030405}, proto.ALLOC_SIZE)


def test_release(doc: Doc) -> None:
    f = _layout(doc, "3.4 request")
    assert set(f) == {"count", "ids"}
    ids = [0x0100000000000000 + i for i in range(1, 4)]
    _check_encoder(doc, "3.4 request", proto.encode_release(TOKEN, ids), {"count": len(ids)}, proto.RELEASE_SIZE, {"ids": struct.pack(f"<{len(ids)}Q", *ids)})
    assert f["ids"].typ == "u64" and f["ids"].off + 8 * proto.MAX_RELEASE == proto.RELEASE_SIZE
    r = _layout(doc, "3.4 reply")
    assert set(r) == {"released", "status"} and r["status"].typ == "i32"
    buf = bytearray(proto.RELEASE_SIZE)
    _put(buf, r["released"], 2)
    struct.pack_into("<3i", buf, r["status"].off, 0, 2, -5)
    assert proto.decode_release(bytes(buf), 3) == (2, [0, 2, -5])


def test_pages(doc: Doc) -> None:
    f = _layout(doc, "3.5 request")
    assert set(f) == {"offset", "flags"}
    for size in (proto.STATUS_SIZE, proto.INDEX_SIZE):
        _check_encoder(doc, "3.5 request", proto.encode_page(TOKEN, size, 0x0102030405), {"offset": 0x0102030405}, size)
    _check_encoder(doc, "3.5 request", proto.encode_page(TOKEN, proto.INDEX_SIZE, 7, proto.INDEX_FLAG_COLUMNS),
                   {"offset": 7, "flags": proto.INDEX_FLAG_COLUMNS}, proto.INDEX_SIZE)
    r = _layout(doc, "3.5 reply")
    assert set(r) == {"total", "generation", "len", "form", "version", "data"}
    assert proto.PAGE_DATA_OFFSET == r["data"].off and r["data"].off + _width(r["data"]) == proto.STATUS_SIZE
    buf = bytearray(proto.STATUS_SIZE)
    data = b'{"x": 1}'
    _put(buf, r["total"], 0x0100000000000009)
    _put(buf, r["generation"], 0x0200000000000003)
    _put(buf, r["len"], len(data))
    buf[r["data"].off : r["data"].off + len(data)] = data
    assert proto.decode_page(bytes(buf)) == (0x0100000000000009, 0x0200000000000003, data, 0, 0)
    _put(buf, r["version"], 0x0300000000000005)
    assert proto.decode_page(bytes(buf)).version == 0x0300000000000005
    _put(buf, r["form"], proto.INDEX_FORM_TAR_COLUMNS)
    assert proto.decode_page(bytes(buf)).form == proto.INDEX_FORM_TAR_COLUMNS


def test_read(doc: Doc) -> None:
    f = _layout(doc, "3.6 request")
    assert set(f) == {"device", "flags", "count", "version", "ranges"}
    assert f["ranges"].typ == f"16 bytes × {proto.MAX_RANGES}" and f["ranges"].off + _width(f["ranges"]) <= proto.READ_SIZE
    ranges = [(0x0100000000000001, 0x0200000000000002), (0x0300000000000003, 0x0400000000000004)]
    flat = struct.pack("<4Q", *(x for r in ranges for x in r))
    _check_encoder(doc, "3.6 request", proto.encode_read(TOKEN, -3, ranges), {"device": -3, "count": len(ranges)}, proto.READ_SIZE, {"ranges": flat})
    _check_encoder(doc, "3.6 request", proto.encode_read(TOKEN, -3, ranges, 0x0500000000000007),
                   {"device": -3, "flags": proto.READ_FLAG_VERSION, "count": len(ranges), "version": 0x0500000000000007}, proto.READ_SIZE, {"ranges": flat})
    r = _layout(doc, "3.6 reply")
    # The reply's count echoes the request's: the Python client keeps its own.
    assert set(r) == {"count"}
    # The reply's descriptors, one per range, fill the buffer (the size of section 1.1).
    assert 64 + proto.LEASE_BYTES * proto.MAX_RANGES == proto.READ_SIZE
    lease = _layout(doc, "2 ")
    buf = bytearray(proto.READ_SIZE)
    for i in range(2):
        for n, x in lease.items():
            _put(buf, x._replace(off=64 + i * proto.LEASE_BYTES + x.off), _value(n, x) + i)
    got = proto.decode_read(bytes(buf), 2)
    assert [d.lease for d in got] == [_value("lease", lease["lease"]) + i for i in range(2)]
    assert [d.engine for d in got] == [_value("engine", lease["engine"]) + i for i in range(2)]


def test_read_names(doc: Doc) -> None:
    f = _layout(doc, "3.7 request")
    assert set(f) == {"device", "flags", "count", "names_len", "names"}
    assert _width(f["names"]) == proto.NAMES_BYTES and f["names"].off + proto.NAMES_BYTES <= proto.READ_SIZE
    names = ["a.jpg", "sample/3/label"]
    area = b"a.jpg\0sample/3/label\0"
    _check_encoder(doc, "3.7 request", proto.encode_read_names(TOKEN, 5, names), {"device": 5, "count": 2, "names_len": len(area)}, proto.READ_SIZE, {"names": area})


def test_write(doc: Doc) -> None:
    f = _layout(doc, "3.8 request")
    assert set(f) == {"lease", "lease_offset", "file_offset", "length", "flags"}
    vals = {n: _value(n, x) for n, x in f.items() if n != "flags"}
    for sync, flags in ((False, 0), (True, proto.WRITE_SYNC)):
        buf = proto.encode_write(TOKEN, vals["lease"], vals["lease_offset"], vals["file_offset"], vals["length"], sync=sync)
        _check_encoder(doc, "3.8 request", buf, {**vals, "flags": flags}, proto.WRITE_SIZE)
    r = _layout(doc, "3.8 reply")
    assert set(r) == {"written", "engine"}
    buf = bytearray(proto.WRITE_SIZE)
    _put(buf, r["written"], 0x0100000000000007)
    _put(buf, r["engine"], 4)
    assert proto.decode_write(bytes(buf)) == (0x0100000000000007, 4)


def test_pin(doc: Doc) -> None:
    f = _layout(doc, "3.9 request")
    assert set(f) == {"offset", "length", "flags"}
    vals = {n: _value(n, x) for n, x in f.items() if n != "flags"}
    for unpin, flags in ((False, 0), (True, proto.PIN_UNPIN)):
        buf = proto.encode_pin(TOKEN, vals["offset"], vals["length"], unpin=unpin)
        _check_encoder(doc, "3.9 request", buf, {**vals, "flags": flags}, proto.PIN_SIZE)
    r = _layout(doc, "3.9 reply")
    assert set(r) == set(proto.PinReply._fields)
    buf = bytearray(proto.PIN_SIZE)
    want = {n: _value(n, x) for n, x in r.items()}
    for n, v in want.items():
        _put(buf, r[n], v)
    assert proto.decode_pin(bytes(buf))._asdict() == want


def test_engine_codes(doc: Doc) -> None:
    """Section 5's table of engine codes is _protocol.ENGINES."""
    text = DOC.read_text(encoding="utf-8")
    sec = text[text.index("## 5. Engine codes") : text.index("## 6.")]
    rows = dict((int(c), n) for c, n in re.findall(r"^\| ([0-9]+) \| `?([a-z-]+)`? \|", sec, re.M))
    assert rows == proto.ENGINES


def test_every_layout_checked(doc: Doc) -> None:
    """Every layout the document has is one a test above checks (a new one needs a test)."""
    checked = {"1.3 ", "2 ", "3.1 reply", "3.2 request", "3.2 reply", "3.2.3 request", "3.2.3 reply", "3.3 request", "3.4 request",
               "3.4 reply", "3.5 request", "3.5 reply", "3.6 request", "3.6 reply", "3.7 request", "3.8 request", "3.8 reply",
               "3.9 request", "3.9 reply"}
    # Section 5's rows look like a layout's to the parser; test_engine_codes reads them.
    found = {k for k, v in doc.layouts.items() if v and k != "5 "}
    assert found - checked == set(), f"layouts no test checks: {sorted(found - checked)}"
    assert checked - found == set(), f"layouts the document lost: {sorted(checked - found)}"
