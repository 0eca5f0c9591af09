"""Rows that share a prompt share its forward, with the plain forward's logits, gradients and samples."""

import pytest
import torch

from benchmarks.process_exit import exit_without_finalizing
from lit_rl.modeling.completions import completion_forward
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.modeling.shared_prompts import distinct_prompts, shared_prompt_cache
from lit_rl.ops import position_ids_from_mask, token_logprobs
from lit_rl.rollout import HFGenerateEngine, SamplingParams

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
    monkeypatch.setattr("lit_rl.rollout.engines.hf.shared_prompt_cache", lambda *args: None)
    plain = sample()
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert torch.equal(shared.completion_mask, plain.completion_mask)
    assert (shared.logprobs - plain.logprobs).abs().max().item() < 1e-5
    assert len(set(map(tuple, shared.completion_ids.tolist()))) > 3  # rows of one prompt do differ


def test_active_dropout_in_training_takes_the_plain_path(model, tokenizer):
    """With dropout, each row must draw its own mask on the prompt's states, as in the plain forward."""
    batch = grouped_batch(tokenizer)
    model.config.attention_dropout = 0.1
    model.train()
    counts = count_input_tokens(model)
    completion_forward(model, *batch)
    model.eval()  # dropout off: sharing is exact again
    completion_forward(model, *batch)
    N, P = batch[0].shape
    assert counts == [N * (P + batch[2].shape[1]), 3 * (P - 1), N * (batch[2].shape[1] + 1)]


def test_a_cache_without_the_prompt_positions_is_not_used(model, tokenizer):
    """A forward that returns an empty cache (a checkpoint wrapper the model does not report drops it) must not
    leave the rows without their prompt: the plain forward runs instead."""
    from transformers.cache_utils import DynamicCache

    batch = grouped_batch(tokenizer)

    class DropsTheCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            out = self.inner(**kwargs)
            if kwargs.get("use_cache"):
                out.past_key_values = DynamicCache()
            return out

    wrapped = DropsTheCache(model).eval()
    assert shared_prompt_cache(wrapped, batch[0], batch[1]) is None
    with torch.no_grad():
        logits = completion_forward(wrapped, *batch)
        assert (logits - plain_forward(model, *batch)).abs().max().item() < 1e-4


def test_lora_policy_and_its_adapter_off_reference_share_prompts_exactly(model, tokenizer):
    from lit_rl.modeling.lora import LoRAConfig, apply_lora, reference_view

    batch = grouped_batch(tokenizer)
    base_logits = plain_forward(model, *batch).detach()
    policy = apply_lora(model, LoRAConfig(r=4, alpha=8))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # a trained-looking adapter: the policy differs from its base
    counts = count_input_tokens(policy)
    with torch.no_grad():
        shared = completion_forward(policy, *batch)
        assert len(counts) == 2  # the prefix and the rows: shared through the peft wrapper
        assert (shared - plain_forward(policy, *batch)).abs().max().item() < 1e-4
        assert (shared - base_logits).abs().max().item() > 1e-2
        with reference_view(policy):
            reference = completion_forward(policy, *batch)
        assert (reference - base_logits).abs().max().item() < 1e-4


def _rank_decides(rank: int, world: int, init_file: str, synced: bool, results) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        tokenizer, model = load_tokenizer(MODEL), load_causal_lm(MODEL)
        # Rank 0's rows repeat a prompt; rank 1's are all different.
        prompts = ["1+2=", "1+2="] if rank == 0 else ["1+2=", "45+67="]
        enc = tokenizer(prompts, padding=True, return_tensors="pt")
        counts = count_input_tokens(model)
        with torch.no_grad():
            cache = shared_prompt_cache(model, enc["input_ids"], enc["attention_mask"], synced_ranks=synced)
        results[rank] = (cache is not None, len(counts))
    finally:
        torch.distributed.destroy_process_group()
    exit_without_finalizing()


@pytest.mark.slow
@pytest.mark.parametrize("synced", [False, True])
def test_ranks_with_sharded_parameters_agree_on_sharing(tmp_path, synced):
    """Under ZeRO-3/FSDP every forward is a collective: a rank that shares (one more forward) while another does
    not would hang them both. With `synced_ranks`, they share only if all can."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_rank_decides, args=(2, str(tmp_path / "init"), synced, results), nprocs=2, join=True)
    if synced:
        assert dict(results) == {0: (False, 0), 1: (False, 0)}
    else:  # what the all-reduce prevents: rank 0 runs a prefix forward, rank 1 does not
        assert dict(results) == {0: (True, 1), 1: (False, 0)}
