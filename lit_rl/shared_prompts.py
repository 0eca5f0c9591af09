"""Compute a prompt once, not once per row that continues it.

GRPO, RLOO and Online DPO score G completions of every prompt, and DPO scores a chosen and a rejected answer of
every prompt; the plain forward runs the whole `[prompt, completion]` sequence of every row, so each prompt goes
through the model G (or 2) times. Here the distinct prompts, all but their last token, run once with the KV cache
on; the cache is indexed out to the rows (`index_select`, which autograd differentiates, so the gradient of the
prompt's states sums over the rows sharing it), and each row then runs its last prompt token and its completion on
top of it. Same logits up to float rounding (a test checks logits and gradients against the plain forward).

Gradient checkpointing drops the KV cache inside training forwards (`transformers` sets `past_key_values=None` in
each checkpointed layer), so checkpointed models in training mode take the plain path.

Pure torch: the model is called, never imported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rl.ops import position_ids_from_mask


def distinct_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The distinct rows of `[prompt_ids, prompt_mask]` [N, P]: `(ids [U, P], mask [U, P], row_to_distinct [N])`,
    or None when no two rows are the same (nothing to share) or prompts are a single token (nothing to cache)."""
    if prompt_ids.shape[1] < 2:
        return None
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [N, 2P]
    distinct, row_to_distinct = torch.unique(rows, dim=0, return_inverse=True)
    if distinct.shape[0] == rows.shape[0]:
        return None
    P = prompt_ids.shape[1]
    return distinct[:, :P], distinct[:, P:].to(prompt_mask.dtype), row_to_distinct


def caches_in_this_mode(model: torch.nn.Module) -> bool:
    """False when a forward of `model` would drop the KV cache: gradient checkpointing in training mode."""
    return not (model.training and getattr(model, "is_gradient_checkpointing", False))


def shared_prompt_cache(model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Optional[Any]:
    """KV cache of every row's prompt but its last token [N, P-1], each distinct prompt computed once; None when
    nothing is shared (then run the plain forward). Gradients flow through it unless called under `no_grad`."""
    found = distinct_prompts(prompt_ids, prompt_mask) if caches_in_this_mode(model) else None
    if found is None:
        return None
    ids, mask, row_to_distinct = found
    prefix_mask = mask[:, :-1]  # [U, P-1]
    out = model(
        input_ids=ids[:, :-1],
        attention_mask=prefix_mask,
        position_ids=position_ids_from_mask(prefix_mask),
        use_cache=True,
        logits_to_keep=1,  # the logits are not needed; 1 keeps the head's work to one position
    )
    cache = getattr(out, "past_key_values", None)
    if not hasattr(cache, "batch_select_indices"):  # a model without a `transformers` Cache: no sharing
        return None
    cache.batch_select_indices(row_to_distinct)  # [U, ...] -> [N, ...] in every layer
    return cache
