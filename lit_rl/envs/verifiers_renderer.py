"""The renderer lit-rl gives verifiers' training client (`renderers`' custom renderer, by import path): the
tokenizer's chat template renders a conversation's first turn, as verifiers' default renderer does, and every later
turn extends the ids already sampled instead of rendering the conversation again.

verifiers' default renderer does not bridge turns (its `bridge_to_next_turn` returns None): from the second turn on
it renders the whole conversation anew, and a template that does not give back the sampled ids exactly (one that
drops the sampled end-of-turn token, or tokenises the reply's text otherwise than the model sampled it) changes the
history under the model. Here the next turn's prompt is the previous prompt, the sampled ids, and the new messages
as lit-rl renders what follows a model turn (`lit_rl.envs.chat_tools.ChatRenderer`, the same as for its own chat
tools): the episode's context only grows, token-in and token-out.
"""

from __future__ import annotations

from typing import Any, Optional

from renderers import DefaultRendererConfig, RenderedTokens
from renderers.default import DefaultRenderer

from lit_rl.envs.chat_tools import ChatRenderer

IMPORT_PATH = "lit_rl.envs.verifiers_renderer.ChatTemplateBridge"


class ChatTemplateBridge(DefaultRenderer):
    """verifiers' default renderer (the chat template), with turns after the first appended to the sampled ids
    (module docstring)."""

    config_class = DefaultRendererConfig

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: Optional[list[Any]] = None,
    ) -> Optional[RenderedTokens]:
        """`previous_prompt_ids + previous_completion_ids`, then `new_messages` as the chat template renders them
        after a model turn, then its generation prompt. None (verifiers renders the conversation anew) when the new
        messages hold an assistant's: its text would be tokenised again."""
        if any(message.get("role") == "assistant" for message in new_messages):
            return None
        # The tools and the template's variables as the first turn's render gave them (what follows a turn may
        # depend on them: Qwen3's generation prompt on enable_thinking)
        template_kwargs = dict(self.config.model_extra or {})
        after_turn = ChatRenderer(self._tokenizer, list(tools) if tools else None, template_kwargs)
        added, owners = after_turn.attributed_observation(list(new_messages), previous_completion_ids)
        prior = [*previous_prompt_ids, *previous_completion_ids]
        return RenderedTokens(
            token_ids=[*prior, *added],
            message_indices=[-1] * len(prior) + owners,  # the prior's: -1, as renderers' bridges give it
            message_roles=[message.get("role") or "" for message in new_messages],
        )
