"""The trainer's recomputed log-probs equal HF generate's own scores on a left-padded batch (fp32)."""

import math

import pytest
import torch

from lit_rl.modeling.completions import completion_scores
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.rollout import HFGenerateEngine, SamplingParams

MODEL = "lit-rl/tiny-qwen2-addition-sft"


@pytest.fixture(scope="module")
def policy():
    return load_tokenizer(MODEL), load_causal_lm(MODEL)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_generate_scores_on_left_padded_prompts(policy, temperature):
    tokenizer, model = policy
    prompts = ["1+2=", "45+67=", "  9+99=", "3+40="]  # different lengths: left padding of 0 to 3 tokens
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any(), "the batch must actually be left-padded"
    ids = enc["input_ids"].repeat_interleave(4, 0)
    mask = enc["attention_mask"].repeat_interleave(4, 0)
    engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(0)
    out = engine.generate(ids, mask, SamplingParams(max_new_tokens=6, temperature=temperature))
    assert out.completion_mask.sum(1).min() >= 1
    with torch.no_grad():
        trainer_logprobs = completion_scores(
            model, ids, mask, out.completion_ids, out.completion_mask, temperature
        ).logprobs
    tokens = out.completion_mask > 0
    diff = (trainer_logprobs - out.logprobs).abs()[tokens]
    assert diff.max().item() < 1e-5
    # Not trivially equal: the log-probs are real, varied numbers.
    assert out.logprobs[tokens].std() > 0.01


def test_greedy_generation_and_completion_mask(policy):
    tokenizer, model = policy
    enc = tokenizer(["12+34=", "7+8="], padding=True, return_tensors="pt")
    engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    out = engine.generate(enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=8, temperature=0.0))
    for row in range(2):
        length = int(out.completion_mask[row].sum())
        ids = out.completion_ids[row]
        assert ids[length - 1] == tokenizer.eos_token_id  # the mask ends on the first EOS
        assert (ids[length:] == tokenizer.pad_token_id).all()
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    assert all(text.strip().isdigit() for text in texts)
    model.train()
    engine.generate(enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert model.training, "generate must restore the train mode it found"


def test_the_models_own_generation_settings_do_not_leak_into_sampling(policy):
    """A repository's generation_config (top_k=1, repetition penalty) must not change what the engine samples:
    the trainer's log-probs assume plain softmax(logits / T)."""
    tokenizer, model = policy
    saved = model.generation_config.to_dict()
    model.generation_config.top_k = 1
    model.generation_config.suppress_tokens = [tokenizer.convert_tokens_to_ids("1")]
    try:
        enc = tokenizer(["45+67="] * 32, return_tensors="pt")
        engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
        torch.manual_seed(0)
        out = engine.generate(
            enc["input_ids"], enc["attention_mask"], SamplingParams(max_new_tokens=6, temperature=1.5)
        )
        distinct = {tuple(row.tolist()) for row in out.completion_ids}
        assert len(distinct) > 1, "top_k=1 from the model's generation_config leaked into sampling"
        one = tokenizer.convert_tokens_to_ids("1")
        assert (out.completion_ids == one).any(), "suppress_tokens from the model's generation_config leaked"
        assert model.generation_config.top_k == 1  # restored afterwards
    finally:
        model.generation_config.update(**{k: saved.get(k) for k in ("top_k", "suppress_tokens")})


def test_any_of_several_eos_ids_ends_a_completion():
    from lit_rl.rollout.base import completion_mask_from_ids

    ids = torch.tensor([[5, 7, 3, 3], [5, 8, 3, 3], [5, 5, 5, 5]])
    assert completion_mask_from_ids(ids, [7, 8]).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


def test_seeded_sampling_depends_on_the_row_and_its_seed_only(policy):
    # What makes GRPO rank-invariant: a completion is the same whether its row is sampled in a batch of 12 on
    # one rank or alone on another, as long as its prompt and seed are.
    tokenizer, model = policy
    engine = HFGenerateEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    enc = tokenizer(["1+2=", "45+67=", "  9+99="], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(4, 0)
    seeds = list(range(100, 112))
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    together = engine.generate(ids, mask, params, seeds=seeds)
    alone = tokenizer(["45+67="], return_tensors="pt")
    for row in (4, 7):
        single = engine.generate(alone["input_ids"], alone["attention_mask"], params, seeds=[seeds[row]])
        width = single.completion_ids.shape[1]
        assert torch.equal(single.completion_ids[0], together.completion_ids[row, :width])
        assert torch.allclose(single.logprobs[0], together.logprobs[row, :width], atol=1e-5)
    # The global RNG plays no part, and different seeds give different samples.
    torch.manual_seed(123)
    again = engine.generate(ids, mask, params, seeds=seeds)
    assert torch.equal(again.completion_ids, together.completion_ids)
    other = engine.generate(ids, mask, params, seeds=[s + 1000 for s in seeds])
    assert not torch.equal(other.completion_ids, together.completion_ids)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (2, 1.0), (0, 0.7)])
