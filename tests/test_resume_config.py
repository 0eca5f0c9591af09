"""The command line or the checkpoint, never silently (`lit_rl.resume_config`): what a run given `--ckpt_path` may
change, what stops it, and that nothing in a checkpoint configures the run. The journey through the `lit-rl` script
is in tests/integration/test_checkpoint_overrides.py."""

from __future__ import annotations

import sys

import pytest

from lit_rl.algorithms import GRPO
from lit_rl.config import GROUP_NAMES, GROUPS, grouped_hparams
from lit_rl.errors import ConfigError
from lit_rl.resume_config import MAY_CHANGE_ON_RESUME, MODEL_IDENTITY, Difference, reconcile, refuse_moved_position
from lit_rl.rollout import VLLMServer

SAVED = {  # as a lit-rl 0.2 checkpoint holds them
    "_class_path": "lit_rl.algorithms.GRPO",
    "_instantiator": "lightning.pytorch.cli.instantiate_module",
    "policy": {"model_name_or_path": "lit-rl/tiny-qwen2-addition-sft", "trust_remote_code": False, "lora": None},
    "rewards": {"funcs": ["lit_rl.rewards.arithmetic.correctness"], "weights": None},
    "optim": {"learning_rate": 1e-4},
    "sampling": {"num_generations": 16},
    "loss": {"beta": 0.0},
    "rollout": {
        "engine": VLLMServer(server_url="http://10.0.0.1:8000", request_timeout_s=60.0).as_config(),
        "max_staleness": 0,
    },
}


def _run(**changes):
    """This run's hyperparameters: SAVED's, with `changes` given by their 0.1 names (`learning_rate`)."""
    run = {k: (dict(v) if isinstance(v, dict) else v) for k, v in SAVED.items() if not k.startswith("_")}
    for key, value in grouped_hparams(changes).items():
        run[key] = {**run[key], **value} if key in GROUP_NAMES else value
    return run


def test_the_same_values_say_nothing():
    assert reconcile("fit", GRPO, _run(), SAVED, "last.ckpt") == []


def test_fit_may_change_the_rates_and_where_rollouts_come_from_and_says_so():
    vllm = {"mode": "server", "server_url": "http://10.0.0.2:8000", "request_timeout_s": 60.0}  # 0.1's spelling
    changed = reconcile("fit", GRPO, _run(learning_rate=0.5, vllm=vllm), SAVED, "last.ckpt")
    assert changed == [
        Difference("model.optim.learning_rate", 0.5, 1e-4),
        Difference("model.rollout.engine.init_args.server_url", "http://10.0.0.2:8000", "http://10.0.0.1:8000"),
    ]


def test_fit_stops_in_one_line_naming_every_key_it_may_not_change():
    with pytest.raises(ConfigError) as caught:
        reconcile("fit", GRPO, _run(beta=0.04, num_generations=8, learning_rate=0.5), SAVED, "runs/last.ckpt")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--ckpt_path runs/last.ckpt was trained with other values: ")
    assert (
        "model.loss.beta: 0.04 here, 0.0 in the checkpoint; "
        "model.sampling.num_generations: 8 here, 16 in the checkpoint;" in message
    )
    assert "learning_rate" not in message  # the rate may change: not among the refused keys


def test_a_rollout_algorithms_micro_batch_size_is_kept_on_resume():
    """The checkpoint counts its place in micro-steps of `micro_batch_size` completions: another size would continue
    elsewhere in the generations, so it is refused with the objective, not announced with the rates."""
    saved, run = {**SAVED, "schedule": {"micro_batch_size": 16}}, {**_run(), "schedule": {"micro_batch_size": 4}}
    with pytest.raises(ConfigError, match="model.schedule.micro_batch_size: 4 here, 16 in the checkpoint"):
        reconcile("fit", GRPO, run, saved, "last.ckpt")


LAYOUT = {"trainer.accumulate_grad_batches": 2, "trainer.devices x trainer.num_nodes": 1, "data.batch_size": 8}


def test_a_resumed_fit_keeps_the_units_of_its_place_in_the_data():
    refuse_moved_position(LAYOUT, LAYOUT, "last.ckpt")  # the same: nothing to say
    refuse_moved_position(LAYOUT, {}, "last.ckpt")  # a checkpoint that kept none (before lit-rl did)
    with pytest.raises(ConfigError) as caught:
        refuse_moved_position({**LAYOUT, "trainer.accumulate_grad_batches": 4, "data.batch_size": 4}, LAYOUT, "a.ckpt")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "--ckpt_path a.ckpt was trained with other values: trainer.accumulate_grad_batches: 4 here, 2 in the "
        "checkpoint; data.batch_size: 4 here, 8 in the checkpoint; the checkpoint's place in the data counts "
    )


