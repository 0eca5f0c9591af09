"""Multi-turn episodes against a slow environment: where a GRPO step's time goes, lock-step against concurrent,
synchronous against asynchronous.

    python benchmarks/agentic.py --out benchmarks/results/agentic_cpu.json   # 6 steps a run, 2 interleaved rounds
    python benchmarks/agentic.py --quick --out /tmp/agentic.json              # a quick look: 2 steps, 1 round
    python benchmarks/agentic.py --markdown benchmarks/results/agentic_cpu.json

The workload is `configs/grpo_tools.yaml` (64 episodes a step: 8 prompts x 8 completions, the tools warm start)
with the environment `LongTail` below instead of the calculator: episode e of the run lasts `TURNS[e % 16]` model
turns (most 1-2, a few 3, 4 and 6: 2.06 on average), and each `step` sleeps `latency_s` before it answers, as a
sandbox or a remote tool does. Each run is `lit-rl fit` in its own process, one per mode (`MODES`):

- `lock-step, one call at a time` (HF generate, `--model.env.concurrency 1`): every environment step of a turn runs
  after the previous one, as lit-rl did before 0.3 (on the training thread then; here on the runner's, one at a
  time);
- `concurrent steps` (HF generate, `concurrency 64`, the default): a turn's steps run together, off the training
  thread;
- `synchronous` and `asynchronous k=1` on a vLLM server the run starts (`--model.rollout.engine.launch true`, CPU
  vLLM on half the cores, the trainer on the other half): each episode goes on on its own after its first turn
  (`model.env.independent_turns`, the default), its next turn sent to the server as soon as its observation is
  back; `synchronous, turn by turn` is the same with `--model.env.independent_turns false` (every running
  episode's turn t in one batch, as before 0.3). With `--model.rollout.max_staleness 1` the next generation's
  episodes run on the server while the trainer updates; `cores shared` is the same with the cores not split
  (`VLLM_CPU_OMP_THREADS_BIND=nobind`, as before lit-rl split them); `in flight k=1` adds
  `--model.rollout.in_flight_updates true`: the generations' episodes run side by side, the server taking each newer
  version between turns (`lit_rl.rollout.in_flight`).

The HF rows with `latency_s` 0.1 and 0 (the same episodes answered at once), the server's with 0.1. Reported per
row: seconds per optimizer step (`perf/step_s`, the median of the steps after the first), the share of it the
trainer waits for its episodes (`perf/generation_s`: synchronous, the engine's turns and the environment's steps;
asynchronous, only what the update did not hide), completions per second, for the server's rows the share of the
step with no request outstanding on the server (`perf/engine_idle_share`), and for asynchronous rows the share of
the trained samples 0 and 1 step stale (`train/staleness/share_<s>`) and the mean staleness of the trained rows and
of the model's tokens (`train/staleness/mean`, `token_mean`: in flight, later turns may be sampled by newer weights
than an episode's first). Rows run interleaved, round by round,
so that a noisy machine affects them alike; each round's values are kept.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parents[1]
TURNS = (1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 6)  # model turns of episode e: TURNS[e % 16]
EPISODES_PER_STEP = 64
SERVER = [
    "--config",
    str(REPO / "configs" / "rollout" / "vllm_server.yaml"),
    "--model.rollout.engine.launch",
    "true",
]
ASYNC = [*SERVER, "--model.rollout.max_staleness", "1"]
# A placement of the user's own turns lit-rl's core split off (`lit_rl.rollout.server.launch.core_split`): vLLM's
# `nobind` keeps the server's threads unbound, as before the split.
SHARED_CORES = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
MODES = {  # mode: (engine, the `lit-rl fit` options that make it, environment variables, latencies it runs at)
    "lock-step, one call at a time": ("HF generate", ["--model.env.concurrency", "1"], {}, None),
    "concurrent steps": ("HF generate", ["--model.env.concurrency", "64"], {}, None),
    "synchronous, turn by turn": ("vLLM server", [*SERVER, "--model.env.independent_turns", "false"], {}, (0.1,)),
    "synchronous": ("vLLM server", SERVER, {}, (0.1,)),
    "asynchronous k=1": ("vLLM server", ASYNC, {}, (0.1,)),
    "asynchronous k=1, cores shared": ("vLLM server", ASYNC, SHARED_CORES, (0.1,)),
    "in flight k=1": ("vLLM server", [*ASYNC, "--model.rollout.in_flight_updates", "true"], {}, (0.1,)),
}


class LongTail:
    """An episode of `TURNS[e % 16]` model turns (e counts the episodes this process made), each answered after
    `latency_s` with the observation `n;` (n: turns left, characters the tiny model knows). With `slow_share`, a
    step answers after `slow_s` instead, as a slow tool call does: step t of episode e is slow when a generator
    seeded by (e, t) draws under `slow_share` (the same steps in every run)."""

    reward_names: tuple[str, ...] = ()
    _episodes = itertools.count()

    def __init__(self, latency_s: float = 0.1, slow_share: float = 0.0, slow_s: float = 1.0) -> None:
        self.latency_s, self.slow_share, self.slow_s = latency_s, slow_share, slow_s
        self.episode = next(LongTail._episodes)
        self.turns = TURNS[self.episode % len(TURNS)]
        self.done_turns = 0

    def reset(self, row: dict[str, Any]) -> None:
        return None

    def step(self, completion: str) -> tuple[Optional[str], dict[str, float], bool]:
        slow = random.Random(self.episode * 1009 + self.done_turns).random() < self.slow_share
        time.sleep(self.slow_s if slow else self.latency_s)
        self.done_turns += 1
        left = self.turns - self.done_turns
        return (None, {}, True) if left <= 0 else (f"{left};", {}, False)


def fit_command(options: list[str], environment_args: str, steps: int, workdir: Path, name: str) -> list[str]:
    """`lit-rl fit` of the tools config with `LongTail` (no calculator, built with `environment_args`) and
    `options`, no validation, `steps` steps."""
    return [
        sys.executable,
        "-m",
        "lit_rl.cli",
        "fit",
        "--config",
        str(REPO / "configs" / "grpo_tools.yaml"),
        "--model.env.tools",
        "null",
        "--model.env.environment",
        "agentic.LongTail",
        "--model.env.environment_args",
        environment_args,
        "--model.env.max_turns",
        str(max(TURNS)),
        "--model.sampling.max_new_tokens",
        "8",
        "--model.env.max_total_tokens",
        "80",
        *options,
        "--trainer.max_steps",
        str(steps),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(workdir / "runs"),
        "--trainer.logger.init_args.name",
        name,
    ]


def after_first_step(rows: list[dict[str, str]], key: str) -> list[float]:
    """The values of `key` in a CSVLogger file's rows, one per step that logged it, in order, the first step's
    (start-up) left out."""
    return [float(row[key]) for row in rows if row.get(key)][1:]


def one_run(mode: str, latency_s: float, steps: int, workdir: Path) -> dict:
    """One `lit-rl fit` of `mode` at `latency_s`: its per-step times, the first step (start-up) left out."""
    _, options, variables, _ = MODES[mode]
    return fit_and_read(
        f"the {mode} run at {latency_s} s", options, f"{{latency_s: {latency_s}}}", variables, steps, workdir
    )


def fit_and_read(
    what: str, options: list[str], environment_args: str, variables: dict[str, str], steps: int, workdir: Path
) -> dict:
    """One `lit-rl fit` (`fit_command`) with the environment `variables`; its numbers (`run_metrics`)."""
    name = f"run_{len(list(workdir.glob('runs/*')))}"
    command = fit_command(options, environment_args, steps, workdir, name)
    # The environment class is imported from benchmarks/ (`agentic.LongTail`), lit_rl from this checkout.
    env = {**os.environ, **variables, "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])}
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {what} failed:\n{result.stderr[-3000:]}")
    return run_metrics(next((workdir / "runs" / name).glob("version_*/metrics.csv")))


def run_metrics(metrics: Path) -> dict:
    """A run's numbers from its CSVLogger file, each over the steps after the first (start-up): the median step and
    generation seconds, and where logged the mean staleness (of rows, of tokens), the server's idle share and the
    staleness histogram (`staleness_shares[s]`: the share of samples s steps stale)."""
    with open(metrics) as handle:
        rows = list(csv.DictReader(handle))  # read once: every value below comes from these rows
    step_s, generation_s = after_first_step(rows, "perf/step_s"), after_first_step(rows, "perf/generation_s")
    run = {"step_s": statistics.median(step_s), "generation_s": statistics.median(generation_s)}
    for key in ("staleness/mean", "staleness/token_mean"):  # asynchronous rows; token_mean in flight only
        values = after_first_step(rows, f"train/{key}")
        if values:
            run[key.replace("/", "_")] = statistics.mean(values)
    idle = after_first_step(rows, "perf/engine_idle_share")  # the server engine's rows: it counts its requests
    if idle:
        run["engine_idle_share"] = statistics.mean(idle)
    shares = []  # the staleness histogram, asynchronous rows: the share of samples s steps stale, s = 0, 1, ...
    while values := after_first_step(rows, f"train/staleness/share_{len(shares)}"):
        shares.append(statistics.mean(values))
    if shares:
        run["staleness_shares"] = shares
    return run


def summarise(mode: str, latency_s: float, rounds: list[dict]) -> dict:
    step_s = statistics.median(r["step_s"] for r in rounds)
    generation_s = statistics.median(r["generation_s"] for r in rounds)
    staleness = {  # over the rounds' means of the steps after the first
        key: statistics.mean(r[key] for r in rounds)
        for key in ("staleness_mean", "staleness_token_mean", "engine_idle_share")
        if key in rounds[0]
    }
    if "staleness_shares" in rounds[0]:
        by_lag = zip(*(r["staleness_shares"] for r in rounds))
        staleness["staleness_shares"] = [statistics.mean(shares) for shares in by_lag]
    return {
        "mode": mode,
        "engine": MODES[mode][0],
        "options": MODES[mode][1],
        "environment": MODES[mode][2],
        "latency_s": latency_s,
        "step_s": step_s,
        "generation_s": generation_s,
        "rollout_share": generation_s / step_s,
        "samples_per_s": EPISODES_PER_STEP / step_s,
        **staleness,
        "rounds": rounds,
    }


def markdown_table(results: list[dict]) -> str:
    """The docs' table of a results file (a test checks the docs carry exactly this)."""
    lines = [
        "| environment step | engine | episodes | s/step | trainer waits for episodes | server idle | samples by "
        "staleness (0 / 1 / ... steps) | completions/s | vs lock-step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lock_step = {r["latency_s"]: r["step_s"] for r in results if r["mode"] == "lock-step, one call at a time"}
    for r in results:
        speedup = lock_step[r["latency_s"]] / r["step_s"]
        idle = f"{100 * r['engine_idle_share']:.0f}%" if "engine_idle_share" in r else ""
        stale = " / ".join(f"{100 * share:.0f}%" for share in r.get("staleness_shares", []))
        lines.append(
            f"| {1000 * r['latency_s']:.0f} ms | {r['engine']} | {r['mode']} | {r['step_s']:.2f} | "
            f"{100 * r['rollout_share']:.0f}% | {idle} | {stale} | {r['samples_per_s']:.1f} | {speedup:.1f}x |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The prose numbers the docs quote: concurrent against lock-step, independent episodes against turn by turn,
    asynchronous against synchronous, split cores against shared ones, and in flight against asynchronous."""
    by = {(r["mode"], r["latency_s"]): r for r in results}
    out = []
    pairs = (
        ("lock-step, one call at a time", "concurrent steps"),
        ("synchronous, turn by turn", "synchronous"),
        ("synchronous", "asynchronous k=1"),
        ("asynchronous k=1, cores shared", "asynchronous k=1"),
        ("asynchronous k=1", "in flight k=1"),
    )
    for before, after in pairs:
        for latency in sorted({latency for _, latency in by if latency > 0}, reverse=True):
            if (before, latency) in by and (after, latency) in by:
                slow, fast = by[(before, latency)]["step_s"], by[(after, latency)]["step_s"]
                out.append(f"{slow:.2f} s -> {fast:.2f} s a step ({slow / fast:.1f}x)")
    return out


def main() -> None:
    from provenance import parse_report_args, write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps a run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latencies", type=float, nargs="+", default=[0.1, 0.0])
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round, 50 ms only")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.steps, args.rounds, args.latencies = 2, 1, [0.05]
    rounds: dict[tuple[str, float], list[dict]] = {
        (m, lat): [] for lat in args.latencies for m in MODES if MODES[m][3] is None or lat in MODES[m][3] or args.quick
    }
    with tempfile.TemporaryDirectory(prefix="lit_rl_agentic_") as workdir:
        for round_index in range(args.rounds):
            for (mode, latency), runs in rounds.items():
                runs.append(one_run(mode, latency, args.steps, Path(workdir)))
                print(f"round {round_index + 1}: {mode} at {latency} s: {runs[-1]}", flush=True)
    results = [summarise(mode, latency, runs) for (mode, latency), runs in rounds.items()]
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty, steps=args.steps, episode_turns=list(TURNS))
    print(markdown_table(results))
    print("\n".join(claims(results)))


if __name__ == "__main__":
    main()
