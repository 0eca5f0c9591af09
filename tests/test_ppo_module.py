"""PPO through a plain Trainer, and its critic (`lit_rl.modeling.value_model`): what the rollout buffer holds, where the
gradient goes, the critic's forwards and its Hugging Face export."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lit_rl.errors import ConfigError
from lit_rl.losses import aggregate
from lit_rl.losses.policy import ppo_clip
from lit_rl.losses.ppo import gae, token_rewards
from lit_rl.modeling.completions import completion_forward
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.modeling.value_model import load_value_model, save_value_model
from lit_rl.ops import position_ids_from_mask
from tests.conftest import build_tiny_reward_model, fit_grpo, fit_on_episodes, grouped_kwargs

MODEL = "lit-rl/tiny-qwen2-addition-sft"


def test_ppo_clip_takes_one_advantage_per_token_by_hand():
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.0]]))
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    loss, stats = ppo_clip(logprobs, old, advantages, torch.ones(1, 3), 0.2, 0.2)
    # -min(1.5 * 1, 1.2 * 1) = -1.2; -min(0.5 * -1, 0.8 * -1) = 0.8; -min(1 * 2, 1 * 2) = -2.
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8, -2.0]]))
    assert stats["clipped_high"].tolist() == [[1.0, 0.0, 0.0]] and stats["clipped_low"].tolist() == [[0.0, 1.0, 0.0]]
    # One advantage per sequence is the same as that advantage on every token.
    per_sequence, _ = ppo_clip(logprobs, old, torch.tensor([1.0]), torch.ones(1, 3))
    per_token, _ = ppo_clip(logprobs, old, torch.ones(1, 3), torch.ones(1, 3))
    torch.testing.assert_close(per_sequence, per_token)


def test_the_critics_forwards_agree_and_its_export_gives_the_same_values(tmp_path):
    tokenizer = load_tokenizer(MODEL)
    critic = load_value_model(MODEL, num_embeddings=len(tokenizer))
    prompts = tokenizer(["1+2=", "1+2=", "33+4="], padding=True, return_tensors="pt")
    completions = tokenizer(["3<|endoftext|>", "4", "37"], padding=True, return_tensors="pt", padding_side="right")
    args = (prompts.input_ids, prompts.attention_mask, completions.input_ids, completions.attention_mask.float())
    mask = completions.attention_mask.float()
    with torch.no_grad():
        assert torch.equal(completion_forward(critic, *args)[..., 0] * mask, torch.zeros_like(mask))  # head at 0
        torch.nn.init.normal_(critic.score.weight, std=0.1)
        critic.score.bias.fill_(0.3)
        critic.train()  # rows 0 and 1 share their prompt's forward
        shared = completion_forward(critic, *args)[..., 0] * mask
        critic.eval()
        padded = completion_forward(critic, *args)[..., 0] * mask
        packed = completion_forward(critic, *args, padding_free=True)[..., 0] * mask
    assert shared[mask > 0].abs().min() > 0
    torch.testing.assert_close(shared, padded, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-6)

    from transformers import AutoModelForTokenClassification

    save_value_model(critic, tmp_path / "critic")
    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic").eval()
    ids = torch.cat([prompts.input_ids, completions.input_ids], dim=1)
    attention = torch.cat([prompts.attention_mask, completions.attention_mask], dim=1)
    with torch.no_grad():
        logits = exported(input_ids=ids, attention_mask=attention, position_ids=position_ids_from_mask(attention))
    T = completions.input_ids.shape[1]
    torch.testing.assert_close(logits.logits[:, -(T + 1) : -1, 0] * mask, padded, rtol=1e-5, atol=1e-6)
    # An exported critic starts a new run's critic, head included (`critic_model_name_or_path`).
    reloaded = load_value_model(str(tmp_path / "critic"), num_embeddings=len(tokenizer)).eval()
    with torch.no_grad():
        torch.testing.assert_close(completion_forward(reloaded, *args)[..., 0] * mask, padded, rtol=1e-5, atol=1e-6)


def test_a_critic_of_an_architecture_without_token_classification_exports_its_decoder_and_head(tmp_path):
    """GPT-2's token-classification class names its decoder `transformer`: the critic is saved as the decoder's own
    directory with `value_head.safetensors`, and loads back with the same values."""
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=64)).save_pretrained(
        tmp_path / "lm"
    )
    critic = load_value_model(str(tmp_path / "lm"), num_embeddings=302).eval()  # 2 tokens added by a tokenizer
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight, std=0.1)
        critic.score.bias.fill_(0.2)
    prompts, prompt_mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    args = (prompts, prompt_mask, torch.tensor([[3, 4], [301, 2]]))  # 301: a token the tokenizer added
    with torch.no_grad():
        values = completion_forward(critic, *args, torch.ones(2, 2))[..., 0]
    out = save_value_model(critic, tmp_path / "critic")
    assert (out / "value_head.safetensors").exists()
    reloaded = load_value_model(str(out), num_embeddings=302).eval()
    with torch.no_grad():
        torch.testing.assert_close(completion_forward(reloaded, *args, torch.ones(2, 2))[..., 0], values)


def test_a_reward_model_or_an_exported_critic_starts_ppos_critic_with_its_head(tmp_path):
    """`model.critic_model_name_or_path` as PPO loads it (`configure_model`): the head comes with the weights; a
    causal LM's critic starts with a head of 0."""
    from transformers import AutoModelForSequenceClassification

    from lit_rl.algorithms import PPO

    def ppo_critic(critic_path):
        ppo = PPO(**grouped_kwargs(PPO, model_name_or_path=MODEL), critic_model_name_or_path=critic_path)
        ppo.configure_model()
        return ppo.critic

    build_tiny_reward_model(tmp_path / "rm")
    reward_model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    critic = ppo_critic(str(tmp_path / "rm"))
    assert reward_model.score.weight.abs().sum() > 0 and torch.equal(critic.score.weight, reward_model.score.weight)
    assert critic.score.bias.item() == 0.0  # a sequence classifier's head has no bias
    assert torch.equal(critic.model.norm.weight, reward_model.model.norm.weight)
    with torch.no_grad():  # a trained critic, exported as a run's `hf/critic`
        critic.score.weight.normal_(std=0.1)
        critic.score.bias.fill_(0.3)
    save_value_model(critic, tmp_path / "critic")
    again = ppo_critic(str(tmp_path / "critic"))
    assert torch.equal(again.score.weight, critic.score.weight) and again.score.bias.item() == pytest.approx(0.3)
    new = ppo_critic(None)  # the policy's weights: values start at 0
    assert new.score.weight.abs().sum() == 0 and new.score.bias.item() == 0.0


