"""Tool calls in the model's chat format (`lit_rl.envs.chat_tools`), on Qwen2.5's chat template
(`tests.qwen_chat`): schemas from functions, calls parsed from `<tool_call>` markup, results as `tool` messages
rendered by the template and appended token-in, token-out."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from lit_rl.envs.chat_tools import (
    ChatRenderer,
    ChatToolEnvironment,
    TemplateCalls,
    parse_tool_calls,
    template_tool_support,
    tool_schema,
    uses_chat_tools,
)
from lit_rl.envs.runner import EnvironmentRunner
from lit_rl.errors import ConfigError
from lit_rl.modeling.models import build_char_tokenizer
from lit_rl.rollout import SamplingParams
from lit_rl.rollout.multi_turn import run_episodes
from tests.integration.envs import add_numbers, slow_echo
from tests.llama_chat import llama_chat_tokenizer
from tests.qwen_chat import qwen_chat_tokenizer, save_qwen_chat_model
from tests.test_multi_turn import ScriptedEngine


def _trl_template(name: str) -> str:
    """A chat template TRL ships (`trl/chat_templates/<name>.jinja`: the models' own, as released)."""
    trl = pytest.importorskip("trl")
    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer():
    return qwen_chat_tokenizer()


def _call(name, arguments):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def test_a_functions_schema_comes_from_its_type_hints_and_docstring():
    assert tool_schema(add_numbers) == {
        "type": "function",
        "function": {
            "name": "add_numbers",
            "description": "Adds two integers (a tool the model calls in its chat format).",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first integer"},
                    "b": {"type": "integer", "description": "the second integer"},
                },
                "required": ["a", "b"],
            },
            "return": {"type": "integer"},
        },
    }

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ConfigError) as err:
        tool_schema(undocumented)
    message = str(err.value)
    assert "\n" not in message and "model.env.tools: undocumented cannot be described" in message


def test_the_chat_format_is_chosen_when_the_template_writes_calls_lit_rl_reads(tokenizer):
    tiny = build_char_tokenizer()  # the shipped tiny model's template: contents only, no tools
    llama = llama_chat_tokenizer()  # Llama 3.1's: reads `tools`, writes calls as bare JSON
    phi = qwen_chat_tokenizer()
    phi.chat_template = _trl_template("phi3_5")  # no tools
    gemma = qwen_chat_tokenizer()
    gemma.chat_template = _trl_template("gemma4")  # reads `tools`, writes calls its own way
    supports = [template_tool_support(t) for t in (tokenizer, tiny, llama, phi, gemma)]
    assert supports == ["hermes", "none", "llama3", "none", "other"]
    assert template_tool_support(llama_chat_tokenizer(template="llama3_2")) == "llama3"
    assert template_tool_support(llama_chat_tokenizer(template="llama3_2_pythonic")) == "pythonic"
    quoting = llama_chat_tokenizer(template="llama3_2_pythonic")  # Llama 4's pythonic template quotes every value
    quoting.chat_template = quoting.chat_template.replace("value | tojson", "'\"' + value | string + '\"'")
    assert template_tool_support(quoting) == "pythonic"
    lfm = qwen_chat_tokenizer()  # LFM2.5 writes [f(x=1)] inside <|tool_call_start|> markup, after the content
    lfm.chat_template = _trl_template("lfm2_2_5")
    assert template_tool_support(lfm) == "other"  # not lit-rl's pythonic turn: TRL's response template reads it
    assert uses_chat_tools("auto", "pythonic")
    assert uses_chat_tools("auto", "hermes") and not uses_chat_tools("auto", "none")
    assert uses_chat_tools("auto", "llama3") and not uses_chat_tools("tags", "llama3")
    assert not uses_chat_tools("tags", "hermes") and not uses_chat_tools("tags", "other")
    assert uses_chat_tools("chat", "hermes")
    with pytest.raises(ConfigError, match="tool_format is chat but the tokenizer's chat template does not render"):
        uses_chat_tools("chat", "none")
    for tool_format in ("auto", "chat"):  # never a silent run whose calls are never read
        with pytest.raises(ConfigError, match="writes tool calls in a format lit-rl does not read by itself"):
            uses_chat_tools(tool_format, "other")
    with pytest.raises(ConfigError, match="model.env.tool_format must be one of auto, tags, chat, got 'json'"):
        uses_chat_tools("json", "hermes")


def test_calls_are_read_from_qwens_markup_and_a_bad_one_keeps_its_error():
    text = (
        "I will add. "
        + _call("add_numbers", '{"a": 2, "b": 3}')
        + _call("add_numbers", '"{\\"a\\": 1, \\"b\\": 1}"')  # arguments as a JSON string
        + "<tool_call>{not json</tool_call>"
        + '<tool_call>{"arguments": {}}</tool_call>'
        + '<tool_call>{"name": "add_numbers", "arguments": [1, 2]}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls[:2]] == [
        ("add_numbers", {"a": 2, "b": 3}, None),
        ("add_numbers", {"a": 1, "b": 1}, None),
    ]
    assert calls[2].error.startswith("the tool call is not JSON") and calls[3].error == 'the tool call has no "name"'
    assert calls[4].error == '"arguments" is not a JSON object'
    assert parse_tool_calls("The answer is 5.") == []


