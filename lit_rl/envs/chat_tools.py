"""Tool calls in the model's own chat format: what an instruct model (Qwen2.5/3, Hermes) already knows.

- **The tools** are plain Python functions with type hints and a Google-style docstring, sync or `async def`. Their
  JSON schemas (`tool_schema`: what `transformers.utils.get_json_schema` makes) reach the prompt through the
  tokenizer's chat template (`apply_chat_template(..., tools=schemas)`), as the model saw them in its training.
- **The calls** come out of a model turn in the template's markup. lit-rl reads two formats itself
  (`parse_tool_calls`): Qwen's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more
  in a turn; or Llama 3.x's bare JSON, the turn itself being `{"name": ..., "parameters": {...}}` (after
  `<|python_tag|>` if the model wrote one), one call a turn as its template allows; or the pythonic list
  `[name(a=1, b="x"), ...]` that vLLM's pythonic templates ask Llama 3.2 and Llama 4 for (read as literals with
  `ast`: no code runs). Any other format is read by
  transformers' `parse_response` where the tokenizer has a `response_template` (`TemplateCalls`), its own or, as
  TRL's trainer gives it, TRL's for its chat template (`trls_response_template`: Qwen3.5-3.8's XML calls,
  gpt-oss, GLM, Nemotron, LFM2, Gemma 4), on the turn decoded with its special tokens, as the template's markup
  needs. Which one is found from the tokenizer (`template_tool_support`). A turn without a call ends the episode.
  As TRL reads them: a call inside the model's reasoning (`<think>...</think>`) is not made, and a string argument is
  typed by the tool's schema (`"3"` is 3 for an integer parameter).
- **The results** go back as `tool` messages (`{"role": "tool", "name": ..., "content": ...}`), one per call, which
  `ChatRenderer` renders through the same template and appends token-in, token-out: only the new messages' tokens
  are appended to the episode's ids, the history is never re-tokenised.
- **Failures are observations**: a call that is not JSON, names no tool or an unknown one, has arguments the function
  does not take, raises, or runs past `timeout_s`, is answered with a tool message `error: ...` and counted in
  `tool_errors`; the model sees what went wrong, the run goes on.

`lit_rl.envs.tools` keeps the built-in tags (`<calc>1+2</calc>` -> `<result>3</result>`) that the shipped tiny
model was trained on; `model.env.tool_format` picks one or the other (`auto`: the chat format when the tokenizer's
chat template renders tools).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional

from lit_rl.envs import runner
from lit_rl.envs.base import StepResult
from lit_rl.envs.runner import EnvCallTimeout, call_in_thread
from lit_rl.errors import ConfigError, one_line

TOOL_FORMATS = ("auto", "tags", "chat")
# A Hermes turn's regions, left to right: a call, or a `<think>` block (closed, or open to the turn's end) whose calls
# the model only thought about, as TRL's Qwen3 response template reads them (a `<think>` inside a call is its text).
_HERMES_REGIONS = re.compile(r"<tool_call>(?P<call>.*?)</tool_call>|<think>.*?(?:</think>|\Z)", re.DOTALL)
_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# Stand-in turns the observation renderer builds its history from (their text never reaches an episode).
_STAND_IN_QUESTION = "lit-rl stand-in question"
_STAND_IN_ANSWER = "lit-rl stand-in answer"


# Schemas made so far, by function (a bound method's: its class's function). Each episode builds its environment,
# and `get_json_schema` takes about 0.2 ms a function (here): made once, not once per episode of every step.
_SCHEMAS: dict[Callable[..., Any], dict[str, Any]] = {}


def tool_schema(tool: Callable[..., Any]) -> dict[str, Any]:
    """`tool`'s JSON schema as transformers' `get_json_schema` makes it (name, description, typed parameters, from
    the signature and the docstring); a one-line `ConfigError` naming the tool when it lacks either. Made once per
    function: the methods of every instance of a class share their schemas."""
    key = getattr(tool, "__func__", tool)
    if key not in _SCHEMAS:
        _SCHEMAS[key] = _described(tool)
    return _SCHEMAS[key]


def _described(tool: Callable[..., Any]) -> dict[str, Any]:
    """`get_json_schema(tool)`, its failure as one line naming the tool."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as err:  # DocstringParsingException, TypeHintParsingException
        name = getattr(tool, "__name__", repr(tool))
        message = one_line(err)
        raise ConfigError(
            f"model.env.tools: {name} cannot be described to the model ({message}); a chat-format tool needs a type "
            "hint on every argument and a docstring with an Args: line for each"
        ) from None


