"""Rows that share a prompt share its forward, with the plain forward's logits, gradients and samples."""

import pytest
import torch

from lit_rl.algorithms.base import completion_forward
from lit_rl.models import load_causal_lm, load_tokenizer
from lit_rl.ops import position_ids_from_mask, token_logprobs
from lit_rl.rollout import HFGenerateEngine, SamplingParams
from lit_rl.shared_prompts import distinct_prompts

MODEL = "lit-rl/tiny-qwen2-addition-sft"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture
def model():
    return load_causal_lm(MODEL)


def plain_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The whole [prompt, completion] sequence of every row, no cache: what sharing must reproduce."""
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    out = model(
        input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
        attention_mask=mask,
        position_ids=position_ids_from_mask(mask),
        use_cache=False,
    )
    return out.logits[:, prompt_ids.shape[1] - 1 : -1]


def grouped_batch(tokenizer, group_size=4, new_tokens=5, seed=0):
    """Three left-padded prompts (padding 0 to 3 tokens), each repeated `group_size` times, with random
    completions whose masks end early on some rows."""
    enc = tokenizer(["1+2=", "45+67=", "9+99="], padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()
    prompt_ids = enc["input_ids"].repeat_interleave(group_size, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(group_size, 0)
    generator = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(0, 250, (len(prompt_ids), new_tokens), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[::3, 3:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def count_input_tokens(model):
    """A list that collects the number of token positions of every forward of `model`'s embedding."""
    counts = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: counts.append(args[0].numel()))
    return counts


def test_distinct_prompts_maps_every_row_to_its_prompt():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    distinct_ids, distinct_mask, row_to_distinct = distinct_prompts(ids, mask)
    assert len(distinct_ids) == 2
    assert torch.equal(distinct_ids[row_to_distinct], ids)
    assert torch.equal(distinct_mask[row_to_distinct], mask)
    # Same ids with a different mask are different prompts.
    other_mask = mask.clone()
    other_mask[1, 0] = 1
    assert len(distinct_prompts(ids, other_mask)[0]) == 3
    assert distinct_prompts(ids[1:3], mask[1:3]) is None  # all distinct: nothing to share
    assert distinct_prompts(ids[:, -1:], mask[:, -1:]) is None  # one-token prompts: nothing to cache


def test_shared_forward_matches_the_plain_forward_in_values_and_gradients(model, tokenizer):
    batch = grouped_batch(tokenizer)
    counts = count_input_tokens(model)
    shared_logits = completion_forward(model, *batch)
    N, P = batch[0].shape
    T = batch[2].shape[1]
    # One pass over the 3 distinct prompts but their last token, one over every row's last prompt token and
    # completion: the prompt is not recomputed per row.
    assert counts == [3 * (P - 1), N * (T + 1)]
    plain_logits = plain_forward(model, *batch)
    assert shared_logits.shape == plain_logits.shape == (N, T, model.config.vocab_size)
    assert (shared_logits - plain_logits).abs().max().item() < 1e-4

    def gradients(logits):
        model.zero_grad()
        (token_logprobs(logits, batch[2]) * batch[3]).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    shared_grads = gradients(completion_forward(model, *batch))
    plain_grads = gradients(plain_forward(model, *batch))
    for name, grad in plain_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (shared_grads[name] - grad).abs().max().item() <= 1e-4 * scale, name


def test_gradient_checkpointing_in_training_takes_the_plain_path(model, tokenizer):
    """Checkpointed layers drop the KV cache in training forwards, so no cache may be relied on there."""
    batch = grouped_batch(tokenizer)
    model.gradient_checkpointing_enable()
    model.train()
    counts = count_input_tokens(model)
    logits = completion_forward(model, *batch)
    assert counts == [batch[0].numel() + batch[2].numel()]
    model.eval()
    with torch.no_grad():
        assert (logits - plain_forward(model, *batch)).abs().max().item() < 1e-4


@pytest.mark.parametrize("seeded", [True, False])
def test_generation_from_the_shared_prefill_samples_the_same_completions(model, tokenizer, seeded, monkeypatch):
    prompt_ids, prompt_mask, _, _ = grouped_batch(tokenizer, group_size=6)
    engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    seeds = list(range(100, 100 + len(prompt_ids))) if seeded else None

    def sample():
        torch.manual_seed(0)
        return engine.generate(prompt_ids, prompt_mask, params, seeds)

    counts = count_input_tokens(model)
    shared = sample()
    assert counts[0] == 3 * (prompt_ids.shape[1] - 1)  # the prefill of the distinct prompts
    assert counts[1] == len(prompt_ids)  # then one position per row: the last prompt token
    monkeypatch.setattr("lit_rl.rollout.hf.shared_prompt_cache", lambda *args: None)
    plain = sample()
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert torch.equal(shared.completion_mask, plain.completion_mask)
    assert (shared.logprobs - plain.logprobs).abs().max().item() < 1e-5
    assert len(set(map(tuple, shared.completion_ids.tolist()))) > 3  # rows of one prompt do differ
