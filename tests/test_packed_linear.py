"""Packed float32 weights for CPU decoding (`lit_rl.rollout.engines.packed_linear`): the same products as
`F.linear`, a weight packed again when it changes, nothing packed outside a generation or where the result would
differ (autocast, gradients), and the compiled decoder packing each large weight once per generation and freeing the
packs after."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from lit_rl.rollout.engines import packed_linear
from lit_rl.rollout.engines.packed_linear import MIN_PACKED_BYTES, PackedLinearMode, packed_weights

pytestmark = pytest.mark.skipif(not packed_linear._PACKS_FLOAT32, reason="this CPU does not pack float32 weights")


def large_weight() -> torch.Tensor:
    """The smallest [out, 512] float32 weight that is packed."""
    return torch.randn(MIN_PACKED_BYTES // (512 * 4), 512) / 512**0.5


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("shape", [(16, 512), (16, 1, 512)], ids=["rows", "rows_by_token"])
def test_packed_products_are_f_linear_s(bias, shape):
    torch.manual_seed(0)
    weight = large_weight()
    b = torch.randn(weight.shape[0]) if bias else None
    x = torch.randn(*shape)
    with torch.no_grad(), packed_weights() as packs, PackedLinearMode():
        y = F.linear(x, weight, b)
        assert len(packs) == 1  # the call went through the pack
    torch.testing.assert_close(y, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again():
    torch.manual_seed(0)
    weight, x = large_weight(), torch.randn(16, 512)
    with torch.no_grad(), packed_weights() as packs, PackedLinearMode():
        before = F.linear(x, weight)
        weight.mul_(-1)  # what an optimizer step does to a weight: in place, its version counter moves
        after = F.linear(x, weight)
        assert [version for version, _ in packs.values()] == [weight._version]
    torch.testing.assert_close(after, -before, rtol=0, atol=0)


def test_nothing_is_packed_outside_a_generation_or_where_the_result_would_differ():
    torch.manual_seed(0)
    weight, x = large_weight(), torch.randn(16, 512)
    with torch.no_grad(), PackedLinearMode():  # no generation: the op is F.linear
        torch.testing.assert_close(torch.ops.lit_rl.packed_linear(x, weight, None), F.linear(x, weight))
    with packed_weights() as packs, PackedLinearMode():
        F.linear(x, weight.requires_grad_())  # training: gradients flow through F.linear
        weight.requires_grad_(False)
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast computes in its own dtype
                F.linear(x.float(), weight.float())
            F.linear(x, weight[:1])  # too small to pay for its pack
            F.linear(x.bfloat16(), weight.bfloat16())  # only float32 is packed
            F.linear(x.double(), weight.double())
        assert packs == {}
    assert packed_linear._packs is None


def test_compiled_decoding_packs_each_large_weight_once_per_generation_and_frees_them(monkeypatch):
    """The 21M-parameter shape of `benchmarks/compiled_decoding.py`: every linear of at least `MIN_PACKED_BYTES` is
    packed once for the generation's rows, and the packs are gone when it returns."""
    from transformers import Qwen2ForCausalLM

    from lit_rl.modeling.models import tiny_qwen2_config
    from lit_rl.rollout import HFGenerateEngine, SamplingParams
    from lit_rl.rollout.engines import static_decode

    torch.manual_seed(0)
    config = tiny_qwen2_config(hidden_size=512, num_hidden_layers=2, intermediate_size=1024)
    model = Qwen2ForCausalLM(config).eval()
    seen = []  # each generation's packs, as they were at its end

    @contextmanager
    def recorded():
        with packed_weights() as packs:
            yield packs
            seen.append(dict(packs))

    monkeypatch.setattr(static_decode, "packed_weights", recorded)
    eager = HFGenerateEngine(model, eos_token_ids=1, pad_token_id=0)
    compiled = HFGenerateEngine(model, eos_token_ids=1, pad_token_id=0, compiled=True)
    ids = torch.randint(3, config.vocab_size, (4, 5))
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0)
    a = eager.generate(ids, torch.ones_like(ids), params, seeds=[1, 2, 3, 4])
    b = compiled.generate(ids, torch.ones_like(ids), params, seeds=[1, 2, 3, 4])
    assert torch.equal(a.completion_ids, b.completion_ids)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
    large = [
        m.weight
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.numel() * m.weight.element_size() >= MIN_PACKED_BYTES
    ]
    assert len(large) == 2 * 7 + 1  # every projection of both layers, and the LM head (320 x 512, 640 KiB)
    assert len(seen) == 1
    assert sorted(seen[0]) == sorted((w.data_ptr(), len(ids)) for w in large)  # each once, for the 4 rows
    assert packed_linear._packs is None  # freed with the generation
