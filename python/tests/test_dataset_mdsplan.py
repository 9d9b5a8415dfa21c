"""Issue 15 for MDS: a DataLoader worker plans an MDS shard's ndarray columns whose dtype or
shape each sample stores (encoding "ndarray" or "ndarray:<dtype>") without reading each sample's
header. The daemon's shard index carries the geometry of those headers (docs/index-format.md,
"ndarray_headers"); it must equal the client's own parse, follow rewrites, and malformed headers
keep the client's own errors."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import pytest

import _mds_helpers as mh
from _pread_trace import PreadTrace

COLUMNS = {"id": "int64", "raw": "bytes", "x": "ndarray", "y": "ndarray:float32", "z": "ndarray:int16:3,5"}
GPU = ["x", "y", "z"]


def _samples(rng: np.random.Generator, n: int, base: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        dt = rng.choice(["float32", "int16", "uint8", "float64", "int64"])
        shape = tuple(int(v) for v in rng.integers(1, 9, int(rng.integers(1, 4))))
        if i % 17 == 0:
            shape = (300, 2)  # dims of two bytes
        x = (rng.standard_normal(shape) * 100).astype(dt)
        y = rng.standard_normal((int(rng.integers(1, 40)),)).astype(np.float32)
        z = rng.integers(-999, 999, (3, 5)).astype(np.int16)
        out.append({"id": base + i, "raw": rng.bytes(int(rng.integers(1, 50))), "x": x, "y": y, "z": z})
    return out


def _index(path: str) -> dict[str, Any]:
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(path, gpu_keys=["x"], strict=True)
    try:
        return ds._shard(0).index
    finally:
        ds.close()


def _served(doc: dict[str, Any], column: str = "x") -> list[Any]:
    """Per sample, the geometry of column the daemon's index gives (header length, dtype, shape), or None."""
    table = doc.get("ndarray_headers", [])
    out = []
    for s in doc["samples"]:
        k = s["columns"][column].get("ndarray")
        h = table[k] if k is not None else None
        out.append(None if h is None else (h["header_length"], h["dtype"], tuple(h["shape"])))
    return out


def _rows(batch: Any) -> list[dict[str, Any]]:
    b = batch.materialize()
    return [{f: (v[i] if isinstance(v, (list, tuple)) or hasattr(v, "shape") else v) for f, v in b.items()} for i in range(len(b["__key__"]))]


def test_workers_plan_variable_ndarray_columns_without_header_preads(gdsfs_mount, tmp_path) -> None:
    """A DataLoader with 2 workers over MDS shards with a dtype-and-shape-per-sample column, a
    shape-per-sample column and a fixed one: every sample once with the bytes, dtype and shape
    decoded from the backing file, and no worker pread lands on an ndarray value's first byte
    (the header read each sample's plan used to make)."""
    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir

    src, mnt = fresh_dir(gdsfs_mount, "mdsplan")
    rng = np.random.default_rng(1515)
    backing = mh.write_dataset(src, COLUMNS, [_samples(rng, 70, 0), _samples(rng, 53, 1000)])
    truth: dict[str, dict[str, Any]] = {}
    starts: dict[str, set[int]] = {}
    for p in backing:
        _cols, rows, ranges = mh.decode_shard(p)
        base = os.path.basename(p)
        for i, (row, where) in enumerate(zip(rows, ranges)):
            truth[f"{base}/{i}"] = row
            starts.setdefault(base, set()).update(where[c][0] for c in ("x", "y"))
    log = str(tmp_path / "preads")
    os.makedirs(log)
    ds = gt.GDSShardDataset(mnt, gpu_keys=GPU, strict=True, shuffle=True, seed=3)
    seen = set()
    for batch in gt.DataLoader(ds, batch_size=8, num_workers=2, worker_init_fn=PreadTrace(log, starts)):
        for row in _rows(batch):
            key = row["__key__"]
            assert key not in seen, f"{key} delivered twice"
            seen.add(key)
            want = truth[key]
            assert row["id"] == want["id"] and row["raw"] == want["raw"], key
            for c in GPU:
                got = row[c].cpu().numpy()
                assert (got.dtype, got.shape) == (want[c].dtype, want[c].shape), (key, c)
                assert got.tobytes() == want[c].tobytes(), (key, c)
    ds.close()
    assert seen == set(truth)
    traced = os.listdir(log)
    assert len([n for n in traced if n.startswith("worker-")]) == 2, traced
    hits = [open(os.path.join(log, n)).read() for n in traced if n.startswith("hdr-")]
    assert not hits, f"{sum(h.count(chr(10)) for h in hits)} preads of ndarray headers, e.g. {hits[0][:200]}"
    assert gdsfs_mount.wait_leases(0) == 0


