"""Scoring completions with several reward functions: one column per function, then their weighted sum."""

from __future__ import annotations

from typing import Any, Optional

import torch

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import (
    NOT_PASSED_COLUMNS,
    RewardFunction,
    TrainerState,
    as_messages,
    call_reward_functions,
    is_conversational,
)


def reward_components(
    reward_fns: dict[str, RewardFunction],
    rows: list[dict[str, Any]],
    completions: list[str],
    repeat: int,
    device: torch.device,
    completion_ids: Optional[list[list[int]]] = None,
    trainer_state: Optional[TrainerState] = None,
    environments: Optional[list[Any]] = None,
) -> torch.Tensor:
    """Reward components [N, F] (one column per reward function) of `completions` [N] of `rows` repeated `repeat`
    times, the functions called with TRL's keywords (`lit_rl.rewards`): message completions for chat prompts,
    `completion_ids`, `trainer_state`, `environments` (episodes' environments, when there are), and every column of
    the rows but `NOT_PASSED_COLUMNS`."""
    prompts = [row["prompt"] for row in rows for _ in range(repeat)]
    columns = {
        key: [row.get(key) for row in rows for _ in range(repeat)] for key in rows[0] if key not in NOT_PASSED_COLUMNS
    }
    columns["completion_ids"] = completion_ids
    columns["trainer_state"] = trainer_state
    if environments is not None:
        columns["environments"] = environments
    passed: list[Any] = as_messages(completions) if prompts and is_conversational(prompts[0]) else completions
    values = call_reward_functions(reward_fns, prompts, passed, columns)
    if not reward_fns:  # an environment's reward parts alone
        return torch.zeros(len(completions), 0, device=device)
    return torch.tensor(values, dtype=torch.float32, device=device).T.reshape(len(completions), -1)


def weighted_reward(
    components: torch.Tensor, weights: torch.Tensor, names: list[str], invalid_reward: str = "zero"
) -> torch.Tensor:
    """[N, F] -> [N]: `sum_f weights[f] * components[:, f]`.

    An invalid value (NaN, inf, or None from the function) counts as 0 with `model.rewards.on_invalid: zero` (the
    default; `frac_invalid_reward` counts them) and stops the run, naming the function (`names[f]`), with `error`.
    """
    invalid = ~torch.isfinite(components)
    if invalid.any() and invalid_reward == "error":
        row, column = (int(i) for i in invalid.nonzero()[0])
        raise RewardFunctionError(
            f"reward function {names[column]!r} returned {components[row, column].item()} for completion {row} "
            "(set model.rewards.on_invalid: zero to count invalid rewards as 0)"
        )
    return (torch.where(invalid, torch.zeros_like(components), components) * weights.to(components)).sum(dim=1)