def test_llama_calls_are_the_turns_json_and_an_answer_is_no_call():
    """Llama 3.x writes one call as the whole turn, `{"name": ..., "parameters": {...}}`, maybe after
    `<|python_tag|>`; a turn of prose is the answer."""
    calls = parse_tool_calls('<|python_tag|>{"name": "add_numbers", "parameters": {"a": 2, "b": 3}}', "llama3")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add_numbers", {"a": 2, "b": 3}, None)]
    calls = parse_tool_calls(' {"name": "add_numbers", "arguments": "{\\"a\\": 1, \\"b\\": 1}"} then', "llama3")
    assert [(c.name, c.arguments) for c in calls] == [("add_numbers", {"a": 1, "b": 1})]
    assert parse_tool_calls("The answer is 5.", "llama3") == []
    assert parse_tool_calls('{"answer": 5}', "llama3") == []  # a JSON answer: no parameters, no call
    # Qwen's markup is not Llama's call (and the other way round): a model writing the wrong one made no call.
    assert parse_tool_calls(_call("add_numbers", '{"a": 2, "b": 3}'), "llama3") == []
    assert parse_tool_calls('{"name": "add_numbers", "parameters": {}}') == []
    (bad,) = parse_tool_calls('{"name": "add_numbers", "parameters": {"a": 2', "llama3")
    assert bad.name is None and bad.error.startswith("the tool call is not JSON")
    assert parse_tool_calls('{"parameters": {}}', "llama3")[0].error == 'the tool call has no "name"'
    (listed,) = parse_tool_calls('{"name": "f", "parameters": [1]}', "llama3")
    assert listed.error == '"parameters" is not a JSON object'


def test_a_call_nested_too_deep_or_with_a_number_past_pythons_digits_is_the_models_error():
    """`json` raises `RecursionError` on a value nested past the interpreter's limit and `ValueError` on an integer
    past Python's 4300 digits: each is a call that is not JSON, told to the model and counted, not the run's end."""
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + ', "b": 1}'
    long = '{"a": ' + "9" * 4301 + ', "b": 1}'
    for arguments, reason in [(deep, "nested too deep"), (long, "Exceeds the limit (4300 digits)")]:
        (hermes,) = parse_tool_calls(_call("add_numbers", arguments))
        (llama,) = parse_tool_calls(f'{{"name": "add_numbers", "parameters": {arguments}}}', "llama3")
        for call in hermes, llama:
            assert call.name is None and call.error.startswith("the tool call is not JSON (") and reason in call.error
        step = ChatToolEnvironment([add_numbers]).step(_call("add_numbers", arguments))
        assert (step.tool_calls, step.tool_errors, step.done) == (1, 1, False)
        assert step.observation[0]["content"].startswith("error: the tool call is not JSON (")
        # The arguments as a JSON string holding such a value: not a JSON object.
        (quoted,) = parse_tool_calls(_call("add_numbers", json.dumps(arguments)))
        assert quoted.error == '"arguments" is not a JSON object'


def test_calls_in_the_models_reasoning_are_not_made():
    """Qwen3 thinks in `<think>...</think>` before it answers: a call written there is one the model thought about,
    which TRL's Qwen3 response template and vLLM's reasoning parser leave out of the calls; so does lit-rl."""
    made, thought = _call("add_numbers", '{"a": 1, "b": 1}'), _call("delete_all", "{}")
    turns = {
        f"<think>\nI could write {thought} but I will not.\n</think>\n\nThe answer is 2.": [],
        f"<think>\nadd first\n</think>\n\n{made}": ["add_numbers"],
        f"<think>\nstill thinking {thought}": [],  # open to the turn's end (cut by its token budget)
        f"{made}<think>then {thought}</think>{made}": ["add_numbers", "add_numbers"],
        _call("add_numbers", '{"a": 1, "b": 1, "note": "<think>"}'): ["add_numbers"],  # in a call: its text
    }
    for text, names in turns.items():
        assert [call.name for call in parse_tool_calls(text)] == names, text
    # The same calls as TRL's response template for Qwen3 reads (the Hermes format is lit-rl's own for Qwen3).
    qwen3 = TemplateCalls.of(_with_response_template(qwen_chat_tokenizer(), "qwen3"))
    for text, names in turns.items():
        assert [call.name for call in qwen3.parse(text + "<|im_end|>")] == names, text
    # Qwen3's thinking templates write `<think>` in the generation prompt: the turn only closes it.
    assert [call.name for call in parse_tool_calls(f"I could write {thought}\n</think>\n\n{made}")] == ["add_numbers"]
    # A `</think>` an argument writes is the call's text, not the end of reasoning the prompt opened.
    writes = _call("add_numbers", '{"a": 1, "b": 1, "note": "a </think> b"}')
    assert [call.name for call in parse_tool_calls(f"{made}{writes}")] == ["add_numbers", "add_numbers"]
    step = ChatToolEnvironment([add_numbers]).step(f"<think>{thought}</think>The answer is 2.")
    assert step.done and step.tool_calls == 0


