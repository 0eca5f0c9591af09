"""`lit-rl`: LightningCLI over the algorithms and data modules.

    lit-rl fit --config configs/grpo.yaml --model.loss.beta 0.04 --trainer.max_steps 50
    lit-rl fit --config configs/grpo.yaml --print_config
    lit-rl fit --model.help lit_rl.algorithms.GRPO      # every option of an algorithm, with its documentation

Mistakes in the input (a config key or value, a data file, a reward function, a model path) end the run with one
line, `lit-rl: error: ...`, naming the key, file, row or function, and a non-zero exit; `LIT_RL_TRACEBACK=1`
shows the traceback as well.
"""

from __future__ import annotations

import difflib
import errno
import importlib
import importlib.util
import os
import re
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, NoReturn, Optional

import lightning as L
import yaml
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

from lit_rl.algorithms.checkpoint_state import CheckpointState
from lit_rl.callbacks import GracefulStop, NonFiniteGuard, RunSummary, StepProgressBar
from lit_rl.callbacks.export import (
    knows_its_directory_before_fit,
    lightnings_checkpoint_dir,
    numbers_its_runs,
    run_directory,
)
from lit_rl.config import GROUP_NAMES, data_key_hint, group_class, group_fields, moved_key_hint, renamed_key_hint
from lit_rl.config_files import config_file_problem, duplicate_key_problem
from lit_rl.console import WEIGHT_PUSH_MESSAGES, drop_log_messages
from lit_rl.data.modules import PromptDataModule
from lit_rl.entry import private_files
from lit_rl.errors import (
    ConfigError,
    LitRLError,
    ReportedOnRankZero,
    exception_chain,
    exception_line,
    one_line,
    refuse_unwritable_folder,
)
from lit_rl.importing import working_directory_source
from lit_rl.numerics import settle_cpu_math_kernels
from lit_rl.resume import (
    CheckpointError,
    ResumePoint,
    checkpoint_step,
    keep_run_metrics,
    read_checkpoint,
    refuse_another_runs_directory,
    resolve_ckpt_path,
    resumes_another_run,
    say,
)
from lit_rl.training.checkpoint import AtomicCheckpointIO
from lit_rl.training.compat import keep_nested_nulls
from lit_rl.training.strategies import as_project_deepspeed

CONFIG_ERROR_EXIT = 2
INPUT_ERROR_EXIT = 1
# Console messages a lit-rl user cannot act on, silenced by `quiet_console` (each by its own text, nothing else):
# Lightning's advertisements, a deprecation inside Lightning's own code, DataLoader advice that does not apply to
# lit-rl's loaders (batches are built in the main process on purpose: tokenizing and rollouts belong to the
# module), the frozen reference model that is in eval mode by design, torch 2.13 deprecating collectives that
# Lightning's `all_gather` and DeepSpeed's ZeRO call, and DeepSpeed saying on a CPU-only machine that it found no
# GPU (Lightning's "GPU available: False" line says it already).
IGNORED_WARNINGS = (  # (message regex, category, module regex)
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\."),
    (r"The '\w+' does not have many workers", UserWarning, ""),
    (r"Your `IterableDataset` has `__len__` defined", UserWarning, ""),
    (r"Found \d+ module\(s\) in eval mode at the start of training", UserWarning, ""),
    (r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning, r"lightning\."),
    # Lightning's advice to sync epoch-level values across ranks, given whenever torch.distributed is initialised (a
    # colocated vLLM engine initialises it in a single process too): lit-rl logs the values its torchmetrics
    # collections computed over every rank already (`lit_rl.training.metrics.compute_collection`).
    (r"It is recommended to use `self\.log\('(step|(train|val|test)/[^']*)', \.\.\., sync_dist=True\)`", Warning, ""),
    # DeepSpeed's ZeRO collectives and vLLM's Triton dispatcher, which torch 2.13 deprecates (lit-rl calls none).
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning, ""),
    (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\."),
    # `data.val_data: null` validates nothing on purpose: its empty validation loader is not a mistake to warn about.
    (r"Total length of `list` across ranks is zero", UserWarning, ""),
)
IGNORED_LOG_MESSAGES = {  # logger name -> message prefixes
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip:",),
    "lightning.fabric.utilities.rank_zero": ("💡 Tip:",),
    "DeepSpeed": ("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it",),
    **WEIGHT_PUSH_MESSAGES,  # a colocated vLLM engine's, at every weight push (`lit_rl.console`)
    # At its start: consequences of what lit-rl asks for on purpose (token ids in and out, so no tokenizer and
    # no chat template; eager mode on CPU; the RNG state around the engine kept by lit-rl) and of the CPU build
    # (no Triton; threads bound by vLLM itself).
    "vllm.renderers.base": ("Using None for EOS token id because tokenizer", "Chat template warmup failed"),
    "vllm.engine.arg_utils": ("The global random seed is set to",),
    "vllm.config.vllm": ("Model Runner V2 requires Triton", "Enforce eager set", "Inductor compilation was disabled"),
    "vllm.platforms.cpu": ("Triton is not installed", "Reset SSM cache type"),
    "vllm.v1.worker.cpu_worker": ("CPU backend doesn't allow to use `torch.set_num_threads`",),
}
_NOISE = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>")


