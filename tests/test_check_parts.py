"""The parts of `lit-rl check` that decide: the layouts a config is run in, and how two runs are compared."""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from lit_rl.check.compare import (
    BF16,
    FP32,
    NOT_MOVED,
    WEIGHTS,
    compare_parameters,
    compare_rows,
    judge,
    tolerance_for,
)
from lit_rl.check.layouts import (
    CannotRunHere,
    Layout,
    accumulation_layout,
    check_runs_here,
    packing_layout,
    ranks_layouts,
    run_config,
)
from lit_rl.check.runner import RunResult, run_cli


def _config(**trainer):
    return {
        "trainer": {"devices": 1, "accelerator": "cpu", "accumulate_grad_batches": 1, "callbacks": [], **trainer},
        "model": {
            "class_path": "lit_rl.algorithms.GRPO",
            "init_args": {
                "schedule": {"micro_batch_size": 8, "micro_batch_tokens": None},
                "policy": {"padding_free": False},
            },
        },
        "data": {"init_args": {}},
    }


def test_accumulation_compares_with_one_micro_batch_or_splits_a_single_one():
    assert accumulation_layout(_config(accumulate_grad_batches=4)).changes == {
        "model.init_args.schedule.micro_batch_size": 32,
        "trainer.accumulate_grad_batches": 1,
    }
    assert accumulation_layout(_config()).changes == {
        "model.init_args.schedule.micro_batch_size": 4,
        "trainer.accumulate_grad_batches": 2,
    }
    odd = _config()
    odd["model"]["init_args"]["schedule"]["micro_batch_size"] = 3
    with pytest.raises(CannotRunHere, match="micro_batch_size=3 cannot be split"):
        accumulation_layout(odd)


def test_online_dpo_keeps_whole_pairs_and_dpo_sizes_by_its_data_module():
    online = _config()
    online["model"]["class_path"] = "lit_rl.algorithms.OnlineDPO"
    online["model"]["init_args"]["schedule"]["micro_batch_size"] = 2  # one pair: cannot be split
    with pytest.raises(CannotRunHere):
        accumulation_layout(online)
    dpo = _config(accumulate_grad_batches=2)
    dpo["model"] = {"class_path": "lit_rl.algorithms.DPO", "init_args": {"policy": {}}}
    dpo["data"]["init_args"]["batch_size"] = 16
    assert accumulation_layout(dpo).changes == {"data.init_args.batch_size": 32, "trainer.accumulate_grad_batches": 1}


def test_ranks_keep_the_global_batch_and_reuse_the_users_one_process_run():
    one, two = ranks_layouts(_config(accumulate_grad_batches=2), gpus=0)
    assert one.name == "straight" and one.changes == {}
    assert two.changes["trainer.devices"] == 2 and two.changes["trainer.accumulate_grad_batches"] == 1
    _, two = ranks_layouts(_config(), gpus=0)
    assert two.changes["model.init_args.schedule.micro_batch_size"] == 4
    one, _ = ranks_layouts(_config(accelerator="gpu"), gpus=0)  # a GPU config on a CPU machine: both sides on CPU
    assert one.name == "one_process" and one.changes["trainer.accelerator"] == "cpu"


def test_ranks_run_the_configs_deepspeed_on_both_sides_and_name_a_strategy_that_stands_in():
    """The pair ran every config in `auto` against `ddp`: a DeepSpeed config's ZeRO never ran on two ranks in it,
    and its row said nothing of it (an outside read found it)."""
    from lit_rl.check.layouts import strategy_in_ranks_pair

    deepspeed = {"class_path": "lit_rl.training.strategies.DeepSpeedStrategy", "init_args": {"stage": 2}}
    one, two = ranks_layouts(_config(devices=2, strategy=deepspeed), gpus=0)
    assert one.changes["trainer.strategy"] == deepspeed and two.changes["trainer.strategy"] == deepspeed
    assert one.name == "one_process"  # the user's run is the two-process side here
    assert strategy_in_ranks_pair(_config(strategy=deepspeed)) == "DeepSpeedStrategy"
    assert strategy_in_ranks_pair(_config()) == "ddp"
    one, two = ranks_layouts(_config(strategy="ddp_find_unused_parameters_true"), gpus=0)
    assert (one.changes["trainer.strategy"], two.changes["trainer.strategy"]) == (
        "auto",
        "ddp_find_unused_parameters_true",
    )
    ddp = {"class_path": "lightning.pytorch.strategies.DDPStrategy", "init_args": {"timeout": "0:10:00"}}
    one, two = ranks_layouts(_config(strategy=ddp), gpus=0)  # its arguments kept on the two-process side
    assert (one.changes["trainer.strategy"], two.changes["trainer.strategy"]) == ("auto", ddp)
    assert strategy_in_ranks_pair(_config(strategy=ddp)) == "DDPStrategy"
    fsdp = {"class_path": "lightning.pytorch.strategies.FSDPStrategy"}
    assert strategy_in_ranks_pair(_config(strategy=fsdp)) == "ddp in place of the config's FSDPStrategy"


