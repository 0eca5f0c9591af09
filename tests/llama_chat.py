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


# Llama 3.2's pythonic tool calling, written here in the family's format (as vLLM's pythonic example template asks
# it): the tools as JSON in the system turn, a call as the Python list `[name(key=value, ...)]` (values as JSON),
# results in an `ipython` turn as `{"output": ...}` JSON.
LLAMA3_2_PYTHONIC = """{{- bos_token -}}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools is not none -%}
{{- 'Environment: ipython\nYou can call these functions. To call them, answer with a Python list of calls only: '
    '[name1(arg1=value1, arg2=value2), name2(arg=value)]. Do not use variables.\n\n' -}}
{%- for tool in tools -%}{{- tool | tojson -}}{{- '\n\n' -}}{%- endfor -%}
{%- endif -%}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}
{{- '<|eot_id|>' -}}
{%- for message in messages -%}
{%- if message.role == 'tool' or message.role == 'ipython' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + {'output': message.content} | tojson + '<|eot_id|>' -}}
{%- elif message.tool_calls -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n[' -}}
{%- for call in message.tool_calls -%}
{%- set call = call.function if call.function is defined else call -%}
{{- call.name + '(' -}}
{%- for key, value in call.arguments.items() -%}
{{- key + '=' + value | tojson -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
{%- endfor -%}
{{- ')' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
{%- endfor -%}
{{- ']<|eot_id|>' -}}
{%- elif message.role != 'system' -%}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def llama_chat_tokenizer(model_max_length: int = 2048, template: str = "llama3_1"):
    """The tiny byte-level tokenizer with Llama 3's special tokens (`<|eot_id|>` is EOS, `<|begin_of_text|>` BOS,
    as in Llama-3.1-Instruct; `<|python_tag|>` special too) and a Llama 3.x chat template (`released_template`, or
    `llama3_2_pythonic`: `LLAMA3_2_PYTHONIC`)."""
    from lit_rl.modeling.models import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": [*LLAMA3_SPECIAL_TOKENS, "<|python_tag|>"]})
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.chat_template = LLAMA3_2_PYTHONIC if template == "llama3_2_pythonic" else released_template(template)
    return tokenizer


def save_llama_chat_model(path: Path, template: str = "llama3_1") -> Path:
    """A randomly initialised tiny Qwen2 (seed 0) with `llama_chat_tokenizer(template=template)`, saved at `path`."""
    from tests.qwen_chat import save_chat_model

    return save_chat_model(path, llama_chat_tokenizer(template=template))
