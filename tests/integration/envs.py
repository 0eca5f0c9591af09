"""Environments for tests, given by import path (`tests.integration.envs.Countdown`)."""

from __future__ import annotations

import itertools
import random
import threading
import time
from typing import Any, Optional

from lit_rl.envs import StepResult, TokenEnvironment, TokenIds
from lit_rl.envs.chat_tools import ChatToolEnvironment


class Countdown:
    """Answers every model turn with an observation until `turns` model turns have run, and pays a reward part
    `bonus` per turn whose text holds a digit; the prompt is the row's. Observations are `turns - t` and `;` (the
    tiny model's characters), so the transcript interleaves model turns and observation tokens."""

    reward_names = ("bonus",)

    def __init__(self, turns: int = 3, bonus: float = 0.25) -> None:
        self.turns, self.bonus, self.done_turns = turns, bonus, 0

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, completion: str) -> StepResult:
        self.done_turns += 1
        rewards = {"bonus": self.bonus if any(c.isdigit() for c in completion) else 0.0}
        if self.done_turns >= self.turns:
            return StepResult(None, rewards, done=True)
        return StepResult(f"{self.turns - self.done_turns};", rewards)


class Exploding:
    """Raises in its second `step`: the run must stop with one line naming it."""

    reward_names = ()

    def __init__(self) -> None:
        self.steps = 0

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, completion: str) -> StepResult:
        self.steps += 1
        if self.steps > 1:
            raise RuntimeError("the environment broke")
        return StepResult("1;")


class RowTurns(Countdown):
    """Countdown whose episode length depends on its row: 1 + answer % 3 model turns, so that ranks holding
    different rows finish their episodes at different turns."""

    def reset(self, row: dict[str, Any]) -> None:
        self.turns = 1 + int(row["answer"]) % 3
        return None


class Stalling(Countdown):
    """Countdown whose every fourth episode (in the order this process makes them) stalls `stall_s` in its first
    `step`: past `model.env.step_timeout_s`, that episode must end and count in `env_timeouts`, and the run go on."""

    _episodes = itertools.count()

    def __init__(self, turns: int = 3, bonus: float = 0.25, stall_s: float = 4.0) -> None:
        super().__init__(turns, bonus)
        self.stall_s = stall_s if next(Stalling._episodes) % 4 == 0 else 0.0

    def step(self, completion: str) -> StepResult:
        if self.done_turns == 0 and self.stall_s:
            time.sleep(self.stall_s)
        return super().step(completion)


def add_numbers(a: int, b: int) -> int:
    """Adds two integers (a tool the model calls in its chat format).

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


async def slow_echo(text: str) -> str:
    """Returns `text` after a short wait (an `async` tool).

    Args:
        text: what to return
    """
    import asyncio

    await asyncio.sleep(0.01)
    return text


class ChatCountdown(Countdown):
    """Countdown whose observations are chat messages (a `tool` message), which the chat template renders."""

    def step(self, completion: str) -> StepResult:
        result = super().step(completion)
        if result.observation is not None:
            result.observation = [{"role": "tool", "name": "countdown", "content": result.observation}]
        return result


class IncrementEnv:
    """TRL's documented environment (`GRPOTrainer(environment_factory=IncrementEnv)`, docs/source/grpo_trainer.md),
    written anew: `reset(**row)` takes the task from the row, the public method `increment` is a tool, and
    `get_reward` scores the episode from the counter. The target is the row's answer's last digit."""

    def reset(self, answer: str = "0", **kwargs: Any) -> str:
        self.counter = 0
        self.target = int(str(answer)[-1])
        return f" Increment the counter to {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class AsyncIncrementEnv(IncrementEnv):
    """IncrementEnv whose tool and reward are `async def` (TRL awaits both)."""

    async def get_reward(self) -> float:
        return float(self.counter == self.target)

    async def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


class NumberedIncrementEnv(IncrementEnv):
    """IncrementEnv that numbers its episodes in its prompt ("Episode 12."), so a test can match each completion's
    instance (`env_number`) to the prompt it sampled from."""

    numbers = itertools.count()

    def reset(self, answer: str = "0", **kwargs: Any) -> str:
        self.number = next(NumberedIncrementEnv.numbers)
        return super().reset(answer, **kwargs) + f" Episode {self.number}."


class DoubleEnv:
    """A second TRL environment, for TRL's dict of environments (`{count: IncrementEnv, double: DoubleEnv}`): its tool
    is `double`, it has no `get_reward`, and it keeps the keywords its `reset` was given."""

    def reset(self, **kwargs: Any) -> str:
        self.reset_with = kwargs
        self.value = 1
        return " Double the value."

    def double(self, times: int) -> int:
        """
        Double the value a number of times.

        Args:
            times: How many times to double it.
        """
        self.value *= 2**times
        return self.value


def environment_of_row(completions: list, environments: list, environment: list, **kwargs: Any) -> list[float]:
    """1 for each episode whose instance is the class its row's `environment` column names (TRL's dict of
    environments: `count` IncrementEnv, `double` DoubleEnv); TRL passes that column to reward functions too."""
    classes = {"count": IncrementEnv, "double": DoubleEnv}
    return [float(type(env) is classes[name]) for env, name in zip(environments, environment)]


def env_number(completions: list, environments: list, **kwargs: Any) -> list[float]:
    """Each completion's environment's episode number (`NumberedIncrementEnv`)."""
    return [float(env.number) for env in environments]


def counter_untouched(completions: list, environments: list, **kwargs: Any) -> list[float]:
    """1 for each episode whose environment's counter is still 0: a reward function reading `environments` (TRL's
    keyword), the user's own instances."""
    return [float(isinstance(env, IncrementEnv) and env.counter == 0) for env in environments]


