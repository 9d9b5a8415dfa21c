"""Resharded DCP loads through GDSFileSystemReader: byte-equal to the stock reader, and only the
bytes each request covers are read (issue 14, part 2).

A checkpoint saved by N ranks holds one item per saved chunk; loading it into another sharding
gives ReadItems asking for parts of those chunks (storage_offsets/lengths) placed at dest_offsets
of the local target. The ReadItems are the ones torch 2.11's planner makes
(create_read_items_for_chunk_list: one per overlap of a saved chunk with the local chunk), built
by _dcp_standin.read_items; the saves follow dcp.save's calls for every rank
(_dcp_standin.save_ranks). With a real torch.distributed.checkpoint the stand-in is not
installed and these tests skip: scripts/gpu/dcp_check.py and the real tests cover that.
"""

from __future__ import annotations

import pytest
import torch

import _dcp_standin as S
from _ckpt_helpers import _bytes, daemon_dir

REAL = S.has_real_dcp()
pytestmark = pytest.mark.skipif(REAL, reason="the real torch.distributed.checkpoint is installed (see test_dcp.py's real tests)")
if not REAL:
    S.install()
import gdsfs.dcp as gdcp  # noqa: E402  (after the stand-in is installed)

Chunk = S.Chunk


@pytest.fixture
def mdir(gdsfs_mount, request):
    yield from daemon_dir(gdsfs_mount, request, "dcp-reshard")


