"""Time of a training forward and backward on variable-length completions: padded rows against padding-free rows.

    python benchmarks/packing.py --out benchmarks/results/packing_cpu.json
    python benchmarks/packing.py --quick                                     # a small problem, for CI
    python benchmarks/packing.py --markdown benchmarks/results/packing_cpu.json   # the README's table

The workload: a randomly initialised Qwen2 of hidden 512, 8 layers (21M parameters, the character tokenizer's
vocabulary), fp32, 64 rows; prompts of 8-24 tokens and completions of 32-128 tokens, lengths uniform (seeded).
Each method computes the completion tokens' log-probs and the gradient of their sum
(`lit_rl.modeling.completions.completion_forward`, as a training step does):
- `padded`: every row `[prompt, completion]` at the batch's P + T, left- and right-padded;
- `packed rows`: `padding_free=True` as it runs on CPU (sdpa): rows of 1-2x the longest sequence, first fit;
- `packed, one row`: every sequence in one row, the flash-attention layout, here with sdpa's dense mask.
After one uncounted warm-up call of each, methods alternate within each of `--rounds` rounds (a slow spell of
the shared machine hits all of them); the table reports the median seconds, the tokens each method computes, and
the largest |difference| of its log-probs and gradients from the padded method's.
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

METHODS = ("padded", "packed rows", "packed, one row")


def workload(rows: int, prompt: tuple[int, int], completion: tuple[int, int], vocab: int, seed: int = 0):
    """Left-padded prompts and right-padded completions of uniformly random lengths."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.randint(prompt[0], prompt[1] + 1, (rows,), generator=generator)
    c = torch.randint(completion[0], completion[1] + 1, (rows,), generator=generator)
    P, T = int(p.max()), int(c.max())
    prompt_mask = (torch.arange(P) >= P - p[:, None]).long()
    completion_mask = (torch.arange(T) < c[:, None]).long()
    prompt_ids = torch.randint(1, vocab, (rows, P), generator=generator) * prompt_mask
    completion_ids = torch.randint(1, vocab, (rows, T), generator=generator) * completion_mask
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def run(model, method: str, batch) -> tuple[float, torch.Tensor, dict[str, torch.Tensor], int]:
    """Seconds of one forward + backward, the log-probs, the gradients, and the tokens the model computed."""
    import lit_rl.modeling.packing as packing
    from lit_rl.modeling.completions import completion_forward
    from lit_rl.ops import token_logprobs

    tokens = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: tokens.append(args[0].numel()))
    single_row = packing.uses_flash_attention
    packing.uses_flash_attention = lambda model: method == "packed, one row"
    try:
        model.zero_grad()
        started = time.perf_counter()
        logits = completion_forward(model, *batch, padding_free=method != "padded")
        logprobs = token_logprobs(logits, batch[2]) * batch[3]
        logprobs.sum().backward()
        seconds = time.perf_counter() - started
    finally:
        packing.uses_flash_attention = single_row
        hook.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return seconds, logprobs.detach(), grads, sum(tokens)


def measure(args) -> dict:
    from transformers import Qwen2ForCausalLM

    from lit_rl.modeling.models import tiny_qwen2_config

    torch.manual_seed(0)
    sizes = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**sizes))
    batch = workload(args.rows, (8, 24), tuple(args.completion), model.config.vocab_size)
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    reference = None
    rows = {}
    for method in METHODS:  # warm-up, not counted: first calls pay for allocation and kernel selection
        run(model, method, batch)
    for _ in range(args.rounds):
        for method in METHODS:
            seconds, logprobs, grads, tokens = run(model, method, batch)
            times[method].append(seconds)
            if method == "padded":
                reference = (logprobs, grads)
            logprob_diff = float((logprobs - reference[0]).abs().max())
            grad_diff = max(
                float((grads[n] - reference[1][n]).abs().max() / reference[1][n].abs().max().clamp(min=1e-30))
                for n in grads
            )
            rows[method] = {"tokens": tokens, "max_logprob_diff": logprob_diff, "max_grad_diff_of_scale": grad_diff}
    padded_s = statistics.median(times["padded"])
    results = []
    for method in METHODS:
        seconds = statistics.median(times[method])
        results.append({"method": method, "seconds": seconds, "ratio": seconds / padded_s, **rows[method]})
    return {
        "model": {**sizes, "parameters": sum(p.numel() for p in model.parameters())},
        "rows": args.rows,
        "completion_tokens": list(args.completion),
        "real_tokens": int(batch[1].sum() + batch[3].sum()),
        "padded_tokens": int(batch[0].numel() + batch[2].numel()),
        "rounds": args.rounds,
        "methods": results,
    }


def markdown_table(results: dict) -> str:
    """The README's table of a results file (a test checks the README carries exactly this)."""
    lines = [
        "| forward + backward | tokens computed | s (median) | vs padded | max logprob diff | max grad diff / scale |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["methods"]:
        lines.append(
            f"| {r['method']} | {r['tokens']:,} | {r['seconds']:.3f} | {r['ratio']:.2f}x | "
            f"{r['max_logprob_diff']:.1e} | {r['max_grad_diff_of_scale']:.1e} |"
        )
    return "\n".join(lines)


def claims(results: dict) -> list[str]:
    """The README's prose numbers of a results file."""
    rows = {r["method"]: r for r in results["methods"]}
    share = 100 * (1 - results["real_tokens"] / results["padded_tokens"])
    return [
        f"{share:.0f}% of the padded batch's tokens are padding",
        f"padding-free rows take {rows['packed rows']['ratio']:.2f}x the padded time",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--completion", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, 8 rows of 4-16 tokens, 1 round")
    args = parse_report_args(parser, markdown_table, claims)
    if args.quick:
        args.hidden, args.layers, args.intermediate = 128, 2, 256
        args.rows, args.completion, args.rounds = 8, (4, 16), 1
    results = measure(args)
    publish(args, results, markdown_table, claims)


if __name__ == "__main__":
    main()
