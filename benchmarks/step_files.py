"""Which of lit-rl's files one GRPO step runs code in: a measure of how many files a reader of a step must open.

    python benchmarks/step_files.py                 # the shipped GRPO config, a few steps, offline, on CPU
    python benchmarks/step_files.py --out step_files.json

Runs `lit-rl fit --config configs/grpo.yaml` in this process (2 optimizer steps, no validation,
no logger) and records, with `sys.setprofile`, every function of `lit_rl` that runs during the micro-steps of the
second optimizer step: its first micro-step samples and scores a generation, builds the rollout batch and trains a
micro-batch. Reports the files those functions are in, with the calls into each, and every pair of files where a
function of one calls a function of the other (with the number of such calls): the back-and-forth a reader follows.

Lightning's own work between micro-steps (backward, the optimizer step, callbacks) is outside `training_step` and
not counted; neither are torch, transformers or Lightning files.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(extra: list[str]) -> dict:
    """Fit the shipped GRPO config for two optimizer steps, profiling the second step's micro-steps."""
    import lit_rl
    from lit_rl.algorithms.on_policy import OnPolicyModule
    from lit_rl.cli import main

    package = Path(lit_rl.__file__).resolve().parent
    calls: collections.Counter = collections.Counter()  # calls into each file
    edges: collections.Counter = collections.Counter()  # (caller's file, callee's file) of calls that cross files
    original = OnPolicyModule.training_step

    def lit_rl_file(code) -> str | None:
        path = Path(code.co_filename)
        return str(path.relative_to(package.parent)) if path.is_relative_to(package) else None

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = lit_rl_file(frame.f_code)
        if callee is None:
            return
        calls[callee] += 1
        caller = lit_rl_file(frame.f_back.f_code) if frame.f_back is not None else None
        if caller is not None and caller != callee:
            edges[caller, callee] += 1

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step != 1:
            return original(self, batch, batch_idx)
        sys.setprofile(profile)
        try:
            return original(self, batch, batch_idx)
        finally:
            sys.setprofile(None)

    OnPolicyModule.training_step = training_step
    args = ["fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--trainer.max_steps", "2"]
    args += ["--trainer.limit_val_batches", "0", "--trainer.logger", "false"]
    with tempfile.TemporaryDirectory(prefix="lit-rl-step-files-") as run:  # its files, not the working directory's
        main([*args, "--trainer.default_root_dir", run, *extra])
    files = sorted(calls, key=lambda f: (-calls[f], f))
    return {
        "files": len(files),
        "file_pairs_calling": len(edges),
        "calls_per_file": {f: calls[f] for f in files},
        "calls_between_files": {f"{a} -> {b}": n for (a, b), n in sorted(edges.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here as well")
    parser.add_argument("overrides", nargs="*", help="further `lit-rl fit` options (`--model.sampling...`)")
    args = parser.parse_args()
    report = measure(args.overrides)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
