"""Engine-independent rollout pieces: padding ragged engine output, seeds, and the truncated importance-sampling
correction of the GRPO loss (hand-computed)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_rl.losses import grpo_loss
from lit_rl.losses.grpo import rollout_is_weights
from lit_rl.rollout.base import draw_seeds, global_batch_seeds, padded_output, unpadded_prompts


def test_padded_output_masks_up_to_the_first_eos_and_never_padding():
    # Row 0 ends with EOS (2); row 1 was cut by the budget; row 2 stopped early without EOS (context full).
    out = padded_output(
        [[5, 2], [5, 6, 7], [9]], [[-1.0, -2.0], [-1.0, -1.0, -1.0], [-3.0]], [2], 0, torch.device("cpu")
    )
    assert out.completion_ids.tolist() == [[5, 2, 0], [5, 6, 7], [9, 0, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out.logprobs.tolist() == [[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-3.0, 0.0, 0.0]]


def test_padded_output_rejects_mismatched_logprobs():
    with pytest.raises(RuntimeError, match="2 tokens but 1 log-probs"):
        padded_output([[5, 2]], [[-1.0]], [2], 0, torch.device("cpu"))


def test_unpadded_prompts_and_reproducible_seeds():
    ids = torch.tensor([[0, 0, 7], [3, 4, 5]])
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    assert unpadded_prompts(ids, mask) == [[7], [3, 4, 5]]
    torch.manual_seed(3)
    first = draw_seeds(4)
    torch.manual_seed(3)
    assert draw_seeds(4) == first and len(set(first)) == 4


def test_the_run_seed_changes_every_sampling_seed_and_seed_0_keeps_its_stream():
    """`seed_everything` reaches the samples: the seeds of a generation differ between run seeds (they were the
    same: torch's CPU generator kept only the low 32 bits of `run_seed * 2**32 + generation`), are the same for the
    same seed, and seed 0's are the draws of torch's generator seeded with the generation, as every recorded run
    and golden number was sampled."""
    by_seed = {seed: global_batch_seeds(seed, 3, 64) for seed in (0, 1, 2, 42, 2**32 - 1)}
    assert len({tuple(seeds) for seeds in by_seed.values()}) == len(by_seed)
    assert all(not set(by_seed[0]) & set(seeds) for seed, seeds in by_seed.items() if seed)  # no seed shared
    assert global_batch_seeds(1, 3, 64) == by_seed[1] and global_batch_seeds(1, 4, 64) != by_seed[1]
    stream = torch.randint(0, 2**31 - 1, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    assert by_seed[0] == stream
    assert all(0 <= seed < 2**31 - 1 for seeds in by_seed.values() for seed in seeds)


def test_token_truncated_is_weights_by_hand():
    old = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.4, 0.9]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # ratios 0.5/0.25 = 2 (capped at 1.5), 0.2/0.4 = 0.5, padding 0
    weights, changed = rollout_is_weights("token_truncate", old, rollout, mask, cap=1.5)
    assert weights[0].tolist() == pytest.approx([1.5, 0.5, 0.0])
    assert changed[0].tolist() == [True, False, False]  # the capped token


def test_grpo_loss_weighs_the_policy_term_by_the_importance_weights():
    logprobs = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    mask = torch.ones(1, 2)
    weights = torch.tensor([[2.0, 0.5]])
    # On-policy (ratio 1), A = 1: the per-token loss is -w_t; sequence mean over 2 tokens = -(2 + 0.5) / 2.
    loss, _ = grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask, importance_weights=weights)
    assert loss.item() == pytest.approx(-1.25)
    loss.backward()
    # d/dlogp of -w * exp(logp - old) at logp = old is -w, over 2 tokens.
    assert logprobs.grad[0].tolist() == pytest.approx([-1.0, -0.25])
    # No weights is w = 1.
    plain, _ = grpo_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), mask)
    assert plain.item() == pytest.approx(-1.0)
    assert math.isfinite(plain.item())
