"""Precision without a Trainer: which dtype a vLLM engine computes in, when GRPO's importance-sampling correction
turns itself on, and gradient clipping under bf16-mixed with the fused optimizer."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lit_rl.algorithms import GRPO
from tests.conftest import grouped_kwargs


def _grpo(precision: str, **kwargs) -> GRPO:
    model = GRPO(**grouped_kwargs(GRPO, num_generations=4, micro_batch_size=8, **kwargs))
    model.configure_model()
    plugin = MixedPrecision(precision, "cpu") if precision.endswith("-mixed") else None
    model._trainer = SimpleNamespace(precision=precision, precision_plugin=plugin, strategy=None)  # not FSDP
    return model


@pytest.mark.parametrize(
    "precision, vllm, engine_dtype, correction",
    [
        ("32-true", None, None, "none"),  # HF generate: the policy samples itself
        ("bf16-mixed", None, None, "none"),
        ("32-true", {"mode": "colocate"}, torch.float32, "none"),  # fp32 on both sides: rounding only
        ("bf16-mixed", {"mode": "colocate"}, torch.bfloat16, "token_truncate"),
        ("bf16-true", {"mode": "colocate"}, torch.bfloat16, "token_truncate"),  # same dtype, different bf16 kernels
        ("32-true", {"mode": "colocate", "dtype": "bfloat16"}, torch.bfloat16, "token_truncate"),
        # The trainer is bf16.
        ("bf16-mixed", {"mode": "colocate", "dtype": "float32"}, torch.float32, "token_truncate"),
        ("32-true", {"mode": "server"}, None, "token_truncate"),  # the server's dtype is its own
        ("32-true", {"mode": "server", "dtype": "float32"}, torch.float32, "none"),
    ],
)
def test_auto_is_correction_follows_the_engine_and_trainer_dtypes(precision, vllm, engine_dtype, correction):
    model = _grpo(precision, vllm=vllm)
    assert model.engine_config.engine_dtype(model.compute_dtype()) == engine_dtype
    assert model.rollout_correction() == correction


@pytest.mark.parametrize("mode", ["none", "token_truncate"])
def test_an_explicit_is_correction_is_kept(mode):
    assert _grpo("bf16-mixed", vllm={"mode": "colocate"}, rollout_is_correction=mode).rollout_correction() == mode


@pytest.mark.parametrize("algorithm, limit", [("norm", 0.5), ("value", 0.01)])
def test_bf16_mixed_clips_gradients_with_the_fused_optimizer(algorithm, limit):
    model = _grpo("bf16-mixed")
    optimizer = model.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"]
    for p in model.policy.parameters():
        p.grad = torch.randn_like(p)
    model.configure_gradient_clipping(optimizer, limit, algorithm)
    grads = [p.grad for p in model.policy.parameters()]
    if algorithm == "norm":
        assert torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])) == pytest.approx(limit, rel=1e-4)
    else:
        assert max(g.abs().max() for g in grads) <= limit


def test_fp16_mixed_precision_uses_the_unfused_optimizer():
    # The gradient scaler unscales before clipping; a fused AdamW would unscale inside its step instead.
    assert not _grpo("16-mixed").configure_optimizers()["optimizer"].defaults["fused"]
