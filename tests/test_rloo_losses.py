"""Hand-computed RLOO baselines, advantages, KL penalty and clipped sequence-level loss."""

import math

import pytest
import torch

from lit_rl.losses.rloo import kl_penalized_rewards, rloo_advantages, rloo_loss


def test_leave_one_out_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0])  # k = 3: groups [1, 0, .5] and [2, 2, 2]
    # group 1: b = [(0 + .5)/2, (1 + .5)/2, (1 + 0)/2] = [.25, .75, .5] -> A = [.75, -.75, 0]
    expected = [0.75, -0.75, 0.0, 0.0, 0.0, 0.0]
    assert rloo_advantages(rewards, 3).tolist() == pytest.approx(expected)


def test_normalised_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])  # k = 2: A = [1, -1, 2, -2]
    raw = [1.0, -1.0, 2.0, -2.0]
    std = math.sqrt(sum(a * a for a in raw) / 3)  # mean 0, unbiased std
    assert rloo_advantages(rewards, 2, normalize=True).tolist() == pytest.approx([a / std for a in raw], rel=1e-6)


def test_kl_penalty_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    penalized, kl = kl_penalized_rewards(torch.tensor([1.0]), logp, ref, mask, beta=0.1)
    assert kl.item() == pytest.approx((-1 + 1.5) + (-2 + 1))  # -0.5: masked token ignored
    assert penalized.item() == pytest.approx(1.0 - 0.1 * -0.5)


def test_sequence_level_clipped_loss_by_hand():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    old = torch.zeros(2, 2)
    # sequence log-ratios: log(1.5) (spread over 2 tokens) and log(0.5) (second token masked)
    logp = torch.tensor([[math.log(1.5) / 2, math.log(1.5) / 2], [math.log(0.5), 5.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = rloo_loss(logp, old, adv, mask, epsilon=0.2)
    # seq 1: min(1.5 * 1, 1.2 * 1) = 1.2; seq 2: min(0.5 * -1, 0.8 * -1) = -0.8 -> losses [-1.2, 0.8]
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, rel=1e-6)
    assert stats["ratio"].tolist() == pytest.approx([1.5, 0.5])
    assert stats["clipped"].tolist() == [1.0, 1.0]


def test_the_rollout_correction_weighs_each_sequences_term():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.tensor([[math.log(1.5) / 2, math.log(1.5) / 2], [math.log(0.5), 5.0]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    weights = torch.tensor([0.5, 2.0], requires_grad=True)
    loss, _ = rloo_loss(logp, torch.zeros(2, 2), adv, mask, epsilon=0.2, sequence_weights=weights)
    # the by-hand losses [-1.2, 0.8], weighed by [0.5, 2.0]; the weights carry no gradient
    assert loss.item() == pytest.approx((-1.2 * 0.5 + 0.8 * 2.0) / 2, rel=1e-6)
    loss.backward()
    assert weights.grad is None


def test_clip_higher_widens_only_the_upper_range_of_the_sequence_ratio():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    logp = torch.tensor([[math.log(1.5) / 2, math.log(1.5) / 2], [math.log(0.5), 5.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, stats = rloo_loss(logp, torch.zeros(2, 2), adv, mask, epsilon=0.2, epsilon_high=0.4)
    # seq 1: min(1.5, 1.4) = 1.4 (the upper range is 0.4 now); seq 2 still clipped at 0.8 -> losses [-1.4, 0.8]
    assert loss.item() == pytest.approx((-1.4 + 0.8) / 2, rel=1e-6)
    assert stats["clipped"].tolist() == [1.0, 1.0]


def test_on_policy_loss_is_minus_mean_advantage_with_a_gradient():
    logp = torch.randn(4, 3, requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, _ = rloo_loss(logp, logp.detach(), adv, torch.ones(4, 3), num_sequences=8)
    assert loss.item() == pytest.approx(-adv.sum().item() / 8)
    loss.backward()
    assert logp.grad.abs().sum() > 0


def test_huge_log_ratio_with_zero_advantage_stays_finite():
    logp = torch.full((2, 4), 30.0, requires_grad=True)  # summed log-ratio 120: exp would overflow
    loss, _ = rloo_loss(logp, torch.zeros(2, 4), torch.tensor([0.0, -1.0]), torch.ones(2, 4))
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
