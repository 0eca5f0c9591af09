"""verifiers tasksets as data (`lit_rl.data.verifiers_tasksets`) and episodes (`lit_rl.envs.Verifiers`), with the
taskset docs/verifiers.md prints (`my_tasks.py`), offline; and the page's command through `lit-rl fit`."""

from __future__ import annotations

import asyncio
import sys

import pytest

from lit_rl.data.files import load_rows
from lit_rl.data.verifiers_tasksets import module_name, parse_spec
from lit_rl.envs.base import environment_factory
from lit_rl.envs.verifiers_tasks import Verifiers, _loaded_taskset
from lit_rl.errors import ConfigError, DataError
from tests.conftest import REPO, fit_documented_two_steps, read_metrics, train_rows

vf = pytest.importorskip("verifiers.v1")

SECTION = (REPO / "docs" / "verifiers.md").read_text().split("\n## ", 1)[0]  # the one-turn part


def _block(opening: str) -> str:
    """The section's code block opening with `opening` (its language, a newline and its first words)."""
    return next(block for block in SECTION.split("```")[1:] if block.startswith(opening))


@pytest.fixture
def beside_the_run(tmp_path, monkeypatch):
    """A run's folder holding the page's `my_tasks.py` (and any module a test writes there), as the working
    directory; the modules and the checked tasksets forgotten afterwards."""
    (tmp_path / "my_tasks.py").write_text(_block("python\n# my_tasks.py").split("\n", 1)[1])
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name, module in list(sys.modules.items()):  # the taskset modules loaded from this folder
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    _loaded_taskset.cache_clear()


def test_a_spec_names_the_taskset_its_selection_its_config_and_the_prompt_style():
    assert parse_spec("verifiers:my_tasks") == ("my_tasks", {}, {}, "chat")
    spec = "verifiers:my_tasks?select.limit=5&select.shuffle=true&select.seed=3&size=40&seed=2&prompt=text"
    assert parse_spec(spec) == ("my_tasks", {"limit": 5, "shuffle": True, "seed": 3}, {"size": 40, "seed": 2}, "text")
    for spec, message in [
        ("verifiers:", "name a verifiers taskset module"),
        ("verifiers:my_tasks?select.limit", "options go as key=value pairs"),
        ("verifiers:my_tasks?prompt=html", "prompt must be one of chat, text, got 'html'"),
        ("verifiers:my_tasks?select.take=3", "select.take is not one of select.limit, select.skip, select.shuffle"),
        ("verifiers:my_tasks?select.seed=3", "select.seed orders a shuffle: add select.shuffle=true"),
    ]:
        with pytest.raises(DataError, match=message):
            parse_spec(spec)
    assert module_name("owner/my-tasks@0.1.0") == "my_tasks"  # as verifiers finds a hub id's module


def test_rows_are_verifiers_own_selection_of_the_tasks(beside_the_run):
    rows = load_rows("verifiers:my_tasks?select.limit=5&select.shuffle=true&select.seed=3&size=40")
    config = vf.taskset_config_type("my_tasks").model_validate({"id": "my_tasks", "size": 40})
    selected = list(vf.load_taskset(config).select(vf.SelectConfig(limit=5, shuffle=True, seed=3)))
    assert [row["verifiers"]["task"] for row in rows] == [task.data.model_dump(mode="json") for task in selected]
    assert [row["prompt"] for row in rows] == [[{"role": "user", "content": task.data.prompt}] for task in selected]
    assert rows[0]["verifiers"]["taskset"] == config.model_dump(mode="json")
    assert rows[0]["verifiers"]["task_config"] == selected[0].config.model_dump(mode="json")
    other = load_rows("verifiers:my_tasks?select.limit=5&seed=1")  # the taskset's own seed: other tasks
    assert [row["prompt"] for row in other] != [row["prompt"] for row in load_rows("verifiers:my_tasks?select.limit=5")]
    assert len(load_rows("verifiers:my_tasks")) == 512  # the taskset's default size, every task
    text = load_rows("verifiers:my_tasks?select.limit=2&prompt=text")
    assert [row["prompt"] for row in text] == [
        task.data.prompt
        for task in vf.load_taskset(vf.taskset_config_type("my_tasks").model_validate({"id": "my_tasks"})).take(2)
    ]


