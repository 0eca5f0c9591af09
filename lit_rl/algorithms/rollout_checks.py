"""Checks of the rollout algorithms' settings, made before anything heavy starts, each naming the offending key."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lit_rl.data.contracts import PromptRows, data_of
from lit_rl.data.files import record_label
from lit_rl.envs.chat_tools import chat_prompt
from lit_rl.envs.trl_environments import ROUTING_COLUMN
from lit_rl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from lit_rl.algorithms.on_policy import OnPolicyModule


def check_environment_column(routing: Any, datamodule: Any) -> None:
    """With several environments by name (`lit_rl.envs.trl_environments.EnvironmentRouting`): fail before training
    when a row's `environment` column names none of them, naming the row."""
    for source, rows in ((datamodule.train_data, datamodule.train_rows), (datamodule.val_data, datamodule.val_rows)):
        for index, row in enumerate(rows):
            name = row.get(ROUTING_COLUMN)
            if not routing.names_one(name):
                raise DataError(f"{source}: {record_label(source, index)} {routing.unknown(name)}")


def check_prompt_lengths(module: OnPolicyModule) -> None:
    """Fail before training when a prompt plus the completion budget (`max_new_tokens`, or with an environment
    `max_total_tokens`) cannot fit the model's context (`module`: an on-policy algorithm with its trainer and
    datamodule attached). With several environments by name, each row must name one (`check_environment_column`)
    and its prompt is measured with its environment's tools."""
    datamodule = data_of(module, PromptRows)
    routing = module.prompt_routing
    if routing is not None:
        check_environment_column(routing, datamodule)
    context = getattr(module.policy.config, "max_position_embeddings", None)
    max_prompt_length = module.prompt_encoder.max_length
    budget = module.completion_budget
    budget_key = "env.max_total_tokens" if module.env_args.enabled else "sampling.max_new_tokens"
    tools = module.prompt_tools  # the prompts are rendered with these schemas (chat-format tools)
    if context is None and (max_prompt_length is None or tools is None):
        return  # no context to fit, and no schemas a limit would cut
    if max_prompt_length is not None:
        if context is not None and max_prompt_length + budget > context:
            raise ConfigError(
                f"model.sampling.max_prompt_length ({max_prompt_length}) + model.{budget_key} ({budget}) "
                f"exceeds the model's context of {context} tokens"
            )
        if tools is None:
            return
    if context is not None and budget >= context:  # no prompt can fit: only the budget can help
        raise ConfigError(
            f"model.{budget_key} ({budget}) leaves no room for a prompt in the model's context of {context} "
            f"tokens: lower it below {context}"
        )
    for source, rows in (
        (datamodule.train_data, datamodule.train_rows),
        (datamodule.val_data, datamodule.val_rows),
    ):
        for start in range(0, len(rows), 1024):
            chunk = rows[start : start + 1024]
            prompts = [row["prompt"] if tools is None else chat_prompt(row["prompt"]) for row in chunk]
            row_tools = [tools] * len(chunk) if routing is None else routing.prompt_tools(chunk)
            texts = [module.prompt_encoder.format(p, t) for p, t in zip(prompts, row_tools)]
            lengths = [len(ids) for ids in module.tokenizer(texts)["input_ids"]]
            for offset, length in enumerate(lengths):
                if max_prompt_length is not None:  # with tools: truncation would cut the schemas, at the start
                    if length > max_prompt_length:
                        raise DataError(
                            f"{source}: {record_label(source, start + offset)} has a prompt of {length} tokens with "
                            f"the tools' schemas; model.sampling.max_prompt_length={max_prompt_length} would cut it "
                            "from its start, schemas first: raise it, or set it to null"
                        )
                    continue
                if length + budget > context:
                    raise DataError(
                        f"{source}: {record_label(source, start + offset)} has a prompt of {length} tokens; with "
                        f"model.{budget_key}={budget} it exceeds the model's context of {context} tokens "
                        f"({_what_would_fit(length, budget, budget_key, context, tools is not None)})"
                    )


def _what_would_fit(length: int, budget: int, budget_key: str, context: int, tools: bool = False) -> str:
    """The settings that would make a prompt of `length` tokens and a completion budget of `budget` fit `context`:
    the budget, and truncating prompts when that leaves a prompt room to keep (never with tools: it would cut their
    schemas); a prompt that alone fills the context, only shorter prompts or a longer context."""
    truncate = f"set model.sampling.max_prompt_length to at most {context - budget} to truncate prompts"
    if length >= context:
        fits = "the prompt alone fills the context: shorten the prompts or use a model with a longer context"
        return fits if tools else f"{fits}, or {truncate}"
    smaller_budget = f"lower model.{budget_key} to at most {context - length}"
    if budget > context // 2 or tools:  # truncating would keep little of the prompt, or cut the tools' schemas
        return smaller_budget
    return f"{smaller_budget}, or {truncate}"