# What a chat template does with tools (`template_tool_support`): calls read by the tokenizer's `response_template`,
# the two call formats lit-rl reads itself, another, none.
RESPONSE_TEMPLATE, HERMES, LLAMA3, PYTHONIC = "response_template", "hermes", "llama3", "pythonic"
OTHER, NONE = "other", "none"
CALL_FORMATS = (RESPONSE_TEMPLATE, HERMES, LLAMA3, PYTHONIC)
_PYTHON_TAG = "<|python_tag|>"  # Llama 3.x's marker before a call (special: usually decoded away already)
# Llama 4's markers around a pythonic call list (special: usually decoded away already).
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
# A turn that opens a pythonic call list (`[name(` or `[a.b(`): one that then cannot be read is a malformed call,
# where any other turn (`[1, 2]`, prose) is an answer.
_PYTHONIC_OPENING = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
# The JSON spellings a model may use in a Python call (`f(flag=true)`), read as their Python values.
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CALL_END_TOKENS = ("<|eom_id|>",)  # Llama 3.x: the end of a turn that calls a tool (`ChatRenderer`)


def template_tool_support(tokenizer: Any) -> str:
    """What the tokenizer's chat template does with tools: `hermes` when it writes a call as
    `<tool_call>{json}</tool_call>` (Qwen2.5/3, Hermes), `llama3` when it writes the bare JSON `{"name": ...,
    "parameters": ...}` (Llama 3.1-3.3), `pythonic` when it writes `[name(x=1)]` (vLLM's Llama 3.2 and Llama 4
    pythonic templates), all read by lit-rl; otherwise `response_template` when the tokenizer has
    a `response_template` that reads tool calls (transformers' parsing), `other` when it has none (not parsed);
    `none` when the template never reads `tools`."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default, or a "tool_use" one
        template = " ".join(template.values())
    if not isinstance(template, str) or re.search(r"\btools\b", template) is None:
        return NONE
    own = _own_call_format(tokenizer)
    if own == OTHER and _reads_tool_calls(getattr(tokenizer, "response_template", None)):
        return RESPONSE_TEMPLATE
    return own


def _own_call_format(tokenizer: Any) -> str:
    """Which of lit-rl's own call formats the chat template writes a call in (`hermes`, `llama3`, `pythonic`), found
    by rendering one; `other` for any other. lit-rl's parsers go first where they apply: they read what the released
    templates' models write, Llama's call ended by `<|eom_id|>` among it, which TRL's response template for Llama
    does not."""
    call = {"type": "function", "function": {"name": "lit_rl_probe", "arguments": {"x": 1}}}
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # a template that raises on a tool call cannot be the format lit-rl parses
        return OTHER
    # JSON inside the tags: Qwen3.5 writes XML inside them (<tool_call><function=...>), another format.
    if re.search(r'<tool_call>\s*\{"name": "lit_rl_probe"', text):
        return HERMES
    if re.search(r'\{"name": "lit_rl_probe", "parameters": \{', text):
        return LLAMA3
    # Llama 3.2's pythonic template writes the value as it is, Llama 4's quoted; the list is the turn itself, after
    # the header's white space. LFM2's templates wrap it in <|tool_call_start|> markup, after the turn's content: a
    # format of its own, which TRL's response template reads.
    return PYTHONIC if re.search(r'(?<=\s)\[lit_rl_probe\(x=(1|"1")\)\]', text) else OTHER


def trls_response_template(tokenizer: Any) -> Optional[dict[str, Any]]:
    """TRL's response template for the tokenizer's chat template, the one TRL's `GRPOTrainer` gives a tokenizer
    without one (`trl.chat_template_utils.add_response_schema`: Qwen3.5-3.8, gpt-oss, GLM-4 MoE, Nemotron 3, LFM2,
    Gemma 4, matched exactly as released); None when TRL is not installed (it is no dependency of lit-rl) or does
    not know the template. The tokenizer is not changed: TRL writes on a stand-in holding only its chat template."""
    try:
        from trl.chat_template_utils import add_response_schema
    except Exception:  # not installed, or an install that does not import: TRL is optional
        return None
    stand_in = SimpleNamespace(chat_template=getattr(tokenizer, "chat_template", None))
    try:
        add_response_schema(stand_in)
    except ValueError:  # "Unrecognized chat template"
        return None
    template = getattr(stand_in, "response_template", None)
    return template if _reads_tool_calls(template) else None


def _reads_tool_calls(response_template: Any) -> bool:
    """Whether a tokenizer's `response_template` has a `tool_calls` field (one for reasoning alone does not)."""
    return isinstance(response_template, dict) and "tool_calls" in (response_template.get("fields") or {})


