"""vLLM rollouts with the real CPU build: weight pushes that make vLLM sample from the trainer's policy, GRPO with
the colocated and the server engine (one process and two DDP processes), and what a dead server does.

Everything that starts vLLM runs in a child process: vLLM binds threads and sets process-wide state.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lit_rl.rollout.engines.vllm_server import RolloutServerError
from lit_rl.rollout.server.client import LocalVLLMServer, free_port
from tests.conftest import (
    CLI_COMMAND,
    CONFIGS,
    FAST_GRPO,
    REPO,
    assert_rows_match,
    cli_env,
    fit_in_subprocess,
    listening_addresses,
    python_path,
    read_metrics,
    saved_steps,
    train_rows,
    without_engine_gap,
    write_overlay,
)
from tests.integration.probes import probe_flags

pytestmark = pytest.mark.slow

CHECK_SCRIPT = Path(__file__).with_name("vllm_logprob_check.py")
TOLERANCE = 1e-4  # fp32; measured differences are ~1e-5


def _vllm_env() -> dict[str, str]:
    return {**cli_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """The documented server command, on 127.0.0.1 and a free port, serving the shipped SFT policy; it can also
    receive weights broadcast over gloo (`model.rollout.engine.transfer.method: gloo`), which the file reloads
    ignore."""
    log = tmp_path_factory.mktemp("vllm_server") / "server.log"
    model = str(REPO / "lit_rl" / "assets" / "tiny-qwen2-addition-sft")
    try:
        server = LocalVLLMServer(model, str(log), extra_args=["--max-model-len", "128"], weight_transfer="gloo")
    except RolloutServerError as err:
        pytest.fail(f"{err}:\n{log.read_text()[-3000:]}")
    yield server.url
    server.stop()


def _logprob_check(*args: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, str(CHECK_SCRIPT), *args], env=_vllm_env(), capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _check_push(diffs: dict[str, float]) -> None:
    assert diffs["tokens"] > 0
    assert diffs["synced"] < TOLERANCE
    assert diffs["before_push"] > 0.1  # the engine still samples from the old weights
    assert diffs["after_push"] < TOLERANCE


def test_transformers_models_import_next_to_vllm():
    # The CPU build of vLLM pulls torchvision/torchaudio builds for another torch; the install removes them.
    code = "import vllm, transformers; from transformers import Qwen2ForCausalLM; print(Qwen2ForCausalLM.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("Qwen2ForCausalLM")


def test_colocated_engine_samples_from_the_pushed_weights_of_a_full_and_a_lora_policy():
    """Sampling agrees, and a push loads every weight: each of the engine's parameters (a linear layer's read back
    through vLLM's own CPU kernel) equals the policy's, bit for bit, and no tensor of the policy is left out; for the
    full policy, then, on the same engine, one carrying a LoRA adapter (the engine receives the merged weights).
    vLLM's `RotaryEmbedding: Failed to load weights` at each push is about its cos/sin cache, which is computed from
    the config and in no checkpoint: it keeps its values, as it should."""
    results = _logprob_check("colocate", "--full-and-lora")
    assert set(results) == {"full", "lora"}
    for diffs in results.values():
        _check_push(diffs)
        assert diffs["parameters_compared"] >= 30  # the tiny model: embedding, final norm, 7 per decoder layer
        assert diffs["parameter_gap"] == 0.0
        assert diffs["policy_tensors_not_in_engine"] == 0


# The weights broadcast over gloo (`transfer.method: gloo`) are checked by GRPO on two servers below: its log-prob
# gap stays under 1e-4 every step at lr 1e-3, which a push that did not land would break after the first.
def test_server_engine_samples_from_the_pushed_weights_of_a_full_and_a_lora_policy(vllm_server):
    results = _logprob_check("server", vllm_server, "--full-and-lora")
    assert set(results) == {"full", "lora"}
    for diffs in results.values():
        _check_push(diffs)


def _fit(tmp_path: Path, name: str, *args: str, algorithm: str = "grpo", max_steps: int = 4) -> Path:
    return fit_in_subprocess(
        tmp_path,
        name,
        f"{algorithm}.yaml",
        *FAST_GRPO,
        "--trainer.max_steps",
        str(max_steps),
        "--model.optim.learning_rate",
        "1e-3",  # large steps: an engine left with old weights would show in the log-prob difference
        *args,
        env=_vllm_env(),
    )


COLOCATE = ("--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml"))
SERVER = ("--config", str(CONFIGS / "rollout" / "vllm_server.yaml"))


def _check_run(log_dir: Path) -> None:
    assert saved_steps(log_dir) == [2, 4]
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["train/rollout_logprob_diff/max"] < TOLERANCE, (str(log_dir), row)  # which run, if it fails
        assert 0.0 <= row["train/reward"] <= 1.1


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory) -> Path:
    """4 GRPO steps with the colocated engine, checked by `_check_run`; shared by the tests that read it."""
    log_dir = _fit(tmp_path_factory.mktemp("colocated"), "full", *COLOCATE)
    _check_run(log_dir)  # the engine samples from the trainer's weights (a gap here says so, before any comparison)
    return log_dir


def test_grpo_trains_with_the_colocated_engine(colocated_run):
    log_dir = colocated_run
    pushes = [int(float(row["step"])) for row in _rows_with(log_dir, "perf/weight_push_s")]
    assert pushes == [1, 2, 3, 4]  # before every generation: the first, then after each optimizer step
    generations = [int(float(row["step"])) for row in _rows_with(log_dir, "perf/generation_s")]
    assert generations == [1, 2, 3, 4]


def test_grpo_with_lora_pushes_merged_weights_into_the_colocated_engine(tmp_path):
    lora = ("--config", str(CONFIGS / "peft" / "lora.yaml"), "--trainer.val_check_interval", "2")
    log_dir = _fit(tmp_path, "colocate_lora", *COLOCATE, *lora)
    _check_run(log_dir)  # includes the engine-vs-trainer log-prob gap < 1e-4 on every step
    # Validation through the engine with the adapter's merged weights, where asked.
    assert [int(float(row["step"])) for row in read_metrics(log_dir) if row.get("val/reward")] == [2, 4]


def test_no_push_when_the_policy_did_not_change(tmp_path):
    # Two optimizer steps per generation: generations before steps 1 and 3 only, so 2 pushes in 4 steps.
    log_dir = _fit(tmp_path, "two_steps", *COLOCATE, "--model.schedule.steps_per_generation", "2")
    _check_run(log_dir)
    pushes = [int(float(row["step"])) for row in _rows_with(log_dir, "perf/weight_push_s")]
    assert pushes == [1, 3]
    # Timings are logged on every step, 0 where the phase did not run (never a stale repeat of the last value).
    generations = [int(float(row["step"])) for row in _rows_with(log_dir, "perf/generation_s")]
    assert generations == [1, 3]


def _rows_with(log_dir: Path, key: str) -> list[dict[str, str]]:
    return [row for row in read_metrics(log_dir) if float(row.get(key) or 0) > 0]


def _placements(directory: Path) -> list[dict]:
    return [json.loads((directory / f"engine_rank{rank}.json").read_text()) for rank in (0, 1)]


def test_two_ddp_processes_place_an_engine_per_rank_or_one_tensor_parallel_engine_alike(tmp_path):
    """Through vLLM's external launcher, inside the trainer's process group: with tensor_parallel_size 1 each
    rank has its own engine; with 2 the two ranks serve one engine and split its completions. Each completion
    has its own seed, so both layouts sample and log the same numbers."""
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    runs = {}
    for tp in (1, 2):
        probe = ("--trainer.callbacks+", "tests.integration.probes.RecordEnginePlacement")
        probe += ("--trainer.callbacks.directory", str(tmp_path / f"engines_tp{tp}"))
        runs[tp] = _fit(
            tmp_path, f"tp{tp}", *COLOCATE, *ddp, *probe, "--model.rollout.engine.tensor_parallel_size", str(tp)
        )
        _check_run(runs[tp])
    per_rank, shared = _placements(tmp_path / "engines_tp1"), _placements(tmp_path / "engines_tp2")
    assert {p["executor"] for p in per_rank + shared} == {"ExecutorWithExternalLauncher"}
    assert [p["world_ranks"] for p in per_rank + shared] == [[0, 1]] * 4  # the trainer's world, not one of its own
    assert [p["tp_ranks"] for p in per_rank] == [[0], [1]]
    assert [p["tp_ranks"] for p in shared] == [[0, 1], [0, 1]]
    assert {p["device"] for p in per_rank + shared} == {"cpu"}  # on GPU: cuda:LOCAL_RANK (tests/gpu)
    tp1, tp2 = train_rows(runs[1]), train_rows(runs[2])
    assert [row.keys() for row in tp1] == [row.keys() for row in tp2]
    for row, expected in zip(tp2, tp1, strict=True):
        for key, value in expected.items():
            # Completions and rewards are identical; TP splits the matmuls, so log-prob values move in the
            # last digits.
            tolerance = 1e-5 if key.startswith("train/rollout_") else 0  # the engine-trainer gap
            assert row[key] == pytest.approx(value, rel=1e-5, abs=tolerance), (row["step"], key)


@pytest.mark.parametrize("algorithm, group", [("rloo", "4"), ("online_dpo", "2")])
def test_rloo_and_online_dpo_take_the_same_overlay(tmp_path, algorithm, group):
    log_dir = _fit(tmp_path, algorithm, *COLOCATE, "--model.sampling.num_generations", group, algorithm=algorithm)
    _check_run(log_dir)


def test_colocated_run_resumes_to_the_same_numbers(tmp_path, colocated_run):
    # Each completion's seed is a function of the run's seed, the generation number (which the checkpoint
    # restores) and its place in the global batch (`RolloutProducer.completion_seeds`), and the resumed engine
    # gets the checkpoint's weights before its first generation: the resumed steps sample and train the same.
    # It resumes the shared 4-step run's step-2 checkpoint, into a directory of its own.
    full = colocated_run
    resumed = _fit(tmp_path, "resumed", *COLOCATE, "--ckpt_path", str(full / "checkpoints" / "step=2.ckpt"))
    assert saved_steps(resumed) == [4]
    rows = train_rows(resumed)
    assert [row["step"] for row in rows] == [3, 4]
    assert_rows_match(rows, train_rows(full), rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def server_run(tmp_path_factory, vllm_server) -> Path:
    """4 GRPO steps on the shared server, checked by `_check_run`; what the other server runs are compared with."""
    args = (*SERVER, "--model.rollout.engine.server_url", vllm_server)
    log_dir = _fit(tmp_path_factory.mktemp("server"), "server", *args)
    _check_run(log_dir)
    return log_dir


def test_grpo_on_one_server_and_on_two_alike_by_file_and_by_broadcast_even_when_one_dies(
    tmp_path, vllm_server, server_run
):
    """`model.rollout.engine.server_urls`: the requests are dealt out across two real servers; a request's completions
    do not depend on which server samples them, so the run logs what the run on one server logs. The second server is
    stopped after step 2's checkpoint: with `on_server_failure: continue` its requests go to the first with one
    warning, and the numbers still match. Before that, the same two servers get their weights broadcast over gloo
    (`weight_transfer: gloo`, a group per server) at every step, with no weight file written anywhere, and log the
    same numbers too (vLLM samples from the trainer's policy: log-prob gap < 1e-4 at a learning rate that would show
    stale weights)."""
    alone = server_run
    model = str(REPO / "lit_rl" / "assets" / "tiny-qwen2-addition-sft")
    args = {"extra_args": ["--max-model-len", "128"], "weight_transfer": "gloo"}
    second = LocalVLLMServer(model, str(tmp_path / "second.log"), **args)
    servers = json.dumps([vllm_server, second.url])
    both = ("--model.rollout.engine.server_urls", servers, "--model.rollout.engine.transfer.method", "gloo")
    sync_dir = tmp_path / "never_written"
    broadcast = _fit(tmp_path, "two_gloo", *SERVER, *both, "--model.rollout.engine.transfer.sync_dir", str(sync_dir))
    _check_run(broadcast)
    assert [int(float(row["step"])) for row in _rows_with(broadcast, "perf/weight_push_s")] == [1, 2, 3, 4]
    assert not sync_dir.exists()
    assert_rows_match(
        without_engine_gap(train_rows(broadcast)), without_engine_gap(train_rows(alone)), rel=1e-4, abs=1e-5
    )
    overlay = write_overlay(tmp_path / "two.yaml", every_n_train_steps=2, save_dir=tmp_path / "two")
    command = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *SERVER]
    command += [*FAST_GRPO, "--model.optim.learning_rate", "1e-3", "--trainer.max_steps", "8"]
    command += ["--model.rollout.engine.server_urls", servers, "--model.rollout.engine.on_server_failure", "continue"]
    command += ["--model.rollout.engine.max_retries", "1", "--model.rollout.engine.request_timeout_s", "60"]
    log_dir = tmp_path / "two" / "run" / "version_0"
    process = subprocess.Popen(
        command, cwd=tmp_path, env=_vllm_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not (log_dir / "checkpoints" / "step=2.ckpt").exists() and process.poll() is None:
            assert time.monotonic() < deadline, "no step-2 checkpoint in 300 s"
            time.sleep(0.1)
    finally:
        second.stop()
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    warnings = [line for line in stderr.splitlines() if "taken out of service" in line]
    assert len(warnings) == 1 and second.url in warnings[0], stderr[-3000:]
    assert saved_steps(log_dir) == [2, 4, 6, 8]
    rows = train_rows(log_dir)
    assert all(row["train/rollout_logprob_diff/max"] < TOLERANCE for row in rows)
    assert_rows_match(without_engine_gap(rows[:4]), without_engine_gap(train_rows(alone)), rel=1e-4, abs=1e-5)


LAUNCH = ("--model.rollout.engine.launch", "true", "--model.rollout.engine.launch_args", '["--max-model-len", "128"]')


def _launched_fit(tmp_path: Path, name: str, ctrl_c_when_ready: bool = False):
    """`lit-rl fit` on the server engine with `launch: true`: (its return code, its stderr, the processes it had
    started once the server was ready, and the addresses the kernel then lists listening on its port). With
    `ctrl_c_when_ready`, SIGINT reaches it then, as Ctrl-C would."""
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=2, save_dir=tmp_path / name)
    command = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *SERVER]
    command += [*FAST_GRPO, "--trainer.max_steps", "4", "--model.optim.learning_rate", "1e-3", *LAUNCH]
    with open(tmp_path / f"{name}.stdout", "w") as stdout:  # the end-of-run summary, read by the test
        process = subprocess.Popen(
            command, cwd=tmp_path, env=_vllm_env(), stdout=stdout, stderr=subprocess.PIPE, text=True
        )
    lines, started, addresses = [], [], []
    for line in process.stderr:
        lines.append(line)
        if "vLLM server ready" in line:
            started = psutil.Process(process.pid).children(recursive=True)  # the server and its engine
            port = int(re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)[1])
            addresses = listening_addresses(port)  # the socket itself, not lit-rl's URL string
            if ctrl_c_when_ready:
                process.send_signal(signal.SIGINT)
            break
    lines.append(process.stderr.read())
    process.wait(timeout=600)
    return process.returncode, "".join(lines), started, addresses


def test_one_command_launches_the_server_and_leaves_no_process_behind_at_the_end_or_on_ctrl_c(tmp_path, server_run):
    """`--model.rollout.engine.launch true`: the trainer starts the documented server itself on loopback, and the run
    logs what the same run on a separately started server logs. When the run ends, and when Ctrl-C stops it, every
    process it started is gone."""
    returncode, stderr, started, addresses = _launched_fit(tmp_path, "launched")
    assert returncode == 0, stderr[-3000:]
    assert addresses == ["127.0.0.1"]  # loopback alone
    (line,) = [line for line in stderr.splitlines() if line.startswith("lit-rl: starting a vLLM server")]
    log_dir = tmp_path / "launched" / "run" / "version_0"
    assert str(log_dir / "vllm_server.log") in line
    server_log = (log_dir / "vllm_server.log").read_text()
    assert "Application startup complete" in server_log
    # 4 weight pushes (a `collective_rpc` each, a retried request one more); vLLM's notice at each (`RotaryEmbedding:
    # Failed to load weights`, harmless: docs/rollouts.md) is kept out of the log of a server lit-rl started
    # (`lit_rl.console`).
    assert server_log.count('"POST /collective_rpc') >= 4 and "Failed to load weights" not in server_log
    # The server's start (in the first step) is left out of the run's speed, and said.
    (speed,) = [line for line in (tmp_path / "launched.stdout").read_text().splitlines() if line.startswith("  speed ")]
    assert re.search(r"; the engine's start \([\d.]+ s\) left out$", speed), speed
    assert started and not psutil.wait_procs(started, timeout=10)[1]
    _check_run(log_dir)
    assert_rows_match(
        without_engine_gap(train_rows(log_dir)), without_engine_gap(train_rows(server_run)), rel=1e-4, abs=1e-5
    )

    returncode, stderr, started, _ = _launched_fit(tmp_path, "stopped", ctrl_c_when_ready=True)
    assert returncode == 130 and "lit-rl: stopped by" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert started and not psutil.wait_procs(started, timeout=10)[1]


def test_grpo_on_two_ddp_processes_shares_one_server(tmp_path, vllm_server):
    # Rank 0 alone talks to the server; both ranks get their own completions back.
    server_args = (
        "--config",
        str(CONFIGS / "rollout" / "vllm_server.yaml"),
        "--model.rollout.engine.server_url",
        vllm_server,
    )
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    log_dir = _fit(tmp_path, "server_ddp", *server_args, *ddp)
    _check_run(log_dir)


def test_dead_server_stops_the_run_with_one_line_naming_the_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    overlay = write_overlay(tmp_path / "dead.yaml", save_dir=tmp_path / "dead")
    command = [
        *CLI_COMMAND,
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(overlay),
        "--config",
        str(CONFIGS / "rollout" / "vllm_server.yaml"),
        *FAST_GRPO,
        "--model.rollout.engine.server_url",
        url,
        "--model.rollout.engine.wait_for_server_s",
        "2",
    ]
    started = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert url in last and "is the server running" in last, last
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 120
    assert os.path.isdir(tmp_path / "dead")  # the run directory the trainer wrote before failing is kept


def test_asynchronous_rollouts_with_the_server_engine_one_and_two_processes_and_over_gloo_alike(tmp_path, vllm_server):
    # Generation g is sampled by the weights of step g - 1 on rank 0's worker thread while step g - 1 trains.
    args = (*SERVER, "--model.rollout.engine.server_url", vllm_server, "--model.rollout.max_staleness", "1")
    single = _fit(tmp_path, "async", *args)
    assert saved_steps(single) == [2, 4]
    rows = train_rows(single)
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    for row in rows:
        assert 0.0 <= row["train/reward"] <= 1.1
    # Stale samples: the trainer's log-probs (one step newer, lr 1e-3) differ from the engine's by far more than
    # rounding after the first step, and the truncated correction is on.
    assert rows[0]["train/rollout_logprob_diff/max"] < TOLERANCE
    assert all(row["train/rollout_logprob_diff/max"] > 10 * TOLERANCE for row in rows[1:])
    assert all(0.0 <= row["train/rollout_is_frac_corrected"] <= 1.0 for row in rows)
    # Resumed from step 2 against the real server, validating through it at step 4: the generation that was in
    # flight at the checkpoint comes from the checkpoint, the next one from the resumed step-3 weights.
    resumed = _fit(
        tmp_path,
        "async_resumed",
        *args,
        "--trainer.val_check_interval",
        "4",
        "--ckpt_path",
        str(single / "checkpoints" / "step=2.ckpt"),
    )
    assert [row["step"] for row in train_rows(resumed)] == [3, 4]
    assert_rows_match(train_rows(resumed), rows, rel=1e-4, abs=1e-5)
    (validation,) = [row for row in read_metrics(resumed) if row.get("val/reward")]
    assert int(float(validation["step"])) == 4 and 0.0 <= float(validation["val/reward"]) <= 1.1
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    two = _fit(tmp_path, "async_ddp", *args, *ddp)
    assert saved_steps(two) == [2, 4]
    # Each rank's 4 completions are one whole group: the server gets the same requests in either layout.
    assert_rows_match(without_engine_gap(train_rows(two)), without_engine_gap(rows), rel=1e-4, abs=1e-5)
    # The staged versions broadcast over gloo instead of written as files: the same versions sample the same.
    gloo = _fit(tmp_path, "async_gloo", *args, "--model.rollout.engine.transfer.method", "gloo")
    assert_rows_match(train_rows(gloo), rows, rel=1e-4, abs=1e-5)


def test_a_server_dying_with_generations_in_flight_ends_the_run_in_one_line_and_the_checkpoint_resumes(
    tmp_path, vllm_server
):
    model = str(REPO / "lit_rl" / "assets" / "tiny-qwen2-addition-sft")
    doomed = LocalVLLMServer(model, str(tmp_path / "doomed.log"), extra_args=["--max-model-len", "128"])
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=2, save_dir=tmp_path / "died")
    base = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *SERVER, *FAST_GRPO]
    run_args = [
        "--model.rollout.max_staleness",
        "1",
        "--model.rollout.engine.max_retries",
        "1",
        "--trainer.max_steps",
        "1000",
    ]
    checkpoints = tmp_path / "died" / "run" / "version_0" / "checkpoints"
    process = subprocess.Popen(
        [*base, "--model.rollout.engine.server_url", doomed.url, *run_args],
        cwd=tmp_path,
        env=_vllm_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (checkpoints / "step=2.ckpt").exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        doomed.stop()  # the next generation is already in flight (launched before step 2's checkpoint)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1, stderr[-3000:]
    error, hint = stderr.strip().splitlines()[-2:]
    assert doomed.url in error and "is the server running" in error, error
    assert hint.startswith("lit-rl: its newest checkpoint is ") and "; resume with: lit-rl fit " in hint, hint
    assert "Traceback" not in stderr
    # The checkpoint of the last finished step is intact: resume it against a live server.
    kept = sorted(p.name for p in checkpoints.glob("step=*.ckpt"))
    assert "step=2.ckpt" in kept and not list(checkpoints.glob("*.tmp*"))
    newest = max(checkpoints.glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    steps_done = int(newest.stem.split("=")[1])
    resumed_overlay = write_overlay(tmp_path / "r.yaml", every_n_train_steps=2, save_dir=tmp_path / "resumed")
    resume = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(resumed_overlay), *SERVER]
    result = subprocess.run(
        [
            *resume,
            *FAST_GRPO,
            "--model.rollout.engine.server_url",
            vllm_server,
            "--model.rollout.max_staleness",
            "1",
            "--trainer.max_steps",
            str(steps_done + 2),
            "--ckpt_path",
            str(newest),
        ],
        cwd=tmp_path,
        env=_vllm_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(tmp_path / "resumed" / "run" / "version_0")
    assert [row["step"] for row in rows] == [steps_done + 1, steps_done + 2]


def test_colocated_episodes_go_on_on_their_own_through_vllms_scheduler_and_log_what_lock_step_logs(tmp_path):
    """Issue 56.1 on the colocated engine: multi-turn episodes (3 model turns, observations between) send each turn
    from the episode's own thread into vLLM's scheduler (`concurrent_generate`), on one process and on each of two
    (each rank's engine steps apart: the collective `generate` is never called), and every turn is sampled by vLLM
    from the transcript's ids (the trainer's log-probs within 1e-4). Each turn is seeded by its episode and turn:
    the runs log what turn-by-turn episodes (`--model.env.independent_turns false`) log."""
    environment = ("--model.env.environment", "tests.integration.envs.Countdown", "--model.env.max_turns", "3")
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    layouts = {
        "independent": ("--model.env.independent_turns", "true"),
        "turn_by_turn": ("--model.env.independent_turns", "false"),
        "two_processes": ddp,
    }
    rows, calls = {}, {}
    for name, layout in layouts.items():
        probe = probe_flags("CountEngineCalls", tmp_path / name)
        log_dir = _fit(tmp_path, name, *COLOCATE, *environment, *layout, *probe)
        _check_run(log_dir)
        rows[name] = train_rows(log_dir)
        ranks = 2 if name == "two_processes" else 1
        calls[name] = [json.loads((tmp_path / name / f"engine_calls_rank{r}.json").read_text()) for r in range(ranks)]
    assert all(row["train/turns"] > 1 and row["train/env_tokens"] > 0 for row in rows["independent"]), rows
    assert calls["turn_by_turn"][0]["concurrent_generate"] == 0
    assert 0 < calls["independent"][0]["generate"] < calls["turn_by_turn"][0]["generate"], calls
    assert all(rank["generate"] == 0 and rank["concurrent_generate"] > 0 for rank in calls["two_processes"]), calls
    for name in ("independent", "two_processes"):
        assert_rows_match(without_engine_gap(rows[name]), without_engine_gap(rows["turn_by_turn"]), rel=1e-4, abs=1e-5)


def test_episodes_score_the_engines_tokens_with_the_server_engine(tmp_path, vllm_server):
    """Multi-turn episodes (3 model turns, observations between): every turn is sampled by vLLM from the ids of the
    transcript so far, and the trainer's log-probs of the model's tokens are vLLM's within 1e-4 (RLOO on the server,
    and GRPO on the server with weights updated in flight; with fixed-lag asynchronous rollouts: the reference run of
    the accounting test below)."""
    environment = ("--model.env.environment", "tests.integration.envs.Countdown", "--model.env.max_turns", "3")
    server = (*SERVER, "--model.rollout.engine.server_url", vllm_server)
    log_dir = _fit(tmp_path, "server_env", *server, *environment, algorithm="rloo")
    _check_run(log_dir)
    for row in train_rows(log_dir):
        assert row["train/turns"] > 1 and row["train/env_tokens"] > 0, row
    # Asynchronous (k = 1, fixed lag): the reference run of the accounting test below. In flight: the generations'
    # episodes run side by side, the server taking each newer version between turns.
    # Generation 1's first episode holds its first step until generation 2 is launched (version 1 staged): its later
    # turns are sampled by version 1, so the tokens trained at step 1 are on average less stale than the rows,
    # whose staleness is their oldest token's.
    server = (*SERVER, "--model.rollout.engine.server_url", vllm_server, "--model.rollout.max_staleness", "1")
    in_flight = (*server, "--model.rollout.in_flight_updates", "true")
    held = ("--model.env.environment", "tests.integration.envs.AwaitsNewerWeights", "--model.env.max_turns", "3")
    held += ("--model.env.environment_args", "{wait_in: [1], per_generation: 8}")
    probe = probe_flags("RecordLabelledVersionGaps", tmp_path / "in_flight_probe")
    rows = train_rows(_fit(tmp_path, "in_flight_env", *in_flight, *held, *probe, max_steps=2))
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0]
    assert rows[0]["train/staleness/token_mean"] == 0.0 and rows[0]["train/rollout_logprob_diff/max"] < TOLERANCE
    assert 0.0 < rows[1]["train/staleness/token_mean"] < rows[1]["train/staleness/mean"] == 1.0
    # Every token was sampled by the version it carries: under that version's weights the trainer gives the
    # server's log-prob, for step 1's tokens of version 0 and of version 1 alike (learning rate 1e-3: a token
    # labelled with the other version would be off by far more).
    gaps = json.loads((tmp_path / "in_flight_probe" / "labelled_versions_rank0.json").read_text())
    assert set(gaps) == {"0", "1"} and set(gaps["1"]) == {"0", "1"}, gaps
    assert all(gap < TOLERANCE for by_version in gaps.values() for gap in by_version.values()), gaps


# A reward function that writes, for every completion it scores, the step that trains on it and its prompt (to
# TRAINED_LOG), and sends its own process STOP_SIGNAL when it scores for step STOP_AT_STEP (0-based).
ACCOUNTING = """
import os, signal
from lit_rl.rewards.arithmetic import correctness as _correctness

