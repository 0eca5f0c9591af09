"""The layouts `lit-rl check` runs a user's config in: pairs that must train to the same numbers.

A layout is the user's resolved config (`lit-rl fit ... --print_config`) with a few keys changed. Every layout of a
check keeps the global batch of an optimizer step (rows per micro-batch x micro-batches per step x processes), so
each pair must agree step by step:

    accumulation : the user's micro-batches  against one micro-batch per step (or two, where the user has one)
    ranks        : 1 process                 against 2 processes (GPUs when there are two, else CPU over gloo)
    packing      : padded forward            against padding-free forward (`model.policy.padding_free`)
    validation   : no validation             against a validation batch after every micro-step
    resume       : k steps straight          against k/2 steps, a stop (SIGTERM), and `--ckpt_path last`
    cadence      : the checkpoints of the straight run and of the resumed one land exactly every N steps
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lit_rl.importing import import_callable

PROBE = "lit_rl.check.probe.CheckProbe"
EXPORT_CALLBACKS = ("lit_rl.callbacks.SaveHFPretrained", "lit_rl.callbacks.export.SaveHFPretrained")
CHECKPOINT_CALLBACK = "lightning.pytorch.callbacks.ModelCheckpoint"


class CannotRunHere(Exception):
    """A pair that cannot run with this config on this machine; the message says why, in one line."""


@dataclass
class Layout:
    """One run of the check: a name, the keys it changes (dotted paths into the resolved config), and how it
    runs: `stop_at` stops it with SIGTERM after that step (and the check then runs the resume command it printed)."""

    name: str
    changes: dict[str, Any] = field(default_factory=dict)
    stop_at: Optional[int] = None
    description: Optional[str] = None  # what the changes mean, where their values alone do not say it
    validates: bool = False  # a validation batch after every micro-step (the check's other runs validate never)

    def describe(self) -> str:
        if self.description:
            return self.description
        parts = [f"{key.rsplit('.', 1)[-1]}={value}" for key, value in self.changes.items()]
        return ", ".join(parts) or "as configured"


def get(config: dict, key: str) -> Any:
    """The value at a dotted key of the resolved config (`model.init_args.schedule.micro_batch_size`), or None."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def with_changes(config: dict, changes: dict[str, Any]) -> dict:
    out = copy.deepcopy(config)
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


@dataclass(frozen=True)
class BatchKeys:
    """Where a config sets its rows per micro-batch, and the unit those rows must stay a multiple of."""

    micro_batch: str
    unit: int
    micro_batch_tokens: Optional[str] = None


def batch_keys(config: dict) -> BatchKeys:
    """Rollout algorithms size micro-batches in `model.schedule`; DPO and SFT by the data module's batch size."""
    if get(config, "model.init_args.schedule.micro_batch_size") is not None:
        model_class = import_callable(get(config, "model.class_path"), "model.class_path")
        return BatchKeys(
            "model.init_args.schedule.micro_batch_size",
            getattr(model_class, "micro_batch_unit", 1),
            "model.init_args.schedule.micro_batch_tokens",
        )
    if get(config, "data.init_args.batch_size") is not None:
        return BatchKeys("data.init_args.batch_size", 1)
    raise CannotRunHere("neither model.schedule.micro_batch_size nor data.batch_size is set")


