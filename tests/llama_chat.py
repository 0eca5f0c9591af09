"""A tiny model that speaks Llama 3.1's chat format: the tiny byte-level tokenizer with Llama 3's header, end-of-turn
and `<|python_tag|>` tokens, Llama-3.1-Instruct's chat template as released (tools in the first user message, a call
as the bare JSON `{"name": ..., "parameters": {...}}`, results in an `ipython` turn, JSON-encoded), and a random
Qwen2 of that vocabulary (the format is the tokenizer's, not the architecture's). Built here because no hub is
reachable; the template is the model's own, as TRL ships it."""

from __future__ import annotations

from pathlib import Path


def released_template(name: str) -> str:
    """A chat template as its model was released, as TRL ships it (`trl/chat_templates/<name>.jinja`)."""
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def llama_chat_tokenizer(model_max_length: int = 2048, template: str = "llama3_1"):
    """The tiny byte-level tokenizer with Llama 3's special tokens (`<|eot_id|>` is EOS, `<|begin_of_text|>` BOS,
    as in Llama-3.1-Instruct; `<|python_tag|>` special too) and a Llama 3.x chat template (`released_template`)."""
    from lit_rl.modeling.models import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": [*LLAMA3_SPECIAL_TOKENS, "<|python_tag|>"]})
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = released_template(template)
    return tokenizer


def save_llama_chat_model(path: Path) -> Path:
    """A randomly initialised tiny Qwen2 (seed 0) with `llama_chat_tokenizer`, saved at `path`."""
    from tests.qwen_chat import save_chat_model

    return save_chat_model(path, llama_chat_tokenizer())
