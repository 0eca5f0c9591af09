"""Token-budget grouping by hand (`lit_rl.training.micro_batches`)."""

import pytest
import torch

from lit_rl.training.micro_batches import budgeted_micro_batch, token_budget_micro_batches


def test_units_are_grouped_first_fit_in_decreasing_size_within_the_budget():
    # Sizes 5, 2, 4, 3, 1, budget 6: 5 -> A; 4 -> B; 3 -> C; 2 -> B (4 + 2 = 6); 1 -> A (5 + 1 = 6).
    assert token_budget_micro_batches([5, 2, 4, 3, 1], 6, 4) == [[0, 4], [1, 2], [3]]
    # Everything fits in one: one micro-batch, the rest of the step's micro-steps run empty.
    assert token_budget_micro_batches([1, 2, 3], 10, 4) == [[0, 1, 2]]
    # A unit larger than the budget gets a micro-batch of its own.
    assert token_budget_micro_batches([9, 1], 4, 3) == [[0], [1]]


def test_over_budget_units_join_the_micro_batch_with_the_fewest_tokens():
    # Budget 6, at most 2 micro-batches: 5 -> A, 5 -> B (A is full), 5 fits nowhere -> the fewer of A (5), B (5):
    # the first; then 2 -> B (5 + 2 = 7 > 6: over budget, B has fewer).
    assert token_budget_micro_batches([5, 5, 5, 2], 6, 2) == [[0, 2], [1, 3]]


@pytest.mark.parametrize("algorithm", ["GRPO", "PPO"])
def test_an_empty_micro_step_adds_no_loss_and_no_gradient(algorithm):
    """A step whose completions fit in fewer micro-batches than the accumulation runs the rest empty: the copied
    unit counts no token, so neither GRPO's KL term (not weighted by the zeroed advantage) nor PPO's per-token
    advantages reach the loss or the log-probs' gradient."""
    from tests.conftest import fit_grpo

    model = fit_grpo(algorithm=algorithm, beta=0.1, num_iterations=2, micro_batch_size=4)
    buffer = model._buffer
    empty, has_completions = budgeted_micro_batch(buffer, 1, len(buffer), accumulate=2, budget=10**6)
    assert not has_completions and empty.loss_mask.sum() == 0
    logprobs = (empty.old_logprobs + 0.5).requires_grad_(True)  # a moved policy: ratio and KL away from 1 and 0
    if algorithm == "PPO":
        model.critic_values = lambda mb: torch.ones_like(mb.old_values, requires_grad=True)
    loss, _ = model.micro_batch_loss(empty, model.micro_batch_terms(empty, logprobs), model._normalizers[0])
    loss.backward()
    assert loss.item() == 0.0 and (logprobs.grad == 0).all()


def _batch(prompt_tokens: list[int], completion_tokens: list[int]):
    """A rollout batch whose rows hold these real prompt and completion tokens (prompts left-padded to 3)."""
    from lit_rl.types import RolloutBatch

    n, P, T = len(prompt_tokens), 3, 8
    zeros = torch.zeros(n)
    return RolloutBatch(
        prompt_ids=torch.arange(n * P).view(n, P),
        prompt_mask=torch.tensor([[0] * (P - p) + [1] * p for p in prompt_tokens]),
        completion_ids=torch.arange(n * T).view(n, T),
        completion_mask=torch.tensor([[1.0] * c + [0.0] * (T - c) for c in completion_tokens]),
        rollout_logprobs=torch.zeros(n, T),
        rewards=zeros,
        reward_components=zeros[:, None],
        advantages=zeros,
        group_reward_std=zeros,
    )


def test_the_forwards_at_generation_time_keep_to_the_token_budget():
    """Old and reference log-probs (and PPO's values) are computed over consecutive rows of at most
    `micro_batch_tokens` real tokens (a longer row alone), and give what one forward over every row gives."""
    from lit_rl.algorithms.micro_steps import MicroBatcher

    batch = _batch([2, 2, 1, 3, 2, 1], [3, 1, 8, 2, 4, 1])  # rows of 5, 3, 9, 5, 6, 2 tokens
    seen = []

    def score(mb) -> torch.Tensor:
        seen.append(int(mb.prompt_mask.sum() + mb.completion_mask.sum()))
        return mb.completion_ids.float() / 7

    by_tokens = MicroBatcher(micro_batch_size=4, accumulate=1, micro_batch_tokens=8)
    assert by_tokens.forward_slices(batch) == [slice(0, 2), slice(2, 3), slice(3, 4), slice(4, 6)]
    assert torch.equal(by_tokens.per_micro_batch(batch, score), score(batch) * batch.completion_mask)
    assert seen[:-1] == [8, 9, 5, 8]  # the 9-token row alone, over the budget; the others within it
    by_rows = MicroBatcher(micro_batch_size=4, accumulate=1)
    assert by_rows.forward_slices(batch) == [slice(0, 4), slice(4, 8)]


