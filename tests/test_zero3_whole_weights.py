"""Running out of memory with the policy gathered whole for decoding under ZeRO-3 (`gather_weights: true`, the
default) ends the run in one line that names the option which decodes through the partitions instead.

An out-of-memory error cannot be caused on CPU: DeepSpeed's gather (or the decoding inside it) raises
`torch.OutOfMemoryError` here as CUDA's caching allocator does. Decoding from whole weights itself is tested through
the CLI on 2 ranks (`tests/integration/test_deepspeed.py::test_zero3_decodes_from_whole_weights_without_its_hooks`).
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lit_rl.cli import user_error_message
from lit_rl.errors import ConfigError
from lit_rl.rollout.engine_config import whole_weights_for_decoding
from lit_rl.training import strategies


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB in float32
        self.layer.weight.ds_numel = 256 * 1024 * 1024  # a partitioned parameter's whole size: 1 GiB in float32
        self.deepspeed_hook = self.layer.register_forward_pre_hook(lambda module, args: None)


@pytest.fixture
def zero3(monkeypatch):
    """A ZeRO-3 strategy whose parameter offload holds the policy's DeepSpeed hook (no engine is started)."""
    policy = _Policy()
    offload = SimpleNamespace(
        empty_partition_cache=lambda: None, forward_hooks=[policy.deepspeed_hook], backward_hooks=[]
    )
    monkeypatch.setattr(strategies, "_zero3_parameter_offload", lambda strategy: offload)
    return DeepSpeedStrategy(stage=3), policy


def test_running_out_of_memory_gathering_the_policy_says_so_in_one_line(zero3, monkeypatch):
    strategy, policy = zero3

    @contextmanager
    def gather_out_of_memory(parameters):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        yield

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gather_out_of_memory)
    with pytest.raises(ConfigError) as raised:
        with whole_weights_for_decoding(strategy, policy):
            pytest.fail("decoded without the whole policy")
    line = user_error_message(raised.value)
    assert line == str(raised.value) and "\n" not in line
    assert line.startswith("model.rollout.engine.gather_weights: out of memory gathering it")
    assert "(1.00 GiB) on every rank" in line and "--model.rollout.engine.gather_weights false" in line
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)  # LIT_RL_TRACEBACK=1 shows DeepSpeed's


def test_running_out_of_memory_while_decoding_whole_names_the_option_and_gives_the_hooks_back(zero3, monkeypatch):
    strategy, policy = zero3
    released = []

    @contextmanager
    def gathered(parameters):  # DeepSpeed's partitions again on the way out, exception or not
        try:
            yield
        finally:
            released.append(len(parameters))

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", gathered)
    hooks = policy.layer._forward_pre_hooks
    with pytest.raises(ConfigError, match=r"^model\.rollout\.engine\.gather_weights: out of memory decoding with it"):
        with whole_weights_for_decoding(strategy, policy):
            assert policy.layer._forward_pre_hooks == {}  # DeepSpeed's hook hidden while decoding
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
    assert released == [1]  # the whole copy was partitioned again
    assert policy.layer._forward_pre_hooks is hooks and list(hooks) == [policy.deepspeed_hook.id]
