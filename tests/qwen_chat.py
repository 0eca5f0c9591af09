"""A tiny model that speaks Qwen2.5's chat format: the tiny byte-level tokenizer with Qwen's role and tool-call
tokens, Qwen2.5-Instruct's chat template (tools in the system prompt, calls as `<tool_call>{json}</tool_call>`,
results as `<tool_response>` in a user turn), and a random Qwen2 of that vocabulary. Written here because no hub
is reachable; the template is Qwen2.5's, token for token, so what the tests check holds for the real model."""

# ruff: noqa: E501  (the chat template is Qwen2.5's own lines, kept as written)
from __future__ import annotations

from pathlib import Path

# Qwen2.5-Instruct's chat template (tokenizer_config.json), reformatted over lines; the output is the same.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def qwen_chat_tokenizer(model_max_length: int = 1024):
    """The tiny byte-level tokenizer with `<|im_start|>` and `<|im_end|>` (special; `<|im_end|>` is EOS, as in
    Qwen2.5-Instruct), `<tool_call>` and `</tool_call>` (added, not special: a turn's decoded text keeps them), and
    Qwen2.5's chat template."""
    from lit_rl.modeling.models import build_char_tokenizer

    tokenizer = build_char_tokenizer(model_max_length=model_max_length)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    return tokenizer


def save_qwen_chat_model(path: Path) -> Path:
    """A randomly initialised tiny Qwen2 (seed 0) with `qwen_chat_tokenizer`, saved at `path`."""
    return save_chat_model(path, qwen_chat_tokenizer())


def save_chat_model(path: Path, tokenizer) -> Path:
    """A randomly initialised tiny Qwen2 (seed 0) of `tokenizer`'s vocabulary, saved with it at `path`."""
    import torch
    from transformers import Qwen2ForCausalLM

    from lit_rl.modeling.models import tiny_qwen2_config

    config = tiny_qwen2_config(vocab_size=len(tokenizer), max_position_embeddings=tokenizer.model_max_length)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
