"""Supervised fine-tuning's loss: the negative log-likelihood of the completion tokens, per token of the
optimizer step. Pure torch."""

from __future__ import annotations

import torch


def sft_loss(logprobs: torch.Tensor, completion_mask: torch.Tensor, step_tokens: torch.Tensor) -> torch.Tensor:
    """A micro-batch's part of the step's token-mean negative log-likelihood.

    `logprobs` [B, T] of the completion tokens (and the EOS after them), `completion_mask` [B, T] (0 on padding and
    on padding rows), `step_tokens` the mask's sum over every micro-batch of the optimizer step on every rank:

        L_mb = - sum_{i,t} m_it logprobs_it / N_step,    N_step = sum over the step's micro-batches and ranks of m

    The parts of a step's micro-batches sum to the token mean over the whole step, so neither the accumulation nor
    the number of ranks changes the loss or its gradient. (A mean per micro-batch, averaged over micro-batches,
    weighs a token of a short micro-batch more than one of a long micro-batch.)
    """
    return -(logprobs * completion_mask).sum() / step_tokens.clamp(min=1.0)
