"""The RolloutEngine interface every generation backend implements, and the capabilities some engines add, each a
protocol of its own that the rollout side checks with `isinstance` (nothing is probed by attribute name)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Protocol, Sequence, runtime_checkable

import torch

from lit_rl.seeding import seed_offset


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled. `temperature == 0` means greedy decoding.

    Log-probs reported by engines are those of the distribution each token was drawn from, the same for every
    engine (vLLM's `processed_logprobs`): the logits with the stop ids masked before `min_new_tokens`, divided by
    `T` and truncated by top-k and top-p (the plain logits when greedy). The trainer recomputes `softmax(logits / T)`:
    the two agree up to rounding without top-k, top-p and `min_new_tokens`; with them the difference is the
    truncation's, which the rollout log-prob metrics show and the importance correction weighs (docs/rollouts.md).
    """

    max_new_tokens: int = 16
    min_new_tokens: int = 0  # the stop ids cannot be sampled before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprob_temperature(self) -> float:
        return 1.0 if self.greedy else self.temperature


@dataclass
class RolloutOutput:
    """Completions of a batch of prompts, right-padded with the pad id."""

    completion_ids: torch.Tensor  # [N, T] long
    completion_mask: torch.Tensor  # [N, T] float, 1 up to and including the first EOS
    logprobs: torch.Tensor  # [N, T] float, the engine's log-probs of the sampled tokens (0 on padding)
    # Multi-turn episodes (`lit_rl.rollout.multi_turn`): 1 on the model's tokens of the transcript (observations 0),
    # and each episode's EPISODE_STATS [N, 5]. None for single-turn completions.
    sampled_mask: Optional[torch.Tensor] = None
    episode_stats: Optional[torch.Tensor] = None
    # In-flight weight updates (`lit_rl.rollout.in_flight`): the policy version that sampled each token [N, T] long
    # (that of the turn it belongs to; observation tokens and padding carry -1). None otherwise: one version per row.
    token_versions: Optional[torch.Tensor] = None


Generate = Callable[..., RolloutOutput]  # generate(prompt_ids, prompt_mask, params, seeds=None), as an engine's


class RolloutEngine(Protocol):
    """Generates completions for token-id prompts and receives the policy's weights after each update.

    `needs_weights` is False for engines that sample from the policy module itself (HF `generate`); the trainer
    then never materialises the weights for them.
    """

    needs_weights: bool

    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        """Sample one completion per row of the left-padded `prompt_ids` [N, P] (repeat rows for groups).

        With `seeds` (one per row), each row's sample is a function of its prompt, the weights and its seed alone:
        not of the other rows, the batch or the rank. Without, engines draw from the global torch RNG."""

    def update_weights(self, named_tensors: Optional[Iterable[tuple[str, torch.Tensor]]] = None) -> None:
        """Make the engine sample from the current policy (a no-op for engines that share the model)."""

    def close(self) -> None:
        """Release what the engine holds (processes, memory, files)."""


@runtime_checkable
class ConcurrentEngine(Protocol):
    """An engine that many threads may call at once, with no collective in the call (the vLLM server engine's
    requests; the colocated vLLM engine's scheduler, an engine per rank): multi-turn episodes then go on on their own
    (`lit_rl.rollout.multi_turn`). `concurrent_on_every_rank`: whether every rank may call it at once, apart from the
    others (decided when the engine starts; True for an engine used by one process). An engine needs both to be one:
    with `concurrent_generate` alone, episodes go turn by turn."""

    concurrent_on_every_rank: bool

    def concurrent_generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        seeds: Optional[Sequence[int]] = None,
    ) -> RolloutOutput:
        """`RolloutEngine.generate` for this rank's rows alone, safe to call from several threads."""