def test_the_buffer_holds_gae_of_the_critics_values_whitened_over_the_generation():
    # 2 steps x 2 passes per generation: step 5 trains on the second generation, sampled after 4 updates (the
    # critic's values and the KL to the reference are no longer 0).
    model = fit_grpo(
        max_steps=5,
        algorithm="PPO",
        beta=0.1,
        gamma=0.99,
        lam=0.9,
        num_iterations=2,
        steps_per_generation=2,
        micro_batch_size=4,
        learning_rate=1e-3,
        critic_learning_rate=1e-2,
    )
    buffer = model._buffer
    mask = buffer.completion_mask
    tokens = mask > 0
    assert buffer.old_values[tokens].abs().min() > 0
    kl = (buffer.old_logprobs - buffer.ref_logprobs) * mask
    assert kl.abs().max() > 0
    torch.testing.assert_close(buffer.kl, kl.sum(dim=1))
    advantages, returns = gae(token_rewards(buffer.rewards, mask, kl, 0.1), buffer.old_values, mask, 0.99, 0.9)
    torch.testing.assert_close(buffer.returns, returns)
    mean, std = advantages[tokens].mean(), advantages[tokens].std(unbiased=False)
    torch.testing.assert_close(buffer.token_advantages, (advantages - mean) / (std + 1e-8) * mask)
    torch.testing.assert_close(buffer.advantages, buffer.token_advantages.sum(dim=1) / mask.sum(dim=1))


