"""Write the trained policy as a Hugging Face `save_pretrained` directory (loadable by transformers and vLLM)."""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path
from typing import Callable, Optional, Protocol, runtime_checkable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger

from lit_rl.algorithms.base import PolicyModule
from lit_rl.callbacks.safety import GracefulStop
from lit_rl.errors import ConfigError, LitRLError, exception_line
from lit_rl.export import MANIFEST, writable_out_dir
from lit_rl.loggers import TrackioLogger
from lit_rl.modeling.lora import is_lora_model, save_merged
from lit_rl.modeling.models import MODEL_TORCH_DTYPES
from lit_rl.modeling.value_model import save_value_model
from lit_rl.resume import numbers_runs
from lit_rl.training.checkpoint import publish_directory
from lit_rl.training.strategies import fail_on_every_rank, gathered_parameters, master_weights


@runtime_checkable
class TrainsCritic(Protocol):
    """An algorithm that trains a value model beside the policy (PPO), exported with it to `hf/critic`. A method, not
    the `critic` attribute: `isinstance` looks members up statically (Python 3.12), and a module's submodule lives in
    its `_modules`, where it is not found."""

    def exported_critic(self) -> Optional[torch.nn.Module]: ...


class SaveHFPretrained(Callback):
    """At the end of `fit`, save `pl_module.policy` and `pl_module.tokenizer` to `dirpath` (rank 0 only); not
    after a stop on SIGTERM or SIGINT (the resumed run exports when it ends).

    A LoRA policy is saved twice: merged into a plain model in `dirpath` (loadable by transformers and vLLM without
    peft) and as the peft adapter alone in `dirpath/adapter` (`PeftModel.from_pretrained(base, dirpath/adapter)`).
    A module with a critic (PPO) also writes it to `dirpath/critic` (`lit_rl.modeling.value_model.save_value_state`: a
    one-label `AutoModelForTokenClassification` whose logits are the values, where the architecture has one).

    The export is written beside `dirpath` and swapped in whole, as `lit-rl export` does: a failed export leaves
    `dirpath` as it was, and no file of an earlier export stays mixed in. It runs after the run's end-of-training
    checkpoint is written, so a failed export never costs the checkpoint; a `dirpath` that cannot be written is
    refused in one line before training starts.

    Args:
        dirpath: output directory: new, empty, or an earlier export (lit-rl's, listed in its `.lit-rl-export`),
            which is replaced; one holding other files is refused before training. Default: `hf/` in this
            run's directory (`runs/<name>/version_N/hf`; W&B: `<save_dir>/<project>/<run id>/hf`, beside its
            `checkpoints/`), so runs never overwrite each other, whatever the logger; only the run's exports write
            there, so it is replaced whatever it holds (an export of lit-rl 0.2 has no list).
    """

    def __init__(self, dirpath: Optional[str] = None) -> None:
        self.dirpath = dirpath
        self.saved_to: Optional[Path] = None  # where the last `fit` wrote the model (the run summary shows it)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Checked before training, not at its end: what is exported is a lit-rl algorithm's policy and tokenizer.
        if not isinstance(pl_module, PolicyModule):
            raise ConfigError(
                f"trainer.callbacks: SaveHFPretrained exports a lit-rl algorithm's policy and tokenizer; "
                f"{type(pl_module).__name__} is not one (a subclass of lit_rl.algorithms.base.PolicyModule)"
            )
        if stage == "fit":
            out = self._out_dir(trainer)  # every rank asks: a broadcast for some loggers
            error = unwritable(out, own=self.dirpath is None) if trainer.is_global_zero else None
            elsewhere, device = f"{DIRPATH} {out}: cannot be written", trainer.strategy.root_device
            fail_on_every_rank(error, ConfigError, elsewhere, trainer.world_size, trainer.global_rank, device)

    def _out_dir(self, trainer: L.Trainer) -> Path:
        return Path(self.dirpath) if self.dirpath else run_directory(trainer) / "hf"

    def on_train_end(self, trainer: L.Trainer, pl_module: PolicyModule) -> None:
        if stopped_by_signal(trainer):
            # A pre-empted run's grace period is for the checkpoint a resume needs; a model's export can take as
            # long again. The resumed run exports when it ends.
            return
        # Lightning calls the checkpoint callbacks' `on_train_end` after every other callback's: their end-of-training
        # save (`last.ckpt`) comes first here, so that a failed export leaves it (Lightning's own call then saves
        # nothing). Not exported in `on_fit_end`, which comes after the strategy's teardown has moved the model and
        # the optimizer's state to the CPU: DeepSpeed's masters are gathered with collectives on the device.
        for checkpoint in trainer.checkpoint_callbacks:
            if isinstance(checkpoint, ModelCheckpoint):
                checkpoint.on_train_end(trainer, pl_module)
        # Every rank asks: the directory is a broadcast, and a collective on rank 0 alone never returns.
        out = self._out_dir(trainer)
        staging: Optional[Path] = None
        error: Optional[BaseException] = None
        if trainer.is_global_zero:
            try:
                staging = staging_dir(out)
            except OSError as err:
                error = err
        # DeepSpeed's bf16/fp16: the optimizer's float32 masters, what `lit-rl export` of the checkpoint writes, not
        # the engine's rounded copies (every rank takes part). A LoRA policy's merge reads the module's own.
        masters = (
            None
            if is_lora_model(pl_module.policy)
            else master_weights(trainer.strategy, pl_module.policy, keep=trainer.is_global_zero)
        )
        with gathered_parameters(pl_module.policy):  # ZeRO-3: every rank takes part in gathering the shards
            if staging is not None and error is None:
                error = _attempt(lambda: self._save_policy(pl_module, staging, masters))
        critic = pl_module.exported_critic() if isinstance(pl_module, TrainsCritic) else None
        if critic is not None:  # PPO: its critic beside the policy (`save_value_model`)
            with gathered_parameters(critic):
                if staging is not None and error is None:
                    error = _attempt(lambda: save_value_model(critic, staging / "critic"))
        if staging is not None:
            if error is None:
                error = _attempt(lambda: publish(staging, out, own=self.dirpath is None))
            shutil.rmtree(staging, ignore_errors=True)
        # A failure on rank 0 is raised after the barrier: raised before it, the other ranks would wait there.
        trainer.strategy.barrier("save_hf_pretrained")
        if isinstance(error, OSError):  # a full disk, a folder removed under the run: the key, in one line
            raise LitRLError(
                f"{DIRPATH} {out}: the export failed ({exception_line(error)}); the run's checkpoints are written, "
                "`lit-rl export` makes the model from one"
            ) from error
        if error is not None:
            raise error
        self.saved_to = out

    @staticmethod
    def _save_policy(pl_module: PolicyModule, out: Path, masters: Optional[dict[str, torch.Tensor]]) -> None:
        out.mkdir(parents=True, exist_ok=True)
        policy = pl_module.policy
        if is_lora_model(policy):
            save_merged(policy, out)
            policy.save_pretrained(out / "adapter", safe_serialization=True)
        elif masters is not None:
            policy.save_pretrained(out, state_dict=_with_masters(pl_module, masters), safe_serialization=True)
            _config_dtype(out / "config.json", exported_dtype(pl_module))  # it names the module's (bf16) dtype
        else:
            policy.save_pretrained(out, safe_serialization=True)
        pl_module.tokenizer.save_pretrained(out)