def test_seeded_row_sampler_draws_from_the_truncated_softmax(top_k, top_p):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from lit_rl.rollout.engines.compact_decode import SeededRowSampler

    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    draws = 20000
    sampler = SeededRowSampler(list(range(draws)), params)
    ids = torch.zeros((draws, 1), dtype=torch.long)
    picked = sampler(ids, logits.expand(draws, -1)).argmax(dim=1)
    frequencies = torch.bincount(picked, minlength=5).float() / draws
    expected = TemperatureLogitsWarper(0.8)(ids[:1], logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(ids[:1], expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(ids[:1], expected)
    probabilities = expected.softmax(dim=1)[0]
    assert (frequencies - probabilities).abs().max() < 0.015  # 4 standard errors at 20,000 draws
    assert frequencies[probabilities == 0].sum() == 0  # truncated tokens are never drawn


def test_counter_uniforms_are_splitmix64_of_the_counter():
    from lit_rl.rollout.engines.compact_decode import counter_uniforms

    def splitmix64(x: int) -> int:  # the reference algorithm, in Python's unbounded integers
        mask = (1 << 64) - 1
        z = (x + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seeds, step, vocab = [0, 5, 2**31 - 2], 3, 258
    values = counter_uniforms(torch.tensor(seeds), step, vocab)
    for row, seed in enumerate(seeds):
        for v in (0, 17, vocab - 1):
            counter = (seed * 0x9E3779B97F4A7C15 + step * vocab + v) & ((1 << 64) - 1)
            assert values[row, v].item() == ((splitmix64(counter) >> 11) + 0.5) / 2**53
    assert 0.0 < values.min() and values.max() < 1.0


def test_sampled_token_logprobs_keeps_one_step_and_reads_each_chosen_token():
    from lit_rl.rollout.engines.hf import SampledTokenLogprobs

    recorder = SampledTokenLogprobs(temperature=2.0)
    step0 = torch.tensor([[0.0, 2.0, 4.0], [1.0, 1.0, 1.0]])
    step1 = torch.tensor([[4.0, 0.0, 0.0], [0.0, 6.0, 0.0]])
    prompt = torch.tensor([[9], [9]])
    assert recorder(prompt, step0) is step0  # the scores pass through untouched
    recorder(torch.cat([prompt, torch.tensor([[2], [0]])], 1), step1)  # step 0 chose tokens 2 and 0
    assert len(recorder.logprobs) == 1
    logprobs = recorder.logprobs_of(torch.tensor([[2, 0], [0, 1]]))  # step 1 chose 0 and 1
    # log softmax(z / 2): row 0 of step 0 is [0, 1, 2] - log(1 + e + e^2); row 1 is uniform, log(1/3).
    expected = torch.tensor(
        [
            [2 - math.log(1 + math.e + math.e**2), 2 - math.log(math.e**2 + 2)],
            [math.log(1 / 3), 3 - math.log(math.e**3 + 2)],
        ]
    )
    assert torch.allclose(logprobs, expected, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_those_of_every_steps_logits(policy, temperature):
    """The engine keeps one step's log-softmax at a time; the values equal those from all the raw logits
    (`output_logits=True`), early-finished rows included."""
    from transformers import GenerationConfig, LogitsProcessorList

    from lit_rl.ops import token_logprobs
    from lit_rl.rollout.engines.compact_decode import SeededRowSampler
    from lit_rl.rollout.engines.hf import SampledTokenLogprobs

    tokenizer, model = policy
    enc = tokenizer(["1+2=", "45+67=", "9+99="], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"].repeat_interleave(4, 0), enc["attention_mask"].repeat_interleave(4, 0)
    params = SamplingParams(max_new_tokens=8, temperature=temperature)
    recorder = SampledTokenLogprobs(temperature)
    config = GenerationConfig(
        max_new_tokens=8,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sampler = SeededRowSampler(list(range(len(ids))), params)
    with torch.no_grad():
        processors = LogitsProcessorList([recorder, sampler])
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, logits_processor=processors)
    completion_ids = out.sequences[:, ids.shape[1] :]
    assert (completion_ids == tokenizer.eos_token_id).any(dim=1).any()  # some rows end early
    expected = token_logprobs(torch.stack(out.logits, dim=1), completion_ids, temperature)
    assert (recorder.logprobs_of(completion_ids) - expected).abs().max().item() < 1e-5  # float rounding only
