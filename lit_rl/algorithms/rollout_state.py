"""What a checkpoint of a rollout algorithm keeps beyond the model's (`lit_rl.algorithms.checkpoint_state`): per
rank, the rollout buffer being trained on, its loss denominators, the random state sampling draws from and the
generations launched ahead; and the micro-steps done, from which the schedule continues. A resumed run then trains
on the same rows with the same denominators, and samples what an uninterrupted run would have."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from lit_rl.algorithms.base import PolicyModule
from lit_rl.errors import ConfigError
from lit_rl.losses import LossNormalizer
from lit_rl.rollout.producer import RolloutProducer
from lit_rl.types import RolloutBatch


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


class RolloutState(PolicyModule):
    """The checkpoint hooks of `OnPolicyModule` (its base): the attributes below are set in its `__init__`."""

    producer: RolloutProducer
    batch_type: type[RolloutBatch]
    _micro_steps_done: int
    _buffer: Optional[RolloutBatch]
    _normalizers: list[LossNormalizer]
    loss_mask: Callable[[RolloutBatch], torch.Tensor]  # the algorithm's (`OnPolicyModule.loss_mask`)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # without the reference model
        # Every rank has its own buffer and RNG stream, but only rank 0 writes the file: gather them all.
        local = {
            "buffer": None if self._buffer is None else self._buffer.state_dict(),
            "normalizers": [vars(n) for n in self._normalizers],
            "rng": rng_state(self.device),
            # Generations launched ahead, finished (waited for): their weights are not in the checkpoint.
            "pending": self.producer.state_dict(),
        }
        per_rank = [local]
        if self.trainer.world_size > 1:
            per_rank = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(per_rank, local)
        checkpoint["lit_rl"] = {"micro_steps_done": self._micro_steps_done, "per_rank": per_rank}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        state = checkpoint.get("lit_rl")
        if state is None:
            return
        per_rank = state["per_rank"]
        if len(per_rank) != self.trainer.world_size:
            raise ConfigError(
                f"checkpoint was written by {len(per_rank)} ranks, this run has {self.trainer.world_size}: "
                "rollout algorithms resume their buffer per rank, so resume with the same number of devices"
            )
        mine = per_rank[self.global_rank]
        self._micro_steps_done = state["micro_steps_done"]
        # Kept on CPU here: the module is moved to its device after this hook; training_step moves it.
        self._buffer = None if mine["buffer"] is None else self.batch_type.from_state_dict(mine["buffer"])
        if self._buffer is not None and self._buffer.loss_mask is None:  # written before the batch kept its mask
            self._buffer.loss_mask = self.loss_mask(self._buffer)
        self._normalizers = [LossNormalizer(**n) for n in mine["normalizers"]]
        set_rng_state(mine["rng"])
        self.producer.load_state_dict(mine.get("pending"))
