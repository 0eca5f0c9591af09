"""`import lit_rl` settles MKL's kernel choices before anything runs threaded (`lit_rl/numerics.py`).

PyTorch computes contiguous float `sin`, `cos`, `exp`, ... on CPU with MKL's vector math, a chunk per intra-op
thread. When a function's first call in a process runs on two threads at once, one thread's chunk can come from
MKL's low-accuracy kernel (pytorch/pytorch#188792). Here that happens to a fresh process's first threaded
`torch.sin` in about one process in eight; it is what made the colocated vLLM engine's log-probs differ from the
trainer's by 1e-4 to 1e-3 in some runs (its rotary table is built by the process's first `cos`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rl.numerics import VML_FUNCTIONS
from tests.conftest import REPO

FIRST_THREADED_SIN = """
import torch
import lit_rl
torch.set_num_threads(2)  # two chunks, one per thread: the race needs them
x = torch.randn(512, 512)
first = torch.sin(x)  # this process's first threaded call of VML's sin
print((first.double() - x.double().sin()).abs().max().item())
"""

# Each attempt needs a fresh process. Without the settling, about one in eight fails here (measured: 5 of 40
# sequential processes), so 30 make a regression fail this test with a probability of about 98%.
PROCESSES = 30


def test_a_fresh_process_computes_its_first_threaded_sin_with_the_accurate_kernel():
    errors = []
    for _ in range(PROCESSES):
        out = subprocess.run(
            [sys.executable, "-c", FIRST_THREADED_SIN], cwd=REPO, capture_output=True, text=True, check=True
        )
        errors.append(float(out.stdout.strip().splitlines()[-1]))
    # MKL's accurate float32 sin is within an ulp or two (6e-8 near 1); its low-accuracy kernel is off by ~1e-4.
    assert max(errors) < 1e-6, sorted(errors)[-3:]


def _vml_functions_of_this_torch() -> set[str]:
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.is_file():
        pytest.skip(f"this torch ships no {header.name} to read its VML functions from")
    lines = [line for line in header.read_text().splitlines() if not line.lstrip().startswith("//")]
    return set(re.findall(r"^\s*IMPLEMENT_VML_MKL\((\w+),", "\n".join(lines), flags=re.MULTILINE))


def test_every_function_torch_hands_to_mkl_vml_is_settled():
    assert _vml_functions_of_this_torch() == set(VML_FUNCTIONS)
