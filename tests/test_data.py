import json

import pytest

from lit_rl.data import RolloutSchedule, RolloutScheduleLoader, load_rows, validate_rows
from lit_rl.data.arithmetic import VAL_SIZE
from lit_rl.data.files import record_label
from lit_rl.errors import ConfigError, DataError


def test_builtin_addition_splits_are_disjoint_and_complete():
    train, val = load_rows("builtin:addition/train"), load_rows("builtin:addition/val")
    assert len(val) == VAL_SIZE and len(train) + len(val) == 100 * 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    row = train[0]
    a, b = map(int, row["prompt"].rstrip("=").split("+"))
    assert row["answer"] == row["completion"] == str(a + b)
    assert load_rows("builtin:addition/val") == val  # deterministic


@pytest.mark.parametrize(
    "rows",
    [
        [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}],
        [{"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"}],
    ],
    ids=["text", "chat"],
)
def test_jsonl_json_and_parquet_load_the_same_rows(tmp_path, rows):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.json", "d.parquet"):
        assert load_rows(str(tmp_path / name)) == rows, name


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl: line 2: malformed JSON"):
        load_rows(str(path))


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("prompt\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        load_rows(str(tmp_path / "x.csv"))


def test_validate_rows_names_the_record_and_column():
    with pytest.raises(ValueError, match="data.parquet: record 2 has no 'prompt' column"):
        validate_rows([{"prompt": "a"}, {"question": "b"}], ["prompt"], "data.parquet")
    with pytest.raises(ValueError, match="empty"):
        validate_rows([], ["prompt"], "data.jsonl")


def test_records_of_a_jsonl_file_are_named_by_their_line_as_editors_count(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"question": "b"}\n')
    rows = load_rows(str(path))
    with pytest.raises(ValueError, match="d.jsonl: line 3 has no 'prompt' column"):  # the blank line counts
        validate_rows(rows, ["prompt"], str(path))
    assert [record_label(str(path), index) for index in range(2)] == ["line 1", "line 3"]
    assert record_label("builtin:addition/train", 0) == "record 1"


def _loader(rows, start=0, rank=0, world=1, prompts=2, micro=3, seed=0, group=1):
    schedule = RolloutSchedule(
        completions_per_rank=prompts * group,
        group_size=group,
        micro_steps_per_generation=micro,
        start_micro_step=lambda: start,
    )
    return RolloutScheduleLoader(rows, schedule, seed=seed, rank=rank, world_size=world)


def test_schedule_carries_prompts_on_the_first_micro_step_of_each_generation():
    rows = [{"prompt": str(i)} for i in range(10)]
    loader = _loader(rows)
    assert len(loader) == 5 * 3  # 5 generations of 2 prompts, 3 micro-steps each
    items = list(loader)
    assert [item.micro_step for item in items] == list(range(15))
    assert [len(item.rows) for item in items] == [2, 0, 0] * 5
    seen = [row["prompt"] for item in items for row in item.rows]
    assert sorted(seen) == sorted(r["prompt"] for r in rows)  # one epoch = every prompt once


def test_schedule_resumes_mid_epoch_with_the_same_items():
    rows = [{"prompt": str(i)} for i in range(10)]
    full = list(_loader(rows))
    resumed = list(_loader(rows, start=7))
    assert resumed == full[7:]
    next_epoch = list(_loader(rows, start=15))
    assert [i.micro_step for i in next_epoch] == list(range(15, 30))
    assert [r for i in next_epoch for r in i.rows] != [r for i in full for r in i.rows]  # reshuffled


def test_schedule_gives_ranks_disjoint_prompts():
    rows = [{"prompt": str(i)} for i in range(12)]
    rank0 = [r["prompt"] for i in _loader(rows, rank=0, world=2) for r in i.rows]
    rank1 = [r["prompt"] for i in _loader(rows, rank=1, world=2) for r in i.rows]
    assert len(rank0) == len(rank1) == 12 // 2 // 2 * 2
    assert not set(rank0) & set(rank1)


def test_groups_span_ranks_when_a_rank_holds_less_than_a_group():
    # G = 4 completions per prompt, 2 per rank, 4 ranks: 2 prompts per generation, each split over 2 ranks.
    rows = [{"prompt": str(i)} for i in range(8)]
    schedule = RolloutSchedule(completions_per_rank=2, group_size=4, micro_steps_per_generation=1, start_micro_step=int)
    per_rank = [
        [r["prompt"] for r in RolloutScheduleLoader(rows, schedule, seed=0, rank=rank, world_size=4).item(0).rows]
        for rank in range(4)
    ]
    assert per_rank[0][0] == per_rank[0][1] == per_rank[1][0] == per_rank[1][1]  # one group over ranks 0 and 1
    assert per_rank[2][0] == per_rank[2][1] == per_rank[3][0] == per_rank[3][1]
    assert per_rank[0][0] != per_rank[2][0]
    # The same global batch as one rank holding everything: prompt-major, in slot order.
    one_rank = RolloutSchedule(completions_per_rank=8, group_size=4, micro_steps_per_generation=1, start_micro_step=int)
    everything = [r["prompt"] for r in RolloutScheduleLoader(rows, one_rank, seed=0, rank=0, world_size=1).item(0).rows]
    assert everything == [p for rank_rows in per_rank for p in rank_rows]


def test_schedule_rejects_too_little_data():
    with pytest.raises(ValueError, match="fewer than one generation batch"):
        _loader([{"prompt": "a"}], prompts=2)


def test_a_data_module_and_an_algorithm_that_do_not_fit_are_refused_in_one_line():
    """The contracts of `lit_rl.data.contracts`, checked where one first reaches for the other."""
    from types import SimpleNamespace

    from lit_rl.algorithms import DPO, GRPO, SFT
    from lit_rl.data import PreferenceDataModule, PromptDataModule, SFTDataModule
    from lit_rl.data.contracts import PreferencePairs, PromptRows, data_of

    class MyDPO(DPO):  # a user's subclass takes what DPO takes
        pass

    for data, algorithm, message in [
        (
            PromptDataModule(),
            SFT,
            "PromptDataModule feeds the algorithms that sample (GRPO, PPO, RLOO, OnlineDPO); SFT takes SFTDataModule: "
            "start from configs/sft.yaml",
        ),
        (
            SFTDataModule(),
            GRPO,
            "SFTDataModule feeds supervised fine-tuning (SFT); GRPO takes PromptDataModule: start from "
            "configs/grpo.yaml",
        ),
        (PreferenceDataModule(), GRPO, "PreferenceDataModule feeds the preference algorithms that train on fixed"),
        (
            PreferenceDataModule(),
            SFT,
            "PreferenceDataModule feeds the preference algorithms that train on fixed pairs "
            "(DPO); SFT takes SFTDataModule",
        ),
        (
            SFTDataModule(),
            MyDPO,
            "SFTDataModule feeds supervised fine-tuning (SFT); MyDPO takes PreferenceDataModule: "
            "start from configs/dpo.yaml",
        ),
    ]:
        data.trainer = SimpleNamespace(lightning_module=algorithm.__new__(algorithm), global_rank=0, world_size=1)
        with pytest.raises(ConfigError) as err:
            data.train_dataloader()
        assert str(err.value).startswith(f"data: {message}")

    def attached(name: str, data_module: object) -> object:  # an algorithm of that name, its trainer attached
        return type(name, (), {"trainer": SimpleNamespace(datamodule=data_module)})()

    with pytest.raises(ConfigError, match="^data: DPO reads its rows from a PreferenceDataModule, not from Prompt"):
        data_of(attached("DPO", PromptDataModule()), PreferencePairs)
    with pytest.raises(ConfigError, match="^data: GRPO reads its rows from a PromptDataModule, not from MyData$"):
        data_of(attached("GRPO", type("MyData", (), {})()), PromptRows)
    prompts = PromptDataModule()
    assert data_of(attached("GRPO", prompts), PromptRows) is prompts


def test_a_json_dict_of_columns_must_hold_one_list_per_column_all_of_one_length(tmp_path):
    """A shorter column used to drop rows silently (`zip` stops at the shortest), and a text value was read as one
    row per character."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}))
    assert load_rows(str(path)) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    for columns, message in (
        ({"prompt": ["1+1=", "2+2="], "answer": ["2"]}, "d.json: column 'answer' has 1 values, column 'prompt' has 2$"),
        ({"prompt": "hello"}, "d.json: column 'prompt' is a str, not a list of one value per row$"),
        ({"prompt": ["1+1="], "source": "gsm8k"}, "d.json: column 'source' is a str, not a list"),
    ):
        path.write_text(json.dumps(columns))
        with pytest.raises(DataError, match=message):
            load_rows(str(path))


@pytest.mark.parametrize(
    "prompt, problem",
    [
        (["What is 2+2?"], "message 1 is 'What is 2+2?'"),
        ([1, 2], "message 1 is 1"),
        ([{"role": "user", "content": "hi"}, {"content": "2+2?"}], "message 2 is {'content': '2+2?'}"),
        ([], "it is an empty list"),
        ({"role": "user", "content": "hi"}, "it is a dict"),
    ],
)
def test_a_prompt_of_chat_messages_is_a_list_of_dicts_with_role_and_content(tmp_path, prompt, problem):
    """TRL's rule for chat messages, checked when the data is read: the old check took any list, which failed later
    in the chat template, with a traceback and no row."""
    path = tmp_path / "d.jsonl"
    good = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]}
    # An assistant's call of tools has `tool_calls` in place of `content`: messages too.
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {}}}]}
    good["prompt"] += [call, {"role": "tool", "content": "4"}]
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": prompt}) + "\n")
    rows = load_rows(str(path))
    validate_rows(rows[:1], ["prompt"], str(path))
    with pytest.raises(DataError) as raised:
        validate_rows(rows, ["prompt"], str(path))
    assert str(raised.value) == (
        f"{path}: line 2 column 'prompt' must be text or chat messages "
        f"([{{'role': ..., 'content' or 'tool_calls': ...}}, ...]): {problem}"
    )


def test_files_that_are_not_utf8_or_not_parquet_are_named_in_one_line(tmp_path):
    """A byte that is not UTF-8 was a bare UnicodeDecodeError (and the file was read in the locale's encoding), a
    corrupt parquet file an ArrowInvalid traceback."""
    (tmp_path / "d.jsonl").write_bytes('{"prompt": "é"}\n\n'.encode() + b'{"prompt": "caf\xe9"}\n')  # latin-1
    with pytest.raises(DataError, match=r"d.jsonl: line 3: not UTF-8 text \(invalid continuation byte: b'\\xe9'\)$"):
        load_rows(str(tmp_path / "d.jsonl"))
    (tmp_path / "d.json").write_bytes(b'[\n{"prompt": "a"},\n{"prompt": "\xff"}\n]')
    with pytest.raises(DataError, match=r"d.json: line 3: not UTF-8 text \(invalid start byte: b'\\xff'\)$"):
        load_rows(str(tmp_path / "d.json"))
    (tmp_path / "d.parquet").write_bytes(b"PAR1 but not parquet")
    with pytest.raises(DataError, match=r"^data file '.*d.parquet': not a readable parquet file \(.+\)$"):
        load_rows(str(tmp_path / "d.parquet"))
    (tmp_path / "u.jsonl").write_text('{"prompt": "café"}\n', encoding="utf-8")
    assert load_rows(str(tmp_path / "u.jsonl")) == [{"prompt": "café"}]