def test_string_arguments_are_typed_by_the_tools_schema_as_transformers_types_trls_calls():
    """A model may write `{"n": "3"}` for an integer parameter: TRL's trainer reads its calls with transformers'
    `parse_response`, which types a string argument by the tool's JSON schema; lit-rl types its own formats' calls
    the same way, and a string that is not of its type stays as written."""

    def typed(n: int, x: float, flag: bool, word: str) -> str:
        """Shows its arguments as the tool got them.

        Args:
            n: an integer
            x: a number
            flag: a boolean
            word: a string
        """
        return repr((n, x, flag, word))

    arguments = '{"n": "3", "x": "2.5", "flag": "true", "word": "7"}'
    turns = {
        "hermes": _call("typed", arguments),
        "llama3": f'{{"name": "typed", "parameters": {arguments}}}',
        "pythonic": '[typed(n="3", x="2.5", flag="true", word="7")]',
    }
    for call_format, turn in turns.items():
        step = ChatToolEnvironment([typed], call_format=call_format).step(turn)
        assert step.observation[0]["content"] == "(3, 2.5, True, '7')", call_format
    trls = TemplateCalls.of(_with_response_template(qwen_chat_tokenizer(), "qwen2_5"))
    (call,) = trls.parse(turns["hermes"] + "<|im_end|>", [tool_schema(typed)])
    assert call.arguments == {"n": 3, "x": 2.5, "flag": True, "word": "7"}  # what TRL's trainer gives the tool
    (kept,) = parse_tool_calls(_call("typed", '{"n": "three", "x": "2"}'), schemas=[tool_schema(typed)])
    assert kept.arguments == {"n": "three", "x": 2}  # not an integer: as written, for the tool to refuse
    assert parse_tool_calls(turns["hermes"])[0].arguments["n"] == "3"  # no schemas: not typed


def test_pythonic_calls_are_a_python_list_of_literals_and_nothing_the_model_writes_runs():
    """vLLM's pythonic templates (Llama 3.2, Llama 4) ask for `[name(key=value, ...)]`: every call of the list is
    read, its values as literals (JSON's true/false/null too); prose or a list of values is an answer; a call list
    that cannot be read, positional arguments, variables, expressions and names that are not names are errors the
    model sees, and none of it is evaluated."""

    def read(text):
        return [(c.name, c.arguments, c.error) for c in parse_tool_calls(text, "pythonic")]

    assert read('[add_numbers(a=2, b=3), lookup(key="x y", flags=[true, null], opts={"k": false})]') == [
        ("add_numbers", {"a": 2, "b": 3}, None),
        ("lookup", {"key": "x y", "flags": [True, None], "opts": {"k": False}}, None),
    ]
    assert read("<|python_start|>[add_numbers(a=-1, b=2.5)]<|python_end|>") == [
        ("add_numbers", {"a": -1, "b": 2.5}, None)
    ]
    assert read("[tools.search(query='q')]") == [("tools.search", {"query": "q"}, None)]
    for answer in ("The answer is 5.", "[1, 2, 3]", "[]", "[unclosed prose"):
        assert read(answer) == [], answer
    ((name, _, error),) = read("[add_numbers(a=2, b=3")
    assert name is None and error.startswith("the tool calls are not a Python list of calls ('(' was never closed")
    assert read("[add_numbers(2, 3)]")[0][2] == "pass every argument by name, name(argument=value)"
    assert read("[add_numbers(**kw)]")[0][2] == "pass every argument by name, name(argument=value)"
    not_literal = "argument 'a' is not a literal value (write it out, no variables)"
    for value in ("x", "1+2", "open('/etc/passwd')", "__import__('os').getcwd()"):
        assert read(f"[add_numbers(a={value}, b=1)]") == [("add_numbers", {}, not_literal)], value
    ((name, _, error),) = read("[__import__('os').system(command='ls')]")
    assert name is None and error == "the tool call's name is not a name (write name(argument=value))"
    assert read("[add_numbers(a=1, b=2), 3]")[1][2] == "every element of the call list must be a call, " + (
        "name(argument=value)"
    )
    for value in ("(1, 2)", "{1, 2}", "b'1'", "1j", "...", "{1: 2}"):  # literals, but none of JSON's kinds
        assert read(f"[add_numbers(a={value}, b=1)]") == [("add_numbers", {}, not_literal)], value
    # Nested past any recursion limit (parser, names, values): one unreadable call, never a crash.
    assert read("[" * 200 + "f(") == []  # no call opens it: an answer
    deep = ["[(" + "-" * 900 + "1)(x=1)]", "[" + "a()" + "()" * 900 + "(x=1)]", "[f(x=" + "[" * 3000]
    for text in [*deep, "[f(x=" + "[" * 900 + "]" * 900 + ")]", "[(" + "1+" * 900 + "1)(x=1)]"]:
        ((name, _, error),) = read(text)
        assert error is not None, text[:40]
    assert read("[a" + ".a" * 1500 + "(x=1)]") == [("a" + ".a" * 1500, {"x": 1}, None)]  # a name, however dotted


