"""Non-finite gradients, atomic checkpoint writes (files and DeepSpeed directories), and SIGTERM handling. The real
DeepSpeed runs (SIGKILL mid-save, NaN gradients under ZeRO-2/3) are in tests/integration/test_deepspeed.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lit_rl.callbacks import NonFiniteError, NonFiniteGuard
from lit_rl.training import checkpoint as checkpoint_module
from lit_rl.training.checkpoint import AtomicCheckpointIO, publish_directory, remove_directory, remove_stale_temporaries
from tests.conftest import CLI_COMMAND, CONFIGS, FAST_GRPO, cli_env, saved_steps, train_rows, write_overlay


class NaNAtStep(L.LightningModule):
    """A linear model whose loss turns NaN at optimizer step `bad_step` (1-based)."""

    def __init__(self, bad_step: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.bad_step = bad_step
        self.weights_before_bad_step = None

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        if self.global_step + 1 == self.bad_step:
            self.weights_before_bad_step = self.layer.weight.detach().clone()
            loss = loss * float("nan")
        return loss

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(64, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


def _trainer(tmp_path, guard, max_steps=5):
    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1
    )
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        callbacks=[guard, checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_nonfinite_gradient_stops_at_its_step_without_a_checkpoint_of_it(tmp_path):
    with pytest.raises(NonFiniteError, match="non-finite loss or gradient at step 3"):
        _trainer(tmp_path, NonFiniteGuard()).fit(NaNAtStep(bad_step=3))
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["step=1.ckpt", "step=2.ckpt"]
    for path in tmp_path.glob("*.ckpt"):
        state = torch.load(path, weights_only=True)["state_dict"]
        assert all(torch.isfinite(v).all() for v in state.values())


def test_skip_leaves_the_weights_unchanged_and_training_goes_on(tmp_path):
    module, guard = NaNAtStep(bad_step=3), NonFiniteGuard(action="skip")
    trainer = _trainer(tmp_path, guard)
    trainer.fit(module)
    assert trainer.global_step == 5 and guard.skipped_steps == 1
    after_step_3 = torch.load(tmp_path / "step=3.ckpt", weights_only=True)["state_dict"]["layer.weight"]
    assert torch.equal(after_step_3, module.weights_before_bad_step)
    assert torch.isfinite(module.layer.weight).all()


SLOW_SAVE = """
import sys, time, torch
from lit_rl.training.checkpoint import AtomicCheckpointIO

class Slow:
    def __reduce__(self):
        print("saving", flush=True)
        time.sleep(60)  # killed here, in the middle of writing the file
        return (int, (0,))

