"""What the strategies leave on which device, shown on CPU for what first failed on a GPU:

- under ZeRO-3, DeepSpeed does not move a model built under `zero.Init`, so the project's strategy moves the rest
  (metric states, buffers, unpartitioned parameters) itself and leaves ZeRO-3's parameters alone;
- under FSDP, Lightning's precision plugin refuses norm clipping, so the policy module clips through the FSDP root
  (the norm over every rank's shards).

"meta" stands in for the GPU: a tensor that moved reports it, one left alone stays on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torchmetrics import MeanMetric, MetricCollection

from lit_rl.algorithms.base import PolicyModule
from lit_rl.training.strategies import move_unpartitioned_state


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.partitioned = torch.nn.Linear(2, 2)
        self.partitioned.weight.ds_id = 0  # what ZeRO-3 marks its parameters with
        self.register_buffer("counts", torch.zeros(3))
        self.metrics = MetricCollection({"reward": MeanMetric()})


def test_zero3_setup_moves_metrics_buffers_and_unpartitioned_parameters_but_not_zero3_parameters():
    module = _Module()
    move_unpartitioned_state(module, torch.device("meta"))
    assert module.partitioned.weight.device.type == "cpu"  # DeepSpeed's, untouched
    assert module.partitioned.bias.device.type == "meta"  # no ds_id: moved
    assert module.counts.device.type == "meta"
    assert module.metrics["reward"].mean_value.device.type == "meta"
    assert module.device.type == "meta"  # the module's own `device`, which the algorithms create tensors on


class _FSDPRoot(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)
        self.clipped_with: list[float] = []

    def clip_grad_norm_(self, max_norm: float) -> None:
        self.clipped_with.append(max_norm)


def _clip(strategy, algorithm: str) -> None:
    fake = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy), clip_gradients=None)
    optimizer = torch.optim.SGD(strategy.model.parameters(), lr=0.1)
    PolicyModule.configure_gradient_clipping(fake, optimizer, 0.5, algorithm)


def test_fsdp_norm_clipping_goes_through_the_fsdp_root():
    strategy = FSDPStrategy()
    strategy.model = _FSDPRoot()
    _clip(strategy, "norm")
    assert strategy.model.clipped_with == [0.5]


def test_fsdp2_norm_clipping_uses_torchs_clip_over_the_roots_parameters():
    strategy = FSDPStrategy()
    strategy.model = torch.nn.Linear(2, 2)  # no clip_grad_norm_ of its own (FSDP2's fully_shard)
    strategy.model.weight.grad = torch.full((2, 2), 10.0)
    strategy.model.bias.grad = torch.zeros(2)
    _clip(strategy, "norm")
    assert torch.linalg.vector_norm(strategy.model.weight.grad).item() == pytest.approx(0.5, rel=1e-5)
