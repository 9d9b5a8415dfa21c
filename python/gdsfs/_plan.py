"""Deterministic epoch plans: which samples each (rank, worker) slot reads.

Torch-free. An epoch's global order is the shards in (seeded, per-epoch)
shuffled order, each shard's samples in (seeded) shuffled order. The order
is cut into world_size * num_workers contiguous blocks, one per slot
(slot = rank * num_workers + worker_id), so a worker reads long runs of one
shard: one daemon request serves many samples. Every sample is in exactly
one block. Resume state is the number of samples each slot has handed out.
"""

from __future__ import annotations

import bisect
import random
from typing import Iterator, Sequence

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
    """

    def __init__(self, counts: Sequence[int], *, seed: int, epoch: int, shuffle: bool, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"gdsfs: slots {slots} must be >= 1")
        self.counts = list(counts)
        self.seed, self.epoch, self.shuffle, self.slots = seed, epoch, shuffle, slots
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
        self._perm_cache: tuple[int, list[int]] | None = None

    def block(self, slot: int) -> tuple[int, int]:
        """Global positions [begin, end) that slot reads."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"gdsfs: slot {slot} outside 0..{self.slots - 1}")
        return slot * self.total // self.slots, (slot + 1) * self.total // self.slots

    def _perm(self, shard: int) -> list[int]:
        if self._perm_cache is not None and self._perm_cache[0] == shard:
            return self._perm_cache[1]
        p = list(range(self.counts[shard]))
        if self.shuffle:
            random.Random(f"gdsfs-samples:{self.seed}:{self.epoch}:{shard}").shuffle(p)
        self._perm_cache = (shard, p)
        return p

    def at(self, pos: int) -> tuple[int, int]:
        """(shard, sample index in shard) at global position pos."""
        k = bisect.bisect_right(self.starts, pos) - 1
        shard = self.shard_order[k]
        return shard, self._perm(shard)[pos - self.starts[k]]

    def positions(self, slot: int, skip: int = 0) -> Iterator[tuple[int, int, int]]:
        """(position, shard, index) for slot's block, after skip samples."""
        lo, hi = self.block(slot)
        for pos in range(lo + skip, hi):
            shard, idx = self.at(pos)
            yield pos, shard, idx
