"""`lit-rl check` as a user runs it: every shipped config passes it in quick mode (or says why it cannot run on
this machine), and the bugs users met elsewhere, planted through an objective, an estimator or a callback given by
import path, fail it, naming the pair that shows them; a Ctrl-C stops it without a false verdict."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import CONFIGS, REPO, bash_block, needs_native_bf16, python_path

pytestmark = pytest.mark.slow

RUNS_HERE = ["grpo", "grpo_tools", "ppo", "rloo", "online_dpo", "dpo", "sft", "sft_tools"]
NEEDS_GPUS = ["grpo_8gpu", "dpo_8gpu"]
PAIRS = ("accumulation", "packing", "ranks", "validation", "resume", "cadence")


def _env(**env_vars: str) -> dict[str, str]:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])  # this Python's lit-rl
    return {**os.environ, "PATH": path, "PYTHONPATH": python_path(), **env_vars}


def _scratch(tmp_path):
    """A directory for the check's `TMPDIR`: the system's temporary directory, as the check sees it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return scratch


def _check(tmp_path, config: str, *args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = _env(**env_vars)
    command = ["lit-rl", "check", "--config", str(CONFIGS / f"{config}.yaml"), "--quick", *args]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


def _results(stdout: str) -> dict[str, str]:
    """pair -> PASS / FAIL / SKIP, from the table's rows."""
    out = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip()[1:-1].split("│")]
        if len(cells) == 5 and cells[0] in PAIRS:
            out[cells[0]] = cells[4]
    return out


def _largest_differences(stdout: str) -> str:
    """The table's "largest difference" column, its wrapped lines joined (rich wraps a long cell over rows)."""
    parts = []
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip()[1:-1].split("│")]
        if len(cells) == 5 and cells[0] != "pair":
            parts.append(cells[2])
    return " ".join(part for part in parts if part)


@pytest.mark.parametrize("config", RUNS_HERE)
def test_a_shipped_config_passes_every_pair(tmp_path, config):
    result = _check(tmp_path, config)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert _results(result.stdout) == {pair: "PASS" for pair in PAIRS}, result.stdout
    assert f"lit-rl check: PASS: {', '.join(PAIRS)}" in result.stderr
    # The metric that differs most, shown with how it is reduced ("[mean per token, ...]" or, where the critic's
    # explained variance moves most, as on an AVX2 AMD EPYC, "[explained variance, ...]").
    differences = _largest_differences(result.stdout)
    assert re.search(r"(train|val)/[\w/]+ \[[a-z][^\]]*, over ranks and", differences), result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written beside the user's files (runs go to a temporary dir)


@pytest.mark.parametrize("config", NEEDS_GPUS)
def test_a_config_for_gpus_this_machine_lacks_is_skipped_saying_why(tmp_path, config):
    result = _check(tmp_path, config)
    assert result.returncode == 2, result.stderr[-3000:]
    assert _results(result.stdout) == {pair: "SKIP" for pair in PAIRS}, result.stdout
    assert "cannot run here: the config trains on 8 GPU(s)" in result.stdout
    assert "no pair could be checked here" in result.stderr


# The run the Ctrl-C interrupts, by pair: the accumulation pair's second run (in the check's process), and the ranks
# pair's two-process run (a `lit-rl fit` process of its own, which starts the second rank).
CTRL_C_DURING = {"accumulation": "two_micro_batches", "ranks": "two_processes"}


@pytest.mark.parametrize("pair", sorted(CTRL_C_DURING))
def test_ctrl_c_stops_the_check_with_no_pair_failed_and_nothing_left_running(tmp_path, pair):
    """A Ctrl-C while a run trains stops the check (exit 130), not just that run: the pair it interrupted is neither
    PASS nor FAIL, the pairs after it do not start, no rank keeps running and the temporary runs are removed."""
    scratch = _scratch(tmp_path)
    env = _env(TMPDIR=str(scratch))
    # 20 steps a run: the run is still training when the Ctrl-C comes (about 0.1 s a step on 2 cores).
    command = ["lit-rl", "check", "--config", str(CONFIGS / "grpo.yaml"), "--steps", "20", "--pairs", f"{pair},cadence"]
    check = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the Ctrl-C a terminal sends to every process of the job
        preexec_fn=_sigint_as_in_a_terminal,
    )
    try:
        deadline = time.monotonic() + 300
        running = f"lit-rl-check-*/{CTRL_C_DURING[pair]}/initial_parameters.pt"  # written as training starts
        while not list(scratch.glob(running)) and check.poll() is None:
            assert time.monotonic() < deadline, f"no {running} in 300 s"
            time.sleep(0.05)
        os.killpg(check.pid, signal.SIGINT)
        stdout, stderr = check.communicate(timeout=300)
    finally:
        if check.poll() is None:
            os.killpg(check.pid, signal.SIGKILL)
    assert check.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"lit-rl check: stopped by Ctrl-C; not checked: {pair}, cadence", stderr
    assert "FAIL" not in stdout + stderr and "Traceback" not in stderr
    assert "lit-rl check: cadence" not in stderr  # the next pair never started
    deadline = time.monotonic() + 30
    while _group_alive(check.pid):  # the run's ranks end with the check (they may take a moment to exit)
        if time.monotonic() > deadline:
            os.killpg(check.pid, signal.SIGKILL)  # none left behind for the tests after this one
            pytest.fail("processes of the check still running 30 s after it ended")
        time.sleep(0.1)
    assert list(scratch.glob("lit-rl-check-*")) == []  # no pair failed: the runs are removed


