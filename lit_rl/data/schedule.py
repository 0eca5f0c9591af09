"""The training loader of rollout algorithms: one item per `training_step` call (a micro-step).

A generation is followed by `micro_steps_per_generation` micro-steps over its buffer (all micro-batches,
`num_iterations` times). Item `i` is micro-step `i` of the run; it carries the prompts of generation
`i // micro_steps_per_generation` when it is that generation's first micro-step, and nothing otherwise.

Everything an item holds is a pure function of `i`, the seed and the rank, and the loader starts at the
algorithm's own counter of micro-steps done (restored from the checkpoint with the module). So Lightning's
prefetching cannot shift it and a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

from lit_rl.data.files import Row
from lit_rl.data.sharding import epoch_order
from lit_rl.errors import DataError


@dataclass(frozen=True)
class RolloutSchedule:
    """What an algorithm tells the loader: prompts per rank per generation, micro-steps per generation, and a
    callable returning how many micro-steps the run has done (the algorithm's checkpointed counter)."""

    prompts_per_rank: int
    micro_steps_per_generation: int
    start_micro_step: Callable[[], int]


class RolloutScheduleLoader:
    def __init__(self, rows: list[Row], schedule: RolloutSchedule, seed: int, rank: int, world_size: int) -> None:
        self.rows = rows
        self.prompts_per_rank = schedule.prompts_per_rank
        self.micro_steps_per_generation = schedule.micro_steps_per_generation
        self.start_micro_step = schedule.start_micro_step
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        prompts_per_rank = self.prompts_per_rank
        prompts_per_generation = prompts_per_rank * world_size
        self.generations_per_epoch = len(rows) // prompts_per_generation
        if self.generations_per_epoch == 0:
            raise DataError(
                f"the training data has {len(rows)} prompts, fewer than one generation batch "
                f"({prompts_per_rank} prompts per rank x {world_size} ranks)"
            )
        self._permutations: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Micro-steps per epoch (one epoch = one pass over the prompts, the last partial batch dropped)."""
        return self.generations_per_epoch * self.micro_steps_per_generation

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            self._permutations = {epoch: epoch_order(len(self.rows), self.seed, epoch)}
        return self._permutations[epoch]

    def prompts_of_generation(self, generation: int) -> list[Row]:
        """This rank's prompts of generation `generation` (consecutive slices of the epoch's permutation)."""
        epoch, within = divmod(generation, self.generations_per_epoch)
        global_start = within * self.prompts_per_rank * self.world_size
        start = global_start + self.rank * self.prompts_per_rank
        order = self._permutation(epoch)
        return [self.rows[i] for i in order[start : start + self.prompts_per_rank]]

    def item(self, micro_step: int) -> dict[str, Any]:
        generation, within = divmod(micro_step, self.micro_steps_per_generation)
        rows = self.prompts_of_generation(generation) if within == 0 else []
        return {"micro_step": micro_step, "rows": rows}

    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self.start_micro_step()
        epoch_end = (start // len(self) + 1) * len(self)
        for micro_step in range(start, epoch_end):
            yield self.item(micro_step)

    # Lightning treats loaders with these two methods as resumable. The position lives in the algorithm's
    # checkpointed micro-step counter (read by `__iter__`), so there is nothing else to save or load here.
    def state_dict(self) -> dict[str, int]:
        return {"start_micro_step": self.start_micro_step()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass
