"""Issue 15, a worker's cost of a shard's index: with the capability INDEX_COLUMNS the daemon
serves a tar's index as columns (docs/index-format.md, "Tar columns"), which a worker decodes
in one pass instead of json.loads-ing every sample's dict. The samples it plans must be the
JSON form's exactly; a daemon or client without the capability keeps the JSON; a malformed
columns document is refused with one line, never planned from."""

from __future__ import annotations

import io
import os
import struct
import tarfile
from typing import Any

import pytest

from gdsfs import _core
from gdsfs import _protocol as proto


def _npy(arr: Any) -> bytes:
    import numpy as np

    b = io.BytesIO()
    np.save(b, arr)
    return b.getvalue()


def _write_tar(path: str, n: int) -> None:
    """n samples of a float32 .npy and a .cls, with the oddities a tar index carries: a key
    that is not ASCII, a hard link, a member outside any sample, a skipped symlink, a sample
    whose .npy header the daemon leaves to the client (a structured dtype)."""
    import numpy as np

    rng = np.random.default_rng(7)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))

        add("README", b"not a sample\n")
        for i in range(n):
            key = f"s{i:05d}" if i != 3 else "sé03"
            add(f"{key}.cls", str(i % 10).encode())
            arr = rng.standard_normal((4, 6)).astype(np.float32)
            add(f"{key}.x.npy", _npy(arr))
            if i == 5:
                add(f"{key}.y.npy", _npy(np.zeros(3, dtype=[("a", "<f4"), ("b", "<i2")])))
        ln = tarfile.TarInfo(f"{key}.z.npy")  # in the last sample
        ln.type, ln.linkname = tarfile.LNKTYPE, "s00001.x.npy"
        tf.addfile(ln)
        sl = tarfile.TarInfo("zz.lnk")
        sl.type, sl.linkname = tarfile.SYMTYPE, "README"
        tf.addfile(sl)


@pytest.fixture()
def shard(gdsfs_mount, tmp_path) -> str:
    d = os.path.join(gdsfs_mount.src, f"cols-{tmp_path.name}")
    os.makedirs(d)
    _write_tar(os.path.join(d, "a.tar"), 300)
    _write_tar(os.path.join(d, "b.tar"), 41)
    return os.path.join(gdsfs_mount.mnt, os.path.basename(d))


def _dataset(paths: Any, columns: bool, strict: bool = True) -> Any:
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], keys=["cls", "x.npy"], strict=strict)
    if not columns:
        # What an older daemon says: no INDEX_COLUMNS. The workers inherit it.
        h = ds.session.hello
        ds.session.hello = h._replace(caps=h.caps & ~proto.CAP_INDEX_COLUMNS)
        ds._close_shards()
    return ds


def _batches(ds: Any, workers: int) -> list[dict[str, Any]]:
    import gdsfs.torch as gt

    out = []
    for b in gt.DataLoader(ds, batch_size=16, num_workers=workers):
        x = b["x.npy"]
        x = x.materialize() if hasattr(x, "materialize") else x
        out.append({"key": list(b["__key__"]), "cls": [int(c) for c in b["cls"]], "x": x.cpu().numpy().tobytes()})
    return out


def test_columns_plan_the_samples_the_json_plans(shard) -> None:
    paths = [os.path.join(shard, "a.tar"), os.path.join(shard, "b.tar")]
    with _dataset(paths, columns=True) as ds:
        assert ds.session.hello.caps & proto.CAP_INDEX_COLUMNS, "the daemon offers INDEX_COLUMNS"
        cols = ds._shard(0).index
        assert cols["samples"].form == "columns"
        got = {w: _batches(ds, w) for w in (0, 2)}
    with _dataset(paths, columns=False) as ds:
        js = ds._shard(0).index
        assert isinstance(js["samples"], list)
        want = {w: _batches(ds, w) for w in (0, 2)}
    assert got == want
    assert sum(len(b["key"]) for b in want[2]) == 341
    # The whole document, sample by sample, is the JSON's.
    assert list(cols["samples"]) == js["samples"]
    assert {k: v for k, v in cols.items() if k != "samples"} == {k: v for k, v in js.items() if k != "samples"}
    assert cols["samples"][3]["key"] == "sé03" and cols["samples"][-1] == js["samples"][-1]


def test_json_when_the_daemon_has_no_columns(shard, monkeypatch) -> None:
    flags: list[int] = []
    real = _core._ioctl

    def spy(fd: int, cmd: int, buf: bytearray) -> None:
        if cmd == proto.INDEX:
            flags.append(struct.unpack_from("<I", buf, 40)[0])
        real(fd, cmd, buf)

    monkeypatch.setattr(_core, "_ioctl", spy)
    with _dataset(os.path.join(shard, "b.tar"), columns=False) as ds:
        flags.clear()
        assert isinstance(ds._shard(0).index["samples"], list)
        assert len(_batches(ds, 0)) == 3
    assert flags and set(flags) == {0}, "an INDEX request without INDEX_COLUMNS asks for JSON"
    with _dataset(os.path.join(shard, "b.tar"), columns=True) as ds:
        ds._close_shards()
        flags.clear()
        ds._shard(0)
    assert flags and set(flags) == {proto.INDEX_FLAG_COLUMNS}


