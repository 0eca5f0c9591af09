"""The loss registry: GSPO, GSPO-token, CISPO and the advantage estimators computed by hand, names and import paths
resolved, and a user's objective given by path running exactly like the built-in it wraps."""

import math

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.loss_config import GRPOLoss
from lit_rl.losses import LossNormalizer, advantage_function, grpo_loss, policy_loss_function
from lit_rl.losses.advantages import loo_advantages, reinforce_pp_advantages, reinforce_pp_baseline_advantages
from lit_rl.losses.policy import cispo, gspo, gspo_token, ppo_clip
from lit_rl.modeling.models import load_causal_lm


def my_objective(logprobs, old_logprobs, advantages, completion_mask, epsilon_low, epsilon_high):
    """A user's objective by import path: PPO's, unchanged (the test checks it trains identically)."""
    return ppo_clip(logprobs, old_logprobs, advantages, completion_mask, epsilon_low, epsilon_high)


# Two sequences: the first of 2 tokens (one pad), the second of 3; log-prob differences d = logprobs - old.
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.7, -0.9]])
D = torch.tensor([[0.3, -0.1, 0.0], [0.05, 0.05, 0.05]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -1.0])


def test_gspo_clips_the_length_normalised_sequence_ratio_by_hand():
    # s_0 = exp((0.3 - 0.1) / 2) = exp(0.1); s_1 = exp((0.05 * 3) / 3) = exp(0.05). Within [0.8, 1.2]: unclipped.
    s0, s1 = math.exp(0.1), math.exp(0.05)
    per_token, stats = gspo(OLD + D, OLD, ADV, MASK, 0.2, 0.2)
    assert torch.allclose(per_token, torch.tensor([[-s0, -s0, -s0], [s1, s1, s1]]), atol=1e-6)
    # Sequence aggregation: (-s0 + s1) / 2, the paper's 1/G sum_i.
    loss, _ = grpo_loss(OLD + D, OLD, ADV, MASK, "sequence", policy_loss="gspo", epsilon_low=0.2, epsilon_high=0.2)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    # eps_high 0.05: s_0 = 1.105 > 1.05 with A > 0 is clipped to 1.05 (every token of it); s_1 with A < 0 is not.
    per_token, stats = gspo(OLD + D, OLD, ADV, MASK, 0.05, 0.05)
    assert torch.allclose(per_token[0], torch.full((3,), -1.05), atol=1e-6)
    assert stats["clipped_high"][0].tolist() == [1.0, 1.0, 1.0] and stats["clipped_high"][1].sum() == 0


def test_gspo_token_has_gspos_value_and_gradient_with_one_advantage_per_sequence():
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]])
    adv = torch.tensor([0.7, -1.3, 0.4])
    grads = []
    for objective in ("gspo", "gspo_token"):
        logprobs = (old + 0.05 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = grpo_loss(logprobs, old, adv, mask, "sequence", policy_loss=objective)
        loss.backward()
        grads.append((loss.item(), logprobs.grad * mask))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)
    assert grads[0][1].abs().sum() > 0


def test_cispo_weighs_each_tokens_logprob_by_the_clipped_ratio_and_keeps_its_gradient():
    # r = exp(-1.0 - -1.5) = exp(0.5) = 1.6487 > 1.2: the weight is 1.2, a constant. A = 2, logprob -1:
    # loss -1.2 * 2 * -1 = 2.4, gradient d/dlogprob = -1.2 * 2 = -2.4 (PPO's clipped surrogate has 0 there).
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    old, adv, mask = torch.tensor([[-1.5]]), torch.tensor([2.0]), torch.ones(1, 1)
    per_token, stats = cispo(logprobs, old, adv, mask, 0.2, 0.2)
    assert per_token.item() == pytest.approx(2.4)
    per_token.sum().backward()
    assert logprobs.grad.item() == pytest.approx(-2.4)
    assert stats["clipped_high"].item() == 1.0 and stats["ratio"].item() == pytest.approx(math.exp(0.5))
    ppo_logprobs = torch.tensor([[-1.0]], requires_grad=True)
    ppo_clip(ppo_logprobs, old, adv, mask, 0.2, 0.2)[0].sum().backward()
    assert ppo_logprobs.grad.item() == 0.0


def test_advantage_estimators_by_hand():
    r = torch.tensor([1.0, 2.0, 3.0, 6.0])
    # RLOO: r_i - mean of the other three: 1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2.
    assert torch.allclose(loo_advantages(r, 4)[0], torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))
    # REINFORCE++: (r - 3) / (std + 1e-4), unbiased std = sqrt((4 + 1 + 0 + 9) / 3).
    std = math.sqrt(14 / 3)
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (std + 1e-4)
    assert torch.allclose(reinforce_pp_advantages(r, 4)[0], expected)
    # REINFORCE++-baseline, groups of 2: [1, 3] and [0, 4] -> c = [-1, 1, -2, 2], std(c) = sqrt(10 / 3).
    baseline, _ = reinforce_pp_baseline_advantages(torch.tensor([1.0, 3.0, 0.0, 4.0]), 2)
    assert torch.allclose(baseline, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / (math.sqrt(10 / 3) + 1e-4))
    assert advantage_function("rloo") is loo_advantages


def test_names_and_import_paths_resolve_and_mistakes_are_one_line():
    assert policy_loss_function("gspo_token") is gspo_token
    user = policy_loss_function("tests.test_policy_losses:my_objective")
    assert user.__module__.endswith("test_policy_losses") and user.__name__ == "my_objective"
    with pytest.raises(ConfigError, match=r"model.loss.objective must be one of \['cispo', 'gspo', 'gspo_token'"):
        policy_loss_function("gpso")
    with pytest.raises(ConfigError, match="model.loss.advantage 'no_such.module.fn': cannot import module"):
        advantage_function("no_such.module.fn")
    with pytest.raises(ConfigError, match="has no callable 'missing'"):
        policy_loss_function("tests.test_policy_losses.missing")


