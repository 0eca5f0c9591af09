"""TRL's environment classes run unchanged (`lit_rl.envs.trl_environments`): TRL's documented `IncrementEnv`
(written anew in `tests.integration.envs`) through `model.env.environment`, its methods as chat-format tools,
`get_reward` as a reward column, and the instances passed to reward functions as `environments`."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Optional

import pytest
import torch

from lit_rl.envs import TRLEnvironment
from lit_rl.envs.base import environment_factory
from lit_rl.envs.runner import EnvironmentRunner
from lit_rl.errors import ConfigError, DataError
from lit_rl.rollout import SamplingParams
from lit_rl.rollout.multi_turn import run_episodes
from tests.integration.envs import AsyncIncrementEnv, IncrementEnv
from tests.qwen_chat import qwen_chat_tokenizer, save_qwen_chat_model
from tests.test_multi_turn import ScriptedEngine

INCREMENT = "tests.integration.envs.IncrementEnv"


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_a_class_with_reset_and_no_step_is_trls_and_its_methods_are_its_tools():
    spec = environment_factory(INCREMENT, None, None, "auto", tool_support="hermes")
    assert spec.reward_names == ("IncrementEnv",)  # get_reward: a column named after the class, as in TRL
    assert [schema["function"]["name"] for schema in spec.tool_schemas] == ["increment"]  # not reset, get_reward
    env = spec.factory()
    assert isinstance(env, TRLEnvironment) and isinstance(env.instance, IncrementEnv)
    # reset(**row): the row's columns as keywords; the text it returns is appended to the last user message.
    row = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Go."}], "answer": "13"}
    assert env.reset(row) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Go. Increment the counter to 3."},
    ]
    assert row["prompt"][1]["content"] == "Go."  # the row is left as it was
    assert env.reset({"prompt": "Go.", "answer": "7"}) == "Go. Increment the counter to 7."
    env.reset({"prompt": "Go.", "answer": "13"})
    first = env.step(_call("increment", step=2))
    assert first.observation == [{"role": "tool", "name": "increment", "content": "2"}] and not first.done
    assert env.step(_call("increment", step=1)).observation[0]["content"] == "3"
    assert env.step("Done.").done
    assert env.finish() == {"IncrementEnv": 1.0}  # counter 3 == target 3


class Game:
    """A TRL environment whose tool is named `step` (a move in a game), as TRL allows: its `reset(**row)` tells it
    from lit-rl's own protocol, whose `reset(row)` takes the row positionally."""

    def reset(self, **kwargs: Any) -> str:
        self.moves: list[str] = []
        return " Start."

    def step(self, action: str) -> str:
        """Takes a move in the game.

        Args:
            action: the move
        """
        self.moves.append(action)
        return "ok"

    def get_reward(self) -> float:
        return float(len(self.moves))


def test_a_trl_class_with_a_tool_named_step_is_trls_and_lit_rls_own_environments_are_not():
    from lit_rl.envs import ChatToolEnvironment, OpenEnv, OpenEnvTools, ToolEnvironment, Verifiers, VerifiersHarness
    from lit_rl.envs.trl_environments import is_trl_environment
    from tests.integration import envs

    spec = environment_factory("tests.test_trl_environments.Game", None, None, "auto", tool_support="hermes")
    assert [schema["function"]["name"] for schema in spec.tool_schemas] == ["step"]
    assert spec.reward_names == ("Game",)
    env = spec.factory()
    assert isinstance(env, TRLEnvironment) and env.reset({"prompt": "Play."}) == "Play. Start."
    assert env.step(_call("step", action="e4")).observation == [{"role": "tool", "name": "step", "content": "ok"}]
    assert env.finish() == {"Game": 1.0}
    trls = [envs.IncrementEnv, envs.AsyncIncrementEnv, envs.DoubleEnv, envs.NumberedIncrementEnv, Silent, Game]
    own = [ChatToolEnvironment, ToolEnvironment, OpenEnv, OpenEnvTools, Verifiers, VerifiersHarness, TRLEnvironment]
    own += [envs.Countdown, envs.ChatCountdown, envs.RowTurns, envs.LongTokenPrompt, envs.LongResetClosed]
    assert [is_trl_environment(cls) for cls in trls] == [True] * len(trls)
    assert [is_trl_environment(cls) for cls in own] == [False] * len(own)

    class StaticReset:  # a staticmethod reset(**row): no `self` to skip
        reset = staticmethod(lambda **row: None)
        step = Game.step

    class RowAndKeywords:  # reset(row, **options): the row positionally, lit-rl's kind
        def reset(self, row: dict[str, Any], **options: Any) -> None: ...
        def step(self, completion: str) -> None: ...

    assert is_trl_environment(StaticReset) and not is_trl_environment(RowAndKeywords)