def condense_parser_error(message: str) -> str:
    """jsonargparse's nested, multi-line message -> `key.path: what is wrong` on one line."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    # An option the class does not take: said before a type mismatch, which jsonargparse also reports for the
    # other members of a union (`trainer.strategy`: "Expected a <class 'str'>").
    unknown = re.search(r"Option '([^']+)' is not accepted", message) or re.search(
        r"unrecognized arguments: --([\w.]+)", message
    )
    if unknown:
        option = unknown.group(1)
        key = ".".join(keys + ([option] if not keys or keys[-1] != option else []))
        named = _named_class(message)
        moved = moved_key_hint(key, named)
        if moved is not None:  # a lit-rl 0.1 key
            return f"{key}: moved to {moved} (lit-rl 0.2 groups the options; see docs/config-reference.md)"
        missing = _missing_group(key, named)
        if missing is not None:  # `--config configs/rollout/vllm_colocate.yaml` over DPO's config
            return f"{key}: {missing}"
        place = data_key_hint(key, _data_classes()) or renamed_key_hint(key, named)
        if place is not None:
            return f"{key}: unknown option; this is {place}"
        close = _close_group_option(key, named)
        return f"{key}: unknown option" + (f" (did you mean {close}?)" if close else "")
    # A group of the class given (switching `--model RLOO` over a GRPO config) without a key the config sets.
    group_option = re.search(r"Group '([\w.]+)' does not accept option '([\w.]+)'", message)
    if group_option:
        named = _named_class(message)
        owner = f"{named.__name__}'s" if named is not None else "this"
        group, option = group_option.groups()
        key = ".".join([*keys, group, option])
        renamed = renamed_key_hint(key, named)
        if renamed is not None:
            return f"{key}: unknown option of {owner} {group} group; this is {renamed}"
        line = f"{key}: unknown option of {owner} {group} group"
        config = SHIPPED_CONFIGS.get(named.__name__) if named is not None else None
        if config is not None and _another_algorithm_takes(named, group, option):
            # most often `--model X` over another algorithm's config
            line += f" (a key of another algorithm's config? start from {config})"
        else:
            close = _close_group_option(key, named)
            line += f" (did you mean {close}?)" if close else ""
        return line
    unimportable = re.search(r"Expected a path but (\S+) either not accessible or invalid", message)
    if unimportable and keys and CLASS_PATH.fullmatch(unimportable.group(1)):  # not a group's YAML file: say why
        path = unimportable.group(1)
        return f"{'.'.join(dict.fromkeys(keys))}: cannot import {path}: {why_unimportable(path)}"
    wrong_type = re.search(r"Expected a <class '(?!NoneType)[^']+'>[^\n]*", message)
    if wrong_type and keys:
        return f"{'.'.join(dict.fromkeys(keys))}: {wrong_type.group(0)}"
    detail = ""
    for line in (raw.strip() for raw in message.splitlines()):
        if line and not line.startswith(_NOISE) and "Problem with given class_path" not in line:
            detail = line.lstrip("- ")
            break
    key = ".".join(keys)
    return f"{key}: {detail}" if key and detail else (detail or message.strip().splitlines()[0])


# What a class path looks like (`my_engines.CountingEngine`), as against a file an option group reads (`lora.yaml`).
CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+(?<!\.yaml)(?<!\.yml)(?<!\.json)")


def why_unimportable(path: str) -> str:
    """Why the class path `path` (`my_engines.CountingEngine`) does not import: its module is a file of the working
    directory (class paths, unlike reward functions and environments, are imported by jsonargparse, from
    `sys.path` alone), there is no such module, or the module has no such name (with the closest it has)."""
    module_name, _, name = path.rpartition(".")
    top = module_name.split(".")[0]
    if not module_name:
        return "not a dotted path (module.Class)"
    try:
        spec = importlib.util.find_spec(top)
    except (ValueError, ImportError) as err:  # `__main__`, whose spec is None
        return exception_line(err)
    if spec is None:
        if working_directory_source(top) is not None:
            return f"{top} is in the working directory, which class paths are not imported from: run with PYTHONPATH=."
        return f"no module named {top!r}"
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001  (the user's module failed to import: that is the reason)
        return f"importing {module_name} raised {exception_line(err)}"
    if name in vars(module):
        return f"{name} is not a class this option takes"
    close = difflib.get_close_matches(name, [n for n in vars(module) if not n.startswith("_")], n=1)
    return f"module {module_name} has no {name!r}" + (f" (did you mean {module_name}.{close[0]}?)" if close else "")


def _algorithm_classes() -> tuple[type, ...]:
    """lit-rl's algorithms, whose groups differ (SFT and DPO sample nothing; each has its own `loss`)."""
    from lit_rl.algorithms import DPO, GRPO, PPO, RLOO, SFT, OnlineDPO

    return (GRPO, OnlineDPO, PPO, RLOO, DPO, SFT)