def trained_at_step(completions: list, trainer_state: Any, **kwargs: Any) -> list[float]:
    """The `trainer_state.global_step` the reward functions were given, for every completion."""
    return [float(trainer_state.global_step)] * len(completions)


def fails_after_the_episode(completions: list, environments: list, **kwargs: Any) -> list[float]:
    """A reward function reading `environments` that raises, as a user's bug does."""
    raise KeyError(f"no score for a counter at {environments[0].counter}")


class BreaksWhenMade(Countdown):
    """Made once to check its arguments (the probe), then raises whenever an episode makes one."""

    made = 0

    def __init__(self, turns: int = 3, bonus: float = 0.25) -> None:
        BreaksWhenMade.made += 1
        if BreaksWhenMade.made > 1:
            raise RuntimeError("the sandbox pool is empty\nsecond line")
        super().__init__(turns, bonus)


class DropsConnection(Countdown):
    """Countdown whose resets numbered in `failing` (counted in this process from 0, across threads) raise, as a
    sandbox that drops its connection: a transient failure."""

    resets = itertools.count()
    failing: frozenset[int] = frozenset()

    def reset(self, row: dict[str, Any]) -> None:
        if next(DropsConnection.resets) in DropsConnection.failing:
            raise RuntimeError("the sandbox dropped the connection")
        return super().reset(row)


class AwaitsNewerWeights(Countdown):
    """Countdown whose first episode of each generation in `wait_in` (episodes counted by their resets in this
    process, `per_generation` a generation) answers its first turn only once the next generation's environments are
    being reset: the module resets them right after it staged that generation's (newer) weights, so with in-flight
    weight updates the waiting episode's later turns must be sampled by them. Waits at most 60 s, then raises."""

    resets = 0  # in this process; set to 0 before a run
    _counting = threading.Lock()

    def __init__(self, turns: int = 3, bonus: float = 0.25, wait_in: tuple = (), per_generation: int = 8) -> None:
        super().__init__(turns, bonus)
        self.wait_in, self.per_generation = tuple(wait_in), per_generation
        self.next_generation_starts_at: Optional[int] = None  # the reset count that means the next one began

    def reset(self, row: dict[str, Any]) -> None:
        with AwaitsNewerWeights._counting:
            index = AwaitsNewerWeights.resets
            AwaitsNewerWeights.resets += 1
        generation, position = divmod(index, self.per_generation)
        if position == 0 and generation in self.wait_in:
            self.next_generation_starts_at = (generation + 1) * self.per_generation + 1
        return None

    def step(self, completion: str) -> StepResult:
        deadline = time.monotonic() + 60
        waiting = self.next_generation_starts_at is not None and self.done_turns == 0
        while waiting and AwaitsNewerWeights.resets < self.next_generation_starts_at:
            if time.monotonic() > deadline:
                raise RuntimeError("the next generation's environments were not reset within 60 s")
            time.sleep(0.01)
        return super().step(completion)


class SlowCountdown(Countdown):
    """Countdown whose every step takes `latency_s`, as a sandbox's does: episodes are still running when the
    trainer moves on."""

    def __init__(self, turns: int = 3, bonus: float = 0.25, latency_s: float = 0.1) -> None:
        super().__init__(turns, bonus)
        self.latency_s = latency_s

    def step(self, completion: str) -> StepResult:
        time.sleep(self.latency_s)
        return super().step(completion)


class JitteryCountdown(Countdown):
    """Countdown whose steps take a random 0-60 ms (a random generator of its own, so the sampling seeds stay
    untouched), and whose first step of the process, while `slow_first` is set, 0.5 s: episodes' steps answer in
    another order each run, and one is slower than any call."""

    jitter = random.Random()
    slow_first = False  # set before a run: its first step takes 0.5 s
    _first = threading.Lock()

    def step(self, completion: str) -> StepResult:
        with JitteryCountdown._first:
            slow, JitteryCountdown.slow_first = JitteryCountdown.slow_first, False
        time.sleep(0.5 if slow else 0.06 * JitteryCountdown.jitter.random())
        return super().step(completion)


class LongTokenPrompt(TokenEnvironment):
    """A token environment with no `close` whose world renders a 40-token prompt (past a small
    `model.sampling.max_prompt_length`)."""

    reward_names = ("r",)

    def reset(self, row: dict[str, Any]) -> TokenIds:
        return TokenIds([5] * 40)

    def step(self, turn: Any) -> StepResult:
        return StepResult(None, {"r": 0.0}, True)


class LongResetClosed(ChatToolEnvironment):
    """A chat-tools environment (the tools it is given) whose reset makes the episode's prompt the row's plus a long
    text, and whose `close` is counted (a session to release)."""

    closed = 0

    def reset(self, row: dict[str, Any]) -> str:
        return f"{row['prompt']} Here is the task in full: " + "lorem ipsum " * 400

    async def close(self) -> None:
        LongResetClosed.closed += 1
