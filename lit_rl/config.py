"""The option groups every algorithm shares, each field defined and documented once.

An algorithm's `__init__` names the groups it uses and the few options that are its own, so the command line reads
by concern (`--model.sampling.temperature 0.7`, `--model.optim.learning_rate 5e-5`, `--model.policy.lora.r 8`) and
`lit-rl fit --model.help GRPO` lists every key with its documentation. An algorithm with other defaults passes its
own instance (`sampling: SamplingArgs = SamplingArgs(num_generations=4)`); the instances are frozen, so one default
is never changed by a run.

lit-rl 0.1 took these options flat (`--model.temperature`); `MOVED_KEYS` maps each old key to its group, so an old
key fails in one line that names its new place (`lit_rl.cli`) and a 0.1 checkpoint's hyperparameters are compared
key by key on resume (`grouped_hparams`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, TypeVar, Union

from lit_rl.data.schedule import MAX_REFILLS
from lit_rl.envs.chat_tools import check_tool_format
from lit_rl.envs.runner import check_runner_settings
from lit_rl.errors import ConfigError
from lit_rl.loss_config import LOSS_GROUPS
from lit_rl.losses import IS_CORRECTIONS
from lit_rl.modeling.lora import LoRAConfig, as_lora_config, check_lora_config
from lit_rl.modeling.models import MODEL_DTYPES
from lit_rl.rollout.engine_config import (
    EngineConfig,
    engine_from_config,
    engine_key_of_0_1,
    engine_of_0_1,
)
from lit_rl.training.compat import flash_attention_installed

INVALID_REWARD_ACTIONS = ("zero", "error")
# transformers' built-in attention kernels (`model.policy.attn_implementation`); its hub kernels are left out.
ATTENTION_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
    "flex_attention",
)


@dataclass(frozen=True)
class PolicyArgs:
    """The policy: which model, how it is loaded, and the forward path its training passes take.

    Args:
        model_name_or_path: policy to train: a hub id, a local directory, or `lit-rl/<asset>` for a shipped one.
        dtype: dtype the policy is loaded in (`float32`, `bfloat16`, `float16`, `auto`); `float16` only under LoRA,
            whose adapters train in float32 (AdamW cannot train float16 parameters: refused in one line).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        trust_remote_code: allow model code from the model repository (off by default: it runs that code).
        lora: train a LoRA adapter (`configs/peft/lora.yaml`) instead of the full weights; the reference is then
            the policy with its adapter disabled. Keys: `lit_rl.modeling.lora.LoRAConfig` (`--model.policy.lora.r 8`).
        padding_free: run the training forwards (policy, reference, old log-probs) on the rows' real tokens laid
            end to end, without padding (`lit_rl.modeling.packing`): the same values to float rounding, less
            compute when lengths vary. It replaces the shared-prompt forward.
        head_chunk_tokens: run the output head on that many completion tokens at a time (`lit_rl.modeling.head`),
            so the `[tokens, vocab]` logits never exist beyond one chunk: the memory of long completions at a large
            vocabulary, for one more head forward per trained token. None: the whole micro-batch's logits at once.
        compile: `torch.compile` the policy (`nn.Module.compile`: its state dict and checkpoints are unchanged), so
            its training forwards and backward run fused kernels: the same values to float rounding, after a compile
            of tens of seconds at the first step and once more when shapes change. Decoding stays eager (for a
            compiled decoder: `configs/rollout/hf_compiled.yaml`). Not with sharded parameters (ZeRO-3, FSDP).
        attn_implementation: the attention kernel of the policy, its reference and PPO's critic, one of
            transformers' built-in ones (`ATTENTION_IMPLEMENTATIONS`; a flash kernel only with its package
            installed); None: the model's default (`sdpa`). On CPUs in bf16-true, `eager` (matmuls and a softmax)
            trains 40-token rows 1.3-1.4x as fast as `sdpa`'s kernel (`benchmarks/train_mfu.py`,
            docs/speed-and-memory.md); on GPUs keep `sdpa` or a flash kernel.
    """

    model_name_or_path: str = "lit-rl/tiny-qwen2-addition-sft"
    dtype: str = "float32"
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: Optional[LoRAConfig] = None
    padding_free: bool = False
    head_chunk_tokens: Optional[int] = None
    compile: bool = False
    attn_implementation: Optional[str] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora", as_lora_config(self.lora))  # a dict from a checkpoint or a test

    def check(self) -> None:
        check_lora_config(self.lora)
        if self.dtype not in MODEL_DTYPES:  # else named only as `dtype` when the model loads
            raise ConfigError(f"model.policy.dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
        if self.head_chunk_tokens is not None and self.head_chunk_tokens < 1:
            raise ConfigError(f"model.policy.head_chunk_tokens must be >= 1 (or null), got {self.head_chunk_tokens}")
        check_attention_implementation(self.attn_implementation)


def check_attention_implementation(name: Optional[str]) -> None:
    """Only transformers' built-in attention kernels, and a flash kernel only where its package is installed: a hub
    kernel ("org/repo"), or the one transformers fetches for `flash_attention_N` when the package is missing, would
    download and run code."""
    if name is None:
        return
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigError(
            f"model.policy.attn_implementation must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)} (or null), "
            f"got {name!r}"
        )
    if name.startswith("flash_attention_") and not flash_attention_installed(name):
        raise ConfigError(
            f"model.policy.attn_implementation={name} needs its flash-attn package installed here (without it, "
            "transformers would download a kernel from the hub and run it)"
        )


@dataclass(frozen=True)
class OptimArgs:
    """AdamW and its learning-rate schedule (a linear warm-up, then constant).

    Args:
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
    """

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0

    def check(self) -> None:
        if self.learning_rate < 0:
            raise ConfigError(f"model.optim.learning_rate must be >= 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ConfigError(f"model.optim.weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ConfigError(f"model.optim.warmup_steps must be >= 0 (0: no warm-up), got {self.warmup_steps}")


@dataclass(frozen=True)
class ScheduleArgs:
    """How each generation's completions become optimizer steps (`lit_rl.data.schedule`): a generation is
    `micro_batch_size x trainer.accumulate_grad_batches x steps_per_generation` completions per rank, trained on
    for `num_iterations` passes of `steps_per_generation` optimizer steps each.

    Args:
        micro_batch_size: completions per `training_step` on each rank.
        steps_per_generation: optimizer steps taken on each generation's buffer (per pass).
        num_iterations: passes over each generation's buffer (PPO epochs); > 1 computes old log-probs.
        micro_batch_tokens: group each optimizer step's completions into at most `accumulate_grad_batches`
            micro-batches of at most this many real (prompt + completion) tokens instead of `micro_batch_size`
            each (`lit_rl.training.micro_batches`); the step's completions and loss stay the same. None: fixed
            counts.
    """

    micro_batch_size: int = 16
    steps_per_generation: int = 1
    num_iterations: int = 1
    micro_batch_tokens: Optional[int] = None

    def check(self) -> None:
        for key in ("micro_batch_size", "steps_per_generation", "num_iterations"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model.schedule.{key} must be >= 1, got {getattr(self, key)}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ConfigError(
                f"model.schedule.micro_batch_tokens must be >= 1 (or null), got {self.micro_batch_tokens}"
            )


@dataclass(frozen=True)
class SamplingArgs:
    """How completions are sampled, for training and for validation.

    Args:
        num_generations: G, completions sampled per prompt (the group).
        max_new_tokens: completion budget T_max.
        min_new_tokens: no completion stops (EOS or a stop id) before this many tokens.
        temperature: sampling temperature; log-probs are computed at this temperature.
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        max_prompt_length: truncate prompts to their last `max_prompt_length` tokens (None: no limit).
        val_temperature: sampling temperature for validation (0: greedy).
        val_num_generations: completions per validation prompt.
    """

    num_generations: int = 8
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: Optional[int] = None
    val_temperature: float = 0.0
    val_num_generations: int = 1

    def check(self, min_generations: int = 2) -> None:
        """`min_generations`: 2 where completions of a prompt are compared, 1 where a critic is the baseline."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"model.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_generations < min_generations:
            compared = " (completions of a prompt are compared)" if min_generations > 1 else ""
            raise ConfigError(
                f"model.sampling.num_generations must be >= {min_generations}{compared}, got {self.num_generations}"
            )
        if self.temperature <= 0 or not math.isfinite(self.temperature):
            raise ConfigError(f"model.sampling.temperature must be > 0 for training rollouts, got {self.temperature}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"model.sampling.min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens}"
            )
        if self.val_num_generations < 1:
            raise ConfigError(f"model.sampling.val_num_generations must be >= 1, got {self.val_num_generations}")
        if self.val_temperature < 0 or not math.isfinite(self.val_temperature):  # else it fails at the first validation
            raise ConfigError(f"model.sampling.val_temperature must be >= 0 (0: greedy), got {self.val_temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"model.sampling.top_p must be in (0, 1] (1: off), got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"model.sampling.top_k must be >= 0 (0: off), got {self.top_k}")
        check_length_limit("model.sampling.max_prompt_length", self.max_prompt_length)

    def check_engine(self, engine: EngineConfig) -> None:
        """Temperatures the engine would sample at another value than asked (`EngineConfig.min_temperature`), while
        the trainer computes log-probs at the one asked."""
        floor = engine.min_temperature
        for key, value in (("temperature", self.temperature), ("val_temperature", self.val_temperature)):
            if 0 < value < floor:
                raise ConfigError(
                    f"model.sampling.{key} must be 0 (greedy) or >= {floor} with {type(engine).__name__}, which "
                    f"samples a lower one at {floor}; got {value}"
                )


