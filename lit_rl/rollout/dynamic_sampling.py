"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2): groups whose rewards all agree teach nothing
(their advantages are all zero), so they are dropped and more prompts are sampled until the step's batch is full.

With `model.rollout.dynamic_sampling` (GRPO), a generation of P prompts x G completions is sampled as usual; its
groups with zero reward std (over the group's G completions, gathered from every rank) are dropped; while fewer than
P groups are left, a refill generation samples P more prompts (at most `model.rollout.max_refill_generations` of
them). The batch is then the first P groups kept, in order (the generation's own, then each refill's); when the
refills run out first, the earliest dropped groups fill the rest (zero advantages: no gradient) and the step trains
on fewer informative groups, which `train/frac_groups_dropped` and `train/refill_generations` show.

Everything is a pure function of the run's seed, the generation and the refill index: the refill prompts
and their sampling seeds (`lit_rl.data.schedule.refill_seed_key`) are, so a resumed run samples the same
refills, the schedule of micro-steps and the checkpoint cadence do not change, and the chosen batch is the same
whatever the number of ranks. `select_groups` and `rows_for_rank` are pure python; `DynamicSampling` is the
producer that does it, around another (`lit_rl.rollout.producer`).

With asynchronous rollouts (`model.rollout.max_staleness = k > 0`) the generation was sampled ahead, by the weights
of its version v(g) (`lit_rl.rollout.asynchronous`), and judged when it is taken; its refills are sampled then, by
the current weights (whose version is the step's: their rows' staleness starts at 0, and each row keeps its own
version). The module takes such a generation before it launches the later ones of that step, so the refills wait
only for the generations already in flight, not for the next one. The price is on every step: the next generation
is staged and submitted after this one is taken, scored and judged, not while it is still sampling; and a step
with refills pushes the weights twice (for the refills, then staged for the next generation). Sampling the refills
by the weights of v(g) instead would mean keeping every version a refill might need. The refills' prompts and seeds
are as in the synchronous schedule, so a resumed run still equals the uninterrupted one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from lit_rl.data.schedule import refill_seed_key
from lit_rl.rollout.base import RolloutOutput, SamplingParams
from lit_rl.rollout.producer import GroupFilterStats, RolloutProducer, ScoredCompletions
from lit_rl.training.rank_balance import concat_batches, exchange_rows
from lit_rl.types import RolloutBatch

ZERO_STD = 1e-6  # a group's rewards whose std is below this all agree


def select_groups(keep: list[bool], needed: int) -> list[int]:
    """The groups that make the batch: the first `needed` groups with `keep`, in order, then (when too few are
    kept) the earliest groups without it. Indices into `keep`, in the batch's order."""
    kept = [g for g, k in enumerate(keep) if k][:needed]
    if len(kept) < needed:
        kept += [g for g, k in enumerate(keep) if not k][: needed - len(kept)]
    if len(kept) < needed:
        raise ValueError(f"{len(keep)} groups cannot fill a batch of {needed}")
    return kept


def rows_for_rank(
    groups: list[int], group_size: int, per_rank: int, world: int, rank: int, generations: int
) -> list[int]:
    """Where rank `rank`'s rows of the chosen batch are in the gathered pool of candidates.

    Each rank's pool holds, generation after generation (the original, then each refill), its `per_rank` rows of
    that generation: global slot `s` of generation `k` is on rank `s // per_rank` at local row
    `k * per_rank + s % per_rank`, so it sits at `(s // per_rank) * generations * per_rank + k * per_rank +
    s % per_rank` of the ranks' pools stacked rank after rank. Candidate group `j` is group `j % P` of generation
    `j // P`, P = world * per_rank / group_size. The batch's slot `t` is member `t % G` of `groups[t // G]`;
    rank `rank` takes slots `rank * per_rank ...`."""
    prompts = world * per_rank // group_size
    rows = []
    for t in range(rank * per_rank, (rank + 1) * per_rank):
        generation, group = divmod(groups[t // group_size], prompts)
        slot = group * group_size + t % group_size
        owner, local = divmod(slot, per_rank)
        rows.append(owner * generations * per_rank + generation * per_rank + local)
    return rows


class DynamicSampling:
    """A producer's generations, with the groups whose rewards all agree replaced by refills (module
    docstring). Everything but `generation` is the wrapped producer's.

    Args:
        inner: the producer that samples (synchronous or asynchronous, single completions or episodes).
        group_size: `model.sampling.num_generations`.
        shape_rewards: the algorithm's reward shaping, (rewards [N], completions) -> rewards [N]: groups are
            judged on the rewards their advantages will be computed from.
        refills_offered: `model.rollout.max_refill_generations`: the refill generations the loader offers with
            each generation (their prompt rows; `lit_rl.data.schedule`).
    """

    samples_when_taken = True  # its refills

    def __init__(
        self,
        inner: RolloutProducer,
        group_size: int,
        shape_rewards: Callable[[torch.Tensor, RolloutOutput], torch.Tensor],
        refills_offered: int = 0,
    ) -> None:
        self.inner = inner
        self.group_size = group_size
        self.shape_rewards = shape_rewards
        self.refills_offered = refills_offered

    def generation(
        self, generation: int, rows: list[dict[str, Any]], refills: Optional[list[list[dict[str, Any]]]] = None
    ) -> ScoredCompletions:
        """The generation's informative groups (reward std > 0), topped up from the refill generations the loader
        offers (`refills`: their prompt rows, one list per refill), with how many refills it took and the fraction
        of the groups sampled that were dropped."""
        inner, host = self.inner, self.inner.host
        G, n, world = self.group_size, len(rows), host.trainer.world_size
        prompts = n * world // G
        first = inner.generation(generation, rows)
        pieces, keep = [first], self._informative_groups(first)
        for refill, refill_rows in enumerate(refills or [], start=1):
            if sum(keep) >= prompts:
                break
            seeds = inner.completion_seeds(n, refill_seed_key(generation, refill))
            pieces.append(inner.sample(refill_rows, 1, inner.params, seeds))
            keep += self._informative_groups(pieces[-1])
        stats = GroupFilterStats(len(pieces) - 1, 1.0 - sum(keep) / len(keep))
        groups = select_groups(keep, prompts)
        if groups == list(range(prompts)):  # the generation as sampled: nothing to move
            return replace(first, group_filter=stats)
        pad = host.tokenizer.pad_token_id
        tagged = any(piece.output.token_versions is not None for piece in pieces)  # in flight: on every rank alike
        pool = concat_batches([_as_rollout_batch(piece, tagged) for piece in pieces], pad)
        rows_here = rows_for_rank(groups, G, n, world, host.trainer.global_rank, len(pieces))
        chosen = exchange_rows(pool, rows_here, host.gather_stacked, pad)
        output = RolloutOutput(
            chosen.completion_ids,
            chosen.completion_mask,
            chosen.rollout_logprobs,
            sampled_mask=chosen.sampled_mask,  # multi-turn: the episodes' model tokens and statistics move along
            episode_stats=chosen.episode_stats,
            token_versions=chosen.token_versions,
        )
        return ScoredCompletions(
            chosen.prompt_ids,
            chosen.prompt_mask,
            output,
            chosen.reward_components,
            chosen.rewards,
            chosen.policy_version,  # refills under asynchronous rollouts have newer versions than the generation
            group_filter=stats,
        )

    def _informative_groups(self, piece: ScoredCompletions) -> list[bool]:
        """Which of a generation's groups (all ranks', in order) have rewards that differ, after reward shaping:
        the others would get zero advantages."""
        rewards = self.shape_rewards(piece.rewards, piece.output)
        all_rewards = self.inner.host.all_gather(rewards).reshape(-1)  # [world * n]
        return (all_rewards.view(-1, self.group_size).std(dim=1) > ZERO_STD).tolist()

    # -- the rest is the wrapped producer's --------------------------------------------------------------------
    @property
    def reward_names(self) -> list[str]:
        return self.inner.reward_names

    @property
    def completion_budget(self) -> int:
        return self.inner.completion_budget

    def launch(self, generation: int, rows: list[dict[str, Any]]) -> None:
        self.inner.launch(generation, rows)

    def sample(
        self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams, seeds: Optional[list[int]] = None
    ) -> ScoredCompletions:
        return self.inner.sample(rows, repeat, params, seeds)

    def release(self) -> None:
        self.inner.release()

    def before_validation(self) -> None:
        self.inner.before_validation()

    def state_dict(self) -> Optional[list[dict[str, Any]]]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Optional[list[dict[str, Any]]]) -> None:
        self.inner.load_state_dict(state)

    def close(self) -> None:
        self.inner.close()


def _as_rollout_batch(piece: ScoredCompletions, token_versions: bool = False) -> RolloutBatch:
    """Scored completions as a RolloutBatch (advantages and statistics to come), so that their rows can move."""
    out, zeros = piece.output, torch.zeros_like(piece.rewards)
    return RolloutBatch(
        piece.prompt_ids,
        piece.prompt_mask,
        out.completion_ids,
        out.completion_mask,
        out.logprobs,
        piece.rewards,
        piece.reward_components,
        zeros,
        zeros,
        sampled_mask=out.sampled_mask,
        episode_stats=out.episode_stats,
        policy_version=piece.row_versions(),
        token_versions=piece.token_versions() if token_versions else None,
    )
