"""reasoning-gym's tasks as data (`lit_rl.data.reasoning_gym`) and scored by their own scorers
(`lit_rl.rewards.reasoning_gym.score`), offline; and a GRPO run on one through `lit-rl fit`."""

from __future__ import annotations

import json

import pytest

from lit_rl.data.files import load_rows
from lit_rl.data.reasoning_gym import parse_spec
from lit_rl.errors import DataError
from lit_rl.rewards.reasoning_gym import answer_of, score
from tests.conftest import bash_block, fit_documented_two_steps, read_metrics, train_rows

reasoning_gym = pytest.importorskip("reasoning_gym")


def test_a_spec_names_tasks_their_options_and_the_prompt_style():
    assert parse_spec("reasoning_gym:basic_arithmetic?seed=0") == (["basic_arithmetic"], {"seed": 0}, "text")
    tasks, options, style = parse_spec(
        'reasoning_gym:basic_arithmetic?size=20&seed=3&min_terms=2&whitespace=single&operators=["%2B","-"]&prompt=chat'
    )
    assert tasks == ["basic_arithmetic"] and style == "chat"
    assert options == {"size": 20, "seed": 3, "min_terms": 2, "whitespace": "single", "operators": ["+", "-"]}
    assert parse_spec("reasoning_gym:basic_arithmetic,leg_counting?size=8&seed=1")[:2] == (
        ["basic_arithmetic", "leg_counting"],
        {"size": 8, "seed": 1},
    )
    for spec, message in [
        ("reasoning_gym:", "name a reasoning-gym task"),
        ("reasoning_gym:basic_arithmetic?size", "options go as key=value pairs"),
        ("reasoning_gym:basic_arithmetic?size=2&size=3", "option 'size' is given twice"),
        ("reasoning_gym:basic_arithmetic?size=2", "give a seed .seed=N., so that every rank and every resume"),
        ("reasoning_gym:basic_arithmetic?seed=1&prompt=html", "prompt must be one of text, chat, got 'html'"),
        ("reasoning_gym:basic_arithmetic,leg_counting?seed=1&min_terms=2", "a mix of tasks takes only size and seed"),
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
        ("reasoning_gym:no_such_task?size=2&seed=1", "reasoning_gym:no_such_task.*reasoning-gym: ValueError"),
        ("reasoning_gym:basic_arithmetic?size=2&seed=1&no_such_option=1", "reasoning-gym: TypeError: .*no_such_option"),
    ]:
        with pytest.raises(DataError, match=message) as err:
            load_rows(spec)
        assert "\n" not in str(err.value)


def test_a_task_whose_scorer_runs_the_answer_as_code_needs_the_users_consent():
    """spiral_matrix's scorer `eval`s the answer: a model writing `__import__('os').system(...)` would run it. The
    task is refused unless the spec says trust_scorer=true; basic_arithmetic's scorer only compares."""
    with pytest.raises(
        DataError, match=r"spiral_matrix's scorer runs the model's answer as code \(eval\( in Spiral"
    ) as err:
        load_rows("reasoning_gym:spiral_matrix?size=2&seed=1")
    assert "trust_scorer=true" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DataError, match="bitwise_arithmetic's scorer runs the model's answer as code .eval. in verify"):
        load_rows("reasoning_gym:basic_arithmetic,bitwise_arithmetic?size=2&seed=1")  # found in a function it calls
    assert len(load_rows("reasoning_gym:spiral_matrix?size=2&seed=1&trust_scorer=true")) == 2


