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


def test_dpo_with_a_compiled_policy_trains_to_the_eager_numbers(tmp_path, monkeypatch):
    """DPO calls the policy on chosen and rejected answers that share their prompt's cached prefix: compiled, its
    pair metrics, gradients and weights stay the eager run's to float rounding (the live reference runs eager)."""
    from lit_rl.algorithms import DPO

    gradients: list[dict[str, torch.Tensor]] = []  # each run's gradients before its step (before clipping)
    before_step = DPO.on_before_optimizer_step

    def record_gradients(module, optimizer):
        gradients.append({name: p.grad.clone() for name, p in module.policy.named_parameters() if p.grad is not None})
        before_step(module, optimizer)

    monkeypatch.setattr(DPO, "on_before_optimizer_step", record_gradients)
    # One step: each later step's new padded lengths compile the graphs again (dynamic shapes), a minute more; the
    # gradients are checked directly, since Adam's first step alone keeps only their signs.
    common = ["--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--data.batch_size", "8"]
    eager = fit_config(tmp_path, "eager", "dpo.yaml", *common, every_n=1)
    compiled = fit_config(tmp_path, "compiled", "dpo.yaml", *common, "--model.policy.compile", "true", every_n=1)
    (a,), (b,) = train_rows(eager), train_rows(compiled)
    assert set(a) == set(b)
    for key in ("train/loss", "train/rewards/margins", "train/logps/chosen", "train/logps/rejected"):
        assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), key
    assert len(gradients) == 2 and list(gradients[0]) == list(gradients[1])
    for name, grad in gradients[0].items():
        torch.testing.assert_close(gradients[1][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    states = [
        torch.load(run / "checkpoints" / "step=1.ckpt", weights_only=True)["state_dict"] for run in (eager, compiled)
    ]
    assert list(states[0]) == list(states[1])  # no `_orig_mod.` prefix
    for key, value in states[0].items():
        torch.testing.assert_close(states[1][key], value, rtol=0, atol=1e-5)