def test_the_validation_pair_validates_a_few_rows_after_every_micro_step():
    from lit_rl.check.layouts import run_config, validation_layout

    with pytest.raises(CannotRunHere, match=r"no validation data \(data.val_data\)"):
        validation_layout(_config())
    config = _config(val_check_interval=50)
    config["data"]["init_args"].update(val_data="builtin:addition/val", val_batch_size=256)
    layout = validation_layout(config)
    assert layout.changes == {"data.init_args.val_limit": 8, "data.init_args.val_batch_size": 8}
    trainer = run_config(config, layout, "/tmp/x", 2, 2, "/tmp/x")["trainer"]
    assert (trainer["limit_val_batches"], trainer["val_check_interval"], trainer["check_val_every_n_epoch"]) == (
        1,
        1,
        None,
    )
    assert run_config(config, Layout("straight"), "/tmp/x", 2, 2, "/tmp/x")["trainer"]["limit_val_batches"] == 0


def test_a_config_that_needs_missing_gpus_is_refused_in_one_line():
    with pytest.raises(CannotRunHere, match="trains on 8 GPU"):
        check_runs_here(_config(accelerator="gpu", devices=8), gpus=1)
    check_runs_here(_config(), gpus=0)


def test_packing_flips_padding_free():
    assert packing_layout(_config()).changes == {"model.init_args.policy.padding_free": True}


def test_a_run_writes_only_under_its_directory_and_keeps_the_users_checkpoint_callback():
    config = _config()
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": "/users/ckpts", "every_n_train_steps": 100, "filename": "{step}"},
        },
        {"class_path": "lit_rl.callbacks.SaveHFPretrained", "init_args": {"dirpath": None}},
    ]
    config["trainer"]["logger"] = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {}}
    out = run_config(config, Layout("x", stop_at=1), "/scratch/x", steps=2, every_n=1, probe_dir="/scratch/x")
    callbacks = out["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks] == [
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lit_rl.check.probe.CheckProbe",
    ]
    assert callbacks[0]["init_args"]["dirpath"] is None and callbacks[0]["init_args"]["every_n_train_steps"] == 1
    assert callbacks[0]["init_args"]["filename"] == "{step}"
    assert callbacks[1]["init_args"] == {"directory": "/scratch/x", "stop_at_step": 1}
    assert out["trainer"]["logger"]["init_args"]["save_dir"] == "/scratch/x"
    assert out["trainer"]["max_steps"] == 2 and out["trainer"]["log_every_n_steps"] == 1
    assert config["trainer"]["logger"]["class_path"].endswith("WandbLogger")  # the user's config is untouched


def test_the_resume_pair_stops_between_two_checkpoints():
    """Checkpoints land every 2 steps; the resumed run stops at an odd step (K/2, or K/2 + 1), so a resumed run that
    counted its cadence from the stop would miss a checkpoint the cadence pair then finds missing (stopped on a
    checkpoint's step, it would not)."""
    from lit_rl.check.command import Check

    for steps, stop in ((2, 1), (4, 3), (6, 3), (8, 5), (10, 5)):
        check = Check({}, Path("unused"), steps, say=print)
        assert check.every_n == 2 and check.stop_at == stop and stop % check.every_n == 1, steps


def test_tolerance_follows_the_lowest_precision():
    assert tolerance_for(None, "float32") is FP32
    assert tolerance_for("bf16-mixed", "float32") is BF16
    assert tolerance_for("32-true", "bfloat16") is BF16
    # fp16 mixed precision runs as bf16-mixed on a CPU (Lightning's), where fp16's tolerance failed a correct config
    assert tolerance_for("16-mixed", "float32", on_cpu=True) is BF16
    assert tolerance_for("16-mixed", "float32").name == "fp16"


