"""The command line or the checkpoint, never silently: what a run given `--ckpt_path` is configured with.

Lightning lays a checkpoint's hyperparameters over the command line: `--model.optim.learning_rate 0.5` with a checkpoint
trained at 1e-4 trained at 1e-4 without a word, and a checkpoint someone shared could set `trust_remote_code`,
the reward functions or the module's class path (an import of any module) for the run that resumes it. lit-rl
never takes a value from a checkpoint. The run is configured by its own config and command line alone; the
checkpoint's hyperparameters are only compared with them, key by key:

- the same value: nothing to say;
- a key in `MAY_CHANGE_ON_RESUME` (or, for `validate`, and Lightning's `test` and `predict` called from Python,
  any key but `MODEL_IDENTITY`): this run's value takes effect, and one line says so (`lit-rl:
  model.optim.learning_rate 0.5 from this run (the checkpoint has 0.0001)`);
- any other key: the run stops before it starts, with one line naming every such key, this run's value and the
  checkpoint's. A resumed `fit` continues the training the checkpoint holds, and changing its objective halfway
  (`beta`, `num_generations`, the reward functions...) is a new run, not a resume.
- a different algorithm (the checkpoint's class path) stops the run the same way; the path is never imported.

And `load_from_checkpoint` of a lit-rl 0.1 checkpoint, whose flat options a module would silently drop, stops in one
line (`refuse_ungrouped_hyperparameters`).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any, Mapping

from lit_rl.config import GROUP_NAMES, MOVED_KEYS, grouped_hparams, own_options, plain_data
from lit_rl.errors import ConfigError
from lit_rl.rollout.engine_config import EngineConfig, engine_from_config

# What a resumed `fit` may change. The optimizer's rates (the configured ones replace those in the restored
# optimizer state, see `PolicyModule.apply_configured_rates`); how a step's micro-batches are cut by tokens and run
# (the same loss and gradient: the token-budget, packing and attention tests prove it; not `micro_batch_size`, in
# whose micro-batches the checkpoint counts its place: `refuse_moved_position`); validation's sampling; and
# how and where rollouts are produced (`model.rollout.engine`: the engine, the server's address, its timeouts).
# Keys under `model.`; a key names everything below it (`rollout.engine` covers `rollout.engine.server_url`).
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "optim.learning_rate",
        "critic_learning_rate",
        "optim.weight_decay",
        "optim.warmup_steps",
        "schedule.micro_batch_tokens",
        "policy.head_chunk_tokens",
        "policy.gradient_checkpointing",
        "policy.padding_free",
        "policy.attn_implementation",
        "precompute_ref_logprobs",
        "ref_cache_dir",
        "sampling.val_temperature",
        "sampling.val_num_generations",
        "rollout.engine",
    }
)
OPTIMIZER_RATES = frozenset({"optim.learning_rate", "critic_learning_rate", "optim.weight_decay", "optim.warmup_steps"})
# What the checkpoint's weights are: these must match for `validate`, `test` and `predict` too.
MODEL_IDENTITY = frozenset(
    {"policy.model_name_or_path", "critic_model_name_or_path", "policy.lora", "policy.dtype", "random_init"}
)
# Saved by Lightning's CLI beside the arguments; not arguments themselves.
NOT_ARGUMENTS = frozenset({"_class_path", "_instantiator"})


@dataclasses.dataclass(frozen=True)
class Difference:
    key: str  # dotted, under `model.` (`model.rollout.engine.server_url`)
    this_run: Any
    checkpoint: Any


def reconcile(
    subcommand: str,
    module_class: type,
    this_run: Mapping[str, Any],
    hyper_parameters: Mapping[str, Any],
    checkpoint: Any,
) -> list[Difference]:
    """Compare this run's hyperparameters (the `hparams` of a `module_class` module) with those a checkpoint saved.
    Returns the differences this run may make that change what it does (to be announced); raises a one-line
    ConfigError naming every difference it may not make, or another algorithm. `subcommand`: fit, validate, test
    or predict."""
    saved_class = str(hyper_parameters.get("_class_path") or "")
    if saved_class and not names_class(saved_class, module_class):
        raise ConfigError(
            f"--ckpt_path {checkpoint} was trained by {saved_class} and this run's model is "
            f"{module_class.__name__}: resume with the algorithm that wrote it"
        )
    this_run = _plain(dict(this_run))
    # A lit-rl 0.1 checkpoint's flat keys (`temperature`) compare with their groups' (`sampling.temperature`).
    given = {k: v for k, v in hyper_parameters.items() if k not in NOT_ARGUMENTS}
    saved = _with_engine_defaults(_plain(grouped_hparams(given, own_options(module_class))))
    allowed, refused = [], []
    for difference in differences("model", this_run, saved):
        bucket = allowed if may_change(subcommand, difference.key.removeprefix("model.")) else refused
        bucket.append(difference)
    if refused:
        listed = _listed(refused)
        if subcommand == "fit":
            advice = (
                "a resumed run keeps what it was trained with (only the rates, token budgets and memory settings, "
                "validation sampling and model.rollout.engine may change): give the checkpoint's values, or start "
                "a new run without --ckpt_path"
            )
        else:
            advice = "the checkpoint's weights belong to that model: give the checkpoint's values"
        raise ConfigError(f"--ckpt_path {checkpoint} was trained with other values: {listed}; {advice}")
    return [difference for difference in allowed if worth_announcing(subcommand, difference)]


def names_class(class_path: str, cls: type) -> bool:
    """Whether `class_path` names `cls`, by its defining module or a package above it that exports it
    (`lit_rl.algorithms.GRPO` names `lit_rl.algorithms.grpo.GRPO`), compared as text: never imported."""
    module, _, name = class_path.rpartition(".")
    return name == cls.__qualname__ and (cls.__module__ == module or cls.__module__.startswith(f"{module}."))


def may_change(subcommand: str, key: str) -> bool:
    """Whether `model.<key>` (dotted: `sampling.temperature`) may differ from the checkpoint's in a `subcommand` run
    given `--ckpt_path`."""
    if subcommand == "fit":
        return _covered(key, MAY_CHANGE_ON_RESUME)
    return not _covered(
        key, MODEL_IDENTITY
    )  # validate/test/predict: the checkpoint gives the weights, this run the rest


def _covered(key: str, keys: frozenset[str]) -> bool:
    """Whether `key` or a key above it (`rollout.engine` above `rollout.engine.server_url`) is in `keys`."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in keys for end in range(1, len(parts) + 1))


