"""Rollouts with `transformers` `generate` on the policy itself: the fallback engine, always available."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence

import torch

from lit_rl.lora import base_model
from lit_rl.ops import token_logprobs
from lit_rl.rollout.base import RolloutOutput, SamplingParams, completion_mask_from_ids


def model_eos_token_ids(model: torch.nn.Module, tokenizer_eos_id: Optional[int]) -> list[int]:
    """Every id that ends a completion: the tokenizer's EOS and the model's generation-config EOS ids
    (chat models often end turns with a token that is not the tokenizer's EOS)."""
    ids = [] if tokenizer_eos_id is None else [tokenizer_eos_id]
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    return ids + [i for i in configured if i not in ids]


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


class HFGenerateEngine:
    """Samples with `model.generate` on the live policy, so it never needs a weight push.

    Sampling is exactly `softmax(logits / temperature)` truncated by `top_k`/`top_p` when asked: the model's own
    generation settings are ignored. The model is held by reference (this is not an `nn.Module`, and it is never
    saved). Sampling uses the global torch RNG, which `seed_everything` seeds and checkpoints restore.
    """

    needs_weights = False

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: int | Sequence[int],
        pad_token_id: int,
        synced_ranks: bool = False,
    ) -> None:
        self.model = model
        # Under ZeRO-3 every forward gathers parameters collectively: ranks must take the same number of decoding
        # steps, so each keeps stepping (on finished rows) until all ranks are done.
        self.synced_ranks = synced_ranks
        self.eos_token_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> RolloutOutput:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy else params.top_p,
            top_k=None if params.greedy else params.top_k,  # 0 disables it (None would mean the default, 50)
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with _library_generation_defaults(self.model):
                out = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=config,
                    synced_gpus=self.synced_ranks,
                )
        finally:
            self.model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # [N, T]
        logits = torch.stack(out.logits, dim=1)  # [N, T, V], raw (before temperature and truncation)
        mask = completion_mask_from_ids(completion_ids, self.eos_token_ids)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_token_id)
        logprobs = token_logprobs(logits, completion_ids, params.logprob_temperature) * mask
        return RolloutOutput(completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs)

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Nothing to do: `generate` runs on the policy module itself."""

    def close(self) -> None:
        """Nothing to release: the model belongs to the trainer."""
