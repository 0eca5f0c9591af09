"""Compute a prompt once, not once per row that continues it.

GRPO, RLOO and Online DPO score G completions of every prompt, and DPO scores a chosen and a rejected answer of
every prompt; the plain forward runs the whole `[prompt, completion]` sequence of every row, so each prompt goes
through the model G (or 2) times. Here the distinct prompts, all but their last token, run once with the KV cache
on; the cache is indexed out to the rows (`index_select`, which autograd differentiates, so the gradient of the
prompt's states sums over the rows sharing it), and each row then runs its last prompt token and its completion on
top of it. Same logits up to float rounding (a test checks logits and gradients against the plain forward).

Gradient checkpointing drops the KV cache inside training forwards (`transformers` sets `past_key_values=None` in
each checkpointed layer), and dropout would draw one mask for a prompt's states instead of one per row, so
models in training mode with either take the plain path. Under ZeRO-3 and FSDP every forward gathers parameters
from all ranks, so the ranks agree (one all-reduce) on whether to share before any of them runs the prefix.

Pure torch but for the cache's layer types (imported from `transformers` when a cache is checked).
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


def can_share_prompts(model: torch.nn.Module) -> bool:
    """False when a prefix forward would not give the plain forward's values: gradient checkpointing drops the KV
    cache in training forwards, and active dropout would draw one mask for a prompt's states instead of one per
    row."""
    if not model.training:
        return True
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    if getattr(getattr(model, "config", None), "attention_dropout", 0.0):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def shared_prompt_cache(
    model: torch.nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, synced_ranks: bool = False
) -> Optional[Any]:
    """KV cache of every row's prompt but its last token [N, P-1], each distinct prompt computed once; None when
    nothing is shared (then run the plain forward). Gradients flow through it unless called under `no_grad`.

    `synced_ranks`: parameters are sharded across ranks (ZeRO-3, FSDP), so every forward is a collective and all
    ranks must run the same forwards; the ranks then share prompts only if all of them can (one all-reduce).
    """
    found = distinct_prompts(prompt_ids, prompt_mask) if can_share_prompts(model) else None
    if synced_ranks and not _on_every_rank(found is not None, prompt_ids.device):
        return None
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
    # Only plain key/value caches can be indexed out to rows (linear-attention or quantized layers hold other
    # states), and a cache that does not hold the P-1 prompt positions was dropped (e.g. by a checkpoint wrapper
    # the model does not report). Either way: the plain forward, which every rank then runs once, as here.
    if not indexable_cache(cache) or cache.get_seq_length() != ids.shape[1] - 1:
        return None
    cache.batch_select_indices(row_to_distinct)  # [U, ...] -> [N, ...] in every layer
    return cache


def indexable_cache(cache: Any) -> bool:
    """Whether every layer of `cache` is a plain key/value cache whose rows can be selected."""
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

    plain = (DynamicLayer, DynamicSlidingWindowLayer, DynamicIndexedLayer)
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in plain for layer in layers)


def _on_every_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on every rank of the default process group (itself when there is none)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())
