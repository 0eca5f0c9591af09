"""Multi-turn episodes on any `RolloutEngine`, token-in and token-out.

Each episode's context is a list of token ids that only grows: the prompt's ids, then each model turn exactly as
the engine sampled it (up to and including its EOS), then each observation encoded once, on its own, and
appended (chat messages rendered by the chat template after the turn: `lit_rl.envs.chat_tools.ChatRenderer`). Every
turn is sampled by `engine.generate` from those ids (left-padded with the other episodes'), so the
transcript the trainer scores is the ids the engine conditioned on and sampled, never text decoded and encoded again
(the drift of re-tokenising a conversation cannot happen). The transcript after the prompt becomes one completion:
`completion_mask` is 1 on all its real tokens (the forward attends to them), `sampled_mask` 1 on the model's tokens
only (the loss and the token metrics count them); observation tokens carry log-prob 0.

Turn t of an episode with sampling seed s samples with seed `turn_seed(s, t)`: a function of the episode's seed and
the turn alone, so an episode's transcript does not depend on the other episodes, the batch or the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from lit_rl.envs.base import Environment, Observation, as_step_result
from lit_rl.envs.runner import EnvCallTimeout, EnvironmentRunner
from lit_rl.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from lit_rl.types import EPISODE_STATS


@dataclass
class Episodes:
    """The episodes of a batch: the transcripts as a `RolloutOutput` (with `sampled_mask`), the environment's
    reward parts [N, E] (summed over steps) and `EPISODE_STATS` [N, 5] (model turns, tool calls, failed tool calls,
    observation tokens, steps timed out)."""

    output: RolloutOutput
    env_rewards: torch.Tensor
    stats: torch.Tensor
    error: Optional[str] = None  # the first failure of an environment (its episode ended there), to raise on every rank
    unfinished: frozenset[int] = frozenset()  # episodes whose environment failed or overran: never asked to `finish`


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of `turn` (0-based) of the episode whose seed is `seed` (turn 0 keeps it)."""
    return (seed + turn * 1_000_003) % (2**31 - 1)


def left_padded(contexts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> left-padded ids [N, L] and their mask."""
    width = max(len(ids) for ids in contexts)
    ids = torch.full((len(contexts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[row, width - len(context) :] = 1
    return ids.to(device), mask.to(device)


def run_episodes(
    engine: RolloutEngine,
    envs: list[Environment],
    prompts: Sequence[list[int]],
    params: SamplingParams,
    seeds: Optional[Sequence[int]],
    *,
    decode: Callable[[list[int]], str],
    encode_observation: Callable[[Observation, list[int]], list[int]],
    reward_names: Sequence[str],
    max_turns: int,
    max_total_tokens: int,
    pad_id: int,
    device: torch.device,
    runner: EnvironmentRunner,
    env_name: str = "environment",
    any_active: Callable[[bool], bool] = bool,
    ended: frozenset[int] = frozenset(),
) -> Episodes:
    """Run one episode per environment from `prompts` (token ids) until each is done (module docstring). A model
    turn samples at most `params.max_new_tokens` tokens and at most what is left of `max_total_tokens` (model and
    observation tokens after the prompt); an observation that would pass it is cut to fit, and ends the episode.

    `any_active(this rank has episodes left)`: whether any rank has (an all-reduce, on several ranks). Engines whose
    `generate` is a collective (sharded parameters, a vLLM server or tensor-parallel group fed by several ranks)
    need every rank in every call, so a rank whose episodes have all ended joins the others' turns with a one-token
    call on a stand-in row, until none is left. An environment that raises ends its episode; the first such error
    is returned (`Episodes.error`) for the caller to raise on every rank at once, after the last collective.

    The environments' steps of a turn run together on `runner` (`lit_rl.envs.runner`: concurrently, off this
    thread, each with a time limit), and their outcomes are taken in episode order, so the transcripts do not depend
    on which step finished first. A step that overruns its time limit ends its episode (its environment is still
    busy, so it cannot be stepped again) and counts in `env_timeouts`."""
    n = len(envs)
    contexts = [list(p) for p in prompts]
    pieces: list[list[tuple[list[int], list[float], bool]]] = [[] for _ in range(n)]
    used = [0] * n
    env_rewards = torch.zeros(n, len(reward_names))
    stats = torch.zeros(n, len(EPISODE_STATS))
    column = {name: i for i, name in enumerate(reward_names)}
    active = [i for i in range(n) if i not in ended]  # `ended`: their reset failed; they take no turn
    broken = set(ended)  # episodes whose environment failed or is still busy: never asked to `finish`
    error: Optional[str] = None
    for turn in range(max_turns):
        if not any_active(bool(active)):
            break
        if not active:  # the other ranks' turn is a collective: take part with one token, and discard it
            ids, mask = left_padded([list(prompts[0])], pad_id, device)  # a prompt and 1 token fit the context
            stand_in = replace(params, max_new_tokens=1, min_new_tokens=0)
            engine.generate(ids, mask, stand_in, seeds=None if seeds is None else [turn_seed(seeds[0], turn)])
            continue
        budgets = {i: min(params.max_new_tokens, max_total_tokens - used[i]) for i in active}
        budget = max(budgets.values())
        turn_params = replace(params, max_new_tokens=budget, min_new_tokens=min(params.min_new_tokens, budget))
        ids, mask = left_padded([contexts[i] for i in active], pad_id, device)
        turn_seeds = None if seeds is None else [turn_seed(seeds[i], turn) for i in active]
        out = engine.generate(ids, mask, turn_params, seeds=turn_seeds)
        texts = {}
        for k, i in enumerate(active):
            length = min(int(out.completion_mask[k].sum()), budgets[i])
            sampled = out.completion_ids[k, :length].tolist()
            pieces[i].append((sampled, out.logprobs[k, :length].float().tolist(), True))
            contexts[i] += sampled
            used[i] += length
            stats[i, 0] += 1
            texts[i] = decode(sampled)
        # After its last turn an episode ends whatever its environment answers: no observation follows.
        last_turn = {i: turn == max_turns - 1 or used[i] >= max_total_tokens for i in active}
        # Every episode's step at once, off this thread; their outcomes are taken in episode order. An environment
        # with `steps_after_last_turn = False` (TRL's kind) is not stepped on its last turn.
        stepped = [i for i in active if getattr(envs[i], "steps_after_last_turn", True) or not last_turn[i]]
        outcomes = runner.run([(envs[i].step, (texts[i],)) for i in stepped])
        still_active = []
        for i, outcome in zip(stepped, outcomes):
            if isinstance(outcome, EnvCallTimeout):  # its environment is still busy: the episode ends here
                stats[i, 4] += 1
                broken.add(i)
                continue
            try:
                if isinstance(outcome, BaseException):
                    raise outcome
                result = as_step_result(outcome, env_name)
                _add_reward_parts(env_rewards[i], result.rewards, column, f"{env_name}.step")
            except Exception as err:  # the user's environment: end this episode, report once every rank is done
                error = error or f"{env_name}.step raised {type(err).__name__}: {err}"
                broken.add(i)
                continue
            stats[i, 1] += result.tool_calls
            stats[i, 2] += result.tool_errors
            if result.done or result.observation is None or last_turn[i]:
                continue
            try:  # text, or chat messages rendered after the turn just sampled
                observation = encode_observation(result.observation, pieces[i][-1][0])
            except Exception as err:
                error = error or f"{env_name}.step's observation cannot be encoded: {type(err).__name__}: {err}"
                broken.add(i)
                continue
            observation = observation[: max_total_tokens - used[i]]
            pieces[i].append((observation, [0.0] * len(observation), False))
            contexts[i] += observation
            used[i] += len(observation)
            stats[i, 3] += len(observation)
            if used[i] < max_total_tokens:
                still_active.append(i)
        active = still_active
    settled = [i for i in range(n) if i not in broken]
    finish_error = _finish(envs, settled, runner, env_rewards, stats, column, env_name)
    for i in broken:  # a reward scored at the end was never asked: invalid (`model.rewards.on_invalid`), not 0
        if callable(getattr(envs[i], "finish", None)):
            env_rewards[i] = float("nan")
    output = _transcripts(pieces, pad_id, device)
    return Episodes(output, env_rewards.to(device), stats.to(device), error or finish_error, frozenset(broken))


def _add_reward_parts(row: torch.Tensor, parts: dict[str, float], column: dict[str, int], where: str) -> None:
    """Add reward `parts` to an episode's `row` of reward parts; an error for a part not in the reward names."""
    for name, value in parts.items():
        if name not in column:
            raise ValueError(f"{where} reported reward part {name!r}, not in its reward_names")
        row[column[name]] += float(value)


