"""verifiers tasksets run by their harness (`lit_rl.envs.VerifiersHarness`), offline: verifiers drives the episode,
lit-rl samples every model call through the token-in endpoint it serves. With the taskset and harness that
docs/verifiers.md prints, and the page's command through `lit-rl fit`."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time

import pytest
import torch

from lit_rl.data.files import load_rows
from lit_rl.envs.base import SampledTurn, TokenIds, environment_factory
from lit_rl.envs.chat_tools import ChatRenderer
from lit_rl.envs.runner import EnvCallTimeout, EnvironmentRunner
from lit_rl.envs.verifiers_harness import (
    TurnEndpoint,
    TurnRequest,
    VerifiersHarness,
    _checked_env_config,
    _VerifiersLoop,
)
from lit_rl.envs.verifiers_tasks import _loaded_taskset
from lit_rl.errors import ConfigError
from lit_rl.modeling.models import ASSETS_DIR, TINY_BASE
from lit_rl.modeling.prompts import PromptEncoder
from lit_rl.rollout.base import RolloutOutput, SamplingParams
from lit_rl.rollout.multi_turn import run_episodes
from tests.conftest import (
    FAST_GRPO,
    REPO,
    documented_fit,
    fit_documented_two_steps,
    listening_addresses,
    read_metrics,
    run_cli,
    train_rows,
    write_overlay,
)
from tests.qwen_chat import qwen_chat_tokenizer

TINY_MODEL = ASSETS_DIR / TINY_BASE  # the tokenizer `configs/grpo.yaml` trains with

vf = pytest.importorskip("verifiers.v1")

PAGE = (REPO / "docs" / "verifiers.md").read_text()
SECTION = PAGE.split("\n## verifiers tasksets run by their harness", 1)[1].split("\n## ", 1)[0]


def _block(text: str, opening: str) -> str:
    """The code block of `text` opening with `opening` (its language, a newline and its first words)."""
    return next(block for block in text.split("```")[1:] if block.startswith(opening))


@pytest.fixture
def beside_the_run(tmp_path, monkeypatch):
    """A run's folder holding the page's `my_tasks.py` and `my_harness.py` (and what a test writes there), as the
    working directory; the modules and the checked settings forgotten afterwards."""
    (tmp_path / "my_tasks.py").write_text(_block(PAGE, "python\n# my_tasks.py").split("\n", 1)[1])
    (tmp_path / "my_harness.py").write_text(_block(SECTION, "python\n# my_harness.py").split("\n", 1)[1])
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    _loaded_taskset.cache_clear()
    _checked_env_config.cache_clear()


def _turn(tokenizer, text: str, end: bool = True) -> SampledTurn:
    """A turn as the engine would sample it: `text`'s ids (and the EOS, which stopped it), with made-up log-probs."""
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if end else [])
    return SampledTurn(ids, [-0.5 - k / 100 for k in range(len(ids))], stopped=end)


def _run(coroutine):
    return asyncio.run(coroutine)


def test_the_harness_drives_the_episode_and_every_call_is_a_turn_lit_rl_samples(beside_the_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    row = load_rows("verifiers:my_tasks?select.limit=1")[0]
    answer = row["verifiers"]["task"]["answer"]
    env = VerifiersHarness(str(TINY_MODEL), "my_tasks", harness="my_harness")
    assert env.reward_names == ("correct", "short")
    prompt = _run(env.reset(row))
    assert isinstance(prompt, TokenIds)
    own, _ = PromptEncoder(tokenizer, None).encode([row["prompt"]])  # the row's prompt as lit-rl renders it
    assert prompt == own[0].tolist()
    first = _run(env.step(_turn(tokenizer, "7")))
    assert not first.done and tokenizer.decode(first.observation) == " Once more:"  # the harness's follow-up
    last = _run(env.step(_turn(tokenizer, answer)))
    assert last.done and last.observation is None  # the program ended after its second call
    assert _run(env.finish()) == pytest.approx({"correct": 1.0, "short": 0.1})
    _run(env.close())


class OneReply:
    """An engine whose every turn is `reply`'s ids and the EOS (log-prob -0.5 each)."""

    def __init__(self, tokenizer, reply: str) -> None:
        self.ids = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]

    def generate(self, prompt_ids, prompt_mask, params, seeds=None):
        n = len(prompt_ids)
        ids = torch.tensor([self.ids] * n)
        return RolloutOutput(ids, torch.ones_like(ids), torch.full(ids.shape, -0.5))


