"""Hand-computed values for the GRPO loss, its aggregations, the clipping, the KL estimator and the advantages."""

import math

import pytest
import torch

from lit_rl.losses import LossNormalizer, aggregate, group_advantages, grpo_loss, grpo_per_token_loss
from lit_rl.ops import kl_k3


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])  # groups [1, 0] and [1, 1]
    std01 = math.sqrt(((1 - 0.5) ** 2 + (0 - 0.5) ** 2) / (2 - 1))  # unbiased std of [1, 0]
    group, stats = group_advantages(rewards, group_size=2, scale_rewards="group")
    expected = [0.5 / (std01 + 1e-4), -0.5 / (std01 + 1e-4), 0.0, 0.0]
    assert torch.allclose(group, torch.tensor(expected), atol=1e-7)
    assert torch.allclose(stats["group_std"], torch.tensor([std01, std01, 0.0, 0.0]))

    batch_std = math.sqrt(((1 - 0.75) ** 2 * 3 + (0 - 0.75) ** 2) / 3)  # 0.5
    batch, _ = group_advantages(rewards, group_size=2, scale_rewards="batch")
    expected = [0.5 / (batch_std + 1e-4), -0.5 / (batch_std + 1e-4), 0.0, 0.0]
    assert torch.allclose(batch, torch.tensor(expected), atol=1e-7)

    none, _ = group_advantages(rewards, group_size=2, scale_rewards="none")
    assert none.tolist() == [0.5, -0.5, 0.0, 0.0]


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), group_size=4)


def _ratios(values):
    """logprobs/old_logprobs whose ratio exp(logp - old) is exactly `values`."""
    old = torch.zeros(1, len(values))
    return torch.log(torch.tensor([values])), old


def test_clipped_surrogate_positive_advantage():
    logp, old = _ratios([1.5, 0.5, 1.0])
    per_token, stats = grpo_per_token_loss(logp, old, torch.tensor([1.0]), epsilon_low=0.2, epsilon_high=0.2)
    # min(r * 1, clip(r, 0.8, 1.2) * 1) = [min(1.5, 1.2), min(0.5, 0.8), 1.0] = [1.2, 0.5, 1.0]
    assert torch.allclose(per_token, -torch.tensor([[1.2, 0.5, 1.0]]))
    assert stats["clipped_high"].tolist() == [[1.0, 0.0, 0.0]]
    assert stats["clipped_low"].tolist() == [[0.0, 0.0, 0.0]]


def test_clipped_surrogate_negative_advantage_and_asymmetric_eps():
    logp, old = _ratios([1.5, 0.5, 1.0])
    per_token, stats = grpo_per_token_loss(logp, old, torch.tensor([-1.0]), epsilon_low=0.2, epsilon_high=0.28)
    # min(-r, -clip(r, 0.8, 1.28)) = [min(-1.5, -1.28), min(-0.5, -0.8), -1] = [-1.5, -0.8, -1]
    assert torch.allclose(per_token, torch.tensor([[1.5, 0.8, 1.0]]))
    assert stats["clipped_low"].tolist() == [[0.0, 1.0, 0.0]]
    assert stats["clipped_high"].tolist() == [[0.0, 0.0, 0.0]]


def test_k3_kl_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    # delta = ref - logp = log(0.5); k3 = exp(delta) - delta - 1 = 0.5 - log(0.5) - 1
    assert torch.allclose(kl_k3(logp, ref), torch.tensor([0.5 - math.log(0.5) - 1.0]))
    assert kl_k3(logp, logp).item() == 0.0


def test_kl_is_added_per_token_before_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    beta = 0.1
    loss, stats = grpo_loss(logp, logp.detach(), torch.tensor([0.0]), mask, "sequence", ref_logprobs=ref, beta=beta)
    k3 = 0.5 - math.log(0.5) - 1.0
    # advantage 0: only the KL term, averaged over the 2 unmasked tokens of the sequence
    assert loss.item() == pytest.approx(beta * (k3 + 0.0) / 2, abs=1e-7)
    assert stats["kl"][0, :2].tolist() == pytest.approx([k3, 0.0], abs=1e-7)


def _k3(p: float, q: float) -> float:
    """k3 of a token the policy gives probability p and the reference q: q/p - log(q/p) - 1."""
    return q / p - math.log(q / p) - 1.0


# Three sequences of lengths 3, 1 and 2 (padded to 4); the policy gives each sampled token probability 0.5.
REF_PROBS = [[0.25, 0.5, 0.125], [0.4], [0.3, 0.6]]
KL = [[_k3(0.5, q) for q in row] for row in REF_PROBS]
KL_SUM = sum(map(sum, KL))