def test_rows_compare_every_shared_metric_and_report_the_worst():
    reference = [{"step": 1.0, "train/loss": 1.0, "train/kl": 0.5}, {"step": 2.0, "train/loss": 2.0, "train/kl": 0.5}]
    close = [
        {"step": 1.0, "train/loss": 1.0 + 5e-6, "train/kl": 0.5},
        {"step": 2.0, "train/loss": 2.0, "train/kl": 0.5},
    ]
    worst, problems, _ = compare_rows(close, reference, FP32)
    assert problems == [] and worst.passed and worst.where == "step 1 train/loss"
    far = [{"step": 1.0, "train/loss": 1.0, "train/kl": 0.5}, {"step": 2.0, "train/loss": 2.1, "train/kl": 0.5}]
    worst, _, _ = compare_rows(far, reference, FP32)
    assert not worst.passed and worst.where == "step 2 train/loss" and worst.abs_diff == pytest.approx(0.1)
    missing = [{"step": 1.0, "train/loss": 1.0}]
    _, problems, _ = compare_rows(missing, reference, FP32)
    assert problems == ["step 2 not logged", "step 1: train/kl logged by one run only"]
    timings = [{**row, "train/perf/step_s": 9.0} for row in reference]  # timings are not compared
    assert compare_rows(timings, reference, FP32)[1] == []


def test_every_row_of_a_step_is_compared_not_only_its_last():
    """A logger writes a row per `log_metrics` call, so a callback logging on its own adds a row at the step.
    Only the step's last row was compared: a metric of the other row, 2x apart, passed (an outside read planted
    one)."""
    reference = [{"step": 1.0, "train/loss": 1.0}, {"step": 1.0, "train/tokens_seen": 1000.0}]
    doubled = [{"step": 1.0, "train/loss": 1.0}, {"step": 1.0, "train/tokens_seen": 2000.0}]
    worst, problems, _ = compare_rows(doubled, reference, FP32)
    assert not worst.passed and worst.where == "step 1 train/tokens_seen"
    twice = [{"step": 1.0, "train/loss": 1.0}, {"step": 1.0, "train/loss": 1.5, "train/tokens_seen": 1000.0}]
    _, problems, _ = compare_rows(twice, reference, FP32)
    assert problems == ["step 1: train/loss logged twice, 1 and 1.5"]


def test_a_metric_nan_in_both_runs_is_named_not_passed_over_in_silence():
    reference = [{"step": 1.0, "train/loss": 1.0, "train/kl": math.nan}]
    worst, problems, nan_in_both = compare_rows([dict(row) for row in reference], reference, FP32)
    assert worst.passed and problems == [] and nan_in_both == ["train/kl"]


def test_weights_compare_by_their_distance_relative_to_the_update():
    initial = {"w": torch.zeros(4)}
    reference = {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}
    near = {"w": torch.tensor([1.0, 5e-4, 0.0, 0.0])}  # 5e-4 of an update of norm 1
    worst, problems = compare_parameters(near, reference, initial, FP32)
    assert problems == [] and worst.where == WEIGHTS and worst.value == pytest.approx(5e-4, rel=1e-6) and worst.passed
    worst, _ = compare_parameters({"w": torch.tensor([1.0, 2e-3, 0.0, 0.0])}, reference, initial, FP32)
    assert not worst.passed
    _, problems = compare_parameters(reference, reference, reference, FP32)
    assert problems == [NOT_MOVED]
    _, problems = compare_parameters(near, reference, reference, FP32)  # the reference did not move; this did
    assert problems == ["the weights moved in one run only"]


def test_a_pair_whose_training_moved_no_weight_is_inconclusive_not_failed():
    """A constant reward gives every advantage 0: the metrics agreed, and the pair said FAIL ("training did not
    move the weights") of a correct layout (an outside read found it)."""
    rows = [{"step": 1.0, "train/loss": 0.0, "train/reward_std": 0.0}]
    unmoved = {"w": torch.zeros(2)}
    result = judge("ranks", RunResult(rows, unmoved, unmoved), RunResult(rows, unmoved, unmoved), FP32)
    assert result.status == "SKIP" and result.detail == NOT_MOVED
    differing = RunResult([{**rows[0], "train/loss": 1.0}], unmoved, unmoved)  # a metric apart is still a FAIL
    assert judge("ranks", differing, RunResult(rows, unmoved, unmoved), FP32).status == "FAIL"
    # Without the evidence of equal rewards (an update skipped every step, an SFT run) no weight moving is a FAIL.
    learning = [{"step": 1.0, "train/loss": 0.0, "train/reward_std": 0.3}]
    assert (
        judge("ranks", RunResult(learning, unmoved, unmoved), RunResult(learning, unmoved, unmoved), FP32).status
        == "FAIL"
    )
    offline = [{"step": 1.0, "train/loss": 0.7}]
    assert (
        judge("ranks", RunResult(offline, unmoved, unmoved), RunResult(offline, unmoved, unmoved), FP32).status
        == "FAIL"
    )