def test_lit_rls_turn_limit_ends_the_episode_and_a_call_past_it_is_answered_empty(beside_the_run):
    """`model.env.max_turns 1` through the episode loop: the harness's second call is answered with no tokens when
    the episode ends; the program then ends, and its trace is scored on that empty last reply."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    row = load_rows("verifiers:my_tasks?select.limit=1")[0]
    env = VerifiersHarness(str(TINY_MODEL), "my_tasks", harness="my_harness")
    runner = EnvironmentRunner(concurrency=4, timeout_s=30.0)
    (prompt,) = runner.run([(env.reset, (row,))])
    engine = OneReply(tokenizer, row["verifiers"]["task"]["answer"])
    episodes = run_episodes(
        engine,
        [env],
        [prompt],
        SamplingParams(max_new_tokens=8),
        [3],
        decode=tokenizer.decode,
        encode_observation=lambda observation, turn: list(observation),
        reward_names=env.reward_names,
        max_turns=1,
        max_total_tokens=64,
        pad_id=tokenizer.pad_token_id,
        device=torch.device("cpu"),
        runner=runner,
        stop_ids=frozenset({tokenizer.eos_token_id}),
    )
    assert episodes.error is None
    assert episodes.output.completion_ids[0].tolist() == engine.ids  # one turn, no observation after it
    assert episodes.env_rewards.tolist() == [pytest.approx([0.0, 0.1])]  # correct: 0 on the empty last reply
    (trace,) = env.episode.result().traces
    assert trace.last_reply == "" and trace.num_turns == 2
    assert not _VerifiersLoop.get()[1].episodes  # the episode's routes are gone
    runner.close()


def test_a_turn_is_answered_stop_or_length_as_lit_rl_ended_it():
    """renderers reads tool calls only after "stop": a turn lit-rl's stop ids ended (a generation-config EOS the
    tokenizer does not name, Llama's <|eom_id|>) is "stop", one cut at its budget "length"."""
    loop = asyncio.new_event_loop()
    try:
        for stopped, reason in [(True, "stop"), (False, "length")]:
            turn = TurnRequest([1, 2], loop.create_future())
            TurnEndpoint.answer(turn, SampledTurn([5, 6], [-0.1, -0.2], stopped=stopped))
            status, body = turn.answer.result()
            assert status == 200 and body["choices"][0]["finish_reason"] == reason
            assert body["choices"][0]["logprobs"]["content"][1] == {"token": "token_id:6", "logprob": -0.2}
    finally:
        loop.close()


def _harness(name: str, calls: str, before: str = "") -> str:
    """A harness module's source: class `name`, whose program sends the task as a user message and then runs
    `calls` (with `http`, an HTTP client, `ask(messages, **more)` posting them to the model endpoint, and
    `messages`); `before`: module-level lines."""
    body = textwrap.indent(textwrap.dedent(calls).strip("\n"), " " * 12)
    return f"""
import asyncio
import json
import httpx
import verifiers.v1 as vf
from verifiers.v1.runtimes import ProgramResult
{before}

class {name}(vf.Harness):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        messages = [{{"role": "user", "content": data.prompt}}]
        async with httpx.AsyncClient(timeout=60) as http:
            async def ask(messages, **more):
                headers = {{"Authorization": f"Bearer {{secret}}"}}
                body = {{"model": ctx.model, "messages": messages, **more}}
                return await http.post(f"{{endpoint}}/chat/completions", headers=headers, json=body)
{body}
        return ProgramResult(0, "", "")

__all__ = ["{name}"]
"""


SLOW_HARNESS = _harness(
    "Slow",
    """
    await ask(messages)
    await asyncio.sleep(60)  # a tool that takes a minute
    """,
)


