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
