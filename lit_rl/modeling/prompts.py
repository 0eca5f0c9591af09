"""Prompts as the policy reads them: rendered by the tokenizer's chat template (chat messages, with the tools'
schemas when the model calls tools in its chat format), tokenised, left-padded, and cut to their last
`max_prompt_length` tokens.

One `PromptEncoder` per run, shared by the module (SFT's prompts, the prompt-length checks) and the rollout
producers (the prompts they sample from), so both read a prompt the same way.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import torch

from lit_rl.envs.base import TokenIds
from lit_rl.errors import ConfigError


class PromptEncoder:
    """Renders and tokenises prompts with a run's tokenizer.

    Args:
        tokenizer: the policy's tokenizer (its chat template renders chat prompts).
        max_length: prompts keep their last that many tokens (None: no limit).
    """

    def __init__(self, tokenizer: Any, max_length: Optional[int]) -> None:
        self.tokenizer = tokenizer
        self.max_length = max_length

    def format(self, prompt: Any, tools: Optional[list[dict]] = None) -> str:
        """Text prompts pass through; chat messages go through the tokenizer's chat template (with `tools`' JSON
        schemas, for a model that calls tools in its chat format)."""
        if isinstance(prompt, str):
            return prompt
        check_chat_template(self.tokenizer)
        return self.tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)

    def encode(
        self,
        prompts: list[Any],
        tools: Optional[list[dict]] = None,
        per_prompt_tools: Optional[list[list[dict]]] = None,
        device: Optional[torch.device] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded prompt ids and mask [B, P] on `device` (None: the CPU); chat prompts are rendered with
        `tools`, or each with its own `per_prompt_tools` (TRL's dict of environments: its row's environment's)
        (`format`). Long prompts keep their end, but one rendered with tools is a `ConfigError`: its schemas, at
        its start, would be cut first.

        Each distinct prompt is rendered and tokenised once (a rollout batch holds every prompt G times). Prompts
        given as `TokenIds` (a `lit_rl.envs.TokenEnvironment`'s) are taken as they are, never cut."""
        if any(isinstance(p, TokenIds) for p in prompts):
            return self._given_ids(prompts, tools, device)
        tools_of = per_prompt_tools if per_prompt_tools is not None else [tools] * len(prompts)
        tool_keys = {id(t): _tools_key(t) for t in tools_of}  # each environment's list once
        keys = [(_prompt_key(p, row), tool_keys[id(t)]) for row, (p, t) in enumerate(zip(prompts, tools_of))]
        first_of = {}  # key -> the first (prompt, tools) with it
        for key, prompt, prompt_tools in zip(keys, prompts, tools_of):
            first_of.setdefault(key, (prompt, prompt_tools))
        distinct_index = {key: i for i, key in enumerate(first_of)}
        texts = [self.format(p, t) for p, t in first_of.values()]
        # Cut from the start, a prompt rendered with tools would lose its schemas first: refused instead.
        with_tools = tools is not None or per_prompt_tools is not None
        self.tokenizer.padding_side = "left"
        self.tokenizer.truncation_side = "left"
        enc = self.tokenizer(
            texts,
            padding=True,
            truncation=self.max_length is not None and not with_tools,
            max_length=self.max_length,
            return_tensors="pt",
            add_special_tokens=all(isinstance(p, str) for p in prompts),  # a chat template already added them
        )
        longest = int(enc["attention_mask"].sum(dim=1).max()) if texts else 0
        if with_tools and self.max_length is not None and longest > self.max_length:
            raise ConfigError(
                f"a prompt has {longest} tokens with the tools' schemas (as its environment's reset left it), more "
                f"than model.sampling.max_prompt_length ({self.max_length}), which would cut it from its start, "
                "schemas first: raise it, or set it to null"
            )
        rows = torch.tensor([distinct_index[key] for key in keys], dtype=torch.long)  # [B] -> distinct prompt
        return enc["input_ids"][rows].to(device), enc["attention_mask"][rows].to(device)

    def _given_ids(
        self, prompts: list[Any], tools: Optional[list[dict]], device: Optional[torch.device]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`TokenIds` prompts left-padded as they are: a prompt the world rendered is what its next turn extends,
        so one longer than `max_length` is an error, not cut. Others beside them (the row's prompt of an episode
        whose environment failed to reset, an error to come) are rendered and tokenised as `encode` does."""
        given = []
        for prompt in prompts:
            if isinstance(prompt, TokenIds):
                if self.max_length is not None and len(prompt) > self.max_length:
                    raise ValueError(
                        f"an environment's prompt has {len(prompt)} tokens, more than model.sampling.max_prompt_length "
                        f"({self.max_length}): raise it (a prompt rendered by the environment cannot be cut)"
                    )
                given.append(list(prompt))
            else:
                text = self.format(prompt, tools)
                ids = self.tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
                given.append(ids[-self.max_length :] if self.max_length else ids)
        return left_padded(given, self.tokenizer.pad_token_id, device)


def left_padded(
    contexts: Sequence[list[int]], pad_id: int, device: Optional[torch.device]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> left-padded ids [N, L] and their mask, on `device` (None: the CPU)."""
    width = max(len(ids) for ids in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    return ids.to(device), mask.to(device)


def _tools_key(tools: Optional[list[dict]]) -> str:
    """Equal keys for equal tool schemas (a prompt is rendered once per set of tools it is offered)."""
    return json.dumps(tools, sort_keys=True, default=str)


def _prompt_key(prompt: Any, row: int) -> tuple:
    """Equal keys for equal prompts: text as itself, chat messages as their JSON; a prompt JSON cannot encode
    exactly gets a key of its own (no sharing for it)."""
    if isinstance(prompt, str):
        return ("text", prompt)
    try:
        return ("chat", json.dumps(prompt, sort_keys=True))
    except (TypeError, ValueError):
        return ("row", row)


def check_chat_template(tokenizer: Any) -> None:
    """A one-line `ConfigError` for chat-format rows (lists of messages) when the tokenizer has no chat template
    (transformers' ValueError came as a traceback through the data module or the first step)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConfigError(
            f"the data's prompts are chat messages, but the tokenizer of {tokenizer.name_or_path!r} has no chat "
            "template to render them (chat_template.jinja or tokenizer_config.json's chat_template): use a model "
            "with one, or text prompts"
        )
