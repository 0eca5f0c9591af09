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
whatever the number of ranks. Pure python.
"""

from __future__ import annotations


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
