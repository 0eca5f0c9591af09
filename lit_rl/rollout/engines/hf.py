"""Rollouts from the policy itself (a decoding loop, or `transformers` `generate`): the fallback engine, always
available."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.modeling.lora import base_model, merged_view
from lit_rl.modeling.shared_prompts import shared_prompt_cache
from lit_rl.rollout.base import RolloutOutput, SamplingParams, completion_mask_from_ids, draw_seeds
from lit_rl.rollout.engines.compact_decode import SeededRowSampler, decode_skipping_finished


@contextmanager
def _library_generation_defaults(model: torch.nn.Module) -> Iterator[None]:
    """Hide the model's own `generation_config` (repetition penalty, top-k, min-p, ... from its repository):
    `generate` fills every unset field from it, which would sample from a distribution the trainer never sees."""
    from transformers import GenerationConfig

    model = base_model(model)  # a peft wrapper generates with its base model's settings
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def compile_stance(stance: str) -> ContextManager:
    """`torch.compiler.set_stance(stance)`: with "force_eager", a policy compiled for training
    (`model.policy.compile`) runs eagerly, since decoding's cache grows every step and would recompile the training
    graph at each new length; the compiled decoder sets "default" back around its own step."""
    return torch.compiler.set_stance(stance)


class HFGenerateEngine:
    """Samples with the live policy, so it never needs a weight push: `lit_rl.rollout.engines.compact_decode` (finished
    rows leave the batch), `static_decode` (`compiled`: a static cache and a compiled one-token step), or
    `model.generate` when the ranks step together (several ranks of FSDP, or of ZeRO-3 decoding through its
    partitions) or `skip_finished` is off; all draw the same samples.

    Sampling is exactly `softmax(logits / temperature)` truncated by `top_k`/`top_p` when asked: the model's own
    generation settings are ignored. The model is held by reference (this is not an `nn.Module`, and it is never
    saved). Each row samples from its own seed; without `seeds`, they are drawn from the global torch RNG, which
    `seed_everything` seeds and checkpoints restore.
    """

    needs_weights = False

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: int | Sequence[int],
        pad_token_id: int,
        synced_ranks: bool = False,
        skip_finished: bool = True,
        merged_lora: bool = False,
        compiled: bool = False,
        whole_weights: Optional[Callable[[], ContextManager]] = None,
    ) -> None:
        self.model = model
        # ZeRO-3 with `gather_weights`: a context inside which each rank holds the whole policy without DeepSpeed's
        # per-module hooks (`zero3_whole_weights`), entered once per generation.
        self.whole_weights = whole_weights
        if compiled and (synced_ranks or merged_lora):
            raise ValueError("compiled decoding needs whole, unmerged weights on each rank")
        self.decoder = None
        if compiled:
            from lit_rl.rollout.engines.static_decode import CompiledDecoder

            self.decoder = CompiledDecoder(model)
        # A LoRA policy samples with its adapter merged into the weights (`merged_view`), as vLLM does: the
        # diagnostic of `lit-rl check --mismatch`.
        self.merged_lora = merged_lora
        # Decode with `lit_rl.rollout.engines.compact_decode` (the same samples, finished rows no longer computed)
        # unless the ranks step together or `skip_finished` is off (then `generate`, which runs every row to the end).
        self.skip_finished = skip_finished
        # Under ZeRO-3 every forward gathers parameters collectively: ranks must take the same number of decoding
        # steps, so each keeps stepping (on finished rows) until all ranks are done.
        self.synced_ranks = synced_ranks
        # No other rank in a call (`RankLocalEngine`): neither decoding steps in step nor weights gathered per call.
        self.rank_local = not synced_ranks and whole_weights is None
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        # Each row samples from its own seed (drawn from the global RNG when none are given): Gumbel-max with
        # counter-based noise (`SeededRowSampler`), so a row's tokens do not depend on the rows beside it.
        if seeds is None and not params.greedy:
            seeds = draw_seeds(len(prompt_ids))
        was_training = self.model.training
        self.model.eval()
        try:
            whole = self.whole_weights() if self.whole_weights is not None else nullcontext()
            merged = merged_view(self.model) if self.merged_lora else nullcontext()
            with whole, merged, compile_stance("force_eager"):
                completion_ids, logprobs = self._decode(prompt_ids, prompt_mask, params, seeds)
        finally:
            self.model.train(was_training)
        mask = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_token_id)
        # After a row's EOS `generate` appends pads, which top-k/top-p may have truncated away (log-prob -inf):
        # zeroed, not multiplied (-inf * 0 is NaN).
        logprobs = logprobs.masked_fill(mask == 0, 0.0)
        return RolloutOutput(completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs)

    def _decode(self, prompt_ids, prompt_mask, params, seeds) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion ids [N, T] and the sampled tokens' log-probs [N, T], in eval mode."""
        # Completions of the same prompt share its prefill: decoding starts after the cached P-1 positions.
        cache = shared_prompt_cache(self.model, prompt_ids, prompt_mask, self.synced_ranks)
        if self.decoder is not None:
            return self.decoder.decode(prompt_ids, prompt_mask, params, seeds, self.eos_token_ids, cache)
        if self.skip_finished and not self.synced_ranks:  # the same samples, finished rows not computed
            return decode_skipping_finished(
                self.model, prompt_ids, prompt_mask, params, seeds, self.eos_token_ids, self.pad_token_id, cache
            )
        return self._generate_every_row(prompt_ids, prompt_mask, params, seeds, cache)

    def _generate_every_row(self, prompt_ids, prompt_mask, params, seeds, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """`model.generate`, every row to the end (ZeRO-3 and FSDP ranks step together): completion ids [N, T] and
        the sampled tokens' log-probs [N, T]."""
        from transformers import GenerationConfig, LogitsProcessorList

        # `generate` only ever takes the argmax: sampling is the `SeededRowSampler` processor. `SampledTokenLogprobs`
        # keeps the sampled tokens' log-probs, one step at a time instead of every step's [N, V] logits.
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=False,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
        )
        # The recorded log-probs are of the distribution sampled from (`compact_decode.sample_next`): after the
        # stops' mask, and when sampling of the sampler's warped scores (temperature, top-k, top-p), before its noise.
        recorder = SampledTokenLogprobs()
        processors = []
        if params.min_new_tokens > 0:  # before top-k/top-p, as HF's own processor and vLLM mask
            processors.append(StopsSuppressed(self.eos_token_ids, params.min_new_tokens))
        processors.append(recorder if params.greedy else SeededRowSampler(seeds, params, recorder=recorder))
        processors = LogitsProcessorList(processors)
        with _library_generation_defaults(self.model):
            out = self.model.generate(
                input_ids=prompt_ids,
                attention_mask=prompt_mask,
                past_key_values=cache,
                generation_config=config,
                logits_processor=processors,
                synced_gpus=self.synced_ranks,
            )
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # [N, T]
        return completion_ids, recorder.logprobs_of(completion_ids)

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Nothing to do: `generate` runs on the policy module itself."""

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer."""


