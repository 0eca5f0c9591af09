"""A reward model as a reward function: `AutoModelForSequenceClassification` (one logit) scoring prompt+completion."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lit_rl.modeling.models import reading_model, resolve_model_path
from lit_rl.rewards import completion_text


class RewardModel:
    """Callable with the reward-function signature `(prompts, completions, **columns) -> list[float]`.

    Text prompts are concatenated with the completion; chat prompts get the completion as an assistant turn and
    go through the reward model tokenizer's chat template. Scores are the model's single output logit.
    Not an `nn.Module`: its weights are never trained or checkpointed.

    Args:
        name_or_path: hub id or local directory of a sequence-classification model with one label.
        batch_size: completions scored per forward pass.
        device: where the model runs (default: CPU; algorithms move it to their device).
        trust_remote_code: allow model code from the model repository (off by default).
    """

    def __init__(
        self,
        name_or_path: str,
        batch_size: int = 32,
        device: str | torch.device = "cpu",
        trust_remote_code: bool = False,
    ) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        resolved = resolve_model_path(name_or_path)
        with reading_model(name_or_path, resolved):
            self.tokenizer = AutoTokenizer.from_pretrained(resolved, trust_remote_code=trust_remote_code)
            self.model = (
                AutoModelForSequenceClassification.from_pretrained(
                    resolved, num_labels=1, trust_remote_code=trust_remote_code
                )
                .eval()
                .requires_grad_(False)
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.to(device)

    def to(self, device: str | torch.device) -> "RewardModel":
        self.model.to(device)
        self.device = torch.device(device)
        return self

    def _text(self, prompt: Any, completion: Any) -> str:
        completion = completion_text(completion)
        if isinstance(prompt, str):
            return prompt + completion
        messages = list(prompt) + [{"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[str], **_: Any) -> list[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], padding=True, return_tensors="pt")
            logits = self.model(**{k: v.to(self.device) for k, v in enc.items()}).logits  # [b, 1]
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