def worth_announcing(subcommand: str, difference: Difference) -> bool:
    """Whether a difference this run makes changes anything it does: the optimizer's rates do not in a run that
    does not train."""
    return subcommand == "fit" or difference.key.removeprefix("model.") not in OPTIMIZER_RATES


def announce(difference: Difference) -> str:
    this_run, checkpoint = _show(difference.this_run), _show(difference.checkpoint)
    return f"{difference.key} {this_run} from this run (the checkpoint has {checkpoint})"


def _with_engine_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` with its engine's options filled in with their defaults: an option added to an engine after the
    checkpoint was written (`launch`) is not a difference. An engine lit-rl cannot rebuild is left as saved."""
    engine = (saved.get("rollout") or {}).get("engine") if isinstance(saved.get("rollout"), Mapping) else None
    if not isinstance(engine, Mapping):
        return saved
    try:
        filled = _plain(engine_from_config(dict(engine)))
    except ConfigError:
        return saved
    return {**saved, "rollout": {**saved["rollout"], "engine": filled}}


def _plain(value: Any) -> Any:
    """A parsed config value as plain data (dicts, lists, str, numbers), as a checkpoint stores it."""
    if hasattr(value, "as_dict"):  # jsonargparse's Namespace
        value = value.as_dict()
    elif isinstance(value, EngineConfig) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        value = plain_data(value)  # an engine choice as {class_path, init_args}, as the checkpoint holds it
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if callable(value) and hasattr(value, "__qualname__"):  # a reward function given as an object
        return f"{value.__module__}.{value.__qualname__}"
    return value


def differences(key: str, this_run: Any, checkpoint: Any) -> list[Difference]:
    """Where two values of `key` differ: key by key inside two mappings (`model.sampling.temperature`), else whole
    (`model.policy.lora` set against null). An option or a group field only one side has is not compared (one
    version of lit-rl has it, the other does not); inside a value (`model.env.environment_args`, `model.rollout.engine`)
    a key only one side has is a difference."""
    if this_run == checkpoint:
        return []
    if not (isinstance(this_run, Mapping) and isinstance(checkpoint, Mapping)):
        return [Difference(key, this_run, checkpoint)]
    options = key == "model" or key.removeprefix("model.") in GROUP_NAMES
    keys = this_run.keys() & checkpoint.keys() if options else this_run.keys() | checkpoint.keys()
    found = []
    for sub in sorted(keys):
        found.extend(differences(f"{key}.{sub}", this_run.get(sub), checkpoint.get(sub)))
    return found


def refuse_moved_position(this_run: Mapping[str, Any], checkpoint_layout: Mapping[str, Any], checkpoint: Any) -> None:
    """A resumed `fit` continues from the checkpoint's place in its data, which counts micro-batches of the
    checkpoint's sizes on its ranks, in the order its data and seed give (`PolicyModule.data_layout`: the
    accumulation, the ranks, a batch size, the data and its seed). With any of them changed the same count is
    another place: samples would be trained twice or skipped, and a generation split across optimizer steps. So a
    change of one stops the run in one line naming every such key, this run's value and the checkpoint's
    (`checkpoint_layout`: empty for a checkpoint that kept none; a key it lacks, from an older checkpoint, is not
    compared)."""
    kept = {key: value for key, value in checkpoint_layout.items() if key in this_run and key not in ANNOUNCED_DATA}
    changed = [Difference(key, this_run[key], value) for key, value in kept.items() if this_run[key] != value]
    if changed:
        listed = _listed(changed)
        raise ConfigError(
            f"--ckpt_path {checkpoint} was trained with other values: {listed}; the checkpoint's place in the data "
            "counts micro-batches of its sizes on its ranks, in its data's order, and a resumed run continues from "
            "that place: give the checkpoint's values, or start a new run without --ckpt_path"
        )


# What a resumed `fit` may change of its data, said in one line: other data continues the run on it (a curriculum's
# next stage, with the optimizer's state), at the checkpoint's step count in the new data's order.
ANNOUNCED_DATA = ("data.train_data",)


def other_data(this_run: Mapping[str, Any], checkpoint_layout: Mapping[str, Any]) -> list[Difference]:
    """The `ANNOUNCED_DATA` this run changes from the checkpoint's (`announce` says each)."""
    return [
        Difference(key, this_run[key], checkpoint_layout[key])
        for key in ANNOUNCED_DATA
        if key in this_run and key in checkpoint_layout and this_run[key] != checkpoint_layout[key]
    ]


def _listed(differences: list[Difference]) -> str:
    return "; ".join(f"{d.key}: {_show(d.this_run)} here, {_show(d.checkpoint)} in the checkpoint" for d in differences)


def _show(value: Any) -> str:
    text = "null" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refuse_ungrouped_hyperparameters(module: Any, saved: dict[str, Any]) -> None:
    """`load_from_checkpoint` of a lit-rl 0.1 checkpoint: Lightning passes the constructor only the keys it takes,
    so the flat 0.1 keys (`temperature`) are dropped and `module` built with its defaults. Where that changed a
    value, stop in one line that says how to load the checkpoint with its values."""
    cls = type(module)
    parameters = inspect.signature(cls.__init__).parameters
    flat = [key for key in saved if key in MOVED_KEYS and key not in parameters]
    theirs, mine = grouped_hparams(saved, own_options(cls)), plain_data(dict(module.hparams))
    lost = sorted(key for key in flat if _field(theirs, MOVED_KEYS[key]) != _field(mine, MOVED_KEYS[key]))
    if lost:
        shown = ", ".join(lost[:4]) + (", ..." if len(lost) > 4 else "")
        raise ConfigError(
            f"this checkpoint holds lit-rl 0.1's flat options ({shown}), which {cls.__name__} now takes in groups: "
            f"load it with {cls.__name__}.load_from_checkpoint(path, "
            "**lit_rl.config.grouped_hparams(torch.load(path, weights_only=True)['hyper_parameters']))"
        )


def _field(hparams: dict[str, Any], place: str) -> Any:
    group, field = place.split(".")
    return (hparams.get(group) or {}).get(field)