def test_a_system_prompt_leads_the_chat_and_the_text(beside_the_run):
    (beside_the_run / "system_tasks.py").write_text(_taskset("return 1.0", data='system_prompt="Add."'))
    (chat,) = load_rows("verifiers:system_tasks")
    assert chat["prompt"] == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
    assert load_rows("verifiers:system_tasks?prompt=text")[0]["prompt"] == "Add.\n\n1+1="


def test_tasks_and_specs_lit_rl_cannot_train_on_are_named_in_one_line(beside_the_run):
    (beside_the_run / "endless_tasks.py").write_text(_taskset("return 1.0", infinite=True))
    (beside_the_run / "image_tasks.py").write_text(_taskset("return 1.0", data='image="data:image/png;base64,AA=="'))
    for spec, message in [
        ("verifiers:no_such_tasks", "cannot import taskset module 'no_such_tasks' .ModuleNotFoundError"),
        ("verifiers:my_tasks?no_such_field=1", "taskset 'my_tasks': ValidationError: .*no_such_field"),
        ("verifiers:endless_tasks", "Endless is infinite: give select.limit=N"),
        ("verifiers:image_tasks", "task 0 has an image: lit-rl trains verifiers' text tasks only"),
    ]:
        with pytest.raises(DataError, match=message) as err:
            load_rows(spec)
        assert "\n" not in str(err.value) and spec in str(err.value)
    assert len(load_rows("verifiers:endless_tasks?select.limit=3")) == 3


def test_an_episode_is_scored_by_the_tasks_own_rewards_each_weighted(beside_the_run):
    env = Verifiers("my_tasks")
    assert env.reward_names == ("correct", "short")
    row = load_rows("verifiers:my_tasks?select.limit=1")[0]
    answer = row["verifiers"]["task"]["answer"]
    for reply, parts in [
        (answer, {"correct": 1.0, "short": 0.1}),
        (f"{answer} it is", {"correct": 1.0, "short": 0.0}),
        ("12 and more" if answer != "12" else "13", {"correct": 0.0, "short": 0.0}),
    ]:
        assert env.reset(row) is None  # the row's prompt
        assert env.step(reply) == (None, {}, True)  # one turn
        assert asyncio.run(env.finish()) == pytest.approx(parts)
    trace = env._trace()
    asyncio.run(env.task.score(trace))
    assert trace.reward == pytest.approx(sum(asyncio.run(env.finish()).values()))  # the columns sum to verifiers'


