"""The option groups (`lit_rl.config`): each field defined once, 0.1's flat keys mapped to their places, a 0.1
config migrated with its comments, and Python calls written flat rebuilt as the 0.1 call did."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys

import pytest
import yaml

from lit_rl.algorithms import DPO, GRPO, PPO, RLOO, SFT, OnlineDPO
from lit_rl.config import (
    GROUP_NAMES,
    GROUPS,
    MOVED_KEYS,
    SamplingArgs,
    as_args,
    grouped_hparams,
    moved_key_hint,
)
from lit_rl.errors import ConfigError
from lit_rl.loss_config import LOSS_GROUPS, GRPOLoss, PPOLoss, RLOOLoss
from lit_rl.migrate import migrate_text
from tests.conftest import REPO, grouped_kwargs

ALGORITHMS = (GRPO, PPO, RLOO, OnlineDPO, DPO, SFT)


def test_no_algorithm_takes_more_than_about_a_dozen_arguments_and_none_repeats_a_group_field():
    fields = {field.name for cls in (*GROUPS.values(), *LOSS_GROUPS) for field in dataclasses.fields(cls)}
    for cls in ALGORITHMS:
        own = set(inspect.signature(cls.__init__).parameters) - {"self"}
        assert len(own) <= 13, (cls.__name__, len(own))
        repeated = (own - set(GROUP_NAMES)) & fields - {"max_prompt_length"}  # SFT truncates its data: its own key
        assert not repeated, (cls.__name__, repeated)


def test_loss_options_agree_in_name_across_algorithms():
    """The clip range is `epsilon` (and `epsilon_high`) wherever a ratio is clipped, whitening is
    `normalize_advantages` wherever advantages are whitened, the KL weight is `beta` everywhere (lit-rl 0.1 said
    `epsilon_low`, `epsilon`, `whiten_advantages` and `normalize_advantages`)."""
    for cls in (GRPOLoss, PPOLoss, RLOOLoss):
        names = {field.name for field in dataclasses.fields(cls)}
        assert {"beta", "epsilon", "epsilon_high"} <= names, cls
        assert cls(epsilon=0.1).clip_high == 0.1 and cls(epsilon=0.1, epsilon_high=0.3).clip_high == 0.3
    assert {"normalize_advantages"} <= {f.name for f in dataclasses.fields(PPOLoss)} & {
        f.name for f in dataclasses.fields(RLOOLoss)
    }
    assert MOVED_KEYS["epsilon_low"] == MOVED_KEYS["epsilon"] == "loss.epsilon"
    assert MOVED_KEYS["whiten_advantages"] == MOVED_KEYS["normalize_advantages"] == "loss.normalize_advantages"
    assert MOVED_KEYS["loss_type"] == "loss.type" and MOVED_KEYS["policy_loss"] == "loss.objective"
    grpo = GRPO(**grouped_kwargs(GRPO, epsilon_low=0.1, epsilon_high=0.28, loss_aggregation="token"))
    assert (grpo.loss_args.epsilon, grpo.loss_args.clip_high, grpo.loss_args.aggregation) == (0.1, 0.28, "token")
    ppo = PPO(**grouped_kwargs(PPO, whiten_advantages=False))
    assert ppo.loss_args.normalize_advantages is False and ppo.loss_args.clip_high == 0.2
    with pytest.raises(ConfigError, match=r"model.loss.epsilon_high \(0.1\) must be >= model.loss.epsilon \(0.2\)"):
        RLOOLoss(epsilon_high=0.1).check()


def test_every_0_1_key_has_one_place_and_the_hint_names_it():
    assert MOVED_KEYS["temperature"] == "sampling.temperature"
    assert MOVED_KEYS["reward_funcs"] == "rewards.funcs" and MOVED_KEYS["lora"] == "policy.lora"
    assert moved_key_hint("model.learning_rate") == "model.optim.learning_rate"
    assert moved_key_hint("model.init_args.micro_batch_size") == "model.schedule.micro_batch_size"
    assert moved_key_hint("model.beta") == "model.loss.beta" and moved_key_hint("model.beta", SFT) is None
    assert moved_key_hint("model.loss.beta") is None and moved_key_hint("trainer.temperature") is None


def test_a_group_from_a_mapping_names_an_unknown_field():
    assert as_args(SamplingArgs, {"temperature": 0.5}) == SamplingArgs(temperature=0.5)
    assert as_args(SamplingArgs, None) == SamplingArgs()
    with pytest.raises(ConfigError, match=r"model\.sampling\.tempature: unknown option"):
        as_args(SamplingArgs, {"tempature": 0.5})


def test_a_0_1_checkpoint_s_hyperparameters_are_grouped():
    flat = {"learning_rate": 1e-4, "temperature": 0.7, "reward_funcs": ["a.b"], "beta": 0.1, "lora": None}
    assert grouped_hparams(flat) == {
        "optim": {"learning_rate": 1e-4},
        "sampling": {"temperature": 0.7},
        "rewards": {"funcs": ["a.b"]},
        "loss": {"beta": 0.1},
        "policy": {"lora": None},
    }
    grouped = {"sampling": {"temperature": 0.7}, "loss": {"beta": 0.1}, "rollout": {"max_staleness": 0}}
    assert grouped_hparams(grouped) == grouped


def test_flat_python_arguments_keep_the_algorithm_s_own_defaults():
    kwargs = grouped_kwargs(PPO, max_new_tokens=4, learning_rate=3e-4, beta=0.0)
    assert kwargs["sampling"] == SamplingArgs(num_generations=4, max_new_tokens=4)  # PPO samples 4, GRPO 8
    assert kwargs["optim"].learning_rate == 3e-4 and kwargs["loss"].beta == 0.0
    assert kwargs["loss"].aggregation == "token"  # PPO's own loss group and its defaults
    with pytest.raises(ConfigError, match="DPO takes no 'sampling' group"):
        grouped_kwargs(DPO, temperature=0.5)


OLD = """\
# my run
model:
  class_path: lit_rl.algorithms.GRPO
  init_args:
    model_name_or_path: my/model   # the policy
    reward_funcs:
      - my.reward
    # a comment about the group size
    num_generations: 4
    beta: 0.04
    learning_rate: 1.0e-5
    vllm:
      mode: server
