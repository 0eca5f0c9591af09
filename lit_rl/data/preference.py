"""Preference pairs (`prompt`, `chosen`, `rejected`): tokenization, truncation, and rank-sharded batches.

Batches are built here, not by a sampler (see `lit_rl.data.sharding`), so every rank gets the same number of
batches whatever the data size: a rank whose share runs out is padded with copies of a pair of weight 0, which the
loss and the metrics ignore.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from lit_rl.data.files import Row
from lit_rl.data.sharding import ResumableShardBatches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenizedPair:
    index: int  # row number in the data set (keys the precomputed reference log-probs)
    prompt_ids: list[int]
    chosen_ids: list[int]  # completion tokens, EOS appended
    rejected_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """The tokens of its two sequences (what a padding-free forward computes)."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)


def with_explicit_prompt(row: Row) -> Row:
    """A preference row with its implicit prompt made explicit: a row without `prompt` whose `chosen` and `rejected`
    (texts, or message lists) start alike gets that shared start as `prompt` and the rest as `chosen` and
    `rejected`, as TRL's `extract_prompt` splits them, so that a data set trains as it does under TRL: texts keep
    the space before the split with the completions, and when one completion starts the other (`... A: 4` and
    `... A: 42`), the last shared character (or message) stays with the completions, so neither is left empty.
    Rows with a `prompt`, or without both completions, are returned as they are."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if row.get("prompt") is not None or chosen is None or rejected is None:
        return row
    length = min(len(chosen), len(rejected))
    shared = next((index for index in range(length) if chosen[index] != rejected[index]), None)
    if shared is None:
        shared = max(length - 1, 0)
    elif isinstance(chosen, str) and shared > 0 and chosen[shared - 1] == " ":
        shared -= 1
    return {**row, "prompt": chosen[:shared], "chosen": chosen[shared:], "rejected": rejected[shared:]}


def completion_text(prompt_text: str, prompt: Any, completion: Any, tokenizer: Any) -> str:
    """A completion as text: plain text as is; chat messages rendered by the chat template after the prompt."""
    if isinstance(completion, str):
        return completion
    if isinstance(prompt, list):
        full = tokenizer.apply_chat_template(prompt + completion, tokenize=False)
        if full.startswith(prompt_text):
            return full[len(prompt_text) :]
    return "".join(message["content"] for message in completion)


def tokenize_pairs(
    rows: list[Row],
    tokenizer: Any,
    format_prompt: Callable[[Any], str],
    max_prompt_length: Optional[int],
    max_length: Optional[int],
    source: str,
) -> list[TokenizedPair]:
    """Tokenize every pair; prompts keep their last `max_prompt_length` tokens, and completions are cut so that
    prompt + completion fits `max_length`. Logs how many rows were truncated."""
    eos = tokenizer.eos_token_id
    pairs, truncated = [], 0
    for index, row in enumerate(rows):
        prompt_text = format_prompt(row["prompt"])
        # A chat template already wrote the special tokens; plain text gets the tokenizer's own.
        prompt_ids = tokenizer(prompt_text, add_special_tokens=isinstance(row["prompt"], str))["input_ids"]
        completions = []
        for key in ("chosen", "rejected"):
            text = completion_text(prompt_text, row["prompt"], row[key], tokenizer)
            completions.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        cut = False
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            prompt_ids, cut = prompt_ids[-max_prompt_length:], True
        if max_length is not None:
            budget = max(max_length - len(prompt_ids), 1)
            if any(len(c) > budget for c in completions):
                completions, cut = [c[:budget] for c in completions], True
        truncated += cut
        pairs.append(TokenizedPair(index, prompt_ids, completions[0], completions[1]))
    if truncated:
        log.warning(
            "%s: truncated %d of %d rows (max_prompt_length=%s, max_length=%s)",
            source,
            truncated,
            len(rows),
            max_prompt_length,
            max_length,
        )
    return pairs


def batch_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The real tokens of a collated batch (`collate_pairs`): each pair of weight > 0 counts its two sequences, as
    `TokenizedPair.num_tokens` (and so `data.micro_batch_tokens`) counts them; padding pairs count nothing."""
    sequences = batch["prompt_mask"].sum(dim=1) + batch["completion_mask"].sum(dim=1)  # [2B]
    return (sequences * (batch["weight"] > 0).repeat(2)).sum()


def batch_completion_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The completion tokens of a collated batch's real pairs (`perf/trained_tokens_per_s`); padding pairs count
    nothing."""
    return (batch["completion_mask"].sum(dim=1) * (batch["weight"] > 0).repeat(2)).sum()


def collate_pairs(pairs: list[TokenizedPair], weights: list[float], pad_id: int) -> dict[str, torch.Tensor]:
    """One batch of B pairs as 2B sequences, chosen first then rejected, for a single forward pass.

    prompt_ids/prompt_mask [2B, P] left-padded; completion_ids/completion_mask [2B, T] right-padded;
    weight [B] (0 for padding pairs); index [B].
    """
    prompts = [p.prompt_ids for p in pairs] * 2
    completions = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    P, T = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(prompts), P), dtype=torch.long)
    completion_ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(prompts), T), dtype=torch.float32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        prompt_ids[row, P - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[row, P - len(prompt) :] = 1
        completion_ids[row, : len(completion)] = torch.tensor(completion)
        completion_mask[row, : len(completion)] = 1.0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "weight": torch.tensor(weights, dtype=torch.float32),
        "index": torch.tensor([p.index for p in pairs], dtype=torch.long),
    }


class ShardedPairBatches(ResumableShardBatches):
    """Batches of this rank's share of the pairs (`order[rank::world_size]`), all ranks with the same count,
    resumable (`lit_rl.data.sharding.ResumableShardBatches`). Each batch also carries `window_pairs`, the real pairs
    of this rank in its optimizer step.
    """

    def __init__(
        self,
        pairs: list[TokenizedPair],
        batch_size: int,
        shuffle: bool,
        seed: int,
        rank: int,
        world_size: int,
        pad_id: int,
        **resume: Any,
    ) -> None:
        super().__init__(len(pairs), batch_size, shuffle, seed, rank, world_size, **resume)
        self.pairs, self.pad_id = pairs, pad_id

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for position, windows in self.positions():
            indices, weights = self.micro_batch_at(position, windows)
            batch = collate_pairs([self.pairs[i] for i in indices], weights, self.pad_id)
            # Real pairs of this rank in the optimizer step holding this batch: the loss is normalised by the
            # step's pairs on all ranks, so a half-empty last batch does not weigh more.
            batch["window_pairs"] = torch.tensor(sum(sum(w) for _, w in self.window_batches(position, windows)))
            yield batch
