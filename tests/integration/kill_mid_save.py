"""Run as `python tests/integration/kill_mid_save.py MARKER fit --config ...`: the lit-rl CLI, where a DeepSpeed
checkpoint save into a path containing MARKER ends with the whole run SIGKILLed right after global rank 0 has
written its first file of it (the other ranks may be writing theirs): a machine dying in the middle of a save.

DeepSpeed's checkpoint writer is patched in every rank (Lightning starts the other ranks with this same command
line). The kill goes to the process group: start this in a new session so that it reaches every rank and nothing
else.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def kill_after_first_file(marker: str) -> None:
    original = TorchCheckpointEngine.save

    def save(self: TorchCheckpointEngine, state_dict: Any, path: str) -> None:
        original(self, state_dict, path)
        if marker in str(path) and dist.get_rank() == 0:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    TorchCheckpointEngine.save = save


if __name__ == "__main__":
    kill_after_first_file(sys.argv[1])
    from lit_rl.cli import main

    main(sys.argv[2:])
