import inspect
import logging

import pytest
import torch

from lit_rl.modeling.models import (
    ASSETS_DIR,
    TINY_BASE,
    build_char_tokenizer,
    build_tiny_base,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)


def test_shipped_base_assets_rebuild_byte_for_byte(tmp_path):
    out = build_tiny_base(tmp_path / "base")
    shipped = ASSETS_DIR / TINY_BASE
    names = sorted(p.name for p in shipped.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), name


def test_tiny_model_is_a_qwen2_with_head_dim_64():
    model = load_causal_lm("lit-rl/tiny-qwen2-base", random_init=True)
    assert model.config.model_type == "qwen2" and model.config.head_dim == 64
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6


def test_character_level_tokenizer_round_trips_text():
    tokenizer = load_tokenizer("lit-rl/tiny-qwen2-base")
    for text in ["12+34=", "a b\nc", " spaced  out "]:
        ids = tokenizer(text)["input_ids"]
        assert len(ids) == len(text.encode())
        assert tokenizer.decode(ids) == text
    chat = [{"role": "user", "content": "1+2="}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "1+2="


def test_builtin_names_resolve_and_local_dirs_load_through_the_same_path(tmp_path):
    assert resolve_model_path("lit-rl/tiny-qwen2-addition-sft") == str(ASSETS_DIR / "tiny-qwen2-addition-sft")
    assert resolve_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    model = load_causal_lm("lit-rl/tiny-qwen2-addition-sft")
    model.save_pretrained(tmp_path / "copy")
    again = load_causal_lm(str(tmp_path / "copy"))
    original, reloaded = model.state_dict(), again.state_dict()
    assert list(reloaded) == list(original)
    for name, tensor in original.items():
        assert torch.equal(tensor, reloaded[name]), name


def test_missing_paths_fail_with_the_path_in_the_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no such built-in model"):
        load_tokenizer("lit-rl/nope")


def test_tokenizer_without_pad_token_gets_one_with_a_warning(tmp_path, caplog):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tok")
    build_tiny_base(tmp_path / "cfg")  # AutoTokenizer needs the model config beside it
    (tmp_path / "tok" / "config.json").write_bytes((tmp_path / "cfg" / "config.json").read_bytes())
    with caplog.at_level(logging.WARNING):
        loaded = load_tokenizer(str(tmp_path / "tok"))
    assert loaded.pad_token == loaded.eos_token
    assert "no pad token" in caplog.text


def test_remote_code_is_off_by_default_and_gradient_checkpointing_is_an_option():
    assert inspect.signature(load_causal_lm).parameters["trust_remote_code"].default is False
    assert inspect.signature(load_tokenizer).parameters["trust_remote_code"].default is False
    model = load_causal_lm("lit-rl/tiny-qwen2-addition-sft", gradient_checkpointing=True)
    assert model.is_gradient_checkpointing


def test_dtype_option():
    assert next(load_causal_lm("lit-rl/tiny-qwen2-addition-sft", dtype="bfloat16").parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm("lit-rl/tiny-qwen2-addition-sft", dtype="float8")


def test_disable_dropout_zeroes_config_and_modules(tmp_path):
    from transformers import Qwen2Config

    from lit_rl.modeling.models import tiny_qwen2_config

    config = tiny_qwen2_config()
    config.attention_dropout = 0.3
    config.save_pretrained(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path)
    assert load_causal_lm(str(tmp_path), random_init=True).config.attention_dropout == 0.3
    assert load_causal_lm(str(tmp_path), random_init=True, disable_dropout=True).config.attention_dropout == 0.0
    assert isinstance(config, Qwen2Config)


def test_home_relative_paths_are_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/models/x") == str(tmp_path / "models" / "x")
