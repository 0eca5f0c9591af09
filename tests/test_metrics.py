import pytest
import torch

from lit_rl.algorithms.grpo import grpo_metrics


def test_every_modules_train_and_val_collections_share_no_metric_object():
    """README's "train and validation apart": each module's `train_metrics` and `val_metrics` (as the modules build
    them, every optional metric on) hold distinct metric objects, so a validation update never reaches a training
    value, whatever the logging's resets hide."""
    for name, collections in _every_collection().items():
        if len(collections) < 2:
            continue  # the asynchronous rollouts' metrics are training metrics alone
        train, val = collections
        assert len(train) > 0 and len(val) > 0, name
        assert all(k.startswith("train/") for k in train.keys(keep_base=False)), name
        assert all(k.startswith("val/") for k in val.keys(keep_base=False)), name
        train_ids = {id(metric) for metric in train.values()}
        assert not train_ids & {id(metric) for metric in val.values()}, name
        for metric in val.values():
            metric.update(torch.ones(2))
        assert not any(metric.update_called for metric in train.values()), name


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

    from benchmarks.process_exit import exit_without_finalizing
    from lit_rl.algorithms.ppo import ppo_metrics
    from lit_rl.training.metrics import compute_collection

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


def _every_collection() -> dict[str, list]:
    """Algorithm -> its training and validation collections, as the modules build them, with every optional metric
    on (the KL, the rollout correction, dynamic sampling, the token budget, an environment; asynchronous rollouts,
    which need a background engine to build a module, from their factory)."""
    from lit_rl.algorithms import DPO, GRPO, PPO, RLOO, SFT, OnlineDPO
    from lit_rl.config import EnvArgs, RolloutArgs, ScheduleArgs
    from lit_rl.loss_config import GRPOLoss, PPOLoss
    from lit_rl.training.metrics import asynchronous_rollout_metrics, metric_collection

    on_policy = {"schedule": ScheduleArgs(micro_batch_tokens=256), "env": EnvArgs(tools=["lit_rl.envs.tools.calc"])}
    modules = {
        "GRPO": GRPO(
            loss=GRPOLoss(beta=0.04),
            rollout=RolloutArgs(dynamic_sampling=True, correction="token_truncate"),
            **on_policy,
        ),
        "PPO": PPO(loss=PPOLoss(beta=0.05), **on_policy),
        "RLOO": RLOO(**on_policy),
        "OnlineDPO": OnlineDPO(**on_policy),
        "DPO": DPO(),
        "SFT": SFT(),
    }
    collections = {name: [module.train_metrics, module.val_metrics] for name, module in modules.items()}
    collections["asynchronous"] = [
        metric_collection(asynchronous_rollout_metrics(False, max_lag=1)).clone(prefix="train/")
    ]
    return collections


def test_every_logged_metric_declares_how_it_is_reduced():
    """Each metric of every algorithm is built with its reduction (`lit_rl.training.metrics.mean`, `total`, ...), and
    `reductions` names it with the logged name: the unit each update weighs, over ranks and micro-batches."""
    from lit_rl.training.metrics import reductions

    described = {}
    for name, collections in _every_collection().items():
        for collection in collections:
            table = reductions(collection)
            assert set(table) == set(collection.keys(keep_base=False)) and table, name
            undeclared = [metric for metric, text in table.items() if "not declared" in text]
            assert not undeclared, (name, undeclared)
            described[name] = {**described.get(name, {}), **table}
    grpo, dpo, sft = described["GRPO"], described["DPO"], described["SFT"]
    assert grpo["train/entropy"] == "mean per token, over ranks and micro-batches"
    assert grpo["train/reward"] == "mean per completion, over ranks and micro-batches"
    assert grpo["val/reward"] == "mean per completion, over ranks and validation batches"
    assert grpo["train/loss"].startswith("sum of ")
    assert grpo["train/kl"].startswith("mean per token")
    assert grpo["train/rollout_is_ratio/max"].startswith("max of any token")
    assert grpo["train/turns"].startswith("mean per episode")
    assert grpo["train/frac_reward_zero_std"].startswith("mean per completion")
    assert described["PPO"]["train/kl"].startswith("mean per completion")  # the per-sequence KL in the reward
    assert described["PPO"]["train/critic/explained_variance"].startswith("explained variance, one sample per token")
    assert described["RLOO"]["train/clip_ratio"].startswith("mean per completion")  # a sequence-level ratio
    assert described["OnlineDPO"]["train/rewards/chosen"].startswith("mean per untied pair")
    assert dpo["train/rewards/chosen"] == "mean per pair, over ranks and micro-batches"
    assert dpo["train/logits/chosen"].startswith("mean per token")
    assert sft["train/loss"] == "mean per token, over ranks and micro-batches"
    assert sft["train/num_tokens"].startswith("sum of ")
    assert described["asynchronous"]["train/staleness/max"].startswith("max of any completion")


