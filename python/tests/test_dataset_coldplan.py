"""Issue 15, cold: a fresh DataLoader worker plans its batches without reading each sample's
.npy header from the (cold) shard. The daemon's tar index carries each .npy member's geometry
(docs/index-format.md, "npy_headers"); it must equal the client's own parse of the header and
numpy's, never be served stale after a rewrite, and malformed headers keep today's errors."""

from __future__ import annotations

import io
import os
import random
import struct
import tarfile
from typing import Any, Optional

import pytest

from _pread_trace import PreadTrace

HERE = os.path.dirname(os.path.abspath(__file__))


def _drop(paths: list[str]) -> None:
    """Drops these files' pages from the page cache (this test's files only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _npy_v(arr: Any, version: Optional[tuple[int, int]] = None) -> bytes:
    import numpy as np

    b = io.BytesIO()
    np.lib.format.write_array(b, np.asanyarray(arr), version=version)
    return b.getvalue()


def _raw_npy(header: str, data: bytes, major: int = 1) -> bytes:
    """A .npy of this header text (padded as numpy pads it) and data, bypassing numpy."""
    pre = 10 if major == 1 else 12
    h = header
    while (pre + len(h) + 1) % 64:
        h += " "
    h += "\n"
    raw = h.encode("latin1" if major < 3 else "utf8")
    size = struct.pack("<H", len(raw)) if major == 1 else struct.pack("<I", len(raw))
    return b"\x93NUMPY" + bytes([major, 0]) + size + raw + data


def _index(path: str) -> dict[str, Any]:
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(path, gpu_keys=["x.npy"], strict=True)
    try:
        return ds._shard(0).index
    finally:
        ds.close()


def _served(doc: dict[str, Any]) -> dict[str, Optional[tuple[int, str, tuple[int, ...], bool]]]:
    """Per sample key, the x.npy geometry the daemon's index gives (None: none)."""
    table = doc.get("npy_headers", [])
    out: dict[str, Optional[tuple[int, str, tuple[int, ...], bool]]] = {}
    for s in doc["samples"]:
        m = s["fields"].get("x.npy")
        if m is not None:
            k = m.get("npy")
            h = table[k] if k is not None else None
            out[s["key"]] = None if h is None else (h["header_length"], h["dtype"], tuple(h["shape"]), h["fortran_order"])
    return out


def _client_parse(member: bytes) -> Any:
    """What the client's own parse of the header gives (geometry or the exception's type and text)."""
    import warnings

    from gdsfs import _layout

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # literal_eval of "\o" and the like
            h = _layout.npy_header_cached(member[:4096])
    except Exception as e:  # noqa: BLE001 - the oracle records any failure
        return (type(e).__name__, str(e))
    return (h.data_offset, h.dtype, h.shape, h.fortran_order)


def test_npy_geometry_equals_numpy_and_the_clients_parse(gdsfs_mount) -> None:
    import numpy as np

    from _wds_helpers import fresh_dir, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "geo")
    arrays: dict[str, bytes] = {}
    for name in sorted(os.listdir(os.path.join(HERE, "npy_fixtures"))):
        arrays["fx_" + name.split(".")[0]] = open(os.path.join(HERE, "npy_fixtures", name), "rb").read()
    rng = np.random.default_rng(7)
    gen = {
        "f4": rng.standard_normal((4, 5)).astype(np.float32),
        "f2_fortran": np.asfortranarray(rng.standard_normal((3, 7)).astype(np.float16)),
        "i8_3d": rng.integers(0, 9, (2, 3, 4)),
        "u1_0d": np.array(7, dtype=np.uint8),
        "b1": np.array([True, False, True]),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "i2_big": np.arange(6, dtype=">i2"),
        "c8": np.arange(3).astype(np.complex64),
        "u4": np.array(["ab", "c"]),
        "f8_long": np.zeros((1, 1, 1, 1, 1, 1, 1, 2), dtype=np.float64),
    }
    for k, a in gen.items():
        arrays[k] = _npy_v(a)
    arrays["v2"] = _npy_v(np.arange(10, dtype=np.int32), (2, 0))
    arrays["v3"] = _npy_v(np.arange(10, dtype=np.int32), (3, 0))
    write_tar(os.path.join(src, "g.tar"), [(k, {"x.npy": v, "cls": b"1"}) for k, v in arrays.items()])
    served = _served(_index(os.path.join(mnt, "g.tar")))
    for k, raw in arrays.items():
        f = io.BytesIO(raw)
        ver = np.lib.format.read_magic(f)
        shape, fortran, dtype = np.lib.format._read_array_header(f, ver)  # numpy's own parse
        assert served[k] is not None, f"{k}: no geometry served"
        hl, descr, sh, fo = served[k]
        assert (hl, sh, fo) == (f.tell(), shape, fortran), k
        assert np.dtype(descr) == dtype, k
        assert served[k] == _client_parse(raw), k