def full(seed: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def shards(shape: tuple[int, ...], dim: int, n: int) -> list[Chunk]:
    """The chunks of Shard(dim) over n ranks (torch.chunk's split: uneven sizes at the end)."""
    size = shape[dim]
    step = -(-size // n)
    out = []
    for r in range(n):
        lo, hi = min(size, r * step), min(size, (r + 1) * step)
        offs = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
        out.append((offs, sizes))
    return out


def piece(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(*chunk)):
        t = t.narrow(d, o, n)
    return t.contiguous()


def save(d: str, tensors: dict[str, torch.Tensor], saved: dict[str, list[Chunk]], writer: str) -> None:
    """Save ``tensors`` as the ranks of ``saved``'s chunking do (rank r holds chunk r of each)."""
    nranks = max(len(c) for c in saved.values())
    per_rank = [{fqn: {saved[fqn][r]: piece(t, saved[fqn][r])} for fqn, t in tensors.items() if r < len(saved[fqn])}
                for r in range(nranks)]
    cls = gdcp.GDSFileSystemWriter if writer == "gds" else S.FileSystemWriter
    S.save_ranks(per_rank, lambda r: cls(d))


def load(d: str, reader: str, tensors: dict[str, torch.Tensor], saved: dict[str, list[Chunk]], local: dict[str, Chunk],
         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Load each tensor's ``local`` chunk (one rank's part of the target sharding)."""
    targets = {fqn: torch.full(local[fqn][1], -7.0, dtype=dtype or t.dtype) for fqn, t in tensors.items()}
    items = [it for fqn in tensors for it in S.read_items(fqn, saved[fqn], local[fqn])]
    cls = gdcp.GDSFileSystemReader if reader == "gds" else S.FileSystemReader
    S.load_items(targets, items, cls(d))
    return targets


SHAPE2 = (48, 40)  # 2-D: rows of 160 bytes
SHAPE3 = (6, 10, 24)


def everything(shape: tuple[int, ...]) -> list[Chunk]:
    return [((0,) * len(shape), shape)]


# (name, tensor shape, saved chunking, the loading ranks' local chunks)
CASES = [
    ("Shard(0) 2 ranks -> Replicate", SHAPE2, shards(SHAPE2, 0, 2), everything(SHAPE2)),
    ("Shard(0) 2 ranks -> 1 rank (Shard(0))", SHAPE2, shards(SHAPE2, 0, 2), shards(SHAPE2, 0, 1)),
    ("Shard(0) 1 rank -> 2 ranks", SHAPE2, everything(SHAPE2), shards(SHAPE2, 0, 2)),
    ("Shard(0) 2 ranks -> Shard(1) 2 ranks", SHAPE2, shards(SHAPE2, 0, 2), shards(SHAPE2, 1, 2)),
    ("Shard(1) 2 ranks -> Shard(0) 3 ranks (uneven)", SHAPE2, shards(SHAPE2, 1, 2), shards(SHAPE2, 0, 3)),
    ("Shard(0) 3 ranks (uneven) -> 2 ranks", (7, 40), shards((7, 40), 0, 3), shards((7, 40), 0, 2)),
    ("3-D Shard(1) 2 ranks -> Shard(2) 2 ranks", SHAPE3, shards(SHAPE3, 1, 2), shards(SHAPE3, 2, 2)),
    ("3-D Shard(0) 2 ranks -> Shard(1) 4 ranks", SHAPE3, shards(SHAPE3, 0, 2), shards(SHAPE3, 1, 4)),
]


@pytest.mark.parametrize("writer", ["gds", "stock"])
@pytest.mark.parametrize("name,shape,saved,loading", CASES, ids=[c[0] for c in CASES])
def test_resharded_load_equals_stock_reader(gdsfs_mount, mdir, writer, name, shape, saved, loading):
    tensors = {"w": full(1, shape), "h": full(2, shape, torch.bfloat16), "i": full(3, shape).mul(100).to(torch.int32)}
    plan = {fqn: saved for fqn in tensors}
    save(mdir, tensors, plan, writer)
    for local in loading:
        got = load(mdir, "gds", tensors, plan, {fqn: local for fqn in tensors})
        ref = load(mdir, "stock", tensors, plan, {fqn: local for fqn in tensors})
        for fqn, t in tensors.items():
            want = piece(t, local)
            assert torch.equal(_bytes(got[fqn]), _bytes(ref[fqn])), f"{name}: {fqn} differs from the stock reader's"
            assert torch.equal(_bytes(got[fqn]), _bytes(want)), f"{name}: {fqn} differs from the saved tensor"


def test_resharded_load_converts_dtype_like_stock(gdsfs_mount, mdir):
    """A target of another dtype gets what the stock reader's copy_ gives it."""
    tensors = {"w": full(4, SHAPE2)}
    plan = {"w": shards(SHAPE2, 0, 2)}
    save(mdir, tensors, plan, "gds")
    for local in shards(SHAPE2, 1, 2):
        got = load(mdir, "gds", tensors, plan, {"w": local}, dtype=torch.float64)
        ref = load(mdir, "stock", tensors, plan, {"w": local}, dtype=torch.float64)
        assert torch.equal(got["w"], ref["w"])


@pytest.mark.parametrize("dim", [0, 1])
def test_resharded_load_reads_only_the_needed_bytes(gdsfs_mount, mdir, dim):
    """1 -> 2 ranks: each rank's half of a tensor saved whole. Along dim 0 the half is one
    contiguous range of the saved bytes and only it is read (before, the whole saved tensor was
    read into a temporary for each rank); along dim 1 the bytes from its first to its last
    element are (one read, then a device copy)."""
    shape = (256, 1024)  # 1 MiB of float32, rows of 4 KiB
    tensors = {"w": full(5, shape)}
    plan = {"w": everything(shape)}
    save(mdir, tensors, plan, "gds")
    total = tensors["w"].numel() * 4
    for r, local in enumerate(shards(shape, dim, 2)):
        before = gdsfs_mount.stats()["counters"]["read_bytes"]
        got = load(mdir, "gds", tensors, plan, {"w": local})
        read = gdsfs_mount.stats()["counters"]["read_bytes"] - before
        assert torch.equal(got["w"], piece(tensors["w"], local))
        if dim == 0:
            assert total // 2 <= read <= total // 2 + 2 * 4096, f"rank {r} read {read} bytes for its half of {total}"
        else:
            # From the first row's start (or middle) to the last row's middle (or end).
            assert read <= total - 2048 + 2 * 4096, f"rank {r} read {read} bytes of {total}"


def test_span_of_sub_boxes():
    # (storage offset, strides, offsets, lengths) -> (first, count, dense)
    cases = [
        (0, (8, 1), (2, 0), (3, 8), (16, 24, True)),     # row-slab of a row-major 2-D tensor
        (0, (8, 1), (0, 2), (4, 3), (2, 27, False)),     # column block: span, not dense
        (5, (8, 1), (1, 0), (1, 4), (13, 4, True)),      # part of one row
        (0, (1, 8), (0, 0), (8, 2), (0, 16, False)),     # transposed tensor: not row-major
        (0, (0, 1), (0, 0), (3, 4), (0, 4, False)),      # expanded (zero stride)
        (0, (40, 8, 1), (1, 2, 0), (1, 3, 8), (56, 24, True)),
        (0, (8, 1), (0, 0), (0, 8), (0, 0, True)),       # empty
    ]
    for so, st, offs, lens, want in cases:
        assert gdcp.span(so, st, offs, lens) == want, (so, st, offs, lens)


def test_resharded_load_uses_one_session_for_every_file(gdsfs_mount, mdir, monkeypatch):
    """A checkpoint of 2 ranks has 2 data files; one load opens one session for both (each
    session that closes drops this process's slab mappings: a session per file mapped the slabs
    anew for every file, a third of a 1 GiB load's time on the GPU)."""
    import gdsfs._ckpt.tensorio as tio

    tensors = {"w": full(6, SHAPE2), "v": full(7, SHAPE2)}
    plan = {fqn: shards(SHAPE2, 0, 2) for fqn in tensors}
    save(mdir, tensors, plan, "gds")
    opened = []
    real = tio.open_mover
    monkeypatch.setattr(tio, "open_mover", lambda *a, **k: (opened.append(a), real(*a, **k))[1])
    got = load(mdir, "gds", tensors, plan, {fqn: everything(SHAPE2)[0] for fqn in tensors})
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    assert len(opened) == 1, f"{len(opened)} sessions for one load of 2 files"