def test_a_metric_built_without_a_reduction_is_named_undeclared():
    from torchmetrics import MeanMetric

    from lit_rl.training.metrics import LOCAL, mean, metric_collection, reductions

    collection = metric_collection({"entropy": mean("token"), "custom": MeanMetric(**LOCAL)}).clone(prefix="train/")
    assert reductions(collection) == {
        "train/custom": "MeanMetric: reduction not declared",
        "train/entropy": "mean per token, over ranks and micro-batches",
    }


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_metrics_accumulate_in_float32_when_lightning_casts_the_module_to_half_precision(precision):
    """`bf16-true`/`16-true` cast the whole module with `.to(dtype)` (Lightning's `HalfPrecision.convert_module`),
    which torchmetrics does not guard: in bfloat16, 300 updates of 7 tokens summed to 2048 and a mean of 2.3 read
    2.703; in float16 the sum of 70 000 tokens was 16384."""
    from lightning.pytorch.plugins.precision import HalfPrecision

    from lit_rl.algorithms import SFT
    from lit_rl.training.metrics import compute_collection

    module = HalfPrecision(precision).convert_module(SFT()).to("cpu")  # cast, then moved: as Strategy.setup
    assert module.policy is None  # the policy is built later (configure_model); the metrics are the module's now
    metrics = module.train_metrics
    states = {value.dtype for metric in metrics.values() for value in metric.metric_state.values()}
    assert states == {torch.float32}
    for _ in range(10_000):  # 70 000 tokens: above float16's largest value, 65 504
        metrics["num_tokens"].update(torch.tensor(7.0))
    for _ in range(300):
        metrics["token_accuracy"].update(torch.full((7,), 0.3))
    values = compute_collection(metrics)
    assert values["num_tokens"].item() == 70_000.0 and values["token_accuracy"].item() == pytest.approx(0.3, rel=1e-6)


def test_a_collection_that_accumulates_in_half_precision_is_refused():
    from lit_rl.training.metrics import compute_collection

    metrics = grpo_metrics([], with_kl=False)
    metrics.to(torch.bfloat16).to("cpu")  # as Lightning's strategies: cast, then moved (`dtype` reads float32 again)
    metrics["entropy"].update(torch.ones(3))
    refused = r"'clip_ratio/high' accumulates in torch.bfloat16 \(mean_value\): metric states must stay float32"
    with pytest.raises(TypeError, match=refused):
        compute_collection(metrics)


def test_a_metric_without_data_on_a_later_step_logs_nan_not_its_last_value(tmp_path):
    """Online DPO's pair metrics on a step whose pairs all tied: the module updates none of them, and Lightning
    repeated the previous step's values in that step's row (`train/rewards/accuracies` 1.0 on a step of ties)."""
    import csv

    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lit_rl.algorithms import OnlineDPO
    from lit_rl.algorithms.base import PolicyModule
    from lit_rl.algorithms.online_dpo import online_dpo_metrics

    class TiedOnSecondStep(L.LightningModule):
        """The logging of `PolicyModule` and the metric updates of `OnlineDPO`, on a linear model."""

        log_collection = PolicyModule.log_collection
        update_algorithm_metrics = OnlineDPO.update_algorithm_metrics

        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)
            self._logged_metrics = set()
            self.train_metrics = online_dpo_metrics(["correctness"]).clone(prefix="train/")

        def training_step(self, batch, batch_idx):
            untied = torch.ones(2) if self.trainer.global_step == 0 else torch.zeros(2)  # step 2: all tied
            ones = torch.ones(2)
            stats = {"untied": untied, "chosen_rewards": ones, "rejected_rewards": ones, "accuracies": ones}
            stats |= {"margins": ones, "chosen_logps": ones, "rejected_logps": ones}
            loss = self.linear(batch).sum()
            self.update_algorithm_metrics(None, loss, stats)
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.log_collection(self.train_metrics, on_step=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)

    trainer = L.Trainer(
        max_steps=2,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(TiedOnSecondStep())
    rows = list(csv.DictReader(open(f"{trainer.logger.log_dir}/metrics.csv")))
    assert [(row["train/frac_tied_pairs"], row["train/rewards/accuracies"]) for row in rows] == [
        ("0.0", "1.0"),
        ("1.0", "nan"),
    ]


def test_a_nan_in_a_step_is_logged_as_nan_not_dropped():
    """torchmetrics' aggregators drop NaN values: a step whose second micro-batch loss was NaN logged the first one's
    0.25, an entropy of [1, nan, 3] logged 2.0. Weights still count (torchmetrics' `nan_strategy="disable"` dropped
    them)."""
    from lit_rl.training.metrics import compute_collection

    metrics = grpo_metrics([], with_kl=False)
    metrics["loss"].update(torch.tensor(0.25))
    metrics["loss"].update(torch.tensor(float("nan")))
    metrics["entropy"].update(torch.tensor([1.0, float("nan"), 3.0]))
    metrics["rollout_is_ratio/max"].update(torch.tensor([1.0, float("nan")]))
    metrics["rollout_is_ratio/min"].update(torch.tensor([1.0, float("nan")]))
    metrics["reward"].update(torch.tensor([1.0, 5.0]), torch.tensor([3.0, 1.0]))
    values = compute_collection(metrics)
    assert all(values[name].isnan() for name in ("loss", "entropy", "rollout_is_ratio/max", "rollout_is_ratio/min"))
    assert values["reward"].item() == 2.0  # (3 * 1 + 1 * 5) / 4