class SampledTokenLogprobs:
    """A logits processor that keeps the log-prob of each sampled token under `softmax(scores / temperature)` of the
    scores it is given: the distribution sampled from (last in the list when greedy; when sampling, the
    `SeededRowSampler` hands it its warped scores before adding the noise).

    At decoding step t it holds step t's log-softmax [N, V] (float32) until step t + 1 shows which token was chosen
    (the last column of `input_ids`); `logprobs_of` reads the last step's. Peak memory is one step's [N, V], where
    `output_logits=True` would keep all T of them: 20 GB in float32 for 64 completions of 512 tokens at the Qwen2
    vocabulary.
    """

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = temperature
        self.logprobs: list[torch.Tensor] = []  # [N] per decided step
        self._pending: Optional[torch.Tensor] = None  # [N, V]: the step whose token is not yet known

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._pending is not None:
            self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # a new tensor: never aliased
        return scores

    def logprobs_of(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """[N, T] log-probs of the generated tokens (`completion_ids` [N, T], the tokens `generate` returned)."""
        if self._pending is not None:
            self._take(completion_ids[:, len(self.logprobs)])
        if len(self.logprobs) != completion_ids.shape[1]:
            raise RuntimeError(f"{len(self.logprobs)} log-prob steps for {completion_ids.shape[1]} generated tokens")
        if not self.logprobs:
            return torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        return torch.stack(self.logprobs, dim=1)

    def _take(self, tokens: torch.Tensor) -> None:
        self.logprobs.append(self._pending.gather(-1, tokens[:, None]).squeeze(-1))
        self._pending = None


class StopsSuppressed:
    """A logits processor that keeps the stop ids from being chosen for the first `min_new_tokens` steps."""

    def __init__(self, stop_ids: Sequence[int], min_new_tokens: int) -> None:
        self.stop_ids = torch.tensor(list(stop_ids), dtype=torch.long)
        self.min_new_tokens = min_new_tokens
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step, self.step = self.step, self.step + 1
        if step >= self.min_new_tokens:
            return scores
        return scores.index_fill(-1, self.stop_ids.to(scores.device), float("-inf"))