def test_a_pythonic_episode_trains_the_sampled_calls_and_the_rendered_results_token_in_token_out():
    """Llama 3.2's pythonic format (`tests.llama_chat.LLAMA3_2_PYTHONIC`): a turn of two calls, their results in
    `ipython` turns, then the answer. The transcript is the prompt, the sampled ids and the rendered results, and
    decodes to exactly the template's rendering of the whole conversation; the second turn was sampled from it."""
    tokenizer = llama_chat_tokenizer(template="llama3_2_pythonic")
    question = [{"role": "user", "content": "What is 2+3, and 1+1?"}]
    env = ChatToolEnvironment([add_numbers], call_format="pythonic")
    turns = ["[add_numbers(a=2, b=3), add_numbers(a=1, b=1)]", "5 and 2."]
    prompt, prompt_ids, (call, answer), engine, episodes = _scripted_episode(tokenizer, env, question, turns)
    calls = [
        {"type": "function", "function": {"name": "add_numbers", "arguments": {"a": a, "b": b}}}
        for a, b in ((2, 3), (1, 1))
    ]
    results = [{"role": "tool", "name": "add_numbers", "content": c} for c in ("5", "2")]
    whole = tokenizer.apply_chat_template(
        [*question, {"role": "assistant", "content": "", "tool_calls": calls}, *results],
        tools=[tool_schema(add_numbers)],
        tokenize=False,
        add_generation_prompt=True,
    )
    call_text = "[add_numbers(a=2, b=3), add_numbers(a=1, b=1)]<|eot_id|>"
    assert whole.startswith(prompt + call_text)
    result_text = whole[len(prompt + call_text) :]
    assert result_text == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "5"}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "2"}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    result = tokenizer.encode(result_text, add_special_tokens=False)
    _assert_trains_the_sampled_turns_and_the_result(episodes, engine, prompt_ids, call, answer, result, tool_calls=2)


def _scripted_episode(tokenizer, env, question, turns, max_total_tokens=1024):
    """One episode of `env` from `question` (rendered with `add_numbers`' schema), its model turns scripted: `turns`,
    each ended by EOS. The prompt's text and ids, each turn's ids, the engine (its `calls`) and the episodes."""
    schemas = [tool_schema(add_numbers)]
    renderer = ChatRenderer(tokenizer, schemas)
    prompt = tokenizer.apply_chat_template(question, tools=schemas, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    turn_ids = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in turns]
    engine = ScriptedEngine({prompt_ids[0]: list(turn_ids)})  # named by its first prompt id; it pops the turns
    episodes = run_episodes(
        engine,
        [env],
        [prompt_ids],
        SamplingParams(max_new_tokens=64),
        [0],
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        encode_observation=lambda observation, turn: renderer.observation_ids(observation, turn),
        reward_names=(),
        max_turns=3,
        max_total_tokens=max_total_tokens,
        pad_id=tokenizer.pad_token_id,
        device=torch.device("cpu"),
        runner=EnvironmentRunner(concurrency=2, timeout_s=10.0),
    )
    return prompt, prompt_ids, turn_ids, engine, episodes


def _assert_trains_the_sampled_turns_and_the_result(episodes, engine, prompt_ids, call, answer, result, tool_calls):
    """The transcript is the sampled `call`, the rendered `result`, the sampled `answer`; only the sampled ids carry
    loss; the second turn was sampled from exactly those ids; the episode's counts."""
    out = episodes.output
    n = len(call) + len(result) + len(answer)
    assert out.completion_ids[0, :n].tolist() == call + result + answer
    assert out.sampled_mask[0, :n].tolist() == [1.0] * len(call) + [0.0] * len(result) + [1.0] * len(answer)
    assert engine.calls[1][0] == [prompt_ids + call + result]  # the second turn's context
    # turns, tool calls, failed calls, observation tokens, steps timed out
    assert episodes.stats[0].tolist() == [2, tool_calls, 0, len(result), 0]


def _with_response_template(tokenizer, template: str):
    """`tokenizer` with the released chat template `template` (TRL's copy) and the `response_template` TRL's
    `add_response_schema` gives that template, as a user gives it before `save_pretrained`."""
    from trl.chat_template_utils import add_response_schema

    tokenizer.chat_template = _trl_template(template)
    return add_response_schema(tokenizer)


def _qwen35_call(a, b):
    """A call as Qwen3.5 writes it: XML, one parameter a block."""
    parameters = f"<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n"
    return f"<tool_call>\n<function=add_numbers>\n{parameters}</function>\n</tool_call>"


