"""What LoRA saves: trainable parameters, checkpoint size and peak memory, full fine-tuning vs `configs/peft/lora.yaml`.

    python benchmarks/lora.py --out benchmarks/results/lora_cpu.json      # the ~20M model, GRPO and DPO
    python benchmarks/lora.py --quick                                      # a small model, GRPO, 2 steps
    python benchmarks/lora.py --markdown benchmarks/results/lora_cpu.json  # the README's table

The model is a randomly initialised Qwen2 (default hidden 512, 8 layers, intermediate 1024: 21M parameters) with
the tiny character tokenizer, built offline. Each row is one `lit-rl fit` process of the algorithm's shipped config
with a reference model (GRPO `beta` 0.04; DPO's is always on), checkpointing at its last step. Reported: trainable
parameters, the size of that checkpoint file, the peak memory of the process (`perf/peak_memory_mib`: RSS on CPU,
CUDA max allocated on GPU) and seconds per step (means after the first step).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, write_report  # noqa: E402
from support import build_random_model, count_parameters  # noqa: E402
from throughput import fit_flags, metric_rows  # noqa: E402

from lit_rl.modeling.lora import LoRAConfig, apply_lora  # noqa: E402
from lit_rl.modeling.models import load_causal_lm  # noqa: E402

CONFIGS = REPO / "configs"
ALGORITHMS = {
    "grpo": [
        "--model.loss.beta",
        "0.04",
        "--model.sampling.num_generations",
        "8",
        "--model.schedule.micro_batch_size",
        "32",
    ],
    "dpo": ["--data.batch_size", "16"],
}


def run_one(algorithm: str, lora: bool, model_dir: Path, steps: int, workdir: Path) -> dict:
    name = f"{algorithm}-{'lora' if lora else 'full'}"
    overlay = workdir / f"{name}.yaml"
    checkpoint = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(workdir / name / "checkpoints"), "every_n_train_steps": steps},
    }
    overlay.write_text(yaml.safe_dump({"trainer": {"callbacks": [checkpoint]}}))
    command = [
        sys.executable,
        "-m",
        "lit_rl.cli",
        "fit",
        "--config",
        str(CONFIGS / f"{algorithm}.yaml"),
        *(["--config", str(CONFIGS / "peft" / "lora.yaml")] if lora else []),
        "--config",
        str(overlay),
        "--model.policy.model_name_or_path",
        str(model_dir),
        "--trainer.val_check_interval",
        "1000000",
        *fit_flags(steps, workdir, name, checkpoints=True),
        *ALGORITHMS[algorithm],
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    log_dir = max((workdir / name).glob("version_*"))
    rows = [row for row in metric_rows(log_dir) if "perf/step_s" in row]
    (checkpoint_file,) = (workdir / name / "checkpoints").glob("*.ckpt")
    model = load_causal_lm(str(model_dir))
    trainable, total = count_parameters(apply_lora(model, LoRAConfig(**_lora_settings())) if lora else model)
    return {
        "algorithm": algorithm,
        "lora": lora,
        "trainable_parameters": trainable,
        "total_parameters": total,
        "checkpoint_mib": checkpoint_file.stat().st_size / 2**20,
        "peak_memory_mib": max(row["perf/peak_memory_mib"] for row in rows),
        "step_s": statistics.fmean(row["perf/step_s"] for row in rows[1:] or rows),
    }


def _lora_settings() -> dict:
    return yaml.safe_load((CONFIGS / "peft" / "lora.yaml").read_text())["model"]["init_args"]["policy"]["lora"]


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| algorithm | training | trainable parameters | checkpoint | peak memory | s/step |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        share = 100 * r["trainable_parameters"] / r["total_parameters"]
        lines.append(
            f"| {r['algorithm']} | {'LoRA' if r['lora'] else 'full'} | {r['trainable_parameters']:,} ({share:.1f}%) "
            f"| {r['checkpoint_mib']:.1f} MiB | {r['peak_memory_mib']:.0f} MiB | {r['step_s']:.2f} |"
        )
    return "\n".join(lines)


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="full fine-tuning vs LoRA")
    for column in ["algorithm", "training", "trainable", "total", "checkpoint MiB", "peak MiB", "s/step"]:
        table.add_column(column, justify="left" if column in ("algorithm", "training") else "right")
    for r in results:
        table.add_row(
            r["algorithm"],
            "LoRA" if r["lora"] else "full",
            f"{r['trainable_parameters']:,}",
            f"{r['total_parameters']:,}",
            f"{r['checkpoint_mib']:.1f}",
            f"{r['peak_memory_mib']:.0f}",
            f"{r['step_s']:.2f}",
        )
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, GRPO, 2 steps")
    args = parse_report_args(parser, markdown_table)
    if args.quick:
        args.algorithms, args.hidden, args.layers, args.intermediate, args.steps = ["grpo"], 128, 2, 256, 2
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-lora-") as tmp:
        sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate)
        model_dir = build_random_model(Path(tmp) / "model", **sizes)
        for algorithm in args.algorithms:
            for lora in (False, True):
                print(f"running {algorithm} {'LoRA' if lora else 'full'} ...", flush=True)
                results.append(run_one(algorithm, lora, model_dir, args.steps, Path(tmp)))
    print_table(results)
    if args.out:
        model = {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "intermediate_size": args.intermediate}
        write_report(args.out, results, allow_dirty=args.allow_dirty, model=model, steps=args.steps)


if __name__ == "__main__":
    main()
