"""Rollouts with `transformers` `generate` on the policy itself: the fallback engine, always available."""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from lit_rl.ops import token_logprobs
from lit_rl.rollout.base import RolloutOutput, SamplingParams, completion_mask_from_ids


class HFGenerateEngine:
    """Samples with `model.generate` on the live policy, so it never needs a weight push.

    The model is held by reference (this is not an `nn.Module`, and it is never saved). Sampling uses the global
    torch RNG, which Lightning's `seed_everything` seeds and checkpoints restore.
    """

    def __init__(self, model: torch.nn.Module, eos_token_id: int, pad_token_id: int) -> None:
        self.model = model
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> RolloutOutput:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy else params.top_p,
            top_k=None if params.greedy or params.top_k == 0 else params.top_k,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
        finally:
            self.model.train(was_training)
        completion_ids = out.sequences[:, prompt_ids.shape[1] :]  # [N, T]
        logits = torch.stack(out.logits, dim=1)  # [N, T, V], raw (before temperature and truncation)
        mask = completion_mask_from_ids(completion_ids, self.eos_token_id)
        completion_ids = completion_ids.masked_fill(mask == 0, self.pad_token_id)
        logprobs = token_logprobs(logits, completion_ids, params.logprob_temperature) * mask
        return RolloutOutput(completion_ids=completion_ids, completion_mask=mask, logprobs=logprobs)

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Nothing to do: `generate` runs on the policy module itself."""
