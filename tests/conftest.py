"""Shared helpers: run the real CLI in-process on the shipped tiny model, read what it wrote."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import inspect
import logging
import os
import shlex
import signal
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

# Before torch loads OpenMP: its idle threads sleep instead of spinning. With two test workers on two cores, each
# process's OpenMP threads spun after every small op while the other worker's process needed the core. Measured on
# 2 cores, two `lit-rl fit --config configs/grpo.yaml --trainer.max_steps 4` side by side: 27-30 s each unset,
# 13-16 s with this (20 steps: 115-134 s against 18-20 s; alone, 16-18 s either way); five tests of
# test_check/test_rank_invariance on two workers: 155.6 s unset, 136.4 s with it. Same threads, same arithmetic:
# only how an idle thread waits. The workers and every run they start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before lit_rl imports huggingface_hub, which reads these once, on import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from lit_rl.config import MOVED_KEYS, _0_1_value, as_args  # noqa: E402
from lit_rl.errors import ConfigError  # noqa: E402
from tests.fake_vllm import fake_server  # noqa: F401  (a fixture: a stdlib server playing vLLM)
from tests.skip_guard import (  # noqa: F401  (hooks: under CI, a skip for any reason but no GPU fails the run)
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# A CPU without bf16 instructions (AVX-512 BF16, AMX; an AVX2 AMD EPYC here) emulates bf16 matmuls, rounding
# otherwise than the kernels a test compares: properties of bf16 kernels are checked where the CPU has them.
needs_native_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="this CPU has no bfloat16 unit: its bf16 matmuls are emulated, with rounding unlike the kernels compared",
)

# Library loggers keep the stream of the first test that configured them; pytest closes captured streams between
# tests, and logging would then print "--- Logging error ---" tracebacks into the next test's output.
logging.raiseExceptions = False


@pytest.fixture(autouse=True)
def sigint_left_as_found(request):
    """Each test leaves SIGINT as it found it: Python's handler, the signal mask, and the handler the C library
    holds (native code can take SIGINT over without Python knowing: `signal.getsignal` still answers
    `default_int_handler`). Twice a full local run failed the in-process Ctrl-C test of `lit-rl check` after some
    earlier test, with Python's handler and the mask unchanged and no Ctrl-C reaching Python; alone it passes. What
    changed is put back, and a warning names the test that changed it. The first two-worker run (xdist) warned once:
    the Ctrl-C test found SIGINT ignored (SIG_IGN, in Python and in the C library) and installed Python's handler.
    No test before it had changed it, so it was set outside a test's own fixtures: by a module-scoped fixture, or
    between tests (Lightning ignores SIGINT when a `fit` ends in a KeyboardInterrupt, `trainer/call.py`)."""
    before = _sigint_state()
    yield
    after = _sigint_state()
    if after != before:
        signal.signal(signal.SIGINT, before[0])  # installs Python's C handler again, whoever replaced it
        signal.pthread_sigmask(signal.SIG_SETMASK, before[1])
        warnings.warn(f"{request.node.nodeid} changed SIGINT (handler, mask, C handler): {before} -> {after}")


@contextlib.contextmanager
def environment_restored():
    """`os.environ` as it was on entry, put back on exit: what the block set, changed or removed is undone."""
    saved = dict(os.environ)
    try:
        yield
    finally:  # by difference: other threads may read the environment meanwhile
        for name in set(os.environ) - set(saved):
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """Each test leaves the worker's environment variables as it found them. Code run in the worker's own process
    sets some (`lit-rl check` sets MKL's reproducible mode, `seed_everything` PL_GLOBAL_SEED), and every later CLI
    process of that worker would inherit them, which a user's `lit-rl fit` does not."""
    with environment_restored():
        yield


def _sigint_state() -> tuple:
    import ctypes

    action = ctypes.create_string_buffer(256)  # struct sigaction, whose first field is the handler's address
    ctypes.CDLL(None).sigaction(signal.SIGINT, None, action)
    c_handler = int.from_bytes(action.raw[:8], sys.byteorder)
    return signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []), c_handler


