"""Multi-turn episodes on any `RolloutEngine`, token-in and token-out.

Each episode's context is a list of token ids that only grows: the prompt's ids, then each model turn exactly as
the engine sampled it (up to and including its EOS), then each observation encoded once, on its own, and
appended (chat messages rendered by the chat template after the turn: `lit_rl.envs.chat_tools.ChatRenderer`). Every
turn is sampled from those ids (left-padded with the other episodes' sampled in the same call), so the
transcript the trainer scores is the ids the engine conditioned on and sampled, never text decoded and encoded again
(the drift of re-tokenising a conversation cannot happen). The transcript after the prompt becomes one completion:
`completion_mask` is 1 on all its real tokens (the forward attends to them), `sampled_mask` 1 on the model's tokens
only (the loss and the token metrics count them); observation tokens carry log-prob 0.

Turn t of an episode with sampling seed s samples with seed `turn_seed(s, t)`: a function of the episode's seed and
the turn alone, so an episode's transcript does not depend on the other episodes, the batch or the rank.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from lit_rl.envs.base import (
    ClosesEpisode,
    Environment,
    FinishesEpisode,
    Observation,
    SampledTurn,
    SkipsLastTurnCalls,
    TokenEnvironment,
    as_step_result,
    env_label,
)
from lit_rl.envs.runner import Call, EnvCallTimeout, EnvironmentRunner
from lit_rl.errors import EnvironmentStepError, exception_line, one_line
from lit_rl.modeling.prompts import left_padded
from lit_rl.rollout.base import Generate, RolloutEngine, RolloutOutput, SamplingParams
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


Piece = tuple[list[int], list[float], bool, Optional[int]]  # ids, log-probs, sampled by the model, its version


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of `turn` (0-based) of the episode whose seed is `seed` (turn 0 keeps it)."""
    return (seed + turn * 1_000_003) % (2**31 - 1)


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
    any_active: Callable[[bool], bool] = bool,
    ended: frozenset[int] = frozenset(),
    concurrent_generate: Optional[Generate] = None,
    first_turns_together: bool = True,
    ready_batches: bool = False,
    stop_ids: frozenset[int] = frozenset(),
) -> Episodes:
    """Run one episode per environment from `prompts` (token ids) until each is done (module docstring). A model
    turn samples at most `params.max_new_tokens` tokens and at most what is left of `max_total_tokens` (model and
    observation tokens after the prompt); an observation that would pass it is cut to fit, and ends the episode.
    `stop_ids`: the ids that end a turn (a `TokenEnvironment` is told whether its turn ended on one:
    `SampledTurn.stopped`).

    Every episode's first turn is sampled in one call: `engine.generate` (`first_turns_together`), or with several
    ranks, each on its own, `concurrent_generate`. Then:

    - **Independent** (`concurrent_generate` given: a `generate` many threads may call at once, with no collective,
      such as the vLLM server engine's, on one rank or on each, or the colocated vLLM engine's with an engine per
      rank): each episode goes on on its own. Its environment step starts as soon as its turn is sampled, and its
      next turn goes to the engine as soon as its observation is back; the engine batches the requests that are in
      flight. A step pays its longest episode, not the sum of every turn's slowest episode.
    - **Ready batches** (`ready_batches`, and no `concurrent_generate`: an engine this thread alone calls, with no
      other rank in its calls, such as HF `generate` on one process): each episode's step starts as soon as its turn
      is sampled, and one `engine.generate` call samples the next turns of every episode whose observation is back,
      once every step under way is back, or once the first of them has waited as long as the last call took. A slow
      step holds the others back by one call at most; when every step answers within a call's time, the calls are
      lock-step's.
    - **Lock-step** (otherwise): turn t of every episode still running is one `engine.generate` call, then their
      environment steps run together. `any_active(this rank has episodes left)`: whether any rank has (an
      all-reduce, on several ranks). Engines whose `generate` is a collective (sharded parameters, a vLLM server or
      tensor-parallel group fed by several ranks) need every rank in every call, so a rank whose episodes have all
      ended joins the others' turns with a one-token call on a stand-in row, until none is left.

    All three sample the same tokens: turn t of an episode is seeded by its episode and turn alone (`turn_seed`), and
    the bookkeeping is the same code (`_EpisodeBatch`). An environment that raises ends its episode; the first such
    error (the earliest turn's, then the first episode's) is returned (`Episodes.error`) for the caller to raise on
    every rank at once, after the last collective.

    The environments' steps run on `runner` (`lit_rl.envs.runner`: concurrently, off this thread, each with a time
    limit, at most `concurrency` at once across episodes). A step that overruns its time limit ends its episode
    (its environment is still busy, so it cannot be stepped again) and counts in `env_timeouts`.

    At the end, or when this raises an `Exception`, each environment that has a `close()` is closed (a session on a
    server released: `lit_rl.envs.OpenEnv`), unless a call of its overran or its reset failed (`ended`): a plain
    method may still be running on its worker thread, using what `close` would release."""
    batch = _EpisodeBatch(
        envs, prompts, params, seeds, decode, encode_observation, reward_names, max_turns, max_total_tokens, stop_ids
    )
    active = [i for i in range(len(envs)) if i not in ended]  # `ended`: their reset failed; they take no turn
    batch.broken.update(ended)
    try:
        if concurrent_generate is not None:  # the caller's word that no other rank takes part in this engine's calls
            first_turns = engine.generate if first_turns_together else concurrent_generate
            _independent(batch, first_turns, concurrent_generate, active, pad_id, device, runner)
        elif ready_batches:
            _ready_batches(batch, engine.generate, active, pad_id, device, runner)
        else:
            _lock_step(batch, engine, active, pad_id, device, runner, any_active)
        finish_error = _finish(envs, runner, batch)
    except Exception:  # not on Ctrl-C (a BaseException): that stops at once
        close_environments(envs, batch.overran | ended, runner)
        raise
    close_environments(envs, batch.overran | ended, runner)
    for i in batch.broken:  # a reward scored at the end was never asked: invalid (`model.rewards.on_invalid`), not 0
        if isinstance(envs[i], FinishesEpisode):
            batch.env_rewards[i] = float("nan")
    output = _transcripts(batch.pieces, pad_id, device)
    error = batch.errors[min(batch.errors)] if batch.errors else None
    return Episodes(
        output, batch.env_rewards.to(device), batch.stats.to(device), error or finish_error, frozenset(batch.broken)
    )


