"""`lit_rl.envs.OpenEnv` in this process against the tests' OpenEnv app served on loopback
(`tests.integration.openenv_countdown`): an episode's reset, steps and close over one session, the observation's
text, and one-line errors for bad settings, a server that does not answer, and an app that does not start. The run
through `lit-rl fit` is `tests/integration/test_environments.py`."""

from __future__ import annotations

import asyncio

import pytest
import torch

from lit_rl.envs import OpenEnv, StepResult
from lit_rl.envs.openenv import observation_text
from lit_rl.errors import ConfigError
from lit_rl.rollout.server.client import free_port
from tests.conftest import listening_addresses

APP = "tests.integration.openenv_countdown:app"


def test_an_episode_is_one_session_reset_by_its_row_stepped_per_turn_and_closed():
    async def episode(env):
        first = await env.reset({"answer": "5", "prompt": "5+0="})  # 2 + 5 % 2 = 3 turns
        results = [await env.step(turn) for turn in ("4", "no digit", "7")]
        await env.close()
        return first, results

    env = OpenEnv(app=APP, row_reset_args=["answer"], prompt="reset")
    # Where the kernel says the app's server listens (the URL is lit-rl's own string): loopback alone.
    assert listening_addresses(int(env.url.rsplit(":", 1)[1])) == ["127.0.0.1"]
    first, results = asyncio.run(episode(env))
    assert first == "3;"
    assert results == [
        StepResult("2;", {"openenv": 0.25}, done=False),
        StepResult("1;", {"openenv": 0.0}, done=False),
        StepResult("0;", {"openenv": 0.25}, done=True),
    ]
    assert OpenEnv(app=APP).url == env.url  # one server per app in a process
    assert asyncio.run(_first_then_lost_session(OpenEnv(app=APP))) is None  # the row's prompt by default


async def _first_then_lost_session(env):
    """The reset's answer; then, the session's socket closed under it, a step fails in one line instead of
    reaching a fresh environment that was never reset (openenv's client would reconnect)."""
    first = await env.reset({"prompt": "1+1="})
    await env._socket.close()
    with pytest.raises(RuntimeError, match="OpenEnv server http://127.0.0.1:\\d+: the episode's session was closed"):
        await env.step("1")
    await env.close()
    return first


def test_the_observations_text_is_the_named_field_its_only_text_field_or_json():
    assert observation_text({"text": "2;", "metadata": {"x": 1}}, None) == "2;"
    assert observation_text({"text": "2;", "board": [1, 2]}, None) == "2;"
    assert observation_text({"a": "x", "b": "y"}, None) == '{"a": "x", "b": "y"}'
    assert observation_text({"a": "x", "b": [1]}, "b") == "[1]"
    with pytest.raises(ValueError, match="the observation has no field 'c' \\(it has a, b\\)"):
        observation_text({"a": "x", "b": "y"}, "c")


async def _two_sessions_at_once(url):
    first, second = OpenEnv(url=url), OpenEnv(url=url)
    await first.reset({})
    with pytest.raises(
        RuntimeError, match="CAPACITY_REACHED.*holds a session from its reset to its end.*let the server allow as many"
    ):
        await second.reset({})
    await first.close()


async def _wrong_action_field(env):
    await env.reset({})
    refused = "VALIDATION_ERROR\\): message: Field required; code: Extra inputs are not permitted \\(the action is"
    with pytest.raises(RuntimeError, match=refused):
        await env.step("1")
    await env.close()


