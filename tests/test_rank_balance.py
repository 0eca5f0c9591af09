"""Token budgets balanced across ranks (`lit_rl.training.rank_balance`): the dealing by hand, and rows that move between
ranks with every field intact."""

from __future__ import annotations

import random

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.training.rank_balance import balanced_assignment, balanced_rows, padded_fields, rows_of
from lit_rl.types import RolloutBatch


def test_units_go_largest_first_to_the_rank_with_the_fewest_tokens_and_room():
    # 9, 7, 6, 5, 2, 1 over 2 ranks of 3 units: 9 -> r0; 7 -> r1; 6 -> r1 (7 < 9); 5 -> r0 (9 < 13); 2 -> r1
    # (13 < 14), which is then full; 1 -> r0, the only room left.
    assert balanced_assignment([5, 9, 2, 7, 1, 6], 2) == [[0, 1, 4], [2, 3, 5]]  # totals 15 and 15
    assert balanced_assignment([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]  # ties: lower index first, to the lower rank
    with pytest.raises(ValueError, match="5 units do not split evenly over 2 ranks"):
        balanced_assignment([1, 2, 3, 4, 5], 2)


def test_dealing_evens_out_ranks_that_a_contiguous_split_leaves_uneven():
    rng = random.Random(0)
    for _ in range(50):
        tokens = [rng.randint(10, 300) for _ in range(16)]
        dealt = balanced_assignment(tokens, 4)
        assert sorted(u for units in dealt for u in units) == list(range(16)) and all(len(u) == 4 for u in dealt)
        totals = [sum(tokens[u] for u in units) for units in dealt]
        contiguous = [sum(tokens[r * 4 : r * 4 + 4]) for r in range(4)]
        assert max(totals) - min(totals) <= max(tokens)  # the greedy deal's bound
        assert max(totals) <= max(contiguous)


def test_rows_are_dealt_step_by_step_and_pairs_stay_whole():
    # 2 ranks x 4 rows, 2 rows per step. Step 0 holds rank 0's rows 0-1 and rank 1's rows 0-1 (global 0, 1, 4, 5).
    tokens = torch.tensor([[10, 1, 7, 7], [9, 2, 3, 3]])
    take0, totals = balanced_rows(tokens, world=2, rank=0, rows_per_step=2)
    take1, _ = balanced_rows(tokens, world=2, rank=1, rows_per_step=2)
    # Step 0: 10 -> r0, 9 -> r1, 2 -> r1, 1 -> r0 (both full after); step 1: 7, 7 -> r0, r1; 3, 3 -> r0, r1.
    assert take0 == [0, 1, 2, 6] and take1 == [4, 5, 3, 7]
    assert totals == [11, 11, 10, 10]
    # Pairs (unit 2): step 0's pairs are (0, 1) of 11 tokens and (4, 5) of 11; each rank takes one whole.
    pairs0, _ = balanced_rows(tokens, world=2, rank=0, rows_per_step=2, unit=2)
    assert pairs0 == [0, 1, 2, 3]


def _batch(prompts, completions, offset):
    """A RolloutBatch of left-padded `prompts` and right-padded `completions` (lists of token lists)."""
    P, T = max(map(len, prompts)), max(map(len, completions))
    n = len(prompts)
    prompt_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [0] * (T - len(c)) for c in completions])
    completion_mask = torch.tensor([[1.0] * len(c) + [0.0] * (T - len(c)) for c in completions])
    values = torch.arange(n, dtype=torch.float32) + offset
    return RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        rollout_logprobs=-completion_mask * (values[:, None] + 1),
        rewards=values,
        reward_components=values[:, None],
        advantages=values * 2,
        group_reward_std=values * 3,
        policy_version=torch.zeros(n, dtype=torch.long),
    )


def test_rows_move_between_ranks_with_every_field_and_only_as_much_padding_as_they_need():
    rank0 = _batch([[5, 6], [7]], [[1, 2, 3], [4]], offset=0)
    rank1 = _batch([[8, 9, 10], [11]], [[12], [13, 14]], offset=10)
    widths = (3, 3)  # the widest prompt and completion over both ranks
    local = [padded_fields(batch, *widths, pad_id=0) for batch in (rank0, rank1)]
    gathered = {name: torch.cat([local[0][name], local[1][name]]) for name in local[0]}  # what all_gather gives
    moved = rows_of(rank0, gathered, [1, 3])  # rank 0's row 1 and rank 1's row 1
    assert moved.prompt_ids.tolist() == [[7], [11]]  # trimmed to the widest real prompt among them
    assert moved.completion_ids.tolist() == [[4, 0], [13, 14]]
    assert moved.completion_mask.tolist() == [[1, 0], [1, 1]]
    assert moved.rewards.tolist() == [1.0, 11.0] and moved.advantages.tolist() == [2.0, 22.0]
    assert moved.group_reward_std.tolist() == [3.0, 33.0] and moved.reward_components.tolist() == [[1.0], [11.0]]
    assert moved.rollout_logprobs.tolist() == [[-2.0, 0.0], [-12.0, -12.0]]
    assert moved.old_logprobs is None


def test_an_algorithms_own_per_token_fields_move_like_the_completions():
    """PPO's per-token fields live in its own batch type (`PPOBatch`), declared as completion-laid-out: rows moved
    between ranks widen and trim them as they do the completions, and its per-row KL moves as a row."""
    from lit_rl.algorithms.ppo import PPOBatch

    def ppo(batch, offset):
        values = batch.completion_mask * (offset + 1)
        return PPOBatch(**vars(batch), old_values=values, returns=values * 2, kl=batch.rewards + 0.5)

    rank0 = ppo(_batch([[5, 6], [7]], [[1, 2, 3], [4]], offset=0), 0)
    rank1 = ppo(_batch([[8, 9, 10], [11]], [[12], [13, 14]], offset=10), 10)
    local = [padded_fields(batch, 3, 3, pad_id=0) for batch in (rank0, rank1)]
    gathered = {name: torch.cat([local[0][name], local[1][name]]) for name in local[0]}
    moved = rows_of(rank0, gathered, [0, 3])
    assert isinstance(moved, PPOBatch)
    assert moved.old_values.tolist() == [[1.0, 1.0, 1.0], [11.0, 11.0, 0.0]]  # widened with 0, then trimmed to 3
    assert moved.returns.tolist() == [[2.0, 2.0, 2.0], [22.0, 22.0, 0.0]]
    assert moved.kl.tolist() == [0.5, 11.5] and moved.token_advantages is None


def test_a_buffer_saved_with_every_algorithms_fields_loads_into_an_algorithms_own_batch():
    """A checkpoint of an earlier lit-rl keeps one batch with every algorithm's fields: another algorithm's, all
    None, are dropped on loading; one that holds values is refused, naming it."""
    from lit_rl.algorithms.rloo import RLOOBatch

    state = {**_batch([[5]], [[1, 2]], offset=0).state_dict(), "old_values": None, "kl": torch.ones(1)}
    loaded = RLOOBatch.from_state_dict(state)
    assert loaded.kl.tolist() == [1.0] and loaded.completion_ids.tolist() == [[1, 2]]
    with pytest.raises(ConfigError, match=r"fields RolloutBatch does not: \['kl'\]"):
        RolloutBatch.from_state_dict(state)
