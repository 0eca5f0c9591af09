"""Token-budget grouping by hand (`lit_rl.training.micro_batches`)."""

from lit_rl.training.micro_batches import token_budget_micro_batches


def test_units_are_grouped_first_fit_in_decreasing_size_within_the_budget():
    # Sizes 5, 2, 4, 3, 1, budget 6: 5 -> A; 4 -> B; 3 -> C; 2 -> B (4 + 2 = 6); 1 -> A (5 + 1 = 6).
    assert token_budget_micro_batches([5, 2, 4, 3, 1], 6, 4) == [[0, 4], [1, 2], [3]]
    # Everything fits in one: one micro-batch, the rest of the step's micro-steps run empty.
    assert token_budget_micro_batches([1, 2, 3], 10, 4) == [[0, 1, 2]]
    # A unit larger than the budget gets a micro-batch of its own.
    assert token_budget_micro_batches([9, 1], 4, 3) == [[0], [1]]


def test_over_budget_units_join_the_micro_batch_with_the_fewest_tokens():
    # Budget 6, at most 2 micro-batches: 5 -> A, 5 -> B (A is full), 5 fits nowhere -> the fewer of A (5), B (5):
    # the first; then 2 -> B (5 + 2 = 7 > 6: over budget, B has fewer).
    assert token_budget_micro_batches([5, 5, 5, 2], 6, 2) == [[0, 2], [1, 3]]