def counted(prompts, completions, trainer_state, **columns):
    with open(os.environ["TRAINED_LOG"], "a") as handle:
        handle.writelines(f"{trainer_state.global_step}\\t{prompt!r}\\n" for prompt in prompts)
    if os.environ.get("STOP_AT_STEP") == str(trainer_state.global_step):
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_SIGNAL"]))
    return _correctness(prompts, completions, **columns)
"""


def _trained(log: Path, steps: range) -> list[str]:
    """The (step, prompt) lines of `log` whose step is in `steps`, sorted."""
    return sorted(line for line in log.read_text().splitlines() if int(line.split("\t")[0]) in steps)


def test_episodes_in_flight_stopped_or_killed_resume_with_every_prompt_trained_once(tmp_path, vllm_server):
    """Issue 56.5, as a user meets it: episodes whose steps take 100 ms, sampled a step ahead (in flight, and
    fixed-lag), on the server. A run stopped by SIGTERM resumes by the command it printed; one killed by SIGKILL
    after its step-2 checkpoint resumes by `--ckpt_path last`. Counted per step and prompt across both processes
    (the steps the checkpoint holds from the first, the rest from the second), what was trained is exactly what an
    uninterrupted run trained: no prompt lost, none trained twice (the episodes in flight at the checkpoint are
    kept whole, so none restarts shorter). In flight on two trainer processes, the same."""
    (tmp_path / "accounting.py").write_text(ACCOUNTING)
    env = {**_vllm_env(), "PYTHONPATH": python_path(tmp_path)}
    episodes = [
        "--model.env.environment", "tests.integration.envs.SlowCountdown",
        "--model.env.max_turns", "3",
        "--model.rewards.funcs", "[accounting.counted, lit_rl.rewards.arithmetic.integer_format]",
        "--model.rollout.engine.server_url", vllm_server,
        "--model.rollout.max_staleness", "1",
        "--trainer.max_steps", "4",
    ]  # fmt: skip

    def command(name: str, *options: str) -> list[str]:
        overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=2, save_dir=tmp_path / name)
        config = ["--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay)]
        return [*CLI_COMMAND, "fit", *config, *SERVER, *FAST_GRPO, *episodes, *options]

    def run(cmd, log: Path, **stop: str) -> subprocess.CompletedProcess:
        run_env = {**env, "TRAINED_LOG": str(log), **stop}
        shell = isinstance(cmd, str)
        return subprocess.run(cmd, shell=shell, cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=600)

    probe = probe_flags("RecordLabelledVersionGaps", tmp_path / "reference_probe")
    reference = run(command("reference", *probe), tmp_path / "reference.log")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Each step's rows were sampled by the weights of their version, max(0, step - 1): the trainer's log-probs
    # under those weights are the server's.
    gaps = json.loads((tmp_path / "reference_probe" / "labelled_versions_rank0.json").read_text())
    assert {step: list(by_version) for step, by_version in gaps.items()} == {
        "0": ["0"],
        "1": ["0"],
        "2": ["1"],
        "3": ["2"],
    }
    assert all(gap < TOLERANCE for by_version in gaps.values() for gap in by_version.values()), gaps
    # Asynchronous (k = 1): each generation's episodes run on rank 0's worker, every turn sampled by the server with
    # the weights staged for its version; the first generation's by the initial weights, which the trainer has too.
    rows = train_rows(tmp_path / "reference" / "run" / "version_0")
    assert [row["train/staleness/max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [(row["train/staleness/share_0"], row["train/staleness/share_1"]) for row in rows[1:]] == [(0.0, 1.0)] * 3
    assert rows[0]["train/rollout_logprob_diff/max"] < TOLERANCE
    # The server's requests are counted: each step has the share of its time with none outstanding.
    perf = [row for row in read_metrics(tmp_path / "reference" / "run" / "version_0") if row.get("perf/step_s")]
    # A step's window may hold no request at all (its generation sampled in the background, during the step before):
    # counted over the run, and each step's share in [0, 1].
    busy = [float(row["perf/engine_busy_s"]) for row in perf]
    assert len(perf) == 4 and all(seconds >= 0 for seconds in busy) and sum(busy) > 0, perf
    assert all(0 <= float(row["perf/engine_idle_share"]) <= 1 for row in perf), perf
    assert all(row["train/turns"] > 1 and row["train/env_tokens"] > 0 for row in rows), rows
    expected = _trained(tmp_path / "reference.log", range(4))
    assert len(expected) == 4 * 8  # 2 prompts x 4 episodes a step

    in_flight = ("--model.rollout.in_flight_updates", "true")
    stopped = run(command("stopped", *in_flight), tmp_path / "stopped.log", STOP_AT_STEP="1", STOP_SIGNAL="SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    (line,) = [line for line in stopped.stderr.splitlines() if line.startswith("lit-rl: stopped by SIGTERM")]
    assert "after step 2;" in line, line
    resumed = run(line.split("resume with: ", 1)[1], tmp_path / "stopped_resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    trained = _trained(tmp_path / "stopped.log", range(2)) + _trained(tmp_path / "stopped_resumed.log", range(2, 4))
    assert sorted(trained) == expected

    # A killed process cannot remove its weight files: they go to the test's directory, not /dev/shm.
    sync_dir = ("--model.rollout.engine.transfer.sync_dir", str(tmp_path / "killed_weights"))
    killed = run(command("killed", *sync_dir), tmp_path / "killed.log", STOP_AT_STEP="3", STOP_SIGNAL="SIGKILL")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = run(command("killed", *sync_dir, "--ckpt_path", "last"), tmp_path / "killed_resumed.log")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "(step 2)" in resumed.stderr  # the checkpoint before the kill
    trained = _trained(tmp_path / "killed.log", range(2)) + _trained(tmp_path / "killed_resumed.log", range(2, 4))
    assert sorted(trained) == expected

    # In flight on two processes: rank 0 runs every rank's episodes against the server, taking each version staged
    # between their turns; every rank trains its share of each step, and the same prompts are trained, once each.
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    two = run(command("two", *in_flight, *ddp), tmp_path / "two.log")
    assert two.returncode == 0, two.stderr[-3000:]
    assert _trained(tmp_path / "two.log", range(4)) == expected
    rows = train_rows(tmp_path / "two" / "run" / "version_0")
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and max(row["train/staleness/max"] for row in rows) == 1
    assert all(row["train/staleness/token_mean"] <= row["train/staleness/mean"] for row in rows), rows


def test_synchronous_episodes_on_two_processes_go_on_on_their_own_with_no_collective_per_turn(tmp_path, vllm_server):
    """Issue 56.1 on several ranks: synchronous multi-turn episodes on a server the run launches, two trainer
    processes. Each rank sends its own episodes' turns to the server as they are ready (rank 0 shares the server's
    URL, whose port only it knows, and its name and state, with every push), so training calls the engine's
    collective `generate` not once. Episodes are seeded by episode and turn: the first step, sampled by the same
    weights, logs what one process logs against another server."""
    episodes = ("--model.env.environment", "tests.integration.envs.Countdown", "--model.env.max_turns", "3")
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    probe = probe_flags("CountEngineCalls", tmp_path / "calls")
    one = train_rows(
        _fit(tmp_path, "one", *SERVER, "--model.rollout.engine.server_url", vllm_server, *episodes, max_steps=2)
    )
    launched = (*SERVER, "--model.rollout.engine.launch", "true")
    two = train_rows(_fit(tmp_path, "two", *launched, *episodes, *ddp, *probe, max_steps=2))
    calls = [json.loads((tmp_path / "calls" / f"engine_calls_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(call["generate"] == 0 and call["concurrent_generate"] > 0 for call in calls), calls
    assert_rows_match(without_engine_gap(two[:1]), without_engine_gap(one[:1]), rel=1e-5, abs=1e-6)
    assert [row["step"] for row in two] == [1, 2] and all(row["train/turns"] > 1 for row in two), two


def test_an_engine_failure_on_one_rank_sampling_apart_stops_every_rank_in_one_line(tmp_path, vllm_server):
    """Two processes whose episodes go to the server apart: rank 1's engine fails in one of its own turns
    (`FailOnRankOne`) while rank 0 goes on with its own. Both processes end, not waiting on each other, and rank 0
    reports rank 1's error in one line; what the run wrote before is kept."""
    episodes = ("--model.env.environment", "tests.integration.envs.Countdown", "--model.env.max_turns", "3")
    ddp = ("--config", str(CONFIGS / "strategy" / "ddp.yaml"), "--model.schedule.micro_batch_size", "4")
    overlay = write_overlay(tmp_path / "fails.yaml", save_dir=tmp_path / "fails")
    command = [*CLI_COMMAND, "fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *FAST_GRPO]
    command += [*SERVER, "--model.rollout.engine.server_url", vllm_server, *episodes, *ddp]
    command += ["--trainer.max_steps", "2", *probe_flags("FailOnRankOne", tmp_path / "probe")]
    result = subprocess.run(command, cwd=tmp_path, env=_vllm_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert (tmp_path / "probe" / "failed_rank1.json").exists()  # the failure was rank 1's, in its own turns
    last = result.stderr.strip().splitlines()[-1]
    assert "planted: the vLLM server stopped answering rank 1 (on rank 1)" in last, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert os.path.isdir(tmp_path / "fails")


def test_the_server_engine_uploads_weights_to_a_receiver_beside_the_server(tmp_path, vllm_server):
    """`model.rollout.engine.transfer.receiver_url`: the weights go over HTTP to the weight receiver (as for a server
    on another machine), which the server reloads from; vLLM then samples from the trainer's policy (log-prob gap <
    1e-4)."""
    import threading

    from lit_rl.rollout.server.weight_receiver import WeightReceiver

    receiver = WeightReceiver(tmp_path / "received")
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        server_args = (
            *SERVER,
            "--model.rollout.engine.server_url",
            vllm_server,
            "--model.rollout.engine.transfer.receiver_url",
            receiver.url,
        )
        log_dir = _fit(tmp_path, "server_http", *server_args)
        _check_run(log_dir)
        # Each push committed a new `current.N`, and the one before it was removed: the newest alone is kept.
        (kept,) = [path for path in (tmp_path / "received").iterdir() if not path.name.startswith(".")]
        assert kept.name.startswith("current.") and (kept / "model-00000.safetensors").exists()
    finally:
        receiver.stop()


# What a colocated vLLM run still prints, once, at the engine's start, and why it stays: vLLM's advice to preload
# tcmalloc and Intel's OpenMP (a user can act on it: faster CPU decoding) and torch's C++ note that memory is
# bound to the NUMA node vLLM's threads are bound to (printed by torch's C++ side, out of Python's reach).
KEPT_WARNINGS = ("libtcmalloc is not found in LD_PRELOAD", "libiomp is not found in LD_PRELOAD", "NUMA binding")


def test_the_console_of_a_colocated_run_with_validation_says_only_what_a_user_can_act_on(tmp_path):
    """The shipped GRPO config with the colocated overlay, through the `lit-rl` script: validation rows where
    asked, and no message at each weight push or validation (vLLM's reload notices, Lightning's sync_dist
    advice): the warnings left are the start-up ones above, each once."""
    from tests.integration.test_resume import SMALL, _env, _lit_rl

    result = _lit_rl(
        tmp_path,
        {**_env(tmp_path), "VLLM_CPU_KVCACHE_SPACE": "1"},
        *["fit", "--config", str(CONFIGS / "grpo.yaml"), *COLOCATE, *SMALL, "--trainer.val_check_interval", "3"],
        *["--trainer.max_steps", "6"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = (result.stdout + result.stderr).splitlines()
    warnings = [line for line in console if "WARNING" in line or "Warning" in line]  # vLLM's, Python's, torch's
    for line in warnings:
        assert any(kept in line for kept in KEPT_WARNINGS), line
    for kept in KEPT_WARNINGS[:2]:
        assert sum(kept in line for line in warnings) <= 1, kept
    for per_step in ("Reloading", "RotaryEmbedding", "reset prefix cache", "sync_dist", "Traceback"):
        assert not [line for line in console if per_step in line], per_step
    rows = read_metrics(tmp_path / "runs" / "grpo" / "version_0")
    assert [int(float(row["step"])) for row in rows if row.get("val/reward")] == [3, 6]
    assert [int(float(row["step"])) for row in rows if row.get("train/reward")] == list(range(1, 7))
