import math

import pytest

from lit_rl.rewards import import_reward_function, reward_name
from lit_rl.rewards.arithmetic import correctness, integer_format
from lit_rl.rewards.scorer import call_reward_function


def test_correctness_and_format_by_hand():
    completions = ["46", " 46 ", "45", "4 6", "", "-3"]
    answers = ["46", "46", "46", "46", "46", "-3"]
    assert correctness([""] * 6, completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert integer_format([""] * 6, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]


def test_import_by_dotted_or_colon_path():
    assert import_reward_function("lit_rl.rewards.arithmetic.correctness") is correctness
    assert import_reward_function("lit_rl.rewards.arithmetic:integer_format") is integer_format
    assert reward_name("lit_rl.rewards.arithmetic:integer_format") == "integer_format"


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_module.fn", "cannot import module 'no_such_module'"),
        ("lit_rl.rewards.arithmetic.missing", "has no callable 'missing'"),
        ("correctness", "must look like"),
    ],
)
def test_bad_reward_paths_name_the_path(path, message):
    with pytest.raises(ValueError, match=message) as err:
        import_reward_function(path)
    assert repr(path) in str(err.value)


def test_wrong_number_of_values_is_reported_with_the_function_name():
    with pytest.raises(ValueError, match="'short' returned 1 values for 2 completions"):
        call_reward_function("short", lambda prompts, completions, **_: [1.0], ["a", "b"], ["x", "y"], {})


def test_none_becomes_nan():
    values = call_reward_function("f", lambda prompts, completions, **_: [None, 2], ["a", "b"], ["x", "y"], {})
    assert math.isnan(values[0]) and values[1] == 2.0


def test_an_invalid_value_names_its_column_as_a_function_or_an_environments_part():
    import torch

    from lit_rl.errors import RewardFunctionError
    from lit_rl.rewards.scorer import weighted_reward

    names, weights = ["correctness", "env/solved"], torch.ones(2)
    part = "^environment reward part 'env/solved' returned nan for completion 1"
    with pytest.raises(RewardFunctionError, match=part):
        weighted_reward(torch.tensor([[1.0, 0.0], [1.0, math.nan]]), weights, names, "error")
    with pytest.raises(RewardFunctionError, match="^reward function 'correctness' returned inf for completion 0"):
        weighted_reward(torch.tensor([[math.inf, 0.0]]), weights, names, "error")