def _rank_scores(rank: int, init_file: str, results) -> None:
    from datetime import timedelta
    from types import SimpleNamespace

    from benchmarks.process_exit import exit_without_finalizing
    from lit_rl.algorithms.micro_steps import MicroBatcher
    from lit_rl.algorithms.on_policy import OnPolicyModule

    # A collective left unmatched fails after a minute instead of hanging the suite.
    init = dict(init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.distributed.init_process_group("gloo", **init)
    try:
        # Rank 0's rows need 4 forwards of at most 8 tokens, rank 1's one.
        batch = _batch([2, 2, 1, 3, 2, 1], [3, 1, 8, 2, 4, 1]) if rank == 0 else _batch([2, 2], [2, 2])
        calls = []

        def score(mb) -> torch.Tensor:  # a forward under sharded parameters: a collective every time
            torch.distributed.all_reduce(torch.ones(1))
            calls.append(len(mb))
            return mb.completion_ids.float()

        module = SimpleNamespace(
            parameters_sharded=lambda: True,
            micro_batcher=MicroBatcher(micro_batch_size=4, accumulate=1, micro_batch_tokens=8),
            device=torch.device("cpu"),
        )
        out = OnPolicyModule.per_micro_batch(module, batch, score)
        results[rank] = (calls, torch.equal(out, batch.completion_ids.float() * batch.completion_mask))
    finally:
        torch.distributed.destroy_process_group()
    exit_without_finalizing()


@pytest.mark.slow
def test_ranks_with_sharded_parameters_run_as_many_forwards_by_tokens(tmp_path):
    """Under ZeRO-3/FSDP every forward gathers the parameters from all ranks: a rank whose rows need fewer
    token-budgeted forwards runs the missing ones on one row (results unused), else the ranks would hang."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank_scores, args=(str(tmp_path / "init"), results), nprocs=2, join=True)
        # Rank 1 runs its forward of 2 rows, then 3 of one row.
        assert dict(results) == {0: ([2, 1, 1, 2], True), 1: ([2, 1, 1, 1], True)}


def test_each_optimizer_steps_denominators_are_its_own_counts_summed_over_ranks(monkeypatch):
    """The loss normalisation's denominators (docs/formulas.md), for each optimizer step of a generation: the step's
    sequences and loss tokens over every rank (`sequence`, `token`), the whole generation's loss tokens (`dapo`),
    the completion budget T_max (`constant`, not the batch's width) and the rows with a non-zero advantage. Layout
    comparisons cannot see a swap of these: every layout goes through this one function."""
    import dataclasses

    from lit_rl.algorithms import micro_steps
    from lit_rl.algorithms.micro_steps import MicroBatcher
    from lit_rl.losses import LossNormalizer

    batch = _batch([1, 1, 1, 1], [3, 1, 2, 4])  # two optimizer steps of 2 rows: 4 then 6 loss tokens
    batch = dataclasses.replace(
        batch, loss_mask=batch.completion_mask.clone(), advantages=torch.tensor([0.5, 0.0, -1.0, 0.0])
    )
    # The other rank's counts, as the all-reduce adds them: step tokens 5 and 6, 11 in all, 2 and 0 active rows.
    other_rank = torch.tensor([5.0, 6.0, 11.0, 2.0, 0.0])
    monkeypatch.setattr(micro_steps, "reduce_across_ranks", lambda counts: counts + other_rank)
    batcher = MicroBatcher(micro_batch_size=1, accumulate=2)
    assert batcher.step_normalizers(batch, completion_budget=16, world_size=2) == [
        LossNormalizer(4.0, 9.0, 21.0, 16, num_active_sequences=3.0),
        LossNormalizer(4.0, 12.0, 21.0, 16, num_active_sequences=1.0),
    ]
    # One rank: its own counts.
    assert batcher.step_normalizers(batch, completion_budget=16, world_size=1) == [
        LossNormalizer(2.0, 4.0, 10.0, 16, num_active_sequences=1.0),
        LossNormalizer(2.0, 6.0, 10.0, 16, num_active_sequences=1.0),
    ]
