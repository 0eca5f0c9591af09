"""What lit-rl loads from files it did not make: a checkpoint given to `lit_rl.export` is read as tensors and
plain containers only (a crafted one runs no code), and it cannot grant itself `trust_remote_code`. (A checkpoint
given to `--ckpt_path` configures nothing: tests/integration/test_checkpoint_overrides.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lit_rl.errors import LitRLError
from lit_rl.export import export_checkpoint
from tests.conftest import cli_env

# Unpickling this object runs `touch <marker>`: what `torch.load(weights_only=False)` would do.
CRAFTED = """
import os, sys, torch
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[2],))
torch.save({"state_dict": {}, "hyper_parameters": {"model_name_or_path": "lit-rl/tiny-qwen2-base"},
            "payload": Payload()}, sys.argv[1])
"""


def test_export_of_a_crafted_checkpoint_runs_no_code_and_says_so_in_one_line(tmp_path):
    checkpoint, marker = tmp_path / "shared.ckpt", tmp_path / "code_ran"
    subprocess.run([sys.executable, "-c", CRAFTED, str(checkpoint), str(marker)], check=True, timeout=120)
    result = subprocess.run(
        [sys.executable, "-m", "lit_rl.export", str(checkpoint), str(tmp_path / "out")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr == (
        f"lit-rl export: error: checkpoint {checkpoint} holds objects other than tensors and plain containers "
        "(posix.system), which lit-rl does not unpickle: it may run code\n"
    )
    assert not marker.exists()
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_cannot_grant_itself_remote_code(tmp_path):
    checkpoint = tmp_path / "remote.ckpt"
    hyper_parameters = {"model_name_or_path": "someone/model-with-code", "trust_remote_code": True}
    torch.save({"state_dict": {"policy.w": torch.zeros(1)}, "hyper_parameters": hyper_parameters}, checkpoint)
    with pytest.raises(LitRLError) as refused:
        export_checkpoint(checkpoint, tmp_path / "out")
    assert str(refused.value) == (
        f"checkpoint {checkpoint} was trained with trust_remote_code: loading its model 'someone/model-with-code' "
        "runs code from the model's repository; pass --trust-remote-code if you trust it"
    )
