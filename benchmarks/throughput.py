"""Throughput of an algorithm config across rollout engines, strategies and device counts, from real runs.

    python benchmarks/throughput.py --config configs/grpo.yaml --engines hf vllm_colocate vllm_server \\
        --strategies single ddp --devices 1 2 --steps 30 --warmup 5 --out benchmarks/results/throughput_cpu.json
    python benchmarks/throughput.py --quick          # the tiny model, hf + colocated vLLM, a few steps
    python benchmarks/throughput.py --markdown benchmarks/results/throughput_cpu.json   # the README's table
    python benchmarks/throughput.py --engines vllm_server --max-staleness 0 1 --pin-cores --rounds 2 \
        --out benchmarks/results/async_cpu.json        # asynchronous rollouts: k = 1 against k = 0

Each configuration is one `lit-rl fit` process. The `vllm_server` engine's server is launched by lit-rl
(`--model.rollout.engine.launch true`, as the docs' command runs it: lit-rl splits the cores between the server and
the trainer), or with `--pin-cores` started by this script on core 0 beside a trainer on core 1. Its `perf/`
metrics, logged every optimizer step by the trainer itself, are averaged over the steps after `--warmup`: seconds
per step and its split into generation, reward, reference and old log-probs, weight push and policy update;
generated and trained tokens/s; peak memory per rank (RSS on CPU, CUDA max allocated on GPU). Samples/s =
completions per optimizer step (micro_batch_size x accumulation x ranks) / seconds per step. Output: a rich table, a
JSON file (machine, versions, commit, the exact command) and a PNG of the time split. The same script runs unchanged
on a GPU machine (`--accelerator gpu`).

`--max-staleness 0 1 2` adds the asynchronous-rollout axis (`model.rollout.max_staleness`; k > 0 needs the `vllm_server`
engine): each k > 0 row also reports its samples/s over the k = 0 row of the same engine, strategy and devices.
`--pin-cores` gives the server CPU core 0 and the trainer core 1 (one thread each side), so generation and
training do not share a core and what asynchrony overlaps shows; `--rounds N` repeats every configuration N times,
interleaved, and reports the round of the lower median step time (of two rounds, the faster).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import add_allow_dirty, check_output, write_report  # noqa: E402

from lit_rl.modeling.models import resolve_model_path  # noqa: E402
from lit_rl.rollout.server.client import LocalVLLMServer  # noqa: E402

CONFIGS = REPO / "configs"
PARTS = ["generation", "reward", "ref_logprobs", "old_logprobs", "weight_push", "policy_update"]
STRATEGIES = {
    "single": None,
    "ddp": CONFIGS / "strategy" / "ddp.yaml",
    "fsdp": CONFIGS / "strategy" / "fsdp.yaml",
    "deepspeed_zero2": CONFIGS / "strategy" / "deepspeed_zero2.yaml",
    "deepspeed_zero3": CONFIGS / "strategy" / "deepspeed_zero3.yaml",
}
ENGINES = {  # each engine's `lit-rl fit` flags
    "hf": [],
    # ZeRO-3 decoding through its partitions (every forward gathers layer by layer), against the default's whole
    # weights gathered once per generation; the same as `hf` under any other strategy.
    "hf_partitioned": ["--model.rollout.engine", "HFGenerate", "--model.rollout.engine.gather_weights", "false"],
    "hf_compiled": ["--config", str(CONFIGS / "rollout" / "hf_compiled.yaml")],
    "vllm_colocate": ["--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml")],
    "vllm_server": ["--config", str(CONFIGS / "rollout" / "vllm_server.yaml")],
}


def policy_of(config_path: Path, overrides: list[str]) -> str:
    model = yaml.safe_load(config_path.read_text())["model"]["init_args"].get("policy", {}).get("model_name_or_path")
    for flag, value in zip(overrides, overrides[1:]):
        if flag == "--model.policy.model_name_or_path":
            model = value
    return model


def fit_flags(steps: int, workdir: Path, name: Optional[str] = None, checkpoints: bool = False) -> list[str]:
    """The `lit-rl fit` flags every benchmark run shares: `steps` optimizer steps, no sanity validation, no progress
    bar, metrics.csv under `workdir` (in `name/` when given); unless `checkpoints`, no checkpointing and none of the
    config's callbacks. Each script adds how it keeps validation out of the measured steps."""
    flags = ["--trainer.max_steps", str(steps), "--trainer.num_sanity_val_steps", "0"]
    if not checkpoints:
        flags += ["--trainer.enable_checkpointing", "false", "--trainer.callbacks", "null"]
    flags += ["--trainer.enable_progress_bar", "false", "--trainer.logger.init_args.save_dir", str(workdir)]
    return flags + (["--trainer.logger.init_args.name", name] if name else [])