@dataclass(frozen=True)
class TemplateCalls:
    """Reads a model turn's calls with the tokenizer's `response_template`, through transformers' `parse_response`.

    Args:
        template: the tokenizer's `response_template` (transformers' response parsing, version 1), compiled.
        prefix: what the chat template writes before a model turn: a stand-in user message and the generation prompt,
            so that the template's start anchor (`<|im_start|>assistant\n`) and anything the generation prompt
            pre-writes (an empty `<think></think>`) are seen, as `parse_response` asks.
    """

    template: Any  # compiled once (transformers' `ResponseTemplate`), not at every turn
    prefix: str

    @classmethod
    def of(cls, tokenizer: Any, template: Optional[dict[str, Any]] = None) -> Optional["TemplateCalls"]:
        """The reader of `template` (TRL's, `trls_response_template`), else of the tokenizer's own response template;
        None when that reads no tool calls; a one-line `ConfigError` when transformers cannot compile it (before any
        rollout, not as an error at every turn)."""
        from transformers.utils.chat_parsing.response_templates import load_response_template

        source = "TRL's response template for the chat template"
        if template is None:
            template = getattr(tokenizer, "response_template", None)
            source = "the tokenizer's response_template (tokenizer_config.json)"
        if not _reads_tool_calls(template):
            return None
        try:
            compiled = load_response_template(template)
        except (ValueError, TypeError, KeyError) as err:
            message = one_line(err)
            raise ConfigError(f"{source} cannot read tool calls: {message}") from None
        question = [{"role": "user", "content": _STAND_IN_QUESTION}]
        prefix = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
        return cls(compiled, prefix)

    def parse(self, text: str, schemas: Optional[list[dict[str, Any]]] = None) -> list[ToolCall]:
        """The calls of a turn (`text`: decoded with its special tokens), their arguments typed by the tools'
        `schemas` as transformers types them (`"7"` -> 7 for an integer parameter); one call with the parser's error
        when the turn's markup cannot be read."""
        from transformers.utils.chat_parsing import parse_response

        try:
            message = parse_response(text, self.template, prefix=self.prefix, tools=schemas)
        except Exception as err:  # a malformed call: the model is told, as for lit-rl's own formats
            reason = one_line(err, 300)
            return [ToolCall(None, {}, f"the tool calls cannot be read ({type(err).__name__}: {reason})")]
        calls = (message.get("tool_calls") if isinstance(message, dict) else None) or []
        # Each call is `{"type": "function", "function": {"name": ..., "arguments": {...}}}`, as the chat format's.
        return [_tool_call(call.get("function") if isinstance(call, dict) else call, "arguments") for call in calls]


def check_tool_format(tool_format: str) -> None:
    """A one-line error unless `model.env.tool_format` is one of `TOOL_FORMATS`."""
    if tool_format not in TOOL_FORMATS:
        raise ConfigError(f"model.env.tool_format must be one of {', '.join(TOOL_FORMATS)}, got {tool_format!r}")


