"""Golden runs of the synchronous rollout schedule: what `max_staleness: 0` must keep logging, bit for bit.

`python -m tests.golden.sync_schedule` writes `sync_schedule.json` (every train/ value of each run) with whatever
lit_rl it imports; the JSON in the repository was written at commit a94e09a, before asynchronous rollouts existed
(`git worktree add /tmp/old a94e09a && cd /tmp/old && PYTHONPATH=. python -m tests.golden.sync_schedule`, the
script copied in). `tests/integration/test_async_rollouts.py` runs the same and compares.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import CONFIGS, FAST_GRPO, run_cli, train_rows, write_overlay

GOLDEN = Path(__file__).with_name("sync_schedule.json")
RUNS = {
    # one generation per step, a reference model and its KL
    "grpo_beta": ["--trainer.max_steps", "3", "--model.loss.beta", "0.04"],
    # two steps per generation, two passes (old log-probs), accumulation, token aggregation
    "grpo_iterations": [
        "--trainer.max_steps",
        "4",
        "--model.schedule.steps_per_generation",
        "2",
        "--model.schedule.num_iterations",
        "2",
        "--trainer.accumulate_grad_batches",
        "2",
        "--model.loss.aggregation",
        "token",
    ],
}


def run(name: str, tmp_path: Path) -> list[dict[str, float]]:
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=None, save_dir=tmp_path / name)
    grpo = str(CONFIGS / "grpo.yaml")
    run_cli("fit", "--config", grpo, "--config", str(overlay), *FAST_GRPO, *RUNS[name])
    return train_rows(tmp_path / name / "run" / "version_0")


if __name__ == "__main__":
    import tempfile

    import lit_rl

    print("lit_rl from", lit_rl.__file__, file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: run(name, Path(tmp)) for name in RUNS}
    GOLDEN.write_text(json.dumps(rows, indent=1) + "\n")
    print("wrote", GOLDEN)
