"""What the rollout parts (the engine owner, the producers, an engine config's `build`) use of the module that
holds them: the whole interface, so that no part reads its host's attributes by convention."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class RolloutHost(Protocol):
    """The on-policy `LightningModule` that trains the policy (`lit_rl.algorithms.on_policy.OnPolicyModule`)."""

    trainer: Any  # the Lightning Trainer: ranks, devices, global_step, max_steps, current_epoch, strategy
    device: torch.device
    policy: torch.nn.Module
    tokenizer: Any
    policy_args: Any  # `model.policy` (`lit_rl.config.PolicyArgs`): the model's path, `trust_remote_code`
    timer: Any  # `lit_rl.training.perf.StepTimer`: read at each use (validation swaps it)
    engine_clock: Any  # `lit_rl.training.perf.BusyClock`: the module's, an engine's requests counted on it

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (Lightning's `all_gather`)."""

    def gather_stacked(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked: [world, ...] (also with one rank)."""

    def compute_dtype(self) -> torch.dtype:
        """The dtype the trainer computes in."""

    def attached_strategy(self) -> Optional[Any]:
        """The trainer's strategy, or None for a module used on its own (tests, export)."""

    def parameters_sharded(self) -> bool:
        """Whether the policy's parameters are sharded over ranks (ZeRO-3, FSDP)."""