class _EpisodeBatch:
    """The episodes of one `run_episodes` call as they grow, and the two things that happen to an episode: a turn
    sampled (`take_turn`) and its environment's answer (`take_step`). Both schedules use these, on one thread."""

    def __init__(
        self,
        envs: list[Environment],
        prompts: Sequence[list[int]],
        params: SamplingParams,
        seeds: Optional[Sequence[int]],
        decode: Callable[[list[int]], str],
        encode_observation: Callable[[Observation, list[int]], list[int]],
        reward_names: Sequence[str],
        max_turns: int,
        max_total_tokens: int,
        stop_ids: frozenset[int] = frozenset(),
    ) -> None:
        n = len(envs)
        self.envs, self.params, self.seeds, self.stop_ids = envs, params, seeds, stop_ids
        self.decode, self.encode_observation = decode, encode_observation
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.prompts = prompts
        self.contexts = [list(p) for p in prompts]
        # Each episode's pieces: (ids, log-probs, sampled by the model, the version that sampled them or None)
        self.pieces: list[list[Piece]] = [[] for _ in range(n)]
        self.used = [0] * n
        self.turns = [0] * n  # model turns sampled so far
        self.env_rewards = torch.zeros(n, len(reward_names))
        self.stats = torch.zeros(n, len(EPISODE_STATS))
        self.column = {name: i for i, name in enumerate(reward_names)}
        self.broken: set[int] = set()  # episodes whose environment failed or is still busy: never asked to `finish`
        self.overran: set[int] = set()  # episodes whose environment is still busy in a call past its time limit
        self.errors: dict[tuple[int, int], str] = {}  # (turns taken, episode) -> the failure that ended it

    def budget(self, i: int) -> int:
        """The most tokens episode i's next turn may sample."""
        return min(self.params.max_new_tokens, self.max_total_tokens - self.used[i])

    def turn_params(self, budget: int) -> SamplingParams:
        return replace(self.params, max_new_tokens=budget, min_new_tokens=min(self.params.min_new_tokens, budget))

    def turn_seeds(self, episodes: Sequence[int]) -> Optional[list[int]]:
        """The seeds of `episodes`' next turns (`turn_seed`)."""
        return None if self.seeds is None else [turn_seed(self.seeds[i], self.turns[i]) for i in episodes]

    def take_turn(self, i: int, out: RolloutOutput, row: int, budget: int) -> Optional[Call]:
        """Row `row` of `out` is episode i's turn, cut to `budget`: laid down, and its environment's step to make
        (None: the episode has ended; an environment with `steps_after_last_turn = False`, TRL's kind, is not
        stepped on its last turn)."""
        length = min(int(out.completion_mask[row].sum()), budget)
        sampled = out.completion_ids[row, :length].tolist()
        version = None if out.token_versions is None else int(out.token_versions[row, 0])  # in-flight updates
        self.pieces[i].append((sampled, out.logprobs[row, :length].float().tolist(), True, version))
        self.contexts[i] += sampled
        self.used[i] += length
        self.turns[i] += 1
        self.stats[i, 0] += 1
        env = self.envs[i]
        if self.last_turn(i) and isinstance(env, SkipsLastTurnCalls) and not env.steps_after_last_turn:
            return None
        if isinstance(env, TokenEnvironment):  # its world answers the sampled ids themselves
            stopped = bool(sampled) and sampled[-1] in self.stop_ids
            return env.step, (SampledTurn(sampled, self.pieces[i][-1][1], stopped),)
        return env.step, (self.decode(sampled),)

    def last_turn(self, i: int) -> bool:
        """After its last turn an episode ends whatever its environment answers: no observation follows."""
        return self.turns[i] >= self.max_turns or self.used[i] >= self.max_total_tokens

    def take_step(self, i: int, outcome: Any) -> bool:
        """Episode i's environment answered `outcome` (`EnvironmentRunner.run`'s) to its last turn: its reward parts
        and tool counts recorded, its observation laid down. Whether the episode takes another turn."""
        if isinstance(outcome, EnvCallTimeout):  # its environment is still busy: the episode ends here
            self.stats[i, 4] += 1
            self.broken.add(i)
            self.overran.add(i)
            return False
        name = env_label(self.envs[i])
        if isinstance(outcome, BaseException):  # a SystemExit too: the environment's, not this process's to end
            self._fail(i, f"{name}.step raised {exception_line(outcome)}")
            return False
        try:
            result = as_step_result(outcome, name)
            _add_reward_parts(self.env_rewards[i], result.rewards, self.column, f"{name}.step")
        except EnvironmentStepError as err:  # what it returned: lit-rl's check says what is wrong with it
            self._fail(i, str(err))
            return False
        except Exception as err:  # the user's environment: end this episode, report once every rank is done
            self._fail(i, f"{name}.step raised {exception_line(err)}")
            return False
        self.stats[i, 1] += result.tool_calls
        self.stats[i, 2] += result.tool_errors
        if result.done or result.observation is None or self.last_turn(i):
            return False
        try:  # text, or chat messages rendered after the turn just sampled
            observation = self.encode_observation(result.observation, self.pieces[i][-1][0])
        except Exception as err:
            self._fail(i, f"{name}.step's observation cannot be encoded: {exception_line(err)}")
            return False
        observation = observation[: self.max_total_tokens - self.used[i]]
        self.pieces[i].append((observation, [0.0] * len(observation), False, None))
        self.contexts[i] += observation
        self.used[i] += len(observation)
        self.stats[i, 3] += len(observation)
        return self.used[i] < self.max_total_tokens

    def _fail(self, i: int, error: str) -> None:
        self.errors[(self.turns[i], i)] = error
        self.broken.add(i)


