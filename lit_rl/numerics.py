"""MKL's math kernels chosen before any threaded use, so CPU float math is as accurate as PyTorch asks.

On CPU, PyTorch computes contiguous float32 and float64 `cos`, `sin`, `exp`, `sqrt`, ... with MKL's vector math
library (VML), each intra-op thread on its own chunk, and asks for the high-accuracy kernels. oneMKL chooses a
function's kernel on that function's first call; when the first call runs on several threads at once, one thread
can run a low-accuracy kernel for its whole chunk of that call (pytorch/pytorch#188792: errors of about 1e-4 on
values of about 1, in float32). Later calls are exact again, so the damage looks random.

It reached lit-rl through vLLM's rotary table: built by the process's first `cos` (128 x 32 values, two chunks on
two threads), half its rows came out wrong in 6 of 102 colocated `lit-rl fit` runs measured, and the engine's
log-probs then differed from the trainer's by up to 7e-4 instead of 2e-6. Calling every such function once, on
one element and so on one thread, settles each choice before anything runs threaded. Where it is called:
- `lit_rl.cli.main`, first: every `lit-rl` process, the ranks Lightning starts and `lit-rl check`'s runs, after
  `lit-rl check` has set MKL's reproducibility variables (MKL reads them at its first call);
- `PolicyModule.__init__`: a module built in Python, outside the CLI;
- lit-rl's vLLM plugin (`vllm.general_plugins`), which vLLM loads in each of its processes before building the
  model: a server started where lit-rl is installed, unless `VLLM_PLUGINS` leaves `lit_rl_gloo` out.
- the benchmark scripts that compare values computed in their own processes (`benchmarks/logprob_memory.py` and
  others): a fresh child's first threaded `exp` once put `token_logprobs` 3.4e-5 from the float32 log-softmax,
  where the settled kernels give 6.7e-6.
"""

from __future__ import annotations

import functools

# The functions ATen hands to MKL VML for float32 and float64 (aten/src/ATen/cpu/vml.h, `IMPLEMENT_VML_MKL`).
VML_FUNCTIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "log",
    "log10",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)


# ATen calls MKL's `vsLn`/`vdLn` outside vml.h too, in `logit`, with a grain that threads even small tensors.
OTHER_MKL_CALLERS = ("logit",)


@functools.cache
def settle_cpu_math_kernels() -> None:
    """Call each VML function once per dtype on one element (a single-threaded first call); once per process."""
    import torch

    if not torch.backends.mkl.is_available():
        return
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            x = torch.full((1,), 0.5, dtype=dtype)  # inside every function's domain
            for name in (*VML_FUNCTIONS, *OTHER_MKL_CALLERS):
                getattr(torch, name)(x)
