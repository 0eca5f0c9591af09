"""`model.policy.compile`: the policy's training forward and backward through `torch.compile`, the same numbers as
eager to float rounding, and checkpoints whose keys are the eager run's."""

import torch

from tests.conftest import fit_config, train_rows


def test_grpo_with_a_compiled_policy_trains_to_the_eager_numbers_and_saves_the_same_keys(tmp_path):
    common = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]
    common += ["--model.schedule.micro_batch_size", "32", "--model.sampling.num_generations", "8"]
    eager = fit_config(tmp_path, "eager", "grpo.yaml", *common, every_n=2)
    compiled = fit_config(tmp_path, "compiled", "grpo.yaml", *common, "--model.policy.compile", "true", every_n=2)
    a, b = train_rows(eager), train_rows(compiled)
    assert len(a) == len(b) == 2
    for row_a, row_b in zip(a, b):
        assert row_a["train/reward"] == row_b["train/reward"]  # generation runs eagerly: the same samples
        assert abs(row_a["train/loss"] - row_b["train/loss"]) <= 1e-6
        assert abs(row_a["train/entropy"] - row_b["train/entropy"]) <= 1e-5
    states = [
        torch.load(run / "checkpoints" / "step=2.ckpt", weights_only=True)["state_dict"] for run in (eager, compiled)
    ]
    assert list(states[0]) == list(states[1])  # no `_orig_mod.` prefix: the checkpoint loads anywhere
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=1e-5)
