"""Environments for multi-turn rollouts: the `Environment` protocol, and tools (`lit_rl.envs.tools`).

An environment is given by import path (`--model.env.environment my_pkg.envs.MyEnv`, built with
`--model.env.environment_args`), or made from `--model.env.tools` (the built-in `ToolEnvironment`, or with calls in
the model's chat format `ChatToolEnvironment`, `lit_rl.envs.chat_tools`); a TRL environment class runs unchanged in
`TRLEnvironment` (`lit_rl.envs.trl_environments`); an OpenEnv server's episodes run in `OpenEnv`
(`lit_rl.envs.openenv`), an OpenEnv MCP tool environment's in `OpenEnvTools` (`lit_rl.envs.openenv_tools`); a
verifiers task's in `Verifiers` (one chat turn) or, run by its harness, `VerifiersHarness`
(`lit_rl.envs.verifiers_harness`: a `TokenEnvironment`, which exchanges token ids). The rollout runs it token-in,
token-out (`lit_rl.rollout.multi_turn`).
"""

from lit_rl.envs.base import (
    Environment,
    SampledTurn,
    StepResult,
    TokenEnvironment,
    TokenIds,
    as_step_result,
    environment_factory,
)
from lit_rl.envs.chat_tools import ChatToolEnvironment
from lit_rl.envs.openenv import OpenEnv
from lit_rl.envs.openenv_tools import OpenEnvTools
from lit_rl.envs.tools import ToolEnvironment, calc
from lit_rl.envs.trl_environments import TRLEnvironment
from lit_rl.envs.verifiers_harness import VerifiersHarness
from lit_rl.envs.verifiers_tasks import Verifiers

__all__ = [
    "ChatToolEnvironment",
    "Environment",
    "OpenEnv",
    "OpenEnvTools",
    "SampledTurn",
    "StepResult",
    "TRLEnvironment",
    "TokenEnvironment",
    "TokenIds",
    "ToolEnvironment",
    "Verifiers",
    "VerifiersHarness",
    "as_step_result",
    "calc",
    "environment_factory",
]