def _group_parts(key: str) -> list[str]:
    """`model.<group>.<option>...` without the `init_args` of a class's keys; [] for a key outside a group."""
    parts = [part for part in key.split(".") if part != "init_args"]
    return parts if parts[:1] == ["model"] and len(parts) > 1 and parts[1] in GROUP_NAMES else []


def _missing_group(key: str, named: Optional[type]) -> Optional[str]:
    """For an option of a group the algorithm `named` does not take (a rollout overlay over DPO's config): that,
    and which algorithms take the group. jsonargparse says only that the option is unknown."""
    parts = _group_parts(key)
    if not parts or named is None or group_class(named, parts[1]) is not None:
        return None
    takers = [cls.__name__ for cls in _algorithm_classes() if group_class(cls, parts[1]) is not None]
    if not takers:
        return None
    listed = takers[0] if len(takers) == 1 else f"{', '.join(takers[:-1])} and {takers[-1]}"
    return f"{named.__name__} takes no {parts[1]} group (only {listed} take it: an option for another algorithm?)"


def _another_algorithm_takes(named: type, group: str, option: str) -> bool:
    """Whether another algorithm's `group` has `option` (GRPO's `loss.scale_rewards` under `--model RLOO`): only
    then is the option likely a key of another algorithm's config rather than a typo."""
    return any(cls is not named and option in group_fields(cls, group) for cls in _algorithm_classes())


def _close_group_option(key: str, named: Optional[type]) -> Optional[str]:
    """The option of the group that `key` (`model.sampling.temprature`) most likely misspells, as a full key."""
    parts = _group_parts(key)
    if len(parts) != 3:
        return None
    close = difflib.get_close_matches(parts[2], sorted(group_fields(named, parts[1])), n=1)
    return f"model.{parts[1]}.{close[0]}" if close else None


def _data_classes() -> tuple[type, ...]:
    """lit-rl's data modules, whose options a user may put under `model.` by mistake."""
    from lit_rl.data import PreferenceDataModule, PromptDataModule, SFTDataModule

    return (PromptDataModule, PreferenceDataModule, SFTDataModule)


def _named_class(message: str) -> Optional[type]:
    """The class a jsonargparse message names (`Problem with given class_path 'lit_rl.algorithms.DPO'`), when it is
    imported already (jsonargparse imported it to read its options); never imports anything."""
    found = re.search(r"class_path '([\w.]+)\.(\w+)'", message)
    module = sys.modules.get(found.group(1)) if found else None
    cls = getattr(module, found.group(2), None) if module is not None else None
    return cls if isinstance(cls, type) else None


def quiet_console() -> None:
    """Silence the known messages above (idempotent); every other warning and log message is left as it is."""
    for message, category, module in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    drop_log_messages(IGNORED_LOG_MESSAGES)


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad command line or config in one line instead of the whole usage text."""

    _config_name: Optional[str] = None  # the `--config FILE` whose text `parse_string` is given next
    _config_file: Optional[tuple[str, str]] = None  # (name, text) of the `--config` file being parsed

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Any:
        """Each `--config FILE`: its name for `parse_string`, which jsonargparse gives the text it read."""
        previous, self._config_name = self._config_name, str(path)
        try:
            return super().parse_path(path, *args, **kwargs)
        finally:
            self._config_name = previous

    def parse_string(self, content: str, *args: Any, **kwargs: Any) -> Any:
        """A `--config` file's text: refused when a mapping sets a key twice (`duplicate_key_problem`), and kept
        with its name for `error`, as jsonargparse's messages about a file it cannot load name neither."""
        name, self._config_name = self._config_name, None  # a config string (`--config '{...}'`) has no file
        if name is None:
            return super().parse_string(content, *args, **kwargs)
        if self.parser_mode == "yaml":
            duplicate = duplicate_key_problem(name, content)
            if duplicate is not None:
                self.error(duplicate)
        previous, self._config_file = self._config_file, (name, content)
        try:
            return super().parse_string(content, *args, **kwargs)
        finally:
            self._config_file = previous

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not getattr(self, "exit_on_error", True):
            super().error(message, ex)
        line = condense_parser_error(message)
        if self._config_file is not None and message.startswith(("Problems parsing config", "Unexpected config")):
            name, text = self._config_file
            line = config_file_problem(name, text) or f"{name}: {line}"
        sys.stderr.write(f"lit-rl: error: {line} (see `lit-rl {self._subcommand_hint()}--help`)\n")
        sys.exit(CONFIG_ERROR_EXIT)

    def _subcommand_hint(self) -> str:
        prog = self.prog.split()
        return f"{prog[-1]} " if len(prog) > 1 else ""