def test_npy_geometry_only_where_the_client_parses_the_same(gdsfs_mount) -> None:
    """Headers mutated at random: wherever the daemon serves geometry, the client's own parse
    gives exactly it; where the client's parse fails, the daemon serves none."""
    from _wds_helpers import fresh_dir, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "mut")
    base = ["{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            "{'descr': '|u1', 'fortran_order': True, 'shape': (24,), }",
            "{'shape': (), 'descr': '<i2', 'fortran_order': False}",
            '{"descr": "<f8", "fortran_order": False, "shape": (3, 1,)}']
    alphabet = "(),:' \"\\\n\t0123456789LTFNe_-[]{}x<>|\xe9"
    rng = random.Random(1515)
    members: dict[str, bytes] = {}
    plain: set[str] = set()
    for i in range(600):
        h = rng.choice(base)
        n = rng.choice((0, 1, 1, 2, 3))
        if not n:
            plain.add(f"m{i:04d}")
        for _ in range(n):
            at = rng.randrange(len(h))
            op = rng.random()
            c = rng.choice(alphabet)
            h = h[:at] + c + h[at + 1:] if op < 0.5 else h[:at] + c + h[at:] if op < 0.8 else h[:at] + h[at + 1:]
        members[f"m{i:04d}"] = _raw_npy(h, bytes(48), major=rng.choice((1, 1, 2, 3)))
    write_tar(os.path.join(src, "m.tar"), [(k, {"x.npy": v}) for k, v in members.items()])
    served = _served(_index(os.path.join(mnt, "m.tar")))
    with_geo = 0
    for k, raw in members.items():
        want = _client_parse(raw)
        if served[k] is not None:
            with_geo += 1
            assert served[k] == want, (k, raw[:200])
        else:
            # None where the client's parse succeeds is allowed (it then reads the header
            # itself), but not for the unmutated headers.
            assert k not in plain, (k, raw[:200])
    assert with_geo >= 100 and plain, (with_geo, len(plain))


def _run(ds: Any) -> Any:
    """Every sample's x.npy as (key, shape, dtype, bytes), or the exception (type, text)."""
    import warnings

    import gdsfs.torch as gt

    try:
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the client's literal_eval of "\<"
            batches = list(gt.DataLoader(ds, batch_size=1))
        for b in batches:
            t = b["x.npy"][0]
            out.append((b["__key__"][0], tuple(t.shape), str(t.dtype), t.cpu().numpy().tobytes()))
        return out
    except Exception as e:  # noqa: BLE001 - compared with the oracle's
        return (type(e).__name__, str(e))


