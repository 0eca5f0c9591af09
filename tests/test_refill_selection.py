"""DAPO's dynamic sampling (`lit_rl.rollout.dynamic_sampling`): which groups make the batch and where each rank's
rows are in the gathered pool, by hand; refill prompts and seeds that are functions of the generation alone."""

from __future__ import annotations

import pytest

from lit_rl.data.schedule import RolloutSchedule, RolloutScheduleLoader, refill_seed_key
from lit_rl.rollout.dynamic_sampling import rows_for_rank, select_groups


def test_the_first_kept_groups_make_the_batch_and_dropped_ones_fill_a_short_one():
    assert select_groups([True, False, True, True, False], 2) == [0, 2]
    assert select_groups([False, True, False, False], 3) == [1, 0, 2]  # too few kept: the earliest dropped fill in
    with pytest.raises(ValueError, match="2 groups cannot fill a batch of 3"):
        select_groups([True, False], 3)


def test_each_rank_finds_its_rows_of_the_chosen_groups_in_the_gathered_pool():
    # 2 ranks x 4 rows, G = 2: 4 groups per generation; two generations (the original and one refill). Rank r's
    # pool holds its 4 rows of generation 0, then its 4 of generation 1; stacked: rank 0's 8, then rank 1's 8.
    # Global slot s of generation k sits at (s // 4) * 8 + k * 4 + s % 4.
    groups = [1, 4, 6, 7]  # group 1 of generation 0, then groups 0, 2, 3 of the refill
    rank0 = rows_for_rank(groups, group_size=2, per_rank=4, world=2, rank=0, generations=2)
    rank1 = rows_for_rank(groups, group_size=2, per_rank=4, world=2, rank=1, generations=2)
    # Slots 0-1: group 1 of generation 0 = global slots 2, 3 (rank 0, local 2, 3); slots 2-3: group 0 of the
    # refill = global slots 0, 1 (rank 0, local 4 + 0, 4 + 1). Rank 1: group 2 of the refill = global slots 4, 5
    # (rank 1: 8 + 4 + 0, 8 + 4 + 1), group 3 = slots 6, 7 (8 + 4 + 2, 8 + 4 + 3).
    assert rank0 == [2, 3, 4, 5]
    assert rank1 == [12, 13, 14, 15]
    # One rank holds everything: the same batch, in the same order.
    assert rows_for_rank(groups, 2, 8, 1, 0, 2) == [2, 3, 8, 9, 12, 13, 14, 15]


def _loader(rank: int, world: int, refills: int = 2) -> RolloutScheduleLoader:
    rows = [{"prompt": str(i)} for i in range(40)]
    schedule = RolloutSchedule(
        completions_per_rank=8 // world,
        group_size=2,
        micro_steps_per_generation=2,
        start_micro_step=lambda: 0,
        refill_generations=refills,
    )
    return RolloutScheduleLoader(rows, schedule, seed=3, rank=rank, world_size=world)


def test_refill_prompts_depend_on_the_generation_and_refill_alone_whatever_the_ranks():
    one = _loader(0, 1).item(2)  # generation 1's first micro-step
    halves = [_loader(rank, 2).item(2) for rank in (0, 1)]
    assert len(one.refills) == 2 and all(len(rows) == 8 for rows in one.refills)
    for refill in range(2):
        assert halves[0].refills[refill] + halves[1].refills[refill] == one.refills[refill]
        assert one.refills[refill][::2] == one.refills[refill][1::2]  # G = 2 completions of each prompt
    assert one.refills[0] != one.refills[1] != one.rows
    assert _loader(0, 1).item(4).refills != one.refills  # another generation, other refills
    assert _loader(0, 1).item(3).refills is None and _loader(0, 1, refills=0).item(2).refills is None


def test_refill_seed_keys_never_meet_a_generations_key_or_each_other():
    keys = {refill_seed_key(g, r) for g in range(100) for r in range(1, 64)}
    assert len(keys) == 100 * 63 and min(keys) >= 2**31
    with pytest.raises(ValueError, match="refill must be in"):
        refill_seed_key(0, 64)


def test_data_seed_reaches_the_refill_prompts_and_seed_0_keeps_them():
    """`data.seed` changes which prompts refill a generation (it was lost: torch's generator kept only the low 32 bits
    of `seed * 2**32 + key`), and seed 0 draws the permutation keyed by the refill alone, as before."""
    import torch

    def refill(seed: int) -> list[str]:
        loader = _loader(0, 1)
        loader.seed = seed
        return [row["prompt"] for row in loader.rows_of_refill(3, 1)]

    rows = _loader(0, 1).rows
    keyed = torch.randperm(len(rows), generator=torch.Generator().manual_seed(refill_seed_key(3, 1))).tolist()
    assert refill(0)[0] == rows[keyed[0]]["prompt"]
    assert len({tuple(refill(seed)) for seed in (0, 1, 2, 3)}) == 4