def accumulation_layout(config: dict) -> Layout:
    """One micro-batch per step where the user accumulates; else the user's micro-batch split in two."""
    keys = batch_keys(config)
    rows, accumulate = get(config, keys.micro_batch), get(config, "trainer.accumulate_grad_batches") or 1
    tokens_off = (
        {keys.micro_batch_tokens: None} if keys.micro_batch_tokens and get(config, keys.micro_batch_tokens) else {}
    )
    if accumulate > 1:
        return Layout(
            "one_micro_batch",
            {keys.micro_batch: rows * accumulate, "trainer.accumulate_grad_batches": 1, **tokens_off},
        )
    if rows % (2 * keys.unit):
        raise CannotRunHere(f"{keys.micro_batch}={rows} cannot be split into 2 micro-batches of whole units")
    return Layout("two_micro_batches", {keys.micro_batch: rows // 2, "trainer.accumulate_grad_batches": 2})


def ranks_layouts(config: dict, gpus: int) -> tuple[Layout, Layout]:
    """(1 process, 2 processes) with the user's global batch. The 1-process side is the user's run when the user
    trains in one process on the device the pair uses."""
    keys = batch_keys(config)
    devices, nodes = get(config, "trainer.devices"), get(config, "trainer.num_nodes") or 1
    if nodes != 1 or devices not in (1, "1", 2, "2", "auto"):
        raise CannotRunHere(f"the config trains on {nodes} node(s) x {devices} devices; the pair compares 1 and 2")
    accelerator = "gpu" if gpus >= 2 else "cpu"
    rows, accumulate = get(config, keys.micro_batch), get(config, "trainer.accumulate_grad_batches") or 1
    one_strategy, two_strategy = ranks_strategies(get(config, "trainer.strategy"))
    one = {"trainer.devices": 1, "trainer.accelerator": accelerator, "trainer.strategy": one_strategy}
    two = {"trainer.devices": 2, "trainer.accelerator": accelerator, "trainer.strategy": two_strategy}
    if accumulate % 2 == 0:
        two["trainer.accumulate_grad_batches"] = accumulate // 2
    elif rows % (2 * keys.unit) == 0:
        two[keys.micro_batch] = rows // 2
    else:
        raise CannotRunHere(f"{keys.micro_batch}={rows} x accumulate {accumulate} cannot be halved for 2 processes")
    configured = {"auto": "gpu" if gpus else "cpu", "cuda": "gpu"}.get(get(config, "trainer.accelerator") or "auto")
    user_is_one = (
        str(devices) == "1"
        and (configured or get(config, "trainer.accelerator")) == accelerator
        and one_strategy == (get(config, "trainer.strategy") or "auto")
    )
    return Layout("straight" if user_is_one else "one_process", {} if user_is_one else one), Layout(
        "two_processes", two
    )


def ranks_strategies(strategy: Any) -> tuple[Any, Any]:
    """The strategies of the ranks pair's (1 process, 2 processes): the config's where it runs in both (DeepSpeed,
    on CPU too; DDP's variants on the two-process side), else the plain ones (`auto`, `ddp`), which
    `strategy_in_ranks_pair` says."""
    path = _strategy_path(strategy)
    if "deepspeed" in path.lower():
        return strategy, strategy
    if path.startswith("ddp") or path.rsplit(".", 1)[-1] == "DDPStrategy":  # a name, or the class with its arguments
        return "auto", strategy
    return "auto", "ddp"


def _strategy_path(strategy: Any) -> str:
    """`trainer.strategy` as one text: its class path, or its name (`ddp`; `auto` when unset)."""
    return strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "auto")


def strategy_in_ranks_pair(config: dict) -> str:
    """How the ranks pair treats the config's strategy, for its row: `DeepSpeedStrategy`, or what stands in."""
    strategy = get(config, "trainer.strategy")
    path = _strategy_path(strategy)
    name = path.rsplit(".", 1)[-1]
    if ranks_strategies(strategy) != ("auto", "ddp"):
        return name
    return "ddp" if path in ("auto", "ddp") else f"ddp in place of the config's {name}"


def processes(config: dict) -> int:
    """How many processes a resolved config trains in: `trainer.devices` (a count, a list or "0,1" of device
    ids, or "auto" / -1: every GPU where the accelerator may use them, else 1) x `trainer.num_nodes`."""
    devices = get(config, "trainer.devices")
    accelerator = str(get(config, "trainer.accelerator") or "auto")
    if isinstance(devices, list):
        count = len(devices)
    elif isinstance(devices, str) and "," in devices:
        count = len([d for d in devices.split(",") if d.strip()])
    elif str(devices) in ("auto", "-1"):
        import torch

        count = torch.cuda.device_count() if accelerator in ("auto", "gpu", "cuda") else 1
    else:
        count = int(devices) if str(devices).lstrip("-").isdigit() else 1
    return max(count, 1) * int(get(config, "trainer.num_nodes") or 1)


def check_runs_here(config: dict, gpus: int) -> None:
    """Refuse, in one line, a config that needs GPUs this machine does not have (every pair would fail alike)."""
    accelerator = str(get(config, "trainer.accelerator") or "auto")
    wanted = processes(config)
    if accelerator in ("gpu", "cuda") and gpus < wanted:
        raise CannotRunHere(
            f"the config trains on {wanted} GPU(s) (trainer.accelerator {accelerator}); this machine has {gpus}"
        )
    if get(config, "trainer.num_nodes") not in (None, 1):
        raise CannotRunHere("the config trains on several nodes; run the check on one node's share of it")


def packing_layout(config: dict) -> Layout:
    key = "model.init_args.policy.padding_free"
    current = get(config, key)
    if current is None:
        raise CannotRunHere("the algorithm has no model.policy.padding_free option")
    return Layout("padding_free" if not current else "padded", {key: not current})


VALIDATION_ROWS = 8  # the validation rows of the validation pair: one small batch after every micro-step


def validation_layout(config: dict) -> Layout:
    """A validation batch (at most `VALIDATION_ROWS` rows) after every micro-step, mid-accumulation too: what
    training computes and logs must not change (a validation that writes into the train metrics, or draws from the
    stream training samples with, does)."""
    if get(config, "data.init_args.val_data") is None:
        raise CannotRunHere("the config has no validation data (data.val_data)")
    changes: dict[str, Any] = {"data.init_args.val_limit": VALIDATION_ROWS}
    if get(config, "data.init_args.val_batch_size") is not None:
        changes["data.init_args.val_batch_size"] = VALIDATION_ROWS
    return Layout("validated", changes, description="a validation batch after every micro-step", validates=True)


def is_checkpoint_callback(callback: Any) -> bool:
    """A `ModelCheckpoint` (or a subclass) under any of its import paths."""
    path = callback.get("class_path") if isinstance(callback, dict) else None
    if not isinstance(path, str):
        return False
    from lightning.pytorch.callbacks import ModelCheckpoint

    try:
        found = import_callable(path, "trainer.callbacks")
    except Exception:  # noqa: BLE001  (a class that does not import fails the run itself, in one line)
        return False
    return isinstance(found, type) and issubclass(found, ModelCheckpoint)


def run_config(config: dict, layout: Layout, save_dir: str, steps: int, every_n: int, probe_dir: str) -> dict:
    """The config a layout runs: the user's with the layout's changes, `steps` optimizer steps, no validation (but
    where the layout validates), a CSV logger under `save_dir`, the user's first checkpoint callback every `every_n`
    steps into the run's directory (others dropped: the check needs one cadence, and two alike would share
    Lightning's state key), no HF export, and the probe that records the parameters (and stops the run where the
    layout says)."""
    out = with_changes(config, layout.changes)
    trainer = out["trainer"]
    configured = trainer.get("callbacks") or []
    configured = [configured] if isinstance(configured, dict) else list(configured)  # one callback, not a list
    callbacks: list[Any] = []
    checkpointing = False
    for callback in configured:
        path = callback.get("class_path") if isinstance(callback, dict) else None
        if path in EXPORT_CALLBACKS:
            continue
        if is_checkpoint_callback(callback):
            if checkpointing:
                continue
            checkpointing = True
            init = dict(callback.get("init_args") or {})
            init.update(dirpath=None, every_n_train_steps=every_n, save_top_k=-1, every_n_epochs=None)
            init.update(train_time_interval=None, monitor=None, save_last=init.get("save_last") or True)
            callback = {"class_path": path, "init_args": init}
        callbacks.append(callback)
    if not checkpointing:
        callbacks.append(
            {
                "class_path": CHECKPOINT_CALLBACK,
                "init_args": {
                    "filename": "{step}",
                    "every_n_train_steps": every_n,
                    "save_top_k": -1,
                    "save_last": True,
                },
            }
        )
    callbacks.append({"class_path": PROBE, "init_args": {"directory": probe_dir, "stop_at_step": layout.stop_at}})
    trainer.update(
        callbacks=callbacks,
        logger={
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": save_dir, "name": "run"},
        },
        max_steps=steps,
        max_epochs=None,
        max_time=None,
        min_steps=None,  # a minimum would defer the stop of the resume pair
        min_epochs=None,
        limit_val_batches=1 if layout.validates else 0,
        val_check_interval=1 if layout.validates else trainer.get("val_check_interval"),
        check_val_every_n_epoch=None if layout.validates else trainer.get("check_val_every_n_epoch"),
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        log_every_n_steps=1,  # every step is compared
        enable_checkpointing=True,
        default_root_dir=save_dir,
        fast_dev_run=False,
    )
    if get(out, "model.init_args.ref_cache_dir") is not None:  # DPO's precomputed reference log-probs
        out["model"]["init_args"]["ref_cache_dir"] = str(Path(save_dir) / "ref_cache")
    out["ckpt_path"] = None
    return out