@pytest.mark.parametrize("case", [
    ("bad dict", "{'descr': '<f4' 'fortran_order': False, 'shape': (6,), }"),
    ("shape (6) is an int", "{'descr': '<f4', 'fortran_order': False, 'shape': (6), }"),
    ("leading zero", "{'descr': '<f4', 'fortran_order': False, 'shape': (06,), }"),
    ("python 2 long", "{'descr': '<f4', 'fortran_order': False, 'shape': (6L,), }"),
    ("escaped descr", "{'descr': '\\<f4', 'fortran_order': False, 'shape': (6,), }"),
    ("big-endian", "{'descr': '>f4', 'fortran_order': False, 'shape': (6,), }"),
    ("unicode dtype", "{'descr': '<U2', 'fortran_order': False, 'shape': (3,), }"),
    ("structured", "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (6,), }"),
    ("no descr", "{'fortran_order': False, 'shape': (6,), }"),
    ("not npy", None),
])
def test_malformed_npy_headers_give_todays_errors(gdsfs_mount, case: tuple[str, Optional[str]]) -> None:
    """The same error (or samples) as the client's own header parse: the dataset with the
    daemon's geometry against the same dataset with the geometry taken away."""
    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "bad")
    good = npy(np.arange(6, dtype=np.float32))
    bad = b"not an array at all, just bytes" if case[1] is None else _raw_npy(case[1], bytes(24))
    write_tar(os.path.join(src, "b.tar"), [("a", {"x.npy": good}), ("b", {"x.npy": bad}), ("c", {"x.npy": good})])
    path = os.path.join(mnt, "b.tar")
    results = []
    for strip in (False, True):
        ds = gt.GDSShardDataset(path, gpu_keys=["x.npy"], strict=True)
        if strip:
            for st in ds._open.values():
                st.npy_headers = []  # the client reads every header itself, as before
        results.append(_run(ds))
        ds.close()
    assert results[0] == results[1]
    assert isinstance(results[0], tuple), results[0]  # every case is an error today
    assert gdsfs_mount.wait_leases(0) == 0


def test_npy_geometry_follows_rewrites_in_place(gdsfs_mount) -> None:
    """A shard rewritten in place with new headers of the same size (behind the mount, then
    through it): a new dataset sees the new dtype and shape, never the old geometry."""
    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "rew")
    rng = np.random.default_rng(3)
    write_tar(os.path.join(src, "r.tar"), [(f"k{i}", {"x.npy": npy(rng.standard_normal(4096).astype(np.float32)), "cls": b"1"}) for i in range(40)])

    def rewrite(path: str, make: Any) -> dict[str, np.ndarray]:
        want = {}
        with tarfile.open(os.path.join(src, "r.tar")) as tf:
            ms = [m for m in tf if m.name.endswith(".x.npy")]
        with open(path, "r+b") as f:
            for m in ms:
                a = make()
                raw = npy(a)
                assert len(raw) == m.size
                f.seek(m.offset_data)
                f.write(raw)
                want[m.name[: -len(".x.npy")]] = a
            f.flush()
            os.fsync(f.fileno())
        return want

    def seen() -> dict[str, np.ndarray]:
        ds = gt.GDSShardDataset(os.path.join(mnt, "r.tar"), gpu_keys=["x.npy"], strict=True)
        out = {}
        for b in gt.DataLoader(ds, batch_size=8, num_workers=2):
            for i, k in enumerate(b["__key__"]):
                out[k] = b["x.npy"][i].cpu().numpy().copy()
        ds.close()
        return out

    def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
        return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(a[k], b[k]) for k in a)

    first = seen()
    assert {v.shape for v in first.values()} == {(4096,)}
    # Behind the mount: float32 (4096,) -> int32 (64, 64), headers of the same length.
    want = rewrite(os.path.join(src, "r.tar"), lambda: rng.integers(-99, 99, (64, 64)).astype(np.int32))
    _drop([os.path.join(src, "r.tar")])
    assert same(seen(), want)
    # Through the mount: -> float16 (2, 4096), Fortran order.
    want = rewrite(os.path.join(mnt, "r.tar"), lambda: np.asfortranarray(rng.standard_normal((2, 4096)).astype(np.float16)))
    got = seen()
    assert same(got, want)
    assert gdsfs_mount.wait_leases(0) == 0