def test_a_pair_fails_on_any_difference_over_tolerance_and_passes_otherwise():
    rows = [{"step": 1.0, "train/loss": 1.0}]
    initial, final = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    same = RunResult(rows, final, initial)
    assert judge("accumulation", same, same, FP32).status == "PASS"
    moved = RunResult([{"step": 1.0, "train/loss": 1.1}], final, initial)
    result = judge("accumulation", moved, same, FP32)
    assert result.status == "FAIL" and "train/loss" in result.largest()


def test_mismatch_varies_each_factor_the_config_allows_and_names_the_largest_move():
    from lit_rl.check.mismatch import FactorResult, factor_layouts, moved_most, steps_needed

    config = _config()
    config["model"]["init_args"]["rollout"] = {"engine": {"class_path": "lit_rl.rollout.VLLMColocate"}}
    config["model"]["init_args"]["policy"].update(dtype="bfloat16", lora=None)
    factors = {factor: (layout.changes if layout else why) for factor, layout, why in factor_layouts(config)}
    assert factors == {
        "engine": {"model.init_args.rollout.engine": None},
        "dtype": {"model.init_args.policy.dtype": "float32"},
        "packing": {"model.init_args.policy.padding_free": True},
        "lora": "the config trains no LoRA adapter",
    }
    baseline = {"train/rollout_kl": 1e-6}
    results = [
        FactorResult("engine", "", {"train/rollout_kl": 1e-9}),  # 3 decades away
        FactorResult("dtype", "", {"train/rollout_kl": 2e-6}),
        FactorResult("lora", "", {}, skipped="no LoRA"),
    ]
    assert moved_most(baseline, results) == "engine"
    # Rounding: 7e-14 as configured and 1e-14 in bf16 was named "dtype" (an outside read found it)
    noise = [FactorResult("dtype", "", {"train/rollout_kl": 1.04e-14}), FactorResult("engine", "", {})]
    assert moved_most({"train/rollout_kl": 6.95e-14}, noise) is None
    assert steps_needed(config) == 1
    config["model"]["init_args"]["policy"]["lora"] = {"r": 8}
    lora = {factor: layout for factor, layout, _ in factor_layouts(config)}["lora"]
    merged = {"class_path": "lit_rl.rollout.HFGenerate", "init_args": {"lora_weights": "merged"}}
    assert lora.changes == {"model.init_args.rollout.engine": merged}
    assert steps_needed(config) == 2  # at step 1 the adapter is zero: merged or not, the same weights
    without_rollouts = _config()
    without_rollouts["model"]["init_args"].pop("schedule")
    with pytest.raises(CannotRunHere, match="samples no rollouts"):
        factor_layouts(without_rollouts)


def test_a_config_that_does_not_parse_stops_the_check_in_one_line(tmp_path, capsys):
    from lit_rl.check.command import main

    with pytest.raises(SystemExit) as stop:
        main(["--config", str(tmp_path / "missing.yaml"), "--quick"])
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lit-rl check: error: ") and "missing.yaml" in lines[0], lines
    assert "lit-rl: error:" not in lines[0]


