import torch

from lit_rl.metrics import grpo_metrics


def test_train_and_val_collections_are_distinct_objects():
    base = grpo_metrics(["correctness"], with_kl=True)
    train, val = base.clone(prefix="train/"), base.clone(prefix="val/")
    train["reward"].update(torch.tensor([1.0, 1.0]))
    assert not val["reward"].update_called
    assert len(train) == len(val) > 0
    assert all(a is not b for a, b in zip(train.values(), val.values(), strict=True))
    assert all(k.startswith("train/") for k in train.keys(keep_base=False))


def test_mean_is_weighted_over_all_updates_not_a_mean_of_means():
    metrics = grpo_metrics([], with_kl=False)
    metrics["entropy"].update(torch.tensor([1.0, 1.0, 1.0]))  # micro-batch with 3 tokens
    metrics["entropy"].update(torch.tensor([5.0]))  # micro-batch with 1 token
    assert metrics["entropy"].compute().item() == 2.0  # (1+1+1+5)/4, not (1+5)/2
    metrics["loss"].update(torch.tensor(0.25))
    metrics["loss"].update(torch.tensor(0.5))
    assert metrics["loss"].compute().item() == 0.75  # step loss: sum of step-normalised micro-batch terms