class Tools:
    """A TRL environment with a staticmethod tool and a property that raises until `reset`: TRL lists the tools on
    the class (`inspect.isfunction`), so the property is never read and the staticmethod is a tool."""

    def reset(self, **kwargs: Any) -> None:
        self.count = 0

    @staticmethod
    def add(a: int, b: int) -> int:
        """Adds two integers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    @property
    def state(self) -> int:
        raise RuntimeError("state read before reset")

    @classmethod
    def build(cls) -> "Tools":
        return cls()

    def incr(self, k: int) -> int:
        """Increments the count.

        Args:
            k: by how much
        """
        self.count += k
        return self.count


def test_the_tools_are_the_classs_public_functions_as_trl_lists_them():
    from lit_rl.envs.trl_environments import tool_methods

    instance = Tools()
    assert [tool.__name__ for tool in tool_methods(instance)] == ["add", "incr"]  # the property never read
    spec = environment_factory("tests.test_trl_environments.Tools", None, None, "auto", tool_support="hermes")
    assert [schema["function"]["name"] for schema in spec.tool_schemas] == ["add", "incr"]
    env = spec.factory()
    env.reset({"prompt": "p"})
    result = env.step(_call("add", a=2, b=3) + _call("incr", k=4))
    assert [message["content"] for message in result.observation] == ["5", "4"]


def test_messages_name_the_users_class_under_the_adapter_and_an_environments_own_otherwise():
    from lit_rl.envs.base import env_label

    assert (
        env_label(environment_factory(INCREMENT, None, None, "auto", tool_support="hermes").factory()) == "IncrementEnv"
    )

    class HoldsAnInstance:  # a user's environment with an attribute of that name: still its own class
        instance = IncrementEnv()

    assert env_label(HoldsAnInstance()) == "HoldsAnInstance"


def test_standalone_tools_are_offered_beside_the_methods_and_async_ones_are_awaited():
    spec = environment_factory(
        "tests.integration.envs.AsyncIncrementEnv", None, ["tests.integration.envs.add_numbers"], "auto", "hermes"
    )
    assert [schema["function"]["name"] for schema in spec.tool_schemas] == ["add_numbers", "increment"]
    env = spec.factory()
    assert isinstance(env.instance, AsyncIncrementEnv)
    env.reset({"prompt": "p", "answer": "2"})
    result = env.step(_call("increment", step=2) + _call("add_numbers", a=1, b=2))
    assert [message["content"] for message in result.observation] == ["2", "3"]
    assert env.finish() == {"AsyncIncrementEnv": 1.0}


class MaybeScored(IncrementEnv):
    """IncrementEnv whose `get_reward` gives None (no score) short of its target, as a TRL environment may."""

    def get_reward(self) -> Optional[float]:
        return 1.0 if self.counter == self.target else None


def test_a_get_reward_of_none_is_an_invalid_reward_as_a_reward_functions_none_is():
    """TRL makes a None reward NaN; lit-rl's reward scoring counts a function's None as an invalid reward (0 with
    `model.rewards.on_invalid: zero`, the run's end with `error`): a `get_reward` of None is the same, not a crash."""
    from lit_rl.errors import RewardFunctionError
    from lit_rl.rewards.scorer import weighted_reward

    env = environment_factory("tests.test_trl_environments.MaybeScored", None, None, "auto", "hermes").factory()
    env.reset({"prompt": "p", "answer": "2"})
    (nan,) = env.finish().values()
    assert math.isnan(nan)
    env.step(_call("increment", step=2))
    assert env.finish() == {"MaybeScored": 1.0}
    parts, weights, names = torch.tensor([[nan], [1.0]]), torch.ones(1), ["env/MaybeScored"]
    assert weighted_reward(parts, weights, names, "zero").tolist() == [0.0, 1.0]
    with pytest.raises(RewardFunctionError, match="environment reward part 'env/MaybeScored' returned nan"):
        weighted_reward(parts, weights, names, "error")


def test_a_trl_environment_that_cannot_run_says_why_in_one_line():
    with pytest.raises(ConfigError, match="is a TRL environment .*tool_format tags cannot call them"):
        environment_factory(INCREMENT, None, None, "tags", "hermes")
    with pytest.raises(ConfigError, match="is a TRL environment .* the tokenizer's chat template does not render"):
        environment_factory(INCREMENT, None, None, "auto", "none")
    with pytest.raises(ConfigError, match=r"IncrementEnv: IncrementEnv\(\) takes no arguments"):
        environment_factory(INCREMENT, {"level": 2}, None, "auto", "hermes")
    with pytest.raises(ConfigError, match="Silent has no public method to offer as a tool"):
        environment_factory("tests.test_trl_environments.Silent", None, None, "auto", "hermes")


class Silent:
    """A TRL-style class with no tool."""

    def reset(self, **kwargs: Any) -> None:
        return None


class Stuck(IncrementEnv):
    """IncrementEnv whose tool never answers in time, and that records whether `get_reward` was asked."""

    asked = False

    def get_reward(self) -> float:
        Stuck.asked = True
        return 1.0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter, slowly.

        Args:
            step: Value to add to the counter.
        """
        time.sleep(1.5)
        return step


def _turn(tokenizer: Any, text: str) -> list[int]:
    """A model turn's ids: `text`, then the end-of-turn token."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def _run(engine: ScriptedEngine, envs: list, prompts: list, tokenizer: Any, reward_names: tuple, **options: Any):
    """`run_episodes` with the environments' tool calls run as they come, observations stood in for by one token."""
    return run_episodes(
        engine,
        envs,
        prompts,
        SamplingParams(max_new_tokens=64),
        list(range(len(envs))),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        encode_observation=lambda observation, turn_ids: [7],
        reward_names=reward_names,
        max_total_tokens=512,
        pad_id=tokenizer.pad_token_id,
        device=torch.device("cpu"),
        **options,
    )


def test_get_reward_scores_each_ended_episode_once_but_not_one_whose_environment_overran():
    tokenizer = qwen_chat_tokenizer()

    def turn(text: str) -> list[int]:
        return _turn(tokenizer, text)

    # Episode 0 (first prompt id 65) increments to its target 3 in two calls, then answers; episode 1 (66) calls
    # the stuck tool, whose step overruns the runner's 0.5 s limit.
    engine = ScriptedEngine({65: [turn(_call("increment", step=2)), turn(_call("increment", step=1)), turn("Done.")],
                             66: [turn(_call("increment", step=1))]})  # fmt: skip
    envs = [TRLEnvironment(Counted()), TRLEnvironment(Stuck())]
    for env in envs:
        env.reset({"prompt": "p", "answer": "3"})
    runner = EnvironmentRunner(concurrency=2, timeout_s=0.5)
    episodes = _run(engine, envs, [[65, 1], [66, 1]], tokenizer, ("Counted",), max_turns=4, runner=runner)
    assert episodes.error is None and episodes.unfinished == {1}
    # Episode 1's reward was never asked: invalid (NaN: `model.rewards.on_invalid` counts it), not a 0 it could earn
    # by stalling.
    assert episodes.env_rewards[0].tolist() == [1.0] and episodes.env_rewards[1].isnan().all()
    # turns, tool calls, failed calls, observation tokens, steps timed out
    assert episodes.stats.tolist() == [[3, 2, 0, 2, 0], [1, 0, 0, 0, 1]]
    assert not Stuck.asked  # its environment was still busy: never asked for a reward
    assert envs[0].instance.rewards_asked == 1


class SlowToScore(IncrementEnv):
    """IncrementEnv whose `get_reward` takes 1.5 s (a sandboxed test run), and then pays -1."""

    def get_reward(self) -> float:
        time.sleep(1.5)
        return -1.0


class ExitsWhenScored(IncrementEnv):
    """IncrementEnv whose `get_reward` calls `sys.exit` (library code ending on bad input)."""

    def get_reward(self) -> float:
        raise SystemExit(3)


def test_a_get_reward_past_its_time_limit_is_invalid_and_its_busy_instance_is_not_handed_on():
    """An episode whose `get_reward` overran scored a valid 0 (more than the -1 it would pay; not counted as
    invalid), and its instance, still scoring on its worker thread, went to the reward functions as
    `environments=`. It is now broken as an episode whose step overran: invalid (NaN, which
    `model.rewards.on_invalid` turns into what it says), counted as timed out, its instance held back."""
    tokenizer = qwen_chat_tokenizer()
    engine = ScriptedEngine({65: [_turn(tokenizer, "Done.")], 66: [_turn(tokenizer, "Done.")]})
    envs = [TRLEnvironment(Counted()), TRLEnvironment(SlowToScore())]
    for env in envs:
        env.reset({"prompt": "p", "answer": "0"})
    runner = EnvironmentRunner(concurrency=2, timeout_s=0.5)
    episodes = _run(engine, envs, [[65, 1], [66, 1]], tokenizer, ("Counted", "SlowToScore"), max_turns=2, runner=runner)
    assert episodes.error is None and episodes.unfinished == {1}
    assert episodes.env_rewards[0].tolist() == [1.0, 0.0] and episodes.env_rewards[1].isnan().all()
    assert episodes.stats[:, 4].tolist() == [0, 1]  # steps (and finishes) timed out


def test_a_get_reward_that_calls_sys_exit_is_the_episodes_error_not_the_end_of_the_process():
    """A SystemExit raised in `get_reward` (or a step) passed through as it is: the run ended with exit code 0 and no
    message, the environments unclosed. It is now the episodes' error, raised in one line on every rank."""
    tokenizer = qwen_chat_tokenizer()
    engine = ScriptedEngine({65: [_turn(tokenizer, "Done.")]})
    env = TRLEnvironment(ExitsWhenScored())
    env.reset({"prompt": "p", "answer": "0"})
    runner = EnvironmentRunner(concurrency=1, timeout_s=5.0)
    episodes = _run(engine, [env], [[65, 1]], tokenizer, ("ExitsWhenScored",), max_turns=2, runner=runner)
    assert episodes.error == "ExitsWhenScored.finish raised SystemExit: 3"


class Counted(IncrementEnv):
    """IncrementEnv that counts the calls of `get_reward`."""

    def get_reward(self) -> float:
        self.rewards_asked = getattr(self, "rewards_asked", 0) + 1
        return super().get_reward()


def test_the_last_turns_tool_calls_are_not_made_as_in_trl():
    """With `max_turns` 2, a call in the second turn would never have its result seen: TRL does not make it, and
    neither does lit-rl, so `get_reward` scores the state the model acted on (counter 2, target 2)."""
    tokenizer = qwen_chat_tokenizer()
    calls = [_call("increment", step=2), _call("increment", step=5)]
    engine = ScriptedEngine({65: [_turn(tokenizer, call) for call in calls]})
    env = TRLEnvironment(Counted())
    env.reset({"prompt": "p", "answer": "2"})
    runner = EnvironmentRunner(concurrency=1, timeout_s=5.0)
    episodes = _run(engine, [env], [[65, 1]], tokenizer, ("Counted",), max_turns=2, runner=runner)
    assert env.instance.counter == 2 and env.instance.rewards_asked == 1
    assert episodes.env_rewards.tolist() == [[1.0]] and episodes.stats[0, :2].tolist() == [2, 1]


def test_grpo_runs_a_trl_environment_and_passes_the_instances_to_reward_functions(tmp_path):
    """GRPO on the built-in addition task with TRL's IncrementEnv (the target: the answer's last digit) on a model
    with Qwen2.5's template: the prompts hold `increment`'s schema and the text reset returned; the columns are the
    reward function's, then `env/IncrementEnv`; the reward function saw the user's own instances."""
    from tests.conftest import fit_grpo

    path = save_qwen_chat_model(tmp_path / "qwen-chat")
    model = fit_grpo(
        model_name_or_path=str(path),
        environment="tests.integration.envs.NumberedIncrementEnv",
        reward_funcs=["tests.integration.envs.counter_untouched", "tests.integration.envs.env_number"],
        max_turns=2,
    )
    assert model.reward_names == ["counter_untouched", "env_number", "env/NumberedIncrementEnv"]
    prompt = model.tokenizer.decode(model._buffer.prompt_ids[0], skip_special_tokens=False)
    assert '"name": "increment"' in prompt and "Increment the counter to" in prompt
    components = model._buffer.reward_components
    calls = model._buffer.episode_stats[:, 1]
    # A random model writes no tool call: every counter is 0, so the reward function (reading `environments`) pays 1
    # and get_reward pays 1 exactly where the target is 0.
    assert calls.sum() == 0 and components[:, 0].tolist() == [1.0] * len(components)
    # Each completion's instance is its own episode's: the number its reset appended to that episode's prompt.
    prompts = model.tokenizer.batch_decode(model._buffer.prompt_ids)
    numbers = [int(text.rsplit("Episode ", 1)[1].split(".")[0]) for text in prompts]
    assert components[:, 1].tolist() == [float(number) for number in numbers] and len(set(numbers)) == len(numbers)
    targets = [int(text.rsplit("to ", 1)[1][0]) for text in prompts]
    assert components[:, 2].tolist() == [float(target == 0) for target in targets]


# -- TRL's dict of environments ------------------------------------------------------------------------------------
ROUTED = {"count": INCREMENT, "double": "tests.integration.envs.DoubleEnv"}


def test_a_dict_of_trl_environments_gives_each_row_the_class_and_the_tools_it_names():
    """TRL's `environment_factory={name: factory}`: the row's `environment` column picks the class; its prompt is
    offered that class's methods (and the standalone tools) alone; `reset` is not given the column; the one class
    with a `get_reward` has its column."""
    spec = environment_factory(ROUTED, None, ["tests.integration.envs.add_numbers"], "auto", "hermes")
    assert spec.reward_names == ("IncrementEnv",) and spec.routing is not None
    names = {env: [s["function"]["name"] for s in spec.routing.tools[env]] for env in ROUTED}
    assert names == {"count": ["add_numbers", "increment"], "double": ["add_numbers", "double"]}
    assert [s["function"]["name"] for s in spec.tool_schemas] == ["add_numbers", "increment", "double"]
    row = {"prompt": "p", "answer": "3", "environment": "double"}
    env = spec.factory(row)
    assert type(env.instance).__name__ == "DoubleEnv" and env.reset(row) == "p Double the value."
    assert env.instance.reset_with == {"prompt": "p", "answer": "3"}  # TRL drops the routing column
    assert env.finish() == {}  # no get_reward: its episodes count 0 in IncrementEnv's column
    assert type(spec.factory({**row, "environment": "count"}).instance) is IncrementEnv
    rows = [{**row, "environment": "count"}, row]
    assert [[s["function"]["name"] for s in tools] for tools in spec.routing.prompt_tools(rows)] == [
        names["count"],
        names["double"],
    ]


def test_a_dict_of_environments_refuses_what_cannot_run_in_one_line():
    def spec(paths, args=None):
        return environment_factory(paths, args, None, "auto", "hermes")

    with pytest.raises(ConfigError, match=r"model.env.environment.game tests.integration.envs.Countdown is not a TRL"):
        spec({"count": INCREMENT, "game": "tests.integration.envs.Countdown"})
    with pytest.raises(ConfigError, match=r"model.env.environment_args.chess: .* maps their names \(count, double\)"):
        spec(ROUTED, {"chess": {}})
    with pytest.raises(ConfigError, match=r"model.env.environment.count tests.integration.envs.IncrementEnv: .*"):
        spec(ROUTED, {"count": {"start": 1}})  # IncrementEnv takes no arguments
    with pytest.raises(ConfigError, match="empty mapping"):
        spec({})
    routing = spec(ROUTED).routing
    assert routing.check([{"environment": "count"}, {"environment": "double"}]) is None
    assert "has environment 'chess', which must name one of model.env.environment's: count, double" in (
        routing.check([{"environment": "count"}, {"environment": "chess"}])
    )
    assert "has environment ['count']" in routing.check([{"environment": ["count"]}])  # a list: not a name
    with pytest.raises(DataError, match="the row has no environment column"):
        spec(ROUTED).factory({"prompt": "p"})


def _routed_rows(path, names):
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "environment": name}) + "\n"
            for i, name in enumerate(names)
        )
    )
    return str(path)


