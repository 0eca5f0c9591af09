"""MKL's math kernels are settled before anything in a lit-rl process runs threaded (`lit_rl/numerics.py`).

PyTorch computes contiguous float `sin`, `cos`, `exp`, ... on CPU with MKL's vector math, a chunk per intra-op
thread. When a function's first call in a process runs on two threads at once, one thread's chunk can come from
MKL's low-accuracy kernel (pytorch/pytorch#188792). Here that happens to a fresh process's first threaded `sin` or
`cos` in 5 to 8 processes in 40; it is what made the colocated vLLM engine's log-probs differ from the trainer's by
1e-4 to 1e-3 in some runs (vLLM builds its rotary table with the process's first `cos`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_rl.numerics import VML_FUNCTIONS
from tests.conftest import REPO

FIRST_THREADED_CALL = """
import sys
import torch
from lit_rl.numerics import settle_cpu_math_kernels
settle_cpu_math_kernels()
torch.set_num_threads(2)  # two chunks, one per thread: the race needs them
x = torch.randn(512, 512)
first = getattr(torch, sys.argv[1])(x)  # this process's first threaded call of the function
print((first.double() - getattr(x.double(), sys.argv[1])()).abs().max().item())
"""

# Each attempt needs a fresh process; without the settling, 5 to 8 in 40 fail here, so 30 make a regression fail
# this test with a probability above 98%.
PROCESSES = 30


@pytest.mark.slow
def test_fresh_processes_compute_their_first_threaded_sin_and_cos_with_the_accurate_kernel():
    errors = []
    for attempt in range(PROCESSES):
        function = ("sin", "cos")[attempt % 2]
        out = subprocess.run(
            [sys.executable, "-c", FIRST_THREADED_CALL, function],
            cwd=REPO,
            env=_spinning_threads_env(),
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        errors.append((float(out.stdout.strip().splitlines()[-1]), function))
    # MKL's accurate float32 kernels are within an ulp or two (6e-8 near 1); the low-accuracy one is off by ~1e-4.
    assert max(errors)[0] < 1e-6, sorted(errors)[-3:]


def _spinning_threads_env() -> dict[str, str]:
    """The environment without the test suite's `OMP_WAIT_POLICY=PASSIVE` (`tests/conftest.py`): the race needs both
    threads to start the first call together, as a user's process's threads do; threads woken from sleep start
    apart and could hide it."""
    return {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}


ENTRY_POINTS = {
    # `lit-rl ...`, the ranks Lightning starts and `lit-rl check`'s runs
    "cli": "from lit_rl.cli import main\ntry:\n    main(['fit', '--help'])\nexcept SystemExit:\n    pass",
    # a module built in Python
    "module": "from lit_rl.algorithms import GRPO\nGRPO()",
    # every vLLM process where lit-rl is installed loads the plugin before building its model
    "vllm_plugin": "from lit_rl.rollout.in_server.vllm_transfer_plugin import register\nregister()",
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_settles_the_kernels_before_its_math(entry):
    script = (
        "from lit_rl.numerics import settle_cpu_math_kernels as settle\n"
        "assert settle.cache_info().currsize == 0, 'settled on import'\n"
        f"{ENTRY_POINTS[entry]}\n"
        "print('settled', settle.cache_info().currsize)"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "settled 1"


def _vml_functions_of_this_torch() -> set[str]:
    header = Path(torch.__file__).parent / "include" / "ATen" / "cpu" / "vml.h"
    if not header.is_file():
        pytest.skip(f"this torch ships no {header.name} to read its VML functions from")
    lines = [line for line in header.read_text().splitlines() if not line.lstrip().startswith("//")]
    return set(re.findall(r"^\s*IMPLEMENT_VML_MKL\((\w+),", "\n".join(lines), flags=re.MULTILINE))


def test_every_function_torch_hands_to_mkl_vml_is_settled():
    assert _vml_functions_of_this_torch() == set(VML_FUNCTIONS)
