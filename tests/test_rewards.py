import math

import numpy as np
import pytest
import torch

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import import_reward_function, reward_name
from lit_rl.rewards.arithmetic import correctness, integer_format
from lit_rl.rewards.scorer import call_reward_function, call_reward_functions


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


@pytest.mark.parametrize("result", ["10", None, 1.0, {"a": 1.0, "b": 2.0}, torch.tensor(1.0)], ids=repr)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_result_that_is_not_a_list_of_numbers_is_named_alike_sync_or_async(result, kind):
    """A sync function's result went through `list()`: a text became its characters, a number or None 'raised
    TypeError: ... not iterable'."""

    def sync(prompts, completions, **_):
        return result

    async def asynchronous(prompts, completions, **_):
        return result

    fn = sync if kind == "sync" else asynchronous
    with pytest.raises(RewardFunctionError) as raised:
        call_reward_functions({"f": fn}, ["p", "q"], ["a", "b"], {})
    assert str(raised.value) == f"reward function 'f' returned {result!r}, not a list of numbers"


@pytest.mark.parametrize(
    "result",
    [[True, 0], (1, None), np.array([0.5, np.nan]), torch.tensor([2.0, 3.0])],
    ids=lambda result: type(result).__name__,
)
def test_lists_tuples_arrays_and_tensors_of_numbers_are_read(result):
    values = call_reward_function("f", lambda prompts, completions, **_: result, ["p", "q"], ["a", "b"], {})
    expected = [float(v) if v is not None else math.nan for v in list(result)]
    assert values == pytest.approx(expected, nan_ok=True)


def test_a_generator_of_numbers_is_read_as_trl_reads_it():
    def lengths(prompts, completions, **_):
        return (float(len(completion)) for completion in completions)

    assert call_reward_function("f", lengths, ["p", "q"], ["a", "bc"], {}) == [1.0, 2.0]


def test_an_invalid_value_names_its_column_as_a_function_or_an_environments_part():
    from lit_rl.rewards.scorer import weighted_reward

    names, weights = ["correctness", "env/solved"], torch.ones(2)
    part = "^environment reward part 'env/solved' returned nan for completion 1"
    with pytest.raises(RewardFunctionError, match=part):
        weighted_reward(torch.tensor([[1.0, 0.0], [1.0, math.nan]]), weights, names, "error")
    with pytest.raises(RewardFunctionError, match="^reward function 'correctness' returned inf for completion 0"):
        weighted_reward(torch.tensor([[math.inf, 0.0]]), weights, names, "error")


def test_a_reward_function_that_calls_sys_exit_fails_the_run_naming_it_instead_of_ending_it_with_exit_0():
    """`sys.exit(0)` in a reward function ended training at once with exit code 0: no message, no summary, no
    checkpoint, and a scheduler recorded success (an outside read found it). A multi-line message is one line."""
    import sys

    def quits(prompts, completions, **_):
        sys.exit(0)

    async def quits_later(prompts, completions, **_):
        sys.exit(0)

    def verbose(prompts, completions, **_):
        raise ValueError("first line\nsecond line\n" + "x" * 3000)

    with pytest.raises(RewardFunctionError, match="^reward function 'quits' raised SystemExit: 0$"):
        call_reward_function("quits", quits, ["p"], ["c"], {})
    asynchronous = r"^an asynchronous reward function \(quits_later\) raised SystemExit"
    with pytest.raises(RewardFunctionError, match=asynchronous):
        call_reward_functions({"quits_later": quits_later}, ["p"], ["c"], {})
    with pytest.raises(RewardFunctionError) as failed:
        call_reward_function("verbose", verbose, ["p"], ["c"], {})
    assert str(failed.value) == "reward function 'verbose' raised ValueError: first line"


def test_an_error_inside_a_generator_reward_function_is_named():
    """A generator's code runs as its values are read: that read is inside the naming of errors too."""

    def ratios(prompts, completions, **_):
        for completion in completions:
            yield 1.0 / len(completion)

    with pytest.raises(RewardFunctionError, match="^reward function 'ratios' raised ZeroDivisionError"):
        call_reward_function("ratios", ratios, ["p", "q"], ["ab", ""], {})
