"""Decoding that stops computing rows once they finish: HF `generate`'s sampling, without its finished rows.

`generate` keeps every row of the batch until the last one stops, so with completions of very different lengths
most decoding steps run rows that already produced their EOS (their tokens are thrown away). This loop samples
exactly as `HFGenerateEngine` does, each row from its own seed with the counter-based Gumbel-max of
`SeededRowSampler` (below; so a row's tokens depend on its seed and step only, never on which rows share the batch), and
drops finished rows from the batch, the attention mask and the KV cache (`batch_select_indices`) as it goes: a
decoding step costs the rows still running.

Finished rows are dropped when the model's cache is a plain key/value cache that can be indexed by row
(`shared_prompts.indexable_cache`; other caches keep every row, as `generate` does). The loop is used when the
ranks do not step together (ZeRO-3 and FSDP step every rank until all are done: `generate` with
`synced_gpus`). Transformers' continuous batching frees slots too, but it samples from one global seed and drops
custom logits processors, so it cannot keep this sampling.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lit_rl.modeling.shared_prompts import indexable_cache
from lit_rl.ops import position_ids_from_mask
from lit_rl.rollout.base import SamplingParams


def sample_next(
    logits: torch.Tensor,
    step: int,
    params: SamplingParams,
    sampler: Optional[Any],
    seeds: Optional[torch.Tensor],
    eos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens [n] chosen from decoding `step`'s logits [n, V] (greedy without a `SeededRowSampler`, else each row
    from its seed in `seeds` [n]) and their log-probs [n] under the distribution they were drawn from: the logits
    with the stop ids masked before `min_new_tokens`, then divided by the temperature and truncated by top-k and
    top-p (`SeededRowSampler.warp`; the plain logits when greedy), as vLLM's `processed_logprobs` report them."""
    scores = logits.float()  # [n, V]
    # No stop yet: masked before top-k/top-p (as HF and vLLM do), so the truncation keeps other tokens.
    allowed = scores.index_fill(-1, eos, float("-inf")) if step < params.min_new_tokens else scores
    drawn_from = allowed if sampler is None else sampler.warp(allowed)
    ranked = drawn_from if sampler is None else sampler.noised(drawn_from, seeds, step)
    chosen = ranked.argmax(dim=-1)  # [n]
    logprob = torch.log_softmax(drawn_from, dim=-1).gather(-1, chosen[:, None])
    return chosen, logprob.squeeze(-1)