io = AtomicCheckpointIO()
io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, sys.argv[1] + "/step=1.ckpt")
io.save_checkpoint({"state_dict": {"w": torch.ones(3) * 2}, "blob": torch.zeros(1 << 20)}, sys.argv[1] + "/step=1.ckpt")
"""


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    script = tmp_path / "slow_save.py"
    script.write_text(SLOW_SAVE.replace("torch.zeros(1 << 20)}", "torch.zeros(1 << 20), 'slow': Slow()}"))
    env = cli_env()
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout.readline().strip() == "saving"  # the second save is half-way through pickling
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    checkpoint = torch.load(tmp_path / "step=1.ckpt", weights_only=True)
    assert torch.equal(checkpoint["state_dict"]["w"], torch.ones(3))  # the previous, complete checkpoint
    leftovers = list(tmp_path.glob(".step=1.ckpt.tmp-*"))
    assert len(leftovers) == 1  # the partial write went to a temporary file...
    AtomicCheckpointIO().save_checkpoint({"w": 3}, tmp_path / "step=1.ckpt")
    assert not list(tmp_path.glob(".step=1.ckpt.tmp-*"))  # ...which the next save in the directory removes


def test_a_full_disk_during_a_save_is_said_naming_the_checkpoint(tmp_path, monkeypatch):
    """torch's writer reports a full disk as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`,
    the OSError only as its context and with no file name: the run ended in a 67-line traceback. The save now
    raises an OSError naming the checkpoint, which `lit-rl fit` reports in one line (`user_error_message`)."""
    import errno

    from lit_rl.cli import user_error_message

    def full_disk(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7627584 vs 7627472")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError) as failed:
        AtomicCheckpointIO().save_checkpoint({"w": 3}, tmp_path / "step=1.ckpt")
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "step=1.ckpt")
    assert user_error_message(failed.value) == f"{tmp_path / 'step=1.ckpt'}: No space left on device"
    assert not list(tmp_path.iterdir())  # nor a temporary file left behind


def _checkpoint_dir(path, value):
    (path / "checkpoint").mkdir(parents=True)
    (path / "checkpoint" / "shard.pt").write_text(value)
    return path


def _shard(path):
    return (path / "checkpoint" / "shard.pt").read_text()


@pytest.mark.parametrize("exchange", [True, False])
def test_publish_directory_replaces_a_directory_or_a_link_whole(tmp_path, monkeypatch, exchange):
    if not exchange:  # a filesystem without renameat2(RENAME_EXCHANGE): the old one is moved aside first
        monkeypatch.setattr(checkpoint_module, "_exchange", lambda a, b: False)
    publish_directory(_checkpoint_dir(tmp_path / ".step=2.ckpt.tmp", "2"), tmp_path / "step=2.ckpt")
    publish_directory(_checkpoint_dir(tmp_path / ".last.ckpt.tmp", "old"), tmp_path / "last.ckpt")
    publish_directory(_checkpoint_dir(tmp_path / ".last.ckpt.tmp", "new"), tmp_path / "last.ckpt")
    assert _shard(tmp_path / "last.ckpt") == "new"
    remove_directory(tmp_path / "last.ckpt")
    os.symlink("step=2.ckpt", tmp_path / "last.ckpt")  # `save_last: link`, then a full save to last.ckpt
    publish_directory(_checkpoint_dir(tmp_path / ".last.ckpt.tmp", "4"), tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink() and _shard(tmp_path / "last.ckpt") == "4"
    assert _shard(tmp_path / "step=2.ckpt") == "2"  # the link's target untouched (DeepSpeed wrote into it)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=2.ckpt"]


def test_stale_temporaries_and_removed_checkpoints_never_look_like_checkpoints(tmp_path):
    _checkpoint_dir(tmp_path / ".step=4.ckpt.tmp", "partial")  # a save killed half-way
    _checkpoint_dir(tmp_path / "step=2.ckpt", "2")
    (tmp_path / ".step=6.ckpt.tmp-123").write_text("AtomicCheckpointIO's, not a directory")
    remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step=6.ckpt.tmp-123", "step=2.ckpt"]
    os.symlink("step=2.ckpt", tmp_path / "last.ckpt")
    remove_directory(tmp_path / "last.ckpt")  # a link: only the link goes
    assert _shard(tmp_path / "step=2.ckpt") == "2"
    remove_directory(tmp_path / "step=2.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step=6.ckpt.tmp-123"]


def test_deepspeed_by_name_or_as_lightnings_class_becomes_the_subclass_with_atomic_directories():
    from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

    from lit_rl.training.strategies import DeepSpeedStrategy, as_project_deepspeed

    by_name = as_project_deepspeed("deepspeed_stage_3_offload")
    assert type(by_name) is DeepSpeedStrategy and by_name.config["zero_optimization"]["stage"] == 3
    assert by_name.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    by_class = as_project_deepspeed(LightningDeepSpeedStrategy(stage=2))
    assert type(by_class) is DeepSpeedStrategy and by_class.config["zero_optimization"]["stage"] == 2
    assert as_project_deepspeed("ddp") == "ddp" and as_project_deepspeed("auto") == "auto"


def _engine(stage, dtype=torch.float32, check_grad_overflow=False, compute_grad_norm=True):
    optimizer = SimpleNamespace(
        dtype=dtype, check_grad_overflow=check_grad_overflow, compute_grad_norm=compute_grad_norm
    )
    return SimpleNamespace(zero_optimization_stage=lambda: stage, optimizer=optimizer)


def test_skip_under_deepspeed_only_where_deepspeed_discards_non_finite_steps():
    from lit_rl.training.strategies import deepspeed_discards_non_finite_steps as discards

    assert discards(_engine(3, torch.bfloat16)) and discards(_engine(2)) and discards(_engine(1))
    assert discards(_engine(2, torch.bfloat16, check_grad_overflow=True))
    assert not discards(_engine(2, torch.bfloat16))  # DeepSpeed's bf16 default: a NaN step would be applied
    assert not discards(_engine(2, compute_grad_norm=False)) and not discards(_engine(0))


@pytest.mark.slow
def test_sigterm_writes_a_resumable_checkpoint_and_exits_non_zero(tmp_path):
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=1000, save_dir=tmp_path / "runs")
    base = [
        *CLI_COMMAND,
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(overlay),
        *FAST_GRPO,
        "--trainer.limit_val_batches",
        "0",
    ]
    env = cli_env()
    process = subprocess.Popen(
        [*base, "--trainer.max_steps", "100000"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # Wait until training is under way: the CSV logger first writes metrics.csv after 100 steps.
    metrics = tmp_path / "runs" / "run" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + 240
    while not metrics.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metrics.exists(), "training did not start"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last_line = stderr.strip().splitlines()[-1]
    assert last_line.startswith("lit-rl: stopped by SIGTERM after step ") and "--ckpt_path last" in last_line
    checkpoints = tmp_path / "runs" / "run" / "version_0" / "checkpoints"
    state = torch.load(checkpoints / "last.ckpt", weights_only=True)
    stopped = state["global_step"]
    assert stopped > 0 and f"after step {stopped};" in last_line
    resumed = subprocess.run(
        [*base, "--trainer.max_steps", str(stopped + 2), "--ckpt_path", "last"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log_dir = tmp_path / "runs" / "run" / "version_0"
    # Continued, not restarted, and the rows of the stopped run kept: every step once.
    assert [r["step"] for r in train_rows(log_dir)] == list(range(1, stopped + 3))
    assert saved_steps(log_dir) == []  # cadence 1000: nothing else saved
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == stopped


def test_has_non_finite_finds_one_bad_element_in_any_dtype():
    from lit_rl.callbacks.safety import has_non_finite
    from lit_rl.training.compat import foreach_norm

    tensors = [torch.randn(64, 32), torch.randn(7, dtype=torch.bfloat16), torch.randn(3, 3, 3)]
    assert not has_non_finite(tensors)
    assert not has_non_finite([])
    assert not has_non_finite([torch.full((100,), 60000.0, dtype=torch.float16)])  # an fp16 L2 norm would overflow
    # bfloat16 norms keep their dtype (float32's range) and sum their squares in float32: large finite values stay
    # finite
    large, many = torch.full((1000,), 1e17, dtype=torch.bfloat16), torch.ones(10**6, dtype=torch.bfloat16)
    assert not has_non_finite([large, many])
    assert foreach_norm([many])[0].item() == 1000.0  # float32 accumulation: a bf16 sum of squares stops at 256
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in range(len(tensors)):
            broken = [t.clone() for t in tensors]
            broken[index].view(-1)[5] = bad
            assert has_non_finite(broken), (bad, index)


def _stopped_into(tmp_path, logger, log_dir: str) -> list[str]:
    """Where GracefulStop writes its checkpoint for a trainer without a checkpoint callback, whose logger is
    `logger` and whose `log_dir` is `log_dir` (what that logger gives)."""
    import signal
    from types import SimpleNamespace

    from lit_rl.callbacks import GracefulStop

    saved = []
    trainer = SimpleNamespace(
        global_step=3,
        world_size=1,
        checkpoint_callback=None,
        logger=logger,
        log_dir=log_dir,
        default_root_dir=str(tmp_path),
        strategy=SimpleNamespace(broadcast=lambda obj: obj),
        save_checkpoint=lambda path, weights_only: saved.append(path),
        should_stop=False,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_skip_next_val=False)),
    )
    stop = GracefulStop()
    stop.received = signal.SIGTERM
    stop.on_train_batch_end(trainer, SimpleNamespace(device=torch.device("cpu")))
    assert trainer.should_stop
    return saved


def test_a_stop_without_a_checkpoint_callback_writes_where_lightning_puts_the_runs_checkpoints(tmp_path):
    """Without a checkpoint callback the stop wrote `<log_dir>/checkpoints/last.ckpt`; a W&B, MLflow or Trackio
    logger's `log_dir` is the save_dir every run shares, so each stopped run wrote over the last one's, and a
    TensorBoard logger's ends in its `sub_dir`, where `--ckpt_path last` does not look. It writes where Lightning
    puts the run's checkpoints, `<save_dir>/<name>/<version>/checkpoints` (`lightnings_checkpoint_dir`)."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import CSVLogger

    shared = SimpleNamespace(save_dir=str(tmp_path), name="my-project", version="run-7")
    assert _stopped_into(tmp_path, shared, str(tmp_path)) == [
        str(tmp_path / "my-project" / "run-7" / "checkpoints" / "last.ckpt")
    ]
    # A numbered logger whose log_dir is below its version directory, as TensorBoard's with a sub_dir.
    numbered = CSVLogger(save_dir=str(tmp_path), name="tb", version=0)
    below = str(tmp_path / "tb" / "version_0" / "sub")
    assert _stopped_into(tmp_path, numbered, below) == [
        str(tmp_path / "tb" / "version_0" / "checkpoints" / "last.ckpt")
    ]


def test_only_loggers_whose_directory_is_known_before_fit_are_checked_for_another_runs_files(tmp_path):
    """The run-directory check reads the logger's version before `fit`: MLflow's starts its run then, W&B's is None."""
    from lightning.pytorch.loggers import CSVLogger, Logger

    from lit_rl.callbacks.export import knows_its_directory_before_fit
    from lit_rl.loggers import TrackioLogger

    class StartsARunWhenAsked(Logger):  # as MLflow's: its version starts a run
        name = "mlflow-like"

        @property
        def version(self):
            raise AssertionError("read before fit")

        def log_hyperparams(self, params, *args, **kwargs) -> None: ...

        def log_metrics(self, metrics, step=None) -> None: ...

    assert knows_its_directory_before_fit(None) and knows_its_directory_before_fit(CSVLogger(str(tmp_path)))
    assert knows_its_directory_before_fit(TrackioLogger(project="p", name="n"))
    assert not knows_its_directory_before_fit(StartsARunWhenAsked())
