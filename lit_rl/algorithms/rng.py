"""The random state a rollout algorithm's checkpoint keeps per rank: what sampling draws from."""

from __future__ import annotations

from typing import Any

import torch


def rng_state(device: torch.device) -> dict[str, Any]:
    """CPU and (on GPU) this device's RNG state: what sampling draws from."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())
