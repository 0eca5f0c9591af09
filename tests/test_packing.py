"""Padding-free forwards: the packed layout by hand, and logits and gradients equal to each row run alone, to the
padded forward and to the shared-prompt forward (fp32, 1e-5)."""

import pytest
import torch

from lit_rl.modeling.completions import completion_forward
from lit_rl.modeling.models import load_causal_lm, load_tokenizer
from lit_rl.modeling.packing import assign_rows, pack_completions, packed_completion_forward, packed_layout
from lit_rl.ops import token_logprobs
from tests.test_shared_prompts import count_input_tokens, plain_forward

MODEL = "lit-rl/tiny-qwen2-addition-sft"


def test_rows_are_filled_first_fit_in_decreasing_length():
    # Lengths 5, 2, 4, 3, 1 into rows of 5: [5], [4, 1], [3, 2]; ties keep the sequences' order.
    assert assign_rows([5, 2, 4, 3, 1], 5) == [[0], [2, 4], [3, 1]]
    assert assign_rows([2, 2, 2], 4) == [[0, 1], [2]]
    assert assign_rows([5, 2, 4], None) == [[0, 1, 2]]
    assert assign_rows([7, 2], 5) == [[0], [1]]  # longer than a row: a row of its own


def test_packed_layout_by_hand():
    # Row 0: prompt [11, 12] (one pad), completion [21, 22, 0] with 2 real tokens -> sequence of 4.
    # Row 1: prompt [13] (two pads), completion [23, 0, 0] with 1 real token -> sequence of 2.
    # Row 2: prompt [14, 15, 16], completion [24, 25, 26] -> sequence of 6 (the longest: the row capacity).
    prompt_ids = torch.tensor([[0, 11, 12], [0, 0, 13], [14, 15, 16]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[21, 22, 0], [23, 0, 0], [24, 25, 26]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    packed = pack_completions(prompt_ids, prompt_mask, completion_ids, completion_mask)
    # First fit, decreasing: [seq 2], [seq 0, seq 1] (4 + 2 = 6 fits).
    assert packed.input_ids.tolist() == [[14, 15, 16, 24, 25, 26], [11, 12, 21, 22, 13, 23]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1]]
    # Logit at a sequence's position p - 1 + t predicts its completion token t.
    kept = list(zip(packed.logit_rows.tolist(), packed.logit_columns.tolist()))
    targets = list(zip(packed.target_rows.tolist(), packed.target_columns.tolist()))
    assert sorted(zip(targets, kept)) == [
        ((0, 0), (1, 1)),
        ((0, 1), (1, 2)),
        ((1, 0), (1, 4)),
        ((2, 0), (0, 2)),
        ((2, 1), (0, 3)),
        ((2, 2), (0, 4)),
    ]
    assert packed.dummy_tokens == 0
    one = pack_completions(prompt_ids, prompt_mask, completion_ids, completion_mask, single_row=True)
    assert one.input_ids.tolist() == [[11, 12, 21, 22, 13, 23, 14, 15, 16, 24, 25, 26]]
    assert one.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5]]


def test_rows_end_with_a_dummy_sequence_of_its_own_positions():
    prompt_ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    packed = pack_completions(prompt_ids, prompt_mask, completion_ids, completion_mask)
    # Lengths 5, 3, 4. Width 5 (1x the longest): [seq 0], [seq 2], [seq 1], 15 positions; width 6: the same;
    # width 7 (1.5x): [seq 0], [seq 2, seq 1], 2 x 7 = 14 positions, the fewest (10 at 2x does not fit: 12 > 10).
    assert packed.input_ids.tolist() == [[5, 6, 1, 2, 3, 0, 0], [9, 10, 5, 6, 7, 8, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 1, 2]]
    assert packed.dummy_tokens == 2