def test_a_tokenizers_response_template_reads_calls_in_formats_lit_rl_does_not_read_itself():
    """Qwen3.5 calls tools in XML (`<tool_call><function=...><parameter=...>`): without a `response_template` the
    run is refused in one line that says how to give one; with it, transformers' `parse_response` reads the calls,
    typing the arguments by the tools' schemas, and failures are error observations as in lit-rl's own formats."""
    from lit_rl.envs.base import environment_factory

    plain = qwen_chat_tokenizer()
    plain.chat_template = _trl_template("qwen3_5_nothink")
    assert template_tool_support(plain) == "other"  # its <tool_call> holds XML, not Qwen2.5's JSON
    with pytest.raises(
        ConfigError, match=r"has no response_template to read them with; .*or install trl, whose add_response_schema"
    ):
        uses_chat_tools("auto", "other")
    tokenizer = _with_response_template(qwen_chat_tokenizer(), "qwen3_5_nothink")
    assert template_tool_support(tokenizer) == "response_template" and uses_chat_tools("auto", "response_template")
    calls = TemplateCalls.of(tokenizer)
    assert calls.prefix.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # what the prompt pre-writes
    spec = environment_factory(None, None, ["tests.integration.envs.add_numbers"], "auto", "response_template", calls)
    env = spec.factory()
    assert spec.raw_turns and (env.call_format, env.template_calls) == ("response_template", calls)
    step = env.step("I will add.\n" + _qwen35_call(3, 4) + "<|im_end|>")
    assert step.observation == [{"role": "tool", "name": "add_numbers", "content": "7"}]  # "3", "4" typed as int
    assert (step.tool_calls, step.tool_errors, step.done) == (1, 0, False)
    assert env.step("The answer is 7.<|im_end|>").done  # no call: the answer
    unknown = env.step(_qwen35_call(3, 4).replace("add_numbers", "mul") + "<|im_end|>")
    assert unknown.tool_errors == 1 and unknown.observation[0]["content"].startswith("error: unknown tool 'mul'")
    # lit-rl's own parsers go first where they apply, also beside a response template: they read Llama's calls
    # ended by <|eom_id|>, which TRL's response template for Llama 3 does not.
    assert template_tool_support(_with_response_template(qwen_chat_tokenizer(), "qwen2_5")) == "hermes"
    assert template_tool_support(_with_response_template(llama_chat_tokenizer(), "llama3_1")) == "llama3"
    broken = qwen_chat_tokenizer()
    broken.chat_template = _trl_template("qwen3_5_nothink")
    broken.response_template = {"fields": {"tool_calls": {"content": "yaml"}}}
    with pytest.raises(ConfigError, match=r"^the tokenizer's response_template \(tokenizer_config.json\) cannot read "):
        TemplateCalls.of(broken)  # before any rollout, not as an error at every turn
    # Qwen2.5's JSON calls through TRL's response template for them: a call that is not JSON is the model's error.
    json_env = ChatToolEnvironment(
        [add_numbers],
        call_format="response_template",
        template_calls=TemplateCalls.of(_with_response_template(qwen_chat_tokenizer(), "qwen2_5")),
    )
    bad = json_env.step('<tool_call>\n{"name": </tool_call><|im_end|>')
    assert bad.tool_errors == 1 and "error: the tool calls cannot be read (ValueError: json parser" in str(bad)
    assert json_env.step(_call("add_numbers", '{"a": 2, "b": 3}')).observation[0]["content"] == "5"
    with pytest.raises(ConfigError, match="call_format response_template needs template_calls"):
        ChatToolEnvironment([add_numbers], call_format="response_template")
    # A TRL environment class's methods are read the same way.
    trl_env = environment_factory(
        "tests.integration.envs.IncrementEnv", None, None, "auto", "response_template", calls
    ).factory()
    assert (trl_env.call_format, trl_env.template_calls) == ("response_template", calls)


def test_a_response_templates_special_token_markup_reaches_the_environment():
    """Gemma 4 marks a call with special tokens (`<|tool_call>`...`<tool_call|>`): decoded without them, as
    lit-rl decodes turns for other environments, the call is gone; with a `response_template`, every turn reaches
    `step` with its special tokens (`EnvironmentSpec.raw_turns`, `EpisodeProducer.turn_text`)."""
    from lit_rl.envs.base import environment_factory
    from lit_rl.rollout.producer import EpisodeProducer

    tokenizer = qwen_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool_call>", "<tool_call|>", "<|turn>", "<turn|>"]})
    tokenizer = _with_response_template(tokenizer, "gemma4")
    assert template_tool_support(tokenizer) == "response_template"
    tools = ["tests.integration.envs.add_numbers"]
    spec = environment_factory(None, None, tools, "auto", "response_template", TemplateCalls.of(tokenizer))
    ids = tokenizer.encode("<|tool_call>call:add_numbers{a:3,b:4}<tool_call|>", add_special_tokens=False)
    skipped = tokenizer.decode(ids, skip_special_tokens=True)
    assert skipped == "call:add_numbers{a:3,b:4}" and spec.factory().step(skipped).done  # the markup is gone
    producer = EpisodeProducer.__new__(EpisodeProducer)  # only its decoding, which reads nothing else
    producer.raw_turns = spec.raw_turns
    step = spec.factory().step(producer.turn_text(tokenizer, ids))
    assert step.observation == [{"role": "tool", "name": "add_numbers", "content": "7"}]


