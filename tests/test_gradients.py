"""Clipping by the global gradient norm: torch's result bit for bit, without the multiply on steps under the cap,
and the path every unscaled precision of the training module takes."""

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lit_rl.algorithms import GRPO
from lit_rl.errors import ConfigError
from lit_rl.training.gradients import clip_grad_norm_
from tests.conftest import grouped_kwargs


def _params(dtype: torch.dtype, norm: float) -> list[torch.nn.Parameter]:
    """Three parameters (one without a gradient) whose gradients have global L2 norm `norm`."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in [(64, 32), (32,), (8, 8)]]
    grads = [torch.randn(p.shape, generator=generator, dtype=torch.float64) for p in params[:2]]
    scale = norm / torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    for p, g in zip(params, grads):
        p.grad = (g * scale).to(dtype)
    return params


def _copy(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for copy, p in zip(copies, params):
        copy.grad = None if p.grad is None else p.grad.clone()
    return copies


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [0.25, 0.9999995, 3.0])  # under; under, yet torch's +1e-6 scales it; over
def test_clipping_gives_torchs_gradients_bit_for_bit(dtype, norm):
    ours = _params(dtype, norm)
    theirs = _copy(ours)
    clip_grad_norm_(ours, 1.0)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    for mine, torchs in zip(ours, theirs):
        assert (mine.grad is None) == (torchs.grad is None)
        if mine.grad is not None:
            assert torch.equal(mine.grad, torchs.grad)
    total = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in ours if p.grad is not None]))
    assert total == pytest.approx(min(norm, 1.0), rel=1e-2)


def test_gradients_under_the_cap_are_not_multiplied(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *args: calls.append(args))
    clip_grad_norm_(_params(torch.float32, 0.5), 1.0)
    assert calls == []
    clip_grad_norm_(_params(torch.float32, 2.0), 1.0)
    assert len(calls) == 1


@pytest.mark.parametrize("cap", [0.5, 1e6])  # every gradient scaled; none
@pytest.mark.parametrize(
    "precision, plugin, dtype",
    [
        ("32-true", Precision(), torch.float32),
        ("bf16-true", HalfPrecision("bf16-true"), torch.bfloat16),
        ("16-true", HalfPrecision("16-true"), torch.float16),
        ("bf16-mixed", MixedPrecision("bf16-mixed", "cpu"), torch.float32),
    ],
)
def test_every_unscaled_precision_clips_the_policy_with_it(precision, plugin, dtype, cap, monkeypatch):
    """fp32, bf16-true, 16-true and bf16-mixed clip through `clip_grad_norm_` (Lightning's own path multiplies every
    step), to torch's gradients bit for bit, over the cap and under it."""
    model = _module(precision, plugin, dtype)
    if dtype == torch.float16:  # which AdamW cannot train (the test below); clipping is the optimizer's own business
        optimizer = torch.optim.SGD(model.policy.parameters(), lr=0.1)
    else:
        optimizer = model.configure_optimizers()["optimizer"]
    expected = [p.grad.clone() for p in model.policy.parameters()]
    torch.nn.utils.clip_grad_norm_(_with_grads(expected), cap)  # clips `expected` in place
    monkeypatch.setattr(model, "clip_gradients", lambda *args: pytest.fail("Lightning's clipping path was taken"))
    model.configure_gradient_clipping(optimizer, cap, "norm")
    assert all(p.grad.dtype == dtype for p in model.policy.parameters())
    assert all(torch.equal(p.grad, e) for p, e in zip(model.policy.parameters(), expected))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adamw_on_float16_parameters_is_refused_in_one_line_naming_the_setting(dtype):
    """float16 parameters under AdamW: its second moment underflows to 0 while the first does not, so a step whose
    gradient is small (here 0: a token the batch does not use) moves by lr * m / eps. Shown on one parameter
    first, then refused for the module's (bfloat16 and float32 train)."""
    param = torch.nn.Parameter(torch.ones(4, dtype=dtype))
    adamw = torch.optim.AdamW([param], lr=1e-4, fused=True)
    for gradient in (1e-3, 0.0, 0.0):
        param.grad = torch.full((4,), gradient, dtype=dtype)
        adamw.step()
    moved = (1 - param.detach().float()).abs().max().item()
    assert moved > 1.0 if dtype == torch.float16 else moved < 1e-3  # three steps of lr 1e-4 move at most ~3e-4
    model = _module("16-true" if dtype == torch.float16 else "32-true", Precision(), dtype)
    if dtype != torch.float16:
        assert model.configure_optimizers()["optimizer"]
        return
    with pytest.raises(ConfigError) as refused:
        model.configure_optimizers()
    assert str(refused.value).startswith("trainer.precision 16-true: AdamW cannot train float16 parameters (")
    assert "\n" not in str(refused.value)


