"""Which producer a run's settings choose, built with its arguments: episodes with `model.env` (`EpisodeProducer`),
generations sampled ahead with `model.rollout.max_staleness > 0` (`AsyncProducer`; with an environment
`AsyncEpisodeProducer`), else each generation when its first micro-step comes (`RolloutProducer`); or a user's
subclass of the one chosen, named by `model.rollout.producer`.

With an environment the choice also fixes how prompts are rendered: the tools' schemas (chat-format tool calls), or
each row's environment's (several environments by name), which the module keeps for its checks of prompt lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from lit_rl.config import EnvArgs, RolloutArgs
from lit_rl.envs import environment_factory
from lit_rl.envs.chat_tools import (
    OTHER,
    RESPONSE_TEMPLATE,
    TRLS_RESPONSE_TEMPLATE,
    TemplateCalls,
    template_tool_support,
    trls_response_template,
)
from lit_rl.envs.runner import EnvironmentRunner
from lit_rl.envs.trl_environments import EnvironmentRouting
from lit_rl.errors import ConfigError
from lit_rl.importing import import_callable
from lit_rl.resume import say
from lit_rl.rollout.async_episodes import AsyncEpisodeProducer
from lit_rl.rollout.in_flight import EXPERIMENTAL as IN_FLIGHT_EXPERIMENTAL
from lit_rl.rollout.producer import AsyncProducer, EpisodeProducer, ProducerParts, RolloutProducer


@dataclass(frozen=True)
class ProducerChoice:
    """The run's producer, and how its prompts are rendered."""

    producer: RolloutProducer
    prompt_tools: Optional[list[dict]] = None  # the tools' schemas the prompts are rendered with (chat format)
    prompt_routing: Optional[EnvironmentRouting] = None  # several environments: each row's own tools


def choose_producer(
    parts: ProducerParts, env: EnvArgs, rollout: RolloutArgs, tokenizer: Any, steps_per_generation: int
) -> ProducerChoice:
    """The producer `model.env` and `model.rollout` choose (module docstring), made of `parts`;
    `steps_per_generation`: the optimizer steps taken on one generation (asynchronous producers' schedule)."""
    chosen, args, tools, routing = _chosen(parts, env, rollout, tokenizer, steps_per_generation)
    path = rollout.producer
    if path is None:
        return ProducerChoice(chosen(**args), tools, routing)
    try:
        cls = import_callable(path, "model.rollout.producer")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    choices = (RolloutProducer, EpisodeProducer, AsyncProducer, AsyncEpisodeProducer)
    # The chosen class itself, or a subclass of yours: not one of lit-rl's others, built with other arguments.
    narrower = [other for other in choices if other is not chosen and issubclass(other, chosen)]
    if not (isinstance(cls, type) and issubclass(cls, chosen) and not issubclass(cls, tuple(narrower) or ())):
        raise ConfigError(
            f"model.rollout.producer {path!r} must be a subclass of {chosen.__module__}.{chosen.__qualname__}, "
            "the producer this run's settings choose (model.env, model.rollout.max_staleness), built with its "
            "arguments"
        )
    return ProducerChoice(cls(**args), tools, routing)


def _chosen(
    parts: ProducerParts, env: EnvArgs, rollout: RolloutArgs, tokenizer: Any, steps_per_generation: int
) -> tuple[type[RolloutProducer], dict[str, Any], Optional[list[dict]], Optional[EnvironmentRouting]]:
    """The producer class, its arguments, and the prompts' tools and routing (`choose_producer`)."""
    if env.enabled:
        support = template_tool_support(tokenizer)
        # A format lit-rl does not read, a template TRL knows: read as TRL's GRPOTrainer reads it.
        trls = trls_response_template(tokenizer) if support == OTHER and env.tool_format != "tags" else None
        if trls is not None:
            support = RESPONSE_TEMPLATE
        spec = environment_factory(
            env.environment,
            env.environment_args,
            env.tools,
            env.tool_format,
            support,
            TemplateCalls.of(tokenizer, trls) if support == RESPONSE_TEMPLATE else None,
            tokenizer_name=tokenizer.name_or_path,
        )
        if trls is not None and spec.raw_turns:
            say(TRLS_RESPONSE_TEMPLATE)
        episode_args = dict(
            parts=parts,
            env_factory=spec.factory,
            env_reward_names=spec.reward_names,
            max_turns=env.max_turns,
            max_total_tokens=env.max_total_tokens,
            runner=EnvironmentRunner(env.concurrency, env.step_timeout_s),
            tool_schemas=spec.tool_schemas,
            independent_turns=env.independent_turns,
            raw_turns=spec.raw_turns,
            routing=spec.routing,
            ready_batches=env.ready_batches,
        )
        if rollout.max_staleness == 0:
            return EpisodeProducer, episode_args, spec.tool_schemas, spec.routing
        if rollout.in_flight_updates:
            say(IN_FLIGHT_EXPERIMENTAL)  # until its accuracy is fixed (lit_rl.rollout.in_flight)
        asynchronous = dict(
            steps_per_generation=steps_per_generation,
            max_staleness=rollout.max_staleness,
            in_flight_updates=rollout.in_flight_updates,
        )
        return AsyncEpisodeProducer, {**episode_args, **asynchronous}, spec.tool_schemas, spec.routing
    if rollout.in_flight_updates:
        raise ConfigError(
            "model.rollout.in_flight_updates needs model.env: weights change between an episode's turns, and a "
            "single completion is one turn (without model.env, max_staleness alone bounds its lag)"
        )
    if rollout.max_staleness > 0:
        lag = dict(steps_per_generation=steps_per_generation, max_staleness=rollout.max_staleness)
        return AsyncProducer, dict(parts=parts, **lag), None, None
    return RolloutProducer, dict(parts=parts), None, None