def write_overlay(
    path: Path,
    every_n_train_steps: Optional[int] = None,
    save_dir: Optional[Path] = None,
    extra: Optional[dict[str, Any]] = None,
    save_last: Optional[str] = None,
) -> Path:
    """A config overlay for tests: logs under `save_dir`, checkpoints every N steps (or none), no progress bar."""
    callbacks = []
    if every_n_train_steps:
        callbacks.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {
                    "filename": "{step}",
                    "every_n_train_steps": every_n_train_steps,
                    "save_top_k": -1,
                    "save_last": save_last,
                },
            }
        )
    trainer = {
        "enable_progress_bar": False,
        "enable_checkpointing": bool(every_n_train_steps),
        "callbacks": callbacks,
        "logger": {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(save_dir or path.parent), "name": "run", "version": 0},
        },
    }
    config: dict[str, Any] = {"trainer": trainer}
    for section, values in (extra or {}).items():
        config.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(config))
    return path


# Small, fast GRPO settings for the tiny model: 2 prompts x G=4 per generation by default.
FAST_GRPO = [
    "--model.sampling.num_generations",
    "4",
    "--model.schedule.micro_batch_size",
    "8",
    "--model.sampling.max_new_tokens",
    "4",
    "--data.val_limit",
    "16",
    "--data.val_batch_size",
    "16",
    "--trainer.val_check_interval",
    "1000",
    "--trainer.num_sanity_val_steps",
    "0",
]


def run_cli(*args: str) -> None:
    from lit_rl.cli import main

    main(list(args))


def bash_block(page: str, containing: str = "") -> str:
    """The first fenced bash block of `docs/<page>` whose text holds `containing`, as the page prints it."""
    blocks = (REPO / "docs" / page).read_text().split("```bash\n")[1:]
    return next(block.split("```", 1)[0] for block in blocks if containing in block.split("```", 1)[0])


def documented_fit(block: str) -> list[str]:
    """A docs page's `lit-rl fit` command (its bash block's text) as the CLI's arguments: split as a shell splits it,
    the repository's configs by their path."""
    words = shlex.split(block.replace("\\\n", " "))
    assert words[:2] == ["lit-rl", "fit"], words
    return [str(REPO / word) if word.startswith("configs/") else word for word in words[1:]]


def fit_documented_two_steps(block: str, folder: Path, *extra: str) -> Path:
    """A docs page's `lit-rl fit` command for 2 steps, validating at step 2 (the test overlay, the suite's small
    batches and `extra` on top), logging under `folder`; its log directory."""
    overlay = write_overlay(folder / "overlay.yaml", save_dir=folder / "runs")
    steps = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    run_cli(*documented_fit(block), "--config", str(overlay), *FAST_GRPO, *steps, *extra)
    return folder / "runs" / "run" / "version_0"


def fit_config(tmp_path: Path, name: str, config: str, *args: str, every_n: Optional[int] = None) -> Path:
    """`lit-rl fit --config configs/<config> <test overlay> *args` in this process, logging under
    `tmp_path/name` (checkpoints every `every_n` steps, or none); its log directory."""
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=every_n, save_dir=tmp_path / name)
    run_cli("fit", "--config", str(CONFIGS / config), "--config", str(overlay), *args)
    return tmp_path / name / "run" / "version_0"


def read_metrics(log_dir: Path) -> list[dict[str, str]]:
    with open(log_dir / "metrics.csv") as handle:
        return list(csv.DictReader(handle))


def train_rows(log_dir: Path) -> list[dict[str, float]]:
    """Rows of metrics.csv that carry train/ values, as floats (empty cells dropped)."""
    rows = []
    for row in read_metrics(log_dir):
        values = {k: float(v) for k, v in row.items() if v != "" and (k.startswith("train/") or k == "step")}
        if any(k.startswith("train/") for k in values):
            rows.append(values)
    return rows