def check_length_limit(key: str, limit: Optional[int]) -> None:
    """A truncation keeps at least one token: `limit` None (no limit) or >= 1."""
    if limit is not None and limit < 1:
        raise ConfigError(f"{key} must be >= 1 (or null: no limit), got {limit}")


@dataclass(frozen=True)
class RewardArgs:
    """The reward functions that score completions (TRL's `reward_funcs` and `reward_weights`).

    Args:
        funcs: import paths of reward functions `(prompts, completions, **columns) -> list[float]` (None: the
            built-in addition task's `lit_rl.rewards.arithmetic.correctness`).
        weights: one weight per reward function (default: all 1.0); the reward is the weighted sum.
        on_invalid: what a NaN/None/inf reward value does: `zero` counts it as 0 (and in the metric
            `frac_invalid_reward`), `error` stops the run naming the reward function.
    """

    funcs: Optional[list[str]] = None
    weights: Optional[list[float]] = None
    on_invalid: str = "zero"

    def check(self) -> None:
        if self.on_invalid not in INVALID_REWARD_ACTIONS:
            choices = " or ".join(repr(action) for action in INVALID_REWARD_ACTIONS)
            raise ConfigError(f"model.rewards.on_invalid must be {choices}, got {self.on_invalid!r}")


@dataclass(frozen=True)
class EnvArgs:
    """Multi-turn episodes in an environment (`lit_rl.rollout.multi_turn`); with neither `environment` nor `tools`
    each completion is a single turn.

    Args:
        environment: the import path of an environment class (`lit_rl.envs.Environment`: `reset(row)`,
            `step(turn_text)`, or TRL's kind: `reset(**row)` and tool methods), one per episode, built with
            `environment_args`. Each completion is then the episode's transcript, token-in and token-out; only the
            model's tokens are trained. Or `{name: import path}` of TRL environment classes, TRL's dict: each row's
            `environment` column names its episodes' class.
        environment_args: keyword arguments of the environment class (with several by name: `{name: {...}}`).
        tools: import paths of tools (`lit_rl.envs.tools.calc`, or functions with type hints and docstrings);
            alone they run in the built-in `ToolEnvironment` or `ChatToolEnvironment` (`tool_format`).
        tool_format: how the model calls tools. `chat`: in its chat template's format (`lit_rl.envs.chat_tools`:
            the tools' schemas go into the prompt through the template, calls are `<tool_call>{json}</tool_call>`
            (Qwen, Hermes), Llama 3.x's bare JSON, a pythonic list `[f(x=1)]` or what the tokenizer's response
            template reads, results come back as `tool` messages); `tags`: the built-in
            `<name>argument</name>` answered `<result>value</result>` (the tiny model's); `auto`: `chat` when the
            tokenizer's chat template renders tools, else `tags`.
        max_turns: the most model turns of an episode.
        max_total_tokens: the most tokens of a transcript after the prompt, model and observation tokens (None:
            `max_turns x sampling.max_new_tokens`).
        concurrency: the most environment calls (`reset`, `step`) running at once, off the training thread
            (`lit_rl.envs.runner`); 1 runs them one after another. Environments of different episodes then run
            at the same time: they must not share mutable state without a lock.
        step_timeout_s: the time limit of one `reset` or `step`. A step that overruns ends its episode and is
            counted in `env_timeouts`; a `reset` that overruns stops the run in one line.
        independent_turns: after the first turn, each episode goes on on its own: its next turn goes to the engine
            as soon as its observation is back (`lit_rl.rollout.multi_turn`), where the engine takes requests from
            many threads with no collective (the vLLM server engine, on every process; the colocated vLLM engine
            with an engine per rank, into vLLM's own scheduler; asynchronous episodes on the server's worker). false,
            or any other engine: turn by turn, every running episode's turn in one batch. The same tokens are sampled
            either way (each turn is seeded by its episode and turn).
        ready_batches: on an engine without such calls (HF `generate`; any engine with `independent_turns: false`),
            on one process, or on each of several apart where a call involves no other rank (HF `generate` on whole
            weights: DDP, ZeRO-2; not FSDP or ZeRO-3): each call samples the next turns of the episodes whose steps
            are back, without waiting for the slowest step of the turn (a slow step holds the others back by one
            call at most). Off by default: the batches then form by timing, and a row's log-probs change with its
            batch at float rounding (HF `generate` on the tiny model: 1.7e-6), so such a run is not
            bit-reproducible; each turn is still seeded by its episode and turn.
    """

    environment: Optional[Union[str, dict[str, str]]] = None
    environment_args: Optional[dict[str, Any]] = None
    tools: Optional[list[str]] = None
    tool_format: str = "auto"
    max_turns: int = 4
    max_total_tokens: Optional[int] = None
    concurrency: int = 64
    step_timeout_s: float = 60.0
    independent_turns: bool = True
    ready_batches: bool = False

    @property
    def enabled(self) -> bool:
        return self.environment is not None or bool(self.tools)

    def check(self) -> None:
        if self.max_turns < 1:
            raise ConfigError(f"model.env.max_turns must be >= 1, got {self.max_turns}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"model.env.max_total_tokens must be >= 1 (or null), got {self.max_total_tokens}")
        check_runner_settings(self.concurrency, self.step_timeout_s)
        check_tool_format(self.tool_format)


@dataclass(frozen=True)
class RolloutArgs:
    """Where completions come from, and how far behind the policy they may be sampled.

    Args:
        engine: the engine that samples (`lit_rl.rollout.engine_config`): `HFGenerate` (null, the default:
            `generate` on the policy), `VLLMColocate` (`configs/rollout/vllm_colocate.yaml`), `VLLMServer`
            (`configs/rollout/vllm_server.yaml`), or the import path of a subclass of
            `lit_rl.rollout.EngineConfig`. Its options follow it: `--model.rollout.engine.gpu_memory_utilization 0.5`.
        max_staleness: asynchronous rollouts: generation g is sampled in the background by the weights of optimizer
            step max(0, g*m - k) (m = steps_per_generation x num_iterations), so each sample is at most k steps older
            than the policy it first updates (`lit_rl.rollout.asynchronous`); needs an engine that samples in the
            background (`VLLMServer`). With `model.env`, each generation's episodes run in the background, every turn
            by that one version (`lit_rl.rollout.async_episodes`; with TRL's environment classes the reward
            functions score there too). 0 (default):
            synchronous.
        in_flight_updates: with `model.env` and `max_staleness > 0`: the engine takes each version the trainer
            stages for a launch between the episodes' turns, while they run, and the generations' episodes run side
            by side, instead of each generation's to its end by one version (`lit_rl.rollout.in_flight`). Every
            token records its version (`train/staleness/token_mean`); a row's staleness is its oldest token's, bound
            as without them (k, plus a generation's later optimizer steps: k + m - 1). Not bit-reproducible: where
            an episode switches versions depends on timing. Experimental:
            single runs of the tools job have fallen mid-run (docs/environments.md). Default false.
        correction (GRPO, PPO, RLOO): weigh the policy term by the importance ratio of the trainer's probability of
            the sampled tokens over the engine's (`lit_rl.losses.rollout_is_weights` has the formulas):
            `token_truncate` (per token, truncated at `correction_cap`), `sequence_truncate` (the sequence's ratio,
            truncated), `sequence_mask` (the sequence's ratio, or 0 outside [1/cap, cap]), or `none`. `auto`
            (default) is `token_truncate` (RLOO, whose loss is per sequence: `sequence_truncate`) with asynchronous
            rollouts (the engine sampled with older weights) or when the engine computes in another dtype than the
            trainer or in any dtype below float32 (`EngineConfig.numerics_differ`), else `none`.
        correction_cap (GRPO, PPO, RLOO): the cap C of the rollout correction (>= 1).
        dynamic_sampling (GRPO): DAPO's dynamic sampling (`lit_rl.rollout.dynamic_sampling`): groups whose rewards
            all agree are dropped and refill generations of as many prompts sampled until the batch is full.
            Logged: `train/refill_generations`, `train/frac_groups_dropped`. With `max_staleness > 0` the refills
            are sampled when the generation is taken, by the current weights (their staleness starts at 0).
        max_refill_generations (GRPO): the most refill generations one generation may sample (0-63); when they run
            out, the earliest dropped groups fill the batch (they add no gradient).
        producer: your own producer of rollouts, by import path (`my_pkg.MyProducer`). The settings above choose
            the producer class: `lit_rl.rollout.producer`'s `RolloutProducer` (synchronous), `EpisodeProducer`
            (synchronous, with `model.env`) or `AsyncProducer` (`max_staleness > 0`), or
            `lit_rl.rollout.async_episodes.AsyncEpisodeProducer` (both; `in_flight_updates` is one of its
            arguments). Yours must subclass the class they choose, and is built with its arguments; dynamic
            sampling wraps it as it wraps theirs. null (default): that class.
    """

    engine: Optional[EngineConfig] = None
    max_staleness: int = 0
    in_flight_updates: bool = False
    correction: str = "auto"
    correction_cap: float = 2.0
    dynamic_sampling: bool = False
    max_refill_generations: int = 4
    producer: Optional[str] = None

    def __post_init__(self) -> None:
        # None stays None, so that LightningCLI writes the default as null (it cannot write an engine object as
        # a default). A mapping is a checkpoint's `{class_path, init_args}`.
        if isinstance(self.engine, Mapping):
            object.__setattr__(self, "engine", engine_from_config(self.engine))

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's config: `engine`, or `HFGenerate` when it is None."""
        return engine_from_config(self.engine)

    def check(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"model.rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.correction not in ("auto", *IS_CORRECTIONS):
            raise ConfigError(
                f"model.rollout.correction must be one of {['auto', *IS_CORRECTIONS]}, got {self.correction!r}"
            )
        if not self.correction_cap >= 1.0:
            raise ConfigError(f"model.rollout.correction_cap must be >= 1, got {self.correction_cap}")
        if not 0 <= self.max_refill_generations <= MAX_REFILLS:
            raise ConfigError(
                f"model.rollout.max_refill_generations must be in [0, {MAX_REFILLS}], got {self.max_refill_generations}"
            )
        if self.in_flight_updates and self.max_staleness == 0:
            raise ConfigError(
                "model.rollout.in_flight_updates needs model.rollout.max_staleness > 0: weights are updated in flight "
                "only while episodes are sampled in the background"
            )
        engine = self.engine_config
        if self.max_staleness > 0 and not engine.samples_in_background:
            raise ConfigError(
                f"model.rollout.max_staleness > 0 needs an engine that samples in the background, not "
                f"{type(engine).__name__} (it shares the trainer's process and device): use "
                "--model.rollout.engine VLLMServer (configs/rollout/vllm_server.yaml)"
            )
        engine.check()

    def check_taken_by(self, algorithm: str, options: frozenset[str]) -> None:
        """Refuse, in one line, an option of `ROLLOUT_OPTION_TAKERS` set away from its default for an `algorithm`
        that does not take it (`options`: those it takes)."""
        default = RolloutArgs()
        for name, takers in ROLLOUT_OPTION_TAKERS.items():
            if name not in options and getattr(self, name) != getattr(default, name):
                raise ConfigError(f"model.rollout.{name}: {algorithm} does not take it ({takers} only)")


# The rollout options some algorithms take, and which (the others refuse them away from their defaults).
ROLLOUT_OPTION_TAKERS = {
    "correction": "GRPO, PPO and RLOO",
    "correction_cap": "GRPO, PPO and RLOO",
    "dynamic_sampling": "GRPO",
    "max_refill_generations": "GRPO",
}
GRPO_ROLLOUT_OPTIONS = tuple(ROLLOUT_OPTION_TAKERS)  # every one of them is GRPO's


# The groups, by the name an algorithm's `__init__` gives them.
GROUPS: dict[str, type] = {
    "policy": PolicyArgs,
    "optim": OptimArgs,
    "schedule": ScheduleArgs,
    "sampling": SamplingArgs,
    "rewards": RewardArgs,
    "env": EnvArgs,
    "rollout": RolloutArgs,
}
# Every group name an algorithm may take: the shared ones and `loss`, whose class is the objective's own
# (`lit_rl.loss_config`).
GROUP_NAMES: tuple[str, ...] = (*GROUPS, "loss")
# Fields whose name changed when they moved into a group (lit-rl 0.1 key -> field), so that names agree across
# algorithms (GRPO's `epsilon_low` is PPO's and RLOO's `epsilon`; PPO's `whiten_advantages` is RLOO's
# `normalize_advantages`).
RENAMED = {
    "reward_funcs": "funcs",
    "reward_weights": "weights",
    "invalid_reward": "on_invalid",
    "epsilon_low": "epsilon",
    "loss_aggregation": "aggregation",
    "policy_loss": "objective",
    "whiten_advantages": "normalize_advantages",
    "loss_type": "type",
    "vllm": "engine",
    "rollout_is_correction": "correction",
    "rollout_is_cap": "correction_cap",
}
# Names a field had in 0.1 in some algorithm, though other algorithms' fields were renamed to them.
_ALSO_0_1_NAMES = frozenset({"epsilon", "normalize_advantages"})  # PPO's and RLOO's
_GROUP_FIELDS = [(group, field.name) for group, cls in GROUPS.items() for field in dataclasses.fields(cls)]
_GROUP_FIELDS += [("loss", field.name) for cls in LOSS_GROUPS for field in dataclasses.fields(cls)]
# lit-rl 0.1's flat key -> its place now (`temperature` -> `sampling.temperature`, `epsilon_low` -> `loss.epsilon`).
MOVED_KEYS: dict[str, str] = {
    **{
        name: f"{group}.{name}"
        for group, name in _GROUP_FIELDS
        if name not in RENAMED.values() or name in _ALSO_0_1_NAMES
    },
    **{old: f"{group}.{name}" for group, name in _GROUP_FIELDS for old, new in RENAMED.items() if new == name},
}

Args = TypeVar("Args")


def as_args(cls: type[Args], value: Any) -> Args:
    """`value` as a `cls` group: itself, a mapping of its fields (from a checkpoint or a test), or None for the
    defaults. An unknown field is a one-line error naming it."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}
        group = "loss" if cls in LOSS_GROUPS else next((g for g, c in GROUPS.items() if c is cls), cls.__name__)
        unknown = sorted(set(value) - names)
        if unknown:
            raise ConfigError(f"model.{group}.{unknown[0]}: unknown option (the keys are {sorted(names)})")
        return cls(**value)
    raise ConfigError(f"expected {cls.__name__} or a mapping of its fields, got {type(value).__name__}")


def plain_data(value: Any) -> Any:
    """`value` with every option group (a dataclass, at any depth) as a dict of its fields, and an engine choice
    as `{"class_path", "init_args"}` (what a checkpoint keeps: no object of lit-rl's is pickled)."""
    if isinstance(value, EngineConfig):
        return value.as_config()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    return value


def _0_1_value(key: str, value: Any) -> Any:
    """A 0.1 flat key's value as its group field takes it now: `vllm`'s mapping is an engine choice."""
    if key == "vllm":  # with every option, as this version's engine records itself (None: the default)
        return None if value is None else engine_from_config(engine_of_0_1(plain_data(value))).as_config()
    return value


def grouped_hparams(hparams: Mapping[str, Any], own_keys: frozenset[str] = frozenset()) -> dict[str, Any]:
    """A module's saved hyperparameters with lit-rl 0.1's flat keys moved into their groups (`MOVED_KEYS`), so a
    0.1 checkpoint compares with a 0.2 config key by key; groups come back as dicts. `own_keys`: the algorithm's
    own options, which stay where they are (SFT's `max_prompt_length` truncates its data: it is not sampling's)."""
    grouped: dict[str, Any] = {}
    for key, value in hparams.items():
        value = plain_data(value)
        place = MOVED_KEYS.get(key)
        if place is None or key in GROUP_NAMES or key in own_keys:
            grouped[key] = value
            continue
        group, field = place.split(".")
        existing = grouped.get(group)
        grouped[group] = {**(existing if isinstance(existing, Mapping) else {}), field: _0_1_value(key, value)}
    return grouped


def own_options(cls: type) -> frozenset[str]:
    """The options algorithm `cls` takes itself, outside the groups (DPO's `beta`, SFT's `max_prompt_length`)."""
    return frozenset(inspect.signature(cls.__init__).parameters) - {*GROUP_NAMES, "self"}


def _option_parts(key: str) -> list[str]:
    """A dotted option's parts, without the `init_args` a class group's key may carry (`model.init_args.x`)."""
    parts = key.split(".")
    return [parts[0], *parts[2:]] if parts[1:2] == ["init_args"] else parts


def moved_key_hint(key: str, cls: Optional[type] = None) -> Optional[str]:
    """For an option a module rejected (`model.temperature`, `model.init_args.temperature`): where 0.2 put it, or
    None when it did not move, or when algorithm `cls` (if known) takes no such group."""
    parts = _option_parts(key)
    if parts[:2] == ["model", "vllm"] and (cls is None or "rollout" in inspect.signature(cls.__init__).parameters):
        return f"model.rollout.{engine_key_of_0_1(parts[2] if len(parts) > 2 else None)}"
    if parts[:1] != ["model"] or len(parts) != 2:
        return None
    place = MOVED_KEYS.get(parts[-1])
    if place is None:
        return None
    if cls is not None:
        if place.split(".")[0] not in inspect.signature(cls.__init__).parameters:
            return None
    return f"model.{place}"


# TRL's names of group fields that neither lit-rl 0.2 nor 0.1 (`RENAMED`) gives them: TRL's GRPO `loss_type` is
# lit-rl's `loss.aggregation`, with its values renamed (docs/coming-from-trl.md); DPO's is `loss.type` (`RENAMED`).
TRL_RENAMED = {"loss_type": "aggregation"}


def group_class(cls: type, group: str) -> Optional[type]:
    """The class of algorithm `cls`'s `group` (its `loss` is its objective's own), or None when it takes no such
    group. Read from the signature's annotation, which `from __future__ import annotations` leaves a name."""
    parameter = inspect.signature(cls.__init__).parameters.get(group)
    if parameter is None:
        return None
    if isinstance(parameter.annotation, type):
        return parameter.annotation
    return next((c for c in (*GROUPS.values(), *LOSS_GROUPS) if c.__name__ == parameter.annotation), None)


def group_fields(cls: Optional[type], group: str) -> frozenset[str]:
    """The options of `group` in algorithm `cls`, or in any algorithm when `cls` is None (every objective's `loss`)."""
    if cls is not None:
        found = group_class(cls, group)
        classes: tuple[type, ...] = () if found is None else (found,)
    else:
        classes = LOSS_GROUPS if group == "loss" else tuple(c for name, c in GROUPS.items() if name == group)
    return frozenset(field.name for c in classes if dataclasses.is_dataclass(c) for field in dataclasses.fields(c))


def renamed_key_hint(key: str, cls: Optional[type] = None) -> Optional[str]:
    """For a group option a module rejected under an older or TRL name (`model.loss.loss_type`,
    `model.rewards.reward_funcs`): its name in that group now (`model.loss.type`), when algorithm `cls` (if known)
    has it; None otherwise. `moved_key_hint` is for 0.1's flat keys, which had no group."""
    parts = _option_parts(key)
    if parts[:1] != ["model"] or len(parts) != 3 or parts[1] not in GROUP_NAMES:
        return None
    group, old = parts[1:]
    fields = group_fields(cls, group)
    new = next((name for name in (RENAMED.get(old), TRL_RENAMED.get(old)) if name in fields), None)
    return f"model.{group}.{new}" if new is not None else None


def data_key_hint(key: str, data_classes: tuple[type, ...]) -> Optional[str]:
    """For a `model.<name>` option the algorithm rejected that is an option of one of `data_classes`:
    `data.<name>` (DPO and SFT take `micro_batch_tokens` there); None otherwise."""
    parts = _option_parts(key)
    if parts[:1] != ["model"] or len(parts) != 2:
        return None
    if any(parts[1] in inspect.signature(cls.__init__).parameters for cls in data_classes):
        return f"data.{parts[1]}"
    return None
