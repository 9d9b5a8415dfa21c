#!/usr/bin/env python3
"""A worker's cost of a shard's index, JSON against the columns form (issue 15).

Usage: bench-index-load.py [--sizes 16,64] [--shard-mib 64] [--shards 4] [--reps 15] [--workers 2] [--json PATH]

Writes WebDataset tars of float32 .npy samples plus a .cls (scripts/bench-dataset.py's) on a
host-mode gdsfs mount of its own and measures, per sample size, interleaved, with the index as
JSON (the capability INDEX_COLUMNS masked in the client, as with a daemon or client without it)
and in the columns form (docs/index-format.md, "Tar columns"):

- INDEX: the paged fetch of one shard's document (ioctls), its decode (json.loads or
  gdsfs._indexcols.decode), and its size;
- a fresh worker's path in this process (its shards closed, as a forked DataLoader worker starts):
  from the shard's open to its index in hand, and from there to the first READ sent (planning the
  first group of samples), split as the worker sees it;
- the same worker's index and the plans of all of the shard's samples (no reads);
- a dataset's construction over the shards (the main process indexes every shard to count its
  samples and check the fields);
- a fresh gdsfs.torch.DataLoader's first batch with --workers workers (worker start included).

Medians of --reps; the ratio is JSON / columns from the same run. Warm page cache; the daemon
has the shards indexed before the first measurement.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _bench_dataset() -> Any:
    spec = importlib.util.spec_from_file_location("bench_dataset", os.path.join(HERE, "bench-dataset.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _dataset(shards: list[str], columns: bool) -> Any:
    import gdsfs.torch as gt
    from gdsfs import _protocol as proto

    ds = gt.GDSShardDataset(shards, gpu_keys=["x.npy"], strict=True)
    if not columns:
        h = ds.session.hello
        ds.session.hello = h._replace(caps=h.caps & ~proto.CAP_INDEX_COLUMNS)
        ds._close_shards()
    return ds


def _fetch(shard: str, columns: bool) -> tuple[float, float, int]:
    """(paging s, decode s, document bytes) of one INDEX of shard."""
    from gdsfs import _core, _indexcols

    fd = os.open(shard, os.O_RDONLY)
    try:
        t0 = time.perf_counter()
        raw, _v, form = _core._paged_index(fd, columns=columns)
        t1 = time.perf_counter()
        doc = _indexcols.decode(raw, shard) if columns else json.loads(raw)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
    assert len(doc["samples"]) > 0 and (form == 1) == columns
    return t1 - t0, t2 - t1, len(raw)


def _worker_path(ds: Any) -> tuple[float, float]:
    """(open -> index s, index -> first READ s) of a fresh worker's first sample."""
    from gdsfs import _core

    ds._close_shards()
    marks: dict[str, float] = {}
    real_read, real_index = _core.Session.read, ds._index_of

    def read(self: Any, *a: Any, **kw: Any) -> Any:
        marks.setdefault("read", time.perf_counter())
        return real_read(self, *a, **kw)

    def index_of(path: str, fd: int) -> Any:
        marks.setdefault("open", time.perf_counter())
        r = real_index(path, fd)
        marks.setdefault("indexed", time.perf_counter())
        return r

    _core.Session.read, ds._index_of = read, index_of  # type: ignore[method-assign]
    try:
        it = iter(ds)
        next(it)
        it.close()
    finally:
        _core.Session.read = real_read  # type: ignore[method-assign]
        del ds._index_of
    return marks["indexed"] - marks["open"], marks["read"] - marks["indexed"]


def _plan_all(ds: Any) -> float:
    """A fresh worker's index of one shard and the plans of all its samples (no reads)."""
    ds._close_shards()
    t0 = time.perf_counter()
    st = ds._shard(0)
    for i in range(len(st.index["samples"])):
        ds._sample_fields(st, i)
    return time.perf_counter() - t0