def without_engine_gap(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    """Rows without the engine-vs-trainer mismatch metrics (`train/rollout_logprob_diff/*`, `train/rollout_kl`,
    `train/rollout_is_ratio/*`): rounding noise around 1e-6, different in every layout of the same run."""
    return [{k: v for k, v in row.items() if not k.startswith("train/rollout_")} for row in rows]


def assert_rows_match(rows: list[dict[str, float]], reference: list[dict[str, float]], **tolerance: Any) -> None:
    """Each row has a reference row with the same step, with the same keys (a metric missing on either side
    fails), and every value equals the reference's (pytest.approx with `tolerance`). `rows` may cover only some
    of the reference's steps (a resumed run), but not none."""
    assert rows, "no rows to compare"
    by_step = {row["step"]: row for row in reference}
    assert len(by_step) == len(reference), "the reference has two rows for one step"
    for row in rows:
        assert row["step"] in by_step, f"step {row['step']} is not in the reference"
        expected = by_step[row["step"]]
        assert sorted(row) == sorted(expected), (row["step"], sorted(set(row) ^ set(expected)))
        for key, value in row.items():
            assert value == pytest.approx(expected[key], **tolerance), (row["step"], key)


def strategy_overlay(name: str) -> list[str]:
    """`--config configs/strategy/<name>.yaml`; under ZeRO-3 with every parameter partitioned. DeepSpeed keeps
    parameters under `param_persistence_threshold` (100k) elements whole on every rank, which is every parameter
    of the tiny model: without this, a ZeRO-3 test would gather nothing and prove nothing about partitions."""
    overlay = ["--config", str(CONFIGS / "strategy" / f"{name}.yaml")]
    if name == "deepspeed_zero3":
        overlay += ["--config", str(REPO / "tests" / "integration" / "zero3_partition_all.yaml")]
    return overlay


# The real CLI in a separate process (multi-process strategies, signals, exit codes).
CLI_COMMAND = [sys.executable, "-m", "lit_rl.cli"]


def python_path(*first: Path) -> str:
    """PYTHONPATH for a process a test starts: `first`, then the repository, then what the caller's PYTHONPATH
    holds (kept: a GPU machine's carried wheels are found through it)."""
    return os.pathsep.join([*map(str, first), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def cli_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": python_path()}


def fit_in_subprocess(
    tmp_path: Path,
    name: str,
    config: str,
    *args: str,
    every_n_train_steps: Optional[int] = 2,
    env: Optional[dict[str, str]] = None,
) -> Path:
    """`lit-rl fit --config configs/<config> <test overlay> *args` as a process (multi-process strategies, vLLM);
    asserts it succeeded and returns its log directory (checkpoints every `every_n_train_steps`); its stderr is
    kept in `<tmp_path>/<name>.stderr`."""
    import subprocess

    overlay = write_overlay(
        tmp_path / f"{name}.yaml", every_n_train_steps=every_n_train_steps, save_dir=tmp_path / name
    )
    command = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / config), "--config", str(overlay), *args]
    result = subprocess.run(command, cwd=tmp_path, env=env or cli_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    (tmp_path / f"{name}.stderr").write_text(result.stderr)
    return tmp_path / name / "run" / "version_0"


def quiet_trainer(**trainer_args: Any):
    """A CPU Lightning Trainer without logger, checkpoints, progress bar or model summary; `trainer_args` on top."""
    import lightning as L

    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return L.Trainer(accelerator="cpu", **{**quiet, **trainer_args})


def fit_grpo(
    max_steps: int = 1,
    callbacks: Optional[list] = None,
    algorithm: str = "GRPO",
    prepare: Optional[Callable[[Any], None]] = None,
    train_data: str = "builtin:addition/train",
    **model_args: Any,
):
    """GRPO (or the on-policy `algorithm` named) on the tiny model for `max_steps` optimizer steps with a plain
    Trainer (no CLI, no logger) on `train_data`; the fitted module. `prepare(module)` runs before the fit."""
    import lightning as L

    import lit_rl.algorithms
    from lit_rl.data import PromptDataModule

    args = dict(num_generations=4, micro_batch_size=8, max_new_tokens=4, temperature=1.0)
    cls = getattr(lit_rl.algorithms, algorithm)
    model = cls(**grouped_kwargs(cls, **{**args, **model_args}))
    if prepare is not None:
        prepare(model)
    trainer = quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=callbacks)
    L.seed_everything(0)
    trainer.fit(model, PromptDataModule(train_data=train_data, val_data=None))
    return model


def fit_on_episodes(algorithm: str = "GRPO", **model_args: Any):
    """One step of the on-policy `algorithm` on Countdown episodes (up to 3 model turns of 3 tokens, observations
    between; 2 passes per generation, `fit_grpo`); the fitted module and its buffer's observation tokens [N, T],
    checked to be there (several turns in every episode)."""
    model = fit_grpo(
        algorithm=algorithm,
        environment="tests.integration.envs.Countdown",
        max_turns=3,
        max_new_tokens=3,
        num_iterations=2,
        **model_args,
    )
    buffer = model._buffer
    observations = (buffer.completion_mask > 0) & (buffer.sampled_mask == 0)
    assert observations.any() and buffer.episode_stats[:, 0].min() >= 2  # several turns, observations between
    return model, observations


def perturbed_lora_model(**config: Any) -> torch.nn.Module:
    """The shipped SFT model with a LoRA adapter (r 4, `config` on top) whose trainable weights are moved by
    N(0, 0.05) noise, so that merged weights differ from the frozen ones."""
    from lit_rl.modeling.lora import LoRAConfig, apply_lora
    from lit_rl.modeling.models import load_causal_lm

    model = apply_lora(
        load_causal_lm("lit-rl/tiny-qwen2-addition-sft", disable_dropout=True), LoRAConfig(r=4, **config)
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn_like(param) * 0.05)
    return model


def build_tiny_reward_model(path: Path) -> Path:
    """A randomly initialised one-label Qwen2 sequence classifier with the tiny tokenizer, saved at `path`."""
    from transformers import Qwen2ForSequenceClassification

    from lit_rl.modeling.models import build_char_tokenizer, tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config()
    config.num_labels = 1
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


def saved_steps(log_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("=")[1]) for p in (log_dir / "checkpoints").glob("step=*.ckpt"))