@pytest.mark.parametrize(
    "aggregation, expected_kl",
    [
        ("sequence", (sum(KL[0]) / 3 + KL[1][0] / 1 + sum(KL[2]) / 2) / 3),  # mean per sequence, then over 3
        ("token", KL_SUM / 6),  # the step's 6 tokens
        ("constant", KL_SUM / (3 * 4)),  # 3 sequences x max_completion_length 4
        ("dapo", KL_SUM / 10),  # the generation batch's 10 tokens
    ],
)
def test_kl_is_aggregated_like_the_policy_term(aggregation, expected_kl):
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    ref = torch.log(torch.tensor([row + [0.5] * (4 - len(row)) for row in REF_PROBS]))
    logp = torch.full((3, 4), math.log(0.5))
    advantages = torch.tensor([1.0, -0.5, 2.0])
    norm = LossNormalizer(num_sequences=3, num_tokens=6, num_generation_tokens=10, max_completion_length=4)
    kwargs = dict(aggregation=aggregation, normalizer=norm, ref_logprobs=ref)
    with_kl, _ = grpo_loss(logp, logp, advantages, mask, beta=0.1, **kwargs)
    without, _ = grpo_loss(logp, logp, advantages, mask, beta=0.0, **kwargs)
    policy_only = aggregate(-advantages[:, None].expand(3, 4), mask, aggregation, norm)  # ratio 1: -A per token
    assert without.item() == pytest.approx(policy_only.item(), abs=1e-7)
    assert (with_kl - without).item() == pytest.approx(0.1 * expected_kl, abs=1e-7)


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("sequence", ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2),  # 3.25
        ("token", (1 + 2 + 3 + 4 + 5) / 5),  # 3.0
        ("constant", (1 + 2 + 3 + 4 + 5) / (2 * 4)),  # max_completion_length 4: 1.875
        ("dapo", (1 + 2 + 3 + 4 + 5) / 10),  # generation batch holds 10 tokens: 1.5
    ],
)
def test_aggregations_by_hand(aggregation, expected):
    norm = LossNormalizer(num_sequences=2, num_tokens=5, num_generation_tokens=10, max_completion_length=4)
    assert aggregate(PER_TOKEN, MASK, aggregation, norm).item() == pytest.approx(expected)


def test_local_normalizer_gives_textbook_means():
    norm = LossNormalizer.local(MASK)
    assert aggregate(PER_TOKEN, MASK, "token", norm).item() == pytest.approx(3.0)
    assert aggregate(PER_TOKEN, MASK, "constant", norm).item() == pytest.approx(15 / (2 * 3))


def test_unknown_aggregation_is_named():
    with pytest.raises(ValueError, match="'mean'"):
        aggregate(PER_TOKEN, MASK, "mean", LossNormalizer.local(MASK))


@pytest.mark.parametrize("aggregation", ["sequence", "token", "constant", "dapo"])
def test_micro_batches_with_step_normalizer_sum_to_the_full_batch_loss(aggregation):
    torch.manual_seed(0)
    logp = torch.randn(8, 5, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(8, 5)
    adv = torch.randn(8)
    mask = (torch.rand(8, 5) > 0.3).float()
    mask[:, 0] = 1.0
    ref = logp.detach() + 0.05 * torch.randn(8, 5)
    full_norm = LossNormalizer.local(mask)
    kwargs = dict(aggregation=aggregation, normalizer=full_norm, ref_logprobs=ref, beta=0.04)
    full, _ = grpo_loss(logp, old, adv, mask, **kwargs)
    parts = [
        grpo_loss(logp[s], old[s], adv[s], mask[s], **{**kwargs, "ref_logprobs": ref[s]})[0]
        for s in (slice(0, 3), slice(3, 8))
    ]
    assert torch.allclose(sum(parts), full, atol=1e-6)


def test_invariant_beta0_one_iteration_sequence_loss_is_zero_with_nonzero_gradient():
    # Rewards symmetric within each group: group-normalised advantages sum to exactly 0 per group.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 1.0, 0.0])
    advantages, _ = group_advantages(rewards, group_size=4, scale_rewards="group")
    torch.manual_seed(0)
    logits = torch.randn(8, 6, 11, requires_grad=True)
    ids = torch.randint(0, 11, (8, 6))
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    mask = torch.ones(8, 6)
    mask[1, 3:] = 0  # different lengths must not break the invariant under sequence aggregation
    mask[6, 2:] = 0
    loss, _ = grpo_loss(logp, logp.detach(), advantages, mask, "sequence", beta=0.0)
    assert loss.item() == 0.0
    loss.backward()
    assert logits.grad.abs().sum() > 0


def test_invariant_holds_to_rounding_for_arbitrary_rewards():
    torch.manual_seed(1)
    advantages, _ = group_advantages(torch.rand(32), group_size=8)
    logp = torch.randn(32, 7, requires_grad=True)
    mask = (torch.rand(32, 7) > 0.2).float()
    mask[:, 0] = 1
    loss, _ = grpo_loss(logp, logp.detach(), advantages, mask, "sequence")
    assert abs(loss.item()) < 1e-6
    loss.backward()
    assert logp.grad.abs().sum() > 0


def test_sft_loss_is_the_token_mean_of_the_whole_step_in_any_split():
    """Two micro-batches of 3 and 1 tokens: their parts sum to the step's token mean, (1 + 2 + 3 + 4) / 4."""
    from lit_rl.losses.sft import sft_loss

    first = torch.tensor([[-1.0, -2.0], [-3.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    second = torch.tensor([[-4.0, -9.0]]), torch.tensor([[1.0, 0.0]])
    step_tokens = torch.tensor(4.0)
    total = sft_loss(*first, step_tokens) + sft_loss(*second, step_tokens)
    assert total.item() == pytest.approx(10.0 / 4)
    # A mean per micro-batch, averaged, would give (6/3 + 4/1) / 2 = 3.0: the split would change the loss.
    assert total.item() != pytest.approx((6.0 / 3 + 4.0) / 2)


def test_the_option_types_name_every_choice_and_only_those():
    from typing import get_args

    from lit_rl.losses.aggregation import AGGREGATIONS, LossAggregation

    assert set(get_args(LossAggregation)) == set(AGGREGATIONS)
