"""verifiers tasksets run by their harness (`pip install 'lit-rl[verifiers]'`): verifiers drives the episode,
lit-rl samples every model call.

    data:
      train_data: verifiers:my_tasks?select.limit=2000
    model:
      env:
        environment: lit_rl.envs.VerifiersHarness
        environment_args: {taskset: my_tasks, harness: my_harness}   # harness: the taskset's own, if it has one

A harness is verifiers' agent program: it sends the model the task, runs the tools the model calls, and asks again,
each call to its rollout's model endpoint. Here that endpoint's upstream is verifiers' training client
(`TrainClientConfig`), which renders the conversation to token ids and sends them to a token-in route
(`POST /inference/v1/generate`, as vLLM's, in `renderers`' wire format). lit-rl serves that route on 127.0.0.1,
one for the process's episodes (`TurnEndpoint`, routing each request by its trace's id): a request is its episode's
next turn, which lit-rl's episode loop samples on its own engine (any engine, with the episode's seed for that turn,
as for its own environments) and answers with the sampled ids and log-probs. verifiers' side (each taskset's env,
serving from its first episode on, the endpoint, the harnesses' programs) runs on one event loop of its own.

**Token-in, token-out.** The first request's ids are the episode's prompt, as the harness's renderer made them
(with its tools' schemas and system prompt). From the second turn on, the renderer lit-rl gives verifiers
(`lit_rl.envs.verifiers_renderer`) appends the new messages (a tool's result) to the ids already sampled, never
rendering the conversation again, and each request must extend the episode's ids exactly: what follows is the
observation (`TokenIds`), appended as it is. A request that rewrites the history (a harness that edits its
messages) stops the run in one line. So the transcript trained is the ids the engine conditioned on and sampled.

**Rewards.** Once the harness's program ends, verifiers scores the trace with the task's `@vf.reward` functions
(with the task's runtime), and each becomes a column `rewards/env/<name>` of `score * weight`, which sum to
verifiers' `trace.reward`.

**Limits.** An episode ends at lit-rl's `model.env.max_turns` or `max_total_tokens`; a call the program makes past
them is answered with no tokens (finish reason `length`) until the program ends, and its trace is scored (give
verifiers the same limit, `agent_args: {max_turns: N}`, and its program is refused the call instead). Each call of
the environment (`reset`, a `step` while the program works between turns) has `model.env.step_timeout_s`; one
that overruns, or fails, ends the episode and cancels its program (`_abort`: nothing of it is left running). The
harness runs in verifiers' `subprocess` runtime on this machine: a harness that runs code (verifiers' `EXECUTES_CODE`,
true for its built-in `bash`) is refused unless `allow_code_execution: true`, and one that needs a container is
refused. verifiers' built-in harnesses install their program with `uv`, from the network; a harness written in
Python, whose `launch` calls the endpoint itself, runs offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import json
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from lit_rl.envs.base import SampledTurn, StepResult, TokenEnvironment, TokenIds
from lit_rl.envs.verifiers_tasks import WHERE, row_task
from lit_rl.errors import ConfigError, one_line

MODEL = "lit-rl-policy"  # the model name the harness's requests carry (lit-rl serves one model)
SESSION_HEADER = "X-Session-ID"  # verifiers' trace id, which its training client sends with each call
SECRET_HEADER = "X-Lit-RL-Secret"  # the endpoint's secret, which lit-rl gives each episode's client
MAX_REQUEST_BYTES = 1 << 30  # a turn's ids as JSON (aiohttp's default, 1 MiB, is about 130k tokens)
LIT_RL_AGENT_KEYS = {"model", "client", "sampling", "retries"}  # verifiers' agent settings lit-rl owns


@dataclass
class TurnRequest:
    """One model call of the harness: the ids to sample from, and its answer."""

    token_ids: list[int]
    answer: asyncio.Future = field(repr=False)


class TurnEndpoint:
    """The token-in model route verifiers' training client calls, on 127.0.0.1 (module docstring), for every episode
    of the process: a request goes to its episode's queue (by its trace's id, `SESSION_HEADER`) and waits there until
    lit-rl answers it with a sampled turn (`answer`) or refuses it (`refuse`). A request without the endpoint's
    secret (`SECRET_HEADER`, in the clients' config) is refused."""

    def __init__(self) -> None:
        self.url = ""
        self.episodes: dict[str, asyncio.Queue[TurnRequest]] = {}
        # Sent by lit-rl's clients alone: another local process cannot put a turn into an episode.
        self.secret = secrets.token_urlsafe(16)
        self._runner: Any = None

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_REQUEST_BYTES)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # port 0: the system's choice
        self.url = f"http://127.0.0.1:{port}/v1"

    async def _generate(self, request: Any) -> Any:
        from aiohttp import web

        if not secrets.compare_digest(request.headers.get(SECRET_HEADER, ""), self.secret):
            return web.json_response({"error": {"message": "not lit-rl's client"}}, status=403)
        body = await request.json()
        # Looked up and queued with no await between: an episode that ends (`_abort`) either took this turn off
        # its queue and refused it, or had no route left for it.
        queue = self.episodes.get(request.headers.get(SESSION_HEADER, ""))
        if queue is None:
            return web.json_response({"error": {"message": "no such episode"}}, status=404)
        turn = TurnRequest([int(t) for t in body["token_ids"]], asyncio.get_running_loop().create_future())
        queue.put_nowait(turn)
        status, payload = await turn.answer
        return web.json_response(payload, status=status)

    async def _models(self, request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    @staticmethod
    def answer(turn: TurnRequest, sampled: SampledTurn) -> None:
        """Answer `turn` with the ids lit-rl sampled, in vLLM's generate response as `renderers` reads it."""
        ids = list(sampled.ids)
        logprobs = [{"token": f"token_id:{t}", "logprob": float(lp)} for t, lp in zip(ids, sampled.logprobs)]
        choice = {
            "index": 0,
            "token_ids": ids,
            "finish_reason": "stop" if sampled.stopped else "length",  # renderers reads tool calls after "stop"
            "logprobs": {"content": logprobs},
        }
        response = {"request_id": "lit-rl", "prompt_token_ids": turn.token_ids, "choices": [choice]}
        if not turn.answer.done():
            turn.answer.set_result((200, response))

    @staticmethod
    def refuse(turn: TurnRequest, reason: str) -> None:
        if not turn.answer.done():
            turn.answer.set_result((400, {"error": {"message": reason, "type": "invalid_request_error"}}))


class _VerifiersLoop:
    """The one event loop (on a daemon thread) every verifiers episode of the process runs on, with the endpoint and
    each environment's serving (its interception server and its clients, started once and kept): verifiers and
    `renderers` keep asyncio state across episodes (locks, pools), which must stay on one loop, while lit-rl's
    environment runner may start a new loop (a new run, or one left to a blocking call)."""

    _lock = threading.Lock()
    _loop: Optional[asyncio.AbstractEventLoop] = None
    _endpoint: Optional[TurnEndpoint] = None
    # settings -> (their env config, the task starting its env, which serves until the process ends)
    _served: dict[str, tuple[Any, asyncio.Future]] = {}
    _stack = contextlib.AsyncExitStack()

    @classmethod
    def get(cls) -> tuple[asyncio.AbstractEventLoop, TurnEndpoint]:
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="lit-rl-verifiers", daemon=True).start()
                endpoint = TurnEndpoint()
                asyncio.run_coroutine_threadsafe(endpoint.start(), loop).result(timeout=60)
                cls._loop, cls._endpoint = loop, endpoint
            assert cls._endpoint is not None
            return cls._loop, cls._endpoint

    @classmethod
    async def served(cls, settings: str, vf: Any, env_config: Any) -> Any:
        """The verifiers env of `settings`, serving: started once, in a task of its own that every episode awaits
        (an episode's time limit cancels its wait, never the start)."""
        config, starting = cls._served.get(settings, (None, None))
        if config is not env_config:  # first, or the run's settings were checked anew (modules reloaded)
            starting = asyncio.ensure_future(cls._serve(vf, env_config))
            cls._served[settings] = (env_config, starting)

            def forget_failed(task: asyncio.Future) -> None:
                if task.cancelled() or task.exception() is not None:  # (retrieved: never logged as lost)
                    if cls._served.get(settings, (None, None))[1] is task:
                        del cls._served[settings]  # the next episode tries again

            starting.add_done_callback(forget_failed)
        return await asyncio.shield(starting)

    @classmethod
    async def _serve(cls, vf: Any, env_config: Any) -> Any:
        env = vf.load_environment(env_config)
        await cls._stack.enter_async_context(env.serving())
        return env