def test_grpo_routes_each_row_to_its_environment_with_its_own_tools_in_its_prompt(tmp_path):
    """GRPO on rows naming `count` or `double`: each prompt holds its environment's tool schema and its reset's
    text, not the other's; the reward function reading `environments` and `environment` saw every episode in the
    class its row named; IncrementEnv's column is 0 on `double` episodes."""
    from tests.conftest import fit_grpo

    data = _routed_rows(tmp_path / "routed.jsonl", ["count", "double"] * 4)
    model = fit_grpo(
        model_name_or_path=str(save_qwen_chat_model(tmp_path / "qwen-chat")),
        environment=ROUTED,
        reward_funcs=["tests.integration.envs.environment_of_row"],
        max_turns=2,
        train_data=data,
        num_generations=2,
        micro_batch_size=16,  # every row once
    )
    assert model.reward_names == ["environment_of_row", "env/IncrementEnv"]
    prompts = model.tokenizer.batch_decode(model._buffer.prompt_ids)
    components = model._buffer.reward_components
    assert components[:, 0].tolist() == [1.0] * len(prompts)
    kinds = []
    for text, increment_reward in zip(prompts, components[:, 1].tolist()):
        counting = "Increment the counter" in text
        kinds.append(counting)
        assert ('"name": "increment"' in text) == counting and ('"name": "double"' in text) != counting
        assert ("Double the value." in text) != counting
        if not counting:
            assert increment_reward == 0.0
    assert any(kinds) and not all(kinds)


def test_a_row_naming_no_environment_stops_the_run_before_training_naming_its_line(tmp_path):
    from tests.conftest import fit_grpo

    data = _routed_rows(tmp_path / "routed.jsonl", ["count", "double", "chess", "count"])
    with pytest.raises(DataError, match=r"routed.jsonl: line 3 has environment 'chess', which must name one of"):
        fit_grpo(
            model_name_or_path=str(save_qwen_chat_model(tmp_path / "qwen-chat")),
            environment=ROUTED,
            reward_funcs=["tests.integration.envs.environment_of_row"],
            train_data=data,
        )
