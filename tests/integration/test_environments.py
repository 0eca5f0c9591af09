"""Multi-turn episodes through the real CLI (`--model.env.environment`): per-stage metrics, the trainer's log-probs of
the transcripts equal to the engine's (token-in, token-out), the checkpoint cadence, exact resume in the middle of
a generation, and the same steps on 1 and 2 processes; for GRPO, RLOO (and PPO and Online DPO, the first) on HF
`generate` (vLLM: `test_vllm.py`)."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch

from tests.conftest import (
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    fit_in_subprocess,
    read_metrics,
    run_cli,
    saved_steps,
    train_rows,
    without_engine_gap,
    write_overlay,
)
from tests.integration.probes import probe_flags

pytestmark = pytest.mark.slow

ENVIRONMENT = ["--model.env.environment", "tests.integration.envs.Countdown", "--model.env.max_turns", "3"]
FAST = [*FAST_GRPO, *ENVIRONMENT, "--model.loss.beta", "0.04", "--model.optim.learning_rate", "1e-3"]


def _fit(tmp_path, algorithm, *args, every_n=None, name="a"):
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=every_n, save_dir=tmp_path / name)
    run_cli("fit", "--config", str(CONFIGS / f"{algorithm}.yaml"), "--config", str(overlay), *FAST, *args)
    return tmp_path / name / "run" / "version_0"


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "ppo", "online_dpo"])
def test_episodes_train_log_their_metrics_and_score_the_engines_tokens(tmp_path, algorithm):
    pairs = ["--model.sampling.num_generations", "2"] if algorithm == "online_dpo" else []
    log_dir = _fit(tmp_path, algorithm, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", *pairs)
    rows = read_metrics(log_dir)
    columns = set(rows[0])
    for stage in ("train", "val"):
        for name in ("turns", "tool_calls", "tool_errors", "env_tokens", "rewards/env/bonus", "rewards/correctness"):
            assert f"{stage}/{name}" in columns, (stage, name)
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert 1 < row["train/turns"] <= 3 and row["train/env_tokens"] > 0 and row["train/tool_calls"] == 0
        # Observations are not the model's: the completion length counts the model's tokens alone, and the
        # trainer's log-probs of those tokens are the engine's (the transcript is what the engine sampled).
        assert row["train/rollout_logprob_diff/max"] < 1e-4
        assert row["train/completion_length"] <= 3 * 4  # max_turns x max_new_tokens
    val = [row for row in rows if row.get("val/turns")]
    assert val and float(val[0]["val/turns"]) > 1


def test_a_stalled_environment_step_ends_its_episode_is_counted_and_the_run_goes_on(tmp_path):
    """Every fourth episode's first step stalls 4 s against a 1 s limit: each step's 8 episodes hold two of them,
    so `train/env_timeouts` is 0.25 a step exactly; the stalled episodes end after one turn, the others run up to 3
    (fewer when the 12-token transcript budget runs out first)."""
    stalling = ["--model.env.environment", "tests.integration.envs.Stalling", "--model.env.step_timeout_s", "1"]
    log_dir = _fit(tmp_path, "grpo", "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", *stalling)
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert row["train/env_timeouts"] == 0.25
        assert 0.25 * 1 + 0.75 * 1 < row["train/turns"] <= 0.25 * 1 + 0.75 * 3


def test_episodes_keep_the_cadence_and_resume_mid_generation_exactly(tmp_path):
    common = (
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.schedule.num_iterations",
        "2",
        "--model.schedule.micro_batch_size",
        "4",
        "--trainer.limit_val_batches",
        "0",
    )
    full = _fit(tmp_path, "grpo", "--trainer.max_steps", "6", *common, every_n=3, name="full")
    first = _fit(tmp_path, "grpo", "--trainer.max_steps", "3", *common, every_n=3, name="first")
    checkpoint = str(first / "checkpoints" / "step=3.ckpt")
    resume = ("--ckpt_path", checkpoint)
    resumed = _fit(tmp_path, "grpo", "--trainer.max_steps", "6", *common, *resume, every_n=3, name="r")
    assert saved_steps(full) == [3, 6] and saved_steps(resumed) == [6]
    rows = train_rows(resumed)
    assert [row["step"] for row in rows] == [4, 5, 6]
    assert_rows_match(rows, train_rows(full), abs=1e-6)


def _layout(tmp_path, devices: int, accumulate: int, *args: str) -> list[dict]:
    """3 GRPO steps on Countdown episodes over `devices` processes x `accumulate` micro-batches of 4; the train rows
    without the engine-gap metrics."""
    log_dir = fit_in_subprocess(
        tmp_path,
        f"env_{devices}x{accumulate}_{len(args)}",
        "grpo.yaml",
        *FAST,
        "--trainer.devices",
        str(devices),
        "--trainer.accumulate_grad_batches",
        str(accumulate),
        "--model.schedule.micro_batch_size",
        "4",
        "--trainer.max_steps",
        "3",
        "--trainer.limit_val_batches",
        "0",
        *(["--trainer.strategy", "ddp"] if devices > 1 else []),
        *args,
        every_n_train_steps=None,
    )
    return train_rows(log_dir)


def test_episodes_are_the_same_steps_on_one_and_two_processes_turn_by_turn_and_in_ready_batches(tmp_path):
    """Each turn samples with a seed of its episode and turn: the transcripts, and so the steps, do not depend on
    how the batch is split over ranks. On two processes turn by turn, the ranks ask each other every turn whether
    any has episodes left (an all-reduce); in ready batches (`model.env.ready_batches`: HF `generate` on whole
    weights involves no other rank), each rank samples its own episodes' ready turns, against steps answering in
    random order, and never asks."""
    reference = without_engine_gap(_layout(tmp_path, 1, 2))
    asked = {}
    for name, mode in {"turn_by_turn": (), "ready_batches": READY_BATCHES}.items():
        probe = probe_flags("CountEngineCalls", tmp_path / name)
        split = without_engine_gap(_layout(tmp_path, 2, 1, *mode, *probe))
        # Float rounding only: each rank pads its transcripts to its own longest one.
        assert_rows_match(split, reference, rel=1e-4, abs=1e-5)
        counts = [json.loads((tmp_path / name / f"engine_calls_rank{r}.json").read_text()) for r in (0, 1)]
        assert all(count["generate"] > 0 for count in counts), counts
        asked[name] = [count["any_rank_active"] for count in counts]
    assert [row["step"] for row in reference] == [1, 2, 3] and reference[-1]["train/kl"] > 0
    assert all(asked["turn_by_turn"]) and asked["ready_batches"] == [0, 0], asked


READY_BATCHES = (
    "--model.env.ready_batches",
    "true",
    "--model.env.environment",
    "tests.integration.envs.JitteryCountdown",
)


def test_dynamic_sampling_refills_episodes_and_chooses_the_same_batch_on_one_and_two_processes(tmp_path):
    """Refill generations are episodes too: the chosen transcripts move between ranks with their model-token masks
    and statistics, so the trainer scores the engine's tokens alone, and the batch is the same however split."""
    dynamic = ("--model.rollout.dynamic_sampling", "true", "--model.rollout.max_refill_generations", "2")
    reference, split = _layout(tmp_path, 1, 2, *dynamic), _layout(tmp_path, 2, 1, *dynamic)
    assert any(row["train/refill_generations"] > 0 for row in reference)
    for row in reference + split:
        assert row["train/rollout_logprob_diff/max"] < 1e-4 and row["train/env_tokens"] > 0 and row["train/turns"] > 1
    assert_rows_match(without_engine_gap(split), without_engine_gap(reference), rel=1e-4, abs=1e-5)