def test_with_an_environment_only_the_models_tokens_are_actions():
    """PPO on Countdown episodes (up to 3 model turns, observations between): GAE runs over the model's tokens alone,
    and neither the policy's loss nor the critic's has a gradient at an observation token."""
    model, observations = fit_on_episodes("PPO", beta=0.1, micro_batch_size=4)
    buffer = model._buffer
    model_tokens = buffer.completion_mask * buffer.sampled_mask
    kl = (buffer.old_logprobs - buffer.ref_logprobs) * model_tokens
    rewards = token_rewards(buffer.rewards, model_tokens, kl, 0.1)
    _, returns = gae(rewards, buffer.old_values, model_tokens, model.loss_args.gamma, model.loss_args.lam)
    torch.testing.assert_close(buffer.returns, returns)
    assert (buffer.token_advantages[observations] == 0).all() and (buffer.returns[observations] == 0).all()
    logprobs = buffer.old_logprobs.clone().requires_grad_(True)
    values = model.critic_values(buffer)
    model.critic_values = lambda mb: values  # the critic's forward, kept to read its gradient
    values.retain_grad()
    loss, _ = model.micro_batch_loss(buffer, model.micro_batch_terms(buffer, logprobs), model._normalizers[0])
    loss.backward()
    for grad in (logprobs.grad, values.grad):
        assert (grad[observations] == 0).all() and (grad[model_tokens > 0] != 0).any()


def test_one_loss_trains_both_networks_each_at_its_own_learning_rate():
    model = fit_grpo(max_steps=1, algorithm="PPO", num_generations=1, learning_rate=1e-4, critic_learning_rate=3e-3)
    groups = model.trainer.optimizers[0].param_groups
    assert [group["lr"] for group in groups] == [1e-4, 3e-3]
    assert [id(p) for p in groups[1]["params"]] == [id(p) for p in model.critic.parameters()]
    # Adam's first step moves every parameter with a gradient by about its learning rate.
    assert 1e-3 < model.critic.score.weight.abs().max() <= 3e-3 * 1.01
    start = dict(load_causal_lm(MODEL).named_parameters())
    moved = max((p.detach() - start[name]).abs().max() for name, p in model.policy.named_parameters())
    assert 1e-5 < moved <= 1e-4 * 1.01


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("value_clip", 0.0, "model.loss.value_clip must be > 0"),
        ("lam", 1.5, r"model.loss.lam must be in \[0, 1\]"),
        ("gamma", -0.1, r"model.loss.gamma must be in \[0, 1\]"),
        ("loss_aggregation", "mean", "model.loss.aggregation must be one of"),
        ("critic_learning_rate", -1.0, "model.critic_learning_rate must be >= 0"),
        ("num_generations", 0, "model.sampling.num_generations must be >= 1"),
    ],
)
def test_bad_ppo_settings_name_their_key(key, value, message):
    from lit_rl.algorithms import PPO

    with pytest.raises(ConfigError, match=message):
        PPO(**grouped_kwargs(PPO, **{key: value}))


def test_the_rollout_correction_weighs_the_policy_term_by_the_truncated_engine_ratio():
    """PPO's policy term per token is w_t times the clipped surrogate, w_t = min(exp(old - engine), cap) with
    `token_truncate` (the default with asynchronous rollouts); the critic's term is not weighed."""
    model, _ = fit_on_episodes("PPO", micro_batch_size=4)
    buffer = model._buffer
    tokens = buffer.completion_mask * buffer.sampled_mask
    logprobs = buffer.old_logprobs.clone()
    values = model.critic_values(buffer)
    model.critic_values = lambda mb: values
    normalizer = model._normalizers[0]
    shift = torch.linspace(-1.0, 1.0, tokens.numel()).reshape(tokens.shape)  # engine log-probs off by -1..1
    buffer.rollout_logprobs = (buffer.old_logprobs - shift) * tokens
    _, plain = model.micro_batch_loss(buffer, model.micro_batch_terms(buffer, logprobs), normalizer)
    model.rollout_args = dataclasses.replace(model.rollout_args, correction="token_truncate", correction_cap=1.5)
    model._correction = None  # resolved once a fit (`on_fit_start`): resolved again on the next micro-batch
    _, weighed = model.micro_batch_loss(buffer, model.micro_batch_terms(buffer, logprobs), normalizer)
    weights = torch.exp(shift).clamp(max=1.5) * tokens
    per_token, _ = ppo_clip(logprobs, buffer.old_logprobs, buffer.token_advantages, tokens)
    expected = aggregate(per_token * weights, tokens, model.loss_args.aggregation, normalizer)
    torch.testing.assert_close(weighed["policy_loss"], expected)
    assert not torch.allclose(plain["policy_loss"], expected)
    torch.testing.assert_close(weighed["value_loss"], plain["value_loss"])
