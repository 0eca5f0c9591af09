"""The training loader of rollout algorithms: one item per `training_step` call (a micro-step).

A generation is followed by `micro_steps_per_generation` micro-steps over its buffer (all micro-batches,
`num_iterations` times). Item `i` (a `ScheduledMicroStep`) is micro-step `i` of the run; it carries, on the first
micro-step of generation `i // micro_steps_per_generation`, one prompt row per completion this rank samples, and
nothing otherwise.

A generation's global batch is `P` prompts (a consecutive slice of the epoch's permutation) x `G` completions,
prompt-major: completion slot `s` belongs to prompt `s // G`. Rank `r` takes slots `r*n .. r*n + n - 1`. A group
of G completions may therefore span ranks (when n is not a multiple of G); the algorithm normalises rewards over
the gathered global batch, so the split never changes a group.

With dynamic sampling (`lit_rl.rollout.dynamic_sampling`) the first micro-step of a generation also carries, as
`refills`, the prompt rows of each refill generation it may sample: refill r of generation g takes the first P
prompts of a permutation of its own (`refill_seed_key`), in the same slots.

With asynchronous rollouts the schedule also says which generations to launch ahead (`launches`): the first
micro-step of each optimizer step carries, as `launches`, the rows of every generation launched at that step.

Everything an item holds is a pure function of `i`, the seed and the rank, and the loader starts at the
algorithm's own counter of micro-steps done (restored from the checkpoint with the module). So Lightning's
prefetching cannot shift it and a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from lit_rl.data.files import Row
from lit_rl.data.sharding import epoch_order
from lit_rl.errors import DataError
from lit_rl.seeding import seed_offset

MAX_REFILLS = 63  # refill keys of generation g are 2**31 + 64 g + r, r = 1..63: no two generations share one


def refill_seed_key(generation: int, refill: int) -> int:
    """The key of refill `refill` (1-based) of `generation`, for its prompt permutation and, as the `generation`
    argument of `global_batch_seeds`, its sampling seeds: disjoint from the generations' own keys (below 2**31)
    and from every other refill's."""
    if not 1 <= refill <= MAX_REFILLS:
        raise ValueError(f"refill must be in [1, {MAX_REFILLS}], got {refill}")
    return 2**31 + 64 * generation + refill


@dataclass(frozen=True)
class RolloutSchedule:
    """What an algorithm tells the loader: completions per rank per generation (n), completions per prompt (G),
    micro-steps per generation, and a callable returning how many micro-steps the run has done (the algorithm's
    checkpointed counter). Asynchronous rollouts add the micro-steps of one optimizer step and which generations
    are launched at the start of optimizer step s (`launches(s)`)."""

    completions_per_rank: int
    group_size: int
    micro_steps_per_generation: int
    start_micro_step: Callable[[], int]
    micro_steps_per_optimizer_step: int = 1
    launches: Optional[Callable[[int], list[int]]] = None
    refill_generations: int = 0  # dynamic sampling: the refills a generation may sample at most


@dataclass
class ScheduledMicroStep:
    """One item of the rollout loader: what the algorithm's `training_step` gets (a dataclass: Lightning moves it to
    the device as it is, and it holds no tensor)."""

    micro_step: int  # the run's micro-step this item is for
    rows: list[Row]  # this rank's prompt row of each completion slot on a generation's first micro-step, else []
    refills: Optional[list[list[Row]]] = None  # dynamic sampling, on a generation's first: each refill's rows
    launches: Optional[list[tuple[int, list[Row]]]] = None  # asynchronous rollouts: (generation, rows) to launch now


class RolloutScheduleLoader:
    def __init__(self, rows: list[Row], schedule: RolloutSchedule, seed: int, rank: int, world_size: int) -> None:
        self.rows = rows
        self.completions_per_rank = schedule.completions_per_rank
        self.group_size = schedule.group_size
        self.micro_steps_per_generation = schedule.micro_steps_per_generation
        self.start_micro_step = schedule.start_micro_step
        self.micro_steps_per_optimizer_step = schedule.micro_steps_per_optimizer_step
        self.launches = schedule.launches
        self.refill_generations = schedule.refill_generations
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        completions = self.completions_per_rank * world_size
        if completions % self.group_size:
            raise ValueError(f"{completions} completions per generation are not whole groups of {self.group_size}")
        self.prompts_per_generation = completions // self.group_size
        self.generations_per_epoch = len(rows) // self.prompts_per_generation
        if self.generations_per_epoch == 0:
            raise DataError(
                f"the training data has {len(rows)} prompts, fewer than one generation batch "
                f"({self.prompts_per_generation} prompts: {self.completions_per_rank} completions per rank x "
                f"{world_size} ranks / {self.group_size} per prompt)"
            )
        self._permutations: dict[int, list[int]] = {}

    def __len__(self) -> int:
        """Micro-steps per epoch (one epoch = one pass over the prompts, the last partial batch dropped)."""
        return self.generations_per_epoch * self.micro_steps_per_generation

    def _permutation(self, epoch: int) -> list[int]:
        if epoch not in self._permutations:
            self._permutations = {epoch: epoch_order(len(self.rows), self.seed, epoch)}
        return self._permutations[epoch]

    def rows_of_generation(self, generation: int) -> list[Row]:
        """The prompt row of each of this rank's completion slots in generation `generation` (module docstring)."""
        epoch, within = divmod(generation, self.generations_per_epoch)
        return self._rows_of_slots(self._permutation(epoch)[within * self.prompts_per_generation :])

    def rows_of_refill(self, generation: int, refill: int) -> list[Row]:
        """This rank's prompt rows of refill `refill` of `generation`: P prompts of a permutation of its own."""
        # Shifted by `data.seed`, below 2**32 where torch's generator reads it (`lit_rl.seeding`); seed 0: unshifted.
        key = (refill_seed_key(generation, refill) + seed_offset(self.seed)) % 2**32
        order = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(key)).tolist()
        return self._rows_of_slots(order)

    def _rows_of_slots(self, prompts: list[int]) -> list[Row]:
        """This rank's completion slots of a generation whose prompts are `prompts` (row indices, in order)."""
        first_slot = self.rank * self.completions_per_rank
        slots = range(first_slot, first_slot + self.completions_per_rank)
        return [self.rows[prompts[slot // self.group_size]] for slot in slots]

    def item(self, micro_step: int) -> ScheduledMicroStep:
        generation, within = divmod(micro_step, self.micro_steps_per_generation)
        item = ScheduledMicroStep(micro_step, self.rows_of_generation(generation) if within == 0 else [])
        if self.refill_generations and within == 0:
            item.refills = [self.rows_of_refill(generation, r) for r in range(1, self.refill_generations + 1)]
        if self.launches is not None:
            step, first = divmod(micro_step, self.micro_steps_per_optimizer_step)
            launched = self.launches(step) if first == 0 else []
            item.launches = [(g, self.rows_of_generation(g)) for g in launched]
        return item

    def __iter__(self) -> Iterator[ScheduledMicroStep]:
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