def test_the_tool_demo_config_calls_the_calculator_and_scores_the_engines_tokens(tmp_path):
    """`configs/grpo_tools.yaml` for 2 steps: the warm start calls `calc` in most episodes, every call succeeds,
    and the trainer's log-probs of the model's tokens are the engine's."""
    overlay = write_overlay(tmp_path / "tools.yaml", save_dir=tmp_path / "tools")
    small = ["--model.schedule.micro_batch_size", "16", "--data.val_limit", "32", "--data.val_batch_size", "32"]
    steps = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "2"]
    run_cli("fit", "--config", str(CONFIGS / "grpo_tools.yaml"), "--config", str(overlay), *small, *steps)
    log_dir = tmp_path / "tools" / "run" / "version_0"
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    for row in train:
        assert row["train/tool_calls"] > 0.25 and row["train/tool_errors"] == 0 and row["train/env_tokens"] > 5
        assert row["train/rollout_logprob_diff/max"] < 1e-4
    val = [row for row in read_metrics(log_dir) if row.get("val/tool_calls")]
    assert float(val[0]["val/tool_calls"]) > 0.5 and float(val[0]["val/rewards/final_answer_correctness"]) > 0.5


@pytest.mark.parametrize("family", ["qwen", "llama"])
def test_chat_message_observations_are_rendered_by_the_template_and_score_the_engines_tokens(tmp_path, family):
    """An environment answering with `tool` messages, on a model with Qwen2.5's or Llama 3.1's chat template: each
    observation is the template's rendering appended after the turn (`ChatRenderer`; Llama's JSON-encoded), and the
    trainer's log-probs of the model's tokens are still the engine's (the transcript is token-in, token-out)."""
    from tests.llama_chat import save_llama_chat_model
    from tests.qwen_chat import save_qwen_chat_model

    model = (save_qwen_chat_model if family == "qwen" else save_llama_chat_model)(tmp_path / f"{family}-chat")
    chat = ["--model.env.environment", "tests.integration.envs.ChatCountdown", "--model.env.max_total_tokens", "200"]
    chat += ["--model.policy.model_name_or_path", str(model)]
    log_dir = _fit(tmp_path, "grpo", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", *chat)
    (row,) = train_rows(log_dir)
    # Each observation holds the template's markup: "\n<|im_start|>user\n<tool_response>\n2;\n</tool_response>..."
    # (about 50 tokens), or '<|start_header_id|>ipython<|end_header_id|>\n\n"2;"<|eot_id|>...' (about 30)
    markup = {"qwen": 40, "llama": 25}[family]
    assert 1 < row["train/turns"] <= 3 and row["train/env_tokens"] / (row["train/turns"] - 1) > markup
    assert row["train/rollout_logprob_diff/max"] < 1e-4


def test_a_trl_environment_class_trains_unchanged_through_the_cli(tmp_path):
    """TRL's IncrementEnv by import path, as a TRL user brings it: its `get_reward` is the column
    `rewards/env/IncrementEnv` and the reward function reading `environments` saw every counter at 0 (a random model
    calls no tool)."""
    from tests.qwen_chat import save_qwen_chat_model

    model = save_qwen_chat_model(tmp_path / "qwen-chat")
    trl_env = ["--model.env.environment", "tests.integration.envs.IncrementEnv", "--model.env.max_total_tokens", "64"]
    trl_env += [
        "--model.rewards.funcs",
        "[tests.integration.envs.counter_untouched]",
        "--model.rewards.weights",
        "null",
    ]
    trl_env += ["--model.policy.model_name_or_path", str(model)]
    log_dir = _fit(tmp_path, "grpo", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", *trl_env)
    (row,) = train_rows(log_dir)
    assert row["train/rewards/counter_untouched"] == 1.0 and row["train/tool_calls"] == 0
    # Logged (its values against each row's target are checked in tests/test_trl_environments.py).
    assert "train/rewards/env/IncrementEnv" in row


def test_trls_dict_of_environments_trains_through_the_cli_each_row_in_the_class_it_names(tmp_path):
    """`--model.env.environment '{count: ..., double: ...}'` (TRL's `environment_factory` dict) on rows whose
    `environment` column names one: the reward function reading `environments` and `environment` found every
    episode in its row's class, and IncrementEnv's `get_reward` has its column."""
    import json

    from tests.qwen_chat import save_qwen_chat_model

    data = tmp_path / "mixed.jsonl"
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "environment": ("count", "double")[i % 2]} for i in range(8)]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    routed = "{count: tests.integration.envs.IncrementEnv, double: tests.integration.envs.DoubleEnv}"
    args = ["--model.env.environment", routed, "--model.env.max_total_tokens", "64", "--data.train_data", str(data)]
    args += ["--data.val_data", "null"]
    args += ["--model.rewards.funcs", "[tests.integration.envs.environment_of_row]", "--model.rewards.weights", "null"]
    args += ["--model.policy.model_name_or_path", str(save_qwen_chat_model(tmp_path / "qwen-chat"))]
    log_dir = _fit(tmp_path, "grpo", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", *args)
    (row,) = train_rows(log_dir)
    assert row["train/rewards/environment_of_row"] == 1.0 and "train/rewards/env/IncrementEnv" in row


@pytest.mark.parametrize("independent_turns", [True, False])
def test_a_one_process_run_on_an_engine_taking_concurrent_calls_runs_its_episodes_on_their_own(independent_turns):
    """`model.env.independent_turns` (the default) on an engine with a `concurrent_generate` (the vLLM server
    engine's; here HF `generate` behind a lock stands in for it): after the first turn, every turn of a one-process
    run goes to it one episode at a time. With `independent_turns: false`, none does: turn by turn."""
    import threading

    from tests.conftest import fit_on_episodes

    turns: list[int] = []

    def prepare(module):
        build, lock = module.engines.build, threading.Lock()

        def with_concurrent_calls():
            engine = build()

            def concurrent_generate(prompt_ids, prompt_mask, params, seeds=None):
                turns.append(len(prompt_ids))
                with lock:
                    return engine.generate(prompt_ids, prompt_mask, params, seeds)

            engine.concurrent_generate = concurrent_generate  # a `ConcurrentEngine`, as the server engine is
            engine.concurrent_on_every_rank = True
            return engine

        module.engines.build = with_concurrent_calls

    model, _ = fit_on_episodes(prepare=prepare, independent_turns=independent_turns)
    later_turns = int((model._buffer.episode_stats[:, 0] - 1).sum())  # every episode's turns after its first
    if independent_turns:
        assert turns == [1] * later_turns and later_turns > 0
    else:
        assert turns == []


def test_hf_generate_on_one_process_samples_in_ready_batches_the_tokens_lock_step_samples():
    """HF `generate` on one process with `model.env.ready_batches`: the turns are sampled in batches of the episodes
    that are ready, against steps answering in random order (one after 0.5 s), more calls than turns; every token
    and count is lock-step's, and the log-probs are within float rounding of it (a row's batch changes them: not
    bit-exact)."""
    from tests.conftest import fit_grpo
    from tests.integration.envs import JitteryCountdown

    runs = {}
    for ready_batches in (True, False):
        calls: list[int] = []
        JitteryCountdown.slow_first = True

        def prepare(module, calls=calls):
            build = module.engines.build

            def counted():
                engine = build()
                generate = engine.generate
                engine.generate = lambda ids, *args, **kwargs: calls.append(len(ids)) or generate(ids, *args, **kwargs)
                return engine

            module.engines.build = counted

        model = fit_grpo(
            environment="tests.integration.envs.JitteryCountdown",
            max_turns=3,
            max_new_tokens=3,
            ready_batches=ready_batches,
            prepare=prepare,
        )
        runs[ready_batches] = (model._buffer, calls)
    (ready, ready_calls), (lock_step, lock_step_calls) = runs[True], runs[False]
    for field in ("completion_ids", "completion_mask", "sampled_mask", "episode_stats", "rewards"):
        assert torch.equal(getattr(ready, field), getattr(lock_step, field)), field
    torch.testing.assert_close(ready.rollout_logprobs, lock_step.rollout_logprobs, rtol=0, atol=1e-5)
    # 8 episodes of 2 turns (a third would pass the 9-token budget): lock-step's 2 calls; in ready batches the
    # episode whose step took 0.5 s takes its second turn in a call of its own, after the others'.
    assert lock_step_calls == [8, 8] and sum(ready_calls) == 16 and ready_calls[-1] == 1, ready_calls


def test_an_openenv_app_runs_one_session_per_episode_scores_its_rewards_and_is_stopped_at_the_end(tmp_path):
    """`lit_rl.envs.OpenEnv` serving the tests' OpenEnv app (`tests.integration.openenv_countdown`) as a user's
    config does: each episode is one WebSocket session, reset with its row's answer (2 + answer % 2 turns), its
    steps' rewards summed into `rewards/env/openenv`; each step's sessions are closed before the next step opens
    its own (left to the end, 16 would be open at once), and the server is gone after the run."""
    from tests.conftest import cli_env

    sessions = tmp_path / "sessions.log"
    openenv = ["--model.env.environment", "lit_rl.envs.OpenEnv", "--model.env.max_turns", "3"]
    openenv += [
        "--model.env.environment_args",
        "{app: tests.integration.openenv_countdown:app, row_reset_args: [answer]}",
    ]
    openenv += ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]
    log_dir = fit_in_subprocess(
        tmp_path,
        "a",
        "grpo.yaml",
        *FAST_GRPO,
        *openenv,
        every_n_train_steps=None,
        env={**cli_env(), "OPENENV_COUNTDOWN_LOG": str(sessions)},
    )
    rows = train_rows(log_dir)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert 2 <= row["train/turns"] <= 3 and row["train/env_tokens"] > 0
        assert 0.0 <= row["train/rewards/env/openenv"] <= 0.25 * row["train/turns"]
        assert row["train/rollout_logprob_diff/max"] < 1e-4  # the observations appended token-in, token-out
    events = [line.split() for line in sessions.read_text().splitlines()]
    open_at_once = list(itertools.accumulate(1 if event == "open" else -1 for event, _ in events))
    # micro_batch_size 8 a step: two prompts x 4 generations, one session each
    assert len(events) == 2 * 16 and max(open_at_once) == 8 and open_at_once[-1] == 0
    (server,) = {pid for _, pid in events}
    with pytest.raises(ProcessLookupError):
        os.kill(int(server), 0)
