"""What lit-rl's HF decoding costs over plain `generate(do_sample=True)` on the same weights: the per-row seeded
sampler (`SeededRowSampler`, counter-based noise over the vocabulary) and the recorded log-probs of the sampled
tokens, per decoding step and over a whole rollout.

    python benchmarks/decode_overhead.py --shape qwen2.5-0.5b --rows 64 --tokens 256   # on a GPU (bf16 weights)
    python benchmarks/decode_overhead.py --quick                                      # CPU, the smoke shape

The model is randomly initialised in one of `gpu_suite.py`'s shapes (vocabulary 151,936), bf16 on a GPU and fp32 on
a CPU (`--weights fp32-autocast`: fp32 weights decoding under bf16 autocast, as `bf16-mixed` training holds them);
prompts are 12 random tokens, 8 rows per prompt; the stop id is one a random model never samples in
practice, so every row runs to `--tokens`. Each timing is the mean of repeated calls after one uncounted call.
It prints its numbers; nothing is written.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_suite import SHAPES  # noqa: E402

from lit_rl.numerics import settle_cpu_math_kernels  # noqa: E402
from lit_rl.rollout.base import SamplingParams  # noqa: E402
from lit_rl.rollout.engines.compact_decode import counter_uniforms  # noqa: E402
from lit_rl.rollout.engines.hf import HFGenerateEngine  # noqa: E402

settle_cpu_math_kernels()  # as every lit-rl process does, before any threaded float math (lit_rl/numerics.py)


def mean_seconds(call: Callable[[], object], repeats: int, device: str) -> float:
    """Mean wall seconds of `call` over `repeats` calls, after one uncounted call (kernels and caches warm)."""
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def measure(shape: str, rows: int, tokens: int, repeats: int, weights: str = "auto") -> dict[str, float]:
    import contextlib

    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and weights == "auto" else torch.float32
    # `bf16-mixed` keeps fp32 weights and decodes under autocast: each matmul casts its weight to bf16 again.
    autocast = torch.autocast(device, dtype=torch.bfloat16) if weights == "fp32-autocast" else contextlib.nullcontext()
    torch.manual_seed(0)
    config = Qwen2Config(**{"num_attention_heads": 2, "num_key_value_heads": 1, **SHAPES[shape]})
    model = Qwen2ForCausalLM(config).to(device, dtype)
    vocab = config.vocab_size
    scores = torch.randn(rows, vocab, device=device, dtype=dtype)
    seeds = torch.arange(rows, device=device)
    step = {
        "seeded noise ms/step": lambda: scores.float() - torch.log(-torch.log(counter_uniforms(seeds, 5, vocab))),
        "log-softmax ms/step": lambda: torch.log_softmax(scores.float(), dim=-1),
        "softmax + multinomial ms/step": lambda: torch.multinomial(torch.softmax(scores.float(), dim=-1), 1),
    }
    results = {name: 1e3 * mean_seconds(call, 20, device) for name, call in step.items()}
    prompts = torch.randint(0, 300, (max(rows // 8, 1), 12), device=device).repeat_interleave(8, dim=0)[:rows]
    mask = torch.ones_like(prompts)
    stop = vocab - 1
    params = SamplingParams(max_new_tokens=tokens, temperature=1.0)
    engine = HFGenerateEngine(model, stop, pad_token_id=0)
    with autocast:
        results["lit-rl HF engine s"] = mean_seconds(lambda: engine.generate(prompts, mask, params), repeats, device)
        model.generation_config.pad_token_id = 0
        plain = dict(do_sample=True, max_new_tokens=tokens, min_new_tokens=tokens, top_k=0, eos_token_id=stop)
        results["generate(do_sample=True) s"] = mean_seconds(
            lambda: model.generate(input_ids=prompts, attention_mask=mask, **plain), repeats, device
        )
    results["lit-rl / generate"] = results["lit-rl HF engine s"] / results["generate(do_sample=True) s"]
    weights_dtype = "fp32 under bf16 autocast" if weights == "fp32-autocast" else str(dtype).removeprefix("torch.")
    return {"device": device, "weights": weights_dtype, **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="timed rollouts per method")
    parser.add_argument("--quick", action="store_true", help="the smoke shape, 16 rows, 8 tokens (CPU, a test)")
    parser.add_argument(
        "--weights",
        choices=["auto", "fp32-autocast"],
        default="auto",
        help="auto: bf16 on a GPU, fp32 on a CPU; fp32-autocast: fp32 weights under bf16 autocast (`bf16-mixed`)",
    )
    args = parser.parse_args()
    if args.quick:
        args.shape, args.rows, args.tokens = "smoke", 16, 8
    for name, value in measure(args.shape, args.rows, args.tokens, args.repeats, args.weights).items():
        print(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")


if __name__ == "__main__":
    main()
