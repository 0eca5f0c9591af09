"""A TRL user's data and rewards through the `lit-rl` script and the shipped configs: a `datasets` directory of
chat prompts scored by TRL's own reward function and the user's, and DPO on implicit-prompt pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, python_path

datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")

SMALL = [
    "--model.sampling.num_generations", "4",
    "--model.schedule.micro_batch_size", "8",
    "--model.sampling.max_new_tokens", "4",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip

# The user's module: a TRL-style reward that records what it was given.
RECORDER = """
import json, os
def recorder(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
    with open(os.environ["RECORD"], "a") as out:
        out.write(json.dumps({
            "prompt": prompts[0], "completion": completions[0], "ids": completion_ids[0], "answer": answer[0],
            "step": trainer_state.global_step, "max_steps": trainer_state.max_steps, "n": len(completions),
            "other": sorted(kwargs),
        }) + "\\n")
    return [len(ids) / 10 for ids in completion_ids]
"""


def _lit_rl(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    environ = {**os.environ, "PATH": path, "PYTHONPATH": python_path(cwd), **env}
    return subprocess.run(["lit-rl", *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_grpo_on_a_saved_dataset_of_chat_prompts_with_trl_rewards(tmp_path):
    def rows(numbers):
        return [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in numbers]

    splits = {"train": datasets.Dataset.from_list(rows(range(8))), "test": datasets.Dataset.from_list(rows([11, 12]))}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "chat"))
    (tmp_path / "my_rewards.py").write_text(RECORDER)
    record = tmp_path / "record.jsonl"
    result = _lit_rl(
        tmp_path,
        *["fit", "--config", str(CONFIGS / "grpo.yaml"), *SMALL, "--trainer.max_steps", "2"],
        *["--data.train_data", "chat:train", "--data.val_data", "chat:test", "--trainer.val_check_interval", "2"],
        *["--data.val_batch_size", "2"],
        *["--model.rewards.funcs", "[trl.rewards.think_format_reward, my_rewards.recorder]"],
        *["--model.rewards.weights", "[1.0, 1.0]"],
        RECORD=str(record),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(c["step"], c["n"]) for c in calls] == [(0, 8), (1, 8), (2, 2)]  # two training steps, one validation
    for call in calls:
        question = call["prompt"][0]
        assert question["role"] == "user" and call["answer"] == str(2 * int(question["content"].split("+")[0]))
        assert [m["role"] for m in call["completion"]] == ["assistant"]
        assert isinstance(call["completion"][0]["content"], str)
        assert 1 <= len(call["ids"]) <= 4 and all(isinstance(i, int) for i in call["ids"])
        # Every column was a named keyword; TRL 1.16's logging hooks are passed as TRL passes them.
        assert call["max_steps"] == 2 and call["other"] == ["log_extra", "log_metric"]
    metrics = (tmp_path / "runs" / "grpo" / "version_0" / "metrics.csv").read_text()
    assert "train/rewards/think_format_reward" in metrics and "val/rewards/recorder" in metrics


@pytest.mark.slow
def test_dpo_on_implicit_prompt_pairs_from_an_arrow_file(tmp_path):
    pairs = [
        {
            "chosen": [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 1)}],
            "rejected": [{"role": "user", "content": f"{a}+1="}, {"role": "assistant", "content": str(a + 2)}],
        }
        for a in range(8)
    ]
    datasets.Dataset.from_list(pairs).save_to_disk(str(tmp_path / "pairs"))
    arrow = next((tmp_path / "pairs").glob("*.arrow"))
    result = _lit_rl(
        tmp_path,
        *["fit", "--config", str(CONFIGS / "dpo.yaml"), "--trainer.max_steps", "1"],
        *["--data.train_data", str(arrow), "--data.val_data", "null", "--data.batch_size", "4"],
        "--trainer.enable_progress_bar=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = (tmp_path / "runs" / "dpo" / "version_0" / "metrics.csv").read_text().splitlines()
    assert rows[0].count("train/rewards/accuracies") == 1 and len(rows) == 2  # header, step 1
