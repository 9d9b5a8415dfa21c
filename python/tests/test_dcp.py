"""gdsfs.dcp: GDSFileSystemWriter/Reader keep stock DCP's files and move bytes through gdsfs.

With a torch that has torch.distributed.checkpoint (>= 2.x), the real dcp.save/dcp.load run
against the real stock FileSystemWriter/FileSystemReader, both directions, plus the committed
fixture written by stock DCP on torch 2.11. Debian's torch 1.13 has no usable DCP (its
torch.distributed._shard does not even import on Python 3.11), so there the writer and reader run
against _dcp_standin, which implements the stock on-disk contract; those tests say so in their
names. scripts/gpu/dcp_2gpu.py runs the 2-rank check on the GPU machine.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import _dcp_standin
from _ckpt_helpers import _bytes, daemon_dir, DTYPES, FIXTURES, make_tensor

REAL = _dcp_standin.has_real_dcp()
needs_real = pytest.mark.skipif(not REAL, reason=f"torch {torch.__version__} has no torch.distributed.checkpoint")
needs_standin = pytest.mark.skipif(REAL, reason="the real torch.distributed.checkpoint is installed; see the *_real tests")

if not REAL:
    _dcp_standin.install()
import gdsfs.dcp as gdcp  # noqa: E402  (after the stand-in is installed)


@pytest.fixture(autouse=True)
def _close_staging():
    """The staging session a snapshot keeps for the next one is closed after each test, so that
    no test's mount is left with an open session."""
    yield
    gdcp.close_staging()


@pytest.fixture
def mdir(gdsfs_mount, request):
    yield from daemon_dir(gdsfs_mount, request, "dcp")


def state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),
        "view": torch.randn(10, 10, generator=g)[:, 2:5],  # non-contiguous: saved as its own bytes
        "i16": torch.arange(7, dtype=torch.int16),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "loader": b"dataloader state: epoch 3, sample 1234",  # a Stateful's pickled state (BYTE_IO)
        **{f"dtype.{str(dt).split('.')[-1]}": make_tensor(dt, (3, 4), g) for dt in DTYPES},
    }


# --- stand-in (torch 1.13) -------------------------------------------------------------------


def _write(writer_cls, d, data):
    """Save ``data`` with dcp.save's calls (torch 2.11's order); the .metadata's storage_data."""
    return _dcp_standin.save(data, writer_cls(d)).storage_data


def _read(reader_cls, d, data, chunks=None):
    targets = {k: torch.zeros_like(v) for k, v in data.items() if not isinstance(v, bytes)}
    planner = _dcp_standin.load(targets, [k for k, v in data.items() if isinstance(v, bytes)], reader_cls(d), chunks)
    return targets, planner


def _check(data, targets, planner):
    for k, v in data.items():
        if isinstance(v, bytes):
            assert planner.bytes[k] == v
        else:
            assert targets[k].dtype == v.dtype and torch.equal(_bytes(targets[k]), _bytes(v)), k


@needs_standin
def test_standin_stock_reader_reads_gds_writer(gdsfs_mount, mdir):
    data = state(1)
    before = gdsfs_mount.stats()["counters"]["write_bytes"]
    infos = _write(gdcp.GDSFileSystemWriter, mdir, data)
    assert gdsfs_mount.stats()["counters"]["write_bytes"] - before >= 64 * 48 * 4
    assert sorted(os.listdir(mdir)) == [".metadata", "__0_0.distcp"]
    assert {i.relative_path for i in infos.values()} == {"__0_0.distcp"}
    for idx, info in infos.items():
        if idx.fqn != "loader":
            assert info.offset % 4096 == 0  # every tensor item starts 4 KiB-aligned
    _check(data, *_read(_dcp_standin.FileSystemReader, mdir, data))


@needs_standin
def test_standin_gds_reader_reads_stock_writer(gdsfs_mount, mdir):
    data = state(2)
    _write(_dcp_standin.FileSystemWriter, mdir, data)
    before = gdsfs_mount.stats()["counters"]["read_bytes"]
    _check(data, *_read(gdcp.GDSFileSystemReader, mdir, data))
    assert gdsfs_mount.stats()["counters"]["read_bytes"] - before >= 64 * 48 * 4


@needs_standin
@pytest.mark.parametrize("writer", ["gds", "stock"])
def test_standin_resharded_reads(gdsfs_mount, mdir, writer):
    """Requests for parts of saved chunks (a different sharding on load) are narrowed correctly."""
    data = {"w": torch.randn(12, 8), "v": torch.arange(30.0)}
    _write(gdcp.GDSFileSystemWriter if writer == "gds" else _dcp_standin.FileSystemWriter, mdir, data)
    chunks = {"w": [((0, 0), (5, 8)), ((5, 0), (7, 8))], "v": [((3,), (10,)), ((0,), (3,)), ((13,), (17,))]}
    targets, planner = _read(gdcp.GDSFileSystemReader, mdir, data, chunks)
    _check(data, targets, planner)


