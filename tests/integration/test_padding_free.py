"""`--model.policy.padding_free true` through the real CLI: every algorithm logs the padded run's numbers (to float
rounding) while every training forward (policy, reference, old log-probs, DPO's chosen and rejected) runs packed."""

from __future__ import annotations

import pytest

import lit_rl.modeling.completions as completions
from tests.conftest import FAST_GRPO, assert_rows_match, fit_config, train_rows

pytestmark = pytest.mark.slow

FAST_DPO = ["--data.batch_size", "8", "--data.val_limit", "16", "--trainer.num_sanity_val_steps", "0"]
ALGORITHMS = {
    # beta > 0 and two optimizer steps per generation: reference and old log-probs run packed too.
    "grpo": [
        *FAST_GRPO,
        "--model.loss.beta",
        "0.04",
        "--model.schedule.steps_per_generation",
        "2",
        "--model.sampling.max_new_tokens",
        "8",
    ],
    "rloo": [*FAST_GRPO, "--model.loss.beta", "0.04"],
    # The critic's forwards (values at sampling time, then with gradients) run packed too.
    "ppo": [
        *FAST_GRPO,
        "--model.loss.beta",
        "0.04",
        "--model.schedule.num_iterations",
        "2",
        "--model.critic_learning_rate",
        "1e-2",
    ],
    "online_dpo": [*FAST_GRPO, "--model.sampling.num_generations", "2"],
    "dpo": FAST_DPO,
    "sft": ["--data.batch_size", "8", "--data.val_limit", "8", "--trainer.log_every_n_steps", "1"],
}


def _fit(tmp_path, name: str, algorithm: str, *args: str) -> list[dict[str, float]]:
    # lr 1e-3: large steps, so a gradient that differed would show in the later steps' numbers.
    steps = ["--trainer.max_steps", "3", "--model.optim.learning_rate", "1e-3"]
    log_dir = fit_config(tmp_path, name, f"{algorithm}.yaml", *ALGORITHMS[algorithm], *steps, *args)
    # Timings and the engine-vs-trainer rounding gap are not the algorithm's numbers.
    return [
        {k: v for k, v in row.items() if not k.startswith(("train/rollout_", "perf/"))} for row in train_rows(log_dir)
    ]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_padding_free_training_logs_the_padded_runs_numbers(tmp_path, monkeypatch, algorithm):
    padded = _fit(tmp_path, "padded", algorithm)
    packed_calls = []
    packed_forward = completions.packed_completion_forward

    def counting(*args, **kwargs):
        packed_calls.append(args[3].shape[0])
        return packed_forward(*args, **kwargs)

    monkeypatch.setattr(completions, "packed_completion_forward", counting)
    # All sequences in one packed row (the flash-attention layout): the tiny task's sequences are of nearly equal
    # length, so the CPU layout (rows of at most the longest sequence) would mostly hold one sequence per row,
    # and a sequence attending to its neighbours would go unseen. Both layouts are checked in test_packing.py.
    monkeypatch.setattr("lit_rl.modeling.packing.uses_flash_attention", lambda model: True)
    packed = _fit(tmp_path, "packed", algorithm, "--model.policy.padding_free", "true")
    assert [row["step"] for row in packed] == [row["step"] for row in padded] and len(padded) >= 3
    assert packed_calls, "no forward ran packed"
    # Same values to float rounding (padded and packed batches sum in different orders); Online DPO logs NaN pair
    # metrics on a step whose pairs all tied, in both runs.
    assert_rows_match(packed, padded, rel=1e-4, abs=1e-5, nan_ok=True)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_head_chunks_log_the_full_logits_runs_numbers(tmp_path, monkeypatch, algorithm):
    """`--model.policy.head_chunk_tokens`: every forward through the output head a few tokens at a time (alone, and with
    padding-free rows) logs the numbers of the run that builds whole logits."""
    full = _fit(tmp_path, "full", algorithm)
    chunk_calls = []
    chunked_scores = completions.chunked_head_scores

    def counting(head, hidden, *args, **kwargs):
        chunk_calls.append(hidden.shape[0])
        return chunked_scores(head, hidden, *args, **kwargs)

    monkeypatch.setattr(completions, "chunked_head_scores", counting)
    chunked = _fit(tmp_path, "chunked", algorithm, "--model.policy.head_chunk_tokens", "5")
    assert chunk_calls and max(chunk_calls) > 5, "no forward ran its head in chunks"
    packed = _fit(
        tmp_path, "packed", algorithm, "--model.policy.head_chunk_tokens", "3", "--model.policy.padding_free", "true"
    )
    assert len(full) >= 3
    for run in (chunked, packed):
        assert [row["step"] for row in run] == [row["step"] for row in full]
        assert_rows_match(run, full, rel=1e-4, abs=1e-5, nan_ok=True)