def _lock_step(
    batch: _EpisodeBatch,
    engine: RolloutEngine,
    active: list[int],
    pad_id: int,
    device: torch.device,
    runner: EnvironmentRunner,
    any_active: Callable[[bool], bool],
) -> None:
    """Turn by turn: every running episode's turn t in one `engine.generate` call, then their steps together, their
    outcomes taken in episode order (`run_episodes`)."""
    for turn in range(batch.max_turns):
        if not any_active(bool(active)):
            break
        if not active:  # the other ranks' turn is a collective: take part with one token, and discard it
            ids, mask = left_padded([batch.prompts[0]], pad_id, device)  # a prompt and 1 token fit the context
            stand_in = replace(batch.params, max_new_tokens=1, min_new_tokens=0)
            seeds = None if batch.seeds is None else [turn_seed(batch.seeds[0], turn)]
            engine.generate(ids, mask, stand_in, seeds=seeds)
            continue
        steps = _sample_turns(batch, engine.generate, active, pad_id, device)
        stepped = [i for i in active if i in steps]
        outcomes = runner.run([steps[i] for i in stepped])
        active = [i for i, outcome in zip(stepped, outcomes) if batch.take_step(i, outcome)]


def _sample_turns(
    batch: _EpisodeBatch, generate: Generate, episodes: list[int], pad_id: int, device: torch.device
) -> dict[int, Call]:
    """The next turn of each of `episodes` in one `generate` call, laid down; the steps to make, by episode."""
    budgets = [batch.budget(i) for i in episodes]
    ids, mask = left_padded([batch.contexts[i] for i in episodes], pad_id, device)
    out = generate(ids, mask, batch.turn_params(max(budgets)), seeds=batch.turn_seeds(episodes))
    steps = {}
    for row, (i, budget) in enumerate(zip(episodes, budgets)):
        step = batch.take_turn(i, out, row, budget)
        if step is not None:
            steps[i] = step
    return steps


