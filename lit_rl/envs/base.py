"""The `Environment` protocol: what a multi-turn rollout asks of the world the model acts in.

One environment object runs one episode (one completion of one prompt row):

    first = env.reset(row)                  # the first observation: text, chat messages, or None (the row's prompt)
    result = env.step(model_turn_text)      # after each model turn: StepResult(observation, rewards, done)
    parts = env.finish()                    # optional, once the episode has ended: {reward part: value}
    env.close()                             # optional, once at the very end, also after a failure: release a session

`step` may return a `StepResult` or the plain tuple `(observation or None, {reward part: value}, done)`. The
episode ends when `done` is true, when `observation` is None, after `max_turns` model turns, or when the transcript
reaches `max_total_tokens`. Its reward is the sum of the reward parts over its steps and `finish` (each part a
column of its own, named in the class attribute `reward_names`, weight 1) plus the reward functions applied to the
final transcript. TRL's environment classes (a `reset`, and no `step` or a `reset(**row)`) are run by
`lit_rl.envs.trl_environments`.

A `TokenEnvironment` exchanges token ids instead of text: `step` gets the turn's sampled ids and engine log-probs
(`SampledTurn`), and its first observation and observations are `TokenIds`, appended as they are. It is for a world
that renders the conversation itself, as verifiers' harnesses do (`lit_rl.envs.VerifiersHarness`).

Environments run in the trainer's process, on every rank, for that rank's episodes (with asynchronous rollouts, on
rank 0 for every rank's, `lit_rl.rollout.async_episodes`): they must not block for long (a tool call has a time
limit, `lit_rl.envs.tools`) and must not run code from the model unless the user asked for it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, Union, runtime_checkable

from lit_rl.errors import ConfigError, EnvironmentStepError, LitRLError, exception_line, one_line
from lit_rl.importing import import_callable

if TYPE_CHECKING:
    from lit_rl.envs.chat_tools import TemplateCalls
    from lit_rl.envs.trl_environments import EnvironmentRouting


class TokenIds(list):
    """Token ids a `TokenEnvironment` gives as a prompt or an observation: appended as they are, never rendered or
    re-tokenised (a prompt longer than `model.sampling.max_prompt_length` is an error, not cut: the world rendered
    it whole)."""


class SampledTurn(NamedTuple):
    """A model turn as a `TokenEnvironment`'s `step` gets it: the ids the engine sampled (cut to the episode's token
    budget), their log-probs under the engine, and whether it ended on an end-of-turn id (the tokenizer's EOS or
    one of the model's generation config; false: cut at its token budget)."""

    ids: list[int]
    logprobs: list[float]
    stopped: bool = False


Observation = Union[str, list[dict[str, Any]], TokenIds]


@dataclass
class StepResult:
    """What one `step` returns: the next observation (None: the episode ends), reward parts, whether it is done,
    and the tool calls it ran and how many of them failed (an exception or a timeout). An observation is text
    (encoded as is) or chat messages (`[{"role": "tool", "content": ...}]`, rendered by the tokenizer's chat template:
    `lit_rl.envs.chat_tools.ChatRenderer`)."""

    observation: Optional[Observation]
    rewards: dict[str, float] = field(default_factory=dict)
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    reward_names: tuple[str, ...]

    def reset(self, row: dict[str, Any]) -> Optional[Observation]: ...

    def step(self, completion: str) -> StepResult | tuple[Optional[str], dict[str, float], bool]: ...

    # Optional: `finish()` (`FinishesEpisode`), `close()` (`ClosesEpisode`), `steps_after_last_turn`
    # (`SkipsLastTurnCalls`).


@runtime_checkable
class FinishesEpisode(Protocol):
    """An environment with `finish() -> {reward part: value}`, called once when the episode has ended (not when its
    environment failed or overran), for a reward scored from the final state (`TRLEnvironment`'s `get_reward`)."""

    def finish(self) -> dict[str, float]: ...


@runtime_checkable
class ClosesEpisode(Protocol):
    """An environment with `close()`, called once for every episode when its batch ends (after `finish`), also when
    the episode failed or the batch stopped with an exception, to release what it holds (`lit_rl.envs.OpenEnv`'s
    session)."""

    def close(self) -> None: ...


@runtime_checkable
class SkipsLastTurnCalls(Protocol):
    """An environment that says whether the last turn's step runs (`steps_after_last_turn`; without it, it does):
    `TRLEnvironment` says no, as TRL runs no tool call whose result the model would never see."""

    steps_after_last_turn: bool


class TokenEnvironment:
    """An environment that exchanges token ids (module docstring): `reset(row)` may return `TokenIds` (the episode's
    prompt), `step(turn: SampledTurn)` returns `TokenIds` observations. lit-rl builds it with `tokenizer`, the name
    or path of the run's tokenizer (`model.policy`'s), so that its world renders with the tokenizer the policy
    reads."""

    reward_names: tuple[str, ...] = ()

    def __init__(self, tokenizer: str) -> None:
        self.tokenizer = tokenizer


class UserObjectAdapter:
    """An environment lit-rl runs around a user's object (`lit_rl.envs.trl_environments.TRLEnvironment`): messages
    name the user's class, that of `instance`."""

    instance: Any


def env_label(env: Any) -> str:
    """The name of an episode's environment in messages: its class, or the user's under lit-rl's adapters."""
    return type(env.instance if isinstance(env, UserObjectAdapter) else env).__name__


def as_step_result(value: Any, where: str) -> StepResult:
    """`step`'s return value as a StepResult; a clear error naming the environment (`where`) otherwise."""
    if isinstance(value, StepResult):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        observation, rewards, done = value
        try:
            return StepResult(observation, dict(rewards or {}), bool(done))
        except (TypeError, ValueError) as err:
            raise EnvironmentStepError(
                f"{where}.step returned rewards {one_line(repr(rewards), 80)}, not a dict of reward parts ({err})"
            ) from err
    raise EnvironmentStepError(
        f"{where}.step returned {one_line(repr(value), 80)}, not a StepResult or (observation, rewards, done)"
    )


class EnvironmentSpec(NamedTuple):
    """What a run's episodes need: `factory(row)` makes the environment of one episode of `row` (None: no
    environment), the reward part names its episodes report, the JSON schemas of the tools the model calls in its
    chat format (the prompts are rendered with them; None: no such tools), whether `step` is given each turn decoded
    with its special tokens (`raw_turns`: calls read by the tokenizer's `response_template`, whose markup may be
    special tokens; otherwise they are skipped), and with several environments by name, how a row picks its own
    (`routing`; `tool_schemas` is then every environment's, and each prompt gets its environment's)."""

    factory: Optional[Callable[..., Environment]]
    reward_names: tuple[str, ...]
    tool_schemas: Optional[list[dict[str, Any]]] = None
    raw_turns: bool = False
    routing: Optional[EnvironmentRouting] = None


def environment_factory(
    path: Optional[str | dict[str, str]],
    args: Optional[dict[str, Any]],
    tools: Optional[list[str]],
    tool_format: str = "auto",
    tool_support: str = "none",
    template_calls: Optional[TemplateCalls] = None,
    tokenizer_name: Optional[str] = None,
) -> EnvironmentSpec:
    """The `EnvironmentSpec` of the settings `model.env.environment` (an import path), `environment_args`, `tools`
    and `tool_format` (`tool_support`: what the tokenizer's chat template does with tools,
    `lit_rl.envs.chat_tools.template_tool_support`; `template_calls`: its `response_template`'s reader, where it has
    one, `TemplateCalls.of`; `tokenizer_name`: the run's tokenizer, given to a `TokenEnvironment`). Tools alone
    give the built-in `ToolEnvironment`, or in the chat format `ChatToolEnvironment`; a TRL environment class (a
    `reset`, and no `step` or a `reset(**row)`) runs in `TRLEnvironment`, its methods and the tools called in the
    chat format; any other environment is given the tools as `tools=`. A dict `{name: import path}` of TRL classes
    is TRL's dict of environments (`routed_trl_environments`)."""
    from lit_rl.envs.chat_tools import RESPONSE_TEMPLATE, ChatToolEnvironment, tool_schema, uses_chat_tools
    from lit_rl.envs.tools import ToolEnvironment, import_tools
    from lit_rl.envs.trl_environments import is_trl_environment

    if path is None and not tools:
        if args:
            raise ConfigError("model.env.environment_args is set but model.env.environment is not")
        return EnvironmentSpec(None, ())
    functions = import_tools(tools) if tools else []
    if isinstance(path, dict):
        return routed_trl_environments(path, args, functions, tool_format, tool_support, template_calls)
    kwargs = dict(args or {})
    make: Callable[..., Any]
    if path is None:
        chat = uses_chat_tools(tool_format, tool_support)
        make = ChatToolEnvironment if chat else ToolEnvironment
        kwargs["tools"] = functions
    else:
        try:
            user_class = import_callable(path, "environment")
        except ValueError as err:
            raise ConfigError(f"model.env.environment: {err}") from None
        if is_trl_environment(user_class):
            _check_chat_format(path, TRL_KIND, tool_format, tool_support)
            chat = True
            make = functools.partial(_trl_episode, user_class, functions, tool_support, template_calls, False)
        else:
            # A ChatToolEnvironment of the user's or lit-rl's (`lit_rl.envs.OpenEnvTools`) offers its own tools.
            offers_tools = isinstance(user_class, type) and issubclass(user_class, ChatToolEnvironment)
            if offers_tools:
                _check_chat_format(path, "a ChatToolEnvironment, whose tools are", tool_format, tool_support)
            chat, make = (bool(functions) or offers_tools) and uses_chat_tools(tool_format, tool_support), user_class
            if functions:
                kwargs["tools"] = functions
            if isinstance(user_class, type) and issubclass(user_class, TokenEnvironment):
                kwargs.setdefault("tokenizer", tokenizer_name)  # its world renders with the policy's tokenizer
    if chat and isinstance(make, type) and issubclass(make, ChatToolEnvironment):  # lit-rl's, or a subclass of it
        kwargs.setdefault("call_format", tool_support)  # reads calls in the template's format (TRL's: given above)
        if tool_support == RESPONSE_TEMPLATE:
            kwargs.setdefault("template_calls", template_calls)
    try:
        probe = make(**kwargs)  # checks the arguments now, before any rollout
    except TypeError as err:
        hint = ""
        if "call_format" in str(err) or "template_calls" in str(err):  # a ChatToolEnvironment of the user's
            hint = " (a ChatToolEnvironment is built with the template's call_format and template_calls: take them)"
        raise ConfigError(f"model.env.environment {path or make.__name__}: {err}{hint}") from None
    except LitRLError:
        raise
    except Exception as err:  # a sandbox it cannot reach, a file it cannot read: the user's to fix, in one line
        raise EnvironmentStepError(
            f"model.env.environment {path or make.__name__}: building it raised {exception_line(err)}"
        ) from err
    if isinstance(probe, ChatToolEnvironment):  # also TRLEnvironment: its methods' schemas too
        schemas: Optional[list[dict[str, Any]]] = probe.schemas
    else:
        schemas = [tool_schema(function) for function in functions] if chat else None
    reward_names = tuple(getattr(probe, "reward_names", ()))  # a user's class with no reward parts may leave it out
    raw_turns = isinstance(probe, ChatToolEnvironment) and probe.call_format == RESPONSE_TEMPLATE
    return EnvironmentSpec(lambda row=None: make(**kwargs), reward_names, schemas, raw_turns)


def routed_trl_environments(
    paths: dict[str, str],
    args: Optional[dict[str, Any]],
    functions: list[Callable[..., Any]],
    tool_format: str,
    tool_support: str,
    template_calls: Optional[TemplateCalls],
) -> EnvironmentSpec:
    """TRL's dict of environments (`model.env.environment: {name: import path}`, `lit_rl.envs.trl_environments`):
    every class TRL's kind, each built with `environment_args[name]` (none by default); a row's `environment`
    column picks its class. One column per class with a `get_reward`, in the order given."""
    from lit_rl.envs.chat_tools import RESPONSE_TEMPLATE
    from lit_rl.envs.trl_environments import EnvironmentRouting, is_trl_environment

    if not paths:
        raise ConfigError("model.env.environment is an empty mapping: give an import path, or {name: import path}")
    args = dict(args or {})
    for name, options in args.items():
        if name not in paths or not isinstance(options, dict):
            raise ConfigError(
                f"model.env.environment_args.{name}: with several environments, environment_args maps their names "
                f"({', '.join(paths)}) to each one's keyword arguments"
            )
    makers: dict[str, Callable[[], Environment]] = {}
    tools: dict[str, list[dict[str, Any]]] = {}
    owners: dict[str, type] = {}  # reward column -> the class whose get_reward fills it
    for name, path in paths.items():
        where = f"model.env.environment.{name}"
        try:
            user_class = import_callable(path, "environment")
        except ValueError as err:
            raise ConfigError(f"{where}: {err}") from None
        if not is_trl_environment(user_class):
            raise ConfigError(
                f"{where} {path} is not a TRL environment class (a reset, and no step or a reset(**row)): several "
                "environments by name are TRL's environment_factory dict"
            )
        _check_chat_format(path, TRL_KIND, tool_format, tool_support)
        make = functools.partial(
            _trl_episode, user_class, functions, tool_support, template_calls, True, **args.get(name, {})
        )
        try:
            probe = make()  # checks the arguments now, before any rollout
        except TypeError as err:
            raise ConfigError(f"{where} {path}: {err}") from None
        makers[name], tools[name] = make, probe.schemas
        for column in probe.reward_names:  # as TRL: one column per class (two names may share one)
            if owners.setdefault(column, user_class) is not user_class:
                raise ConfigError(
                    f"{where}: two environment classes named {column} both define get_reward, whose column is "
                    "named after the class: rename one"
                )
    routing = EnvironmentRouting(tools)
    every_tool = [schema for name in paths for schema in tools[name]]
    distinct = [schema for i, schema in enumerate(every_tool) if schema not in every_tool[:i]]  # standalone once
    raw_turns = probe.call_format == RESPONSE_TEMPLATE
    return EnvironmentSpec(lambda row: makers[routing.name_of(row)](), tuple(owners), distinct, raw_turns, routing)


def _trl_episode(
    user_class: type,
    functions: list[Callable[..., Any]],
    tool_support: str,
    template_calls: Optional[TemplateCalls],
    routed: bool,
    **options: Any,
) -> Environment:
    """One episode of a TRL environment class: a fresh instance, built with `options`."""
    from lit_rl.envs.trl_environments import TRLEnvironment

    return TRLEnvironment(user_class(**options), functions, tool_support, template_calls, routed=routed)


TRL_KIND = "a TRL environment (a reset, and no step or a reset(**row)), whose methods are tools"


def _check_chat_format(path: str, kind: str, tool_format: str, tool_support: str) -> None:
    """An environment whose tools are called in the chat format (`kind`: what it is, TRL's or a
    ChatToolEnvironment): a one-line error when they cannot be."""
    from lit_rl.envs.chat_tools import CALL_FORMATS, NONE, UNREAD_CALLS

    if tool_format == "tags":
        raise ConfigError(
            f"model.env.environment {path} is {kind} called in the chat format; model.env.tool_format tags cannot "
            "call them"
        )
    if tool_support not in CALL_FORMATS:
        raise ConfigError(
            f"model.env.environment {path} is {kind} called in the chat format, but "
            + ("the tokenizer's chat template does not render tools" if tool_support == NONE else UNREAD_CALLS)
        )
