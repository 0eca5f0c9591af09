"""Seconds per optimizer step of lit-rl and TRL on the same workload, from interleaved runs.

    python benchmarks/compare_trl.py --out benchmarks/results/compare_trl_cpu.json   # tiny and ~20M, GRPO and DPO
    python benchmarks/compare_trl.py --quick                                          # tiny model, 6 steps each
    python benchmarks/compare_trl.py --markdown benchmarks/results/compare_trl_cpu.json

Needs TRL (`pip install trl`; not a lit-rl dependency). Each run is its own process; runs alternate lit-rl, TRL,
lit-rl, TRL, ... (`--rounds`), so a slow spell of a shared machine hits both. Seconds per step: the median of the
wall time between consecutive optimizer steps after `--warmup` steps (lit-rl's `perf/step_s`; for TRL the time
between `on_step_end` callbacks), then the median over rounds.

The workloads, the same for both libraries:
- GRPO: the built-in addition prompts, 8 prompts x G = 8 completions per step (one micro-batch of 64), at most
  8 new tokens, temperature 1, beta 0 (no reference model), one iteration, the GRPO paper's sequence-level loss
  (lit-rl `loss_aggregation: sequence`, TRL `loss_type: grpo`), group-std advantages, reward = correctness,
  HF `generate` (TRL `use_vllm: false`), AdamW lr 1e-5, fp32, CPU.
- DPO: the built-in addition preference pairs, 32 pairs per step, sigmoid loss, beta 0.1, a live reference
  model, AdamW lr 1e-5, fp32, CPU.
Both without gradient checkpointing, gradient norm clipped at 1 (TRL's default `max_grad_norm`, lit-rl's configs).
Models: the shipped tiny model (1M parameters) and a randomly initialised Qwen2 of hidden 512, 8 layers (21M),
both with the character tokenizer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import add_allow_dirty, check_output, write_report  # noqa: E402
from throughput import fit_flags, metric_rows  # noqa: E402

from lit_rl.models import build_random_model, resolve_model_path  # noqa: E402

TINY = "lit-rl/tiny-qwen2-addition-sft"


@dataclass
class Workload:
    """What both libraries run. The defaults are this script's CPU workloads; `benchmarks/gpu_suite.py` runs GRPO
    on a GPU in bf16 with colocated vLLM through the same two functions."""

    group: int = 8  # G, completions per prompt
    prompts: int = 8  # prompts per optimizer step
    max_new_tokens: int = 8
    pairs: int = 32  # DPO pairs per step
    learning_rate: float = 1e-5
    gpu: bool = False
    bf16: bool = False  # lit-rl `bf16-mixed`, TRL `bf16=True`
    vllm: bool = False  # colocated vLLM (lit-rl `configs/rollout/vllm_colocate.yaml`, TRL `vllm_mode="colocate"`)
    sleep_mode: bool = False
    gpu_memory_utilization: float = 0.3


# -- one run (a child process) ---------------------------------------------------------------------------------
def lit_run(algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()) -> list[float]:
    """lit-rl's CLI on the workload; its per-step wall times (`perf/step_s`)."""
    from lit_rl.cli import main

    common = [
        "--model.model_name_or_path",
        model,
        "--model.learning_rate",
        str(work.learning_rate),
        "--trainer.limit_val_batches",
        "0",
        *fit_flags(steps, workdir),
    ]
    if work.gpu:
        common += ["--trainer.accelerator", "gpu", "--trainer.devices", "1"]
    if work.bf16:
        common += ["--trainer.precision", "bf16-mixed"]
    if algorithm == "grpo":
        args = [
            "--config",
            str(REPO / "configs" / "grpo.yaml"),
            "--model.reward_funcs",
            "[lit_rl.rewards.arithmetic.correctness]",
            "--model.reward_weights",
            "null",
            "--model.num_generations",
            str(work.group),
            "--model.micro_batch_size",
            str(work.group * work.prompts),
            "--model.max_new_tokens",
            str(work.max_new_tokens),
            "--model.beta",
            "0.0",
            "--model.loss_aggregation",
            "sequence",
        ]
        if work.vllm:
            args += ["--config", str(REPO / "configs" / "rollout" / "vllm_colocate.yaml")]
            args += ["--model.vllm.enable_sleep_mode", str(work.sleep_mode).lower()]
            args += ["--model.vllm.gpu_memory_utilization", str(work.gpu_memory_utilization)]
    else:
        args = ["--config", str(REPO / "configs" / "dpo.yaml"), "--data.batch_size", str(work.pairs)]
    main(["fit", *args, *common])
    (log_dir,) = workdir.glob("*/version_*")
    return [row["perf/step_s"] for row in metric_rows(log_dir) if "perf/step_s" in row]