def test_bad_settings_a_silent_server_and_an_app_that_does_not_start_fail_in_one_line():
    with pytest.raises(ConfigError, match="exactly one of environment_args.url .* and environment_args.app"):
        OpenEnv()
    with pytest.raises(ConfigError, match="environment_args.prompt must be row or reset, got 'first'"):
        OpenEnv(url="http://127.0.0.1:8000", prompt="first")
    with pytest.raises(ConfigError, match="environment_args.app must be module:attribute"):
        OpenEnv(app="tests.integration.openenv_countdown")
    silent = OpenEnv(url=f"http://127.0.0.1:{free_port()}", max_retries=1)
    silence = r"^OpenEnv server http://127.0.0.1:\d+ did not answer \(2 tries of 10 s\): "
    with pytest.raises(ConnectionError, match=silence):
        asyncio.run(silent.reset({}))
    with pytest.raises(ValueError, match="row_reset_args: the row has no field 'seed'"):
        asyncio.run(OpenEnv(url="http://127.0.0.1:8000", row_reset_args=["seed"]).reset({}))
    crowded = OpenEnv(app="tests.integration.openenv_countdown:small_app")  # one session at a time
    asyncio.run(_two_sessions_at_once(crowded.url))
    with pytest.raises(ConfigError, match="environment_args.url must be http\\(s\\)://host:port"):
        OpenEnv(url="127.0.0.1:8000")
    assert OpenEnv(url="ws://127.0.0.1:8000/").url == "ws://127.0.0.1:8000/"
    miscalled = OpenEnv(url=OpenEnv(app=APP).url, action_field="code")
    asyncio.run(_wrong_action_field(miscalled))
    broken = OpenEnv(url=miscalled.url, row_reset_args=["answer"])  # the server's reset raises on answer "x"
    with pytest.raises(
        RuntimeError, match=r"http://127.0.0.1:\d+: invalid literal for int\(\) .* \(code: EXECUTION_ERROR\)"
    ):
        asyncio.run(broken.reset({"answer": "x"}))
    assert broken._socket is None  # its session freed: the rollout never closes an episode whose reset failed
    with pytest.raises(ConfigError, match=r"the server of tests.no_such_module:app exited with code \d+ \(.*no_such"):
        OpenEnv(app="tests.no_such_module:app")


def test_a_module_beside_the_run_cannot_stand_in_for_a_package_the_served_app_imports(tmp_path, monkeypatch):
    """The app lit-rl serves is started with the working directory last on its import path (`python -m uvicorn`
    put it first, so a stray `uvicorn.py` beside the run was imported instead of the package)."""
    import sys

    from lit_rl.envs.openenv import _LocalApps
    from tests.conftest import REPO

    marker = tmp_path / "stray-imported"
    (tmp_path / "uvicorn.py").write_text(f"open({str(marker)!r}, 'w').close(); raise SystemExit(3)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the tests' app, `tests.integration.openenv_countdown`
    url = _LocalApps().url(APP, sys.executable, timeout_s=60)
    assert listening_addresses(int(url.rsplit(":", 1)[1])) == ["127.0.0.1"]
    assert not marker.exists()


def test_a_port_another_process_takes_before_the_app_binds_it_is_passed_over(monkeypatch, first_free_port_taken):
    """`free_port` finds a port free, and another process may take it before the app's server binds it (a CI run
    failed so: `found its port ... taken by another process`): the server is started on another port."""
    import sys

    from lit_rl.envs.openenv import _LocalApps
    from tests.conftest import REPO

    monkeypatch.setenv("PYTHONPATH", str(REPO))
    url = _LocalApps().url(APP, sys.executable, timeout_s=60)
    assert url == f"http://127.0.0.1:{first_free_port_taken}"


# -- MCP tool environments (`lit_rl.envs.OpenEnvTools`) ---------------------------------------------------------
TOOLS_APP = "tests.integration.openenv_tools:app"


def _call(name, **arguments):
    import json

    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_an_mcp_environments_tools_are_offered_and_each_call_is_a_step_of_the_episodes_session():
    """The server's tools (listed once, JSON-RPC tools/list) are chat-template schemas; each call the model writes
    is a `call_tool` step of the episode's session, answered with a tool message; a framework error, an unknown tool
    and a malformed call are `error: ...` messages counted as failed; `submit_answer` ends the episode with the
    server's reward."""
    from lit_rl.envs import OpenEnvTools

    env = OpenEnvTools(app=TOOLS_APP, row_reset_args=["answer"])
    assert [(s["function"]["name"], sorted(s["function"]["parameters"]["properties"])) for s in env.schemas] == [
        ("add", ["a", "b"]),
        ("submit_answer", ["answer"]),
    ]

    async def episode():
        assert await env.reset({"prompt": "2+3=", "answer": "5"}) is None  # the row's prompt
        two_calls = await env.step("Let me add. " + _call("add", a=2, b=3) + _call("add", a=2))
        wrong = await env.step(_call("multiply", a=2, b=3) + "<tool_call>{not json</tool_call>")
        submitted = await env.step(_call("submit_answer", answer=5))
        await env.close()
        return two_calls, wrong, submitted

    two_calls, wrong, submitted = asyncio.run(episode())
    assert two_calls.observation == [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "add", "content": "error: invalid_args: add takes a and b, got ['a']"},
    ]
    assert (two_calls.tool_calls, two_calls.tool_errors, two_calls.done) == (2, 1, False)
    assert two_calls.rewards == {"openenv": 0.0}
    assert [m["name"] for m in wrong.observation] == ["unknown", "unknown"] and wrong.tool_errors == 2
    assert wrong.observation[0]["content"].startswith("error: unknown tool 'multiply' (the tools are add, ")
    assert submitted == StepResult(None, {"openenv": 1.0}, done=True, tool_calls=1, tool_errors=0)
    assert asyncio.run(_no_call_ends(OpenEnvTools(app=TOOLS_APP))).done  # a turn without a call ends it