async def _on_verifiers_loop(coroutine: Any) -> Any:
    """Await `coroutine` run on the verifiers loop (`_VerifiersLoop`); cancelling this cancels it there."""
    loop, _ = _VerifiersLoop.get()
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, loop))


class VerifiersHarness(TokenEnvironment):
    """One episode of a verifiers task, run by its harness (module docstring). Its calls are awaited on lit-rl's
    environment runner and run on the verifiers loop (`_VerifiersLoop`).

    Args:
        tokenizer: the run's tokenizer (given by lit-rl): verifiers' renderer renders with it.
        taskset: the taskset id (the data spec's).
        harness: the harness id (a module, installed or beside the run, whose `__all__` exports one `vf.Harness`);
            None: the taskset package's own.
        taskset_args: the taskset config's fields, if it needs some.
        harness_args: the harness config's fields.
        agent_args: more of verifiers' agent config (`runtime` is `{type: subprocess}` unless given).
        renderer_args: the renderer's settings (`renderers.DefaultRendererConfig`): `tool_parser: qwen3` reads the
            model's tool calls in Qwen's `<tool_call>` JSON, for a harness that offers tools.
        allow_code_execution: run a harness that executes code (verifiers' `EXECUTES_CODE`) on this machine.
    """

    def __init__(
        self,
        tokenizer: str,
        taskset: str,
        harness: Optional[str] = None,
        taskset_args: Optional[dict[str, Any]] = None,
        harness_args: Optional[dict[str, Any]] = None,
        agent_args: Optional[dict[str, Any]] = None,
        renderer_args: Optional[dict[str, Any]] = None,
        allow_code_execution: bool = False,
    ) -> None:
        super().__init__(tokenizer)
        settings = dict(
            taskset=taskset,
            harness=harness,
            taskset_args=taskset_args or {},
            harness_args=harness_args or {},
            agent_args=agent_args or {},
            renderer_args=renderer_args or {},
            allow_code_execution=allow_code_execution,
        )
        self.settings = json.dumps(settings, sort_keys=True)
        self.vf, self.env_config, self.renderer, self.reward_names = _checked_env_config(self.settings)
        self.traces: list[str] = []  # the ids of the episode's traces (a retried attempt mints another)
        self.requests: Optional[asyncio.Queue[TurnRequest]] = None
        self.episode: Optional[asyncio.Future] = None
        self.pending: Optional[TurnRequest] = None
        self.context: list[int] = []

    async def reset(self, row: dict[str, Any]) -> TokenIds:
        """Start the harness's program on the row's task; its first model call's ids are the episode's prompt."""
        return await _on_verifiers_loop(self._start(row))

    async def step(self, turn: SampledTurn) -> StepResult:
        """Answer the harness's call with the sampled turn; the ids its next call adds (an observation), or the
        episode's end when its program is done."""
        return await _on_verifiers_loop(self._step(turn))

    async def finish(self) -> dict[str, float]:
        """The task's rewards of the episode's trace, each weighted."""
        return await _on_verifiers_loop(self._finish())

    async def close(self) -> None:
        await _on_verifiers_loop(self._close())

    async def _start(self, row: dict[str, Any]) -> TokenIds:
        try:
            return await self._begin(row)
        except BaseException:  # a failure, or the runner's time limit: nothing of the episode is left running
            self._abort()
            raise

    async def _begin(self, row: dict[str, Any]) -> TokenIds:
        vf = self.vf
        env = await _VerifiersLoop.served(self.settings, vf, self.env_config)
        task = row_task(row, env.taskset.config, type(env.taskset).task_type())
        _, endpoint = _VerifiersLoop.get()
        self.requests = requests = asyncio.Queue()

        def minted(trace: Any) -> None:  # before the harness's first call: its calls come to this episode
            endpoint.episodes[trace.id] = requests
            self.traces.append(trace.id)

        client = vf.TrainClientConfig(
            base_url=endpoint.url,
            api_key_var="LIT_RL_NO_KEY",  # the endpoint is lit-rl's own: no key
            headers={SECRET_HEADER: endpoint.secret},
            renderer=self.renderer,
            renderer_model_name=self.tokenizer,
        )
        # lit-rl samples with its own settings (model.sampling): the harness's are not read.
        ctx = vf.ModelContext(model=MODEL, client=client, sampling=vf.SamplingConfig())
        self.episode = asyncio.ensure_future(env.run_slot(env.slots(task, 1)[0], ctx, on_trace=minted))
        first = await self._next_request()
        if first is None:
            raise ValueError(f"the harness ended the episode without calling the model: {_failure(self.episode)}")
        self.context = list(first.token_ids)
        return TokenIds(first.token_ids)

    async def _step(self, turn: SampledTurn) -> StepResult:
        try:
            return await self._answer(turn)
        except BaseException:
            self._abort()
            raise

    async def _answer(self, turn: SampledTurn) -> StepResult:
        assert self.pending is not None
        TurnEndpoint.answer(self.pending, turn)
        self.pending = None
        self.context += turn.ids
        request = await self._next_request()
        if request is None:
            return StepResult(None, done=True)
        known = len(self.context)
        if request.token_ids[:known] != self.context:
            differs = next((k for k, (a, b) in enumerate(zip(request.token_ids, self.context)) if a != b), known)
            raise ValueError(
                f"the harness's next model call does not extend the episode's tokens (they differ from token {differs}"
                f" of {known}): it rewrote the conversation, which lit-rl cannot train token-in, token-out"
            )
        self.context = list(request.token_ids)
        return StepResult(TokenIds(request.token_ids[known:]))

    async def _finish(self) -> dict[str, float]:
        try:
            return await self._scored()
        finally:
            self._abort()  # scored, failed or past its time limit: the episode is over

    async def _scored(self) -> dict[str, float]:
        assert self.episode is not None
        # lit-rl's limits ended the episode while the program goes on: each call it still makes is answered with no
        # tokens ("length"), until it ends (a refusal would fail its trace, which verifiers then does not score).
        while self.pending is not None:
            TurnEndpoint.answer(self.pending, SampledTurn([], [], stopped=False))
            self.pending = None
            await self._next_request()
        episode = await self.episode
        traces = list(episode.traces)
        if len(traces) != 1 or not traces[0].rewards:
            raise ValueError(f"the harness's episode was not scored: {_failure(self.episode)}")
        rewards = traces[0].rewards
        missing = [name for name in self.reward_names if rewards.get(name) is None]
        if missing:
            raise ValueError(f"the task did not score {missing}: {_failure(self.episode)}")
        return {name: rewards[name].value for name in self.reward_names}

    async def _close(self) -> None:
        self._abort()

    def _abort(self) -> None:
        """End what is left of the episode, on the verifiers loop: every call waiting is refused, the program is
        cancelled, and its trace ids are forgotten (idempotent)."""
        waiting = [self.pending] if self.pending is not None else []
        while self.requests is not None and not self.requests.empty():
            waiting.append(self.requests.get_nowait())
        for turn in waiting:
            TurnEndpoint.refuse(turn, "lit-rl ended the episode")
        self.pending = None
        if self.episode is not None and not self.episode.done():
            self.episode.cancel()
        _, endpoint = _VerifiersLoop.get()
        for trace in self.traces:
            endpoint.episodes.pop(trace, None)

    async def _next_request(self) -> Optional[TurnRequest]:
        """The harness's next model call, or None once its episode has ended."""
        assert self.episode is not None and self.requests is not None
        getting = asyncio.ensure_future(self.requests.get())
        try:
            await asyncio.wait({getting, self.episode}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getting.done():  # this wait ended or was cancelled: the next call stays in the queue
                getting.cancel()
            elif not getting.cancelled():  # taken off the queue: pending, so that `_abort` refuses it if cancelled
                self.pending = getting.result()
        if self.pending is not None:
            return self.pending
        if self.episode.cancelled():
            raise ValueError("the harness's episode was cancelled")
        if self.episode.exception() is not None:
            raise ValueError(f"the harness's episode raised {_failure(self.episode)}") from None
        return None


def _failure(episode: asyncio.Future) -> str:
    """What went wrong in a finished verifiers episode, in one line."""
    if episode.cancelled():
        return "cancelled"
    if episode.exception() is not None:
        return f"{type(episode.exception()).__name__}: {one_line(episode.exception())}"
    result = episode.result()
    errors = [*result.errors, *(e for trace in result.traces for e in trace.errors)]
    return one_line(errors[0].message) if errors else "no error was recorded"


@functools.lru_cache(maxsize=8)
def _checked_env_config(settings_json: str) -> tuple[Any, Any, Any, tuple[str, ...]]:
    """(verifiers.v1, the env config, the renderer's config, the reward names), checked once per run: a one-line
    `ConfigError` for a taskset, harness or renderer that does not load, and the refusals of the module docstring."""
    from lit_rl.data.verifiers_tasksets import load_taskset, module_name
    from lit_rl.importing import import_module

    settings = json.loads(settings_json)
    taskset = settings["taskset"]
    vf, config, loaded = load_taskset(taskset, settings["taskset_args"], lambda m: ConfigError(f"{WHERE}: {m}"))
    harness = settings["harness"]
    try:
        from verifiers.v1.utils.loaders import default_harness_id, environment_class, harness_class

        if environment_class(taskset) is not vf.SingleAgentEnv:  # several agents: several traces an episode
            raise ConfigError(f"{WHERE}: taskset {taskset!r}: its package exports its own Env; lit-rl runs one agent")
        if harness is None:
            harness = default_harness_id(taskset)
            if harness == "bash":  # verifiers' default: a shell for the model, installed from the network
                raise ConfigError(
                    f"{WHERE}: taskset {taskset!r} exports no Harness: name one (harness: <module>); verifiers' "
                    "default, bash, gives the model a shell on this machine"
                )
        if importlib.util.find_spec(f"verifiers.v1.harnesses.{module_name(harness)}") is None:
            import_module(module_name(harness))  # a module beside the run, as for tasksets
        chosen = harness_class(harness)
        if chosen.NEEDS_CONTAINER:
            raise ConfigError(f"{WHERE}: harness {harness!r} needs a container (NEEDS_CONTAINER); lit-rl runs it here")
        if chosen.EXECUTES_CODE and not settings["allow_code_execution"]:
            raise ConfigError(
                f"{WHERE}: harness {harness!r} runs the model's code on this machine (EXECUTES_CODE): set "
                "allow_code_execution: true to run it"
            )
        taken = sorted(set(settings["agent_args"]) & LIT_RL_AGENT_KEYS)
        if taken:
            raise ConfigError(
                f"{WHERE}.agent_args.{taken[0]}: lit-rl sets the model, client and sampling of every call, and an "
                "episode is one attempt (a retry would be another episode's transcript)"
            )
        agent = {"runtime": {"type": "subprocess"}, **settings["agent_args"]}
        agent["harness"] = {**settings["harness_args"], "id": harness}
        env_config = vf.resolve_env_config({"taskset": {**settings["taskset_args"], "id": taskset}, "agent": agent})
        task_class = loaded.task_type()
        if getattr(task_class, "NEEDS_CONTAINER", False):
            raise ConfigError(f"{WHERE}: taskset {taskset!r}: {task_class.__name__} needs a container")
        if config.task.judges:
            raise ConfigError(f"{WHERE}: taskset {taskset!r}: its task config plugs judges, which call a model")
        rewards = task_class(task_class.data_type().model_construct(), config.task).hooks("reward")
        if not rewards:
            raise ConfigError(f"{WHERE}: taskset {taskset!r}: {task_class.__name__} has no @vf.reward function")
    except ConfigError:
        raise
    except Exception as err:  # verifiers' or the user's code: its message, in one line
        raise ConfigError(f"{WHERE}: harness {harness!r}: {type(err).__name__}: {one_line(err)}") from None
    try:
        from renderers import CustomRendererConfig

        from lit_rl.envs.verifiers_renderer import IMPORT_PATH

        renderer = CustomRendererConfig(**settings["renderer_args"], import_path=IMPORT_PATH)
    except Exception as err:
        raise ConfigError(f"{WHERE}: renderer_args: {type(err).__name__}: {one_line(err)}") from None
    return vf, env_config, renderer, tuple(function.__name__ for function in rewards)