def test_a_replys_reasoning_is_split_off_as_verifiers_renderer_parses_it(beside_the_run):
    """A Qwen3 reply opens with `<think>...</think>`, which lit-rl's decoded turn keeps: the rewards score the content
    after it and the reasoning is the message's `reasoning_content`, as verifiers' renderer gives them."""
    from renderers.default import DefaultRenderer

    from lit_rl.envs.verifiers_tasks import split_reasoning
    from tests.llama_chat import released_template
    from tests.qwen_chat import qwen_chat_tokenizer

    env = Verifiers("my_tasks")
    row = load_rows("verifiers:my_tasks?select.limit=1")[0]
    answer = row["verifiers"]["task"]["answer"]
    env.reset(row)
    env.step(f"<think>\nThe question has 2 numbers; adding them.\n</think>\n\n{answer}")
    assert asyncio.run(env.finish()) == pytest.approx({"correct": 1.0, "short": 0.1})  # as the answer alone scores
    reply = env._trace().nodes[-1].message
    assert (reply.content, reply.reasoning_content) == (f"\n\n{answer}", "\nThe question has 2 numbers; adding them.\n")
    tokenizer = qwen_chat_tokenizer()
    tokenizer.chat_template = released_template("qwen3")
    renderer = DefaultRenderer(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for text in [
        answer,
        "<think>\nhm\n</think>\n\n5",
        " <think>still open",
        "<think></think>5",
        "a <think>b</think> c",
    ]:
        parsed = renderer.parse_response(tokenizer.encode(text, add_special_tokens=False) + [end])
        assert split_reasoning(text) == (parsed.content, parsed.reasoning_content), text
    # A reply closing reasoning its generation prompt opened (Qwen3's thinking templates write `<think>` there).
    assert split_reasoning("hm\n</think>\n\n5") == ("\n\n5", "hm\n")


def test_the_environment_is_built_from_its_settings_and_checks_each_rows_taskset(beside_the_run):
    spec = environment_factory("lit_rl.envs.Verifiers", {"taskset": "my_tasks"}, None)
    assert spec.reward_names == ("correct", "short") and spec.tool_schemas is None
    env = spec.factory({})
    validation = load_rows("verifiers:my_tasks?seed=1&size=8")[0]
    env.reset(validation)  # other rows of the same tasks: their size and seed may differ
    other = dict(validation, verifiers={**validation["verifiers"], "taskset": {"id": "sums"}})
    with pytest.raises(ValueError, match="a task of taskset 'sums', model.env.environment_args gives 'my_tasks'"):
        env.reset(other)
    with pytest.raises(ValueError, match="the row has no verifiers task .its 'verifiers' column."):
        env.reset({"prompt": "1+1=", "answer": "2"})


OWN_CONFIG = """
import verifiers.v1 as vf

class TargetConfig(vf.TaskConfig):
    target: str = "never"

class T(vf.Task[vf.TaskData, vf.State, TargetConfig]):
    @vf.reward
    async def hit(self, trace):
        return float(self.config.target == trace.last_reply)

class Targets(vf.Taskset[T]):
    def load(self):
        yield T(vf.TaskData(prompt="1+1="), TargetConfig(target="2"))

__all__ = ["Targets"]
"""


def test_a_task_is_scored_with_the_task_config_its_taskset_gave_it(beside_the_run):
    (beside_the_run / "target_tasks.py").write_text(OWN_CONFIG)
    env = Verifiers("target_tasks")  # built from the taskset's config, whose target is "never"
    env.reset(load_rows("verifiers:target_tasks")[0])
    env.step("2")
    assert asyncio.run(env.finish()) == {"hit": 1.0}


def test_a_rows_own_task_config_is_taken_only_where_this_runs_taskset_gave_it(beside_the_run, tmp_path, monkeypatch):
    """A row from a data file that carries a task config plugging a reward function from a file (or a judge, which
    calls a model with a key from the environment) is refused, and nothing of it runs; one whose config is the one
    the taskset's `load()` gave is scored with it."""
    import json

    monkeypatch.setattr("lit_rl.data.verifiers_tasksets._LOADED_TASK_CONFIGS", {})  # this test's loads alone
    (beside_the_run / "target_tasks.py").write_text(OWN_CONFIG)
    marker = tmp_path / "ran"
    (tmp_path / "planted.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    row = load_rows("verifiers:target_tasks")[0]
    plugged = {"target": "2", "rewards": {"own": {"fn": f"{tmp_path}/planted.py:f"}}}
    planted = {**row["verifiers"], "task_config": plugged}
    rows = tmp_path / "rows.jsonl"
    lines = [json.dumps({"prompt": row["prompt"], "verifiers": entry}) for entry in (planted, row["verifiers"])]
    rows.write_text("\n".join(lines) + "\n")
    from_file, as_loaded = load_rows(str(rows))
    env = Verifiers("target_tasks")
    with pytest.raises(ValueError, match="the row's task config is none that taskset 'target_tasks' gave in this run"):
        env.reset(from_file)
    env.reset(as_loaded)
    env.step("2")
    assert asyncio.run(env.finish()) == {"hit": 1.0} and not marker.exists()


def _taskset(reward: str, *, task: str = "", taskset: str = "", data: str = "", infinite: bool = False, exports=()):
    """A taskset module's source: tasks of class T, whose reward `passed` returns `reward`'s body (given `runtime`
    when it names it), with `task` and `taskset` lines added to the classes and `exports` beside the taskset."""
    runtime = ", runtime" if "runtime" in reward else ""
    lines = [
        "import verifiers.v1 as vf",
        "class T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):",
        f"    {task}",
        "    @vf.reward",
        f"    async def passed(self, trace{runtime}):",
        f"        {reward}",
        "class Endless(vf.Taskset[T]):",
        f"    INFINITE = {infinite}",
        f"    {taskset}",
        "    def load(self):",
        "        while True:",
        f"            yield T(vf.TaskData(prompt='1+1=', {data}), self.config.task)",
        "            if not self.INFINITE:",
        "                return",
        "class OwnHarness(vf.Harness):",
        "    pass",
        "class OwnEnv(vf.SingleAgentEnv):",
        "    pass",
        f"__all__ = ['Endless', *{list(exports)}]",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "source, args, message",
    [
        (_taskset("return float(runtime is not None)"), {}, "T's reward passed needs the task's runtime"),
        (_taskset("return 1.0", task="NEEDS_CONTAINER = True"), {}, "T needs a container"),
        (_taskset("return 1.0", task="async def setup(self, trace, runtime): pass"), {}, "T overrides setup"),
        (
            _taskset("return 1.0", taskset="toolsets = classmethod(lambda cls, config: [object()])"),
            {},
            "its tasks call tools",
        ),
        (_taskset("return 1.0", exports=["OwnHarness"]), {}, "its package exports its own Harness"),
        (_taskset("return 1.0", exports=["OwnEnv"]), {}, "its package exports its own Env"),
        (_taskset("return 1.0"), {"task": {"judges": [{"id": "rubric", "path": "c.toml"}]}}, "plugs judges"),
    ],
    ids=["runtime reward", "container", "setup", "toolsets", "own harness", "own env", "judges"],
)
def test_what_one_chat_turn_cannot_score_is_refused_when_the_run_starts(beside_the_run, source, args, message):
    (beside_the_run / "refused_tasks.py").write_text(source)
    with pytest.raises(ConfigError, match=message) as err:
        environment_factory("lit_rl.envs.Verifiers", {"taskset": "refused_tasks", "taskset_args": args}, None)
    assert str(err.value).startswith("model.env.environment_args: taskset 'refused_tasks': ")
    assert "lit-rl runs a task as one chat turn" in str(err.value) and "\n" not in str(err.value)


def test_a_reward_giving_a_dict_of_rewards_or_none_stops_at_the_first_episode(beside_the_run):
    (beside_the_run / "keyed_tasks.py").write_text(_taskset('return {"a": 1.0, "b": 0.0}'))
    env = Verifiers("keyed_tasks")
    env.reset(load_rows("verifiers:keyed_tasks")[0])
    env.step("2")
    with pytest.raises(ValueError, match=r"T scored rewards \['a', 'b'\], not its reward functions' \['passed'\]"):
        asyncio.run(env.finish())
    (beside_the_run / "empty_tasks.py").write_text(_taskset("return {}"))  # verifiers records nothing for it
    env = Verifiers("empty_tasks")
    env.reset(load_rows("verifiers:empty_tasks")[0])
    env.step("2")
    with pytest.raises(ValueError, match=r"T scored rewards \[\], not its reward functions' \['passed'\]"):
        asyncio.run(env.finish())


@pytest.mark.slow
def test_grpo_trains_on_a_verifiers_taskset_through_the_cli(beside_the_run):
    """The page's command for 2 steps (the test overlay and the suite's small batches on top): the task's rewards
    are the reward, column by column, in training and validation."""
    log_dir = fit_documented_two_steps(_block("bash\nlit-rl fit").split("\n", 1)[1], beside_the_run)
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert row["train/reward"] == pytest.approx(row["train/rewards/env/correct"] + row["train/rewards/env/short"])
        assert 0.0 <= row["train/rewards/env/short"] <= 0.1 + 1e-6
    val = [row for row in read_metrics(log_dir) if row.get("val/rewards/env/correct")]
    assert len(val) == 1 and 0.0 <= float(val[0]["val/rewards/env/correct"]) <= 1.0
    assert sum(row["train/rewards/env/correct"] for row in train) > 0  # the tiny model adds some of them right
