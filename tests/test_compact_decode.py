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
    assert (a.logprobs[a.completion_mask > 0] < 0).all()


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


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.0, 0), (1.0, 1)], ids=["sampled", "greedy", "top_k_1"])
def test_no_completion_stops_before_min_new_tokens_and_the_logprobs_stay_the_trainers(policy, temperature, top_k):
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
    # The log-probs are of the model's own distribution (stops unmasked), what the trainer computes.
    trainer = completion_scores(
        model, ids, mask, a.completion_ids, a.completion_mask, 1.0 if temperature == 0 else temperature
    ).logprobs
    for out in (a, b):
        torch.testing.assert_close(out.logprobs, trainer * out.completion_mask, rtol=1e-5, atol=1e-5)
