"""`lit_rl.envs.OpenEnv` in this process against the tests' OpenEnv app served on loopback
(`tests.integration.openenv_countdown`): an episode's reset, steps and close over one session, the observation's
text, and one-line errors for bad settings, a server that does not answer, and an app that does not start. The run
through `lit-rl fit` is `tests/integration/test_environments.py`."""

from __future__ import annotations

import asyncio

import pytest

from lit_rl.envs import OpenEnv, StepResult
from lit_rl.envs.openenv import observation_text
from lit_rl.errors import ConfigError
from lit_rl.rollout.server.client import free_port

APP = "tests.integration.openenv_countdown:app"


def test_an_episode_is_one_session_reset_by_its_row_stepped_per_turn_and_closed():
    async def episode(env):
        first = await env.reset({"answer": "5", "prompt": "5+0="})  # 2 + 5 % 2 = 3 turns
        results = [await env.step(turn) for turn in ("4", "no digit", "7")]
        await env.close()
        return first, results

    env = OpenEnv(app=APP, row_reset_args=["answer"], prompt="reset")
    assert env.url.startswith("http://127.0.0.1:")
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
