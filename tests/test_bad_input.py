"""Bad input, table-driven: each case ends the CLI with one line `lit-rl: error: ...` naming the key, file, row or
function, a non-zero exit, and no traceback."""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch

from tests.conftest import CLI_COMMAND, CONFIGS, FAST_GRPO, REPO, run_cli, write_overlay

GRPO = ["--config", str(CONFIGS / "grpo.yaml")]
DPO = ["--config", str(CONFIGS / "dpo.yaml")]
SFT = ["--config", str(CONFIGS / "sft.yaml")]
RLOO = ["--config", str(CONFIGS / "rloo.yaml")]

BAD_REWARDS = """
def raises(prompts, completions, **_):
    raise KeyError("answer_column")

def too_few(prompts, completions, **_):
    return [1.0]

def nones(prompts, completions, **_):
    return [None for _ in completions]

def correctness(prompts, completions, **_):
    return [1.0 for _ in completions]

def text(prompts, completions, **_):
    return ["high" for _ in completions]

def noted(prompts, completions, **_):  # leaves a file: a step started
    open("a_step_started", "w").close()
    return [1.0 for _ in completions]

def quits(prompts, completions, **_):
    import sys
    sys.exit(0)

def objective_of_two(logprobs, advantages):  # an objective written for another signature
    return logprobs

def objective_bare_tensor(logprobs, old_logprobs, advantages, mask, epsilon_low, epsilon_high):  # no stats
    return -logprobs * advantages[:, None]

def advantages_one_short(rewards, group_size, scale_rewards):
    return rewards[1:] - rewards.mean(), {}

class UnreachableSandbox:  # an environment whose constructor cannot reach its sandbox
    def __init__(self):
        raise ConnectionError("sandbox pool at 127.0.0.1:9 refused the connection")

from lit_rl.rollout import EngineConfig

class NoBuild(EngineConfig):  # a user's engine that forgot `build`
    pass

from lightning.pytorch.loggers import CSVLogger

class Unreachable(CSVLogger):  # a tracker whose server went away mid-run
    def log_metrics(self, metrics, step=None):
        raise ConnectionError("remote tracker: connection reset by peer\\nretry later")
"""


def _jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def _data(tmp_path, name, rows, key="train_data"):
    return [f"--data.{key}", _jsonl(tmp_path / name, rows), "--data.val_data", "null"]


