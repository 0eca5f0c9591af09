"""Optimised numerics against naive references."""

import pytest
import torch

from lit_rl.ops import entropy_from_logits, kl_k3, masked_sum, position_ids_from_mask, token_logprobs
from lit_rl.rollout.base import completion_mask_from_ids


def test_token_logprobs_matches_full_log_softmax_across_chunks():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 50)
    ids = torch.randint(0, 50, (3, 7))
    for temperature in (1.0, 0.7):
        naive = torch.log_softmax(logits / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
        chunked = token_logprobs(logits, ids, temperature, chunk_size=4)  # 21 rows: uneven chunks
        assert torch.allclose(chunked, naive, atol=1e-6)


def test_token_logprobs_has_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long)).sum().backward()
    assert logits.grad.abs().sum() > 0


def test_entropy_matches_naive():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 9)
    p = torch.softmax(logits / 0.5, -1)
    naive = -(p * p.log()).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, 0.5, chunk_size=3), naive, atol=1e-6)


def test_masked_sum_and_empty_rows():
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert masked_sum(values, mask).item() == 3.0
    assert masked_sum(values, mask, dim=1).tolist() == [3.0, 0.0]


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_completion_mask_keeps_first_eos_only():
    eos = 9
    ids = torch.tensor([[1, 2, eos, 0, 0], [1, 1, 1, 1, 1], [eos, eos, 3, 3, 3]])
    assert completion_mask_from_ids(ids, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_k3_kl_is_accurate_for_log_prob_differences_near_float32_rounding():
    # k3 = exp(d) - d - 1 = d^2 / 2 + d^3 / 6 + ...; for d = 1e-3 and 1e-6 in float32, exp(d) - 1 cancels to noise
    # (5% off and exactly 0 with that formula).
    logprobs = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float32)
    ref_logprobs = logprobs + torch.tensor([1e-3, -1e-6, 0.5], dtype=torch.float32)
    delta = (ref_logprobs - logprobs).double().tolist()  # the differences float32 can hold
    expected = [d * d / 2 + d**3 / 6 + d**4 / 24 + d**5 / 120 + d**6 / 720 for d in delta]
    got = kl_k3(logprobs, ref_logprobs).tolist()
    for value, reference in zip(got, expected, strict=True):
        assert value == pytest.approx(reference, rel=1e-2, abs=0)