def trl_run(algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()) -> list[float]:
    """TRL's trainer on the workload; the wall times between its optimizer steps."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from lit_rl.data.arithmetic import addition_preference_rows, addition_rows
    from lit_rl.models import load_causal_lm, load_tokenizer
    from lit_rl.rewards.arithmetic import correctness

    torch.manual_seed(0)
    marks: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not marks:
                marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    tokenizer = load_tokenizer(model)
    policy = load_causal_lm(model, disable_dropout=True)
    common = dict(
        output_dir=str(workdir),
        max_steps=steps,
        learning_rate=work.learning_rate,
        lr_scheduler_type="constant",
        use_cpu=not work.gpu,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        # TRL's configs default to bf16 mixed precision and gradient checkpointing; the workload says which
        # precision, and both run without checkpointing.
        bf16=work.bf16,
        gradient_checkpointing=False,
    )
    if algorithm == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        rows = addition_rows("train")
        dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])
        config = GRPOConfig(
            **common,
            per_device_train_batch_size=work.group * work.prompts,
            gradient_accumulation_steps=1,
            num_generations=work.group,
            max_completion_length=work.max_new_tokens,
            temperature=1.0,
            top_k=0,
            beta=0.0,
            num_iterations=1,
            loss_type="grpo",
            scale_rewards="group",
            disable_dropout=True,
            use_vllm=work.vllm,
            vllm_mode="colocate",
            vllm_enable_sleep_mode=work.sleep_mode,
            vllm_gpu_memory_utilization=work.gpu_memory_utilization,
        )
        trainer = GRPOTrainer(
            model=policy,
            reward_funcs=[correctness],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimes()],
        )
    else:
        from trl import DPOConfig, DPOTrainer

        rows = addition_preference_rows("train")
        dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
        config = DPOConfig(**common, per_device_train_batch_size=work.pairs, beta=0.1, loss_type="sigmoid")
        ref = load_causal_lm(model, disable_dropout=True)
        trainer = DPOTrainer(
            model=policy,
            ref_model=ref,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[StepTimes()],
        )
    trainer.train()
    return [b - a for a, b in zip(marks, marks[1:])]


# -- the comparison ----------------------------------------------------------------------------------------------
def run_child(
    library: str, algorithm: str, model: str, steps: int, workdir: Path, work: Workload = Workload()
) -> list[float]:
    """One run in a process of its own: the per-step wall times of `library` on the workload."""
    out = workdir / "times.json"
    command = [sys.executable, __file__, "--child", library, algorithm, model, str(steps), str(out)]
    command.append(json.dumps(asdict(work)))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{library} {algorithm} on {model} failed:\n{result.stderr[-3000:]}")
    return json.loads(out.read_text())


def compare(algorithm: str, model_name: str, model: str, args, tmp: Path) -> dict:
    per_round: dict[str, list[float]] = {"lit_rl": [], "trl": []}
    for round_index in range(args.rounds):
        for library in ("lit_rl", "trl"):
            workdir = tmp / f"{algorithm}-{model_name}-{library}-{round_index}"
            workdir.mkdir()
            times = run_child(library, algorithm, model, args.steps, workdir)
            if len(times) <= args.warmup:
                raise RuntimeError(f"{library}: {len(times)} step times, not more than --warmup {args.warmup}")
            per_round[library].append(statistics.median(times[args.warmup :]))
            print(f"  {algorithm} {model_name} {library} round {round_index}: {per_round[library][-1]:.3f} s/step")
    lit, trl = (statistics.median(per_round[name]) for name in ("lit_rl", "trl"))
    return {
        "algorithm": algorithm,
        "model": model_name,
        "lit_rl_s_per_step": lit,
        "trl_s_per_step": trl,
        "ratio": lit / trl,
        "rounds": per_round,
    }


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = ["| algorithm | model | lit-rl s/step | TRL s/step | ratio |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r['algorithm']} | {r['model']} | {r['lit_rl_s_per_step']:.3f} | {r['trl_s_per_step']:.3f} "
            f"| {r['ratio']:.2f} |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them): the range of the ratios,
    the tiny model's GRPO step, and how far single rounds of one configuration and library spread."""
    ratios = [r["ratio"] for r in results]
    spread = max(max(t) / min(t) - 1 for r in results for t in r["rounds"].values())
    tiny = next(r for r in results if (r["algorithm"], r["model"]) == ("grpo", "tiny"))
    return [
        f"Ratio = lit-rl / TRL, {min(ratios):.2f} to {max(ratios):.2f}",
        f"Single rounds of the same configuration differ by up to {100 * spread:.0f}%",
        f"The tiny model's GRPO step ({1000 * tiny['lit_rl_s_per_step']:.0f} ms)",
        f"the TRL speed ratio ({min(ratios):.2f}-{max(ratios):.2f} today, 0.67 asked)",
    ]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        library, algorithm, model, steps, out, work = sys.argv[2:8]
        run = lit_run if library == "lit_rl" else trl_run
        times = run(algorithm, model, int(steps), Path(out).parent, Workload(**json.loads(work)))
        Path(out).write_text(json.dumps(times))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", choices=["grpo", "dpo"], default=["grpo", "dpo"])
    parser.add_argument("--models", nargs="+", choices=["tiny", "20m"], default=["tiny", "20m"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny model, 6 steps, 1 round")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None, help="print the markdown table of a results JSON")
    add_allow_dirty(parser)
    args = parser.parse_args()
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())["results"]))
        return
    check_output(args.out, args.allow_dirty)
    if args.quick:
        args.models, args.steps, args.warmup, args.rounds = ["tiny"], 6, 2, 1
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-vs-trl-") as tmp:
        models = {"tiny": resolve_model_path(TINY)}
        if "20m" in args.models:
            sizes = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024)
            models["20m"] = str(build_random_model(Path(tmp) / "model-20m", **sizes))
        for model_name in args.models:
            for algorithm in args.algorithms:
                results.append(compare(algorithm, model_name, models[model_name], args, Path(tmp)))
    print(markdown_table(results))
    if args.out:
        import trl

        write_report(args.out, results, versions={"trl": trl.__version__}, allow_dirty=args.allow_dirty)


if __name__ == "__main__":
    main()