data:
  class_path: lit_rl.data.PromptDataModule
"""


def test_migrate_moves_the_flat_keys_and_keeps_comments_and_everything_else():
    new = migrate_text(OLD)
    assert "# a comment about the group size\n      num_generations: 4" in new
    assert "model_name_or_path: my/model   # the policy" in new
    config = yaml.safe_load(new)
    init = config["model"]["init_args"]
    assert init["policy"] == {"model_name_or_path": "my/model"}
    assert init["rewards"] == {"funcs": ["my.reward"]}
    assert init["sampling"] == {"num_generations": 4} and init["optim"] == {"learning_rate": 1e-5}
    assert init["loss"] == {"beta": 0.04}
    assert init["rollout"] == {"engine": {"class_path": "lit_rl.rollout.VLLMServer", "init_args": {}}}
    assert config["data"] == {"class_path": "lit_rl.data.PromptDataModule"}
    assert migrate_text(new) == new  # a 0.2 config is left as it is


def test_migrate_leaves_sft_s_own_prompt_limit(tmp_path):
    sft = "model:\n  class_path: lit_rl.algorithms.SFT\n  init_args:\n    max_prompt_length: 64\n    dtype: bfloat16\n"
    init = yaml.safe_load(migrate_text(sft))["model"]["init_args"]
    assert init == {"max_prompt_length": 64, "policy": {"dtype": "bfloat16"}}


def test_the_shipped_configs_need_no_migration_and_the_command_rewrites_a_file(tmp_path):
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        assert migrate_text(path.read_text()) == path.read_text(), path
    old = tmp_path / "old.yaml"
    old.write_text(OLD)
    subprocess.run([sys.executable, "-m", "lit_rl.migrate", "--in-place", str(old)], check=True)
    assert old.read_text() == migrate_text(OLD)


@pytest.mark.parametrize(
    "text, expected",
    [
        (  # a group the config has takes the moved keys: YAML would keep only one of two `sampling:` keys
            "model:\n  class_path: lit_rl.algorithms.GRPO\n  init_args:\n    sampling:\n      max_new_tokens: 64\n"
            "    temperature: 0.7\n",
            {"sampling": {"max_new_tokens": 64, "temperature": 0.7}},
        ),
        (  # a renamed key below a blank line and a comment
            "model:\n  class_path: lit_rl.algorithms.GRPO\n  init_args:\n    beta: 0.1\n\n    # judge\n"
            "    reward_funcs: [a.b]\n",
            {"loss": {"beta": 0.1}, "rewards": {"funcs": ["a.b"]}},
        ),
        (  # a quoted class path
            'model:\n  class_path: "lit_rl.algorithms.SFT"\n  init_args:\n    max_prompt_length: 64\n',
            {"max_prompt_length": 64},
        ),
        (  # no algorithm named: SFT's and the samplers' key is left where it is
            "model:\n  init_args:\n    max_prompt_length: 64\n    temperature: 0.5\n",
            {"max_prompt_length": 64, "sampling": {"temperature": 0.5}},
        ),
        (  # blank lines inside a block scalar stay in it
            "model:\n  class_path: lit_rl.algorithms.GRPO\n  init_args:\n    environment_args:\n      system: |\n"
            "        line1\n\n        line2\n    beta: 0.1\n",
            {"env": {"environment_args": {"system": "line1\n\nline2\n"}}, "loss": {"beta": 0.1}},
        ),
    ],
)
def test_migrate_keeps_every_value(text, expected):
    warnings = []
    assert yaml.safe_load(migrate_text(text, warn=warnings.append))["model"]["init_args"] == expected
    assert bool(warnings) == ("class_path" not in text)


def test_a_hint_names_a_place_only_the_algorithm_has():
    assert moved_key_hint("model.temperature", GRPO) == "model.sampling.temperature"
    assert moved_key_hint("model.temperature", DPO) is None  # DPO samples nothing
    assert moved_key_hint("model.policy.lora.dtype") is None and moved_key_hint("model.sampling.temperature") is None


def test_resume_compares_sft_s_own_prompt_limit_and_the_keys_of_a_free_form_value():
    from lit_rl.resume_config import reconcile

    saved = {"_class_path": "lit_rl.algorithms.SFT", "max_prompt_length": 64, "policy": {"dtype": "float32"}}
    with pytest.raises(ConfigError, match=r"model\.max_prompt_length: 32 here, 64 in the checkpoint"):
        reconcile("fit", SFT, {"max_prompt_length": 32, "policy": {"dtype": "float32"}}, saved, "c")
    env = {"environment_args": {"x": 1}}
    saved = {"_class_path": "lit_rl.algorithms.GRPO", "env": env}
    with pytest.raises(ConfigError, match=r"model\.env\.environment_args\.hard: True here, null in the checkpoint"):
        reconcile("fit", GRPO, {"env": {"environment_args": {"x": 1, "hard": True}}}, saved, "c")


def test_a_module_built_in_python_writes_plain_hyperparameters(tmp_path):
    """Its groups are dataclasses; the checkpoint holds dicts, which `weights_only` loading (export, resume) reads."""
    import torch

    module = SFT()
    checkpoint = {"hyper_parameters": dict(module.hparams)}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / "c.ckpt")
    loaded = torch.load(tmp_path / "c.ckpt", weights_only=True)
    assert loaded["hyper_parameters"]["policy"]["model_name_or_path"] == "lit-rl/tiny-qwen2-base"
    assert loaded["hyper_parameters"]["optim"] == {"learning_rate": 1e-3, "weight_decay": 0.0, "warmup_steps": 0}


def test_load_from_checkpoint_of_a_0_1_checkpoint_says_how_to_keep_its_values(tmp_path):
    """Lightning passes a constructor only the keys it takes: 0.1's flat keys would be dropped silently."""
    import lightning
    import torch

    module = GRPO(**grouped_kwargs(GRPO, temperature=0.7, beta=0.0))
    module.configure_model()
    flat = {"temperature": 0.7, "num_generations": 8, "beta": 0.0, "learning_rate": 1e-5}
    path = tmp_path / "old.ckpt"
    torch.save(
        {
            "state_dict": module.state_dict(),
            "hyper_parameters": flat,
            "pytorch-lightning_version": lightning.__version__,
        },
        path,
    )
    with pytest.raises(ConfigError, match=r"^this checkpoint holds lit-rl 0\.1.s flat options \(temperature\)"):
        GRPO.load_from_checkpoint(path, weights_only=False)
    saved = torch.load(path, weights_only=True)["hyper_parameters"]  # as the message says
    loaded = GRPO.load_from_checkpoint(path, weights_only=False, **grouped_hparams(saved))
    assert loaded.sampling_args.temperature == 0.7 and loaded.optim_args.learning_rate == 1e-5
    assert torch.equal(loaded.policy.lm_head.weight, module.policy.lm_head.weight)
