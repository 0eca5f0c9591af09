"""PPO's critic math (`lit_rl.losses.ppo`), checked against values computed by hand."""

from __future__ import annotations

import math

import torch

from lit_rl.losses.ppo import clipped_value_loss, gae, masked_moments, moments_to_mean_std, token_rewards, whiten


def test_the_sequence_reward_lands_on_the_last_real_token_minus_the_kl_penalty():
    rewards = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    # Row 0: -0.5 * [0.1, 0.2, 0.3] + [0, 0, 1]; row 1: 2 - 0.5 * 0.5 at its only token, nothing after it.
    expected = torch.tensor([[-0.05, -0.1, 0.85], [1.75, 0.0, 0.0]])
    torch.testing.assert_close(token_rewards(rewards, mask, kl, beta=0.5), expected)
    torch.testing.assert_close(token_rewards(rewards, mask), torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 0.0]]))


def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 1.0, 5.0]])  # row 1's third value is past its end: ignored
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # Row 0: delta = [0.6 - 0.5, 0.7 - 0.6, 1 - 0.7] = [0.1, 0.1, 0.3]; A_2 = 0.3, A_1 = 0.1 + 0.5 * 0.3 = 0.25,
    # A_0 = 0.1 + 0.5 * 0.25 = 0.225. Row 1 (V_2 = 0, the episode ended): delta = [0, 2 - 1]; A = [0.5, 1].
    torch.testing.assert_close(advantages, torch.tensor([[0.225, 0.25, 0.3], [0.5, 1.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.725, 0.85, 1.0], [1.5, 2.0, 0.0]]))


def test_gae_with_gamma_and_lambda_one_is_the_reward_to_go_minus_the_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(returns, torch.ones(1, 3))
    discounted, _ = gae(rewards, torch.zeros(1, 3), torch.ones(1, 3), gamma=0.9, lam=1.0)
    torch.testing.assert_close(discounted, torch.tensor([[0.81, 0.9, 1.0]]))


def test_a_transcripts_observations_are_skipped_as_if_the_models_tokens_were_laid_end_to_end():
    """Multi-turn: the mask is 0 on the environment's tokens between turns. The reward lands on the last model
    token, and GAE over the transcript equals GAE over the model's tokens alone, put back in place."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0, 0], [1, 0, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    rewards, values, kl = torch.tensor([1.0, -2.0]), torch.randn(2, 10), torch.randn(2, 10)
    per_token = token_rewards(rewards, mask, kl, beta=0.3)
    assert per_token[0, 7] == 1.0 - 0.3 * kl[0, 7] and per_token[1, 4] == -2.0 - 0.3 * kl[1, 4]
    assert (per_token[mask == 0] == 0).all()
    advantages, returns = gae(per_token, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):
        real = mask[row] > 0
        compact_mask = torch.ones(1, int(real.sum()))
        compact_rewards = token_rewards(rewards[row : row + 1], compact_mask, kl[row : row + 1, real], beta=0.3)
        compact = gae(compact_rewards, values[row : row + 1, real], compact_mask, gamma=0.9, lam=0.8)
        torch.testing.assert_close(advantages[row, real], compact[0][0])
        torch.testing.assert_close(returns[row, real], compact[1][0])
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_whitening_uses_the_steps_moments_summed_over_ranks():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    whole = masked_moments(values, mask)
    torch.testing.assert_close(whole, torch.tensor([4.0, 10.0, 30.0], dtype=torch.float64))
    split = masked_moments(values[:1], mask[:1]) + masked_moments(values[1:], mask[1:])  # two ranks
    torch.testing.assert_close(split, whole)
    mean, std = moments_to_mean_std(whole)
    assert math.isclose(float(mean), 2.5) and math.isclose(float(std), math.sqrt(30 / 4 - 6.25), rel_tol=1e-6)
    white = whiten(values, mask, mean, std)
    assert float(white[1, 1]) == 0.0  # padding stays 0
    torch.testing.assert_close(white[mask > 0].mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_the_value_loss_is_clipped_around_the_sampling_times_values():
    values = torch.tensor([[1.0, 0.0, 0.6]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    loss, stats = clipped_value_loss(values, old, returns, clip=0.2)
    # Token 0: (1 - 2)^2 = 1 vs clipped (0.7 - 2)^2 = 1.69; token 1: 0 vs (0.3 - 0)^2 = 0.09; token 2: within the
    # clip range, (0.6 - 1)^2 = 0.16 both ways.
    torch.testing.assert_close(loss, torch.tensor([[0.845, 0.045, 0.08]]))
    assert stats["clipped"].tolist() == [[1.0, 1.0, 0.0]]
    loss.sum().backward()
    # The clipped tokens' loss does not depend on V (their clipped value is pinned): no gradient.
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 0.6 - 1.0]]))
    plain, _ = clipped_value_loss(values.detach(), old, returns, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.5, 0.0, 0.08]]))