def test_a_checkpoint_never_configures_trust_or_code():
    """A shared checkpoint that asks for remote code or other reward functions: the run stops, it does not
    take them (this run's config is the only source of values)."""
    shared = {
        **SAVED,
        "policy": {**SAVED["policy"], "trust_remote_code": True},
        "rewards": {**SAVED["rewards"], "funcs": ["evil.reward"]},
    }
    with pytest.raises(
        ConfigError,
        match=r"model\.policy\.trust_remote_code: False here, True in the checkpoint; "
        r"model\.rewards\.funcs: .* here, \['evil.reward'\] in the checkpoint",
    ):
        reconcile("fit", GRPO, _run(), shared, "shared.ckpt")


def test_another_algorithm_is_refused_by_name_without_importing_it():
    for other in ("module_that_must_not_be_imported.GRPO", "lit_rl.algorithms.PPO", "lit_rl.algorithmsX.GRPO"):
        with pytest.raises(
            ConfigError,
            match=f"trained by {other} and this run's model is GRPO: resume with the algorithm that wrote it",
        ):
            reconcile("fit", GRPO, _run(), {**SAVED, "_class_path": other}, "x.ckpt")
    for same in ("lit_rl.algorithms.GRPO", "lit_rl.algorithms.grpo.GRPO", "lit_rl.GRPO"):
        assert reconcile("fit", GRPO, _run(), {**SAVED, "_class_path": same}, "x.ckpt") == []
    assert "module_that_must_not_be_imported" not in sys.modules


def test_validate_takes_this_runs_values_except_the_models_identity():
    rewards = ["lit_rl.rewards.arithmetic.integer_format"]
    changed = reconcile("validate", GRPO, _run(reward_funcs=rewards, beta=0.1, learning_rate=3.0), SAVED, "c")
    # The learning rate changes nothing in a run that does not train: not announced.
    assert changed == [
        Difference("model.loss.beta", 0.1, 0.0),
        Difference("model.rewards.funcs", rewards, SAVED["rewards"]["funcs"]),
    ]
    with pytest.raises(
        ConfigError, match=r"model\.policy\.model_name_or_path: 'other' here, .*the checkpoint's weights"
    ):
        reconcile("validate", GRPO, _run(model_name_or_path="other"), SAVED, "c")


def test_a_key_only_one_version_of_lit_rl_knows_is_not_compared():
    # A group field the checkpoint's version did not have (`loss.beta` missing), and an option only it had.
    older = {**SAVED, "loss": {}, "retired_option": 1}
    assert reconcile("validate", GRPO, _run(new_option=3, beta=0.1), older, "c") == []
    # The same change against a checkpoint that has the field is announced: the comparison above could see it.
    assert reconcile("validate", GRPO, _run(beta=0.1), SAVED, "c") == [Difference("model.loss.beta", 0.1, 0.0)]


def test_a_checkpoint_of_lit_rl_0_1_compares_key_by_key_with_the_groups():
    """0.1 saved the options flat (`learning_rate`); they are compared with their places in the groups."""
    flat = {
        "_class_path": "lit_rl.algorithms.GRPO",
        "model_name_or_path": "lit-rl/tiny-qwen2-addition-sft",
        "trust_remote_code": False,
        "lora": None,
        "reward_funcs": ["lit_rl.rewards.arithmetic.correctness"],
        "reward_weights": None,
        "learning_rate": 1e-4,
        "num_generations": 16,
        "beta": 0.0,
        "vllm": {"mode": "server", "server_url": "http://10.0.0.1:8000", "request_timeout_s": 60.0},
    }
    assert reconcile("fit", GRPO, _run(), flat, "old.ckpt") == []
    assert reconcile("fit", GRPO, _run(learning_rate=0.5), flat, "old.ckpt") == [
        Difference("model.optim.learning_rate", 0.5, 1e-4)
    ]
    with pytest.raises(ConfigError, match=r"model\.sampling\.num_generations: 8 here, 16 in the checkpoint"):
        reconcile("fit", GRPO, _run(num_generations=8), flat, "old.ckpt")


def test_the_documented_sets_are_arguments_of_the_algorithms():
    import dataclasses
    import inspect

    from lit_rl.algorithms import DPO, GRPO, PPO, RLOO, SFT, OnlineDPO

    arguments = set().union(*(inspect.signature(cls).parameters for cls in (DPO, GRPO, PPO, RLOO, SFT, OnlineDPO)))
    keys = {key for key in arguments if key not in GROUP_NAMES}
    keys |= {f"{group}.{field.name}" for group, cls in GROUPS.items() for field in dataclasses.fields(cls)}
    assert MAY_CHANGE_ON_RESUME <= keys and MODEL_IDENTITY <= keys


def test_a_validated_checkpoints_step_is_logged_once_not_into_later_runs_of_the_module():
    """`validate --ckpt_path` logs its row at the checkpoint's step; a later `fit` or `validate` of the same module
    (a notebook) must log at its own steps, not at that one (a review found it kept)."""
    from lit_rl.algorithms.checkpoint_state import CheckpointState

    logged = []

    class Module(CheckpointState):
        def log(self, name, value):
            logged.append((name, value))

    module = Module()
    module.validated_step = 2
    module.log_validated_step()
    module.log_validated_step()
    assert logged == [("step", 2.0)]