def test_grpo_reads_a_template_trl_knows_with_trls_response_template_as_trls_trainer_does(tmp_path, capfd):
    """A Qwen3.5-format model whose tokenizer has no `response_template` (`tool_format: auto`): as TRL's
    `GRPOTrainer` does, the run reads its calls with TRL's response template for its chat template and says so
    once, leaving the tokenizer (and so the exported one) as it was; the prompts hold the schemas as its template
    writes them. A template TRL does not know gets none; a tokenizer's own response template, saved with it, is
    loaded and used as it is."""
    from lit_rl.envs.chat_tools import trls_response_template
    from lit_rl.errors import DataError
    from lit_rl.modeling.models import load_tokenizer
    from tests.conftest import fit_grpo
    from tests.qwen_chat import save_chat_model

    tools = ["tests.integration.envs.add_numbers"]
    qwen35 = _trl_template("qwen3_5_nothink")
    # Qwen3.5's tool instructions alone are longer than a 1024-token context: no budget could help, and truncating
    # would cut the schemas, so the error offers neither.
    short = qwen_chat_tokenizer()
    short.chat_template = qwen35
    with pytest.raises(DataError, match=r"\(the prompt alone fills the context: shorten the prompts or use a model "):
        fit_grpo(model_name_or_path=str(save_chat_model(tmp_path / "short", short)), tools=tools, max_turns=2)
    tokenizer = qwen_chat_tokenizer(model_max_length=2048)
    tokenizer.chat_template = qwen35
    path = save_chat_model(tmp_path / "qwen35", tokenizer)
    capfd.readouterr()
    model = fit_grpo(model_name_or_path=str(path), tools=tools, max_turns=2)
    assert capfd.readouterr().err.count("they are read with TRL's response template for it") == 1
    assert getattr(model.tokenizer, "response_template", None) is None  # the tokenizer is left as it was
    env = model.producer.env_factory()
    assert type(env).__name__ == "ChatToolEnvironment" and env.call_format == "response_template"
    assert env.template_calls.template.fields["tool_calls"].content == "xml-inline"  # TRL's, for Qwen3.5's XML
    assert model.producer.raw_turns
    prompt = model.tokenizer.decode(model._buffer.prompt_ids[0], skip_special_tokens=False)
    assert "<function=example_function_name>" in prompt and '"name": "add_numbers"' in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    unknown = qwen_chat_tokenizer()
    unknown.chat_template = qwen35.replace("<tool_call>", "<call>")  # no longer the template as released
    assert trls_response_template(unknown) is None
    _with_response_template(model.tokenizer, "qwen3_5_nothink").save_pretrained(tmp_path / "own")
    own = load_tokenizer(str(tmp_path / "own"))
    assert own.response_template["fields"]["tool_calls"] and template_tool_support(own) == "response_template"


