"""ZeRO-3 as users run it: the shipped overlay with a user's threshold that splits the model into partitioned and
persistent parameters. Through the `lit-rl` script: a Ctrl-C during step 3 and the printed resume command give every
step of a DDP run's numbers, the export at the end equals DDP's, and the split model pushes its gathered weights
into vLLM. (tests/integration/test_deepspeed.py covers every parameter partitioned. The shipped overlay alone keeps
every parameter of the tiny model whole, a case the split model's persistent half already runs: its own run, 70 s
of CI, proved nothing more.)"""

from __future__ import annotations

import shlex
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import CONFIGS, REPO
from tests.integration.test_resume import GROUP_STOPPER, SMALL, _by_step, _env, _lit_rl, _rows

pytestmark = pytest.mark.slow

STRATEGY = CONFIGS / "strategy"
MIXED = REPO / "tests" / "integration" / "zero3_mixed_partition.yaml"
LAYOUTS = {
    "ddp": [STRATEGY / "ddp.yaml"],
    "zero3_mixed": [STRATEGY / "ddp.yaml", STRATEGY / "deepspeed_zero3.yaml", MIXED],
}


def _args(layout: str, *extra: str) -> list[str]:
    configs = [arg for path in LAYOUTS[layout] for arg in ("--config", str(path))]
    return [
        *["fit", "--config", str(CONFIGS / "grpo.yaml"), *configs, *SMALL],
        *[
            "--model.schedule.micro_batch_size",
            "4",
            "--trainer.accumulate_grad_batches",
            "2",
            "--model.loss.beta",
            "0.04",
        ],
        *["--model.rewards.funcs", "[stopper.correctness, lit_rl.rewards.arithmetic.integer_format]"],
        *["--trainer.max_steps", "4", *extra],
    ]


def _comparable(rows: dict) -> dict:
    """The rows without timings and the engine-vs-trainer gap (rounding noise that differs in every layout)."""
    return {
        key: {name: value for name, value in values.items() if not name.startswith("train/rollout_")}
        for key, values in rows.items()
    }


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("ddp")
    (cwd / "stopper.py").write_text(GROUP_STOPPER)
    result = _lit_rl(cwd, _env(cwd), *_args("ddp"))
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd / "runs" / "grpo" / "version_0"


def test_zero3_stopped_and_resumed_as_printed_matches_ddp_and_exports_the_same_model(tmp_path, ddp_run):
    layout = "zero3_mixed"
    (tmp_path / "stopper.py").write_text(GROUP_STOPPER)
    # Reward calls: steps 1 and 2, the validation at step 2 (val_check_interval 4 micro-batches, accumulation 2),
    # then step 3: Ctrl-C during step 3.
    stopped = _lit_rl(tmp_path, _env(tmp_path, SIGINT_AT_CALL="4"), *_args(layout), start_new_session=True)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("lit-rl: stopped by SIGINT")]
    assert "after step 3;" in line
    run = tmp_path / "runs" / "grpo" / "version_0"
    assert (run / "checkpoints" / "last.ckpt").is_dir()  # DeepSpeed's sharded checkpoint directory

    printed = line.split("resume with: ", 1)[1]
    assert shlex.split(printed)[-2:] == ["--ckpt_path", "last"]
    resumed = subprocess.run(
        printed, shell=True, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "lit-rl: resuming from" in resumed.stderr and "(step 3)" in resumed.stderr

    got, expected = _comparable(_by_step(_rows(run))), _comparable(_by_step(_rows(ddp_run)))
    assert (
        sorted(got) == sorted(expected) == sorted([(step, "train") for step in range(1, 5)] + [(2, "val"), (4, "val")])
    )
    for key, values in expected.items():
        assert sorted(got[key]) == sorted(values), key
        for name, value in values.items():
            assert got[key][name] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, name)

    exported, reference = load_file(run / "hf" / "model.safetensors"), load_file(ddp_run / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(reference)
    # atol 1e-5: the key projections' bias has a gradient of rounding noise only (softmax ignores a shift common
    # to every key), which Adam scales into steps; measured 2.3e-6 at most, every other tensor within 1e-6.
    for name, value in reference.items():
        torch.testing.assert_close(exported[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_zero3_with_partitioned_and_persistent_parameters_pushes_the_whole_policy_into_vllm(tmp_path):
    (tmp_path / "stopper.py").write_text(GROUP_STOPPER)
    colocate = ["--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml"), "--trainer.max_steps", "2"]
    result = _lit_rl(tmp_path, {**_env(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1"}, *_args("zero3_mixed", *colocate))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _by_step(_rows(tmp_path / "runs" / "grpo" / "version_0"))
    assert sorted(rows) == [(1, "train"), (2, "train"), (2, "val")]  # validation through the engine too
    for key, values in rows.items():
        if key[1] == "train":
            assert values["train/rollout_logprob_diff/max"] < 1e-4  # vLLM sampled from the whole, current policy