@needs_standin
def test_standin_async_staging_into_slabs(gdsfs_mount, mdir, monkeypatch):
    data = state(3)
    copied = []
    real_transfer = gdcp.transfer
    monkeypatch.setattr(gdcp, "transfer", lambda path, fd, items, **kw: (copied.extend(items), real_transfer(path, fd, items, **kw))[1])
    w = gdcp.GDSFileSystemWriter(mdir)
    tensors = {k: v for k, v in data.items() if not isinstance(v, bytes)}
    staged = w.stage(tensors)
    assert w._staged, "nothing was staged into daemon slabs"
    assert gdsfs_mount.stats()["leases"] > 0
    for k, v in tensors.items():
        assert torch.equal(_bytes(staged[k]), _bytes(v))
        if v.numel():
            v.zero_()  # training goes on: the snapshot must not change
    S = _dcp_standin
    items = [S.WriteItem(S.MetadataIndex(k), S.WriteItemType.TENSOR) for k in staged]
    w.set_up_storage_writer(True, rank=0, use_collectives=True)
    plan = w.prepare_global_plan([w.prepare_local_plan(S.SavePlan(items))])[0]
    res = w.write_data(plan, S.SavePlannerStub(staged)).wait()
    w.finish(S.Metadata(), [res])
    assert not w._staged and gdsfs_mount.wait_leases(0) == 0
    assert not copied, "staged tensors were copied again instead of written from their leases"
    want = {k: v for k, v in state(3).items() if not isinstance(v, bytes)}
    _check(want, *_read(_dcp_standin.FileSystemReader, mdir, want))


@needs_standin
@pytest.mark.parametrize("first", ["gds", "stock"])
def test_standin_gds_writer_over_existing_checkpoint(gdsfs_mount, mdir, first):
    """A second save into the same directory: the stock reader loads the new checkpoint, the data
    files of the old one and of a crashed save of ours are gone, and other files stay."""
    old, new = state(5), state(6)
    _write(gdcp.GDSFileSystemWriter if first == "gds" else _dcp_standin.FileSystemWriter, mdir, old)
    for junk in ("__7_0.distcp", "notes.txt", "__0_0.0badc0de.distcp"):
        with open(os.path.join(mdir, junk), "w") as f:
            f.write("keep")  # no .metadata names these; the last has our naming: a crashed save's
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        infos = _write(gdcp.GDSFileSystemWriter, mdir, new)
    names = {i.relative_path for i in infos.values()}
    assert names and "__0_0.distcp" not in names, "the new data files must not reuse the old names"
    assert sorted(os.listdir(mdir)) == sorted([".metadata", "__7_0.distcp", "notes.txt", *names])
    _check(new, *_read(_dcp_standin.FileSystemReader, mdir, new))
    _check(new, *_read(gdcp.GDSFileSystemReader, mdir, new))


@needs_standin
def test_standin_data_file_vanishing_is_a_save_error(gdsfs_mount, mdir, monkeypatch):
    """A data file missing once the save committed is an error naming it (the first GPU run's
    stock reader found a file the metadata named missing), not a checkpoint that cannot load."""
    real = _dcp_standin.FileSystemWriter.finish

    def finish_and_lose(self, metadata, results):
        real(self, metadata, results)
        os.unlink(os.path.join(mdir, "__0_0.distcp"))

    monkeypatch.setattr(_dcp_standin.FileSystemWriter, "finish", finish_and_lose)
    with pytest.raises(FileNotFoundError, match="__0_0.distcp"):
        _write(gdcp.GDSFileSystemWriter, mdir, state(7))


# --- real DCP (torch >= 2) ---------------------------------------------------------------------


@needs_real
def test_real_fixture_written_by_stock_dcp(gdsfs_mount, mdir):
    import torch.distributed.checkpoint as dcp

    dst = os.path.join(mdir, "ckpt")
    shutil.copytree(os.path.join(FIXTURES, "dcp_ckpt"), dst)
    ref = {"model": {"layer.weight": torch.zeros(64, 48), "layer.bias": torch.zeros(64),
                     "emb": torch.zeros(100, 16, dtype=torch.bfloat16)}, "step": torch.tensor(0)}
    got = {"model": {k: v.clone() for k, v in ref["model"].items()}, "step": torch.tensor(0)}
    dcp.load(ref, storage_reader=dcp.FileSystemReader(dst))
    dcp.load(got, storage_reader=gdcp.GDSFileSystemReader(dst))
    assert int(got["step"]) == 17
    for k in ref["model"]:
        assert torch.equal(got["model"][k], ref["model"][k]), k


@needs_real
@pytest.mark.parametrize("direction", ["gds-save-stock-load", "stock-save-gds-load", "gds-both"])
def test_real_round_trips(gdsfs_mount, mdir, direction):
    import torch.distributed.checkpoint as dcp

    data = {k: v for k, v in state(4).items() if not isinstance(v, bytes)}
    d = os.path.join(mdir, "ck")
    writer = dcp.FileSystemWriter(d) if direction == "stock-save-gds-load" else gdcp.GDSFileSystemWriter(d)
    dcp.save(data, storage_writer=writer)
    got = {k: torch.zeros_like(v) for k, v in data.items()}
    reader = dcp.FileSystemReader(d) if direction == "gds-save-stock-load" else gdcp.GDSFileSystemReader(d)
    dcp.load(got, storage_reader=reader)
    for k in data:
        assert got[k].dtype == data[k].dtype and torch.equal(_bytes(got[k]), _bytes(data[k])), k