class SaveRunConfig(SaveConfigCallback):
    """Lightning's SaveConfigCallback writes `config.yaml` into `trainer.log_dir`, which for W&B, MLflow or Trackio
    is the `save_dir` every run shares, so each run replaced the last one's. This one writes it into the run's
    own directory (`run_directory`: the CSV logger's `version_N`, W&B's `<project>/<run id>`), beside its
    checkpoints and export. lit-rl always overwrites: a resumed run writes the config it runs with."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            log_dir = run_directory(trainer)  # a broadcast: every rank asks
            if trainer.is_global_zero:
                log_dir.mkdir(parents=True, exist_ok=True)
                self.parser.save(
                    self.config,
                    str(log_dir / self.config_filename),
                    skip_none=False,
                    overwrite=self.overwrite,
                    multifile=self.multifile,
                )
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = trainer.strategy.broadcast(self.already_saved)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A run that fails before writing anything (a missing data file fails after the logger made its folder)
        leaves no empty `version_N` folder, nor an empty folder of its name; what a run wrote stays. A run that
        failed before its first step (a model that cannot be read) wrote only its own config and
        hyperparameters: they go too. No collective: the other ranks may be elsewhere."""
        log_dir = getattr(trainer.logger, "log_dir", None)
        if not trainer.is_global_zero or not isinstance(log_dir, str):
            return
        own = [Path(log_dir) / name for name in (self.config_filename, "hparams.yaml")]
        # Before the first step only: a logger may hold later rows in memory until it finalizes (the CSV logger
        # writes every 100 steps), after this hook.
        if trainer.global_step == 0 and Path(log_dir).is_dir() and set(Path(log_dir).iterdir()) <= set(own):
            for path in own:
                path.unlink(missing_ok=True)
        for folder in (Path(log_dir), Path(log_dir).parent):
            try:
                folder.rmdir()  # only an empty folder
            except OSError:
                return