@torch.no_grad()
def decode_skipping_finished(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    seeds: Optional[Sequence[int]],
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    cache: Optional[Any] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion ids [N, T'] (pad after each row's EOS, T' <= max_new_tokens: up to the longest row) and the
    log-probs [N, T'] of the sampled tokens under the distribution they were drawn from (`sample_next`).

    `cache`: a KV cache of every row's prompt but its last token (`shared_prompt_cache`), or None.
    """
    N, P = prompt_ids.shape
    T = params.max_new_tokens
    device = prompt_ids.device
    sampler = None if params.greedy else SeededRowSampler(seeds, params)
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
    tokens = torch.full((N, T), pad_token_id, dtype=prompt_ids.dtype, device=device)
    logprobs = torch.zeros(N, T, dtype=torch.float32, device=device)
    running = torch.arange(N, device=device)  # the original row of each row still in the batch

    attention_mask = prompt_mask
    positions = position_ids_from_mask(prompt_mask)
    if cache is None:
        inputs, input_positions = prompt_ids, positions
    else:  # the cache holds positions 0..P-2: run each row's last prompt token on it
        inputs, input_positions = prompt_ids[:, -1:], positions[:, -1:]
    out = model(
        input_ids=inputs,
        attention_mask=attention_mask,
        position_ids=input_positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    compactable = indexable_cache(cache)  # else finished rows keep running (their tokens are masked later)
    next_position = positions[:, -1] + 1  # [n]
    steps = 0
    for t in range(T):
        row_seeds = None if sampler is None else sampler.seeds[running.cpu()]
        chosen, logprob = sample_next(out.logits[:, -1, :], t, params, sampler, row_seeds, eos)
        tokens[running, t] = chosen.to(tokens.dtype)
        logprobs[running, t] = logprob
        steps = t + 1
        if compactable:
            done = torch.isin(chosen, eos)  # [n]
        else:  # every row stays in the batch: a row is done once any of its tokens was an EOS
            done = torch.isin(tokens[running, : t + 1], eos).any(dim=1)
        if bool(done.all()) or t == T - 1:
            break
        if compactable and bool(done.any()):  # drop the finished rows from everything the next step reads
            keep = (~done).nonzero().squeeze(-1)
            running, chosen = running[keep], chosen[keep]
            attention_mask, next_position = attention_mask[keep], next_position[keep]
            cache.batch_select_indices(keep)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(running), 1)], dim=1)
        out = model(
            input_ids=chosen[:, None].to(prompt_ids.dtype),
            attention_mask=attention_mask,
            position_ids=next_position[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        next_position = next_position + 1
    return tokens[:, :steps], logprobs[:, :steps]


class SeededRowSampler:
    """A logits processor that turns greedy decoding into sampling, each row from its own seed.

    Gumbel-max: `argmax(z + g)` with `g = -log(-log(u))`, `u ~ U(0, 1)` i.i.d. per vocabulary entry, is a sample
    of `softmax(z)`. Here `z` is the logits divided by the temperature, truncated by top-k and top-p (entries
    outside set to -inf), so the argmax `generate` takes is a sample of exactly the distribution `generate` itself
    would sample. The uniforms of row `r` at decoding step `t` are a hash of (`seeds[r]`, `t`, vocabulary index)
    (`counter_uniforms`): vectorised over the batch, the same on any device, and independent of the other rows.
    """

    def __init__(self, seeds: Sequence[int], params: SamplingParams, recorder: Optional[Any] = None) -> None:
        """`recorder`: a logits processor (`hf.SampledTokenLogprobs`) given each step's warped scores in `generate`."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.seeds = torch.tensor([int(seed) for seed in seeds], dtype=torch.int64)
        self.step = 0
        self.recorder = recorder
        warpers = [TemperatureLogitsWarper(params.temperature)]
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(params.top_p))
        self.warpers = LogitsProcessorList(warpers)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if len(self.seeds) != scores.shape[0]:
            raise ValueError(f"{len(self.seeds)} seeds for {scores.shape[0]} rows")
        warped = self.warp(scores)
        if self.recorder is not None:  # the log-probs of the distribution sampled from, before the noise
            self.recorder(input_ids, warped)
        perturbed = self.noised(warped, self.seeds, self.step)
        self.step += 1
        return perturbed

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores [n, V] of the distribution sampled from: divided by the temperature, truncated by top-k and
        top-p (-inf outside)."""
        return self.warpers(None, scores.float())  # the warpers do not read input_ids

    def noised(self, warped: torch.Tensor, seeds: torch.Tensor, step: int) -> torch.Tensor:
        """Warped scores [n, V] of rows with `seeds` [n] at decoding `step`, plus their Gumbel noise: the argmax is
        the sample."""
        uniform = counter_uniforms(seeds.to(warped.device), step, warped.shape[1])  # [n, V]
        return warped + (-torch.log(-torch.log(uniform))).to(warped.dtype)


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def counter_uniforms(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1) [N, V], float64: SplitMix64 of the counter `seed * golden + step * V + v` (int64
    arithmetic wraps around, as the hash wants)."""
    counter = torch.arange(vocab, dtype=torch.int64, device=seeds.device) + step * vocab  # [V]
    z = seeds[:, None] * _GOLDEN + counter[None, :] + _GOLDEN  # [N, V]
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return (_shift_right(z, 11).double() + 0.5) / 2.0**53
