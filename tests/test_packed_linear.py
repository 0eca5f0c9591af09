"""Packed float32 weights for CPU decoding (`lit_rl.rollout.engines.packed_linear`): the same products as
`F.linear`, a weight packed again when it changes, nothing packed outside a generation or for what the pack cannot
serve (views, odd biases, other dtypes, autograd, autocast), and the compiled decoder packing each large parameter
once per generation, sampling what the eager loop samples across an optimizer-like update, and freeing the packs."""

import pytest
import torch
import torch.nn.functional as F

from lit_rl.rollout.engines import packed_linear
from lit_rl.rollout.engines.packed_linear import MIN_PACKED_BYTES, PackedLinearMode, packed_weights

pytestmark = pytest.mark.skipif(not packed_linear._PACKS_FLOAT32, reason="this CPU does not pack float32 weights")


def large_weight() -> torch.nn.Parameter:
    """The smallest [out, 512] float32 parameter that is packed."""
    return torch.nn.Parameter(torch.randn(MIN_PACKED_BYTES // (512 * 4), 512) / 512**0.5, requires_grad=False)


@pytest.fixture
def pack_calls(monkeypatch) -> list:
    """The (address, rows) of every packing."""
    calls, pack = [], packed_linear.pack

    def counted(weight, rows):
        calls.append((weight.data_ptr(), rows))
        return pack(weight, rows)

    monkeypatch.setattr(packed_linear, "pack", counted)
    return calls


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", [(16, 512), (16, 1, 512)], ids=["rows", "rows_by_token"])
def test_packed_products_are_f_linear_s(bias, shape, pack_calls):
    torch.manual_seed(0)
    weight = large_weight()
    b = torch.randn(weight.shape[0]) if bias else None
    x = torch.randn(*shape)
    with torch.no_grad(), packed_weights(), PackedLinearMode():
        y = F.linear(x, weight, b)
        again = F.linear(x, weight, b)
    assert pack_calls == [(weight.data_ptr(), 16)]  # packed once, then reused
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(again, y)


def test_a_weight_changed_in_place_is_packed_again(pack_calls):
    torch.manual_seed(0)
    weight, x = large_weight(), torch.randn(16, 512)
    with torch.no_grad(), packed_weights(), PackedLinearMode():
        before = F.linear(x, weight)
        weight.mul_(-1)  # what an optimizer step does to a weight: in place, its version counter moves
        after = F.linear(x, weight)
    assert len(pack_calls) == 2
    torch.testing.assert_close(after, -before, rtol=0, atol=0)


def test_nothing_is_packed_outside_a_generation_or_where_a_pack_cannot_serve(pack_calls):
    torch.manual_seed(0)
    weight, x = large_weight(), torch.randn(16, 512)
    with torch.no_grad(), PackedLinearMode():  # no generation: the op is F.linear
        torch.testing.assert_close(torch.ops.lit_rl.packed_linear(x, weight, None), F.linear(x, weight))
    with packed_weights() as packs, PackedLinearMode():
        trained = torch.nn.Parameter(weight.detach().clone())
        F.linear(x, trained)  # autograd: the op has no backward
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast computes in bfloat16
                F.linear(x, weight)
            F.linear(x, torch.nn.Parameter(weight[:1].clone()))  # too small to repay its pack
            F.linear(x, weight[:256])  # views start where their parameter does: they could take its pack
            F.linear(x[:, :256], weight.t()[:256])
            F.linear(x, weight.detach().clone())  # not a parameter (a weight computed in the forward)
            F.linear(x, weight, torch.randn(1))  # a broadcast bias
            F.linear(x.bfloat16(), torch.nn.Parameter(weight.bfloat16()))  # only float32 is packed
            F.linear(x.double(), torch.nn.Parameter(weight.double()))
        assert packs == {}
    assert pack_calls == []
    assert getattr(packed_linear._generation, "packs", None) is None


def test_compiled_decoding_packs_each_large_parameter_once_per_generation(pack_calls):
    """The 21M-parameter shape of `benchmarks/compiled_decoding.py` (2 layers): every linear of at least
    `MIN_PACKED_BYTES` is packed once per generation for its rows, also after an in-place update of the weights,
    and the compiled tokens and log-probs stay the eager loop's; under autocast nothing is packed."""
    from transformers import Qwen2ForCausalLM

    from lit_rl.modeling.models import tiny_qwen2_config
    from lit_rl.rollout import HFGenerateEngine, SamplingParams

    torch.manual_seed(0)
    config = tiny_qwen2_config(hidden_size=512, num_hidden_layers=2, intermediate_size=1024)
    model = Qwen2ForCausalLM(config).eval()
    large = [
        m.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.numel() * m.weight.element_size() >= MIN_PACKED_BYTES
    ]
    assert len(large) == 2 * 7 + 1  # every projection of both layers, and the LM head (320 x 512, 640 KiB)
    eager = HFGenerateEngine(model, eos_token_ids=1, pad_token_id=0)
    compiled = HFGenerateEngine(model, eos_token_ids=1, pad_token_id=0, compiled=True)
    ids = torch.randint(3, config.vocab_size, (4, 5))
    mask, seeds = torch.ones_like(ids), [1, 2, 3, 4]
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0)

    def same_samples() -> torch.Tensor:
        a, b = eager.generate(ids, mask, params, seeds), compiled.generate(ids, mask, params, seeds)
        assert torch.equal(a.completion_ids, b.completion_ids)
        torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
        return b.logprobs

    first = same_samples()
    assert sorted(pack_calls) == sorted((w.data_ptr(), len(ids)) for w in large)  # each once, for the 4 rows
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    assert not torch.equal(same_samples(), first)  # the second generation sampled from the updated weights
    assert len(pack_calls) == 2 * len(large)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled.generate(ids, mask, params, seeds)
    assert len(pack_calls) == 2 * len(large)
    assert getattr(packed_linear._generation, "packs", None) is None  # freed with each generation