def engine_label(r: dict) -> str:
    return r["engine"] + (f" k={r['max_staleness']}" if r.get("max_staleness") else "")


@contextmanager
def pinned(cores: Optional[set[int]], env: dict[str, str]):
    """This process (and so what it starts) on `cores`, with `env` set; both restored afterwards."""
    if cores is None:
        yield
        return
    affinity, saved = os.sched_getaffinity(0), {key: os.environ.get(key) for key in env}
    os.sched_setaffinity(0, cores)
    os.environ.update(env)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_one(args, engine: str, strategy: str, devices: int, workdir: Path, staleness: int = 0, round_: int = 0) -> dict:
    name = (
        f"{engine}-{strategy}-{devices}" + (f"-k{staleness}" if staleness else "") + (f"-r{round_}" if round_ else "")
    )
    command = [
        sys.executable,
        "-m",
        "lit_rl.cli",
        "fit",
        "--config",
        str(args.config),
        *(["--config", str(STRATEGIES[strategy])] if STRATEGIES[strategy] else []),
        *ENGINES[engine],
        "--trainer.accelerator",
        args.accelerator,
        "--trainer.devices",
        str(devices),
        "--trainer.val_check_interval",
        "1000000",
        *fit_flags(args.steps, workdir, name),
        *(["--model.rollout.max_staleness", str(staleness)] if staleness else []),
        *args.overrides,
    ]
    server: Optional[LocalVLLMServer] = None
    if engine == "vllm_server" and not args.pin_cores:
        # As the docs' command runs it: lit-rl launches the server, on its share of the cores (`launch.py`).
        command += ["--model.rollout.engine.launch", "true"]
    elif engine == "vllm_server":  # placed by this script: server on core 0, trainer on core 1
        model = resolve_model_path(policy_of(args.config, args.overrides))
        log = str(workdir / f"{name}-server.log")
        with pinned({0} if args.pin_cores else None, {"VLLM_CPU_OMP_THREADS_BIND": "0"}):
            server = LocalVLLMServer(model, log, cpu=args.accelerator == "cpu")
        command += ["--model.rollout.engine.server_url", server.url]
    started = time.monotonic()
    try:
        with pinned({1} if args.pin_cores else None, {"OMP_NUM_THREADS": "1"}):
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    finally:
        if server is not None:
            server.stop()
    wall = time.monotonic() - started
    row = {"engine": engine, "strategy": strategy, "devices": devices}
    if staleness:
        row["max_staleness"] = staleness
    if result.returncode != 0:
        return row | {"error": result.stderr.strip()[-600:]}
    log_dir = max((workdir / name).glob("version_*"))
    return summarise(log_dir, args.warmup) | row | {"wall_s": wall}


def metric_rows(log_dir: Path) -> list[dict[str, float]]:
    """The rows of a run's metrics.csv, as floats, empty cells left out."""
    with open(log_dir / "metrics.csv") as handle:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(handle)]


