"""Data through Hugging Face `datasets` (`lit_rl.data.hf_datasets`, through `load_rows` as the data modules call
it): a `Dataset` or `DatasetDict` written by `save_to_disk`, an `.arrow` file, a hub id offline; and preference rows
with an implicit prompt, split as TRL splits them."""

from __future__ import annotations

import pytest

from lit_rl.data.files import load_rows
from lit_rl.data.preference import with_explicit_prompt
from lit_rl.errors import DataError

datasets = pytest.importorskip("datasets")

ROWS = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(5)]


def test_a_saved_dataset_a_split_of_a_saved_dataset_dict_and_an_arrow_file_give_the_same_rows(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "one")) == ROWS
    assert load_rows(f"{tmp_path / 'dict'}:train") == ROWS
    assert load_rows(f"{tmp_path / 'dict'}:test") == ROWS[:2]
    assert load_rows(str(next((tmp_path / "one").glob("*.arrow")))) == ROWS
    with pytest.raises(DataError, match="a single data set, with no splits: drop ':train'"):
        load_rows(f"{tmp_path / 'one'}:train")


def test_only_a_split_left_unnamed_falls_back_to_the_only_one(tmp_path, monkeypatch):
    """`dir:train` of a `DatasetDict` holding only `test` used to train on `test`: a named split must exist. A
    folder named alone still reads its only split; a hub id without a split reads `train`, else its only split."""
    only_test = tmp_path / "only_test"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(only_test))
    with pytest.raises(DataError) as raised:
        load_rows(f"{only_test}:train")
    assert (
        str(raised.value) == f"data '{only_test}:train' has no split 'train' (test): name one, e.g. '{only_test}:test'"
    )
    assert load_rows(str(only_test)) == ROWS[:2]

    splits = {
        "owner/train-and-test": {"train": ROWS, "test": ROWS[:2]},
        "owner/test-only": {"test": ROWS[:2]},
        "owner/val-and-test": {"validation": ROWS, "test": ROWS[:2]},
    }

    def load_dataset(name, config, split):
        assert split is None
        return datasets.DatasetDict({key: datasets.Dataset.from_list(rows) for key, rows in splits[name].items()})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert load_rows("owner/train-and-test") == ROWS
    assert load_rows("owner/test-only") == ROWS[:2]
    with pytest.raises(DataError, match=r"'owner/val-and-test' has several splits \(validation, test\): name one"):
        load_rows("owner/val-and-test")


def test_a_hub_id_not_in_the_cache_offline_says_so_in_one_line():
    assert datasets.config.HF_HUB_OFFLINE  # tests/conftest.py: the suite runs offline, as this machine is
    with pytest.raises(DataError) as raised:
        load_rows("no-such-owner/no-such-data:train")
    message = str(raised.value)
    assert "\n" not in message and "'no-such-owner/no-such-data'" in message
    assert message.endswith("HF_HUB_OFFLINE is set, and it is not in the local datasets cache")


def test_implicit_prompts_are_split_as_trls_extract_prompt():
    from trl.data_utils import extract_prompt

    def chat(*turns):
        return [{"role": role, "content": content} for role, content in zip(("user", "assistant") * 3, turns)]

    rows = [
        {"chosen": "Q: 2+2? A: 4", "rejected": "Q: 2+2? A: 5"},  # the space before the split goes with the answers
        {"chosen": "What is 2+2? 4", "rejected": "What is 2+2? four"},
        {"chosen": "abc", "rejected": "abd"},
        {"chosen": "same start, then yes", "rejected": "same start, then no"},
        {"chosen": chat("2+2?", "4"), "rejected": chat("2+2?", "5")},
        {"chosen": chat("hi", "hello", "2+2?", "4"), "rejected": chat("hi", "hello", "2+2?", "22")},
        # One completion starts the other: the last shared character (or message) goes with the completions.
        {"chosen": "Q: 6*7? A: 4", "rejected": "Q: 6*7? A: 42"},
        {"chosen": "Q: 6*7? A: 42", "rejected": "Q: 6*7? A: 4"},
        {"chosen": "same", "rejected": "same"},
        {"chosen": chat("2+2?", "4"), "rejected": chat("2+2?", "4", "sure?", "no, 5")},
    ]
    for row in rows:
        assert with_explicit_prompt(row) == extract_prompt(row), row
    prefix = {"prompt": "Q: 6*7? A: ", "chosen": "4", "rejected": "42"}
    assert with_explicit_prompt({"chosen": "Q: 6*7? A: 4", "rejected": "Q: 6*7? A: 42"}) == prefix
    explicit = {"prompt": "p", "chosen": "a", "rejected": "b"}
    assert with_explicit_prompt(explicit) is explicit
