"""What the rollout parts (the engine owner, the producers, an engine config's `build`) use of the module that
holds them: the whole interface, so that no part reads its host's attributes by convention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch

if TYPE_CHECKING:  # annotations only: the rollout parts import no Lightning, config or timers through this file
    import lightning as L
    from transformers import PreTrainedTokenizerBase

    from lit_rl.config import PolicyArgs
    from lit_rl.training.perf import BusyClock, StepTimer


class RolloutHost(Protocol):
    """The on-policy `LightningModule` that trains the policy (`lit_rl.algorithms.on_policy.OnPolicyModule`)."""

    trainer: L.Trainer  # ranks, devices, global_step, max_steps, current_epoch, strategy, log_dir
    device: torch.device
    policy: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    policy_args: PolicyArgs  # `model.policy`: the model's path, `trust_remote_code`
    timer: StepTimer  # read at each use (validation swaps it)
    engine_clock: BusyClock  # the module's: an engine's requests are counted on it

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
