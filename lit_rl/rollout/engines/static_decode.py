"""Decoding with a static KV cache and a compiled one-token step (`HFGenerate(compile: true)`).

A decoding step of a small batch is mostly per-operator overhead: the eager forward of one token launches a few
hundred small kernels, and a growing cache is re-concatenated every step. Here the cache is allocated once at its
final length (`transformers.StaticCache`, [N, heads, P + T, head_dim]) and written in place, and the one-token
forward is `torch.compile`d (inductor's fused C++ kernels on CPU; CUDA graphs on GPU). The prompt's prefill stays
eager, as it runs once per generation at a new shape.

Sampling is `compact_decode.sample_next`, the same function the eager loop uses: each row from its own seed with
the counter-based Gumbel-max, so in float32 the tokens are the eager path's and their log-probs agree to float
rounding. Finished rows keep running (a compiled step has fixed shapes; their tokens are masked afterwards) and
decoding stops when every row has finished. Shapes: `torch.compile`'s automatic dynamic shapes compile the step
for the first shape, once more with the changing dimension (cache length, rows) symbolic, then reuse it.

On CPU two more things make the step faster (`benchmarks/compiled_decoding.py`): float32 weight matmuls run on
weights packed once per generation (`packed_linear`), and inductor stores any value of more than one operation that
has several users instead of recomputing it inside each (`realize_opcount_threshold: 1`; on CPU it recomputes up to
50 operations by default): otherwise the query's rotary embedding, sines and cosines included, is recomputed
inside attention's reduction once for every cached position.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional, Sequence

import torch

from lit_rl.ops import position_ids_from_mask
from lit_rl.rollout.base import SamplingParams
from lit_rl.rollout.engines.compact_decode import SeededRowSampler, sample_next
from lit_rl.rollout.engines.packed_linear import PackedLinearMode, packed_weights

# Inductor's options for the step on CPU: store values of more than one operation that are read twice (see above).
CPU_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 1}


class CompiledDecoder:
    """The compiled one-token step of `model`, and the static cache it writes, kept across generations (the cache
    is reused while the batch shape stays; CUDA graphs need its address fixed). Compiling takes seconds to tens of
    seconds at the first generation (`benchmarks/compiled_decoding.py` measures it and the break-even).
    """

    def __init__(self, model: torch.nn.Module, cpu_tuned: bool = True) -> None:
        """`cpu_tuned=False`: on CPU too, the plain compiled step without packed weights or inductor options (what
        `benchmarks/compiled_decoding.py` compares against)."""
        self.model = model
        device = _device_type(model)
        self.packs_weights = cpu_tuned and device == "cpu"
        if device == "cuda":  # CUDA graphs replay the whole step
            self.step = torch.compile(model.__call__, mode="reduce-overhead")
        elif self.packs_weights:
            self.step = torch.compile(_step_on_packed_weights(model), options=CPU_INDUCTOR_OPTIONS)
        else:
            self.step = torch.compile(model.__call__)
        self._cache: Optional[Any] = None
        self._cache_shape: Optional[tuple] = None

    @torch.no_grad()
    def decode(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]],
        eos_token_ids: Sequence[int],
        prefix_cache: Optional[Any] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion ids [N, T'] (anything after a row's EOS: the caller masks it; T' <= max_new_tokens, up to the
        longest row) and the sampled tokens' log-probs [N, T'] under the distribution each was drawn from
        (`compact_decode.sample_next`).

        `prefix_cache`: a KV cache of every row's prompt but its last token (`shared_prompt_cache`), or None.
        On CPU the weights are packed for this generation's steps and freed after them.
        """
        from lit_rl.rollout.engines.hf import compile_stance

        N, P = prompt_ids.shape
        T = params.max_new_tokens
        device = prompt_ids.device
        sampler = None if params.greedy else SeededRowSampler(seeds, params)
        row_seeds = None if sampler is None else sampler.seeds
        eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=device)
        tokens = torch.zeros(N, T, dtype=prompt_ids.dtype, device=device)
        logprobs = torch.zeros(N, T, dtype=torch.float32, device=device)
        finished = torch.zeros(N, dtype=torch.bool, device=device)

        cache = self._static_cache(N, P + T, device)
        # Every position after the prompt is a token: the causal mask (by cache position) hides those not yet
        # written, so the same [N, P + T] mask serves every step and the compiled step sees one tensor shape.
        attention_mask = torch.cat([prompt_mask, prompt_mask.new_ones(N, T)], dim=1)
        positions = position_ids_from_mask(prompt_mask)  # [N, P]
        start = 0
        if prefix_cache is not None:  # positions 0..P-2 were computed once per distinct prompt
            for layer, (keys, values) in enumerate(_layer_states(prefix_cache)):
                cache.update(keys, values, layer, {"cache_position": torch.arange(P - 1, device=device)})
            start = P - 1
        out = self.model(
            input_ids=prompt_ids[:, start:],
            attention_mask=attention_mask,
            position_ids=positions[:, start:],
            past_key_values=cache,
            cache_position=torch.arange(start, P, device=device),
            use_cache=True,
            logits_to_keep=1,
        )
        next_position = positions[:, -1:] + 1  # [N, 1]
        steps = 0
        with packed_weights() if self.packs_weights else nullcontext():
            for t in range(T):
                chosen, logprob = sample_next(out.logits[:, -1, :], t, params, sampler, row_seeds, eos)
                tokens[:, t] = chosen.to(tokens.dtype)
                logprobs[:, t] = logprob
                steps = t + 1
                finished |= torch.isin(chosen, eos)
                if t == T - 1 or bool(finished.all()):
                    break
                with compile_stance("default"):  # the engine decodes under "force_eager"
                    out = self.step(
                        input_ids=chosen[:, None].to(prompt_ids.dtype),
                        attention_mask=attention_mask,
                        position_ids=next_position,
                        past_key_values=cache,
                        cache_position=torch.tensor([P + t], device=device),
                        use_cache=True,
                    )
                next_position = next_position + 1
        return tokens[:, :steps], logprobs[:, :steps]

    def _static_cache(self, rows: int, length: int, device: torch.device) -> Any:
        """A `StaticCache` of `rows` x `length` positions: the last one emptied when the shape is the same."""
        from transformers import StaticCache

        shape = (rows, length, device)
        if self._cache is not None and self._cache_shape == shape:
            self._cache.reset()
            return self._cache
        self._cache = StaticCache(config=self.model.config, max_cache_len=length)
        for layer in self._cache.layers:
            _store_in_the_keys_dtype(layer)
        self._cache_shape = shape
        return self._cache


def _step_on_packed_weights(model: torch.nn.Module):
    """`model(**inputs)` with its weight matmuls on packed weights (`PackedLinearMode`), as one function to compile."""

    def step(**inputs):
        with PackedLinearMode():
            return model(**inputs)

    return step


def _store_in_the_keys_dtype(layer: Any) -> None:
    """Make a `StaticLayer` store its values in the dtype it allocated, its first keys': `index_copy_` refuses
    another. Under bf16 autocast (`bf16-mixed`) the keys leave the rotary embedding in float32 (float32 cos/sin
    times bfloat16) while the values come out of their projection in bfloat16; the eager loop's dynamic cache
    concatenates them onto float32 too, so both hold the same (exactly widened) numbers."""
    update = layer.update

    def update_in_one_dtype(key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        dtype = layer.keys.dtype if layer.is_initialized else key_states.dtype
        return update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    layer.update = update_in_one_dtype


def _layer_states(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [N, heads, P-1, head_dim] of each layer of a plain key/value cache."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type