def test_a_step_past_its_time_limit_leaves_nothing_of_the_episode_running(beside_the_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    (beside_the_run / "slow_harness.py").write_text(SLOW_HARNESS)
    env = VerifiersHarness(str(TINY_MODEL), "my_tasks", harness="slow_harness")
    runner = EnvironmentRunner(concurrency=2, timeout_s=1.0)
    (prompt,) = runner.run([(env.reset, (load_rows("verifiers:my_tasks?select.limit=1")[0],))])
    assert isinstance(prompt, TokenIds)
    (outcome,) = runner.run([(env.step, (_turn(tokenizer, "7"),))])
    assert isinstance(outcome, EnvCallTimeout)
    deadline = time.monotonic() + 10
    while not env.episode.done() and time.monotonic() < deadline:  # cancelled on the verifiers loop
        time.sleep(0.05)
    assert env.episode.cancelled()
    assert not _VerifiersLoop.get()[1].episodes
    runner.close()


def test_the_endpoint_answers_lit_rls_clients_alone(beside_the_run):
    import httpx

    _, endpoint = _VerifiersLoop.get()
    body = {"model": "lit-rl-policy", "token_ids": [1, 2], "sampling_params": {}}
    answer = httpx.post(f"{endpoint.url.removesuffix('/v1')}/inference/v1/generate", json=body, timeout=10)
    assert answer.status_code == 403  # no secret: another local process cannot put a turn into an episode
    port = int(endpoint.url.removesuffix("/v1").rsplit(":", 1)[1])
    assert listening_addresses(port) == ["127.0.0.1"]  # where the kernel says it listens, not lit-rl's URL string


TOOL_TASKS = """
import verifiers.v1 as vf

class AddData(vf.TaskData):
    answer: str

class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace):
        return float(trace.last_reply.strip() == task.answer)

class AddTasks(vf.Taskset[AddTask]):
    def load(self):
        yield AddTask(AddData(prompt="What is 2 plus 3?", answer="5"), self.config.task)

__all__ = ["AddTasks"]
"""

ADD = """
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
"""
TOOL_HARNESS = _harness(
    "ToolLoop",
    """
    for _ in range(4):
        reply = await ask(messages, tools=[ADD])
        if reply.status_code != 200:
            return ProgramResult(1, "", reply.text)
        message = reply.json()["choices"][0]["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return ProgramResult(0, "", "")
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            result = str(arguments["a"] + arguments["b"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    """,
    before=ADD,
)


def test_a_tool_call_in_qwens_format_trains_the_sampled_ids_and_the_rendered_result(beside_the_run):
    """Qwen2.5's chat template: the model calls `add` in `<tool_call>` JSON, the harness runs it and sends a
    `tool` message; lit-rl appends the result as its own chat tools render one, and the episode's ids (prompt,
    sampled turns, observation) are verifiers' trace's, with the sampled mask on the model's tokens alone."""
    tokenizer = qwen_chat_tokenizer()
    tokenizer.save_pretrained(beside_the_run / "qwen-chat")
    (beside_the_run / "add_tasks.py").write_text(TOOL_TASKS)
    (beside_the_run / "tool_harness.py").write_text(TOOL_HARNESS)
    env = VerifiersHarness(
        str(beside_the_run / "qwen-chat"), "add_tasks", harness="tool_harness", renderer_args={"tool_parser": "qwen3"}
    )
    row = load_rows("verifiers:add_tasks")[0]
    prompt = _run(env.reset(row))
    text = tokenizer.decode(prompt)
    assert '"name": "add"' in text  # the tools' schemas, in the system prompt
    assert text.endswith("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    call = _turn(tokenizer, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')
    result = _run(env.step(call))
    expected = ChatRenderer(tokenizer).observation_ids([{"role": "tool", "content": "5"}], call.ids)
    assert list(result.observation) == expected  # what lit-rl's own chat tools append for that result
    assert tokenizer.decode(result.observation) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    reply = _turn(tokenizer, "5")
    assert _run(env.step(reply)).done
    assert _run(env.finish()) == {"correct": 1.0}
    (trace,) = env.episode.result().traces
    (branch,) = trace.branches  # one sequence: no call rendered the conversation anew
    episode = [*prompt, *call.ids, *result.observation, *reply.ids]
    assert list(branch.token_ids) == episode
    sampled = [0] * len(prompt) + [1] * len(call.ids) + [0] * len(result.observation) + [1] * len(reply.ids)
    assert [int(m) for m in branch.sampled_mask] == sampled
    logprobs = [lp for lp, m in zip(branch.logprobs, branch.sampled_mask) if m]
    assert logprobs == pytest.approx(call.logprobs + reply.logprobs)
    _run(env.close())


REWRITING_HARNESS = _harness(
    "Rewriter",
    """
    for _ in range(2):
        reply = await ask(messages)
        if reply.status_code != 200:
            return ProgramResult(1, "", reply.text)
        messages.append({"role": "assistant", "content": "something else"})  # not what the model said
        messages.append({"role": "user", "content": "Again:"})
    """,
)
SILENT_HARNESS = _harness("Silent", 'return ProgramResult(3, "", "gave up before asking")')


def test_a_harness_that_rewrites_the_conversation_or_never_asks_fails_in_one_line(beside_the_run):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    (beside_the_run / "rewriting_harness.py").write_text(REWRITING_HARNESS)
    (beside_the_run / "silent_harness.py").write_text(SILENT_HARNESS)
    row = load_rows("verifiers:my_tasks?select.limit=1")[0]
    env = VerifiersHarness(str(TINY_MODEL), "my_tasks", harness="rewriting_harness")
    _run(env.reset(row))
    with pytest.raises(ValueError, match="does not extend the episode's tokens .they differ from token") as err:
        _run(env.step(_turn(tokenizer, "7")))
    assert "\n" not in str(err.value)
    _run(env.close())
    env = VerifiersHarness(str(TINY_MODEL), "my_tasks", harness="silent_harness")
    with pytest.raises(ValueError, match="ended the episode without calling the model: .*gave up before asking"):
        _run(env.reset(row))
    _run(env.close())


def _harness_module(attributes: str) -> str:
    return f"""
import verifiers.v1 as vf

class H(vf.Harness):
    {attributes}

__all__ = ["H"]
"""


JUDGE = {"id": "rubric", "path": "c.toml"}


def _taskset_module(task: str = "", exports=()) -> str:
    """A taskset module of one task of class T (with `task`'s line), exporting `exports` beside its taskset."""
    return f"""
import verifiers.v1 as vf

class T(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    {task}
    @vf.reward
    async def passed(self, trace):
        return 1.0

class Tasks(vf.Taskset[T]):
    def load(self):
        yield T(vf.TaskData(prompt="1+1="), self.config.task)

class OwnEnv(vf.SingleAgentEnv):
    pass

__all__ = ["Tasks", *{list(exports)}]
"""


@pytest.mark.parametrize(
    "harness, source, args, message",
    [
        (
            "coder",
            _harness_module("NEEDS_CONTAINER = False"),
            {},
            "runs the model's code on this machine .EXECUTES_CODE.: set allow_code_execution: true",
        ),
        ("boxed", _harness_module("EXECUTES_CODE = False"), {}, "needs a container .NEEDS_CONTAINER."),
        (None, None, {}, "taskset 'my_tasks' exports no Harness: name one .harness: <module>.; verifiers' default"),
        ("no_such_harness", None, {}, "harness 'no_such_harness': ModuleNotFoundError"),
        ("my_harness", None, {"renderer_args": {"tool_parser": 3}}, "renderer_args: ValidationError"),
        ("my_harness", None, {"taskset_args": {"task": {"judges": [JUDGE]}}}, "plugs judges"),
        ("my_harness", None, {"agent_args": {"client": {}}}, "agent_args.client: lit-rl sets the model, client"),
        ("my_harness", None, {"agent_args": {"retries": {}}}, "agent_args.retries: lit-rl sets"),
        ("my_harness", None, {"agent_args": {"model": "gpt"}}, "agent_args.model: lit-rl sets"),
        ("my_harness", None, {"agent_args": {"sampling": {}}}, "agent_args.sampling: lit-rl sets"),
        ("my_harness", None, {"taskset": "env_tasks"}, "taskset 'env_tasks': its package exports its own Env"),
        ("my_harness", None, {"taskset": "boxed_tasks"}, "taskset 'boxed_tasks': T needs a container"),
    ],
    ids=[
        "runs code",
        "container",
        "no harness",
        "no module",
        "renderer",
        "judges",
        "client",
        "retries",
        "model",
        "sampling",
        "own env",
        "task container",
    ],
)
def test_what_lit_rl_will_not_run_is_refused_when_the_run_starts(beside_the_run, harness, source, args, message):
    if source is not None:
        (beside_the_run / f"{harness}.py").write_text(source)
    (beside_the_run / "env_tasks.py").write_text(_taskset_module(exports=["OwnEnv"]))
    (beside_the_run / "boxed_tasks.py").write_text(_taskset_module(task="NEEDS_CONTAINER = True"))
    settings = {"taskset": "my_tasks", "harness": harness, **args}
    with pytest.raises(ConfigError, match=message) as err:
        environment_factory("lit_rl.envs.VerifiersHarness", settings, None, tokenizer_name=str(TINY_MODEL))
    assert str(err.value).startswith("model.env.environment_args") and "\n" not in str(err.value)
    if harness == "coder":  # allowed when the user says so
        allowed = {**settings, "allow_code_execution": True}
        spec = environment_factory("lit_rl.envs.VerifiersHarness", allowed, None, tokenizer_name=str(TINY_MODEL))
        assert spec.reward_names == ("correct", "short")


def test_an_environments_token_prompt_is_taken_whole_or_refused():
    from transformers import AutoTokenizer

    encoder = PromptEncoder(AutoTokenizer.from_pretrained(TINY_MODEL), max_length=4)
    ids, mask = encoder.encode([TokenIds([5, 6, 7]), TokenIds([8, 9]), "12"])  # a failed reset's row prompt, too
    assert ids[0].tolist() == [5, 6, 7] and ids[1, 1:].tolist() == [8, 9] and mask.sum(1).tolist() == [3, 2, 2]
    with pytest.raises(ValueError, match="prompt has 5 tokens, more than model.sampling.max_prompt_length .4."):
        encoder.encode([TokenIds([1, 2, 3, 4, 5])])


@pytest.mark.slow
def test_grpo_trains_on_a_taskset_run_by_its_harness_through_the_cli(beside_the_run):
    """The page's command for 2 steps (the test overlay and the suite's small batches on top, with room in an
    episode for the follow-up after 4-token turns): two model calls an episode, each sampled by lit-rl, and the
    task's rewards are the reward, column by column."""
    command = _block(SECTION, "bash\nlit-rl fit").split("\n", 1)[1]
    log_dir = fit_documented_two_steps(command, beside_the_run, "--model.env.max_total_tokens", "32")
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert row["train/turns"] == 2.0  # the harness asks twice
        assert row["train/reward"] == pytest.approx(row["train/rewards/env/correct"] + row["train/rewards/env/short"])
    val = [row for row in read_metrics(log_dir) if row.get("val/turns")]
    assert len(val) == 1 and float(val[0]["val/turns"]) == 2.0


@pytest.mark.slow
def test_a_harness_prompt_past_max_prompt_length_stops_the_run_in_one_line_and_leaves_nothing_running(
    beside_the_run, capsys
):
    """A prompt the harness rendered is never cut: past `model.sampling.max_prompt_length` it is a reset error, on
    every rank at once, and the episodes are closed (their routes gone)."""
    command = _block(SECTION, "bash\nlit-rl fit").split("\n", 1)[1]
    overlay = write_overlay(beside_the_run / "overlay.yaml", save_dir=beside_the_run / "runs")
    too_short = ["--trainer.max_steps", "1", "--model.sampling.max_prompt_length", "3"]
    with pytest.raises(SystemExit) as ended:
        run_cli(*documented_fit(command), "--config", str(overlay), *FAST_GRPO, *too_short)
    assert ended.value.code != 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lit-rl: error: VerifiersHarness.reset gave a prompt of ") and last.endswith(
        "tokens, more than model.sampling.max_prompt_length (3): raise it (its world rendered it whole)"
    )
    assert not _VerifiersLoop.get()[1].episodes
