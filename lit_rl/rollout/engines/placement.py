"""Where each trainer rank's colocated vLLM engine lives, and which ranks serve one engine together.

Colocated engines are built with vLLM's `external_launcher` executor: one vLLM worker in the trainer's own
process, on `cuda:LOCAL_RANK`, inside the trainer's `torch.distributed` world (vLLM reuses the default process
group when it is initialised; `initialize_model_parallel` cuts it into contiguous tensor-parallel blocks). With
`tensor_parallel_size = t`, ranks `[g*t, ..., g*t + t - 1]` form TP group `g` and run one engine between them:
every member generates the group's prompts together (vLLM's TP workers must be fed the same requests) and keeps
its own rows of the result. With `t = 1` every rank has an engine of its own.

(vLLM's default single-process executor takes its device index from the device string, which is a bare `cuda`,
so every rank's engine would land on GPU 0: the failure this module exists to prevent.)

Plain data and arithmetic: importing it imports no vLLM, so tests check the placement of rank r of W on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_rl.errors import ConfigError

EXECUTOR = "external_launcher"


@dataclass(frozen=True)
class EnginePlacement:
    """The colocated engine of global rank `rank` (of `world_size`), local rank `local_rank` on its node.

    Args:
        rank: global rank of the trainer process.
        local_rank: rank on its node, i.e. the index of its GPU.
        world_size: number of trainer processes.
        local_world_size: trainer processes on each node.
        tensor_parallel_size: consecutive ranks that serve one engine.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    tensor_parallel_size: int = 1

    @classmethod
    def of(cls, trainer: Any, tensor_parallel_size: int = 1) -> "EnginePlacement":
        """The placement of `trainer`'s rank (a Lightning Trainer: its ranks and devices per node)."""
        return cls(
            rank=trainer.global_rank,
            local_rank=trainer.local_rank,
            world_size=trainer.world_size,
            local_world_size=trainer.num_devices,
            tensor_parallel_size=tensor_parallel_size,
        )

    def __post_init__(self) -> None:
        t = self.tensor_parallel_size
        if t < 1:
            raise ConfigError(f"model.rollout.engine.tensor_parallel_size must be >= 1, got {t}")
        if self.world_size % t != 0:
            raise ConfigError(
                f"model.rollout.engine.tensor_parallel_size={t} must divide the {self.world_size} trainer ranks "
                "(consecutive ranks form one tensor-parallel engine)"
            )
        if self.local_world_size % t != 0:
            raise ConfigError(
                f"model.rollout.engine.tensor_parallel_size={t} must divide the {self.local_world_size} ranks "
                "per node: "
                "a tensor-parallel engine cannot span nodes"
            )
        if not 0 <= self.rank < self.world_size or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"rank {self.rank} / local rank {self.local_rank} outside the world {self}")

    @property
    def tp_group(self) -> int:
        """Index of the engine this rank belongs to."""
        return self.rank // self.tensor_parallel_size

    @property
    def tp_rank(self) -> int:
        """This rank's place within its engine's TP group."""
        return self.rank % self.tensor_parallel_size

    def all_tp_groups(self) -> list[list[int]]:
        """Every engine's ranks, in order: what `torch.distributed.new_subgroups_by_enumeration` needs."""
        t = self.tensor_parallel_size
        return [list(range(start, start + t)) for start in range(0, self.world_size, t)]

    @property
    def engine_seed(self) -> int:
        """vLLM's base seed: the same for the members of one TP group, which must sample identically. (Every
        training completion also carries a seed of its own, which is what decides its sample.)"""
        return self.tp_group

    def environment(self, master_addr: str, master_port: int) -> dict[str, str]:
        """The variables `external_launcher` reads (`RANK`, `LOCAL_RANK`; `MASTER_ADDR` and `MASTER_PORT` matter
        only when no process group exists yet, i.e. a single-process run, where vLLM creates one of size 1)."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }


def tp_slice(sizes: list[int], tp_rank: int) -> slice:
    """This member's rows in the concatenation of its TP group's requests, whose members sent `sizes` rows each."""
    start = sum(sizes[:tp_rank])
    return slice(start, start + sizes[tp_rank])
