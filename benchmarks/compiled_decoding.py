"""Compiled decoding (`configs/rollout/hf_compiled.yaml`) against the default eager loop: seconds per generation,
compile time, the break-even generation count, and how far the compiled log-probs are from the eager ones.

    python benchmarks/compiled_decoding.py --out benchmarks/results/compiled_decoding_cpu.json
    python benchmarks/compiled_decoding.py --quick        # the tiny model, fp32 only, few generations
    python benchmarks/compiled_decoding.py --markdown benchmarks/results/compiled_decoding_cpu.json
    python benchmarks/compiled_decoding.py --device cuda --model qwen2.5-0.5b --dtypes bfloat16 --attention sdpa \
        --rows 64 --tokens 256 --out benchmarks/results/compiled_decoding_<gpu>.json     # on a GPU: CUDA graphs

The workload is GRPO's rollout from issue 34: a randomly initialised Qwen2 of hidden 512, 8 layers (21M
parameters, the character tokenizer), 2 addition prompts x G = 8 completions of exactly 32 tokens
(`min_new_tokens = max_new_tokens`), temperature 1, each row from its own seed, eager attention as in the TRL
comparison's fastest settings (`--attention sdpa`: torch's fused kernel, the model's default). Each dtype (the
weights in float32 or bfloat16, as `trainer.precision` 32-true and bf16-true hold them) runs in its own process
with an empty inductor cache, so the first generations pay a cold compile, as a user's first run does.

Per dtype: the wall time of the first `--warm` compiled generations (prompt lengths change between batches, so
torch.compile compiles the step, then once more with the cache length symbolic), then `--rounds` rounds that
alternate eager and compiled over the same batches. Reported: the median seconds per generation of each, their
ratio, the compile time (the warm generations' time beyond as many steady compiled ones) and the break-even
(compile time / seconds saved per generation). Exactness, over the steady generations: the share of tokens
equal to the eager ones, and the largest log-prob difference from the trainer's forward of the same tokens
(`completion_scores`), for the compiled and the eager engine, beside each other.

On CPU the compiled step multiplies float32 weights packed once per generation into MKL's layout (bfloat16 ones
are not packed) and compiles with an inductor option of its own (`lit_rl/rollout/engines/static_decode.py`);
`untuned` is the compiled step without either, timed in the same rounds, so `compiled / untuned` is what they
bring. `untuned_compile_s` is the untuned step's compile time, measured as the compiled one's but after it in the
same process (so it may find some kernels in inductor's cache).

The floor: the same rounds also time `--tokens` passes of a [rows, in] input through the model's weight matrices
alone (every `nn.Linear`, the LM head included, each once per token, packed on CPU as the compiled step runs them;
no attention, norms or sampling). At a decoding batch this small every weight is read from memory once per token
for a few rows of arithmetic, so this is what one-token decoding cannot go below on this machine without batching
more rows or holding smaller weights; `compiled / floor` says how much of a compiled generation is anything else.

On a GPU (`--device cuda`) the compiled step runs as CUDA graphs (`reduce-overhead`); `--model qwen2.5-0.5b` is
`benchmarks/gpu_suite.py`'s randomly initialised Qwen2.5-0.5B shape (vocabulary 151,936), its workload 8 prompts x
G = 8 completions of 256 tokens (`--rows 64 --tokens 256`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import parse_report_args, publish  # noqa: E402

from lit_rl.numerics import settle_cpu_math_kernels  # noqa: E402

settle_cpu_math_kernels()  # as every lit-rl process does, before any threaded float math (lit_rl/numerics.py)

SIZES = {"20m": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1024), "tiny": dict()}


def model_config(size: str):
    from lit_rl.modeling.models import tiny_qwen2_config

    if size in SIZES:
        return tiny_qwen2_config(**SIZES[size])
    from gpu_suite import SHAPES

    return tiny_qwen2_config(**SHAPES[size])


def child(
    dtype_name: str,
    size: str,
    rows: int,
    group: int,
    tokens: int,
    warm: int,
    rounds: int,
    device: str = "cpu",
    attention: str = "eager",
) -> dict:
    """One dtype's measurements (run in a fresh process)."""
    import torch
    from transformers import Qwen2ForCausalLM

    from lit_rl.data.arithmetic import addition_rows
    from lit_rl.modeling.completions import completion_scores
    from lit_rl.modeling.models import build_char_tokenizer
    from lit_rl.rollout import HFGenerateEngine, SamplingParams
    from lit_rl.rollout.engines.packed_linear import PackedLinearMode, packed_weights
    from lit_rl.rollout.engines.static_decode import CompiledDecoder

    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    config = model_config(size)
    config._attn_implementation = attention  # `model.policy.attn_implementation`
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "left"
    prompts = [row["prompt"] for row in addition_rows("train")]
    per_batch = rows // group
    batches = []
    for i in range(warm + 4):  # distinct prompts of varying lengths
        enc = tokenizer(prompts[i * per_batch : (i + 1) * per_batch], padding=True, return_tensors="pt")
        batches.append(
            tuple(enc[key].repeat_interleave(group, 0).to(device) for key in ("input_ids", "attention_mask"))
        )
    params = SamplingParams(max_new_tokens=tokens, min_new_tokens=tokens, temperature=1.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    engines = {"eager": HFGenerateEngine(model, eos, pad), "compiled": HFGenerateEngine(model, eos, pad, compiled=True)}
    if device == "cpu":  # the compiled step without packed weights or inductor options, as it was before them
        engines["untuned"] = HFGenerateEngine(model, eos, pad)
        engines["untuned"].decoder = CompiledDecoder(model, cpu_tuned=False)

    def timed(engine, batch, seed):
        began = time.perf_counter()
        out = engine.generate(*batch, params, list(range(seed, seed + rows)))
        if device == "cuda":
            torch.cuda.synchronize()  # kernels are queued: the wall time is the GPU's once they finish
        return time.perf_counter() - began, out

    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    inputs = [torch.randn(rows, m.in_features, dtype=dtype, device=device) for m in linears]

    @torch.no_grad()
    def weight_matmuls_s() -> float:
        """Every weight matrix once per token, as the compiled step multiplies it (packed, on CPU)."""
        began = time.perf_counter()
        with packed_weights(), PackedLinearMode():
            for _ in range(tokens):
                for module, x in zip(linears, inputs):
                    module(x)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began

    compiling = [name for name in engines if name != "eager"]
    warm_s = {name: [timed(engines[name], batches[i], i)[0] for i in range(warm)] for name in compiling}
    seconds = {name: [] for name in engines}
    floor_s, equal, total, gap_compiled, gap_eager = [], 0, 0, 0.0, 0.0
    for r in range(rounds):
        for j, batch in enumerate(batches[warm:]):
            seed = 1000 * (r + 1) + j
            outs = {}
            for name, engine in engines.items():  # interleaved, on the same batch and seeds
                took, outs[name] = timed(engine, batch, seed)
                seconds[name].append(took)
            floor_s.append(weight_matmuls_s())
            a, b = outs["eager"], outs["compiled"]
            equal += int((a.completion_ids == b.completion_ids).sum())
            total += a.completion_ids.numel()
            for out, gaps in ((b, "compiled"), (a, "eager")):
                with torch.no_grad():
                    trainer = completion_scores(model, *batch, out.completion_ids, out.completion_mask, 1.0).logprobs
                gap = float((out.logprobs - trainer * out.completion_mask).abs().max())
                if gaps == "compiled":
                    gap_compiled = max(gap_compiled, gap)
                else:
                    gap_eager = max(gap_eager, gap)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    eager_med, compiled_med = medians["eager"], medians["compiled"]
    compile_s = sum(warm_s["compiled"]) - warm * compiled_med
    untuned_compile_s = sum(warm_s["untuned"]) - warm * medians["untuned"] if "untuned" in medians else None
    saved = eager_med - compiled_med
    return {
        "dtype": dtype_name,
        "model": size,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "rows": rows,
        "tokens": tokens,
        "attention": attention,
        "eager_s": eager_med,
        "compiled_s": compiled_med,
        "speedup": eager_med / compiled_med,
        "untuned_compiled_s": medians.get("untuned"),
        "untuned_compile_s": untuned_compile_s,
        "weight_matmuls_s": statistics.median(floor_s),
        "weight_bytes": sum(m.weight.numel() * m.weight.element_size() for m in linears),
        "warm_generations_s": warm_s["compiled"],
        "compile_s": compile_s,
        "break_even_generations": compile_s / saved if saved > 0 else None,
        "tokens_equal": equal / total,
        "max_logprob_gap_compiled": gap_compiled,
        "max_logprob_gap_eager": gap_eager,
    }


def run_child(dtype: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="lit-rl-inductor-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}  # a cold compile, as a first run's
        command = [sys.executable, __file__, "--child", dtype, "--model", args.model, "--rows", str(args.rows)]
        command += ["--group", str(args.group), "--tokens", str(args.tokens), "--warm", str(args.warm)]
        command += ["--rounds", str(args.rounds), "--device", args.device, "--attention", args.attention]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"decoding in {dtype} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown_table(results: list[dict]) -> str:
    lines = [
        "| weights | eager s/generation | compiled | speed-up | compile s | break-even (generations) "
        "| tokens equal | max log-prob gap to the trainer: compiled / eager "
        "| weight-matmul floor s | compiled / floor | untuned compiled s | compiled / untuned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        even = "never" if r["break_even_generations"] is None else f"{r['break_even_generations']:.0f}"
        untuned = r.get("untuned_compiled_s")
        tuning = "| - | - |" if untuned is None else f"| {untuned:.3f} | {r['compiled_s'] / untuned:.2f}x |"
        lines.append(
            f"| {r['dtype']} | {r['eager_s']:.3f} | {r['compiled_s']:.3f} | {r['speedup']:.2f}x | {r['compile_s']:.1f} "
            f"| {even} | {100 * r['tokens_equal']:.1f}% | {r['max_logprob_gap_compiled']:.2g} / "
            f"{r['max_logprob_gap_eager']:.2g} | {r['weight_matmuls_s']:.3f} "
            f"| {r['compiled_s'] / r['weight_matmuls_s']:.1f}x {tuning}"
        )
    return "\n".join(lines)


# What the tuned CPU step adds to the untuned one, by weight dtype.
TUNING = {
    "float32": "packed weights, the inductor option",
    "bfloat16": "the inductor option; bf16 weights are not packed",
}


def claims(results: list[dict]) -> list[str]:
    lines = [
        f"{r['dtype']}: compiled decoding {r['speedup']:.2f}x the eager loop's speed, {r['compile_s']:.0f} s to "
        f"compile, repaid after {r['break_even_generations'] or float('inf'):.0f} generations"
        for r in results
    ]
    return lines + [
        f"{r['dtype']}: the tuned step ({TUNING[r['dtype']]}) takes {r['compiled_s'] / r['untuned_compiled_s']:.2f}x "
        f"the untuned step's time a generation"
        for r in results
        if r.get("untuned_compiled_s")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--model", default="20m", choices=[*SIZES, "qwen2.5-0.5b", "qwen2.5-1.5b"])
    parser.add_argument("--attention", default="eager", choices=["eager", "sdpa"], help="the attention kernel")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=16, help="completions per generation")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--warm", type=int, default=3, help="compiled generations counted as compiling")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the tiny model, fp32, 8 tokens, 1 round")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parse_report_args(parser, markdown_table, claims)
    if args.child:
        measured = child(
            args.child,
            args.model,
            args.rows,
            args.group,
            args.tokens,
            args.warm,
            args.rounds,
            args.device,
            args.attention,
        )
        print(json.dumps(measured))
        return
    if args.quick:
        args.dtypes, args.model, args.tokens, args.rounds = ["float32"], "tiny", 8, 1
    results = []
    for dtype in args.dtypes:
        print(f"decoding in {dtype} ...", flush=True)
        results.append(run_child(dtype, args))
    publish(args, results, markdown_table, claims, workload=vars(args) | {"out": None, "markdown": None})


if __name__ == "__main__":
    main()
