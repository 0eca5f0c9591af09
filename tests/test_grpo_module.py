"""GRPO internals through a plain Trainer: what is (not) computed, and what the rollout buffer holds."""

import pytest
import torch

from tests.conftest import fit_grpo


def test_on_policy_single_pass_computes_no_old_logprobs_and_beta0_loads_no_reference():
    model = fit_grpo(beta=0.0, num_iterations=1, steps_per_generation=1)
    assert model.ref_model is None
    assert model._buffer.old_logprobs is None and model._buffer.ref_logprobs is None


def test_multiple_iterations_compute_old_logprobs_that_match_the_rollout():
    model = fit_grpo(beta=0.1, num_iterations=2, micro_batch_size=4, steps_per_generation=2)
    buffer = model._buffer
    assert model.ref_model is not None and not any(p.requires_grad for p in model.ref_model.parameters())
    tokens = buffer.completion_mask > 0
    assert (buffer.old_logprobs - buffer.rollout_logprobs).abs()[tokens].max() < 1e-5
    # The reference is the starting policy: before any update its log-probs equal the old ones.
    assert (buffer.ref_logprobs - buffer.old_logprobs).abs()[tokens].max() < 1e-5
    assert buffer.advantages.shape == buffer.rewards.shape == (8,)
    grouped = buffer.advantages.view(-1, 4)
    assert torch.allclose(grouped.sum(dim=1), torch.zeros(2), atol=1e-4)


def test_group_must_fit_in_a_generation_batch():
    with pytest.raises(ValueError, match="must be a multiple of model.num_generations=3"):
        fit_grpo(num_generations=3, micro_batch_size=4)


class CountingTokenizer:
    """Passes everything to a tokenizer and records the texts of each call."""

    def __init__(self, inner):
        self.__dict__.update(inner=inner, calls=[])

    def __call__(self, texts, **kwargs):
        self.calls.append(list(texts))
        return self.inner(texts, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)


def test_encode_prompts_tokenizes_each_distinct_prompt_once():
    """A rollout batch holds every prompt G times: the encoding must equal tokenizing every row, from one
    tokenizer call over the distinct prompts (chat prompts included)."""
    from lit_rl.algorithms import GRPO

    module = GRPO()
    module.configure_model()
    chat = [{"role": "user", "content": "45+67="}]
    prompts = ["1+2=", "9+99=", "1+2=", chat, "9+99=", [dict(m) for m in chat]]
    texts = [p if isinstance(p, str) else module.format_prompt(p) for p in prompts]
    module.tokenizer.padding_side = "left"
    expected = module.tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    assert (expected["attention_mask"] == 0).any()  # padded: the rows differ in length
    module.tokenizer = CountingTokenizer(module.tokenizer)
    ids, mask = module.encode_prompts(prompts)
    assert module.tokenizer.calls == [["1+2=", "9+99=", texts[3]]]
    assert torch.equal(ids, expected["input_ids"])
    assert torch.equal(mask, expected["attention_mask"])
    # All text prompts: the tokenizer adds its special tokens, once per distinct prompt too.
    module.tokenizer.calls.clear()
    texts = ["7+8=", "12+34=", "7+8="]
    ids, mask = module.encode_prompts(texts)
    assert module.tokenizer.calls == [["7+8=", "12+34="]]
    expected = module.tokenizer(texts, padding=True, return_tensors="pt")
    assert torch.equal(ids, expected["input_ids"]) and torch.equal(mask, expected["attention_mask"])
