"""EpochPlan with interleaving, a shuffle buffer and even ranks (daemon-free): every slot's
order is a permutation of its block, fixed by (seed, epoch, slot), resumable by skipping, and
the ranks' shares are disjoint and equal where asked."""

from __future__ import annotations

import pytest

from gdsfs._plan import EpochPlan

CASES = [
    # counts, world, workers, even, buffer, interleave
    ([13, 13, 13, 13], 1, 1, None, 0, 1),
    ([13, 13, 13, 13], 1, 1, None, 8, 4),
    ([5, 0, 17, 3, 9], 2, 3, None, 4, 2),
    ([5, 0, 17, 3, 9], 3, 2, "drop", 6, 3),
    ([5, 0, 17, 3, 9], 3, 2, "pad", 6, 3),
    ([1], 4, 2, "pad", 2, 2),
    ([7, 7], 4, 1, "drop", 100, 9),
    ([], 2, 2, "pad", 3, 2),
]


@pytest.mark.parametrize("counts,world,workers,even,buffer,interleave", CASES)
@pytest.mark.parametrize("shuffle", [False, True])
def test_slots_cover_the_epoch(counts, world, workers, even, buffer, interleave, shuffle) -> None:
    slots = world * workers
    plan = EpochPlan(counts, seed=5, epoch=2, shuffle=shuffle, slots=slots, world=world, even=even, buffer=buffer, interleave=interleave)
    total = sum(counts)
    per_rank = []
    everything = []
    for rank in range(world):
        got = []
        for w in range(workers):
            slot = rank * workers + w
            lo, hi = plan.block(slot)
            items = list(plan.positions(slot))
            assert [p for p, _, _ in items] == list(range(lo, hi))  # progress counts samples
            again = EpochPlan(counts, seed=5, epoch=2, shuffle=shuffle, slots=slots, world=world, even=even, buffer=buffer, interleave=interleave)
            assert list(again.positions(slot)) == items
            for skip in (0, 1, len(items) // 2, len(items)):
                assert [x[1:] for x in plan.positions(slot, skip)] == [x[1:] for x in items[skip:]]
            got.extend((sh, i) for _, sh, i in items)
        per_rank.append(got)
        everything.extend(got)
    assert all(0 <= i < counts[sh] for sh, i in everything)
    if even is None:
        assert sorted(everything) == sorted((s, i) for s, n in enumerate(counts) for i in range(n))
        return
    n = (total // world) if even == "drop" else -(-total // world)
    assert [len(g) for g in per_rank] == [n] * world
    if even == "drop":
        assert len(set(everything)) == len(everything)
    else:
        assert set(everything) == {(s, i) for s, n_ in enumerate(counts) for i in range(n_)}
    # Workers of every rank split its share the same way: equal batches per rank.
    sizes = [[plan.block(r * workers + w)[1] - plan.block(r * workers + w)[0] for w in range(workers)] for r in range(world)]
    assert all(s == sizes[0] for s in sizes)


def test_buffer_and_interleave_change_the_order_not_the_set() -> None:
    counts = [20] * 6
    base = EpochPlan(counts, seed=1, epoch=0, shuffle=False, slots=1)
    mixed = EpochPlan(counts, seed=1, epoch=0, shuffle=False, slots=1, buffer=16, interleave=3)
    a = [x[1:] for x in base.positions(0)]
    b = [x[1:] for x in mixed.positions(0)]
    assert sorted(a) == sorted(b) and a != b
    # Windows of 8 consecutive samples come from several shards.
    windows = [{sh for sh, _ in b[i : i + 8]} for i in range(0, len(b), 8)]
    assert sum(len(w) > 1 for w in windows) >= len(windows) - 1
    other_epoch = EpochPlan(counts, seed=1, epoch=1, shuffle=False, slots=1, buffer=16, interleave=3)
    assert [x[1:] for x in other_epoch.positions(0)] != b


def test_bad_plan_arguments() -> None:
    with pytest.raises(ValueError, match="even"):
        EpochPlan([3], seed=0, epoch=0, shuffle=False, slots=1, even="equal")
    with pytest.raises(ValueError, match="world size"):
        EpochPlan([3], seed=0, epoch=0, shuffle=False, slots=3, world=2)


@pytest.mark.parametrize("buffer", [0, 400])
def test_interleaving_and_buffer_shuffle_few_shards_at_a_time(buffer: int) -> None:
    # Each shard's permutation is computed once per epoch, however far the buffer spreads.
    plan = EpochPlan([50] * 40, seed=0, epoch=0, shuffle=True, slots=1, interleave=4, buffer=buffer)
    made = []
    real = plan._perm

    def counting(shard: int) -> list[int]:
        if shard not in plan._perms:
            made.append(shard)
        return real(shard)

    plan._perm = counting  # type: ignore[method-assign]
    assert len(list(plan.positions(0))) == 2000
    assert sorted(made) == list(range(40)) and len(plan._perms) <= 5
