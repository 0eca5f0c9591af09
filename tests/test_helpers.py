"""The comparison helpers the invariance tests rely on fail on every kind of difference they could hide."""

import pytest

from tests.conftest import assert_rows_match

REFERENCE = [{"step": 1.0, "train/loss": 0.5, "train/kl": 0.1}, {"step": 2.0, "train/loss": 0.4, "train/kl": 0.2}]


def test_rows_match_passes_on_equal_rows_and_on_a_resumed_subset():
    assert_rows_match([dict(row) for row in REFERENCE], REFERENCE, abs=1e-9)
    assert_rows_match([dict(REFERENCE[1])], REFERENCE, abs=1e-9)


@pytest.mark.parametrize(
    "rows",
    [
        [{"step": 1.0, "train/loss": 0.5}],  # a metric missing in the candidate
        [{"step": 1.0, "train/loss": 0.5, "train/kl": 0.1, "train/entropy": 1.0}],  # one only the candidate has
        [{"step": 1.0, "train/loss": 0.5, "train/kl": 0.1001}],  # a value off by more than the tolerance
        [{"step": 3.0, "train/loss": 0.5, "train/kl": 0.1}],  # a step the reference does not have
        [],  # nothing compared
    ],
)
def test_rows_match_fails_on_any_difference(rows):
    with pytest.raises(AssertionError):
        assert_rows_match(rows, REFERENCE, abs=1e-6)