@pytest.mark.parametrize(
    "command, argv, expected",
    [
        ("check", ["configs/grpo.yaml"], "lit-rl check: error: give the config to check: lit-rl check --config"),
        ("check", ["--config", "my.yaml", "--steps", "3"], "lit-rl check: error: --steps must be even and at least 2"),
        ("export", [], "lit-rl export: error: the following arguments are required: checkpoint, out_dir"),
    ],
)
def test_a_bad_command_line_of_check_and_export_is_one_line(capsys, command, argv, expected):
    """argparse printed its usage text before the error: three lines."""
    from lit_rl.check.command import main as check
    from lit_rl.export import main as export

    with pytest.raises(SystemExit) as stop:
        (check if command == "check" else export)(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_the_users_checkpoint_callbacks_in_any_form_become_one_that_writes_under_the_run():
    """Any import path of ModelCheckpoint (or a subclass) is redirected; a second one is dropped (two alike would
    share Lightning's state key); a single callback given without a list is read as one."""
    config = _config()
    config["trainer"]["callbacks"] = [
        {"class_path": "lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint", "init_args": {"dirpath": "/u"}},
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": {"monitor": "val/loss"}},
    ]
    out = run_config(config, Layout("x"), "/scratch/x", steps=2, every_n=2, probe_dir="/scratch/x")
    paths = [c["class_path"] for c in out["trainer"]["callbacks"]]
    assert paths == ["lightning.pytorch.callbacks.model_checkpoint.ModelCheckpoint", "lit_rl.check.probe.CheckProbe"]
    assert out["trainer"]["callbacks"][0]["init_args"]["dirpath"] is None
    single = _config()
    single["trainer"]["callbacks"] = {"class_path": "lightning.pytorch.callbacks.LearningRateMonitor", "init_args": {}}
    out = run_config(single, Layout("x"), "/scratch/x", steps=2, every_n=2, probe_dir="/scratch/x")
    assert [c["class_path"] for c in out["trainer"]["callbacks"]] == [
        "lightning.pytorch.callbacks.LearningRateMonitor",
        "lightning.pytorch.callbacks.ModelCheckpoint",
        "lit_rl.check.probe.CheckProbe",
    ]
    dpo = _config()
    dpo["model"]["init_args"]["ref_cache_dir"] = "runs/cache"  # DPO's cache goes under the run too
    assert run_config(dpo, Layout("x"), "/scratch/x", 2, 2, "/scratch/x")["model"]["init_args"]["ref_cache_dir"] == (
        "/scratch/x/ref_cache"
    )


def test_processes_read_every_form_of_trainer_devices():
    from lit_rl.check.layouts import processes

    assert processes(_config(devices=[0, 1])) == 2
    assert processes(_config(devices="0,1")) == 2
    assert processes(_config(devices=3)) == 3
    assert processes(_config(devices="auto", accelerator="cpu")) == 1


def test_layout_metrics_of_token_budgets_are_not_compared():
    reference = [{"step": 1.0, "train/loss": 1.0, "train/micro_batch_tokens/max": 64.0, "train/rank_tokens/min": 9.0}]
    other = [{"step": 1.0, "train/loss": 1.0, "train/micro_batch_tokens/max": 128.0}]
    worst, problems, _ = compare_rows(other, reference, FP32)
    assert problems == [] and worst.passed


def test_dtype_auto_gets_the_tolerance_of_the_dtype_the_checkpoint_loads_in(tmp_path):
    from transformers import Qwen2ForCausalLM

    from lit_rl.check.command import policy_dtype
    from lit_rl.modeling.models import tiny_qwen2_config

    Qwen2ForCausalLM(tiny_qwen2_config()).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    config = _config()
    config["model"]["init_args"]["policy"].update(dtype="auto", model_name_or_path=str(tmp_path / "bf16"))
    assert policy_dtype(config) == "bfloat16" and tolerance_for("32-true", policy_dtype(config)) == BF16
    config["model"]["init_args"]["random_init"] = True  # built from the config alone: float32
    assert tolerance_for("32-true", policy_dtype(config)) == FP32
    config["model"]["init_args"].pop("random_init")
    config["model"]["init_args"]["policy"]["model_name_or_path"] = "lit-rl/tiny-qwen2-addition-sft"  # saved in fp32
    assert policy_dtype(config) == "float32"


def test_the_check_asks_the_blas_for_reproducible_results_before_it_computes(tmp_path, monkeypatch):
    """MKL otherwise picks code paths by memory alignment and thread counts by load: float rounding that moves
    between two runs of one layout, which Adam amplifies in weights whose exact gradient is 0."""
    from lit_rl.check.command import main
    from tests.conftest import environment_restored

    monkeypatch.delenv("MKL_CBWR", raising=False)
    monkeypatch.delenv("MKL_DYNAMIC", raising=False)
    with environment_restored():
        with pytest.raises(SystemExit):
            main(["--config", str(tmp_path / "missing.yaml"), "--quick"])
        assert os.environ["MKL_CBWR"] == "AUTO,STRICT" and os.environ["MKL_DYNAMIC"] == "FALSE"
    # Undone for the rest of this worker's tests (monkeypatch's delenv of an absent name records nothing to undo).
    assert "MKL_CBWR" not in os.environ and "MKL_DYNAMIC" not in os.environ


def test_a_ctrl_c_that_ended_a_run_stops_the_check_and_an_exit_1_alone_is_a_failed_run(monkeypatch, tmp_path):
    """Lightning ends `fit` with its own exit 1 after a KeyboardInterrupt (a second Ctrl-C, or one before lit-rl's
    graceful stop took SIGINT over): the runner must tell that from a run that failed."""
    import lit_rl.cli

    def ended_by_ctrl_c(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the KeyboardInterrupt arrives here
        except KeyboardInterrupt:
            sys.exit(1)  # as Lightning's `_call_and_handle_interrupt`

    monkeypatch.setattr(lit_rl.cli, "main", ended_by_ctrl_c)
    # Python's own handler, whatever the process holds: in a full run this process has been found with SIGINT
    # ignored (see conftest's `sigint_left_as_found`); the previous handler is put back after.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_cli(tmp_path, ["fit"])
        monkeypatch.setattr(lit_rl.cli, "main", lambda args: sys.exit(1))
        assert run_cli(tmp_path, ["fit"]) == 1
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_value_fit_refuses_stops_the_check_in_one_line_and_a_layouts_own_refusal_fails_its_pair(
    monkeypatch, tmp_path, capsys
):
    """`--print_config` instantiates nothing, so a value `lit-rl fit` refuses as it builds the model
    (`num_generations 0`) reached the pairs: each "failed (exit 1)", as if accumulation and packing were broken, and
    the scratch directory stayed. The config's own error is one line and exit 2 ("nothing checked"), the runs gone.
    A refusal of a layout's own change, where the config as configured runs, is still its pair's FAIL."""
    import tempfile

    import lit_rl.check.command as command

    refused = "model.sampling.num_generations must be >= 2 (GRPO compares rollouts within a group), got 0"
    refusing: dict[str, str] = {}  # layout -> the line `lit-rl fit` refuses it with ("*": every layout)
    ran: list[str] = []

    def fit(config, directory, processes=1):  # `lit-rl fit` of a layout, refusing its input as the CLI does
        ran.append(directory.name)
        directory.mkdir(parents=True, exist_ok=True)
        error = refusing.get(directory.name, refusing.get("*"))
        (directory / "output.log").write_text("Seed set to 0\n" + (f"lit-rl: error: {error}\n" if error else ""))
        if error and error.startswith("step 1's loss"):  # it failed while training: a logged step
            (directory / "run" / "version_0").mkdir(parents=True)
            (directory / "run" / "version_0" / "metrics.csv").write_text("step,train/loss\n1,0.5\n")
        return 1 if error else 0

    monkeypatch.setattr(command, "resolved_config", lambda fit_args: _config())
    monkeypatch.setattr(command, "fit", fit)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    refusing["*"] = refused
    with pytest.raises(SystemExit) as stop:
        command.main(["--config", "my.yaml", "--quick", "--pairs", "accumulation,packing"])
    assert stop.value.code == command.EXIT_NOTHING_CHECKED
    out, err = capsys.readouterr()
    assert out == ""  # no table
    assert err.strip().splitlines()[-1] == f"lit-rl check: error: {refused}", err
    assert "FAIL" not in err and "failed" not in err
    assert ran == ["two_micro_batches", "straight"]  # the config as configured is refused too: no packing run
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed

    # Only the padding-free layout is refused; the run as configured is not, so the pair fails with the layout's
    # line (and the runs are kept).
    refusing.clear()
    refusing["padding_free"] = "model.policy.padding_free needs an attention that packs"
    ran.clear()
    monkeypatch.setattr(command, "read_run", lambda directory, save_dir: RunResult([], {}, None))
    with pytest.raises(SystemExit) as stop:
        command.main(["--config", "my.yaml", "--quick", "--pairs", "packing"])
    assert stop.value.code == command.EXIT_FAIL
    out, err = capsys.readouterr()
    assert "padding_free failed (exit 1): lit-rl: error: model.policy.padding_free needs" in out
    assert err.strip().splitlines()[-1] == "lit-rl check: FAIL: packing", err
    assert ran == ["padding_free", "straight"]

    # A run that failed while training (a diverged loss, a full disk: `lit-rl: error:` too) is its pair's FAIL.
    refusing.clear()
    refusing["*"] = "step 1's loss is not finite (nan)"
    ran.clear()
    with pytest.raises(SystemExit) as stop:
        command.main(["--config", "my.yaml", "--quick", "--pairs", "accumulation"])
    assert stop.value.code == command.EXIT_FAIL
    out, err = capsys.readouterr()
    assert "two_micro_batches failed (exit 1): lit-rl: error: step 1's loss is not finite" in out
    assert ran == ["two_micro_batches"]