def uses_chat_tools(tool_format: str, support: str) -> bool:
    """Whether `model.env.tool_format` (auto, tags, chat) means calls in the chat format, given the tokenizer's
    `template_tool_support`; a one-line error when the chat format is asked of, or is the only choice for, a template
    whose calls lit-rl cannot read."""
    check_tool_format(tool_format)
    if tool_format == "tags":
        return False
    if support in CALL_FORMATS:
        return True
    if tool_format == "auto" and support == NONE:
        return False
    if support == NONE:
        raise ConfigError(
            "model.env.tool_format is chat but the tokenizer's chat template does not render tools (it never reads "
            "`tools`); give a tool-calling model's template, or use tool_format tags"
        )
    raise ConfigError(f"model.env.tools: {UNREAD_CALLS}; or set model.env.tool_format tags for lit-rl's tags")


# Said once when the run reads the model's calls with TRL's response template (`trls_response_template`).
TRLS_RESPONSE_TEMPLATE = (
    "model.env: the chat template writes tool calls in a format lit-rl does not read by itself; they are read "
    "with TRL's response template for it (trl.chat_template_utils.add_response_schema), as TRL's GRPOTrainer reads them"
)

# Why a template whose calls lit-rl cannot read is refused, and the way out.
UNREAD_CALLS = (
    "the tokenizer's chat template writes tool calls in a format lit-rl does not read by itself (it reads Qwen's and "
    "Hermes' <tool_call>{json}</tool_call>, Llama 3.x's bare JSON and pythonic [f(x=1)] lists) and the tokenizer has "
    "no response_template to read them with; give it one (tokenizer.response_template, then "
    "tokenizer.save_pretrained), or install trl, whose add_response_schema knows Qwen3.5-3.8, gpt-oss, GLM-4 MoE, "
    "Nemotron 3, LFM2 and Gemma 4 as released"
)


@dataclass
class ToolCall:
    """One call the model wrote: the tool's name and its keyword arguments; or why it could not be read."""

    name: Optional[str]
    arguments: dict[str, Any]
    error: Optional[str] = None