def exported_dtype(pl_module: PolicyModule) -> torch.dtype:
    """The dtype the masters are exported in: `model.policy.dtype` (`auto`: float32)."""
    return MODEL_TORCH_DTYPES.get(pl_module.policy_args.dtype, torch.float32)


def _with_masters(pl_module: PolicyModule, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The policy's state dict with each parameter's master copy (the same tensor under every name of a tied
    parameter, so `save_pretrained` still writes it once), in `exported_dtype`."""
    dtype = exported_dtype(pl_module)
    by_parameter = {id(p): masters[name] for name, p in pl_module.policy.named_parameters() if name in masters}
    state = pl_module.policy.state_dict(keep_vars=True)
    converted = {id(t): by_parameter.get(id(t), t.detach()).to(dtype) for t in state.values()}  # one per tensor
    return {name: converted[id(t)] if t.is_floating_point() else t.detach() for name, t in state.items()}


def _config_dtype(config_file: Path, dtype: torch.dtype) -> None:
    """`config.json`'s dtype set to the weights' (`save_pretrained` writes the module's): a loader with `dtype="auto"`
    (vLLM's default) reads it."""
    config = json.loads(config_file.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config or key == "dtype":
            config[key] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# How errors name the export's folder: the callback and its key, as a config spells them.
DIRPATH = "trainer.callbacks: SaveHFPretrained dirpath"


def unwritable(out: Path, own: bool = False) -> Optional[str]:
    """Why the export could not be written to `out`, or None: checked at `setup`, so that a run of hours does not end
    in a failed export. The folders the check makes are removed again."""
    made = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]  # deepest first
    try:
        checked_out_dir(out, own)
        staging_dir(out).rmdir()
    except ConfigError as err:
        return str(err)
    except OSError as err:
        return f"{DIRPATH} {out}: cannot be written ({exception_line(err)})"
    finally:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:
                break
    return None


def checked_out_dir(out: Path, own: bool = False) -> None:
    """`out` is what `lit-rl export` would replace (`writable_out_dir`: missing, empty or an earlier export; not a
    file, a folder of other files, nor the working directory); its refusal names this callback's key. `own`: the
    run's own `hf/` (the default `dirpath`), which only this run's exports write: one without a `MANIFEST` (an
    export of lit-rl 0.2, in a run resumed now) is replaced too."""
    if own and (out.is_dir() or not out.exists()):
        return
    try:
        writable_out_dir(out)
    except LitRLError as err:
        # An export of lit-rl 0.2 there has no MANIFEST either: the user's to move (it could be theirs).
        earlier = " (an export of lit-rl 0.2 lists none of its files: move it away first)"
        earlier = earlier if "did not write" in str(err) else ""
        raise ConfigError(f"{DIRPATH} {str(err).removeprefix('out_dir ')}{earlier}") from err


def staging_dir(out: Path) -> Path:
    """A new folder beside `out` to write the export into: on its filesystem, so that `publish` is a rename, and
    made with the process's umask (`tempfile.mkdtemp`'s are 0700 whatever `LIT_RL_UMASK` says)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    staging.mkdir()
    return staging


def publish(staging: Path, out: Path, own: bool = False) -> None:
    """List the export's files in its `MANIFEST` (a later export may replace them) and swap it in for `out` whole
    (`publish_directory`). `out` is checked again: anything may have been written there since `setup`."""
    listed = sorted(path.relative_to(staging).as_posix() for path in staging.rglob("*") if not path.is_dir())
    (staging / MANIFEST).write_text(json.dumps(listed))
    checked_out_dir(out, own)
    publish_directory(staging, out)


def stopped_by_signal(trainer: L.Trainer) -> bool:
    """Whether `GracefulStop` ended this `fit` on SIGTERM or SIGINT."""
    return any(isinstance(c, GracefulStop) and c.stopped_at_step is not None for c in trainer.callbacks)


def numbers_its_runs(logger: Optional[Logger]) -> bool:
    """Whether `logger` lays runs out in numbered directories, `<save_dir>/<name>/version_N` (CSV, TensorBoard; also
    no logger): `--ckpt_path last` finds its newest run, and its `log_dir` is the run's own."""
    return logger is None or numbers_runs(type(logger))


def run_directory(trainer: L.Trainer) -> Path:
    """This run's own directory, the parent of the `checkpoints/` Lightning makes: the CSV or TensorBoard logger's
    `log_dir`; for other loggers (W&B, MLflow, ...), whose `log_dir` is their shared `save_dir`,
    `<save_dir>/<name>/<version>` as Lightning lays out their checkpoints (W&B: the project and the run id)."""
    if numbers_its_runs(trainer.logger):
        return Path(trainer.log_dir or trainer.default_root_dir)
    return Path(trainer.strategy.broadcast(str(_lightnings_run_dir(trainer))))


def _lightnings_run_dir(trainer: L.Trainer) -> Path:
    """`<save_dir>/<name>/<version>` of the first logger, as Lightning lays out a run's checkpoints under it."""
    logger = trainer.logger
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version


def lightnings_checkpoint_dir(trainer: L.Trainer) -> list[str]:
    """Where Lightning puts a `ModelCheckpoint`'s files when it names no `dirpath`, as `ModelCheckpoint` resolves it:
    `<save_dir>/<name>/<version>/checkpoints` of the first logger (TensorBoard's `sub_dir` is not in it, its
    `log_dir` is); none without a logger (then `<default_root_dir>/checkpoints`, the run directory's own)."""
    if trainer.logger is None:
        return []
    return [str(_lightnings_run_dir(trainer) / "checkpoints")]


def knows_its_directory_before_fit(logger: Optional[Logger]) -> bool:
    """Whether `logger`'s run directory can be read before `fit` without side effects: numbered runs (CSV,
    TensorBoard), no logger, and lit-rl's Trackio logger (its directory is the run's name). Not MLflow (reading its
    `version` starts its run) nor W&B (its run id is None until `fit`)."""
    return numbers_its_runs(logger) or isinstance(logger, TrackioLogger)


def _attempt(save: Callable[[], object]) -> Optional[BaseException]:
    """Run `save`; the exception it raised, or None."""
    try:
        save()
    except Exception as err:  # re-raised by the caller once every rank has passed the barrier
        return err
    return None
