"""Multi-turn episodes on an engine in the trainer's process, when a few environment steps are slow: turn by turn
against turns sampled in batches of the episodes that are ready (`model.env.ready_batches`) on HF `generate`, and
against those and independent episodes (`model.env.independent_turns`, the default) on the colocated vLLM engine.

    python benchmarks/ready_batches.py --out benchmarks/results/ready_batches_cpu.json   # 6 steps, 2 rounds
    python benchmarks/ready_batches.py --engine colocate --out benchmarks/results/colocated_episodes_cpu.json
    python benchmarks/ready_batches.py --quick --out /tmp/ready_batches.json               # 2 steps, 1 round
    python benchmarks/ready_batches.py --markdown benchmarks/results/ready_batches_cpu.json

The workload is `agentic.py`'s (`configs/grpo_tools.yaml`, 64 episodes a step of 1 to 6 turns, the `LongTail`
environment), with steps that answer in 20 ms but one in ten (`--slow-shares 0.1`) in 1 s (`--slow-s`), as a slow
tool call or a cold sandbox does (the same steps are slow in every run), and with none slow (`0`): where every step
answers within a call's time, ready batches should be turn by turn's calls. The steps run together off the training
thread (`model.env.concurrency` 64, the default) in every mode:

- `turn by turn` (HF `generate`'s default): turn t of every running episode in one `generate` call, after every
  step of turn t - 1 is back: each turn waits for its slowest step;
- `ready batches` (`--model.env.ready_batches true`): a call samples the turns of the episodes whose steps are
  back, once every step under way is back or once they have waited as long as the last call took;
- `independent` (`--engine colocate`, the colocated engine's default): each episode's next turn goes into vLLM's
  scheduler as soon as its step is back, and joins the batch running at vLLM's next step.

`--engine colocate` runs the colocated vLLM engine (`configs/rollout/vllm_colocate.yaml`); its `turn by turn` and
`ready batches` rows set `--model.env.independent_turns false`. Reported per mode: seconds per optimizer step (the
median of the steps after the first), the share the trainer waits for its episodes, completions per second. Runs
alternate, round by round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentic import EPISODES_PER_STEP, REPO, fit_and_read  # noqa: E402

COLOCATE = ["--config", str(REPO / "configs" / "rollout" / "vllm_colocate.yaml")]
TURN_BY_TURN_ON_COLOCATE = [*COLOCATE, "--model.env.independent_turns", "false"]
MODES = {  # engine: {mode: the `lit-rl fit` options that make it}
    "hf": {
        "turn by turn": ["--model.env.ready_batches", "false"],
        "ready batches": ["--model.env.ready_batches", "true"],
    },
    "colocate": {
        "turn by turn": TURN_BY_TURN_ON_COLOCATE,
        "ready batches": [*TURN_BY_TURN_ON_COLOCATE, "--model.env.ready_batches", "true"],
        "independent": COLOCATE,
    },
}


def markdown_table(results: list[dict]) -> str:
    """The docs' table of a results file (a test checks the docs carry exactly this)."""
    lines = [
        "| steps | episodes | s/step | trainer waits for episodes | completions/s | vs turn by turn |",
        "|---|---|---|---|---|---|",
    ]
    base = {r["slow_share"]: r["step_s"] for r in results if r["mode"] == "turn by turn"}
    for r in results:
        steps = f"{1000 * r['latency_s']:.0f} ms, {100 * r['slow_share']:.0f}% {r['slow_s']:g} s"
        lines.append(
            f"| {steps} | {r['mode']} | {r['step_s']:.2f} | {100 * r['rollout_share']:.0f}% | "
            f"{r['samples_per_s']:.1f} | {base[r['slow_share']] / r['step_s']:.2f}x |"
        )
    return "\n".join(lines)


def claims(results: list[dict]) -> list[str]:
    """The prose numbers the docs quote: each mode against turn by turn, at each share of slow steps."""
    by = {(r["mode"], r["slow_share"]): r["step_s"] for r in results}
    out = []
    for share in sorted({share for _, share in by}, reverse=True):
        slow = by[("turn by turn", share)]
        for mode in [mode for mode, at in by if at == share and mode != "turn by turn"]:
            fast = by[(mode, share)]
            out.append(f"{slow:.2f} s -> {fast:.2f} s a step ({slow / fast:.2f}x)")
    return out


def main() -> None:
    from provenance import parse_report_args, write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps a run (the first is left out)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-s", type=float, default=0.02, help="a step's time")
    parser.add_argument("--slow-shares", type=float, nargs="+", default=[0.1, 0.0], help="shares of slow steps")
    parser.add_argument("--slow-s", type=float, default=1.0, help="a slow step's time")
    parser.add_argument("--quick", action="store_true", help="2 steps, 1 round")
    parser.add_argument("--engine", choices=sorted(MODES), default="hf", help="HF generate or colocated vLLM")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.steps, args.rounds = 2, 1
    modes = MODES[args.engine]
    rounds: dict[tuple[float, str], list[dict]] = {(share, mode): [] for share in args.slow_shares for mode in modes}
    with tempfile.TemporaryDirectory(prefix="lit_rl_ready_batches_") as workdir:
        for index in range(args.rounds):
            for (share, mode), runs in rounds.items():
                environment_args = f"{{latency_s: {args.latency_s}, slow_share: {share}, slow_s: {args.slow_s}}}"
                what = f"the {mode} run with {share} slow"
                runs.append(fit_and_read(what, modes[mode], environment_args, {}, args.steps, Path(workdir)))
                print(f"round {index + 1}: {mode}, {share} slow: {runs[-1]}", flush=True)
    results = []
    for (share, mode), runs in rounds.items():
        step_s = statistics.median(r["step_s"] for r in runs)
        generation_s = statistics.median(r["generation_s"] for r in runs)
        results.append(
            {
                "engine": args.engine,
                "mode": mode,
                "options": modes[mode],
                "latency_s": args.latency_s,
                "slow_share": share,
                "slow_s": args.slow_s,
                "step_s": step_s,
                "generation_s": generation_s,
                "rollout_share": generation_s / step_s,
                "samples_per_s": EPISODES_PER_STEP / step_s,
                "rounds": runs,
            }
        )
    if args.out:
        write_report(args.out, results, allow_dirty=args.allow_dirty, steps=args.steps)
    print(markdown_table(results))
    print("\n".join(claims(results)))


if __name__ == "__main__":
    main()
