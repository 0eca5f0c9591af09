import pytest
import torch

from lit_rl.algorithms.grpo import grpo_metrics


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


def test_a_metric_that_syncs_itself_is_refused_before_it_counts_ranks_twice():
    from torchmetrics import MeanMetric, MetricCollection

    from lit_rl.training.metrics import compute_collection

    with pytest.raises(TypeError, match="'entropy' must be built with lit_rl.training.metrics.LOCAL"):
        compute_collection(MetricCollection({"entropy": MeanMetric()}))


def _synced_values(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank of `test_a_collection_syncs_in_two_collectives_to_the_values_of_all_ranks_data`."""
    import json

    import torch.distributed as dist

    from lit_rl.algorithms.ppo import ppo_metrics
    from lit_rl.training.metrics import compute_collection
    from lit_rl.training.strategies import exit_without_finalizing

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    for name in ("all_reduce", "all_gather", "barrier", "broadcast", "all_gather_object"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    metrics = ppo_metrics(["correctness"], with_kl=True).clone(prefix="train/")
    _feed(metrics, rank)
    if rank == 1:  # a metric only one rank saw
        metrics["kl"].update(torch.tensor([3.0, 5.0]))
    computed = compute_collection(metrics)
    dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as handle:
        json.dump({"values": {k: v.item() for k, v in computed.items()}, "calls": calls}, handle)
    exit_without_finalizing()


def _feed(metrics, rank: int) -> None:
    """Rank `rank`'s updates: a weighted mean, a max, a min, a sum and an explained variance."""
    for values, weights, target in _rank_data(rank):
        metrics["entropy"].update(values, weights)
        metrics["rollout_is_ratio/max"].update(values)
        metrics["rollout_is_ratio/min"].update(values)
        metrics["loss"].update(values.sum())
        metrics["critic/explained_variance"].update(values, target)


def _rank_data(rank: int):
    generator = torch.Generator().manual_seed(rank)
    for size in (3, 5 + rank):
        values = torch.randn(size, generator=generator)
        yield values, torch.rand(size, generator=generator), 2 * values + 0.1 * torch.randn(size, generator=generator)


def test_a_collection_syncs_in_two_collectives_to_the_values_of_all_ranks_data(tmp_path):
    """`compute_collection` on 2 gloo processes: every metric equals the same metric fed all ranks' data in one
    process (sums, weighted means, max, min, explained variance, one updated on a single rank), through two
    all-reduces and no other collective (torchmetrics' own sync: a barrier and a gather per state)."""
    import json

    import torch.multiprocessing as mp

    from lit_rl.algorithms.ppo import ppo_metrics

    out = str(tmp_path / "values")
    mp.start_processes(_synced_values, args=(2, str(tmp_path / "init"), out), nprocs=2, start_method="spawn")
    ranks = [json.loads(open(f"{out}.{rank}").read()) for rank in range(2)]
    whole = ppo_metrics(["correctness"], with_kl=True)
    for rank in range(2):
        _feed(whole, rank)
    whole["kl"].update(torch.tensor([3.0, 5.0]))
    expected = {name: whole[name].compute().item() for name in whole if whole[name].update_called}
    assert set(expected) == {"entropy", "rollout_is_ratio/max", "rollout_is_ratio/min", "loss", "kl"} | {
        "critic/explained_variance"
    }
    for rank in ranks:
        assert rank["values"].keys() == expected.keys()
        for name, value in expected.items():
            assert abs(rank["values"][name] - value) <= 1e-5 * max(1.0, abs(value)), name
        assert rank["calls"] == ["all_reduce", "all_reduce"]