def chat_prompt(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages, as tools in the chat format need it: a text prompt becomes a user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def parse_tool_calls(
    text: str, call_format: str = HERMES, schemas: Optional[list[dict[str, Any]]] = None
) -> list[ToolCall]:
    """The tool calls of a model turn, in order; a call that cannot be read keeps its error.

    - `hermes` (Qwen2.5/3, Hermes): every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in `text`
      outside the model's reasoning (`<think>...</think>`, or open to the turn's end; text before a `</think>` the
      turn never opened, the generation prompt having opened it), as TRL's Qwen3 response template and vLLM's
      reasoning parser leave it out: a call the model thought about is not made.
    - `llama3` (Llama 3.1-3.3): the turn itself, when it is a JSON object (after `<|python_tag|>` and white space):
      `{"name": ..., "parameters": {...}}` (`arguments` is read too), one call; text after the object is ignored, as
      Llama's own parsers do. A turn that does not start with `{`, or whose object has neither `parameters` nor
      `arguments` (`{"answer": 5}`), is an answer, not a call, as vLLM's `llama3_json` parser reads it.
    - `pythonic` (vLLM's Llama 3.2 and Llama 4 pythonic templates): `pythonic_calls`.

    The arguments may be an object or a JSON string holding one. Given the tools' `schemas`, a string argument is
    typed by its parameter's JSON schema type (`typed_arguments`), as transformers' `parse_response` types it for
    TRL."""
    calls = _read_calls(text, call_format)
    return typed_arguments(calls, schemas) if schemas else calls


def _read_calls(text: str, call_format: str) -> list[ToolCall]:
    """`parse_tool_calls` before the arguments are typed."""
    if call_format == PYTHONIC:
        return pythonic_calls(text)
    if call_format == LLAMA3:
        body = text.strip().removeprefix(_PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return []
        try:
            call, _ = json.JSONDecoder().raw_decode(body)
        except _NOT_DECODED as err:
            return [ToolCall(None, {}, _not_json(err))]
        if not isinstance(call, dict) or not ({"parameters", "arguments"} & set(call)):
            return []
        return [_tool_call(call, "parameters" if "parameters" in call else "arguments")]
    calls = []
    for match in _HERMES_REGIONS.finditer(_after_prewritten_reasoning(text)):
        if match.group("call") is None:  # a `<think>` block
            continue
        try:
            call = json.loads(match.group("call").strip())
        except _NOT_DECODED as err:
            calls.append(ToolCall(None, {}, _not_json(err)))
            continue
        calls.append(_tool_call(call, "arguments"))
    return calls


# What `json.loads` raises on a model's text: `JSONDecodeError` (a `ValueError`), `ValueError` for an integer past
# Python's 4300 digits, `RecursionError` for values nested past the interpreter's limit. Each is a malformed call.
_NOT_DECODED = (ValueError, RecursionError)


def _not_json(err: Exception) -> str:
    """Why a call is not JSON, as the model is told it: the decoder's message and where, or the limit it ran past."""
    if isinstance(err, json.JSONDecodeError):
        return f"the tool call is not JSON ({err.msg} at character {err.pos})"
    if isinstance(err, RecursionError):
        return "the tool call is not JSON (nested too deep)"
    return f"the tool call is not JSON ({one_line(err, 120)})"


def _after_prewritten_reasoning(text: str) -> str:
    """`text` after a `</think>` that comes before any `<think>`, outside a call: the reasoning a generation prompt
    opened (Qwen3's thinking templates write `<think>` there), which the turn only closes."""
    closing, opening = text.find(_THINK_CLOSE), text.find(_THINK_OPEN)
    if closing < 0 or 0 <= opening < closing:
        return text
    call = text.rfind("<tool_call>", 0, closing)
    if call >= 0 and text.find("</tool_call>", call, closing) < 0:
        return text  # inside a call: an argument that writes `</think>`
    return text[closing + len(_THINK_CLOSE) :]


def typed_arguments(calls: list[ToolCall], schemas: list[dict[str, Any]]) -> list[ToolCall]:
    """`calls` with each string argument (or list of strings, for a parameter that is no array) typed by its
    parameter's JSON schema type in the tools' `schemas`: `"3"` -> 3 for an integer, `"true"` -> True for a boolean,
    with transformers' own helpers, as `parse_response` types TRL's calls. A string that is not of its type (`"x"` for
    an integer) stays as written, as transformers leaves it: the tool gets it, and says what is wrong."""
    try:  # private helpers of transformers' (5.16-5.19): without them the arguments stay as written
        from transformers.utils.chat_parsing.response_parser import _coerce, _schema_types
    except ImportError:
        return calls

    def coerced(raw: str, types: tuple[str, ...]) -> Any:
        try:
            return _coerce(raw, types)
        except RecursionError:  # an object or array argument nested past the interpreter's limit: as written
            return raw

    properties = {schema["function"]["name"]: _parameters(schema) for schema in schemas}
    for call in calls:
        declared = properties.get(call.name) or {}
        for key, value in call.arguments.items():
            types = _schema_types(declared.get(key))
            if not types:
                continue
            if isinstance(value, str):
                call.arguments[key] = coerced(value, types)
            elif isinstance(value, list) and "array" not in types:
                call.arguments[key] = [coerced(item, types) if isinstance(item, str) else item for item in value]
    return calls


def _parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool schema's parameters' schemas, by name (none for a schema without them)."""
    parameters = schema["function"].get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


def pythonic_calls(text: str) -> list[ToolCall]:
    """The calls of a turn that is a Python list of calls, `[name(a=1, b="x"), other()]` (after Llama 4's
    `<|python_start|>`, its `<|python_end|>` dropped), as vLLM's `pythonic` parser reads them: keyword arguments whose
    values are JSON's kinds of literal (strings, numbers, lists, dicts with string keys, True/False/None, and JSON's
    true/false/null), read with `ast.literal_eval`, so nothing the model writes is run. A turn that is no call list
    (prose, `[1, 2]`) is an answer; one that opens a call (`[name(`) but cannot be read, nested past what Python's
    parser or this reader recurses through among them, is one call with the reason."""
    body = text.strip().removeprefix(_PYTHON_START).replace(_PYTHON_END, "").strip()
    if not body.startswith("["):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not any(isinstance(element, ast.Call) for element in tree.elts):
            return []
        return [_pythonic_call(element) for element in tree.elts]
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        if _PYTHONIC_OPENING.match(body) is None:
            return []
        reason = f"{err.msg} at character {err.offset}" if isinstance(err, SyntaxError) else type(err).__name__
        return [ToolCall(None, {}, f"the tool calls are not a Python list of calls ({reason})")]


def _pythonic_call(node: ast.expr) -> ToolCall:
    """One element of a pythonic call list -> its ToolCall, or why it cannot be one (`RecursionError` from a value
    nested past the interpreter's limit is the caller's to catch)."""
    if not isinstance(node, ast.Call):
        return ToolCall(None, {}, "every element of the call list must be a call, name(argument=value)")
    name = _dotted_name(node.func)
    if name is None:
        return ToolCall(None, {}, "the tool call's name is not a name (write name(argument=value))")
    if node.args or any(keyword.arg is None for keyword in node.keywords):
        return ToolCall(name, {}, "pass every argument by name, name(argument=value)")
    arguments = {}
    for keyword in node.keywords:
        try:
            value = ast.literal_eval(_JSONNamesAsConstants().visit(keyword.value))
        except (ValueError, TypeError, SyntaxError):
            value = _NOT_JSON
        if not _json_like(value):
            return ToolCall(name, {}, f"argument {keyword.arg!r} is not a literal value (write it out, no variables)")
        arguments[keyword.arg] = value
    return ToolCall(name, arguments)


_NOT_JSON = object()  # a value `ast.literal_eval` could not read


def _json_like(value: Any) -> bool:
    """Whether `value` is one of JSON's kinds (what a chat-format call's arguments are): no tuple, set, bytes,
    complex number or `...`, which `ast.literal_eval` also reads."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return True
    if isinstance(value, list):
        return all(_json_like(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(key, str) and _json_like(item) for key, item in value.items())
    return False


def _dotted_name(node: ast.expr) -> Optional[str]:
    """`name` or `a.b.name` as written; None for anything else (`f()(...)`, `(lambda: 1)(...)`). A loop, not a
    recursion: a name dotted a thousand times deep is read like any other."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


class _JSONNamesAsConstants(ast.NodeTransformer):
    """JSON's `true`, `false`, `null` (a model may write them in a Python call) as Python's constants, at any depth."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(_JSON_NAMES[node.id]) if node.id in _JSON_NAMES else node


def _tool_call(call: Any, arguments_key: str) -> ToolCall:
    """A decoded call object -> its ToolCall (the arguments under `arguments_key`), or why it cannot be made."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(None, {}, 'the tool call has no "name"')
    arguments = call.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except _NOT_DECODED:
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(call["name"], {}, f'"{arguments_key}" is not a JSON object')
    return ToolCall(call["name"], arguments)


def _call(tool: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """`tool(**arguments)`; an `async def` tool is run to completion on this (worker) thread's own event loop."""
    if inspect.iscoroutinefunction(tool):
        return asyncio.run(tool(**arguments))
    return tool(**arguments)


def _as_text(value: Any) -> str:
    """A tool's return value as a message's content: `str(value)`, as TRL writes it."""
    return value if isinstance(value, str) else str(value)


class ChatToolEnvironment:
    """Runs every tool call of a model turn written in the chat format (module docstring) and answers each with a
    `tool` message; a turn without a call ends the episode. No reward parts of its own: the reward functions score
    the transcript. With `call_format` `response_template`, `step` is given each turn decoded with its special
    tokens (`EnvironmentSpec.raw_turns`: the template's markup may be special tokens), a subclass's too.

    Args:
        tools: the functions (`model.env.tools` import paths), each called with the call's arguments as keywords.
        timeout_s: the time limit of one call, on a thread of its own; None: called on the step's thread, bounded
            by the step's time limit (`model.env.step_timeout_s`).
        call_format: how the model's calls are read: `response_template` (the tokenizer's, `template_calls`),
            `hermes`, `llama3` or `pythonic` (`parse_tool_calls`); its tokenizer's (`template_tool_support`; set
            by lit-rl).
        template_calls: with `call_format` `response_template`: the tokenizer's (`TemplateCalls.of`; set by
            lit-rl).
    """

    reward_names: tuple[str, ...] = ()

    def __init__(
        self,
        tools: Optional[list[Callable[..., Any]]] = None,
        timeout_s: Optional[float] = 5.0,
        call_format: str = HERMES,
        template_calls: Optional[TemplateCalls] = None,
    ) -> None:
        self.take_call_format(call_format, template_calls)
        if not tools:
            raise ConfigError("ChatToolEnvironment needs at least one tool (model.env.tools)")
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"model.env.environment_args.timeout_s must be > 0, got {timeout_s}")
        self.schemas = [tool_schema(tool) for tool in tools]
        self.tools = {schema["function"]["name"]: tool for schema, tool in zip(self.schemas, tools)}
        if len(self.tools) < len(tools):
            names = [schema["function"]["name"] for schema in self.schemas]
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ConfigError(f"model.env.tools: two tools are named {twice[0]!r}; names must be unique")
        self.timeout_s = timeout_s

    def take_call_format(self, call_format: str, template_calls: Optional[TemplateCalls]) -> None:
        """Read the model's calls in `call_format` (with `template_calls` for `response_template`)."""
        if call_format not in CALL_FORMATS:
            raise ConfigError(f"{type(self).__name__} call_format must be one of {', '.join(CALL_FORMATS)}")
        if call_format == RESPONSE_TEMPLATE and template_calls is None:
            raise ConfigError(
                f"{type(self).__name__} call_format response_template needs template_calls (the tokenizer's, "
                "TemplateCalls.of(tokenizer))"
            )
        self.call_format, self.template_calls = call_format, template_calls

    def reset(self, row: dict[str, Any]) -> None:
        return None  # the row's prompt (with the tools' schemas, through the chat template) is the first observation

    def read_calls(self, completion: str) -> list[ToolCall]:
        """The calls of a model turn, read in this environment's `call_format`."""
        if self.call_format == RESPONSE_TEMPLATE:
            return self.template_calls.parse(completion, self.schemas)
        return parse_tool_calls(completion, self.call_format, self.schemas)

    def step(self, completion: str) -> StepResult:
        calls = self.read_calls(completion)
        if not calls:
            return StepResult(observation=None, done=True)
        messages, errors = [], 0
        for call in calls:
            content, failed = self.run(call)
            errors += int(failed)
            messages.append(self.tool_message(call, content))
        return StepResult(observation=messages, tool_calls=len(calls), tool_errors=errors)

    def tool_message(self, call: ToolCall, content: str) -> dict[str, str]:
        """The `tool` message answering `call`. Only a registered name reaches the template's markup: the model's
        own text could hold special tokens."""
        return {"role": "tool", "name": call.name if call.name in self.tools else "unknown", "content": content}

    def call_error(self, call: ToolCall) -> Optional[str]:
        """What the model sees of a call that cannot be made (unreadable, or naming no tool); None: it can."""
        if call.error is not None:
            return f"error: {call.error}"
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r} (the tools are {', '.join(sorted(self.tools))})"
        return None

    def run(self, call: ToolCall) -> tuple[str, bool]:
        """The call's result as a message's content, and whether it failed (then the content is `error: ...`)."""
        error = self.call_error(call)
        if error is not None:
            return error, True
        tool = self.tools[call.name]
        try:
            inspect.signature(tool).bind(**call.arguments)
        except TypeError as err:
            return f"error: {call.name}: {err}", True
        try:
            if self.timeout_s is None:
                value = _call(tool, call.arguments)
            else:
                value = call_in_thread(_call, (tool, call.arguments), self.timeout_s, runner.tool_overrunning)
        except EnvCallTimeout as err:
            return f"error: {err}", True
        except Exception as err:  # the tool's own error, shown to the model
            return f"error: {type(err).__name__}: {err}", True
        return _as_text(value), False