async def _no_call_ends(env):
    await env.reset({"prompt": "p"})
    result = await env.step("The answer is 5.")
    await env.close()
    return result


def test_an_mcp_environment_is_refused_in_one_line_where_its_tools_cannot_be_offered():
    """A server that lists no tools (a plain OpenEnv environment), and a chat template that does not render tools."""
    from lit_rl.envs import OpenEnvTools
    from lit_rl.envs.base import environment_factory

    with pytest.raises(ConfigError, match=r"OpenEnvTools: http://127.0.0.1:\d+ listed no tools .*Unknown message"):
        OpenEnvTools(app=APP)  # the countdown app: no MCP
    args = {"app": TOOLS_APP}
    with pytest.raises(ConfigError, match="is a ChatToolEnvironment, whose tools are called in the chat format, but"):
        environment_factory("lit_rl.envs.OpenEnvTools", args, None, "auto", "none")
    spec = environment_factory("lit_rl.envs.OpenEnvTools", args, None, "auto", "hermes")
    assert [s["function"]["name"] for s in spec.tool_schemas] == ["add", "submit_answer"]
    assert spec.reward_names == ("openenv",) and spec.factory().call_format == "hermes"


def test_grpo_trains_on_an_mcp_environment_whose_calls_are_read_from_the_models_turns(tmp_path):
    """GRPO on the addition task with `lit_rl.envs.OpenEnvTools` serving the tests' MCP app, on a tiny model with
    Qwen2.5's template whose first turn is scripted (a random model calls no tool): `submit_answer` with the row's
    sum. Every prompt offers the server's tools; every episode made its call, which the server scored 1.0 against
    the answer its reset took from the row (`row_reset_args`), in the column `env/openenv`."""
    import re

    from lit_rl.rollout import RolloutOutput
    from tests.conftest import fit_grpo
    from tests.qwen_chat import save_qwen_chat_model

    def prepare(module):
        build, tokenizer = module.engines.build, module.tokenizer

        def scripted_first_turns():
            engine = build()

            def generate(prompt_ids, prompt_mask, params, seeds=None):
                texts = tokenizer.batch_decode(prompt_ids)
                a, b = zip(*(map(int, re.findall(r"(\d+)\+(\d+)=", text)[-1]) for text in texts))
                turns = [_call("submit_answer", answer=x + y) + "<|im_end|>" for x, y in zip(a, b)]
                ids = [tokenizer.encode(turn, add_special_tokens=False) for turn in turns]
                width = max(map(len, ids))
                out = torch.zeros(len(ids), width, dtype=torch.long)
                mask = torch.zeros(len(ids), width)
                for row, turn_ids in enumerate(ids):
                    out[row, : len(turn_ids)], mask[row, : len(turn_ids)] = torch.tensor(turn_ids), 1.0
                return RolloutOutput(out, mask, -0.1 * mask)

            engine.generate = generate
            return engine

        module.engines.build = scripted_first_turns

    model = fit_grpo(
        model_name_or_path=str(save_qwen_chat_model(tmp_path / "qwen-chat")),
        environment="lit_rl.envs.OpenEnvTools",
        environment_args={"app": TOOLS_APP, "row_reset_args": ["answer"]},
        max_turns=2,
        max_new_tokens=76,  # a byte-level tokenizer: the call is about 70 tokens
        max_total_tokens=150,  # the prompt with the tools' schemas is 872 of the 1024
        prepare=prepare,
    )
    assert model.reward_names[-1] == "env/openenv"
    prompts = model.tokenizer.batch_decode(model._buffer.prompt_ids)
    assert all('"name": "submit_answer"' in text and '"name": "add"' in text for text in prompts)
    stats = model._buffer.episode_stats
    assert stats[:, 1].tolist() == [1.0] * len(prompts) and stats[:, 2].sum() == 0  # one call each, none failed
    assert model._buffer.reward_components[:, -1].tolist() == [1.0] * len(prompts)