@needs_real
def test_real_async_save_stages_dtensors_into_slabs(gdsfs_mount, mdir):
    """DTensors (and a plain tensor) are staged into daemon slabs, none the stock way (a
    GDSFallbackWarning is an error here); the snapshot ignores later training updates."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from _dcp_real import one_rank_group

    d = os.path.join(mdir, "async")
    with one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(9)
        sd = {"model": {"s": DTensor.from_local(torch.randn(64, 48, generator=g), mesh, [Shard(0)], run_check=False),
                        "r": DTensor.from_local(torch.randn(33, generator=g).to(torch.bfloat16), mesh, [Replicate()],
                                                run_check=False),
                        "p": torch.randn(100, generator=g)}}
        want = {k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in sd["model"].items()}
        w = gdcp.GDSFileSystemWriter(d)
        fut = dcp.async_save(sd, storage_writer=w)
        assert w.stage_stats["slab_tensors"] == 3 and w.stage_stats["stock_bytes"] == 0, w.stage_stats
        for v in sd["model"].values():
            (v.to_local() if isinstance(v, DTensor) else v).zero_()  # training goes on
        getattr(fut, "upload_completion", fut).result()
        got = {"model": {k: (DTensor.from_local(torch.zeros_like(want[k]), mesh, [Shard(0)] if k == "s" else [Replicate()],
                                                run_check=False) if k != "p" else torch.zeros_like(want[k]))
                         for k in want}}
        dcp.load(got, storage_reader=dcp.FileSystemReader(d))
    for k, v in got["model"].items():
        v = v.to_local() if isinstance(v, DTensor) else v
        assert torch.equal(_bytes(v), _bytes(want[k])), k


@needs_real
def test_real_async_save_stages_sharded_tensors_into_slabs(gdsfs_mount, mdir):
    import torch.distributed.checkpoint as dcp

    from _dcp_real import one_rank_group

    try:
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    except Exception as e:  # noqa: BLE001 - a torch without (an importable) ShardedTensor
        pytest.skip(f"no ShardedTensor here: {e}")
    d = os.path.join(mdir, "async-st")
    with one_rank_group():
        t = torch.randn(16, 8)
        st = init_from_local_shards([Shard.from_tensor_and_offsets(t.clone(), [0, 0], rank=0)], 16, 8)
        w = gdcp.GDSFileSystemWriter(d)
        fut = dcp.async_save({"st": st}, storage_writer=w)
        assert w.stage_stats["slab_tensors"] == 1 and w.stage_stats["stock_bytes"] == 0, w.stage_stats
        st.local_shards()[0].tensor.zero_()
        getattr(fut, "upload_completion", fut).result()
        got = init_from_local_shards([Shard.from_tensor_and_offsets(torch.zeros(16, 8), [0, 0], rank=0)], 16, 8)
        dcp.load({"st": got}, storage_reader=dcp.FileSystemReader(d))
    assert torch.equal(got.local_shards()[0].tensor, t)


@needs_real
def test_real_resharded_loads_equal_stock_reader(gdsfs_mount, mdir):
    """A Shard(0) checkpoint saved by 2 ranks (spawned, gloo) loaded on 1 rank into Replicate,
    Shard(0), Shard(1) DTensors and plain tensors: the gdsfs reader gives the stock reader's bytes."""
    import multiprocessing

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import _dcp_real as R

    d = os.path.join(mdir, "shard0")
    ctx = multiprocessing.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = R.free_port()
    procs = [ctx.Process(target=R.save_shard0, args=(r, port, d, errq)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    errs = [errq.get() for _ in range(10) if not errq.empty()]
    assert all(p.exitcode == 0 for p in procs) and not errs, errs
    with R.one_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        for layout in ("replicate", "shard0", "shard1", "plain"):
            def targets() -> dict:
                out = {}
                for k, shape in R.SHAPES.items():
                    z = torch.zeros(shape)
                    if layout != "plain":
                        pl = {"replicate": Replicate(), "shard0": Shard(0), "shard1": Shard(1)}[layout]
                        z = DTensor.from_local(z, mesh, [pl], run_check=False)
                    out[k] = z
                return {"model": out}

            got, ref = targets(), targets()
            dcp.load(got, storage_reader=gdcp.GDSFileSystemReader(d))
            dcp.load(ref, storage_reader=dcp.FileSystemReader(d))
            for i, k in enumerate(R.SHAPES):
                a, b = got["model"][k], ref["model"][k]
                a = a.to_local() if isinstance(a, DTensor) else a
                b = b.to_local() if isinstance(b, DTensor) else b
                assert torch.equal(_bytes(a), _bytes(b)), (layout, k)
                assert torch.equal(a, R.full(i, R.SHAPES[k])), (layout, k)
