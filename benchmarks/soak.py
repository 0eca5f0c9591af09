"""Soak test: does a long GRPO run leak memory, file descriptors or threads?

    python benchmarks/soak.py --out benchmarks/results/soak_cpu.json          # 3000 steps, HF then colocated vLLM
    python benchmarks/soak.py --steps 60 --every 20 --warmup 20 --engines hf  # a quick look
    python benchmarks/soak.py --markdown benchmarks/results/soak_cpu.json     # the README's table

Each engine runs the demo config (`lit-rl fit --config configs/grpo.yaml`, with
`--config configs/rollout/vllm_colocate.yaml` for vLLM) for `--steps` optimizer steps in its own process, with its
validation every 50 steps and a checkpoint every 100, as the demo does. A callback in that process samples, every
`--every` steps, after a `gc.collect()`: the resident set size (RSS, /proc/self/statm), the open file descriptors
(/proc/self/fd) and the operating-system threads (/proc/self/status). Start-up allocates caches, pools and
threads that stay, so growth is counted from the sample at `--warmup` steps to the largest sample after it:

    RSS growth     = (max RSS after warm-up - RSS at warm-up) / RSS at warm-up    must be <= 5%
    fds, threads   =  max after warm-up - value at warm-up                         must be <= 0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import parse_report_args, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
RSS_GROWTH_LIMIT = 0.05
ENGINES = {"hf": [], "vllm_colocate": ["--config", str(REPO / "configs" / "rollout" / "vllm_colocate.yaml")]}


def process_resources() -> dict:
    """This process's resident memory (MiB), open file descriptors and operating-system threads, now."""
    with open("/proc/self/statm") as handle:
        rss_pages = int(handle.read().split()[1])
    with open("/proc/self/status") as handle:
        threads = next(int(line.split()[1]) for line in handle if line.startswith("Threads:"))
    return {
        "rss_mib": rss_pages * os.sysconf("SC_PAGE_SIZE") / MIB,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threads,
    }


class ResourceSampler(L.Callback):
    """Appends `{"step": N, "time_s": ..., **process_resources()}` to `out` (JSON lines) at the start of training
    and every `every_n_steps` optimizer steps."""

    def __init__(self, out: str, every_n_steps: int = 100) -> None:
        self.out, self.every_n_steps = Path(out), every_n_steps
        self.start = time.perf_counter()
        self.last_step = -1

    def sample(self, step: int) -> None:
        gc.collect()
        record = {"step": step, "time_s": time.perf_counter() - self.start, **process_resources()}
        with open(self.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.last_step = step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.sample(trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0 and step != self.last_step:
            self.sample(step)


def growth(samples: list[dict], warmup: int) -> dict:
    """Growth from the sample at `warmup` steps (the first at or after it) to the largest sample after it."""
    base_index = next(i for i, s in enumerate(samples) if s["step"] >= warmup)
    base, after = samples[base_index], samples[base_index + 1 :]
    if not after:
        raise ValueError(f"no sample after the warm-up ({warmup} steps): run longer or sample more often")
    rss_growth = (max(s["rss_mib"] for s in after) - base["rss_mib"]) / base["rss_mib"]
    fds_growth = max(s["fds"] for s in after) - base["fds"]
    threads_growth = max(s["threads"] for s in after) - base["threads"]
    return {
        "warmup_step": base["step"],
        "rss_mib_at_warmup": base["rss_mib"],
        "rss_mib_end": samples[-1]["rss_mib"],
        "rss_growth": rss_growth,
        "fds_at_warmup": base["fds"],
        "fds_growth": fds_growth,
        "threads_at_warmup": base["threads"],
        "threads_growth": threads_growth,
        "within_bounds": rss_growth <= RSS_GROWTH_LIMIT and fds_growth <= 0 and threads_growth <= 0,
    }


def soak(engine: str, steps: int, every: int, warmup: int, workdir: Path, overrides: list[str]) -> dict:
    """One engine's run in its own process; its samples and their growth."""
    samples_path = workdir / f"{engine}.jsonl"
    command = [
        sys.executable,
        "-m",
        "lit_rl.cli",
        "fit",
        "--config",
        str(REPO / "configs" / "grpo.yaml"),
        *ENGINES[engine],
        "--trainer.max_steps",
        str(steps),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(workdir / "runs"),
        "--trainer.logger.init_args.name",
        engine,
        "--trainer.callbacks+",
        "soak.ResourceSampler",
        "--trainer.callbacks.out",
        str(samples_path),
        "--trainer.callbacks.every_n_steps",
        str(every),
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])}
    start = time.perf_counter()
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"soak.py: the {engine} run failed:\n{result.stderr[-3000:]}")
    samples = [json.loads(line) for line in samples_path.read_text().splitlines()]
    return {"engine": engine, "steps": steps, "wall_s": wall, **growth(samples, warmup), "samples": samples}


def markdown_table(results: list[dict]) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| engine | steps | RSS at warm-up -> end, MiB | RSS growth (<= 5%) | fds growth | threads growth | "
        "within bounds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['engine']} | {r['steps']} | {r['rss_mib_at_warmup']:.0f} -> "
            f"{r['rss_mib_end']:.0f} | {100 * r['rss_growth']:.1f}% | {r['fds_growth']:+d} | "
            f"{r['threads_growth']:+d} | {'yes' if r['within_bounds'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--every", type=int, default=100, help="sample every N optimizer steps")
    parser.add_argument("--warmup", type=int, default=500, help="growth is counted from this step on")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=["hf", "vllm_colocate"])
    parser.add_argument("overrides", nargs="*", help="extra `lit-rl fit` options, after `--`")
    args = parse_report_args(parser, markdown_table)
    results = []
    with tempfile.TemporaryDirectory(prefix="lit_rl_soak_") as workdir:
        for engine in args.engines:
            results.append(soak(engine, args.steps, args.every, args.warmup, Path(workdir), args.overrides))
            print(markdown_table(results[-1:]), flush=True)
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty, rss_growth_limit=RSS_GROWTH_LIMIT)
    print(markdown_table(results))
    if not all(r["within_bounds"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
