"""The RolloutEngine interface every generation backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. `temperature == 0` means greedy decoding.

    Log-probs reported by engines are those of the temperature-scaled distribution `softmax(logits / T)` (of the
    plain logits when greedy), before top-p/top-k truncation, which is what the trainer recomputes.
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutOutput:
    """Completions of a batch of prompts, right-padded with the pad id."""

    completion_ids: torch.Tensor  # [N, T] long
    completion_mask: torch.Tensor  # [N, T] float, 1 up to and including the first EOS
    logprobs: torch.Tensor  # [N, T] float, the engine's log-probs of the sampled tokens (0 on padding)


class RolloutEngine(Protocol):
    """Generates completions for token-id prompts and receives the policy's weights after each update."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> RolloutOutput:
        """Sample one completion per row of the left-padded `prompt_ids` [N, P] (repeat rows for groups)."""

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Make the engine sample from the current policy (a no-op for engines that share the model)."""


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS (any of `eos_token_ids`), 0 after it: [N, T] -> [N, T]."""
    eos = torch.tensor([eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids))
    is_eos = torch.isin(completion_ids, eos.to(completion_ids.device))
    # Number of EOS strictly before each position; a token counts while none came before it.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).float()
