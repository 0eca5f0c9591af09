"""`lit-rl`: LightningCLI over the algorithms and data modules.

    lit-rl fit --config configs/grpo.yaml --model.beta 0.04 --trainer.max_steps 50
    lit-rl fit --config configs/grpo.yaml --print_config
    lit-rl fit --model.help lit_rl.algorithms.GRPO      # every option of an algorithm, with its documentation

Mistakes in the input (a config key or value, a data file, a reward function, a model path) end the run with one
line, `lit-rl: error: ...`, naming the key, file, row or function, and a non-zero exit; `LIT_RL_TRACEBACK=1`
shows the traceback as well.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from typing import Any, NoReturn, Optional

import lightning as L
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from lit_rl.callbacks import GracefulStop, NonFiniteGuard, StepProgressBar
from lit_rl.checkpoint import AtomicCheckpointIO
from lit_rl.errors import LitRLError

CONFIG_ERROR_EXIT = 2
INPUT_ERROR_EXIT = 1
_NOISE = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value", "- Expected a <class 'NoneType'>")


def condense_parser_error(message: str) -> str:
    """jsonargparse's nested, multi-line message -> `key.path: what is wrong` on one line."""
    keys = re.findall(r'Parser key "([^"]+)"', message)
    wrong_type = re.search(r"Expected a <class '(?!NoneType)[^']+'>[^\n]*", message)
    if wrong_type and keys:
        return f"{'.'.join(dict.fromkeys(keys))}: {wrong_type.group(0)}"
    unknown = re.search(r"Option '([^']+)' is not accepted", message)
    if unknown:
        option = unknown.group(1)
        return ".".join(keys + ([option] if not keys or keys[-1] != option else [])) + ": unknown option"
    detail = ""
    for line in (raw.strip() for raw in message.splitlines()):
        if line and not line.startswith(_NOISE) and "Problem with given class_path" not in line:
            detail = line.lstrip("- ")
            break
    key = ".".join(keys)
    return f"{key}: {detail}" if key and detail else (detail or message.strip().splitlines()[0])


class OneLineErrorParser(LightningArgumentParser):
    """Reports a bad command line or config in one line instead of the whole usage text."""

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        if not getattr(self, "exit_on_error", True):
            super().error(message, ex)
        sys.stderr.write(
            f"lit-rl: error: {condense_parser_error(message)} (see `lit-rl {self._subcommand_hint()}--help`)\n"
        )
        sys.exit(CONFIG_ERROR_EXIT)

    def _subcommand_hint(self) -> str:
        prog = self.prog.split()
        return f"{prog[-1]} " if len(prog) > 1 else ""


class LitRLCLI(LightningCLI):
    """LightningCLI with lit-rl defaults: any LightningModule/DataModule by class path, configs overwritable, and
    unless configured otherwise:
    - a rich progress bar that shows the optimizer step (off with `--trainer.enable_progress_bar false`);
    - `NonFiniteGuard` (stop at a NaN/inf gradient; add it with `action: skip` to skip such steps instead);
    - `GracefulStop` (SIGTERM/SIGINT write a resumable `last.ckpt` after the current step, then stop);
    - `AtomicCheckpointIO` (checkpoints are written to a temporary file and renamed), unless `trainer.plugins`
      is set or the strategy is DeepSpeed (which writes checkpoint directories its own way).
    """

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> L.Trainer:
        configured = list(config.get("callbacks") or []) + callbacks
        extra: list[Callback] = []
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in configured):
            extra.append(StepProgressBar())
        for kind in (NonFiniteGuard, GracefulStop):
            if not any(isinstance(c, kind) for c in configured):
                extra.append(kind())
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        deepspeed = "deepspeed" in str(config.get("strategy", "")).lower()
        if not deepspeed and not any(isinstance(p, CheckpointIO) for p in plugins):
            config = {**config, "plugins": [*plugins, AtomicCheckpointIO()]}
        return super()._instantiate_trainer(config, [*callbacks, *extra])


def main(args: Optional[list[str]] = None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cli = LitRLCLI(
            model_class=L.LightningModule,
            datamodule_class=L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=args,
            auto_configure_optimizers=False,
            parser_class=OneLineErrorParser,
        )
        if cli.subcommand == "fit":
            exit_if_interrupted(cli.trainer)
    except Exception as err:
        user_error = find_user_error(err)
        if user_error is None or os.environ.get("LIT_RL_TRACEBACK"):
            raise
        sys.stderr.write(f"lit-rl: error: {user_error}\n")
        sys.exit(INPUT_ERROR_EXIT)


def exit_if_interrupted(trainer: L.Trainer) -> None:
    """After a run that GracefulStop ended on a signal: say where the checkpoint is and exit 128 + signal."""
    for callback in trainer.callbacks:
        if isinstance(callback, GracefulStop) and callback.received is not None and callback.checkpoint_path:
            name = signal.Signals(callback.received).name
            sys.stderr.write(
                f"lit-rl: stopped by {name} after step {callback.stopped_at_step}; checkpoint written to "
                f"{callback.checkpoint_path} (resume with --ckpt_path last)\n"
            )
            sys.exit(128 + callback.received)


def find_user_error(err: BaseException) -> Optional[LitRLError]:
    """The LitRLError behind `err`: itself, or one that jsonargparse or Lightning wrapped while instantiating."""
    seen: set[int] = set()
    current: Optional[BaseException] = err
    while current is not None and id(current) not in seen:
        if isinstance(current, LitRLError):
            return current
        seen.add(id(current))
        current = current.__cause__ if current.__suppress_context__ else (current.__cause__ or current.__context__)
    return None


if __name__ == "__main__":
    main()