@pytest.fixture
def tmp_run(tmp_path):
    return tmp_path


def grouped_kwargs(cls: type, **kwargs: Any) -> dict[str, Any]:
    """Keyword arguments of algorithm `cls` written flat, as lit-rl 0.1 took them (`temperature=0.7`) and tests
    still write them, grouped as its `__init__` takes them now (`sampling=SamplingArgs(..., temperature=0.7)`);
    each group starts from `cls`'s own default (PPO samples 4 completions per prompt, GRPO 8). Grouped and own
    arguments pass through, so `cls(**grouped_kwargs(cls, ...))` builds what the 0.1 call did."""
    parameters = inspect.signature(cls.__init__).parameters
    out: dict[str, Any] = {}
    fields: dict[str, dict[str, Any]] = {}
    for key, value in kwargs.items():
        place = MOVED_KEYS.get(key)
        if key in parameters or place is None:
            out[key] = value
            continue
        group, field = place.split(".")
        fields.setdefault(group, {})[field] = _0_1_value(key, value)
    for group, changes in fields.items():
        if group not in parameters:
            raise ConfigError(f"{cls.__name__} takes no {group!r} group, so no {', '.join(changes)}")
        default = parameters[group].default  # the algorithm's own instance: its class and its defaults
        base = as_args(type(default), out.get(group, default))
        out[group] = dataclasses.replace(base, **changes)
    return out


def listening_addresses(port: int) -> list[str]:
    """The local addresses with a socket listening on `port`, as the kernel lists them (/proc/net/tcp, tcp6)."""
    from lit_rl.rollout.server.listeners import listening_sockets

    return [str(address) for address, _ in listening_sockets(port) or []]


@pytest.fixture
def first_free_port_taken(monkeypatch):
    """`free_port` finds a port another process then binds before the server it was found for (a CI run failed so):
    its first answer is a port a socket here listens on, its second a free one, which the fixture returns."""
    import socket

    from lit_rl.rollout.server import client

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    other_port = client.free_port()
    answers = iter([taken.getsockname()[1], other_port])
    monkeypatch.setattr(client, "free_port", lambda: next(answers))
    yield other_port
    taken.close()