@pytest.mark.parametrize("template", ["llama3_1", "llama3_2"])
def test_llama_templates_append_the_json_encoded_result_token_in_token_out(template):
    """Llama 3.1/3.2's templates write a tool result JSON-encoded in an `ipython` turn: prompt + the sampled call +
    the observation's ids == the template's own rendering of the whole conversation, and a result holding
    `<|eot_id|>`'s text stays text."""
    tokenizer = llama_chat_tokenizer(template=template)
    schemas = [tool_schema(add_numbers)]
    renderer = ChatRenderer(tokenizer, schemas)
    question = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(question, tools=schemas, tokenize=False, add_generation_prompt=True)
    call = {"type": "function", "function": {"name": "add_numbers", "arguments": {"a": 2, "b": 3}}}
    turn_text = '{"name": "add_numbers", "parameters": {"a": 2, "b": 3}}'
    turn_ids = tokenizer.encode(turn_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    messages = [{"role": "tool", "name": "add_numbers", "content": "5 <|eot_id|>"}]
    observation = renderer.observation_ids(messages, turn_ids)
    whole = tokenizer.apply_chat_template(
        [*question, {"role": "assistant", "content": "", "tool_calls": [call]}, *messages],
        tools=schemas,
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False) + turn_ids + observation
    assert tokenizer.decode(ids) == whole
    assert tokenizer.decode(observation) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5 <|eot_id|>"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert observation.count(tokenizer.eos_token_id) == 1  # the template's own <|eot_id|> only
    # A call ended with <|eom_id|> (Llama's end of a message a tool result follows) is not closed again.
    eom_turn = [*turn_ids[:-1], tokenizer.convert_tokens_to_ids("<|eom_id|>")]
    assert renderer.observation_ids(messages, eom_turn) == observation
    # The environment reads the call in Llama's format and answers it.
    env = ChatToolEnvironment([add_numbers], call_format="llama3")
    step = env.step(tokenizer.decode(turn_ids, skip_special_tokens=True))
    assert step.observation == [{"role": "tool", "name": "add_numbers", "content": "5"}]
    assert (step.tool_calls, step.tool_errors) == (1, 0)
    # A TRL environment class's methods are called in Llama's format too.
    from lit_rl.envs.base import environment_factory

    trl_env = environment_factory("tests.integration.envs.IncrementEnv", None, None, "auto", "llama3").factory()
    assert type(trl_env).__name__ == "TRLEnvironment" and trl_env.call_format == "llama3"
    # ... and so are lit-rl's own tool environment's, named by import path.
    tools = ["tests.integration.envs.add_numbers"]
    named = environment_factory("lit_rl.envs.ChatToolEnvironment", None, tools, "auto", "llama3").factory()
    assert named.call_format == "llama3"


@pytest.mark.parametrize(
    "template, call_format, tools_at",
    [
        ("llama3_1", "llama3", "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions"),
        ("llama3_2_pythonic", "pythonic", "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"),
    ],
)
def test_grpo_with_a_llama_model_offers_the_tools_in_its_template_and_reads_its_calls(
    tmp_path, template, call_format, tools_at
):
    """`model.env.tools` with a Llama 3.1-format model, or one of Llama 3.2's pythonic format (`tool_format: auto`):
    the prompts hold the schemas where the template puts them and the episodes read calls as the template writes
    them."""
    from tests.conftest import fit_grpo
    from tests.llama_chat import save_llama_chat_model

    path = save_llama_chat_model(tmp_path / "llama-chat", template)
    model = fit_grpo(model_name_or_path=str(path), tools=["tests.integration.envs.add_numbers"], max_turns=2)
    env = model.producer.env_factory()
    assert type(env).__name__ == "ChatToolEnvironment" and env.call_format == call_format
    prompt = model.tokenizer.decode(model._buffer.prompt_ids[0], skip_special_tokens=False)
    assert tools_at in prompt
    assert '"name": "add_numbers"' in prompt
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_every_call_is_answered_with_a_tool_message_and_failures_are_counted():
    def fails(x: int) -> int:
        """Raises.

        Args:
            x: ignored
        """
        raise RuntimeError("no luck")

    def stalls(x: int) -> int:
        """Sleeps past the limit.

        Args:
            x: ignored
        """
        time.sleep(2)
        return x

    env = ChatToolEnvironment([add_numbers, slow_echo, fails, stalls], timeout_s=0.5)
    assert env.reset({"prompt": "p"}) is None
    turn = (
        _call("add_numbers", '{"a": 2, "b": 3}')
        + _call("slow_echo", '{"text": "hi"}')
        + _call("add_numbers", '{"a": 2}')
        + _call("multiply", "{}")
        + _call("fails", '{"x": 1}')
        + _call("stalls", '{"x": 1}')
        + "<tool_call>oops</tool_call>"
    )
    result = env.step(turn)
    contents = [message["content"] for message in result.observation]
    assert [message["role"] for message in result.observation] == ["tool"] * 7
    assert contents[:2] == ["5", "hi"]  # the async tool was awaited
    assert contents[2] == "error: add_numbers: missing a required argument: 'b'"
    assert contents[3].startswith("error: unknown tool 'multiply' (the tools are add_numbers, fails, slow_echo")
    assert contents[4] == "error: RuntimeError: no luck"
    assert contents[5].startswith("error: ") and "0.5" in contents[5]
    assert contents[6].startswith("error: the tool call is not JSON")
    assert (result.tool_calls, result.tool_errors, result.done) == (7, 5, False)
    assert env.step("The answer is 5.").done  # a turn without a call ends the episode


def test_the_appended_tokens_are_what_the_template_renders_after_the_turn(tokenizer):
    """Prompt ids + the turn the model sampled + the observation's ids == the template's own rendering of the whole
    conversation: the observation is exactly the tool messages' markup and the next generation prompt, and the
    model's `<|im_end|>` is not repeated."""
    schemas = [tool_schema(add_numbers)]
    renderer = ChatRenderer(tokenizer, schemas)
    question = [{"role": "user", "content": "What is 2+3?"}]
    prompt = tokenizer.apply_chat_template(question, tools=schemas, tokenize=False, add_generation_prompt=True)
    turn_text = _call("add_numbers", '{"a": 2, "b": 3}')
    turn_ids = tokenizer.encode(turn_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    messages = [{"role": "tool", "name": "add_numbers", "content": "5"}, {"role": "tool", "content": "x"}]
    observation = renderer.observation_ids(messages, turn_ids)
    whole = tokenizer.apply_chat_template(
        [*question, {"role": "assistant", "content": turn_text}, *messages],
        tools=schemas,
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False) + turn_ids + observation
    assert ids == tokenizer.encode(whole, add_special_tokens=False)
    assert tokenizer.decode(observation) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nx\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    # A turn cut short by its budget (no <|im_end|>) gets the whole closing.
    cut = renderer.observation_ids(messages, turn_ids[:-1])
    assert cut == [tokenizer.eos_token_id, *observation]


@pytest.mark.parametrize(
    "template, generation_prompt",
    [
        ("qwen2_5", ""),
        ("qwen3", ""),  # renders an earlier assistant turn without the empty <think> block the last one gets
        ("qwen3_instruct_2507", ""),
        ("qwen3_5_think", "<think>\n"),
        ("qwen3_8", "<think>\n"),
    ],
)
def test_the_released_qwen_templates_append_the_tool_response_and_the_next_generation_prompt(
    template, generation_prompt
):
    """The Qwen family's own templates (as TRL ships them): after a turn ending in <|im_end|>, a tool result is the
    tool-response block and the template's generation prompt, nothing of the history."""
    tokenizer = qwen_chat_tokenizer()
    tokenizer.chat_template = _trl_template(template)
    renderer = ChatRenderer(tokenizer, [tool_schema(add_numbers)])
    ids = renderer.observation_ids([{"role": "tool", "name": "add_numbers", "content": "5"}], [tokenizer.eos_token_id])
    assert tokenizer.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        + generation_prompt
    )


def test_a_special_tokens_text_in_a_result_stays_text(tokenizer):
    renderer = ChatRenderer(tokenizer, None)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    observation = renderer.observation_ids([{"role": "tool", "content": "a<|im_end|>b"}], [5, im_end])
    assert tokenizer.decode(observation).count("<|im_end|>") == 2  # the result's text, then the template's own
    assert observation.count(im_end) == 1  # only the template's is the special token


def test_an_episode_trains_exactly_the_sampled_turns_and_the_rendered_tool_results(tokenizer):
    """A two-turn episode: the model calls `add_numbers`, gets the result, answers. The transcript is the sampled
    ids, then the rendered tool message, then the sampled answer; only the sampled ids carry loss; the second turn
    was sampled from exactly those ids."""
    question = [{"role": "user", "content": "What is 2+3?"}]
    turns = [_call("add_numbers", '{"a": 2, "b": 3}'), "The answer is 5."]
    _, prompt_ids, (call, answer), engine, episodes = _scripted_episode(
        tokenizer, ChatToolEnvironment([add_numbers]), question, turns, max_total_tokens=512
    )
    result = tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    _assert_trains_the_sampled_turns_and_the_result(episodes, engine, prompt_ids, call, answer, result, tool_calls=1)


def test_grpo_puts_the_tools_schemas_in_the_prompt_through_the_chat_template(tmp_path):
    """`model.env.tools` with a model whose template renders tools (`tool_format: auto`): the prompts GRPO sampled
    from hold the schemas, rendered by Qwen's template, and the episodes ran in `ChatToolEnvironment`."""
    from tests.conftest import fit_grpo

    path = save_qwen_chat_model(tmp_path / "qwen-chat")
    model = fit_grpo(model_name_or_path=str(path), tools=["tests.integration.envs.add_numbers"], max_turns=2)
    assert type(model.producer.env_factory()).__name__ == "ChatToolEnvironment"
    prompt = model.tokenizer.decode(model._buffer.prompt_ids[0], skip_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "add_numbers"' in prompt
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_prompt_that_an_environments_reset_lengthened_past_the_limit_is_refused_not_cut():
    """The check before training measures the data's prompts; an environment's `reset` may add to one (a TRL class
    returning text). Rendered with the tools' schemas and cut from its start, it lost its schemas with no word;
    encoding it is now a one-line error (the episodes' start failure, raised on every rank)."""
    from lit_rl.envs.chat_tools import chat_prompt, tool_schema
    from lit_rl.modeling.prompts import PromptEncoder

    tokenizer = qwen_chat_tokenizer()
    schemas = [tool_schema(add_numbers)]
    row_prompt = chat_prompt("What is 2 + 3?")
    fits = int(PromptEncoder(tokenizer, None).encode([row_prompt], schemas)[1].sum())
    encoder = PromptEncoder(tokenizer, max_length=fits)
    ids, mask = encoder.encode([row_prompt], schemas)  # the data's prompt fits as it is
    assert int(mask.sum()) == fits
    lengthened = chat_prompt("What is 2 + 3? Here is the task in full: " + "lorem ipsum " * 20)
    with pytest.raises(ConfigError, match=rf"a prompt has \d+ tokens with the tools' schemas .* \({fits}\), which"):
        encoder.encode([row_prompt, lengthened], schemas)
    assert int(PromptEncoder(tokenizer, max_length=64).encode([lengthened])[1].sum()) == 64  # no tools: cut


def test_episodes_whose_lengthened_prompts_are_refused_stop_the_run_and_release_their_environments(tmp_path):
    """Through a fit: an environment's reset makes a prompt longer than model.sampling.max_prompt_length allows with
    the tools' schemas; the episodes stop in one line, and the environments already reset are closed (a session on
    a server is released), not left open until the process ends."""
    from lit_rl.errors import EnvironmentStepError
    from tests.conftest import fit_grpo
    from tests.integration.envs import LongResetClosed

    path = save_qwen_chat_model(tmp_path / "qwen-chat")
    LongResetClosed.closed = 0
    with pytest.raises(EnvironmentStepError, match="the episodes could not start: ConfigError: a prompt has .* tokens"):
        fit_grpo(
            model_name_or_path=str(path),
            environment="tests.integration.envs.LongResetClosed",
            tools=["tests.integration.envs.add_numbers"],
            max_prompt_length=1000,  # with the 4-token budget, the model's context of 1024
            max_turns=1,
        )
    assert LongResetClosed.closed == 8  # the first generation's 2 prompts x 4 episodes, each reset once


def test_a_prompt_length_limit_that_would_cut_the_tools_schemas_stops_the_run_first(tmp_path):
    """Truncation keeps a prompt's end: with tools, it would drop the schemas at its start. The check before
    training renders the prompts as the rollouts do, schemas included, and names the first that would be cut."""
    from lit_rl.errors import DataError
    from tests.conftest import fit_grpo

    path = save_qwen_chat_model(tmp_path / "qwen-chat")
    with pytest.raises(DataError, match="has a prompt of .* tokens with the tools' schemas; .*max_prompt_length=256"):
        fit_grpo(model_name_or_path=str(path), tools=["tests.integration.envs.add_numbers"], max_prompt_length=256)