def summarise(log_dir: Path, warmup: int) -> dict:
    rows = metric_rows(log_dir)
    steps = [r for r in rows if "perf/step_s" in r and r["step"] > warmup]
    if not steps:
        raise RuntimeError(f"{log_dir}: no step after the {warmup} warm-up steps; raise --steps")
    config = yaml.safe_load((log_dir / "config.yaml").read_text())
    trainer, model = config["trainer"], config["model"]["init_args"]
    devices = trainer["devices"] if isinstance(trainer["devices"], int) else 1
    samples_per_step = model["schedule"]["micro_batch_size"] * (trainer.get("accumulate_grad_batches") or 1) * devices

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in steps)

    step_s = mean("perf/step_s")
    return {
        "steps_measured": len(steps),
        "step_s": step_s,
        "samples_per_s": samples_per_step / step_s,
        "generated_tokens_per_s": mean("perf/generated_tokens_per_s"),
        "trained_tokens_per_s": mean("perf/trained_tokens_per_s"),
        "peak_memory_mib_per_rank": max(r.get("perf/peak_memory_mib", 0.0) for r in steps),
        "split_s": {part: mean(f"perf/{part}_s") for part in PARTS},
        "rollout_logprob_diff_max": max(r.get("train/rollout_logprob_diff/max", 0.0) for r in steps),
        "rollout_kl_mean": mean("train/rollout_kl"),
    } | _utilisation(steps)


def _utilisation(steps: list[dict[str, float]]) -> dict:
    """The run's mean `perf/tflops`, `perf/mfu` and `perf/update_mfu` after warm-up, where it logged them (`perf/mfu`
    needs a known peak: a GPU in `lit_rl.training.flops.GPU_PEAKS` or the CPU's measured one)."""
    keys = {"tflops": "perf/tflops", "mfu": "perf/mfu", "update_mfu": "perf/update_mfu"}
    return {name: statistics.fmean(r[key] for r in steps) for name, key in keys.items() if all(key in r for r in steps)}


