"""The README's "your own model and data" command, run as printed through the `lit-rl` script, from a directory
holding the prompts file and the reward module it names (the model is the shipped one, as no hub is reachable here,
and the run is 2 steps instead of 500)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

REWARDS = """
def accuracy(prompts, completions, answer, **kwargs):
    return [1.0 if completion.strip() == expected else 0.0 for completion, expected in zip(completions, answer)]
"""


def _readme_command(heading: str) -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split(f"## {heading}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    return block.replace("\\\n", " ")


@pytest.mark.slow
def test_your_own_model_and_data_runs_as_the_readme_prints_it(tmp_path):
    command = _readme_command("Your own model and data")
    assert "Qwen/Qwen2.5-0.5B-Instruct" in command and "--trainer.max_steps 500" in command
    local_model = str(REPO / "lit_rl" / "assets" / "tiny-qwen2-addition-sft")
    command = command.replace("Qwen/Qwen2.5-0.5B-Instruct", local_model).replace("max_steps 500", "max_steps 2")
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    with open(tmp_path / "prompts.jsonl", "w") as handle:
        for a in range(32):
            handle.write(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n")
    # The working directory is not on PYTHONPATH: lit-rl itself lets the config name modules there.
    env = {**os.environ, "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "lit-rl: done, 2 optimizer steps" in result.stdout + result.stderr
    run = tmp_path / "runs" / "grpo" / "version_0"
    with open(run / "metrics.csv", newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/rewards/accuracy")]
    assert [int(float(row["step"])) for row in rows] == [1, 2]
    assert (run / "hf" / "model.safetensors").is_file()