def _client_parse(encoding: str, value: bytes) -> Any:
    """The client's own plan of a value's header: (header length, dtype, shape) or the error."""
    from gdsfs import _layout

    try:
        at, dtype, shape = _layout.mds_ndarray_prefix(encoding, value)
        _layout.mds_ndarray_check(dtype, shape, len(value) - at)
    except Exception as e:  # noqa: BLE001 - the oracle records any failure
        return (type(e).__name__, str(e))
    return (at, dtype, shape)


def test_ndarray_geometry_only_where_the_client_parses_the_same(gdsfs_mount) -> None:
    """Headers mutated at random (dtype codes, shape bytes, value lengths): wherever the daemon
    serves geometry, the client's own parse of the header gives exactly it; every unmutated
    header gets geometry."""
    from _wds_helpers import fresh_dir

    rng = random.Random(15)
    nrng = np.random.default_rng(15)
    for enc in ("ndarray", "ndarray:int32"):
        src, mnt = fresh_dir(gdsfs_mount, "mdsmut")
        values, plain = [], set()
        for i in range(400):
            dt = "int32" if enc != "ndarray" else str(nrng.choice(["float32", "uint8", "int16", "float64", "uint16"]))
            shape = tuple(int(v) for v in nrng.integers(1, 300 if i % 5 == 0 else 6, int(nrng.integers(1, 4))))
            v = bytearray(mh.ndarray_value(enc, np.zeros(shape, dt)))
            n = rng.choice((0, 0, 1, 1, 2))
            if not n:
                plain.add(i)
            for _ in range(n):
                op = rng.random()
                at = rng.randrange(min(len(v), 12))
                if op < 0.6:
                    v[at] = rng.randrange(256)
                elif op < 0.8:
                    del v[len(v) - rng.randrange(1, 4):]
                else:
                    v += bytes(rng.randrange(1, 4))
            values.append(bytes(v))
        mh.write_dataset(src, {"x": enc}, [[{"x": v} for v in values]])
        served = _served(_index(os.path.join(mnt, "shard.00000.mds")))
        with_geo = 0
        for i, v in enumerate(values):
            if served[i] is not None:
                with_geo += 1
                assert served[i] == _client_parse(enc, v), (enc, i, v[:20])
            else:
                assert i not in plain, (enc, i, v[:20])
        assert with_geo >= 150, with_geo


def _run(path: str, strip: bool, handler: str = "raise") -> Any:
    """Every sample's (key, dtype, shape, bytes) of x, or the error (type, text)."""
    import gdsfs.torch as gt

    ds = gt.GDSShardDataset(path, gpu_keys=["x"], strict=True, handler=handler)
    if strip:
        for st in ds._open.values():
            st.mds_headers = []  # the client reads every header itself, as before
    try:
        out = []
        for b in gt.DataLoader(ds, batch_size=1):
            t = b.materialize()["x"][0]
            out.append((b["__key__"][0], str(t.dtype), tuple(t.shape), t.cpu().numpy().tobytes()))
        return out
    except Exception as e:  # noqa: BLE001 - compared with the other run's
        return (type(e).__name__, str(e))
    finally:
        ds.close()


def _hdr(dtype_code: int, ndim_code: int, dims: bytes) -> bytes:
    return bytes([dtype_code, ndim_code]) + dims