def test_the_row_width_computing_the_fewest_positions_is_chosen():
    # Longest 5. Capacity 5: [5], [5], [3], [3] -> 4 rows x 5 = 20 positions; 6 (1.25x) and 7 (1.5x): [5], [5],
    # [3, 3] -> 3 rows x 6 = 18, the fewest (the first such wins); 10 (2x): [5, 5], [3, 3] -> 2 x 10 = 20.
    assert packed_layout([5, 5, 3, 3], single_row=False) == [[0], [1], [2, 3]]
    assert packed_layout([4, 4, 2, 2], single_row=True) == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "prompt_mask, completion_mask, message",
    [
        ([[1, 1, 0]], [[1, 1]], "prompt_mask of row 0 is not 0s then 1s"),
        ([[0, 1, 1]], [[0, 1]], "completion_mask of row 0 is not 1s then 0s"),
        ([[1, 1], [0, 0]], [[1, 0], [1, 0]], "row 1 has an empty prompt"),
    ],
)
def test_masks_that_are_not_left_padded_prompts_or_prefix_completions_are_refused(
    prompt_mask, completion_mask, message
):
    prompt_mask, completion_mask = torch.tensor(prompt_mask), torch.tensor(completion_mask)
    with pytest.raises(ValueError, match=message):
        pack_completions(torch.ones_like(prompt_mask), prompt_mask, torch.ones_like(completion_mask), completion_mask)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def variable_batch(tokenizer, group_size=3, new_tokens=7, seed=0):
    """Four left-padded prompts of different lengths, each `group_size` times (so shared prompts apply), with
    random completions of 1 to `new_tokens` real tokens."""
    enc = tokenizer(["1+2=", "45+67=", "9+99=", "123+4567="], padding=True, return_tensors="pt")
    prompt_ids = enc["input_ids"].repeat_interleave(group_size, 0)
    prompt_mask = enc["attention_mask"].repeat_interleave(group_size, 0)
    generator = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(0, 250, (len(prompt_ids), new_tokens), generator=generator)
    lengths = torch.randint(1, new_tokens + 1, (len(prompt_ids),), generator=generator)
    completion_mask = (torch.arange(new_tokens) < lengths[:, None]).long()
    assert len(set(lengths.tolist())) > 2 and (prompt_mask == 0).any()
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def each_row_alone(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The reference: every row's real tokens as a batch of one, no padding anywhere. [N, T, V], 0 where masked."""
    N, T = completion_ids.shape
    rows = []
    for i in range(N):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        c = int(completion_mask[i].sum())
        out = model(input_ids=torch.cat([prompt, completion_ids[i, :c]])[None], use_cache=False)
        logits = out.logits[0, len(prompt) - 1 : len(prompt) - 1 + c]  # [c, V]
        rows.append(torch.cat([logits, logits.new_zeros(T - c, logits.shape[-1])]))
    return torch.stack(rows)


def objective(logits, completion_ids, completion_mask):
    """A scalar whose gradient touches every kept logit: weighted sum of the completion tokens' log-probs."""
    weights = torch.linspace(-1.0, 2.0, completion_ids.numel()).view_as(completion_ids)
    return (token_logprobs(logits, completion_ids) * completion_mask * weights).sum()


def assert_close_to_scale(value, reference, tolerance, name):
    """max |value - reference| <= tolerance x max |reference|: float32 sums over differently shaped batches differ
    by rounding relative to the tensor's scale (measured: at most 1.9e-6 of it on any path), not to each element."""
    error = (value - reference).abs().max().item()
    assert error <= tolerance * reference.abs().max().item(), (name, error, reference.abs().max().item())


def gradients(model, forward, batch):
    model.zero_grad()
    logits = forward(model, *batch)
    objective(logits, batch[2], batch[3]).backward()
    return logits.detach() * batch[3][..., None], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("single_row", [False, True], ids=["rows", "one_row"])
def test_packed_logits_and_gradients_equal_each_row_alone_the_padded_and_the_shared_prompt_forward(
    tokenizer, monkeypatch, single_row
):
    model = load_causal_lm(MODEL)  # dropout off: every path sees the same function
    monkeypatch.setattr("lit_rl.modeling.packing.uses_flash_attention", lambda model: single_row)
    batch = variable_batch(tokenizer)
    counts = count_input_tokens(model)
    reference, reference_grads = gradients(model, each_row_alone, batch)
    counts.clear()
    packed, packed_grads = gradients(model, packed_completion_forward, batch)
    # One forward, of the real tokens (and at most the filler of the rows' ends) only.
    real = int(batch[1].sum() + batch[3].sum())
    N, P, T = batch[0].shape[0], batch[0].shape[1], batch[2].shape[1]
    assert len(counts) == 1 and real <= counts[0] < N * (P + T)
    if single_row:
        assert counts[0] == real
    padded, padded_grads = gradients(model, plain_forward, batch)
    shared, shared_grads = gradients(model, completion_forward, batch)  # prompts repeat: the shared-prompt path
    for logits, grads in ((packed, packed_grads), (padded, padded_grads), (shared, shared_grads)):
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            assert_close_to_scale(grad, reference_grads[name], 1e-5, name)
    assert packed.abs().max() > 1  # the comparison is of real logits


def test_completion_forward_runs_packed_when_asked(tokenizer):
    model = load_causal_lm(MODEL)
    batch = variable_batch(tokenizer)
    counts = count_input_tokens(model)
    with torch.no_grad():
        packed = completion_forward(model, *batch, padding_free=True)
        assert len(counts) == 1  # not the shared-prompt path's two forwards
        plain = plain_forward(model, *batch) * batch[3][..., None]
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
