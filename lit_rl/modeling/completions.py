"""The policy's forward paths over completions: the logits, hidden states and per-token scores of each completion
token given its prompt, as sampling saw them.

Three ways to run the same forward, equal in value: padded rows whose shared prompts run once
(`lit_rl.modeling.shared_prompts`), padding-free packed rows (`lit_rl.modeling.packing`), and either one stopped
before the output head, which then runs on chunks of tokens (`lit_rl.modeling.head`). The algorithms score
completions through `completion_scores` (`PolicyModule.score_completions` passes the run's settings); PPO's critic
reads its values from `completion_forward`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rl.modeling.head import TokenScores, check_plain_head, chunked_head_scores, scores_from_logits
from lit_rl.modeling.packing import packed_completion_forward, packed_completion_hidden
from lit_rl.modeling.shared_prompts import shared_prompt_cache
from lit_rl.ops import position_ids_from_mask


def _padded_completion_call(
    module: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    cache: Any,
    **kwargs: Any,
) -> Any:
    """`module` (the model, or its decoder) on the padded `[prompt, completion]` rows, from the shared-prompt cache
    when there is one; its output's last T + 1 positions are the last prompt token and the completion."""
    attention_mask = torch.cat([prompt_mask, completion_mask.to(prompt_mask.dtype)], dim=1)  # [N, P+T]
    positions = position_ids_from_mask(attention_mask)
    T = completion_ids.shape[1]
    if cache is None:
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # [N, P+T]
    else:  # the cache holds prompt positions 0..P-2; run the last prompt token and the completion on it
        input_ids = torch.cat([prompt_ids[:, -1:], completion_ids], dim=1)  # [N, 1+T]
        positions = positions[:, -(T + 1) :]
    return module(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=cache is not None,
        **kwargs,
    )


def completion_forward(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    synced_ranks: bool = False,
    padding_free: bool = False,
) -> torch.Tensor:
    """Logits that predict each completion token: [N, P] + [N, T] -> [N, T, V].

    Positions come from the attention mask, as in generation, so a left-padded prompt gets the same positions
    (and the same log-probs) as when it was sampled. Rows that share a prompt share its forward
    (`lit_rl.modeling.shared_prompts`): each distinct prompt but its last token runs once, and the rows run the rest.
    `synced_ranks`: parameters are sharded across ranks (`PolicyModule.parameters_sharded`), so the ranks must
    decide together. `padding_free`: one forward of the rows' real tokens laid end to end (`lit_rl.modeling.packing`;
    it replaces prompt sharing), with zero logits where `completion_mask` is 0.
    """
    if padding_free:
        return packed_completion_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    cache = shared_prompt_cache(model, prompt_ids, prompt_mask, synced_ranks)
    T = completion_ids.shape[1]
    out = _padded_completion_call(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, cache, logits_to_keep=T + 1
    )
    return out.logits[:, :-1]  # [N, T, V]: the logit at position t predicts token t + 1


def completion_hidden(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    synced_ranks: bool = False,
    padding_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`completion_forward` stopped before the output head: the decoder's last hidden states [K, H] at the K
    positions that predict completion tokens (where `completion_mask` is 1), and each one's (row, column) [K]."""
    if padding_free:
        return packed_completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    cache = shared_prompt_cache(model, prompt_ids, prompt_mask, synced_ranks)
    out = _padded_completion_call(model.get_decoder(), prompt_ids, prompt_mask, completion_ids, completion_mask, cache)
    rows, columns = (completion_mask > 0).nonzero(as_tuple=True)  # row by row, as the packed path orders them
    T = completion_ids.shape[1]
    return out.last_hidden_state[:, -(T + 1) : -1][rows, columns], rows, columns


def completion_scores(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    synced_ranks: bool = False,
    padding_free: bool = False,
    head_chunk_tokens: Optional[int] = None,
    extras: tuple[str, ...] = (),
) -> TokenScores:
    """Per-token log-probs [N, T] of the completion tokens under `softmax(logits / temperature)`, and the
    statistics named in `extras` (`lit_rl.modeling.head.EXTRAS`).

    `head_chunk_tokens`: the output head runs on the completion tokens' hidden states that many at a time
    (`lit_rl.modeling.head`), never building `[N, T, V]` logits; scores are then zero where `completion_mask` is 0.
    Otherwise from `completion_forward`'s logits.
    """
    args = (model, prompt_ids, prompt_mask, completion_ids, completion_mask, synced_ranks, padding_free)
    if head_chunk_tokens is None:
        return scores_from_logits(completion_forward(*args), completion_ids, temperature, extras)
    check_plain_head(model, prompt_ids.device)
    hidden, rows, columns = completion_hidden(*args)
    num_chunks = -(-len(rows) // head_chunk_tokens)
    if synced_ranks:  # every rank calls the sharded head equally often
        count = torch.tensor(float(num_chunks), device=prompt_ids.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        num_chunks = int(count)
    scores = chunked_head_scores(
        model.get_output_embeddings(),
        hidden,
        completion_ids[rows, columns],
        head_chunk_tokens,
        temperature,
        extras,
        num_chunks=num_chunks,
    )
    return scores.scatter(rows, columns, tuple(completion_ids.shape))
