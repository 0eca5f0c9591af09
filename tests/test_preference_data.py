import logging

from lit_rl.data.preference import (
    ShardedPairBatches,
    TokenizedPair,
    batch_completion_tokens,
    batch_tokens,
    collate_pairs,
    tokenize_pairs,
)
from lit_rl.modeling.models import load_tokenizer

TOKENIZER = load_tokenizer("lit-rl/tiny-qwen2-base")


def test_tokenize_appends_eos_and_counts_truncated_rows(caplog):
    rows = [
        {"prompt": "1+2=", "chosen": "3", "rejected": "4"},
        {"prompt": "123456789+1=", "chosen": "123456790", "rejected": "1"},
    ]
    with caplog.at_level(logging.WARNING):
        pairs = tokenize_pairs(rows, TOKENIZER, lambda p: p, max_prompt_length=8, max_length=12, source="x.jsonl")
    eos = TOKENIZER.eos_token_id
    assert pairs[0].prompt_ids == TOKENIZER("1+2=")["input_ids"] and pairs[0].chosen_ids[-1] == eos
    assert len(pairs[1].prompt_ids) == 8  # the prompt keeps its last 8 tokens
    assert len(pairs[1].prompt_ids) + len(pairs[1].chosen_ids) <= 12
    assert "x.jsonl: truncated 1 of 2 rows" in caplog.text


def test_chat_formatted_pairs_use_the_chat_template():
    rows = [
        {
            "prompt": [{"role": "user", "content": "1+2="}],
            "chosen": [{"role": "assistant", "content": "3"}],
            "rejected": [{"role": "assistant", "content": "4"}],
        }
    ]
    fmt = lambda p: TOKENIZER.apply_chat_template(p, tokenize=False, add_generation_prompt=True)  # noqa: E731
    (pair,) = tokenize_pairs(rows, TOKENIZER, fmt, None, None, "chat.jsonl")
    assert TOKENIZER.decode(pair.prompt_ids) == "1+2="
    assert TOKENIZER.decode(pair.chosen_ids, skip_special_tokens=True) == "3"


def test_collate_concatenates_chosen_then_rejected():
    pairs = [TokenizedPair(0, [5, 6], [7, 1], [8, 9, 1]), TokenizedPair(1, [5], [7, 1], [1])]
    batch = collate_pairs(pairs, [1.0, 0.0], pad_id=0)
    assert batch["prompt_ids"].tolist() == [[5, 6], [0, 5], [5, 6], [0, 5]]
    assert batch["completion_ids"].tolist() == [[7, 1, 0], [7, 1, 0], [8, 9, 1], [1, 0, 0]]
    assert batch["completion_mask"].sum(1).tolist() == [2, 2, 3, 1]
    assert batch["weight"].tolist() == [1.0, 0.0] and batch["index"].tolist() == [0, 1]


def test_a_batch_counts_the_tokens_of_its_real_pairs_as_the_token_budget_does():
    real = TokenizedPair(0, [5], [7, 1], [1])
    padding = TokenizedPair(1, [5, 6, 7, 8], [7, 7, 7, 1], [8, 8, 8, 8, 1])  # the longest, but of weight 0
    batch = collate_pairs([real, padding], [1.0, 0.0], pad_id=0)
    assert int(batch_tokens(batch)) == real.num_tokens == 5
    # DPO's `perf/trained_tokens_per_s` counts the real pair's completions (2 + 1), not the padding pair's 4 + 5.
    assert int(batch_completion_tokens(batch)) == 3


def test_uneven_shards_get_equal_batch_counts_with_weight_zero_padding():
    pairs = [TokenizedPair(i, [1], [2], [3]) for i in range(7)]
    ranks = [list(ShardedPairBatches(pairs, 2, False, 0, rank, 2, pad_id=0)) for rank in (0, 1)]
    assert [len(r) for r in ranks] == [2, 2]
    real = [[int(i) for b in r for i, w in zip(b["index"], b["weight"], strict=True) if w > 0] for r in ranks]
    assert real == [[0, 2, 4, 6], [1, 3, 5]]
    assert [b["weight"].tolist() for b in ranks[1]] == [[1.0, 1.0], [1.0, 0.0]]


def test_shuffle_changes_with_the_epoch_and_is_reproducible():
    pairs = [TokenizedPair(i, [1], [2], [3]) for i in range(20)]
    position = {"n": 0}
    batches = ShardedPairBatches(pairs, 20, True, 3, 0, 1, 0, start_batch=lambda: position["n"])
    first = next(iter(batches))["index"].tolist()
    assert next(iter(batches))["index"].tolist() == first
    position["n"] = 1  # one batch consumed: the next epoch, a new permutation
    assert next(iter(batches))["index"].tolist() != first
    assert sorted(first) == list(range(20))


def test_iteration_resumes_at_the_consumed_batch_count():
    pairs = [TokenizedPair(i, [1], [2], [3]) for i in range(12)]
    position = {"n": 0}
    batches = ShardedPairBatches(pairs, 2, True, 0, 0, 1, 0, start_batch=lambda: position["n"])
    epoch0 = [b["index"].tolist() for b in batches]
    position["n"] = 4
    assert [b["index"].tolist() for b in batches] == epoch0[4:]
    position["n"] = 6 + 1
    assert len(list(batches)) == 5  # epoch 1, one batch already consumed