@pytest.mark.filterwarnings("ignore::gdsfs.torch.GDSShardWarning")
@pytest.mark.parametrize("case", [
    ("unknown dtype code", _hdr(7, (1 << 2) | 0, b"\x04") + bytes(16)),
    ("dims past the value", _hdr(34, (20 << 2) | 3, b"\x01\x00")),
    ("empty value", b""),
    ("data short of the shape", _hdr(34, (2 << 2) | 0, b"\x02\x03") + bytes(20)),
    ("data past the shape", _hdr(34, (1 << 2) | 0, b"\x04") + bytes(20)),
    ("no torch dtype", _hdr(16, (1 << 2) | 0, b"\x04") + bytes(8)),
])
def test_malformed_ndarray_headers_give_the_clients_errors(gdsfs_mount, case: tuple[str, bytes]) -> None:
    """The same one-line error (and with handler='warn_and_skip' the same samples) with the
    daemon's geometry as with the geometry taken away, naming the sample and shard."""
    from _wds_helpers import fresh_dir

    src, mnt = fresh_dir(gdsfs_mount, "mdsbad")
    good = mh.ndarray_value("ndarray", np.arange(6, dtype=np.float32))
    mh.write_dataset(src, {"x": "ndarray"}, [[{"x": good}, {"x": case[1]}, {"x": good}]])
    path = os.path.join(mnt, "shard.00000.mds")
    got = [_run(path, strip) for strip in (False, True)]
    assert got[0] == got[1], got
    assert isinstance(got[0], tuple) and got[0][0] == "GDSShardError", got[0]
    assert "\n" not in got[0][1] and "shard.00000.mds/1" in got[0][1] and "'x'" in got[0][1], got[0][1]
    skipped = [_run(path, strip, "warn_and_skip") for strip in (False, True)]
    assert skipped[0] == skipped[1] and [k for k, *_ in skipped[0]] == ["shard.00000.mds/0", "shard.00000.mds/2"], skipped
    assert gdsfs_mount.wait_leases(0) == 0


def test_a_persistent_worker_plans_a_rewritten_mds_shard_anew(gdsfs_mount) -> None:
    """A persistent worker keeps its open shards' plans between epochs; an MDS shard rewritten
    in place through the mount between them (new dtypes and shapes, same sizes) is planned anew:
    the next epoch has the new geometry and bytes, not the old file's."""
    import gdsfs.torch as gt
    from _wds_helpers import fresh_dir

    src, mnt = fresh_dir(gdsfs_mount, "mdspersist")
    rng = np.random.default_rng(5)
    first = [{"x": rng.standard_normal((4, 16)).astype(np.float32)} for _ in range(12)]
    mh.write_dataset(src, {"x": "ndarray"}, [first])
    ds = gt.GDSShardDataset(mnt, gpu_keys=["x"], strict=True)
    dl = gt.DataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True)

    def epoch(dl: Any) -> dict[str, np.ndarray]:
        return {r["__key__"]: r["x"].cpu().numpy().copy() for b in dl for r in _rows(b)}

    got = epoch(dl)
    assert {(v.dtype.name, v.shape) for v in got.values()} == {("float32", (4, 16))}
    second = [{"x": rng.integers(-9, 9, (16, 8)).astype(np.int16) if i % 2 else rng.integers(0, 9, (8, 8)).astype(np.int32)} for i in range(12)]
    new = mh.shard_bytes({"x": "ndarray"}, second)
    with open(os.path.join(mnt, "shard.00000.mds"), "r+b") as f:
        assert len(new) == os.fstat(f.fileno()).st_size
        f.write(new)
    ds.set_epoch(1)
    got = epoch(dl)
    assert got.keys() == {f"shard.00000.mds/{i}" for i in range(12)}
    for i, s in enumerate(second):
        g = got[f"shard.00000.mds/{i}"]
        assert g.dtype == s["x"].dtype and g.shape == s["x"].shape and np.array_equal(g, s["x"]), i
    del dl
    ds.close()
    assert gdsfs_mount.wait_leases(0) == 0


def test_fixed_columns_and_older_indexes_keep_todays_plan(gdsfs_mount) -> None:
    """A fixed-shape ndarray column gets no geometry (its encoding says it), and a shard index
    without ndarray_headers (an older daemon's) plans from each header as before, with the
    same samples."""
    from _wds_helpers import fresh_dir

    src, mnt = fresh_dir(gdsfs_mount, "mdsold")
    rng = np.random.default_rng(9)
    mh.write_dataset(src, COLUMNS, [_samples(rng, 20, 0)])
    path = os.path.join(mnt, "shard.00000.mds")
    doc = _index(path)
    assert all(g is None for g in _served(doc, "z")) and all(g is not None for g in _served(doc, "x"))
    got = _run(path, strip=False)
    assert isinstance(got, list) and len(got) == 20 and got == _run(path, strip=True), got