class _Waiting:
    """The calls `batch`'s episodes wait on (an environment's step, a next turn), each on a thread of its own, and
    their answers as they arrive; a context manager. When its block raises (a failure, Ctrl-C), calls not yet begun
    are never made, those under way are abandoned (each ends at its time limit), and the episodes whose step is
    still under way count as overrunning (their environments are busy: not closed under them)."""

    def __init__(self, batch: _EpisodeBatch, episodes: int) -> None:
        self.batch = batch
        self.threads = ThreadPoolExecutor(max_workers=max(1, episodes), thread_name_prefix="lit-rl-episode")
        # future -> (episode, "step" or "turn", the turn's budget)
        self.pending: dict[Future, tuple[int, str, int]] = {}
        self.stopped = threading.Event()

    def __enter__(self) -> _Waiting:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if error is not None:
            self.stopped.set()
            self.batch.overran.update(i for i, what, _ in self.pending.values() if what == "step")
        self.threads.shutdown(wait=False, cancel_futures=True)

    def _unless_stopped(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return None if self.stopped.is_set() else call(*args, **kwargs)

    def submit(self, i: int, kind: str, call: Callable[..., Any], *args: Any, budget: int = 0, **kwargs: Any) -> None:
        self.pending[self.threads.submit(self._unless_stopped, call, *args, **kwargs)] = (i, kind, budget)

    def step(self, i: int, step: Call, runner: EnvironmentRunner) -> None:
        """Episode i's environment step, on `runner` (its time limit, its bound on calls at once)."""
        self.submit(i, "step", runner.run, [step])

    def answers(self, timeout: Optional[float] = None) -> list[tuple[int, str, int, Any]]:
        """The calls that have answered (waiting for one at most `timeout` seconds; None: until one does), in
        episode order: (episode, kind, budget, result); a call's exception is raised."""
        done, _ = wait(self.pending, timeout=timeout, return_when=FIRST_COMPLETED)
        answered = sorted(((f, self.pending.pop(f)) for f in done), key=lambda d: d[1][0])
        return [(i, kind, budget, future.result()) for future, (i, kind, budget) in answered]


def _independent(
    batch: _EpisodeBatch,
    first_turns: Generate,
    generate: Generate,
    active: list[int],
    pad_id: int,
    device: torch.device,
    runner: EnvironmentRunner,
) -> None:
    """Each episode on its own after the first turn (`run_episodes`): its step, then its next turn, each submitted
    as soon as the last is back. The sampling and the environments' calls wait on worker threads; this thread does
    the bookkeeping (and the tokenizer's work) as each answer arrives, in episode order among those that arrive
    together."""
    if not active:
        return
    # The first turn in one call, as in lock-step: the G episodes of a prompt share it (one request for n).
    steps = _sample_turns(batch, first_turns, active, pad_id, device)
    with _Waiting(batch, len(active)) as waiting:

        def submit_turn(i: int) -> None:
            budget = batch.budget(i)
            ids, mask = left_padded([batch.contexts[i]], pad_id, device)
            params, seeds = batch.turn_params(budget), batch.turn_seeds([i])
            waiting.submit(i, "turn", generate, ids, mask, params, seeds=seeds, budget=budget)

        for i in steps:
            waiting.step(i, steps[i], runner)
        while waiting.pending:
            for i, kind, budget, result in waiting.answers():
                if kind == "step":
                    if batch.take_step(i, result[0]):
                        submit_turn(i)
                    continue
                step = batch.take_turn(i, result, 0, budget)  # an engine's failure stops the run
                if step is not None:
                    steps[i] = step
                    waiting.step(i, step, runner)


def _ready_batches(
    batch: _EpisodeBatch,
    generate: Generate,
    active: list[int],
    pad_id: int,
    device: torch.device,
    runner: EnvironmentRunner,
) -> None:
    """Turns sampled in batches of the episodes that are ready (`run_episodes`): every step runs as soon as its
    turn is sampled, and a call on this thread samples the next turns of the episodes whose steps are back (in
    episode order), once no step is under way or once the first of them has waited as long as the last call took."""
    if not active:
        return
    started = time.monotonic()
    steps = _sample_turns(batch, generate, active, pad_id, device)
    last_call = time.monotonic() - started  # how long a ready episode may wait for the steps still under way
    ready: list[int] = []
    ready_since = 0.0
    with _Waiting(batch, len(active)) as waiting:
        for i in steps:
            waiting.step(i, steps[i], runner)
        while waiting.pending or ready:
            if waiting.pending:
                timeout = None if not ready else max(0.0, ready_since + last_call - time.monotonic())
                for i, _, _, result in waiting.answers(timeout):
                    if batch.take_step(i, result[0]):
                        ready_since = ready_since if ready else time.monotonic()
                        ready.append(i)
            if ready and (not waiting.pending or time.monotonic() - ready_since >= last_call):
                started = time.monotonic()
                steps = _sample_turns(batch, generate, sorted(ready), pad_id, device)
                last_call, ready = time.monotonic() - started, []
                for i in steps:
                    waiting.step(i, steps[i], runner)


def _add_reward_parts(row: torch.Tensor, parts: dict[str, float], column: dict[str, int], where: str) -> None:
    """Add reward `parts` to an episode's `row` of reward parts; an error for a part not in the reward names."""
    for name, value in parts.items():
        if name not in column:
            raise EnvironmentStepError(f"{where} reported reward part {name!r}, not in its reward_names")
        try:
            row[column[name]] += float(value)
        except (TypeError, ValueError):
            raise EnvironmentStepError(f"{where} returned reward part {name!r} = {value!r}, not a number") from None


def close_environments(envs: Sequence[Environment], busy: set[int] | frozenset[int], runner: EnvironmentRunner) -> None:
    """Close the environments that have a `close()`, together, but for the `busy` ones (a call overran, or their
    reset failed). A failure to close is not the episode's: it is scored already, and the server's own log says what
    went wrong."""
    closing = [env for i, env in enumerate(envs) if i not in busy and isinstance(env, ClosesEpisode)]
    if closing:
        runner.run([(env.close, ()) for env in closing])


def _finish(envs: list[Environment], runner: EnvironmentRunner, batch: _EpisodeBatch) -> Optional[str]:
    """Ask each ended episode's environment that has a `finish()` for its last reward parts (a TRL environment's
    `get_reward`), all at once on `runner`; the first failure, to raise on every rank. Only episodes whose
    environment neither failed nor overran are asked (an overrunning one is still busy). One whose `finish`
    overruns is broken as a step that overruns is: its reward invalid (counted in `train/frac_invalid_reward`;
    `model.rewards.on_invalid` says what it then counts), and its environment busy (not closed, not handed to the
    reward functions)."""
    finishing = [i for i, env in enumerate(envs) if i not in batch.broken and isinstance(env, FinishesEpisode)]
    error = None
    for i, outcome in zip(finishing, runner.run([(envs[i].finish, ()) for i in finishing])):
        if isinstance(outcome, EnvCallTimeout):
            batch.stats[i, 4] += 1
            batch.broken.add(i)
            batch.overran.add(i)
            continue
        label = f"{env_label(envs[i])}.finish"
        if isinstance(outcome, BaseException):  # a SystemExit too: the environment's, not this process's to end
            error = error or f"{label} raised {exception_line(outcome)}"
            continue
        try:
            _add_reward_parts(batch.env_rewards[i], dict(outcome or {}), batch.column, label)
        except EnvironmentStepError as err:
            error = error or str(err)
        except Exception as err:
            error = error or f"{label} returned {one_line(repr(outcome), 80)}, not a dict of reward parts ({err})"
    return error


def _transcripts(pieces: list[list[Piece]], pad_id: int, device: Any) -> RolloutOutput:
    """Each episode's pieces laid end to end, right-padded: ids, real-token mask, log-probs and sampled mask, and
    with in-flight weight updates each model token's version (-1 elsewhere)."""
    width = max(1, max(sum(len(piece[0]) for piece in episode) for episode in pieces))
    n = len(pieces)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    real = torch.zeros(n, width)
    sampled = torch.zeros(n, width)
    logprobs = torch.zeros(n, width)
    versions = torch.full((n, width), -1, dtype=torch.long)
    tagged = False
    for row, episode in enumerate(pieces):
        start = 0
        for piece_ids, piece_logprobs, by_model, version in episode:
            end = start + len(piece_ids)
            ids[row, start:end] = torch.tensor(piece_ids, dtype=torch.long)
            logprobs[row, start:end] = torch.tensor(piece_logprobs)
            real[row, start:end] = 1.0
            sampled[row, start:end] = float(by_model)
            if version is not None:
                versions[row, start:end] = version
                tagged = True
            start = end
    return RolloutOutput(
        ids.to(device),
        real.to(device),
        logprobs.to(device),
        sampled_mask=sampled.to(device),
        token_versions=versions.to(device) if tagged else None,
    )
