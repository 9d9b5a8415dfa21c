"""Deterministic epoch plans: which samples each (rank, worker) slot reads.

Torch-free. An epoch's global order is the shards in (seeded, per-epoch)
shuffled order, each shard's samples in (seeded) shuffled order. The order
is cut into world_size * num_workers contiguous blocks, one per slot
(slot = rank * num_workers + worker_id), so a worker reads long runs of one
shard: one daemon request serves many samples. Every sample is in exactly
one block. Resume state is the number of samples each slot has handed out.

Within its block a slot may interleave several runs (one per open shard) and pass the result
through a shuffle buffer. Both act on positions only, seeded, so a slot's output order is fixed
by (seed, epoch, slot) and resuming still means skipping the first n positions of it.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections import OrderedDict
from typing import Iterable, Iterator, Optional, Sequence

__all__ = ["EpochPlan", "expand_braces"]


def expand_braces(pattern: str) -> list[str]:
    """Expand WebDataset-style brace patterns: "a-{000..003}.tar",
    "{train,val}/x.tar". Zero padding follows the first bound."""
    i = pattern.find("{")
    if i < 0:
        return [pattern]
    j = pattern.find("}", i)
    if j < 0:
        raise ValueError(f"gdsfs: unbalanced brace in shard pattern {pattern!r}")
    body, head, tail = pattern[i + 1 : j], pattern[:i], pattern[j + 1 :]
    if ".." in body:
        lo, hi = body.split("..", 1)
        if not (lo.isdigit() and hi.isdigit()):
            raise ValueError(f"gdsfs: brace range {{{body}}} in {pattern!r} must be numeric")
        width = len(lo)
        items = [str(k).zfill(width) for k in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    return [x for item in items for x in expand_braces(head + item + tail)]


class EpochPlan:
    """The sample order of one epoch and its split into slots.

    Args:
        counts: samples per shard, in the dataset's shard order.
        seed: shuffle seed.
        epoch: epoch number (mixed into the shuffle).
        shuffle: shuffle shard order and samples within shards.
        slots: world_size * num_workers.
        world: world_size (slots must be a multiple of it); used by even.
        even: None (ranks differ by at most one sample), "drop" (every rank reads
            total // world samples; the epoch's last ones are left out) or "pad" (every rank
            reads ceil(total / world); the first ones of the epoch are read twice). Workers of
            a rank then split its share the same way on every rank.
        buffer: shuffle buffer size in samples (0: none).
        interleave: runs of a slot's block read in turn (1: one after the other).
    """

    def __init__(self, counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool, slots: int, world: int = 1,
                 even: Optional[str] = None, buffer: int = 0, interleave: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"gdsfs: slots {slots} must be >= 1")
        if world < 1 or slots % world:
            raise ValueError(f"gdsfs: {slots} slots cannot be split over world size {world}")
        if even not in (None, "drop", "pad"):
            raise ValueError(f"gdsfs: even {even!r} is not None, 'drop' or 'pad'")
        self.counts = list(counts)
        self.seed, self.epoch, self.shuffle, self.slots = seed, epoch, shuffle, slots
        self.world, self.even, self.buffer, self.interleave = world, even, max(0, buffer), max(1, interleave)
        order = list(range(len(self.counts)))
        if shuffle:
            random.Random(f"gdsfs-shards:{seed}:{epoch}").shuffle(order)
        self.shard_order = order
        self.starts: list[int] = []
        total = 0
        for s in order:
            self.starts.append(total)
            total += self.counts[s]
        self.total = total
        # Sample permutations of the shards read lately (interleaving alternates between them).
        self._perms: "OrderedDict[int, list[int]]" = OrderedDict()

    def per_rank(self) -> int:
        """Samples each rank reads with even set (rank 0's share otherwise)."""
        if self.even == "drop":
            return self.total // self.world
        if self.even == "pad":
            return -(-self.total // self.world)
        return self.total // self.world

    def block(self, slot: int) -> tuple[int, int]:
        """Positions [begin, end) that slot reads (with even="pad", positions past the epoch's
        total wrap around to its start)."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"gdsfs: slot {slot} outside 0..{self.slots - 1}")
        if self.even is None:
            return slot * self.total // self.slots, (slot + 1) * self.total // self.slots
        nw = self.slots // self.world
        rank, w = divmod(slot, nw)
        n = self.per_rank() if self.total else 0
        return rank * n + w * n // nw, rank * n + (w + 1) * n // nw

    def _perm(self, shard: int) -> list[int]:
        p = self._perms.get(shard)
        if p is not None:
            self._perms.move_to_end(shard)
            return p
        p = list(range(self.counts[shard]))
        if self.shuffle:
            random.Random(f"gdsfs-samples:{self.seed}:{self.epoch}:{shard}").shuffle(p)
        self._perms[shard] = p
        while len(self._perms) > self.interleave + 1:
            self._perms.popitem(last=False)
        return p

    def at(self, pos: int) -> tuple[int, int]:
        """(shard, sample index in shard) at global position pos."""
        if self.total and pos >= self.total:
            pos %= self.total  # even="pad"
        k = bisect.bisect_right(self.starts, pos) - 1
        shard = self.shard_order[k]
        return shard, self._perm(shard)[pos - self.starts[k]]

    def _walk(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """at(pos) for pos in [lo, hi), one shard's stretch at a time: a bisect and a _perm per
        stretch instead of per sample (the same samples, the same permutations kept)."""
        pos = lo
        while pos < hi:
            p = pos % self.total if self.total and pos >= self.total else pos
            k = bisect.bisect_right(self.starts, p) - 1
            shard = self.shard_order[k]
            base = self.starts[k]
            n = min(hi - pos, base + self.counts[shard] - p)
            perm = self._perm(shard)
            for i in perm[p - base : p - base + n]:
                yield shard, i
            pos += n

    def _order(self, slot: int) -> Iterator[tuple[int, int]]:
        """(shard, index) of slot's samples in the order it reads them: its block cut into
        `interleave` runs read in turn (so at() touches `interleave` shards at a time), then
        through a shuffle buffer of `buffer` samples."""
        lo, hi = self.block(slot)
        k = min(self.interleave, max(1, hi - lo))
        src: Iterable[tuple[int, int]]
        if k == 1:
            src = self._walk(lo, hi)
        else:
            runs = [range(lo + j * (hi - lo) // k, lo + (j + 1) * (hi - lo) // k) for j in range(k)]
            longest = max(len(r) for r in runs)
            src = (self.at(r[i]) for i in range(longest) for r in runs if i < len(r))
        if self.buffer <= 1:
            yield from src
            return
        rng = random.Random(f"gdsfs-buffer:{self.seed}:{self.epoch}:{slot}")
        buf: list[tuple[int, int]] = []
        for p in src:
            if len(buf) < self.buffer:
                buf.append(p)
                continue
            i = rng.randrange(len(buf))
            yield buf[i]
            buf[i] = p
        while buf:
            i = rng.randrange(len(buf))
            buf[i], buf[-1] = buf[-1], buf[i]
            yield buf.pop()

    def positions(self, slot: int, skip: int = 0) -> Iterator[tuple[int, int, int]]:
        """(block start + n, shard, index) of the n-th sample slot reads, after skip samples.
        The first field counts samples (block start + n), so that it minus the block start
        is the slot's progress whatever the order."""
        lo = self.block(slot)[0]
        order = self._order(slot)
        if skip > 0:
            next(itertools.islice(order, skip - 1, skip), None)  # past the first skip samples
        for n, (shard, idx) in enumerate(order, max(0, skip)):
            yield lo + n, shard, idx
