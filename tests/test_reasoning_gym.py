"""reasoning-gym's tasks as data (`lit_rl.data.reasoning_gym`) and scored by their own scorers
(`lit_rl.rewards.reasoning_gym.score`), offline; and a GRPO run on one through `lit-rl fit`."""

from __future__ import annotations

import pytest

from lit_rl.data.files import load_rows
from lit_rl.data.reasoning_gym import parse_spec
from lit_rl.errors import DataError
from lit_rl.rewards.reasoning_gym import answer_of, score
from tests.conftest import CONFIGS, FAST_GRPO, read_metrics, run_cli, train_rows, write_overlay

reasoning_gym = pytest.importorskip("reasoning_gym")


def test_a_spec_names_tasks_their_options_and_the_prompt_style():
    assert parse_spec("reasoning_gym:basic_arithmetic") == (["basic_arithmetic"], {}, "text")
    tasks, options, style = parse_spec(
        'reasoning_gym:basic_arithmetic?size=20&seed=3&min_terms=2&whitespace=single&operators=["%2B","-"]&prompt=chat'
    )
    assert tasks == ["basic_arithmetic"] and style == "chat"
    assert options == {"size": 20, "seed": 3, "min_terms": 2, "whitespace": "single", "operators": ["+", "-"]}
    assert parse_spec("reasoning_gym:basic_arithmetic,leg_counting?size=8")[:2] == (
        ["basic_arithmetic", "leg_counting"],
        {"size": 8},
    )
    for spec, message in [
        ("reasoning_gym:", "name a reasoning-gym task"),
        ("reasoning_gym:basic_arithmetic?size", "options go as key=value pairs"),
        ("reasoning_gym:basic_arithmetic?size=2&size=3", "option 'size' is given twice"),
        ("reasoning_gym:basic_arithmetic?prompt=html", "prompt must be one of text, chat, got 'html'"),
        ("reasoning_gym:basic_arithmetic,leg_counting?min_terms=2", "a mix of tasks takes only size and seed"),
    ]:
        with pytest.raises(DataError, match=message):
            parse_spec(spec)


def test_rows_are_the_tasks_own_entries_with_their_options():
    rows = load_rows("reasoning_gym:basic_arithmetic?size=6&seed=1&min_terms=2&max_terms=2")
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=1, min_terms=2, max_terms=2))
    assert [row["prompt"] for row in rows] == [entry["question"] for entry in entries]
    assert [row["answer"] for row in rows] == [entry["answer"] for entry in entries]
    assert [row["reasoning_gym"] for row in rows] == entries
    assert {row["reasoning_gym"]["metadata"]["num_terms"] for row in rows} == {2}
    chat = load_rows("reasoning_gym:basic_arithmetic?size=2&seed=1&prompt=chat")
    system, user = chat[0]["prompt"]
    question = load_rows("reasoning_gym:basic_arithmetic?size=2&seed=1")[0]["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"] and user["content"] == question
    mixed = load_rows("reasoning_gym:basic_arithmetic,leg_counting?size=40&seed=1")
    assert {row["reasoning_gym"]["metadata"]["source_dataset"] for row in mixed} == {"basic_arithmetic", "leg_counting"}


def test_a_task_reasoning_gym_refuses_is_named_in_one_line():
    for spec, message in [
        ("reasoning_gym:no_such_task?size=2", "reasoning_gym:no_such_task.*reasoning-gym: ValueError"),
        ("reasoning_gym:basic_arithmetic?size=2&no_such_option=1", "reasoning-gym: TypeError: .*no_such_option"),
    ]:
        with pytest.raises(DataError, match=message) as err:
            load_rows(spec)
        assert "\n" not in str(err.value)


def test_score_uses_each_tasks_own_scorer_on_the_answer_the_completion_gives():
    rows = load_rows("reasoning_gym:basic_arithmetic,leg_counting?size=20&seed=2")
    entries = [row["reasoning_gym"] for row in rows]
    right = [f"Thinking... <answer>{entry['answer']}</answer>" for entry in entries]
    assert score([], right, reasoning_gym=entries) == [1.0] * len(rows)
    untagged = [f" {entry['answer']}\n" for entry in entries]  # a base model answering directly
    assert score([], untagged, reasoning_gym=entries) == [1.0] * len(rows)
    wrong = ["<answer>not a number</answer>"] * len(rows)
    assert score([], wrong, reasoning_gym=entries) == [0.0] * len(rows)
    as_messages = [[{"role": "assistant", "content": text}] for text in right]
    assert score([], as_messages, reasoning_gym=entries) == [1.0] * len(rows)
    assert answer_of("<answer>1</answer> then <answer> 2 </answer>") == "2"


@pytest.mark.slow
def test_grpo_trains_on_a_reasoning_gym_task_through_the_cli(tmp_path):
    """The command docs/environments.md prints, for 2 steps on 3-digit sums: the task's rows are the data (train and
    validation), its scorer the reward, logged in both stages."""
    overlay = write_overlay(tmp_path / "overlay.yaml", save_dir=tmp_path / "runs")
    task = "reasoning_gym:basic_arithmetic?size={}&seed={}&min_terms=2&max_terms=2&max_digits=2&whitespace=none"
    run_cli(
        "fit",
        "--config",
        str(CONFIGS / "grpo.yaml"),
        "--config",
        str(overlay),
        *FAST_GRPO,
        "--data.train_data",
        task.format(64, 1),
        "--data.val_data",
        task.format(16, 2),
        "--model.rewards.funcs",
        "[lit_rl.rewards.reasoning_gym.score]",
        "--model.rewards.weights",
        "null",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
    )
    log_dir = tmp_path / "runs" / "run" / "version_0"
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    assert all(0.0 <= row["train/rewards/score"] <= 1.0 for row in train)
    val = [row for row in read_metrics(log_dir) if row.get("val/rewards/score")]
    assert len(val) == 1 and 0.0 <= float(val[0]["val/rewards/score"]) <= 1.0