@runtime_checkable
class RankLocalEngine(Protocol):
    """An engine whose `generate` involves no other rank (`rank_local`, decided when the engine starts: HF `generate`
    on whole weights, without ZeRO-3's gathering for each call): on several processes each rank's multi-turn
    episodes may then make their own number of calls (`model.env.ready_batches`)."""

    rank_local: bool


@runtime_checkable
class InFlightEngine(Protocol):
    """An engine that takes new weights while its episodes run (`lit_rl.rollout.in_flight`)."""

    def take_weights_in_flight(self) -> None:
        """From now on, the jobs' turns take each version staged as soon as the turns under way have ended."""


@runtime_checkable
class SleepingEngine(Protocol):
    """An engine that can release its memory between generations (vLLM's sleep mode); `holds_weights` is False
    until weights are pushed into it again."""

    holds_weights: bool

    def sleep(self) -> None:
        """Release the weights (and the cache) until the next push."""


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS (any of `eos_token_ids`), 0 after it: [N, T] -> [N, T]."""
    eos = torch.tensor([eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids))
    is_eos = torch.isin(completion_ids, eos.to(completion_ids.device))
    # Number of EOS strictly before each position; a token counts while none came before it.
    eos_before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (eos_before == 0).float()


def unpadded_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Left-padded prompts [N, P] and their mask -> N lists of the real token ids."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]


def draw_seeds(n: int) -> list[int]:
    """One sampling seed per completion, drawn from the global torch RNG (which `seed_everything` seeds and
    checkpoints restore), so an engine with its own sampler samples reproducibly and resumes exactly."""
    return torch.randint(0, 2**31 - 1, (n,)).tolist()


def global_batch_seeds(run_seed: int, generation: int, total: int) -> list[int]:
    """`total` sampling seeds for generation number `generation`, one per completion of the global batch (all
    ranks, in global order): a function of the run's seed and the generation alone, so a completion gets the same
    seed whatever the number of ranks it is split over, and a resumed run the same seeds as an uninterrupted one.

    The generation's draws come from torch's generator seeded with `generation`; the run's seed shifts them all by
    `seed_offset(run_seed)` (modulo 2**31 - 1; `lit_rl.seeding`). It cannot go into the generator's seed: torch's
    CPU generator keeps a seed's low 32 bits only, and a seed of `run_seed * 2**32 + generation` gave every run seed
    the same samples. Seed 0's offset is 0: its runs sample as they always did."""
    generator = torch.Generator().manual_seed(generation)
    draws = torch.randint(0, 2**31 - 1, (total,), generator=generator)
    return ((draws + seed_offset(run_seed)) % (2**31 - 1)).tolist()


def padded_output(
    token_ids: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float]],
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    device: torch.device,
) -> RolloutOutput:
    """Ragged completions (token ids and the engine's log-probs of them) -> a right-padded `RolloutOutput`.

    The mask covers each completion's own tokens up to and including its first EOS: an engine that stopped for
    another reason (the context filled up) leaves no padding marked as completion.
    """
    width = max(1, max((len(ids) for ids in token_ids), default=0))
    ids = torch.full((len(token_ids), width), pad_token_id, dtype=torch.long)
    lps = torch.zeros((len(token_ids), width), dtype=torch.float32)
    lengths = torch.zeros((len(token_ids), 1), dtype=torch.long)
    for row, (row_ids, row_lps) in enumerate(zip(token_ids, logprobs)):
        if len(row_ids) != len(row_lps):
            raise RuntimeError(f"rollout engine returned {len(row_ids)} tokens but {len(row_lps)} log-probs")
        ids[row, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        lps[row, : len(row_lps)] = torch.tensor(row_lps, dtype=torch.float32)
        lengths[row] = len(row_ids)
    within = (torch.arange(width).unsqueeze(0) < lengths).float()  # [N, T]
    mask = completion_mask_from_ids(ids, eos_token_ids) * within
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return RolloutOutput(
        completion_ids=ids.to(device), completion_mask=mask.to(device), logprobs=(lps * mask).to(device)
    )