class ChatRenderer:
    """Chat messages (an observation) -> the token ids appended to an episode after a model turn, token-in,
    token-out: the tokens the chat template puts after an assistant message for these messages, then its
    generation prompt. They are found by rendering a stand-in conversation (a user question, an assistant answer, the
    messages) and keeping what follows the answer; the episode's own history is never rendered or re-tokenised, and
    a template that renders earlier turns differently once more follow (Qwen3 drops the empty `<think>` block of an
    assistant turn that is no longer the last) needs no special case. What the model already wrote of the closing
    markup (its end-of-turn token, `<|im_end|>` for Qwen) is not repeated; a turn cut short by its token budget gets
    the whole closing.

    Message contents are encoded as text: a tool's result that contains a special token's text (`<|im_end|>`)
    gets that text's characters, never the special token, so an observation cannot end a turn or forge a role. A
    template that writes a content as JSON (Llama 3.1's `message.content | tojson`) gets it JSON-encoded the same way.

    Args:
        tokenizer: the policy's tokenizer, with a chat template.
        tools: the schemas given to the template (the same as the prompt's, so the renders agree).
        template_kwargs: more of the template's variables (`enable_thinking`), the same as the prompt's.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Optional[list[dict[str, Any]]] = None,
        template_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools
        self.template_kwargs = dict(template_kwargs or {})
        self.history = [
            {"role": "user", "content": _STAND_IN_QUESTION},
            {"role": "assistant", "content": _STAND_IN_ANSWER},
        ]
        base = self._render(self.history, generation_prompt=False)
        answer_end = base.rindex(_STAND_IN_ANSWER) + len(_STAND_IN_ANSWER)
        self.closing = tokenizer.encode(base[answer_end:], add_special_tokens=False)  # `<|im_end|>`, `\n` for Qwen
        # Llama 3.x ends a tool call with `<|eom_id|>` ("end of message": a tool's result follows), in place of the
        # `<|eot_id|>` its template closes a turn with: a turn ending in it has closed itself.
        self.call_end_ids = {tokenizer.convert_tokens_to_ids(t) for t in _CALL_END_TOKENS if t in tokenizer.get_vocab()}

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def observation_ids(self, messages: list[dict[str, Any]], turn_ids: list[int]) -> list[int]:
        """The ids to append after a model turn whose sampled ids are `turn_ids` (module and class docstrings)."""
        return self.attributed_observation(messages, turn_ids)[0]

    def attributed_observation(
        self, messages: list[dict[str, Any]], turn_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """`observation_ids`, and for each id the index of the message it renders (its markup and content; -1 for
        the generation prompt after the last)."""
        placeholders = [f"\x00lit-rl content {k}\x00" for k in range(len(messages))]
        stand_ins = [{**message, "content": placeholder} for message, placeholder in zip(messages, placeholders)]
        full = self._render(self.history + stand_ins, generation_prompt=True)
        first = full.find(placeholders[0]) if placeholders else -1
        answer = full.rfind(_STAND_IN_ANSWER, 0, first if first >= 0 else len(full))
        if answer < 0:
            raise ValueError("the chat template does not render the assistant's turn before these messages")
        added = full[answer + len(_STAND_IN_ANSWER) :]
        ids: list[int] = []
        owners: list[int] = []
        for k, (message, placeholder) in enumerate(zip(messages, placeholders)):
            content = _as_text(message.get("content", ""))
            markup, found, rest = added.partition(placeholder)
            if not found:  # written as JSON (quoted, escaped), as transformers' `tojson` filter writes it
                markup, found, rest = added.partition(json.dumps(placeholder, ensure_ascii=False))
                content = json.dumps(content, ensure_ascii=False)
            if not found:
                raise ValueError(f"the chat template does not render the content of message {k} as it is")
            added = rest
            ids += self.tokenizer.encode(markup, add_special_tokens=False)
            ids += self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
            owners += [k] * (len(ids) - len(owners))
        ids += self.tokenizer.encode(added, add_special_tokens=False)
        owners += [-1] * (len(ids) - len(owners))
        written = self._already_written(turn_ids, ids)
        return ids[written:], owners[written:]

    def _already_written(self, turn_ids: list[int], ids: list[int]) -> int:
        """How many of the closing markup's first tokens (which `ids` begin with) end the model's turn (its
        `<|im_end|>`)."""
        for k in range(min(len(turn_ids), len(self.closing)), 0, -1):
            if turn_ids[-k:] == self.closing[:k] == ids[:k]:
                return k
        if turn_ids and turn_ids[-1] in self.call_end_ids and self.closing[:1] == ids[:1]:
            return 1
        return 0