def test_a_scaled_precision_leaves_clipping_to_lightnings_path(monkeypatch):
    """fp16 mixed precision unscales first (its scaler), as DeepSpeed clips in its engine: the module's
    `clip_gradients`, Lightning's, runs, with the hook's arguments, and the gradients are left to it."""
    model = _module("16-mixed", SimpleNamespace(precision="16-mixed"), torch.float32)
    optimizer = model.configure_optimizers()["optimizer"]
    before = [p.grad.clone() for p in model.policy.parameters()]
    calls = []
    monkeypatch.setattr(model, "clip_gradients", lambda *args: calls.append(args))
    model.configure_gradient_clipping(optimizer, 0.5, "norm")
    assert calls == [(optimizer, 0.5, "norm")]
    assert all(torch.equal(p.grad, b) for p, b in zip(model.policy.parameters(), before))


@pytest.mark.parametrize("cap", [0.0, -1.0])
def test_a_cap_of_zero_or_less_clips_nothing_as_in_lightning(cap):
    model = _module("32-true", Precision(), torch.float32)
    optimizer = model.configure_optimizers()["optimizer"]
    before = [p.grad.clone() for p in model.policy.parameters()]
    model.configure_gradient_clipping(optimizer, cap, "norm")
    assert all(torch.equal(p.grad, b) for p, b in zip(model.policy.parameters(), before))


def test_a_nan_norm_makes_every_gradient_nan_as_in_torch():
    ours = _params(torch.float32, 2.0)
    ours[0].grad[0, 0] = float("nan")
    theirs = _copy(ours)
    clip_grad_norm_(ours, 1.0)
    torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert all(p.grad.isnan().all() and q.grad.isnan().all() for p, q in zip(ours[:2], theirs[:2]))


def _module(precision: str, plugin, dtype: torch.dtype) -> GRPO:
    """A GRPO module in `dtype` under `plugin` (no FSDP), every parameter with a seeded random gradient."""
    model = GRPO(**grouped_kwargs(GRPO, num_generations=4, micro_batch_size=8))
    model.configure_model()
    model.policy.to(dtype)
    model._trainer = SimpleNamespace(precision=precision, precision_plugin=plugin, strategy=None)
    generator = torch.Generator().manual_seed(0)
    for p in model.policy.parameters():
        p.grad = torch.randn(p.shape, generator=generator).to(dtype)
    return model


def _with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Stand-in parameters holding `grads` (the same tensors: clipping them in place clips `grads`)."""
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params


def test_the_guards_norm_is_taken_by_clipping_once_and_only_for_the_same_values(monkeypatch):
    """The non-finite guard hands its norm over: the clipping that follows reads no gradient again; a gradient
    written in place in between (its version counter moves), other tensors, or a second clipping compute anew."""
    from lit_rl.callbacks.safety import has_non_finite

    computed = []
    get_total_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: computed.append(1) or get_total_norm(*a, **k))
    params = _params(torch.float32, 2.0)
    expected = _copy(params)
    torch.nn.utils.clip_grad_norm_(expected, 1.0)
    assert not has_non_finite([p.grad for p in params if p.grad is not None])
    clip_grad_norm_(params, 1.0)
    assert len(computed) == 1  # the guard's, taken by clipping
    assert all(torch.equal(p.grad, e.grad) for p, e in zip(params[:2], expected[:2]))
    clip_grad_norm_(params, 1.0)  # nothing handed over now: computed again
    assert len(computed) == 2

    params = _params(torch.float32, 2.0)
    assert not has_non_finite([p.grad for p in params if p.grad is not None])
    params[0].grad.mul_(3.0)  # written in place after the guard: the handed-over norm is stale
    expected = _copy(params)
    torch.nn.utils.clip_grad_norm_(expected, 1.0)
    clip_grad_norm_(params, 1.0)
    assert all(torch.equal(p.grad, e.grad) for p, e in zip(params[:2], expected[:2]))

    assert not has_non_finite([p.grad for p in _params(torch.float32, 0.5) if p.grad is not None])
    before = len(computed)
    clip_grad_norm_(params, 1.0)  # other tensors than the guard's
    assert len(computed) == before + 1