def _file(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    return ["--data.train_data", str(tmp_path / name), "--data.val_data", "null"]


def _damaged_checkpoint(tmp_path):
    """A run directory with an intact checkpoint at step 1 and a `last.ckpt` cut short, as by a full disk."""
    import torch

    checkpoints = tmp_path / "runs" / "run" / "version_0" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save({"global_step": 1}, checkpoints / "step=1.ckpt")
    torch.save({"global_step": 2, "pad": torch.zeros(1000)}, checkpoints / "last.ckpt")
    (checkpoints / "last.ckpt").write_bytes((checkpoints / "last.ckpt").read_bytes()[:300])
    return ["--ckpt_path", "last"]


def _dataset_dict(tmp_path):
    import datasets

    rows = datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
    datasets.DatasetDict({"train": rows, "test": rows}).save_to_disk(str(tmp_path / "dd"))
    return ["--data.train_data", str(tmp_path / "dd"), "--data.val_data", "null"]


def _parquet(tmp_path, name, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    return ["--data.train_data", str(tmp_path / name), "--data.val_data", "null"]


def _broken_module(tmp_path):
    """A reward module with a syntax error (a missing colon): a 112-line traceback before."""
    (tmp_path / "broken_rewards.py").write_text("def accuracy(prompts, completions, **kw)\n    return [1.0]\n")
    return ["--model.rewards.funcs", "[broken_rewards.accuracy]", "--model.rewards.weights", "null"]


def _module_failing_in_what_it_imports(tmp_path):
    """A reward module whose import of a helper module fails: the line names the helper's file and line."""
    (tmp_path / "helper_of_rewards.py").write_text("x = 1\ny = undefined_name\n")
    (tmp_path / "rewards_with_helper.py").write_text(
        "import helper_of_rewards\n\ndef score(completions, **kw):\n    pass\n"
    )
    return ["--model.rewards.funcs", "[rewards_with_helper.score]", "--model.rewards.weights", "null"]


def _save_dir_under_a_file(tmp_path):
    (tmp_path / "a_file").write_text("")
    return ["--trainer.logger.init_args.save_dir", str(tmp_path / "a_file" / "runs")]


def _model_without_chat_template(tmp_path):
    """The shipped policy without its chat template, on chat-format prompts: a 46-line traceback before."""
    import shutil

    from lit_rl.modeling.models import resolve_model_path

    model = tmp_path / "no-template"
    shutil.copytree(resolve_model_path("lit-rl/tiny-qwen2-addition-sft"), model)
    (model / "chat_template.jinja").unlink()
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 8
    return ["--model.policy.model_name_or_path", str(model), *_data(tmp_path, "chat.jsonl", rows)]


def _unreadable_weights(tmp_path):
    """A model directory whose `model.safetensors` was cut short (a copy that failed): a 51-line traceback before."""
    import shutil

    from lit_rl.modeling.models import resolve_model_path

    model = tmp_path / "cut"
    shutil.copytree(resolve_model_path("lit-rl/tiny-qwen2-addition-sft"), model)
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes()[:100])
    return ["--model.policy.model_name_or_path", str(model)]


def _checkpoints_under_a_file(tmp_path):
    """Checkpoints into a folder under a file: found at the first save before, after that many steps of work."""
    (tmp_path / "a_file").write_text("")
    folder = tmp_path / "a_file" / "checkpoints"
    callbacks = f"[{{class_path: lightning.pytorch.callbacks.ModelCheckpoint, init_args: {{dirpath: {folder}}}}}]"
    noted = ["--model.rewards.funcs", "[bad_rewards.noted]", "--model.rewards.weights", "null"]
    return ["--trainer.enable_checkpointing", "true", "--trainer.callbacks", callbacks, *noted]


def _config_file(name, text):
    """The arguments `--config <tmp_path>/<name>`, the file holding `text`."""

    def write(tmp_path):
        (tmp_path / name).write_text(text)
        return ["--config", str(tmp_path / name)]

    return write


# (id, base config, arguments (a callable of tmp_path when it needs files), expected text, exit code)
CASES = [
    (
        "reward-module-syntax-error",
        GRPO,
        _broken_module,
        "'broken_rewards.accuracy': importing module 'broken_rewards' raised SyntaxError: expected ':'",
        1,
    ),
    (
        "reward-module-import-fails-inside",
        GRPO,
        _module_failing_in_what_it_imports,
        "raised NameError: name 'undefined_name' is not defined (at ",
        1,
    ),
    ("zero-prompt-length", GRPO, ["--model.sampling.max_prompt_length", "0"], "max_prompt_length must be >= 1", 1),
    ("unknown-dtype", GRPO, ["--model.policy.dtype", "foo"], "model.policy.dtype must be one of float32, bfloat16", 1),
    ("top-p-above-1", GRPO, ["--model.sampling.top_p", "1.5"], "model.sampling.top_p must be in (0, 1]", 1),
    (
        "negative-val-temperature",  # failed in transformers at the first validation, after training
        GRPO,
        ["--model.sampling.val_temperature", "-1"],
        "model.sampling.val_temperature must be >= 0",
        1,
    ),
    ("negative-weight-decay", GRPO, ["--model.optim.weight_decay", "-1"], "model.optim.weight_decay must be >= 0", 1),
    ("negative-warmup", GRPO, ["--model.optim.warmup_steps", "-5"], "model.optim.warmup_steps must be >= 0", 1),
    (
        "zero-accumulation",
        GRPO,
        ["--trainer.accumulate_grad_batches", "0"],
        "trainer.accumulate_grad_batches must be >= 1",
        1,
    ),
    (
        "option-before-config",  # jsonargparse applied the file's max_steps over it, silently
        [],
        ["--config", str(CONFIGS / "grpo.yaml")],
        "--trainer.max_steps comes before --config",
        1,
    ),
    (  # LightningCLI's short form: the option was then named as a key of the wrong class
        "option-before-short-config",
        [],
        ["-c", str(CONFIGS / "grpo.yaml")],
        "--trainer.max_steps comes before --config",
        1,
    ),
    ("zero-val-interval", GRPO, ["--trainer.val_check_interval", "0"], "trainer.val_check_interval must be > 0", 1),
    ("save-dir-under-a-file", GRPO, _save_dir_under_a_file, "a_file/runs: Not a directory", 1),
    ("unknown-key", GRPO, ["--model.no_such_option", "1"], "model.no_such_option: unknown option", 2),
    (
        "config-file-with-a-tab",  # named neither the file nor the line
        GRPO,
        _config_file("tab.yaml", "trainer:\n\tmax_steps: 1\n"),
        "tab.yaml line 2, column 1: found character '\\t' that cannot start any token (YAML indents with spaces",
        2,
    ),
    (
        "config-file-not-yaml",
        GRPO,
        _config_file("bad.yaml", "model:\n  init_args: {sampling: [1, 2}\n"),
        "bad.yaml line 2, column 30: expected ',' or ']', but got '}'",
        2,
    ),
    ("config-file-empty", GRPO, _config_file("empty.yaml", ""), "empty.yaml: not a mapping of options", 2),
    ("config-file-a-list", GRPO, _config_file("list.yaml", "- a\n- b\n"), "list.yaml: not a mapping of options", 2),
    (
        "config-file-key-twice",  # the first `sampling` block was dropped silently
        GRPO,
        _config_file(
            "dup.yaml",
            "model:\n  init_args:\n    sampling:\n      temperature: 0.5\n    sampling:\n      top_p: 0.9\n",
        ),
        "dup.yaml line 5: key 'sampling' appears twice in one mapping (also on line 3; the first would be dropped)",
        2,
    ),
    (
        "trl-name-in-a-group",
        DPO,
        ["--model.loss.loss_type", "ipo"],
        "model.loss.loss_type: unknown option; this is model.loss.type",
        2,
    ),
    (
        "grpo-trl-loss-type",  # TRL's GRPO `loss_type` is the aggregation (docs/coming-from-trl.md)
        GRPO,
        ["--model.loss.loss_type", "dapo"],
        "model.loss.loss_type: unknown option; this is model.loss.aggregation",
        2,
    ),
    (
        "trl-reward-funcs",
        GRPO,
        ["--model.rewards.reward_funcs", "[bad_rewards.correctness]"],
        "model.rewards.reward_funcs: unknown option; this is model.rewards.funcs",
        2,
    ),
    (
        "typo-in-a-group-of-a-config",  # said "a key of another algorithm's config?"
        GRPO,
        _config_file("typo.yaml", "model:\n  init_args:\n    sampling:\n      temprature: 0.7\n"),
        "model.sampling.temprature: unknown option of GRPO's sampling group (did you mean model.sampling.temperature?)",
        2,
    ),
    (
        "typo-in-a-group",
        GRPO,
        ["--model.sampling.temprature", "0.7"],
        "model.sampling.temprature: unknown option (did you mean model.sampling.temperature?)",
        2,
    ),
    (
        "rollout-overlay-over-dpo",  # said only that gpu_memory_utilization is unknown
        DPO,
        ["--config", str(CONFIGS / "rollout" / "vllm_colocate.yaml")],
        "model.rollout.engine.init_args.gpu_memory_utilization: DPO takes no rollout group (only GRPO, OnlineDPO, "
        "PPO and RLOO take it",
        2,
    ),
    (
        "data-key-under-model",
        DPO,
        ["--model.micro_batch_tokens", "400"],
        "model.micro_batch_tokens: unknown option; this is data.micro_batch_tokens",
        2,
    ),
    (
        "wrong-type",
        GRPO,
        ["--model.sampling.num_generations", "many"],
        "model.sampling.num_generations: Expected a <class 'int'>",
        2,
    ),
    ("wrong-type-trainer", GRPO, ["--trainer.max_steps", "ten"], "trainer.max_steps: Expected a <class 'int'>", 2),
    ("missing-required", [], [], "required: fit.data, fit.model", 2),
    (
        "zero-micro-batch",
        GRPO,
        ["--model.schedule.micro_batch_size", "0"],
        "model.schedule.micro_batch_size must be >= 1",
        1,
    ),
    ("negative-batch-size", SFT, ["--data.batch_size", "-4"], "data.batch_size must be >= 1", 1),
    (
        "one-generation",
        GRPO,
        ["--model.sampling.num_generations", "1"],
        "model.sampling.num_generations must be >= 2",
        1,
    ),
    (
        "batch-not-multiple-of-group",
        GRPO,
        ["--model.schedule.micro_batch_size", "6"],
        "must be a multiple of model.sampling.num_generations=4",
        1,
    ),
    (
        "epsilon-high-below-low",
        GRPO,
        ["--model.loss.epsilon", "0.3", "--model.loss.epsilon_high", "0.2"],
        "model.loss.epsilon_high (0.2) must be >= model.loss.epsilon (0.3)",
        1,
    ),
    (
        "temperature-vllm-raises",  # vLLM samples at 0.01 with a log line; the trainer's log-probs at 0.005
        GRPO,
        ["--model.rollout.engine", "VLLMServer", "--model.sampling.temperature", "0.005"],
        "model.sampling.temperature must be 0 (greedy) or >= 0.01 with VLLMServer, which samples a lower one at 0.01",
        1,
    ),
    (
        "val-temperature-vllm-raises",
        GRPO,
        ["--model.rollout.engine", "VLLMColocate", "--model.sampling.val_temperature", "0.001"],
        "model.sampling.val_temperature must be 0 (greedy) or >= 0.01 with VLLMColocate",
        1,
    ),
    ("vllm-0-1-key", GRPO, ["--model.vllm.mode", "server"], "model.vllm.mode: moved to model.rollout.engine", 2),
    ("unknown-engine", GRPO, ["--model.rollout.engine", "SGLangEngine"], "model.rollout.engine", 2),
    (
        "vllm-server-url-without-scheme",
        GRPO,
        ["--model.rollout.engine", "VLLMServer", "--model.rollout.engine.server_url", "localhost:8000"],
        "model.rollout.engine.server_url must start with http:// or https://",
        1,
    ),
    (
        "vllm-colocate-tensor-parallel-beyond-ranks",
        GRPO,
        ["--model.rollout.engine", "VLLMColocate", "--model.rollout.engine.tensor_parallel_size", "2"],
        "model.rollout.engine.tensor_parallel_size=2 must divide the 1 trainer ranks",
        1,
    ),
    (
        "vllm-push-bucket-zero",
        GRPO,
        ["--model.rollout.engine", "VLLMColocate", "--model.rollout.engine.push_bucket_mib", "0"],
        "model.rollout.engine.push_bucket_mib must be a finite number of MiB > 0",
        1,
    ),
    (
        "vllm-negative-retries",
        GRPO,
        ["--model.rollout.engine", "VLLMServer", "--model.rollout.engine.max_retries", "-1"],
        "model.rollout.engine.max_retries must be >= 0",
        1,
    ),
    ("is-correction-unknown", GRPO, ["--model.rollout.correction", "seq"], "model.rollout.correction", 1),
    (
        "min-above-max-tokens",
        GRPO,
        ["--model.sampling.min_new_tokens", "99"],
        "model.sampling.min_new_tokens must be in [0, max_new_",
        1,
    ),
    (
        "refills-out-of-range",
        GRPO,
        ["--model.rollout.max_refill_generations", "64"],
        "model.rollout.max_refill_generations must be",
        1,
    ),
    (
        "zero-head-chunk",
        SFT,
        ["--model.policy.head_chunk_tokens", "0"],
        "model.policy.head_chunk_tokens must be >= 1",
        1,
    ),
    (
        "hub-attention-kernel",  # transformers would download and run its code
        DPO,
        ["--model.policy.attn_implementation", "kernels-community/flash-attn"],
        "model.policy.attn_implementation must be one of eager, sdpa,",
        1,
    ),
    (
        "grpo-only-option",
        RLOO,
        ["--model.rollout.dynamic_sampling", "true"],
        "model.rollout.dynamic_sampling: RLOO does not take it (GRPO only)",
        1,
    ),
    ("cap-below-one", GRPO, ["--model.rollout.correction_cap", "0.5"], "model.rollout.correction_cap must be >= 1", 1),
    ("unknown-aggregation", GRPO, ["--model.loss.aggregation", "mean"], "model.loss.aggregation must be one of", 1),
    ("unknown-scale-rewards", GRPO, ["--model.loss.scale_rewards", "std"], "model.loss.scale_rewards", 1),
    (
        "reward-weights-mismatch",
        GRPO,
        ["--model.rewards.weights", "[1.0]"],
        "model.rewards.weights has 1 values for 2 functions in model.rewards.funcs",
        1,
    ),
    ("unknown-dtype", GRPO, ["--model.policy.dtype", "float8"], "dtype must be one of", 1),
    ("unknown-dpo-loss", DPO, ["--model.loss.type", "kto"], "model.loss.type must be one of", 1),
    (
        "smoothing-a-loss-without-labels",
        DPO,
        ["--model.loss.type", "ipo", "--model.loss.label_smoothing", "0.1"],
        "model.loss.label_smoothing=0.1: model.loss.type 'ipo' has no label smoothing",
        1,
    ),
    (
        "missing-model",
        GRPO,
        ["--model.policy.model_name_or_path", "./no/such/model"],
        "model path './no/such/model' does not exist",
        1,
    ),
    ("missing-data-file", GRPO, ["--data.train_data", "missing.jsonl"], "data file 'missing.jsonl' does not exist", 1),
    (  # named as itself, not through the loss setting whose range it bounds
        "negative-max-new-tokens",
        GRPO,
        ["--model.sampling.max_new_tokens", "-1"],
        "model.sampling.max_new_tokens must be >= 1, got -1",
        1,
    ),
    (
        "damaged-checkpoint",
        GRPO,
        _damaged_checkpoint,
        "runs/run/version_0/checkpoints/last.ckpt cannot be read (",  # and the intact one beside it:
        1,
    ),
    (
        "damaged-checkpoint-names-the-intact-one",
        GRPO,
        _damaged_checkpoint,
        "; the newest intact checkpoint beside it is ",
        1,
    ),
    (
        "datasets-directory-without-its-split",
        GRPO,
        _dataset_dict,
        "has several splits (train, test): name one, e.g. ",
        1,
    ),
    (
        "hub-dataset-not-reachable",
        GRPO,
        ["--data.train_data", "no-such-owner/no-such-data:train"],
        "no local file or directory of that name, and the hub data set 'no-such-owner/no-such-data' could not be",
        1,
    ),
    ("unknown-builtin", GRPO, ["--data.train_data", "builtin:subtraction/train"], "unknown built-in dataset", 1),
    (
        "unsupported-extension",
        GRPO,
        lambda t: ["--data.train_data", _jsonl(t / "d.csv", ["prompt"])],
        "unsupported extension '.csv'",
        1,
    ),
    ("empty-data", GRPO, lambda t: ["--data.train_data", _jsonl(t / "empty.jsonl", [""])], "the data set is empty", 1),
    (
        "row-missing-prompt",
        GRPO,
        lambda t: _data(t, "q.jsonl", [{"prompt": "1+1="}, {"question": "2+2="}]),
        "q.jsonl: line 2 has no 'prompt' column",  # lines as editors count them: 1-based
        1,
    ),
    (
        "row-missing-rejected",
        DPO,
        lambda t: _data(t, "p.jsonl", [{"prompt": "1+1=", "chosen": "2"}]),
        "p.jsonl: line 1 has no 'rejected' column",
        1,
    ),
    (
        "non-string-prompt",
        GRPO,
        lambda t: _data(t, "n.jsonl", [{"prompt": 12}]),
        "n.jsonl: line 1 column 'prompt' must be text or chat messages",
        1,
    ),
    (
        "malformed-jsonl",
        GRPO,
        lambda t: _data(t, "m.jsonl", ['{"prompt": "1+1="}', '{"prompt": ']),
        "m.jsonl: line 2: malformed JSON",
        1,
    ),
    (
        "blank-lines-count-as-lines",
        GRPO,
        lambda t: _data(t, "b.jsonl", [{"prompt": "1+1="}, "", {"question": "2+2="}]),
        "b.jsonl: line 3 has no 'prompt' column",
        1,
    ),
    (
        "malformed-json",
        GRPO,
        lambda t: _file(t, "m.json", '[{"prompt": "1+1="},\n {"prompt": }]'),
        "m.json: line 2: malformed JSON",
        1,
    ),
    (
        "json-record-missing-prompt",
        GRPO,
        lambda t: _file(t, "q.json", json.dumps([{"prompt": "1+1="}, {"question": "2+2="}])),
        "q.json: record 2 has no 'prompt' column",
        1,
    ),
    (
        "json-record-not-an-object",
        GRPO,
        lambda t: _file(t, "s.json", json.dumps([{"prompt": "1+1="}, "2+2="])),
        "s.json: record 2 must be an object with named columns",
        1,
    ),
    (
        "parquet-record-missing-prompt",
        GRPO,
        lambda t: _parquet(t, "q.parquet", [{"prompt": "1+1="}, {"prompt": None}]),
        "q.parquet: record 2 has no 'prompt' column",
        1,
    ),
    (
        "prompt-too-long",
        GRPO,
        lambda t: _data(t, "long.jsonl", [{"prompt": "1+1=", "answer": "2"}, ""] + [{"prompt": "1+" * 70 + "1="}] * 4),
        "long.jsonl: line 3 has a prompt of 142 tokens",
        1,
    ),
    (
        "duplicate-reward-names",
        GRPO,
        [
            "--model.rewards.funcs",
            "[lit_rl.rewards.arithmetic.correctness, bad_rewards.correctness]",
            "--model.rewards.weights",
            "null",
        ],
        "model.rewards.funcs: two functions are named 'correctness'",
        1,
    ),
    (
        "reward-path-not-importable",
        GRPO,
        ["--model.rewards.funcs", "[no_such_pkg.score]"],
        "reward function 'no_such_pkg.score': cannot import module 'no_such_pkg'",
        1,
    ),
    (
        "reward-raises",
        GRPO,
        ["--model.rewards.funcs", "[bad_rewards.raises]", "--model.rewards.weights", "null"],
        "reward function 'raises' raised KeyError: 'answer_column'",
        1,
    ),
    (
        "reward-wrong-count",
        GRPO,
        ["--model.rewards.funcs", "[bad_rewards.too_few]", "--model.rewards.weights", "null"],
        "reward function 'too_few' returned 1 values for 8 completions",
        1,
    ),
    (
        "reward-not-a-number",
        GRPO,
        ["--model.rewards.funcs", "[bad_rewards.text]", "--model.rewards.weights", "null"],
        "reward function 'text' returned 'high' for completion 0, not a number",
        1,
    ),
    (
        "reward-none-with-error-policy",
        GRPO,
        [
            "--model.rewards.funcs",
            "[bad_rewards.nones]",
            "--model.rewards.weights",
            "null",
            "--model.rewards.on_invalid",
            "error",
        ],
        "reward function 'nones' returned nan for completion 0",
        1,
    ),
    (
        "prompt-plus-completions-past-the-context",
        GRPO,
        ["--model.sampling.max_new_tokens", "125"],
        "has a prompt of 6 tokens; with model.sampling.max_new_tokens=125 it exceeds the model's context of 128 tokens "
        "(lower model.sampling.max_new_tokens to at most 122)",
        1,
    ),
    (
        "completion-budget-fills-the-context",
        GRPO,
        ["--model.sampling.max_new_tokens", "256"],
        "model.sampling.max_new_tokens (256) leaves no room for a prompt in the model's context of 128 tokens: lower "
        "it below 128",
        1,
    ),
    (
        "transcript-budget-past-the-context",
        GRPO,
        [
            "--model.env.tools",
            "[lit_rl.envs.tools.calc]",
            "--model.env.max_total_tokens",
            "200",
            "--model.sampling.max_prompt_length",
            "8",
        ],
        "model.sampling.max_prompt_length (8) + model.env.max_total_tokens (200) exceeds the model's context of 128",
        1,
    ),
    (
        "chat-tools-on-a-template-without-tools",
        GRPO,
        ["--model.env.tools", "[lit_rl.envs.tools.calc]", "--model.env.tool_format", "chat"],
        "model.env.tool_format is chat but the tokenizer's chat template does not render tools",
        1,
    ),
    (
        "tool-format-unknown",
        GRPO,
        ["--model.env.tools", "[lit_rl.envs.tools.calc]", "--model.env.tool_format", "json"],
        "model.env.tool_format must be one of auto, tags, chat, got 'json'",
        1,
    ),
    (
        "tool-not-found",
        GRPO,
        ["--model.env.tools", "[lit_rl.envs.tools.sqrt]"],
        "model.env.tools: tool 'lit_rl.envs.tools.sqrt'",
        1,
    ),
    (
        "hub-model-not-cached-offline",
        GRPO,
        ["--model.policy.model_name_or_path", "no-such-owner/no-such-model"],
        "model 'no-such-owner/no-such-model': no local directory of that name, and the hub model could not be loaded (",
        1,
    ),
    (
        "strategy-unknown-option",
        GRPO,
        [
            "--trainer.strategy",
            "lit_rl.training.strategies.DeepSpeedStrategy",
            "--trainer.strategy.no_such_option",
            "1",
        ],
        "trainer.strategy.no_such_option: unknown option",
        2,
    ),
    ("trainer-value", GRPO, ["--trainer.max_steps=-5"], "trainer: `max_steps` must be a non-negative integer", 1),
    # Values Lightning refuses with a ValueError or TypeError of its own: a 35-line traceback before.
    ("trainer-devices", GRPO, ["--trainer.devices", "-2"], "trainer: ", 1),
    ("trainer-strategy", GRPO, ["--trainer.strategy", "no_such_strategy"], "trainer: ", 1),
    (
        "checkpoint-callback-value",  # Lightning's refusal, named by the class that refused it, not `trainer`
        GRPO,
        _config_file(
            "checkpoints.yaml",
            "trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
            "      init_args: {save_top_k: -2}\n",
        ),
        "ModelCheckpoint: Invalid value for save_top_k=-2",
        1,
    ),
    ("checkpoint-dir-under-a-file", GRPO, _checkpoints_under_a_file, "a_file/checkpoints: Not a directory", 1),
    (
        "no-chat-template",
        GRPO,
        _model_without_chat_template,
        "the data's prompts are chat messages, but the tokenizer of ",
        1,
    ),
    ("weights-cut-short", GRPO, _unreadable_weights, "cannot be read: SafetensorError", 1),
    (
        "logger-raises-mid-run",
        GRPO,
        ["--trainer.logger", "bad_rewards.Unreachable", "--trainer.logger.save_dir", "runs"],
        "Unreachable.log_metrics raised ConnectionError: remote tracker: connection reset by peer",
        1,
    ),
    (
        "reward-calls-sys-exit",  # ended the run with exit 0 before, silently
        GRPO,
        ["--model.rewards.funcs", "[bad_rewards.quits]", "--model.rewards.weights", "null"],
        "reward function 'quits' raised SystemExit: 0",
        1,
    ),
    *(
        [
            (
                "accelerator-absent",
                GRPO,
                ["--trainer.accelerator", "gpu"],
                "trainer.accelerator gpu: torch sees no GPU",
                1,
            )
        ]
        if not torch.cuda.is_available()
        else []
    ),
    *(
        [
            (
                "logger-package-missing",
                GRPO,
                ["--trainer.logger", "lightning.pytorch.loggers.MLFlowLogger"],
                "lightning.pytorch.loggers.MLFlowLogger needs the package 'mlflow', which is not installed: "
                "pip install mlflow",
                1,
            ),
            (
                "logger-extra-missing",
                GRPO,
                ["--trainer.logger", "lightning.pytorch.loggers.WandbLogger"],
                "lightning.pytorch.loggers.WandbLogger needs the package 'wandb', which is not installed: "
                'pip install -e ".[wandb]"',
                1,
            ),
        ]
        if importlib.util.find_spec("mlflow") is None and importlib.util.find_spec("wandb") is None
        else []
    ),
    (
        "zero-turns",
        GRPO,
        ["--model.env.tools", "[lit_rl.envs.tools.calc]", "--model.env.max_turns", "0"],
        "model.env.max_turns",
        1,
    ),
    (
        "environment-raises",
        GRPO,
        ["--model.env.environment", "tests.integration.envs.Exploding", "--model.env.max_turns", "3"],
        "Exploding.step raised RuntimeError: the environment broke",
        1,
    ),
    (  # was 91 lines: two chained tracebacks and jsonargparse's dump of the whole model namespace
        "environment-constructor-raises",
        GRPO,
        ["--model.env.environment", "bad_rewards.UnreachableSandbox", "--model.env.max_turns", "3"],
        "model.env.environment bad_rewards.UnreachableSandbox: building it raised ConnectionError: sandbox pool at "
        "127.0.0.1:9 refused the connection",
        1,
    ),
    (  # was found at the first rollout, a 116-line traceback
        "engine-without-build",
        GRPO,
        ["--model.rollout.engine", "bad_rewards.NoBuild"],
        "model.rollout.engine: NoBuild does not say how to build its engine: define build(self, module)",
        1,
    ),
    (  # was jsonargparse's "Expected a path but ... either not accessible or invalid"
        "algorithm-class-typo",
        GRPO,
        ["--model", "lit_rl.algorithms.GRPOO"],
        "model: cannot import lit_rl.algorithms.GRPOO: module lit_rl.algorithms has no 'GRPOO' (did you mean "
        "lit_rl.algorithms.GRPO?)",
        2,
    ),
    (
        "producer-not-a-producer",
        GRPO,
        ["--model.rollout.producer", "bad_rewards.correctness"],
        "'bad_rewards.correctness' must be a subclass of lit_rl.rollout.producer.RolloutProducer",
        1,
    ),
    (
        "producer-of-another-kind",  # episodes' producer, for a run without model.env: built with other arguments
        GRPO,
        ["--model.rollout.producer", "lit_rl.rollout.producer.EpisodeProducer"],
        "'lit_rl.rollout.producer.EpisodeProducer' must be a subclass of lit_rl.rollout.producer.RolloutProducer",
        1,
    ),
    (  # was a 108-line traceback ending in lit-rl's loss
        "objective-wrong-signature",
        GRPO,
        ["--model.loss.objective", "bad_rewards.objective_of_two"],
        "model.loss.objective 'bad_rewards.objective_of_two' raised TypeError: objective_of_two() takes 2 positional "
        "arguments but 6 were given",
        1,
    ),
    (  # was "too many values to unpack" from lit_rl/losses/grpo.py
        "objective-without-stats",
        GRPO,
        ["--model.loss.objective", "bad_rewards.objective_bare_tensor"],
        "model.loss.objective 'bad_rewards.objective_bare_tensor' returned Tensor, not (per-token loss tensor, stats "
        "dict)",
        1,
    ),
    (  # was a 114-line traceback from a shape mismatch in lit_rl/losses/policy.py, the function never named
        "advantage-wrong-length",
        GRPO,
        ["--model.loss.advantage", "bad_rewards.advantages_one_short"],
        "model.loss.advantage 'bad_rewards.advantages_one_short' returned (",
        1,
    ),
    (
        "producer-missing",
        GRPO,
        ["--model.rollout.producer", "bad_rewards.Producer"],
        "model.rollout.producer 'bad_rewards.Producer': module 'bad_rewards' has no callable 'Producer'",
        1,
    ),
]


@pytest.fixture
def bad_rewards(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(BAD_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_table_covers_at_least_20_cases():
    assert len(CASES) >= 20


@pytest.mark.parametrize("case, config, args, expected, code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_line_error(bad_rewards, capsys, case, config, args, expected, code):
    tmp_path = bad_rewards
    args = args(tmp_path) if callable(args) else args
    overlay = write_overlay(tmp_path / "overlay.yaml", save_dir=tmp_path / "runs")
    extra = ["--config", str(overlay), *FAST_GRPO] if config is GRPO else ["--config", str(overlay)] if config else []
    with pytest.raises(SystemExit) as exit_info:
        run_cli("fit", *config, *extra, "--trainer.max_steps", "1", *args)
    assert exit_info.value.code == code
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("lit-rl: error: ") and expected in last, err[-2000:]
    runs = tmp_path / "runs"  # a failed start leaves no empty run folder (issue 58.6)
    empty = [str(folder) for folder in runs.rglob("*") if folder.is_dir() and not any(folder.iterdir())]
    assert not empty, empty
    # Nor one holding only the config it was started with (a model that cannot be read fails after it is written).
    bare = [str(f) for f in runs.rglob("version_*") if {p.name for p in f.iterdir()} <= {"config.yaml", "hparams.yaml"}]
    assert not bare or case == "logger-raises-mid-run", bare  # after a step: a logger may hold rows in memory
    if case == "checkpoint-dir-under-a-file":  # refused before the first step, not at its first save
        assert not (tmp_path / "a_step_started").exists()
    # (No-traceback is checked on a real process below: in-process, pytest's capture can make logging print its
    # own "Logging error" tracebacks.)


def test_invalid_rewards_count_as_zero_by_default_and_are_counted(bad_rewards):
    from tests.conftest import train_rows

    overlay = write_overlay(bad_rewards / "o.yaml", save_dir=bad_rewards / "runs")
    run_cli(
        "fit",
        *GRPO,
        "--config",
        str(overlay),
        *FAST_GRPO,
        "--trainer.max_steps",
        "1",
        "--model.rewards.funcs",
        "[bad_rewards.nones, lit_rl.rewards.arithmetic.correctness]",
        "--model.rewards.weights",
        "null",
        "--trainer.limit_val_batches",
        "0",
    )
    (row,) = train_rows(bad_rewards / "runs" / "run" / "version_0")
    assert row["train/frac_invalid_reward"] == 1.0
    assert row["train/reward"] == row["train/rewards/correctness"]  # the invalid column counted as 0


def test_a_real_process_prints_no_traceback_and_keeps_what_was_written(tmp_path):
    """A reward function that fails at step 3: exit 1, one line, and the steps already logged stay on disk."""
    (tmp_path / "late.py").write_text(
        "calls = {'n': 0}\n"
        "def fails_at_third_generation(prompts, completions, **_):\n"
        "    calls['n'] += 1\n"
        "    if calls['n'] == 3:\n"
        "        raise RuntimeError('judge unavailable')\n"
        "    return [0.0 for _ in completions]\n"
    )
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=1, save_dir=tmp_path / "runs")
    command = [
        *CLI_COMMAND,
        "fit",
        *GRPO,
        "--config",
        str(overlay),
        *FAST_GRPO,
        "--trainer.max_steps",
        "5",
        "--trainer.limit_val_batches",
        "0",
        "--model.rewards.funcs",
        "[late.fails_at_third_generation]",
        "--model.rewards.weights",
        "null",
    ]
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    error, resume = result.stderr.strip().splitlines()[-2:]
    assert error == "lit-rl: error: reward function 'fails_at_third_generation' raised RuntimeError: judge unavailable"
    log_dir = tmp_path / "runs" / "run" / "version_0"
    # The newest checkpoint, and the command that resumes from it once the cause is fixed.
    assert resume.startswith(f"lit-rl: its newest checkpoint is {log_dir / 'checkpoints' / 'step=2.ckpt'} (step 2)")
    assert resume.endswith(
        "--trainer.max_steps 5 --trainer.limit_val_batches 0 --model.rewards.funcs "
        "'[late.fails_at_third_generation]' --model.rewards.weights null --ckpt_path "
        f"{log_dir / 'checkpoints' / 'step=2.ckpt'}"
    )
    assert sorted(p.name for p in (log_dir / "checkpoints").iterdir()) == ["step=1.ckpt", "step=2.ckpt"]
    from tests.conftest import train_rows

    assert [r["step"] for r in train_rows(log_dir)] == [1, 2]


def test_validate_without_validation_data_says_so_in_one_line_and_writes_nothing(tmp_path, capsys):
    """It ran no batch, printed nothing, exited 0 and left a run folder holding only its config files."""
    overlay = write_overlay(tmp_path / "o.yaml", save_dir=tmp_path / "runs")
    with pytest.raises(SystemExit) as exit_info:
        run_cli("validate", *GRPO, "--config", str(overlay), "--data.val_data", "null")
    assert exit_info.value.code == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == "lit-rl: error: data.val_data is null: lit-rl validate has no data to validate on"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.yaml"))


def test_a_class_path_in_the_working_directory_says_class_paths_are_not_imported_from_it(tmp_path, monkeypatch):
    """Reward functions and environments beside the run are found; an engine or algorithm class there is imported
    by jsonargparse from sys.path alone, and its message said only 'either not accessible or invalid'."""
    from lit_rl.cli import why_unimportable

    (tmp_path / "my_engines_beside_the_run.py").write_text("class CountingEngine:\n    pass\n")
    monkeypatch.chdir(tmp_path)
    assert why_unimportable("my_engines_beside_the_run.CountingEngine") == (
        "my_engines_beside_the_run is in the working directory, which class paths are not imported from: run with "
        "PYTHONPATH=."
    )
    assert why_unimportable("no_module_of_that_name.Engine") == "no module named 'no_module_of_that_name'"
    from lit_rl.cli import CLASS_PATH  # a group's YAML file that is missing keeps jsonargparse's own words

    assert CLASS_PATH.fullmatch("my_engines.CountingEngine") and not CLASS_PATH.fullmatch("lora.yaml")


CTRL_C = (
    "import os, signal, time\n"
    "calls = {'n': 0}\n"
    "def ctrl_c(times):\n"
    "    for _ in range(times):  # apart: Python runs a signal's handler once for signals that arrive together\n"
    "        os.kill(os.getpid(), signal.SIGINT)\n"
    "        time.sleep(1)\n"
    "if os.environ.get('CTRL_C_AT_IMPORT'):\n"
    "    ctrl_c(1)  # while the config's reward functions load, before training starts\n"
    "def twice_at_third_generation(prompts, completions, **_):\n"
    "    calls['n'] += 1\n"
    "    if calls['n'] == 3:\n"
    "        ctrl_c(2)  # the second while the first's graceful stop waits for the step to end\n"
    "    return [0.0 for _ in completions]\n"
)


@pytest.mark.parametrize("when", ["setup", "mid-step"])
def test_a_ctrl_c_that_stops_the_run_at_once_exits_130_in_one_line_with_the_resume_hint(tmp_path, when):
    """A Ctrl-C that cannot wait for the step to end (one during setup, before the graceful stop takes SIGINT over;
    a second one mid-step) exits 130 as a shell reports a job Ctrl-C ended, not Lightning's exit 1 of a failed run,
    with no traceback, and names the newest checkpoint and the command that resumes from it."""
    import signal

    (tmp_path / "ctrl_c.py").write_text(CTRL_C)
    overlay = write_overlay(tmp_path / "o.yaml", every_n_train_steps=1, save_dir=tmp_path / "runs")
    args = ["--trainer.max_steps", "5", "--trainer.limit_val_batches", "0", "--model.rewards.weights", "null"]
    funcs = ["--model.rewards.funcs", "[ctrl_c.twice_at_third_generation]"]
    command = [*CLI_COMMAND, "fit", *GRPO, "--config", str(overlay), *FAST_GRPO, *args, *funcs]
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    if when == "setup":
        env["CTRL_C_AT_IMPORT"] = "1"
    result = subprocess.run(
        command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell starts a job (a worker may not)
    )
    assert result.returncode == 130, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    log_dir = tmp_path / "runs" / "run" / "version_0"
    if when == "setup":
        assert lines[-1] == "lit-rl: interrupted by Ctrl-C (SIGINT), without finishing the step"
        assert not log_dir.exists()
        return
    interrupted, resume = lines[-2:]
    assert interrupted == "lit-rl: interrupted by Ctrl-C (SIGINT), without finishing the step"
    newest = log_dir / "checkpoints" / "step=2.ckpt"
    assert resume.startswith(f"lit-rl: its newest checkpoint is {newest} (step 2); resume with: lit-rl fit ")
    assert resume.endswith(f"--model.rewards.funcs '[ctrl_c.twice_at_third_generation]' --ckpt_path {newest}")


def test_lit_rl_traceback_set_to_0_or_false_keeps_the_one_line(monkeypatch):
    """`LIT_RL_TRACEBACK=0` showed the traceback: only whether the variable was set was read."""
    from lit_rl.cli import wants_traceback

    for value, wanted in (("", False), ("0", False), ("false", False), ("No", False), ("1", True), ("yes", True)):
        monkeypatch.setenv("LIT_RL_TRACEBACK", value)
        assert wants_traceback() is wanted, value
    monkeypatch.delenv("LIT_RL_TRACEBACK")
    assert wants_traceback() is False


def test_the_checkpoint_folder_check_makes_no_folder_and_runs_on_every_rank(tmp_path):
    """The check made the folder it checked, which the run-directory check right after took for another run's
    `checkpoints/` (a fresh run with `dirpath` inside its run folder was refused); and it ran on rank 0 alone, whose
    refusal left the other ranks waiting for the process group."""
    import errno
    from types import SimpleNamespace

    from lit_rl.cli import refuse_unwritable_checkpoint_dirs

    folder = tmp_path / "run" / "checkpoints"
    other_rank = SimpleNamespace(is_global_zero=False, checkpoint_callbacks=[SimpleNamespace(dirpath=str(folder))])
    refuse_unwritable_checkpoint_dirs(other_rank)
    assert not (tmp_path / "run").exists()
    (tmp_path / "a_file").write_text("")
    other_rank.checkpoint_callbacks[0].dirpath = str(tmp_path / "a_file" / "checkpoints")
    with pytest.raises(OSError) as refused:
        refuse_unwritable_checkpoint_dirs(other_rank)
    assert refused.value.errno == errno.ENOTDIR