def test_fresh_cold_worker_reads_no_npy_headers(gdsfs_mount, tmp_path) -> None:
    """A fresh DataLoader worker on cold shards the daemon has indexed: no pread lands on an
    x.npy member (the header reads planning used to make), and every sample arrives once with
    the file's bytes."""
    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "fresh")
    rng = np.random.default_rng(15)
    truth: dict[str, bytes] = {}
    backing, paths = [], []
    for s in range(2):
        samples = []
        for i in range(150):
            a = rng.standard_normal(4096).astype(np.float32)
            samples.append((f"f{s}_{i:04d}", {"cls": str(i % 10).encode(), "x.npy": npy(a)}))
            truth[f"f{s}_{i:04d}"] = a.tobytes()
        write_tar(os.path.join(src, f"s{s}.tar"), samples)
        backing.append(os.path.join(src, f"s{s}.tar"))
        paths.append(os.path.join(mnt, f"s{s}.tar"))
    starts = {}
    for p in backing:
        with tarfile.open(p) as tf:
            starts[os.path.basename(p)] = sorted(m.offset_data for m in tf if m.name.endswith(".x.npy"))
    for p in paths:
        _index(p)  # the daemon indexes the shards (as the dataset's construction does)
    _drop(backing + paths)

    log = str(tmp_path / "preads")
    os.makedirs(log)
    ds = gt.GDSShardDataset(paths, gpu_keys=["x.npy"], strict=True)
    seen: dict[str, bytes] = {}
    for b in gt.DataLoader(ds, batch_size=16, num_workers=2, worker_init_fn=PreadTrace(log, starts, prefix="npy")):
        for i, k in enumerate(b["__key__"]):
            assert k not in seen, f"{k} delivered twice"
            seen[k] = b["x.npy"][i].cpu().numpy().tobytes()
    ds.close()
    assert seen == truth
    traced = os.listdir(log)
    assert len([n for n in traced if n.startswith("worker-")]) == 2, traced
    hits = [open(os.path.join(log, n)).read() for n in traced if n.startswith("npy-")]
    assert not hits, f"{sum(h.count(chr(10)) for h in hits)} preads of x.npy headers, e.g. {hits[0][:200]}"
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_persistent_worker_plans_a_rewritten_shard_anew(gdsfs_mount) -> None:
    """A persistent worker keeps its open shards' plans between epochs; a shard rewritten in
    place through the mount between them (new dtype and shape, same size) is planned anew: the
    next epoch has the new geometry and bytes, not the plans of the old file."""
    import numpy as np

    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir, npy, write_tar

    src, mnt = fresh_dir(gdsfs_mount, "persist")
    rng = np.random.default_rng(5)
    write_tar(os.path.join(src, "p.tar"), [(f"k{i}", {"x.npy": npy(rng.standard_normal(1024).astype(np.float32)), "cls": b"1"}) for i in range(16)])
    with tarfile.open(os.path.join(src, "p.tar")) as tf:
        ms = [m for m in tf if m.name.endswith(".x.npy")]
    ds = gt.GDSShardDataset(os.path.join(mnt, "p.tar"), gpu_keys=["x.npy"], strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)
    first = {k: b["x.npy"][i].cpu().numpy().copy() for b in dl for i, k in enumerate(b["__key__"])}
    assert {v.shape for v in first.values()} == {(1024,)}
    want = {}
    with open(os.path.join(mnt, "p.tar"), "r+b") as f:
        for m in ms:
            a = rng.integers(-9, 9, (32, 32)).astype(np.int32)
            raw = npy(a)
            assert len(raw) == m.size
            f.seek(m.offset_data)
            f.write(raw)
            want[m.name[: -len(".x.npy")]] = a
    ds.set_epoch(1)
    got = {k: b["x.npy"][i].cpu().numpy().copy() for b in dl for i, k in enumerate(b["__key__"])}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and np.array_equal(got[k], want[k]), k
    del dl
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0