def _columns_doc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        doc, _version, form = _core._paged_index(fd, columns=True)
    finally:
        os.close(fd)
    assert form == proto.INDEX_FORM_TAR_COLUMNS
    return doc


def _sections(doc: bytes) -> dict[str, int]:
    """Where the name-id and sample-field-end columns of a columns document start."""
    head, ns, nf, nn, _nl, kb, nb, _lb = struct.unpack_from("<8I", doc, 8)
    w = doc[40:48]
    key_end = 48 + head + nn * w[6] + nb
    field_end = key_end + ns * w[0] + kb
    return {"field_end": field_end, "name_id": field_end + ns * w[1], "w_field_end": w[1], "w_name_id": w[2]}


def _field_column(doc: bytes, i: int, v: int) -> bytes:
    s = _sections(doc)
    b = bytearray(doc)
    b[s["name_id"] + i * s["w_name_id"]] = v
    return bytes(b)


def _field_end(doc: bytes, i: int, v: int) -> bytes:
    s = _sections(doc)
    b = bytearray(doc)
    b[s["field_end"] + i * s["w_field_end"]] = v
    return bytes(b)


def _bad_docs(good: bytes) -> dict[str, bytes]:
    """Malformed columns documents: (what is wrong) -> bytes."""
    def put(off: int, fmt: str, v: int) -> bytes:
        b = bytearray(good)
        struct.pack_into(fmt, b, off, v)
        return bytes(b)

    return {
        "truncated": good[:-3],
        "one byte too many": good + b"\0",
        "bad magic": b"XXXX" + good[4:],
        "unknown version": put(4, "<I", 9),
        "samples past the bound": put(12, "<I", 1 << 30),
        "fields fewer than samples need": put(16, "<I", 1),
        "a width of 3 bytes": put(40, "<B", 3),
        "key bytes past the document": put(28, "<I", 0xFFFFFFF0),
        "a name id past the names": _field_column(good, 0, 0xFF),
        "a sample's fields out of order": _field_end(good, 0, 200),
    }


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "no-numpy"])
def test_malformed_columns_are_refused_in_one_line(shard, monkeypatch, numpy: bool) -> None:
    from gdsfs import _indexcols
    from gdsfs._errors import GDSUnavailableError

    if not numpy:
        monkeypatch.setattr(_indexcols, "_np", None)  # the checks without numpy
    good = _columns_doc(os.path.join(shard, "b.tar"))
    doc = _indexcols.decode(good, "b.tar")
    assert len(doc["samples"]) == 41
    for what, bad in _bad_docs(good).items():
        with pytest.raises(GDSUnavailableError) as ei:
            d = _indexcols.decode(bad, "b.tar")
            list(d["samples"])  # nothing is left to fail later
        msg = str(ei.value)
        assert "\n" not in msg and "b.tar" in msg and "index columns" in msg, (what, msg)


def test_a_malformed_columns_page_fails_the_dataset(shard, monkeypatch) -> None:
    from gdsfs._errors import GDSUnavailableError

    good = _columns_doc(os.path.join(shard, "b.tar"))
    real = _core._paged_index

    def corrupt(fd: int, *, columns: bool) -> tuple[bytes, int, int]:
        doc, version, form = real(fd, columns=columns)
        return (good[:-1], version, form) if form == proto.INDEX_FORM_TAR_COLUMNS else (doc, version, form)

    monkeypatch.setattr(_core, "_paged_index", corrupt)
    with pytest.raises(GDSUnavailableError, match="index columns") as ei:
        _dataset(os.path.join(shard, "b.tar"), columns=True)
    assert "\n" not in str(ei.value)
    # strict=False: said once, and the shard is indexed here; the batches are the same.
    from gdsfs._errors import GDSFallbackWarning

    with pytest.warns(GDSFallbackWarning, match="index columns"):
        ds = _dataset(os.path.join(shard, "b.tar"), columns=True, strict=False)
    with ds:
        got = _batches(ds, 0)
    monkeypatch.undo()
    with _dataset(os.path.join(shard, "b.tar"), columns=False) as ds:
        assert got == _batches(ds, 0)


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "no-numpy"])
def test_mutated_columns_decode_or_fail_in_one_line(shard, monkeypatch, numpy: bool) -> None:
    """The client's fuzz target for the columns decoder (the daemon's is cache's FuzzTarColumns):
    a real document with bytes changed, counts rewritten or bytes cut out either decodes into
    samples that can all be read, or is refused with GDSUnavailableError; never another error."""
    import random

    from gdsfs import _indexcols
    from gdsfs._errors import GDSUnavailableError

    if not numpy:
        monkeypatch.setattr(_indexcols, "_np", None)
    good = _columns_doc(os.path.join(shard, "b.tar"))
    rng = random.Random(20261201)
    for _ in range(1500):
        b = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            k = rng.random()
            if k < 0.6:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif k < 0.8:
                struct.pack_into("<I", b, rng.randrange(4, 40, 4), rng.choice([0, 1, 0xFFFFFFFF, len(b), rng.randrange(1 << 22)]))
            else:
                del b[rng.randrange(len(b))]
        try:
            s = _indexcols.decode(bytes(b), "b.tar")["samples"]
            for i in range(len(s)):
                s[i], s.fields(i), s.span(i)
        except GDSUnavailableError as e:
            assert "\n" not in str(e)
