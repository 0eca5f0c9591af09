"""Checks of the rollout algorithms' settings, made before anything heavy starts, each naming the offending key."""

from __future__ import annotations

import math
from typing import Any, Optional

from lit_rl.data.files import record_label
from lit_rl.errors import ConfigError, DataError
from lit_rl.rollout import VLLMConfig


def check_max_staleness(max_staleness: int, vllm: Optional[VLLMConfig]) -> None:
    """Asynchronous rollouts need an engine that samples beside the trainer: today the vLLM server."""
    if max_staleness < 0:
        raise ConfigError(f"model.max_staleness must be >= 0, got {max_staleness}")
    if max_staleness == 0:
        return
    if vllm is None:
        raise ConfigError(
            "model.max_staleness > 0 needs an engine that samples in the background; HF generate samples from the "
            "policy being trained: set model.vllm.mode: server (configs/rollout/vllm_server.yaml)"
        )
    if vllm.mode != "server":
        raise ConfigError(
            f"model.max_staleness > 0 is not supported with model.vllm.mode: {vllm.mode} yet (the engine shares "
            "the trainer's process and device): use model.vllm.mode: server (configs/rollout/vllm_server.yaml)"
        )


def check_rollout_args(args: dict[str, Any], min_generations: int = 2) -> None:
    """Reject impossible rollout settings at construction, naming the offending key (`min_generations`: 2 where
    completions of a prompt are compared, 1 where a critic is the baseline)."""
    positive = ("num_generations", "micro_batch_size", "steps_per_generation", "num_iterations", "max_new_tokens")
    for key in positive:
        if args[key] < 1:
            raise ConfigError(f"model.{key} must be >= 1, got {args[key]}")
    if args["num_generations"] < min_generations:
        raise ConfigError(
            f"model.num_generations must be >= {min_generations} (completions of a prompt are compared), "
            f"got {args['num_generations']}"
        )
    if args["temperature"] <= 0 or not math.isfinite(args["temperature"]):
        raise ConfigError(f"model.temperature must be > 0 for training rollouts, got {args['temperature']}")
    if args.get("invalid_reward", "zero") not in ("zero", "error"):
        raise ConfigError(f"model.invalid_reward must be 'zero' or 'error', got {args['invalid_reward']!r}")
    if args.get("beta", 0.0) < 0:
        raise ConfigError(f"model.beta must be >= 0, got {args['beta']}")
    if not 0 <= args.get("min_new_tokens", 0) <= args["max_new_tokens"]:
        raise ConfigError(
            f"model.min_new_tokens must be in [0, max_new_tokens={args['max_new_tokens']}], "
            f"got {args['min_new_tokens']}"
        )
    if args.get("micro_batch_tokens") is not None and args["micro_batch_tokens"] < 1:
        raise ConfigError(f"model.micro_batch_tokens must be >= 1 (or null), got {args['micro_batch_tokens']}")


def check_prompt_lengths(module: Any) -> None:
    """Fail before training when a prompt plus the completion budget (`max_new_tokens`, or with an environment
    `max_total_tokens`) cannot fit the model's context (`module`: an on-policy algorithm with its trainer and
    datamodule attached)."""
    context = getattr(module.policy.config, "max_position_embeddings", None)
    if context is None:
        return
    hp, datamodule = module.hparams, module.trainer.datamodule
    budget = module.completion_budget
    budget_key = "max_total_tokens" if module.env_factory is not None else "max_new_tokens"
    if hp.max_prompt_length is not None:
        if hp.max_prompt_length + budget > context:
            raise ConfigError(
                f"model.max_prompt_length ({hp.max_prompt_length}) + model.{budget_key} ({budget}) "
                f"exceeds the model's context of {context} tokens"
            )
        return
    for source, rows in (
        (datamodule.train_data, datamodule.train_rows),
        (datamodule.val_data, datamodule.val_rows),
    ):
        for start in range(0, len(rows), 1024):
            chunk = rows[start : start + 1024]
            prompts = [row["prompt"] for row in chunk]
            lengths = [len(ids) for ids in module.tokenizer([module.format_prompt(p) for p in prompts])["input_ids"]]
            for offset, length in enumerate(lengths):
                if length + budget > context:
                    raise DataError(
                        f"{source}: {record_label(source, start + offset)} has a prompt of {length} tokens; with "
                        f"model.{budget_key}={budget} it exceeds the model's context of {context} "
                        "tokens (set model.max_prompt_length to truncate prompts)"
                    )