def print_table(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="seconds per optimizer step and where they go (means after warm-up)")
    for column in ["engine", "strategy", "dev", "s/step", "samples/s", "gen tok/s", *PARTS, "peak MiB/rank"]:
        table.add_column(column, justify="left" if column in ("engine", "strategy") else "right")
    for r in results:
        if "error" in r:
            table.add_row(engine_label(r), r["strategy"], str(r["devices"]), "error: " + r["error"][-60:])
            continue
        table.add_row(
            engine_label(r),
            r["strategy"],
            str(r["devices"]),
            f"{r['step_s']:.3f}",
            f"{r['samples_per_s']:.0f}",
            f"{r['generated_tokens_per_s']:.0f}",
            *[f"{r['split_s'][part]:.3f}" for part in PARTS],
            f"{r['peak_memory_mib_per_rank']:.0f}",
        )
    Console(width=200).print(table)


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| engine | strategy x devices | s/step | samples/s | generation | weight push | policy update | push share "
        "| max logprob diff | peak memory/rank |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            continue
        split = r["split_s"]
        lines.append(
            f"| {engine_label(r)} | {r['strategy']} x {r['devices']} | {r['step_s']:.3f} | {r['samples_per_s']:.0f} "
            f"| {split['generation']:.3f} | {split['weight_push']:.3f} | {split['policy_update']:.3f} "
            f"| {100 * split['weight_push'] / r['step_s']:.1f}% | {r['rollout_logprob_diff_max']:.1e} "
            f"| {r['peak_memory_mib_per_rank']:.0f} MiB |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The README's prose numbers of a results file (a test checks the README says them): the colocated engine's
    push share of the step, against the issue's 5% target."""
    out = []
    for r in results:
        if r.get("engine") == "vllm_colocate" and "error" not in r:
            share = 100 * r["split_s"]["weight_push"] / r["step_s"]
            side = "above" if share > 5 else "within"
            out.append(f"The colocated push is {share:.1f}% of the step here, {side} the issue's 5% target.")
            out.append(f"the colocated weight push under 5% of a step ({share:.1f}% on CPU)")
    return out + staleness_claims(results)


def staleness_speedups(results: list[dict]) -> list[tuple[dict, float]]:
    """Each k > 0 row with its samples/s over the k = 0 row of the same engine, strategy and devices."""
    key = lambda r: (r["engine"], r["strategy"], r["devices"])  # noqa: E731
    sync = {key(r): r for r in results if not r.get("max_staleness") and "error" not in r}
    return [
        (r, r["samples_per_s"] / sync[key(r)]["samples_per_s"])
        for r in results
        if r.get("max_staleness") and "error" not in r and key(r) in sync
    ]


def staleness_claims(results: list[dict]) -> list[str]:
    """The README's prose of an asynchronous-rollout results file, against the issue's 1.3x target."""
    return [
        f"{engine_label(r)}: {ratio:.2f}x the samples/s of k=0 "
        f"({'meets' if ratio >= 1.3 else 'misses'} the 1.3x target)"
        for r, ratio in staleness_speedups(results)
    ]


def median_of_rounds(results: list[dict]) -> list[dict]:
    """One row per configuration: the round with the lower median step time (of two rounds, the faster; all
    rounds when they failed)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["engine"], r["strategy"], r["devices"], r.get("max_staleness", 0)), []).append(r)
    out = []
    for rows in groups.values():
        ok = sorted((r for r in rows if "error" not in r), key=lambda r: r["step_s"])
        if not ok:
            out.extend(rows)
            continue
        median = ok[(len(ok) - 1) // 2]
        out.append(median | {"rounds_step_s": [r["step_s"] for r in rows if "error" not in r]})
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    labels = [f"{engine_label(r)}\n{r['strategy']} x{r['devices']}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(ok)), 4))
    bottom = [0.0] * len(ok)
    for part in PARTS:
        values = [r["split_s"][part] for r in ok]
        ax.bar(labels, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title("Where a step's time goes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIGS / "grpo.yaml")
    parser.add_argument(
        "--engines", nargs="+", choices=list(ENGINES), help="default: hf (with --quick: hf and vllm_colocate)"
    )
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=["single"])
    parser.add_argument("--devices", nargs="+", type=int, default=[1])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the means (engine start-up)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 steps (hf + colocated vLLM by default)")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[0], help="model.rollout.max_staleness values")
    parser.add_argument("--pin-cores", action="store_true", help="server on CPU core 0, trainer on core 1")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repetitions, interleaved (lower median: of 2, the faster)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results (the PNG goes beside it)")
    parser.add_argument("--markdown", type=Path, default=None, help="print the markdown table of a results JSON")
    add_allow_dirty(parser)
    parser.add_argument("overrides", nargs="*", help="extra `lit-rl fit` flags, after `--`")
    args = parser.parse_args()
    if args.markdown:
        print(markdown_table(json.loads(args.markdown.read_text())["results"]))
        return
    check_output(args.out, args.allow_dirty)
    if args.quick:
        args.engines = args.engines or ["hf", "vllm_colocate"]
        args.steps, args.warmup = 8, 3
        args.overrides = [
            "--model.sampling.num_generations",
            "8",
            "--model.schedule.micro_batch_size",
            "32",
            *args.overrides,
        ]
    args.engines = args.engines or ["hf"]
    invalid = [(s, d) for s in args.strategies for d in args.devices if s == "single" and d != 1]
    if invalid:
        parser.error("strategy 'single' runs on 1 device; use ddp/fsdp/deepspeed_* for more")
    if any(args.max_staleness) and args.engines != ["vllm_server"]:
        parser.error("--max-staleness above 0 needs --engines vllm_server (the engine that samples beside training)")
    if args.pin_cores and (len(os.sched_getaffinity(0)) < 2 or args.devices != [1]):
        parser.error("--pin-cores needs two CPU cores and --devices 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="lit-rl-throughput-") as tmp:
        for round_ in range(args.rounds):
            for strategy in args.strategies:
                for devices in args.devices:
                    for engine in args.engines:
                        for k in args.max_staleness:
                            print(f"running {engine} / {strategy} / {devices} device(s) / k={k} ...", flush=True)
                            results.append(run_one(args, engine, strategy, devices, Path(tmp), k, round_))
    if args.rounds > 1:
        results = median_of_rounds(results)
    print_table(results)
    for line in staleness_claims(results):
        print(line)
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty)
        plot(results, args.out.with_suffix(".png"))
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