def _construct(shards: list[str], columns: bool) -> float:
    t0 = time.perf_counter()
    if columns:
        ds = _dataset(shards, True)
    else:
        # The constructor indexes every shard: mask the capability before it does.
        from gdsfs import _core
        from gdsfs import _protocol as proto

        real = _core._paged_index

        def no_columns(fd: int, *, columns: bool) -> tuple[bytes, int, int]:
            return real(fd, columns=False)

        _core._paged_index = no_columns  # type: ignore[assignment]
        try:
            ds = _dataset(shards, False)
        finally:
            _core._paged_index = real  # type: ignore[assignment]
        assert not ds.session.hello.caps & proto.CAP_INDEX_COLUMNS
    secs = time.perf_counter() - t0
    ds.close()
    return secs


def _first_batch(shards: list[str], columns: bool, workers: int) -> float:
    import gdsfs.torch as gt

    ds = _dataset(shards, columns)
    t0 = time.perf_counter()
    dl = gt.DataLoader(ds, batch_size=16, num_workers=workers)
    it = iter(dl)
    next(it)
    secs = time.perf_counter() - t0
    del it, dl
    ds.close()
    return secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64", help="sample KiB")
    ap.add_argument("--shard-mib", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "python"))
    bd = _bench_dataset()
    base = tempfile.mkdtemp(prefix="gdsfs-bench-index-load-")
    src, mnt = bd.own_mount(base)
    rows: list[dict[str, Any]] = []
    try:
        for kib in (int(x) for x in a.sizes.split(",") if x.strip()):
            per = (a.shard_mib << 20) // (kib << 10)
            backing = bd.make_tars(os.path.join(src, f"{kib}KiB"), kib, per * a.shards, a.shards)
            shards = [p.replace(src, mnt, 1) for p in backing]
            _construct(shards, True)  # the daemon indexes the shards
            res: dict[str, dict[str, list[float]]] = {"json": {}, "columns": {}}
            sizes: dict[str, int] = {}
            probes: list[tuple[str, Callable[[bool], Any]]] = [
                ("fetch", lambda c: _fetch(shards[0], c)),
                ("worker", lambda c: _worker_path(dss[c])),
                ("index + plan all", lambda c: _plan_all(dss[c])),
                ("construct", lambda c: _construct(shards, c)),
                ("first batch", lambda c: _first_batch(shards, c, a.workers)),
            ]
            dss = {c: _dataset(shards, c) for c in (False, True)}
            try:
                for rep in range(a.reps):
                    for c in (False, True) if rep % 2 == 0 else (True, False):
                        label = "columns" if c else "json"
                        r = res[label]
                        for name, probe in probes:
                            if name == "first batch" and rep >= max(3, a.reps // 3):
                                continue  # seconds of worker start each: fewer runs
                            v = probe(c)
                            if name == "fetch":
                                r.setdefault("INDEX paging", []).append(v[0])
                                r.setdefault("decode", []).append(v[1])
                                sizes[label] = v[2]
                            elif name == "worker":
                                r.setdefault("open -> index", []).append(v[0])
                                r.setdefault("index -> first READ", []).append(v[1])
                                r.setdefault("open -> first READ", []).append(v[0] + v[1])
                            else:
                                r.setdefault(name, []).append(v)
            finally:
                for ds in dss.values():
                    ds.close()
            rows.append({"kib": kib, "samples_per_shard": per, "shards": a.shards, "bytes": sizes,
                         "median": {lab: {k: statistics.median(v) for k, v in r.items()} for lab, r in res.items()}})
    finally:
        bd.unmount(mnt)
        if not os.path.ismount(mnt):
            shutil.rmtree(base, ignore_errors=True)
    print(f"host engine, warm; {a.shards} shards per size; medians of {a.reps} interleaved runs (first batch: of {max(3, a.reps // 3)}, "
          f"{a.workers} workers); ms; ratio = JSON / columns")
    for row in rows:
        b = row["bytes"]
        print(f"\n{row['kib']} KiB samples, {row['samples_per_shard']} per shard: index {b['json']:,} bytes JSON, {b['columns']:,} columns "
              f"({b['json'] / b['columns']:.1f}x smaller)")
        print(f"{'':>22} {'JSON ms':>9} {'columns ms':>10} {'ratio':>6}")
        m = row["median"]
        for k in m["json"]:
            j, c = m["json"][k] * 1e3, m["columns"][k] * 1e3
            label = k + (f" ({row['shards']} shards)" if k == "construct" else "")
            print(f"{label:>22} {j:>9.2f} {c:>10.2f} {j / c if c else float('inf'):>5.1f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
