"""Decoding that skips finished rows samples what `generate` samples, and computes only the rows still running."""

import pytest
import torch

from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.rollout import HFGenerateEngine, SamplingParams

MODEL = "lit-rl/tiny-qwen2-addition-sft"


@pytest.fixture(scope="module")
def policy():
    return load_tokenizer(MODEL), load_causal_lm(MODEL)


def batch(tokenizer, prompts, repeat):
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    return enc["input_ids"].repeat_interleave(repeat, 0), enc["attention_mask"].repeat_interleave(repeat, 0)


def rows_per_forward(model):
    """A list that collects the rows of every forward of `model` (its embedding's input)."""
    rows = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    return rows


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, temperature=1.0),
        SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(max_new_tokens=8, temperature=0.0),
    ],
    ids=["sampled", "top_k_top_p", "greedy"],
)
@pytest.mark.parametrize("repeat", [1, 4], ids=["distinct_prompts", "shared_prompts"])
def test_skipping_finished_rows_samples_what_generate_samples(policy, params, repeat):
    tokenizer, model = policy
    ids, mask = batch(tokenizer, ["1+2=", "45+67=", "9+99=", "123+4567=", "5+5=", "80+9="], repeat)
    seeds = list(range(100, 100 + len(ids)))
    skipping = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    full = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, skip_finished=False)
    a = skipping.generate(ids, mask, params, seeds)
    b = full.generate(ids, mask, params, seeds)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)
    lengths = a.completion_mask.sum(dim=1)
    assert len(set(lengths.tolist())) > 1  # rows finish at different steps: there is something to skip
    sampled = a.logprobs[a.completion_mask > 0]
    # Of the distribution drawn from: top-k/top-p may leave a step one token (log-prob 0), never a positive one.
    assert (sampled <= 0).all() and (sampled < 0).any()


def test_only_the_rows_still_running_are_computed(policy):
    tokenizer, model = policy
    ids, mask = batch(tokenizer, ["1+2=", "45+67=", "9+99=", "123+4567=", "5+5=", "80+9="], 1)  # distinct
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    seeds = list(range(len(ids)))
    engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    rows = rows_per_forward(model)
    out = engine.generate(ids, mask, params, seeds)
    lengths = out.completion_mask.sum(dim=1).long()
    steps = out.completion_ids.shape[1]
    # The prefill runs every row; the forward that feeds token k - 1 runs the rows longer than k (a row whose k-th
    # token was its EOS has left the batch).
    assert rows == [len(ids)] + [int((lengths > k).sum()) for k in range(1, steps)]
    full_rows = len(ids) * steps
    assert sum(rows) < full_rows


def drawn_from_logprobs(model, ids, mask, out, params, eos_id):
    """[N, T] log-probs of `out`'s tokens under the distribution each was drawn from, from the whole sequence's
    forward: the stop masked before `min_new_tokens`, then temperature, top-k and top-p (the plain logits when
    greedy), as vLLM's `processed_logprobs` report them."""
    from lit_rl.ops import position_ids_from_mask
    from lit_rl.rollout.engines.compact_decode import SeededRowSampler

    full_mask = torch.cat([mask, out.completion_mask.long()], dim=1)
    full_ids = torch.cat([ids, out.completion_ids], dim=1)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=position_ids_from_mask(full_mask))
    logits = logits.logits[:, ids.shape[1] - 1 : -1].float()  # [N, T, V]: the logits each token was drawn from
    warp = (lambda x: x) if params.greedy else SeededRowSampler([0] * len(ids), params).warp
    columns = []
    for t in range(logits.shape[1]):
        step = logits[:, t]
        if t < params.min_new_tokens:
            step = step.index_fill(-1, torch.tensor([eos_id]), float("-inf"))
        columns.append(torch.log_softmax(warp(step), dim=-1).gather(-1, out.completion_ids[:, t : t + 1]))
    return torch.cat(columns, dim=1).masked_fill(out.completion_mask == 0, 0.0)  # pads may be truncated: -inf


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.0, 0), (1.0, 1)], ids=["sampled", "greedy", "top_k_1"])
def test_no_completion_stops_before_min_new_tokens_and_the_logprobs_are_of_the_distribution_drawn_from(
    policy, temperature, top_k
):
    from lit_rl.modeling.completions import completion_scores

    tokenizer, model = policy
    ids, mask = batch(tokenizer, ["1+2=", "45+67=", "9+99=", "123+4567="], 2)
    seeds = list(range(len(ids)))
    free = SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k)
    # The stops are masked before top-k: with top_k 1 the most likely other token is chosen, never an id the
    # truncation left at -inf everywhere.
    held = SamplingParams(max_new_tokens=10, min_new_tokens=6, temperature=temperature, top_k=top_k)
    skipping = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    full = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, skip_finished=False)
    assert skipping.generate(ids, mask, free, seeds).completion_mask.sum(dim=1).min() < 6  # the model stops early
    a, b = skipping.generate(ids, mask, held, seeds), full.generate(ids, mask, held, seeds)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert a.completion_mask.sum(dim=1).min() >= 6
    # The log-probs are of the distribution drawn from (vLLM's `processed_logprobs`): the stop masked early, top-k
    # applied (top_k 1: every token had probability 1, log-prob 0).
    expected = drawn_from_logprobs(model, ids, mask, a, held, tokenizer.eos_token_id)
    for out in (a, b):
        torch.testing.assert_close(out.logprobs, expected, rtol=1e-5, atol=1e-5)
    if top_k == 1:
        assert a.logprobs.abs().max() == 0
    # The trainer's are of the whole distribution: the early tokens' differ by the stop's mass, the later agree.
    trainer = completion_scores(model, ids, mask, a.completion_ids, a.completion_mask, held.logprob_temperature)
    gap = a.logprobs - trainer.logprobs * a.completion_mask
    if top_k == 0:
        assert (gap[:, :6] > 1e-4).any() and (gap[:, :6] > -1e-5).all()  # the engine's q >= the trainer's p
        # (the whole sequence's forward rounds differently from one token at a time: ~1e-5)
        torch.testing.assert_close(gap[:, 6:], torch.zeros_like(gap[:, 6:]), rtol=0, atol=5e-5)
