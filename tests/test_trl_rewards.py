"""Reward functions get what TRL 1.16's GRPOTrainer passes (`lit_rl.rewards`): TRL's own reward functions and the
examples of its documentation run unchanged."""

from __future__ import annotations

import re

import pytest
import torch

from lit_rl.errors import RewardFunctionError
from lit_rl.rewards import TrainerState
from lit_rl.rewards.scorer import reward_components

CHAT_ROWS = [
    {"prompt": [{"role": "user", "content": "Solve 1/3 + 0."}], "solution": "$\\frac{1}{3}$", "completion": "x"},
    {"prompt": [{"role": "user", "content": "Solve 1/2 + 0."}], "solution": "$\\frac{1}{2}$", "completion": "y"},
]
COMPLETIONS = ["<think>\nadd\n</think>\n$\\boxed{\\frac{1}{3}}$", "<think>no end tag $\\frac{1}{3}$"]
IDS = [[5, 6, 7], [8, 9]]
STATE = TrainerState(global_step=3, max_steps=10, epoch=0.0)


# From TRL's GRPOTrainer documentation ("Using a custom reward function"), as written there.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def _score(fns, rows, completions, repeat=1):
    return reward_components(fns, rows, completions, repeat, torch.device("cpu"), IDS, STATE)


def test_trl_reward_functions_score_chat_completions():
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    fns = {
        "think_format_reward": trl_rewards.think_format_reward,
        "accuracy_reward": trl_rewards.accuracy_reward,
        "overlong": trl_rewards.get_soft_overlong_punishment(max_completion_len=3, soft_punish_cache=2),
        "format_reward_func": format_reward_func,
    }
    values = _score(fns, CHAT_ROWS, COMPLETIONS)
    assert values.tolist() == [
        [1.0, 1.0, -1.0, 0.0],  # 3 tokens: ((3 - 2) - 3) / 2
        [0.0, 0.0, -0.5, 0.0],  # no </think>; 1/3 is not the gold 1/2; 2 tokens: ((3 - 2) - 2) / 2
    ]


def test_text_prompts_get_text_completions_and_every_keyword_trl_passes():
    seen = {}

    def recorder(prompts, completions, completion_ids, trainer_state, ground_truth, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, **kwargs)
        return [0.0] * len(completions)

    rows = [{"prompt": "2+2=", "ground_truth": "4", "completion": "dropped, as TRL drops it"}]
    fns = {"reward_len": reward_len, "reward_func": reward_func, "recorder": recorder}
    values = _score(fns, rows, ["\\boxed{4}", "5"], 2)
    assert values.tolist() == [[-11.0, 1.0, 0.0], [-19.0, 0.0, 0.0]]
    hooks = {key: seen.pop(key) for key in ("log_extra", "log_metric")}
    assert seen == {"prompts": ["2+2=", "2+2="], "completions": ["\\boxed{4}", "5"], "ids": IDS, "state": STATE}
    assert all(callable(hook) for hook in hooks.values())


def test_trls_logging_hooks_are_passed_log_extra_dropped_and_log_metric_refused_by_name():
    """TRL 1.16 passes `log_extra` and `log_metric`: a function that names them failed with "missing 2 required
    positional arguments". `log_extra` feeds TRL's table of completions, which lit-rl does not keep; a number given
    to `log_metric` stops the run naming the function and the way lit-rl logs it."""

    def with_extra(prompts, completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        return [1.0] * len(completions)

    def with_metric(prompts, completions, log_metric, **kwargs):
        log_metric("mean_length", 1.5)
        return [1.0] * len(completions)

    rows = [{"prompt": "2+2="}]
    assert _score({"with_extra": with_extra}, rows, ["4", "5"], 2).tolist() == [[1.0], [1.0]]
    with pytest.raises(RewardFunctionError) as refused:
        _score({"with_metric": with_metric}, rows, ["4", "5"], 2)
    assert str(refused.value) == (
        "reward function 'with_metric' raised NotImplementedError: log_metric('mean_length', ...) is TRL's; lit-rl "
        "does not log a reward function's own metrics: compute the number in a further function of "
        "model.rewards.funcs, of weight 0 (its mean is logged as rewards/<its name>)"
    )


def test_every_column_of_any_row_is_passed_none_where_a_row_lacks_it():
    """The columns were those of the batch's first row: `answer` reached a function only when a row holding it came
    first, so a function that names it failed or not with the order of the batch."""
    seen = {}

    def named(prompts, completions, answer, **kwargs):
        seen.update(answer=answer, **kwargs)
        return [0.0] * len(completions)

    rows = [{"prompt": "1+1=", "source": "a"}, {"prompt": "2+2=", "answer": "4", "level": 2}]
    _score({"named": named}, rows, ["2", "4", "5", "3"], 2)
    assert seen.pop("answer") == [None, None, "4", "4"]
    assert list(seen) == ["source", "level", "completion_ids", "trainer_state", "log_extra", "log_metric"]
    assert seen["source"] == ["a", "a", None, None] and seen["level"] == [None, None, 2, 2]


def test_chat_completions_are_one_assistant_message_each():
    got = {}

    def recorder(prompts, completions, solution, **kwargs):
        got.update(completions=completions, solution=solution)
        return [1.0, None]  # None: this completion cannot be scored

    values = _score({"recorder": recorder}, CHAT_ROWS, ["a", "b"])
    assert got["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert got["solution"] == ["$\\frac{1}{3}$", "$\\frac{1}{2}$"]
    assert values[0, 0] == 1.0 and torch.isnan(values[1, 0])  # counted by invalid_reward (0 by default)


def test_lit_rl_builtin_rewards_take_either_form():
    from lit_rl.rewards.arithmetic import correctness, integer_format

    messages = [[{"role": "assistant", "content": " 4"}], [{"role": "assistant", "content": "four"}]]
    assert correctness(None, messages, answer=["4", "4"]) == correctness(None, [" 4", "four"], answer=["4", "4"])
    assert integer_format(None, messages) == [1.0, 0.0]


def test_math_accuracy_on_math_verify():
    pytest.importorskip("math_verify")
    from lit_rl.rewards.math_answer import accuracy

    completions = ["so $\\boxed{\\frac{2}{6}}$", [{"role": "assistant", "content": "$\\boxed{3}$"}], "$1$"]
    assert accuracy(None, completions, solution=["$\\frac{1}{3}$", "$4$", "no latex ]]"]) == [1.0, 0.0, None]
    assert accuracy(None, ["$\\boxed{4}$"], answer=["4"]) == [1.0]  # the built-in tasks' column name
