"""Time of HF-engine rollouts on completions of very different lengths: every row to the end against finished rows
skipped.

    python benchmarks/generation.py --out benchmarks/results/generation_cpu.json
    python benchmarks/generation.py --quick                                        # a small problem, for CI
    python benchmarks/generation.py --markdown benchmarks/results/generation_cpu.json  # the README's table

The workload: a randomly initialised Qwen2 of hidden 512, 8 layers (21M parameters, the character tokenizer's
vocabulary of 320), fp32, 64 rows of random 8-24-token prompts, temperature 1, at most 128 new tokens. Random
weights give nearly uniform next-token probabilities, so with `--stop-tokens 5` ids counted as EOS a row stops
with probability about 5/320 per token: lengths spread from 1 to 128 (mean about 60), as in real RL rollouts.
Both methods are `lit_rl.rollout.HFGenerateEngine` with the same per-completion seeds:
- `generate, every row`: `skip_finished=False`, `transformers` `generate`, which keeps every row until the last
  one stops (what ZeRO-3 and FSDP ranks still use);
- `finished rows skipped`: the default, `lit_rl.rollout.engines.compact_decode`.
After one uncounted warm-up call of each, the methods alternate within each of `--rounds` rounds; the table reports
the median seconds, the row-steps each method computes (rows x decoding steps, prefill included), and whether the
completions and log-probs are the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from provenance import parse_report_args, publish  # noqa: E402

from lit_rl.numerics import settle_cpu_math_kernels  # noqa: E402

settle_cpu_math_kernels()  # as every lit-rl process does, before any threaded float math (lit_rl/numerics.py)

METHODS = {"generate, every row": False, "finished rows skipped": True}


def measure(args) -> dict:
    from transformers import Qwen2ForCausalLM

    from lit_rl.modeling.models import tiny_qwen2_config
    from lit_rl.rollout import HFGenerateEngine, SamplingParams

    torch.manual_seed(0)
    sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate)
    # A context that holds the longest prompt and completion (the default 128 would not).
    model = Qwen2ForCausalLM(tiny_qwen2_config(**sizes, max_position_embeddings=256)).eval()
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 25, (args.rows,), generator=generator)
    P = int(lengths.max())
    prompt_mask = (torch.arange(P) >= P - lengths[:, None]).long()
    prompt_ids = torch.randint(args.stop_tokens + 1, vocab, (args.rows, P), generator=generator) * prompt_mask
    stops = list(range(1, args.stop_tokens + 1))  # ids 1..k end a completion (0 pads)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    seeds = list(range(args.rows))
    engines = {name: HFGenerateEngine(model, stops, 0, skip_finished=skip) for name, skip in METHODS.items()}
    row_steps: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: row_steps.append(a[0].shape[0]))

    def run(name: str):
        row_steps.clear()
        started = time.perf_counter()
        out = engines[name].generate(prompt_ids, prompt_mask, params, seeds)
        return time.perf_counter() - started, out, sum(row_steps)

    for name in METHODS:  # warm-up, not counted
        run(name)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    outputs, computed = {}, {}
    for _ in range(args.rounds):
        for name in METHODS:
            seconds, outputs[name], computed[name] = run(name)
            times[name].append(seconds)
    reference = outputs["generate, every row"]
    completion_lengths = reference.completion_mask.sum(dim=1)
    full_s = statistics.median(times["generate, every row"])
    methods = []
    for name in METHODS:
        out = outputs[name]
        seconds = statistics.median(times[name])
        methods.append(
            {
                "method": name,
                "seconds": seconds,
                "ratio": seconds / full_s,
                "row_steps": computed[name],
                "same_completions": bool(torch.equal(out.completion_ids, reference.completion_ids)),
                "max_logprob_diff": float((out.logprobs - reference.logprobs).abs().max()),
            }
        )
    return {
        "model": {**sizes, "vocab": vocab, "parameters": sum(p.numel() for p in model.parameters())},
        "rows": args.rows,
        "max_new_tokens": args.max_new_tokens,
        "stop_tokens": args.stop_tokens,
        "completion_tokens": int(completion_lengths.sum()),
        "completion_length": {
            "min": int(completion_lengths.min()),
            "mean": float(completion_lengths.float().mean()),
            "max": int(completion_lengths.max()),
        },
        "rounds": args.rounds,
        "methods": methods,
    }


def markdown_table(results: dict) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| rollout | row-steps computed | s (median) | vs generate | same completions | max logprob diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["methods"]:
        lines.append(
            f"| {r['method']} | {r['row_steps']:,} | {r['seconds']:.2f} | {r['ratio']:.2f}x | "
            f"{'yes' if r['same_completions'] else 'no'} | {r['max_logprob_diff']:.1e} |"
        )
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The README's prose numbers of a results file."""
    rows = {r["method"]: r for r in results["methods"]}
    full = rows["generate, every row"]
    wasted = 100 * (1 - rows["finished rows skipped"]["row_steps"] / full["row_steps"])
    length = results["completion_length"]
    return [
        f"completions of {length['min']} to {length['max']} tokens (mean {length['mean']:.0f})",
        f"{wasted:.0f}% of the row-steps `generate` computes belong to finished rows",
        f"skipping them takes {rows['finished rows skipped']['ratio']:.2f}x the time",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop-tokens", type=int, default=5, help="token ids that end a completion")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, 16 rows, 32 tokens, 1 round")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.hidden, args.layers, args.intermediate = 128, 2, 256
        args.rows, args.max_new_tokens, args.rounds, args.stop_tokens = 16, 32, 1, 20
    results = measure(args)
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