def _sigint_as_in_a_terminal() -> None:
    """SIGINT at its default action in the check's process, as a shell starts a foreground job. A process starts
    with the SIGINT disposition of the one that started it, and Python installs its KeyboardInterrupt handler only
    over the default. A test worker has been found ignoring SIGINT (`tests/conftest.py::sigint_left_as_found`;
    Lightning sets SIG_IGN when an in-process `fit` ends in a KeyboardInterrupt); a check started from it ignores
    SIGINT until `GracefulStop` takes it over as training starts, and a Ctrl-C sent in between (the initial
    parameters, which the test waits for, are written first) is lost. The likely cause of a CI failure
    (2026-11-28): the check's run trained all 20 steps after the Ctrl-C, at 9.9 s a step on a loaded machine, and
    the test timed out."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


PLANTED = {
    "loss normalised per micro-batch": (
        ["--model.loss.objective", "tests.integration.planted_bugs.loss_over_the_micro_batch_tokens"],
        "accumulation",
    ),
    "advantages normalised per rank": (
        ["--model.loss.advantage", "tests.integration.planted_bugs.advantages_normalised_per_rank"],
        "ranks",
    ),
    "metric averaged as a mean of rank means": (
        ["--trainer.callbacks+=tests.integration.planted_bugs.EntropyAsMeanOfRankMeans"],
        "ranks",
    ),
    "validation rewards counted as training": (
        ["--trainer.callbacks+=tests.integration.planted_bugs.ValidationRewardsCountedAsTraining"],
        "validation",
    ),
    "state kept outside the checkpoint": (
        ["--trainer.callbacks+=tests.integration.planted_bugs.StepCountOutsideTheCheckpoint"],
        "resume",
    ),
    "checkpoint cadence counted from the resume": (  # the run's one checkpoint callback: the check keeps the first
        ["--trainer.callbacks", '[{"class_path": "tests.integration.planted_bugs.CadenceCountedFromTheStart"}]'],
        "cadence",
    ),
}


# The planted bug docs/check.md shows: its command is run as the page prints it, from the checkout.
DOCUMENTED = "loss normalised per micro-batch"


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_bug_fails_the_pair_that_shows_it(tmp_path, bug):
    args, pair = PLANTED[bug]
    scratch = _scratch(tmp_path)
    if bug == DOCUMENTED:  # without the suite's PYTHONPATH: the page's own command must find `tests`
        env = {key: value for key, value in _env(TMPDIR=str(scratch)).items() if key != "PYTHONPATH"}
        command = bash_block("check.md", "planted_bugs")
        assert all(arg in command for arg in (*args, "--pairs", pair))
        result = subprocess.run(["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    else:
        result = _check(tmp_path, "grpo", *args, "--pairs", pair, TMPDIR=str(scratch))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert _results(result.stdout) == {pair: "FAIL"}, result.stdout
    assert f"lit-rl check: FAIL: {pair}" in result.stderr
    # A failed pair keeps its runs, where the check says they are.
    (kept,) = scratch.glob("lit-rl-check-*")
    assert f"lit-rl check: the runs are in {kept}" in result.stderr
    assert (kept / "straight" / "output.log").is_file()
    if bug.startswith("metric"):
        assert "train/entropy_of_ranks" in result.stdout  # the table names the metric that differs
    if bug.startswith("validation"):
        assert "train/reward" in result.stdout  # the train metric the validation wrote into
    if bug.startswith("state"):
        assert "train/steps_this_process" in result.stdout
    if bug.startswith("checkpoint"):  # the checkpoints themselves differ, not a run that failed
        assert "straight [2], resumed []" in result.stdout


@pytest.mark.parametrize("planted", [False, True], ids=["correct", "normalised-per-micro-batch"])
def test_in_bf16_a_correct_config_passes_and_a_normalisation_bug_fails(tmp_path, planted):
    """bf16's weights tolerance (0.05) failed the shipped GRPO config with bf16 weights (0.053 at 4 steps); at 0.08
    the correct layouts pass and a loss normalised per micro-batch still fails (0.18 at 2 steps)."""
    objective = ["--model.loss.objective", "tests.integration.planted_bugs.loss_over_the_micro_batch_tokens"]
    pairs = "accumulation" if planted else "accumulation,packing"
    args = ["--model.policy.dtype", "bfloat16", *(objective if planted else []), "--pairs", pairs]
    result = _check(tmp_path, "grpo", *args, TMPDIR=str(_scratch(tmp_path)))
    expected = {"accumulation": "FAIL"} if planted else {"accumulation": "PASS", "packing": "PASS"}
    assert _results(result.stdout) == expected, result.stdout + result.stderr[-2000:]
    assert "bf16" in result.stdout


def _mismatch_rows(stdout: str) -> dict[str, list[str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip()[1:-1].split("│")]
        if len(cells) == 5 and cells[0] in ("as configured", "engine", "dtype", "packing", "lora"):
            rows[cells[0]] = cells
    assert sorted(rows) == ["as configured", "dtype", "engine", "lora", "packing"], stdout
    return rows


def test_mismatch_reports_each_factor_and_names_the_one_that_moves_the_kl_most(tmp_path):
    scratch = _scratch(tmp_path)
    result = _check(tmp_path, "grpo", "--mismatch", TMPDIR=str(scratch))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert list(scratch.glob("lit-rl-check-*")) == []  # its runs removed at the end
    rows = _mismatch_rows(result.stdout)
    for factor in ("as configured", "dtype", "packing"):  # measured: a KL and a ratio range
        kl, ratios = float(rows[factor][2]), rows[factor][3].split(" / ")
        assert 0 <= kl < 1e-3 and float(ratios[0]) <= 1.0 <= float(ratios[1]) + 1e-6, rows[factor]
    assert rows["dtype"][1] == "dtype=bfloat16" and rows["packing"][1] == "padding_free=True"
    assert rows["engine"][1] == "the config samples with HF generate already"  # said, not measured
    # The verdict names the factor whose KL is furthest from the configured run's, in log scale, read off the table,
    # or none where every KL is rounding. With HF generate the engine and the trainer run the same kernels: on a
    # Xeon every row was rounding (5.8e-14 as configured, 3.5e-14 in bf16), and the verdict named "dtype" for it
    # (a tie at the old 1e-12 floor, won by the first row) until it had a rounding floor.
    from lit_rl.check.mismatch import KL_ROUNDING

    kls = {f: float(rows[f][2]) for f in ("as configured", "dtype", "packing")}
    if max(kls.values()) <= KL_ROUNDING:
        assert "No factor moves rollout_kl beyond rounding (at or below 1e-09)." in result.stdout, kls
        assert "The factor that moves rollout_kl most" not in result.stdout
        return
    (named,) = re.findall(r"The factor that moves rollout_kl most: (.+)\.", result.stdout)
    base = math.log10(max(kls["as configured"], KL_ROUNDING))
    measured = {f: abs(math.log10(max(kls[f], KL_ROUNDING)) - base) for f in ("dtype", "packing")}
    assert named == max(measured, key=measured.get), (named, measured)


@needs_native_bf16
def test_mismatch_with_lora_in_bf16_names_merging_the_adapter(tmp_path):
    """In bf16, merging a trained adapter into the weights rounds it (as vLLM's weights are): measured KL ~1e-4
    against ~5e-14 as configured (HF generate through the adapter, as the trainer computes). The runs take 2
    steps, so the adapter has trained once."""
    lora = str(CONFIGS / "peft" / "lora.yaml")
    result = _check(
        tmp_path, "grpo", "--config", lora, "--model.policy.dtype", "bfloat16", "--model.optim.learning_rate",
        "0.0005", "--mismatch",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 2, engine against trainer" in result.stdout
    rows = _mismatch_rows(result.stdout)
    assert rows["lora"][1] == "HF generate, adapter merged"
    kl = {factor: float(rows[factor][2]) for factor in ("as configured", "lora")}
    assert kl["lora"] > 1e3 * kl["as configured"], rows
    assert "The factor that moves rollout_kl most: lora." in result.stdout


def test_mismatch_of_an_algorithm_without_rollouts_says_so(tmp_path):
    scratch = _scratch(tmp_path)
    result = _check(tmp_path, "sft", "--mismatch", TMPDIR=str(scratch))
    assert result.returncode == 2
    assert "lit-rl check: error: the algorithm samples no rollouts" in result.stderr
    assert "  run " not in result.stderr  # said before training anything
    assert list(scratch.glob("lit-rl-check-*")) == []  # and no run left behind


def test_mismatch_on_the_colocated_vllm_engine_shows_bf16_as_the_largest_factor(tmp_path):
    """The CPU vLLM engine against the fp32 trainer agrees to rounding (KL ~1e-13); in bf16 the engine's kernels
    and the trainer's round differently (KL ~5e-5, ratios 0.95-1.03 measured): the factor named."""
    pytest.importorskip("vllm")
    overlay = str(CONFIGS / "rollout" / "vllm_colocate.yaml")
    result = _check(tmp_path, "grpo", "--config", overlay, "--mismatch", VLLM_CPU_KVCACHE_SPACE="1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _mismatch_rows(result.stdout)
    assert rows["engine"][1] == "HF generate instead of VLLMColocate"
    kl = {factor: float(rows[factor][2]) for factor in ("as configured", "engine", "dtype", "packing")}
    assert kl["as configured"] < 1e-8 and kl["engine"] < 1e-8
    assert kl["dtype"] > 1e3 * kl["as configured"]
    assert "The factor that moves rollout_kl most: dtype." in result.stdout