@pytest.mark.slow
def test_a_users_objective_by_path_trains_exactly_like_the_builtin(tmp_path):
    from tests.conftest import fit_grpo

    builtin = fit_grpo(max_steps=2, learning_rate=1e-3)
    user = fit_grpo(max_steps=2, learning_rate=1e-3, policy_loss="tests.test_policy_losses.my_objective")
    for (name, a), (_, b) in zip(builtin.policy.state_dict().items(), user.policy.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    initial = load_causal_lm("lit-rl/tiny-qwen2-addition-sft")
    assert not torch.equal(builtin.policy.lm_head.weight, initial.lm_head.weight)  # it trained


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"policy_loss": "gspo", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
        {"policy_loss": "gspo_token"},
        {"policy_loss": "cispo", "epsilon_low": 1.0, "epsilon_high": 4.0},
        {"advantage": "rloo"},
        {"advantage": "reinforce_pp"},
        {"advantage": "reinforce_pp_baseline", "beta": 0.04},
        {"overlong_filter": True, "max_new_tokens": 2, "loss_aggregation": "dapo"},
        {"overlong_buffer": 2, "overlong_penalty": 0.5},
    ],
    ids=lambda options: "-".join(str(v) for v in options.values()),
)
def test_grpo_trains_with_every_objective_and_estimator(options):
    from tests.conftest import fit_grpo

    model = fit_grpo(max_steps=2, learning_rate=1e-3, **options)
    assert model.trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in model.policy.parameters())


def test_normalizer_is_shared_by_every_objective():
    # The same denominators: a token-aggregated CISPO loss over two micro-batches sums to the one-batch loss.
    logprobs = OLD + D
    whole, _ = grpo_loss(logprobs, OLD, ADV, MASK, "token", policy_loss="cispo")
    norm = LossNormalizer(2.0, float(MASK.sum()), float(MASK.sum()), 3)
    parts = []
    for i in range(2):
        rows = slice(i, i + 1)
        parts.append(grpo_loss(logprobs[rows], OLD[rows], ADV[rows], MASK[rows], "token", norm, policy_loss="cispo")[0])
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_overlong_penalty_and_truncation_by_hand():
    from lit_rl.losses.overlong import overlong_penalty, truncated

    # Limit 10, buffer 4: the penalty starts after 6 tokens and reaches 0.5 (the scale) at 10.
    lengths = torch.tensor([5, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, 0.125, 0.25, 0.5]
    assert overlong_penalty(lengths, 10, 0).tolist() == [0.0] * 5
    ids = torch.tensor([[5, 2, 0], [5, 6, 7], [2, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    assert truncated(ids, mask, [2]).tolist() == [False, True, False]


@pytest.mark.parametrize("overlong_filter", [True, False])
def test_overlong_filter_gives_truncated_completions_no_loss(overlong_filter):
    from lit_rl.algorithms import GRPO
    from lit_rl.types import RolloutBatch

    module = GRPO(loss=GRPOLoss(overlong_filter=overlong_filter, aggregation="token"))
    module.configure_model()
    eos = module.tokenizer.eos_token_id
    # Row 0 ends with EOS after 2 tokens; row 1 runs to the limit (3 tokens) without one: truncated.
    batch = RolloutBatch(
        prompt_ids=torch.tensor([[5, 6], [5, 6]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.long),
        completion_ids=torch.tensor([[7, eos, eos], [7, 8, 9]]),
        completion_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        rollout_logprobs=torch.zeros(2, 3),
        rewards=torch.zeros(2),
        reward_components=torch.zeros(2, 1),
        advantages=torch.tensor([1.0, 5.0]),
        group_reward_std=torch.ones(2),
    )
    mask = batch.loss_mask = module.loss_mask(batch)  # as the module sets it when it builds a batch
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, _ = module.micro_batch_loss(batch, module.micro_batch_terms(batch, logprobs), LossNormalizer.local(mask))
    loss.backward()
    # Ratio 1 (one on-policy pass): each counted token's loss is -A. Filtered: row 0's two tokens only,
    # (-1 - 1) / 2; unfiltered: (-1 * 2 - 5 * 3) / 5.
    assert loss.item() == pytest.approx(-1.0 if overlong_filter else -17 / 5)
    assert (logprobs.grad[1] == 0).all() == overlong_filter
    assert mask.tolist() == [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0] if overlong_filter else [1.0, 1.0, 1.0]]


@pytest.mark.slow
def test_soft_overlong_punishment_is_subtracted_from_the_reward(tmp_path):
    from tests.conftest import FAST_GRPO, fit_config, train_rows

    # Buffer = the limit (4): every completion of L tokens loses 0.5 * L / 4. The functions' own values are logged
    # apart, so train/reward = correctness - 0.5 * mean length / 4, per step.
    overlong = ["--model.loss.overlong_buffer", "4", "--model.loss.overlong_penalty", "0.5", "--trainer.max_steps", "2"]
    rewards = ["--model.rewards.funcs", "[lit_rl.rewards.arithmetic.correctness]", "--model.rewards.weights", "null"]
    log_dir = fit_config(tmp_path, "run", "grpo.yaml", *FAST_GRPO, *rewards, *overlong)
    rows = train_rows(log_dir)
    assert len(rows) == 2
    for row in rows:
        expected = row["train/rewards/correctness"] - 0.5 * row["train/completion_length"] / 4
        assert row["train/reward"] == pytest.approx(expected, abs=1e-6)
        assert row["train/completion_length"] > 2  # the penalty is not 0