def _finish(
    envs: list[Environment],
    settled: list[int],
    runner: EnvironmentRunner,
    env_rewards: torch.Tensor,
    stats: torch.Tensor,
    column: dict[str, int],
    env_name: str,
) -> Optional[str]:
    """Ask each ended episode's environment that has a `finish()` for its last reward parts (a TRL environment's
    `get_reward`), all at once on `runner`; the first failure, to raise on every rank. `settled`: the episodes whose
    environment neither failed nor overran (an overrunning one is still busy)."""
    finishing = [i for i in settled if callable(getattr(envs[i], "finish", None))]
    error = None
    for i, outcome in zip(finishing, runner.run([(envs[i].finish, ()) for i in finishing])):
        if isinstance(outcome, EnvCallTimeout):
            stats[i, 4] += 1
            continue
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            _add_reward_parts(env_rewards[i], dict(outcome or {}), column, f"{env_name}.finish")
        except Exception as err:
            error = error or f"{env_name}.finish raised {type(err).__name__}: {err}"
    return error


def _transcripts(pieces: list[list[tuple[list[int], list[float], bool]]], pad_id: int, device: Any) -> RolloutOutput:
    """Each episode's pieces laid end to end, right-padded: ids, real-token mask, log-probs and sampled mask."""
    width = max(1, max(sum(len(ids) for ids, _, _ in episode) for episode in pieces))
    n = len(pieces)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    real = torch.zeros(n, width)
    sampled = torch.zeros(n, width)
    logprobs = torch.zeros(n, width)
    for row, episode in enumerate(pieces):
        start = 0
        for piece_ids, piece_logprobs, by_model in episode:
            end = start + len(piece_ids)
            ids[row, start:end] = torch.tensor(piece_ids, dtype=torch.long)
            logprobs[row, start:end] = torch.tensor(piece_logprobs)
            real[row, start:end] = 1.0
            sampled[row, start:end] = float(by_model)
            start = end
    return RolloutOutput(ids.to(device), real.to(device), logprobs.to(device), sampled_mask=sampled.to(device))