SUBCOMMANDS = ("fit", "validate")


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl defaults: any LightningModule/DataModule by class path, configs overwritable, and
    unless configured otherwise:
    - a rich progress bar that shows the optimizer step (off with `--trainer.enable_progress_bar false`);
    - `NonFiniteGuard` (stop at a NaN/inf gradient; add it with `action: skip` to skip such steps instead);
    - `GracefulStop` (SIGTERM/SIGINT write a resumable `last.ckpt` after the current step, then stop);
    - `RunSummary` (at the end of `fit`, steps, wall time, headline metrics and output paths, also without the
      progress bar);
    - `AtomicCheckpointIO` (checkpoints are written to a temporary file and renamed), unless `trainer.plugins`
      gives a `CheckpointIO` of its own or the strategy is DeepSpeed;
    - under DeepSpeed, `lit_rl.training.strategies.DeepSpeedStrategy` for Lightning's (a `deepspeed*` name or
      Lightning's class): its checkpoint directories are written to a temporary directory and renamed.
    """

    resumed: Optional[ResumePoint] = None  # the checkpoint and run directory `--ckpt_path` resolved to

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """`fit` and `validate`: Lightning's `test` and `predict` need a `test_step`, a `predict_step` and loaders
        that no lit-rl algorithm has (offered, they could only fail)."""
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name in SUBCOMMANDS}

    # This and `_instantiate_trainer` are private methods of Lightning's: tests/test_compat.py finds them and checks
    # that Lightning still calls them.
    def _parse_ckpt_path(self) -> None:
        # Lightning lays the checkpoint's hyperparameters over the parsed config here. lit-rl takes no value from a
        # checkpoint (a shared one could set `trust_remote_code` or import any module): the module compares them
        # with this run's when the checkpoint loads (`lit_rl/resume_config.py`). What is left: which checkpoint
        # `--ckpt_path` means, and which run directory continues.
        subcommand = self.config.get("subcommand")
        if subcommand:
            self.resumed = resolve_ckpt_path(self.config[subcommand], continue_run=subcommand == "fit")

    # The trainer of the `fit` under way: after a failure mid-run, `main` names its newest checkpoint and the command
    # that resumes from it (the exception leaves the LitRLCLI object unbuilt).
    fitting: Optional[L.Trainer] = None

    def before_fit(self) -> None:
        LitRLCLI.fitting = self.trainer
        # A resume the module refuses stops here, before the run's config.yaml and metrics.csv are written.
        if self.resumed is not None and isinstance(self.model, CheckpointState):
            checkpoint = read_checkpoint(self.resumed.checkpoint)
            self.model.refuse_resume_before_writing(self.trainer, self.datamodule, checkpoint, self.resumed.checkpoint)
        refuse_unwritable_checkpoint_dirs(self.trainer)
        # The CSV logger deletes the metrics file of a run directory it opens: put back the resumed run's rows.
        if self.resumed is not None and self.resumed.run is not None:
            keep_run_metrics(self.trainer.loggers, self.resumed)
        # A new run (no --ckpt_path, or `last` where there is none), or one resumed from a checkpoint of another
        # directory, never writes into a directory holding another run's files: a logger whose directory is a name
        # (Trackio), a CSV/TensorBoard `version` fixed by hand, or no logger (`default_root_dir`, the working
        # directory by default, where a user's config.yaml may be). Only where the directory is known before `fit`
        # without side effects (MLflow's `version` starts its run; W&B's is None until `fit`).
        if not knows_its_directory_before_fit(self.trainer.logger):
            return
        ckpt_path = self.config[self.config["subcommand"]].get("ckpt_path")
        run = run_directory(self.trainer)
        checkpoint_dirs = [str(c.dirpath) for c in self.trainer.checkpoint_callbacks if getattr(c, "dirpath", None)]
        checkpoint_dirs += lightnings_checkpoint_dir(self.trainer)
        if not ckpt_path or resumes_another_run(str(ckpt_path), run, checkpoint_dirs):
            resuming = str(ckpt_path) if ckpt_path else None
            refuse_another_runs_directory(run, logged=self.trainer.logger is not None, resuming=resuming)

    def before_validate(self) -> None:
        if isinstance(self.datamodule, PromptDataModule) and self.datamodule.val_data is None:
            # Lightning would run no batch, print nothing, exit 0 and leave a run folder of config files.
            raise ConfigError("data.val_data is null: lit-rl validate has no data to validate on")
        # `validate` writes a run directory of its own (its metrics file, config.yaml): never one that holds a
        # trained run's files, which the CSV logger would delete (`--trainer.logger.version` of that run).
        if knows_its_directory_before_fit(self.trainer.logger):
            run = run_directory(self.trainer)
            refuse_another_runs_directory(run, logged=self.trainer.logger is not None, subcommand="validate")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> L.Trainer:
        check_trainer_settings(config)
        configured = list(config.get("callbacks") or []) + callbacks
        extra: list[Callback] = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in configured):
            extra.append(StepProgressBar())
        for kind in (NonFiniteGuard, GracefulStop, RunSummary):
            if not any(isinstance(c, kind) for c in configured):
                extra.append(kind())
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        strategy = as_project_deepspeed(config.get("strategy", "auto"))
        config = {**config, "strategy": strategy}
        deepspeed = isinstance(strategy, LightningDeepSpeedStrategy)  # writes checkpoint directories, atomically
        if not deepspeed and not any(isinstance(p, CheckpointIO) for p in plugins):
            config = {**config, "plugins": [*plugins, AtomicCheckpointIO()]}
        try:
            trainer = super()._instantiate_trainer(config, [*callbacks, *extra])
        except LitRLError:
            raise
        except (ValueError, TypeError, ImportError) as err:  # a value Lightning refuses (`--trainer.devices -2`)
            raise ConfigError(f"trainer: {exception_line(err)}") from err
        return trainer


def local_checkpoint_dirs(trainer: L.Trainer) -> list[Path]:
    """The folders the run's checkpoint callbacks were given (`dirpath`) on this machine's file system (not a URL)."""
    dirpaths = (getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks)
    return [Path(dirpath) for dirpath in dirpaths if dirpath and "://" not in str(dirpath)]


def refuse_unwritable_checkpoint_dirs(trainer: L.Trainer) -> None:
    """A checkpoint folder given by hand (`ModelCheckpoint.dirpath`) that cannot be made or written fails before the
    first step, in one line, not at the first save, after `every_n_train_steps` steps of work. (A folder derived
    from the logger's is made with the logger's, which is checked where it is made.) Run by every rank."""
    for dirpath in local_checkpoint_dirs(trainer):  # every rank: a refusal on rank 0 alone leaves the others waiting
        refuse_unwritable_folder(dirpath, "checkpoints (ModelCheckpoint.dirpath)")


def check_trainer_settings(config: dict[str, Any]) -> None:
    """Trainer settings Lightning takes and then divides by (a `ZeroDivisionError` traceback, mid-run)."""
    accumulate = config.get("accumulate_grad_batches", 1)
    if isinstance(accumulate, int) and accumulate < 1:
        raise ConfigError(f"trainer.accumulate_grad_batches must be >= 1, got {accumulate}")
    interval = config.get("val_check_interval")
    if isinstance(interval, (int, float)) and interval <= 0:
        raise ConfigError(f"trainer.val_check_interval must be > 0 (or null: once an epoch), got {interval}")


def refuse_options_a_later_config_replaces(args: list[str]) -> None:
    """An option followed by a `--config` that sets the same value is silently replaced by the file's
    (jsonargparse applies the command line left to right): refused in one line. An option the later files leave
    alone stands (a test overlay after a documented command), and so does one they merge with: a group given as a
    file (`--model.policy p.yaml`), or the class a later file names too (`--model GRPO --config lora.yaml`). Each
    file is read once, and only when an option comes before it."""
    config_files = _config_files(args)
    read: dict[int, Any] = {}  # position of the file's name in `args` -> its YAML
    for index, arg in enumerate(args):
        key, has_value, value = arg.partition("=")
        if not key.startswith(("--trainer", "--model", "--data", "--seed_everything")) or key.endswith(".help"):
            continue
        given = value if has_value else (args[index + 1] if index + 1 < len(args) else None)
        path = [part for part in key[2:].split(".") if part != "init_args"]
        for position, config_file in config_files:
            if position <= index:
                continue
            if position not in read:
                read[position] = _read_config_file(config_file)
            if _replaces(read[position], path, given):
                raise ConfigError(
                    f"{key} comes before --config {config_file}, which sets it too and would replace it: put "
                    "options after the last --config"
                )


def _config_files(args: list[str]) -> list[tuple[int, str]]:
    """Each `--config FILE` (or `--config=FILE`, or LightningCLI's short `-c FILE`) of `args`: where it stands, and
    the file."""
    found = []
    for index, arg in enumerate(args):
        if arg in ("--config", "-c") and index + 1 < len(args):
            found.append((index, args[index + 1]))
        elif arg.startswith("--config="):
            found.append((index, arg.partition("=")[2]))
    return found


def _read_config_file(config_file: str) -> Any:
    """A `--config` file's YAML; None for one that cannot be read, which the parser reports."""
    try:
        return yaml.safe_load(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None


def _replaces(values: Any, path: list[str], given: Optional[str]) -> bool:
    """Whether the config `values` replaces option `path` given as `given`: it sets a value there (a class's options
    are under its `init_args`), or another class than the one `given` names."""
    node = values
    for part in path:
        if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    if not isinstance(node, dict):
        return True
    class_path = node.get("class_path")
    names_a_class = given is not None and not given.endswith((".yaml", ".yml", ".json")) and "{" not in given
    return names_a_class and class_path is not None and class_path != given


# Short names on the command line (`--model GRPO`, `--model.help GRPO`, `--data.help PromptDataModule`).
SHORT_NAMES = {
    **{name: f"lit_rl.algorithms.{name}" for name in ("DPO", "GRPO", "OnlineDPO", "PPO", "RLOO", "SFT")},
    **{name: f"lit_rl.data.{name}" for name in ("PreferenceDataModule", "PromptDataModule", "SFTDataModule")},
}
CLASS_KEYS = ("--model", "--model.help", "--data", "--data.help")
# Each algorithm's shipped config: where a user switching algorithms with `--model X` should start from.
SHIPPED_CONFIGS = {
    "GRPO": "configs/grpo.yaml",
    "PPO": "configs/ppo.yaml",
    "RLOO": "configs/rloo.yaml",
    "OnlineDPO": "configs/online_dpo.yaml",
    "DPO": "configs/dpo.yaml",
    "SFT": "configs/sft.yaml",
}
_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
CHECK_EPILOG = (
    "Also: lit-rl check --config my.yaml [--quick] runs your config in layouts that must agree (accumulation, "
    "ranks, padding-free, resume, cadence); --mismatch names what moves the engine-trainer gap (docs/check.md). "
    "lit-rl export CKPT OUT_DIR [--adapter] writes a checkpoint as a save_pretrained folder."
)
HELP_EPILOG = (
    "algorithms: --model GRPO | PPO | RLOO | OnlineDPO | DPO | SFT (or a class path); the options of one: "
    "lit-rl fit --model.help GRPO. Data: --data PromptDataModule | PreferenceDataModule | SFTDataModule. "
    "Examples: lit-rl fit --config configs/grpo.yaml --model.optim.learning_rate 5e-5; resume: add --ckpt_path last."
)


def normalize_args(args: list[str]) -> list[str]:
    """The command line as the parser needs it: a short algorithm or data-module name after `--model`,
    `--data` or their `.help` becomes its class path, and a negative number after an option is joined to it
    (`--model.optim.learning_rate=-1e-4`: argparse would read `-1e-4` as an option)."""
    out: list[str] = []
    for arg in args:
        previous = out[-1] if out else ""
        option = previous.startswith("--") and "=" not in previous
        if option and previous in CLASS_KEYS and arg in SHORT_NAMES:
            out.append(SHORT_NAMES[arg])
        elif option and _NEGATIVE_NUMBER.fullmatch(arg):
            out[-1] = f"{previous}={arg}"
        else:
            out.append(arg)
    return out


# What `--model.help` / `--data.help` without a class should have named (jsonargparse would print the base class's
# empty usage and exit 0).
HELP_NEEDS = {
    "--model.help": "an algorithm: lit-rl fit --model.help GRPO (or DPO, OnlineDPO, PPO, RLOO, SFT, or a class path)",
    "--data.help": "a data module: lit-rl fit --data.help PromptDataModule (or PreferenceDataModule, SFTDataModule, "
    "or a class path)",
}


def refuse_help_without_class(args: list[str]) -> None:
    """`--model.help` and `--data.help` show one class's options, so they need the class after them."""
    for index, arg in enumerate(args):
        key, equals, value = arg.partition("=")
        if key not in HELP_NEEDS:
            continue
        if not equals:
            value = args[index + 1] if index + 1 < len(args) else ""
        if not value or value.startswith("-"):
            raise ConfigError(f"{key} needs {HELP_NEEDS[key]}")


def main(args: Optional[list[str]] = None) -> None:
    if args is None:  # `python -m lit_rl.cli` (the ranks Lightning starts, `lit-rl check`'s runs) as `lit-rl` does
        private_files()
    settle_cpu_math_kernels()  # before anything runs threaded float math (lit_rl/numerics.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_console()
    keep_nested_nulls()  # `--model.rewards.weights null` (lit_rl.training.compat)
    given = sys.argv[1:] if args is None else list(args)
    if given[:1] == ["validate"]:
        # The checkpoint's ModelCheckpoint state names the trained run's folder, and this run writes no checkpoint:
        # Lightning's "The dirpath has changed" (its best-k bookkeeping not reloaded) is nothing to act on.
        warnings.filterwarnings("ignore", message="The dirpath has changed from", category=UserWarning)
    LitRLCLI.fitting = None  # set by this run's `fit` (a process may run several: tests, notebooks)
    if args is None:  # LightningCLI warns when given `args` while sys.argv holds arguments too
        sys.argv[1:] = normalize_args(given)
    try:
        refuse_help_without_class(given)
        refuse_options_a_later_config_replaces(normalize_args(given))
        cli = LitRLCLI(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveRunConfig,
            save_config_kwargs={"overwrite": True},
            args=None if args is None else normalize_args(given),
            auto_configure_optimizers=False,
            parser_class=OneLineErrorParser,
            parser_kwargs={
                "description": "lit-rl: reinforcement-learning fine-tuning of language models, on Lightning.",
                "epilog": CHECK_EPILOG,
                **{sub: {"epilog": HELP_EPILOG} for sub in SUBCOMMANDS},
            },
        )
        if cli.subcommand == "fit":
            exit_if_interrupted(cli.trainer, given)
    except Exception as err:
        reported = any(isinstance(e, ReportedOnRankZero) for e in exception_chain(err))
        if reported and not wants_traceback():
            sys.exit(INPUT_ERROR_EXIT)  # another rank failed: rank 0 says what, in one line
        user_error = user_error_message(err)
        if user_error is None or wants_traceback():
            raise
        sys.stderr.write(f"lit-rl: error: {one_line(user_error)}\n")  # a message of the user's code may hold lines
        try:
            say_where_to_resume(LitRLCLI.fitting, given)
        except Exception:  # noqa: BLE001  (a hint: its own failure must not replace the error line)
            pass
        sys.exit(INPUT_ERROR_EXIT)
    except KeyboardInterrupt:  # a Ctrl-C before `fit`'s graceful stop took SIGINT over: loading the model, the data
        exit_after_ctrl_c(given)
    except SystemExit as stop:
        if isinstance(stop.__context__, KeyboardInterrupt):  # Lightning's own `sys.exit(1)` after one inside `fit`
            exit_after_ctrl_c(given)
        raise
    finally:
        LitRLCLI.fitting = None  # nothing of the run stays referenced (a notebook's next cell, a sweep)


def say_where_to_resume(trainer: Optional[L.Trainer], args: list[str]) -> None:
    """After a `fit` failed mid-run (a reward function, an environment, a logger): its newest checkpoint, if it wrote
    one (not before its first step: a refusal at setup left a run that never started), and the command that resumes
    from it once the cause is fixed. Rank 0 alone; no collective (the other ranks may be elsewhere)."""
    if trainer is None or not trainer.is_global_zero or trainer.global_step == 0:
        return
    found = [
        path
        for dirpath in local_checkpoint_dirs(trainer)
        for path in dirpath.glob("*.ckpt")
        if not path.name.startswith(".")
    ]
    if not found:
        return
    newest = max(found, key=lambda path: path.stat().st_mtime)
    try:
        step = checkpoint_step(newest)
    except CheckpointError:
        return
    command = resume_command(args, str(newest))  # the file itself: `last` means a `last.ckpt`, which may not exist
    sys.stderr.write(f"lit-rl: its newest checkpoint is {newest} (step {step}); resume with: {command}\n")


def exit_after_ctrl_c(args: list[str]) -> None:
    """A Ctrl-C that stopped the run at once (one during setup, before the graceful stop takes SIGINT over, or a
    second one while it finishes its step): one line on rank 0, the newest checkpoint and the command that resumes
    from it where the run wrote one, and exit 130 (128 + SIGINT, as a shell reports a job Ctrl-C ended) where
    Lightning exits 1, the code of a failed run."""
    say("interrupted by Ctrl-C (SIGINT), without finishing the step")
    try:
        say_where_to_resume(LitRLCLI.fitting, args)
    except Exception:  # noqa: BLE001  (a hint: its failure must not hide the exit code)
        pass
    sys.exit(128 + signal.SIGINT)


def wants_traceback() -> bool:
    """`LIT_RL_TRACEBACK` set to anything but empty, 0, false or no: the traceback too, not one line alone."""
    return os.environ.get("LIT_RL_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no")


def exit_if_interrupted(trainer: L.Trainer, args: list[str]) -> None:
    """After a run that GracefulStop ended on a signal: say where the checkpoint is, the command that continues
    the run (`args`, this run's arguments, with `--ckpt_path last`), and exit 128 + signal."""
    for callback in trainer.callbacks:
        if isinstance(callback, GracefulStop) and callback.received is not None and callback.checkpoint_path:
            name = signal.Signals(callback.received).name
            # `last` finds the newest run of a versioned logger (CSV, TensorBoard); with another logger (W&B,
            # Trackio) the command names the checkpoint itself.
            if trainer.is_global_zero:
                last = "last" if numbers_its_runs(trainer.logger) else str(callback.checkpoint_path)
                command = resume_command(args, last)
                sys.stderr.write(
                    f"lit-rl: stopped by {name} after step {callback.stopped_at_step}; checkpoint written to "
                    f"{callback.checkpoint_path}; resume with: {command}\n"
                )
            sys.exit(128 + callback.received)


def resume_command(args: list[str], checkpoint: str = "last") -> str:
    """The `lit-rl` command line that continues a run started with `args`: the same arguments, `--ckpt_path
    <checkpoint>` in place of any `--ckpt_path`."""
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--ckpt_path":
            skip = True
        elif not arg.startswith("--ckpt_path="):
            kept.append(arg)
    return shlex.join(["lit-rl", *kept, "--ckpt_path", checkpoint])


# What a missing package is installed with: `pip install -e ".[<extra>]"` (pyproject.toml's extras).
EXTRA_OF_PACKAGE = {
    "wandb": "wandb",
    "tensorboard": "tensorboard",
    "tensorboardX": "tensorboard",
    "trackio": "trackio",
    "datasets": "datasets",
}
_REQUIREMENT = re.compile(r"Requirement '([A-Za-z0-9_.\-]+)")
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
# Lightning's messages whose own words do not say what to do.
LIGHTNING_ADVICE = {
    "No supported gpu backend found!": "trainer.accelerator gpu: torch sees no GPU on this machine; use "
    "--trainer.accelerator cpu (or auto)",
}


def user_error_message(err: BaseException) -> Optional[str]:
    """The one line that reports `err`, when it is the user's to fix: a LitRLError (itself, or one that jsonargparse
    or Lightning wrapped while instantiating), an invalid Trainer setting (Lightning's MisconfigurationException),
    a path that cannot be made or written (`UNUSABLE_PATH`), a class the config names whose package is not
    installed (a logger: the extra that installs it), or an exception raised inside a logger's method. None for
    anything else: a traceback is then the useful report."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    chain = exception_chain(err)
    for current in chain:
        if isinstance(current, LitRLError):
            return str(current)
    for current in chain:
        if isinstance(current, MisconfigurationException):
            text = str(current).strip().splitlines()[0] if str(current).strip() else type(current).__name__
            return LIGHTNING_ADVICE.get(text, f"{_raised_by(current)}: {text}")
    unusable = next((c for c in chain if isinstance(c, OSError) and c.filename and c.errno in UNUSABLE_PATH), None)
    if unusable is not None:  # a directory the config names that cannot be made or written (a logger's save_dir)
        return f"{unusable.filename}: {unusable.strerror}"
    missing = next((c for c in chain if isinstance(c, ImportError)), None)
    class_path = next((m.group(1) for c in chain if (m := _CLASS_PATH.search(str(c)))), None)
    if missing is not None and class_path is not None:
        found = _REQUIREMENT.search(str(missing))
        package = found.group(1) if found else (getattr(missing, "name", None) or "").split(".")[0]
        if package:
            extra = EXTRA_OF_PACKAGE.get(package)
            install = f'pip install -e ".[{extra}]"' if extra else f"pip install {package}"
            return f"{class_path} needs the package {package!r}, which is not installed: {install}"
    return _logger_failure(chain)  # a tracker's network error, mid-run: the logger's, not Lightning's loop's


def _logger_failure(chain: list[BaseException]) -> Optional[str]:
    """`<Logger class>.<method> raised <exception>` where the first exception of `chain` (its innermost: one raised
    while handling it is its consequence) was raised inside a logger's method (W&B, MLflow, TensorBoard, a user's),
    else None."""
    from lightning.fabric.loggers import Logger

    first = chain[-1]
    inside = [f"{type(owner).__name__}.{method}" for owner, method in _methods(first) if isinstance(owner, Logger)]
    return f"{inside[-1]} raised {exception_line(first)}" if inside else None


def _methods(err: BaseException) -> list[tuple[Any, str]]:
    """(the object, the method's name) of every method call on the way from where `err` was caught to where it was
    raised, outermost first: whose code raised it."""
    found = []
    frame = err.__traceback__
    while frame is not None:
        owner = frame.tb_frame.f_locals.get("self")
        if owner is not None:
            found.append((owner, frame.tb_frame.f_code.co_name))
        frame = frame.tb_next
    return found


# Lightning classes whose refusals are of a `trainer.*` key other than the class's own name says.
TRAINER_KEY_OF_CLASS = {"Timer": "trainer.max_time"}


def _raised_by(err: BaseException) -> str:
    """Whose setting Lightning refused: the callback whose method raised `err` (`ModelCheckpoint`, `Timer
    (trainer.max_time)`), else `trainer`."""
    methods = _methods(err)
    owner = type(methods[-1][0]) if methods else None  # the innermost method is the raiser
    if owner is None or not issubclass(owner, Callback):  # the Trainer, its loops and connectors
        return "trainer"
    key = TRAINER_KEY_OF_CLASS.get(owner.__name__)
    return f"{owner.__name__} ({key})" if key else owner.__name__


# The OS errors of a path that cannot be used as the config asks (a file where a directory must be, no permission,
# no space): the user's to fix, named in one line.
UNUSABLE_PATH = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC}


if __name__ == "__main__":
    main()