def test_rows_from_a_file_cannot_choose_a_scorer_that_runs_text_as_code(tmp_path, monkeypatch):
    """A row names its task (`metadata.source_dataset`): rows from a data file naming number_sorting, whose scorer
    `eval`s the row's answer, are refused by the reward, and nothing of theirs runs; the same task's rows from a spec
    that trusts it are scored."""
    from lit_rl.errors import RewardFunctionError

    monkeypatch.setattr("lit_rl.data.reasoning_gym._TRUSTED_SCORERS", set())  # what this test's specs trust alone
    marker = tmp_path / "ran"
    entry = dict(load_rows("reasoning_gym:basic_arithmetic?size=1&seed=1")[0]["reasoning_gym"])
    entry["metadata"] = {**entry["metadata"], "source_dataset": "number_sorting"}
    entry["answer"] = f"__import__('pathlib').Path({str(marker)!r}).write_text('x') or [1]"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Sort 1.", "reasoning_gym": entry}) + "\n")
    (row,) = load_rows(str(rows))
    with pytest.raises(RewardFunctionError, match=r"task 'number_sorting', whose scorer runs text as code") as err:
        score([], ["<answer>['1']</answer>"], reasoning_gym=[row["reasoning_gym"]])
    assert "number_sorting?...&trust_scorer=true" in str(err.value) and not marker.exists()
    trusted = load_rows("reasoning_gym:number_sorting?size=2&seed=1&trust_scorer=true")
    answers = [f"<answer>{row['reasoning_gym']['answer']}</answer>" for row in trusted]
    assert score([], answers, reasoning_gym=[row["reasoning_gym"] for row in trusted]) == [1.0, 1.0]


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


def test_the_scorer_is_built_with_the_specs_task_options(tmp_path, monkeypatch):
    """decimal_arithmetic scores to its config's decimal places: built with the defaults, a wrong sixth decimal scored
    1.0 where the spec's own dataset scores 0.0. Options a row names that no spec of this run gave are refused."""
    from lit_rl.errors import RewardFunctionError

    monkeypatch.setattr("lit_rl.data.reasoning_gym._SCORING_OPTIONS", set())  # what this test's specs register alone
    spec = "reasoning_gym:decimal_arithmetic?size=8&seed=3&max_num_decimal_places=6"
    rows = load_rows(spec)
    dataset = reasoning_gym.create_dataset("decimal_arithmetic", size=8, seed=3, max_num_decimal_places=6)
    wrong = [str(e["answer"])[:-1] + ("1" if str(e["answer"])[-1] != "1" else "2") for e in dataset]
    expected = [dataset.score_answer(answer, entry) for answer, entry in zip(wrong, dataset)]
    assert 0.0 in expected  # a wrong last decimal that the default config's scorer rounds away
    columns = {key: [row[key] for row in rows] for key in ("reasoning_gym", "reasoning_gym_options")}
    assert columns["reasoning_gym_options"] == [{"max_num_decimal_places": 6}] * 8
    assert score([], [f"<answer>{a}</answer>" for a in wrong], **columns) == expected
    rows_file = tmp_path / "rows.jsonl"  # a file's row naming options no spec gave
    options = {"max_num_decimal_places": 2}
    rows_file.write_text(
        json.dumps({"prompt": "?", "reasoning_gym": rows[0]["reasoning_gym"], "reasoning_gym_options": options}) + "\n"
    )
    (row,) = load_rows(str(rows_file))
    with pytest.raises(
        RewardFunctionError, match=r"with options \{\"max_num_decimal_places\": 2\}, which no reasoning_gym: spec"
    ):
        score(
            [],
            ["<answer>1</answer>"],
            reasoning_gym=[row["reasoning_gym"]],
            reasoning_gym_options=[row["reasoning_gym_options"]],
        )


@pytest.mark.slow
def test_grpo_trains_on_a_reasoning_gym_task_through_the_cli(tmp_path):
    """The command the docs print, for 2 steps (the test overlay and the suite's small batches on top): the task's
    rows are the data (train and validation), its scorer the reward, logged in both stages."""
    log_dir = fit_documented_two_steps(bash_block("reasoning-gym.md"), tmp_path)
    train = train_rows(log_dir)
    assert [row["step"] for row in train] == [1, 2]
    assert all(0.0 <= row["train/rewards/score"] <= 1.0 for row in train)
    val = [row for row in read_metrics(log_dir) if row.get("val/rewards/score")]
    assert len(val) == 1 and 0.0 <= float(val[0]["val/rewards/score"]) <= 1.0
