"""DPO through the real CLI: metrics, precomputed reference, and exact global metrics across 2 DDP processes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from tests.conftest import (
    CLI_COMMAND,
    CONFIGS,
    assert_rows_match,
    cli_env,
    read_metrics,
    run_cli,
    train_rows,
    write_overlay,
)

pytestmark = pytest.mark.slow

DPO_YAML = str(CONFIGS / "dpo.yaml")
FAST = ["--data.batch_size", "8", "--data.val_limit", "16", "--trainer.num_sanity_val_steps", "0"]
NAMES = [
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
]


def _fit(tmp_path, *args, name="a"):
    overlay = write_overlay(tmp_path / f"{name}.yaml", save_dir=tmp_path / name)
    run_cli("fit", "--config", DPO_YAML, "--config", str(overlay), *FAST, *args)
    return tmp_path / name / "run" / "version_0"


def test_dpo_logs_every_metric_for_train_and_val(tmp_path):
    log_dir = _fit(
        tmp_path,
        "--trainer.max_steps",
        "4",
        "--trainer.val_check_interval",
        "2",
        "--trainer.callbacks+=lit_rl.callbacks.SaveHFPretrained",
    )
    assert (log_dir / "hf" / "model.safetensors").exists()  # exported into this run's own directory
    columns = set(read_metrics(log_dir)[0])
    for name in NAMES:
        assert f"train/{name}" in columns and f"val/{name}" in columns, name
    rows = train_rows(log_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["train/rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 1
    assert rows[-1]["train/rewards/margins"] > 0


def test_validation_does_not_change_training(tmp_path):
    # Training reads the data position (`train_batches_done`), the metrics and the RNG; validation must touch
    # none of them. The probe checks that the global torch RNG state after each validation is the one before it.
    probe = ("--trainer.callbacks+", "tests.integration.probes.RecordRngAcrossValidation")
    probe += ("--trainer.callbacks.directory", str(tmp_path / "probe"))
    with_val = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.val_check_interval", "2", *probe)
    without = _fit(tmp_path, "--trainer.max_steps", "4", "--trainer.limit_val_batches", "0", name="noval")
    assert [float(r["step"]) for r in read_metrics(with_val) if r.get("val/loss")] == [2.0, 4.0]
    validations = json.loads((tmp_path / "probe" / "rng_rank0.json").read_text())["validations"]
    assert validations == [{"step": 2, "unchanged": True}, {"step": 4, "unchanged": True}]
    assert train_rows(with_val) == train_rows(without)


@pytest.mark.parametrize(("loss_type", "batch_size", "precision"), [("sigmoid", "8", "bf16-mixed"), ("ipo", "2", "32")])
def test_precomputed_reference_trains_to_the_same_numbers(tmp_path, loss_type, batch_size, precision):
    """The precomputed and the live reference give the same train/ values to 1e-6 + 1e-6 relative (CPU); measured:
    0.0 on an Intel Xeon, 3.8e-6 on a loss of 25 on an AVX2 AMD EPYC. Under `bf16-mixed` too: the precompute pass
    runs under the trainer's autocast, as the live forward does (in float32 it differed by 1e-2 per sequence).

    A pair's log-probs round differently with the shape of the batch it is in (CPU kernels are picked by shape),
    so the precompute pass runs in batches of `data.batch_size` like the live forward. In chunks of 64 pairs it
    gave 7.6e-6 in train/loss here at batch size 2 with IPO (and 0.0 at 8); per pair, 1e-5 in a log-prob."""
    common = (
        *("--trainer.max_steps", "3", "--model.loss.type", loss_type, "--trainer.limit_val_batches", "0"),
        *("--data.train_data", "builtin:addition_preference/val", "--data.batch_size", batch_size),
        *("--trainer.precision", precision),
    )
    live = _fit(tmp_path, *common, name="live")
    cache = tmp_path / "cache"
    pre = _fit(
        tmp_path, *common, "--model.precompute_ref_logprobs", "true", "--model.ref_cache_dir", str(cache), name="pre"
    )
    assert len(list(cache.glob("ref_logprobs-*.pt"))) == 2  # train and val pairs
    again = _fit(
        tmp_path, *common, "--model.precompute_ref_logprobs", "true", "--model.ref_cache_dir", str(cache), name="again"
    )  # served from the cache
    assert [r["step"] for r in train_rows(pre)] == [r["step"] for r in train_rows(live)] == [1, 2, 3]
    # 1e-6 plus float32's own resolution: IPO's loss is about 25 here, where one rounding step is 2e-6 (an AVX2
    # AMD EPYC gave 25.0000038 against 25.0 at batch size 2).
    assert_rows_match(train_rows(pre), train_rows(live), abs=1e-6, rel=1e-6)
    assert train_rows(again) == train_rows(pre)  # exactly: the same cached values


def test_resume_reads_the_reference_logprobs_from_the_checkpoint(tmp_path, monkeypatch, capsys):
    """Precomputed reference, 4 steps straight or 2 then a resume with the cache directory deleted: the same
    train/ and val/ values exactly, from the log-probs the checkpoint holds, and no reference model built."""
    from lit_rl.algorithms import DPO

    def fit(name, *args):
        overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=2, save_dir=tmp_path / name)
        run_cli(
            *("fit", "--config", DPO_YAML, "--config", str(overlay), *FAST),
            *("--data.train_data", "builtin:addition_preference/val", "--trainer.val_check_interval", "2"),
            *("--model.precompute_ref_logprobs", "true", "--model.ref_cache_dir", str(tmp_path / name / "cache")),
            *args,
        )
        return tmp_path / name / "run" / "version_0"

    full = fit("full", "--trainer.max_steps", "4")
    part = fit("part", "--trainer.max_steps", "2")
    checkpoint = part / "checkpoints" / "step=2.ckpt"
    stored = torch.load(checkpoint, weights_only=True)["lit_rl"]["ref_logprobs"]
    assert {split: (tuple(s["values"].shape), s["values"].dtype) for split, s in stored.items()} == {
        "train": ((256, 2), torch.float32),
        "val": ((16, 2), torch.float32),
    }
    shutil.rmtree(tmp_path / "part" / "cache")
    built = []  # every reference model loaded: the live one or the one a precompute pass loads
    load_reference = DPO.load_reference
    monkeypatch.setattr(DPO, "load_reference", lambda self, *a, **k: built.append(a) or load_reference(self, *a, **k))

    resumed = fit("resumed", "--trainer.max_steps", "4", "--ckpt_path", str(checkpoint))
    assert built == [] and not (tmp_path / "resumed" / "cache").exists()  # nothing computed, nothing cached
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [3, 4]
    assert rows == train_rows(full)[2:]
    assert val_rows(resumed) == val_rows(full)[1:]  # step 4's

    # Other validation pairs than the checkpoint's: their log-probs are computed (and said so), train's are not.
    capsys.readouterr()
    fit("other", "--trainer.max_steps", "3", "--ckpt_path", str(checkpoint), "--data.val_limit", "8")
    assert "the checkpoint's reference log-probs are of other val pairs" in capsys.readouterr().err
    assert len(built) == 1 and len(list((tmp_path / "other" / "cache").glob("ref_logprobs-*.pt"))) == 1


def val_rows(log_dir):
    """The val/ values of each validation in metrics.csv, as logged."""
    return [{k: v for k, v in row.items() if k.startswith("val/")} for row in read_metrics(log_dir) if row["val/loss"]]


def test_resume_mid_epoch_is_exact(tmp_path, capsys):
    """8 steps straight, or 3 steps then a resume to 8: the same train/ values and the same final weights; a resume
    in batches of another size stops in one line."""
    common = (
        "--trainer.accumulate_grad_batches",
        "2",
        "--trainer.limit_val_batches",
        "0",
        "--data.train_data",
        "builtin:addition_preference/val",
        "--data.batch_size",
        "16",
    )
    # 256 pairs in batches of 16 with accumulation 2: an epoch is 8 steps, so the resumed run crosses into epoch 2
    overlay = lambda name: write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=1, save_dir=tmp_path / name)  # noqa: E731
    run_cli("fit", "--config", DPO_YAML, "--config", str(overlay("full")), *FAST, *common, "--trainer.max_steps", "10")
    run_cli("fit", "--config", DPO_YAML, "--config", str(overlay("part")), *FAST, *common, "--trainer.max_steps", "3")
    part = tmp_path / "part" / "run" / "version_0"
    run_cli(
        "fit",
        "--config",
        DPO_YAML,
        "--config",
        str(overlay("resumed")),
        *FAST,
        *common,
        "--trainer.max_steps",
        "10",
        "--ckpt_path",
        str(part / "checkpoints" / "step=3.ckpt"),
    )
    full, resumed = tmp_path / "full" / "run" / "version_0", tmp_path / "resumed" / "run" / "version_0"
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == list(range(4, 11))  # crosses the epoch boundary at step 8
    assert_rows_match(rows, train_rows(full), abs=1e-6)
    a = torch.load(full / "checkpoints" / "step=10.ckpt", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoints" / "step=10.ckpt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # The checkpoint's place is 6 batches of 16 pairs: in batches of 8 it would be another place in the data.
    again = ("--ckpt_path", str(part / "checkpoints" / "step=3.ckpt"), "--data.batch_size", "8")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        run_cli("fit", "--config", DPO_YAML, "--config", str(overlay("other")), *FAST, *common, *again)
    error = "data.batch_size: 8 here, 16 in the checkpoint; the checkpoint's place in the data counts micro-batches"
    assert error in capsys.readouterr().err


def test_validate_subcommand_with_precomputed_reference(tmp_path, capsys):
    overlay = write_overlay(tmp_path / "v.yaml", save_dir=tmp_path / "v")
    run_cli(
        "validate",
        "--config",
        DPO_YAML,
        "--config",
        str(overlay),
        *FAST,
        "--model.precompute_ref_logprobs",
        "true",
        "--model.ref_cache_dir",
        str(tmp_path / "cache"),
    )
    rows = read_metrics(tmp_path / "v" / "run" / "version_0")
    assert float(rows[-1]["val/loss"]) == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference


def _perturbed_reference(path):
    from lit_rl.modeling.models import load_causal_lm

    torch.manual_seed(123)
    model = load_causal_lm("lit-rl/tiny-qwen2-addition-sft")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path)
    load_causal_lm_tokenizer_copy(path)
    return path


def load_causal_lm_tokenizer_copy(path):
    from lit_rl.modeling.models import load_tokenizer

    load_tokenizer("lit-rl/tiny-qwen2-addition-sft").save_pretrained(path)


def _expected_means(rows, ref_path):
    """Every DPO metric computed in one process over the union of the pairs."""
    from lit_rl.algorithms import DPO
    from lit_rl.data.preference import collate_pairs, tokenize_pairs
    from lit_rl.losses.dpo import dpo_loss

    module = DPO(ref_model_name_or_path=str(ref_path))
    module.configure_model()
    pairs = tokenize_pairs(rows, module.tokenizer, module.prompt_encoder.format, None, None, "union")
    batch = collate_pairs(pairs, [1.0] * len(pairs), module.tokenizer.pad_token_id)
    with torch.no_grad():
        logps, _, mean_logits = module.sequence_logps(module.policy, batch)
        ref, _, _ = module.sequence_logps(module.ref_model, batch)
    chosen, rejected = logps.chunk(2)
    _, stats = dpo_loss(chosen, rejected, *ref.chunk(2), beta=0.1)
    mask_c, mask_r = batch["completion_mask"].chunk(2)
    logits_c, logits_r = mean_logits.chunk(2)
    return {
        "loss": stats["losses"].mean(),
        "rewards/chosen": stats["chosen_rewards"].mean(),
        "rewards/rejected": stats["rejected_rewards"].mean(),
        "rewards/margins": stats["margins"].mean(),
        "rewards/accuracies": stats["accuracies"].mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
        "logits/chosen": logits_c[mask_c > 0].mean(),
        "logits/rejected": logits_r[mask_r > 0].mean(),
    }


def test_two_process_ddp_metrics_are_the_exact_global_values(tmp_path):
    """7 pairs on 2 ranks (4 and 3, in micro-batches of 2 with accumulation 2): every logged value must equal the
    value over all 7 pairs, not rank 0's and not a mean of per-rank or per-micro-batch means."""
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1 + a % 3)}
        for a, b in [(3, 4), (12, 30), (55, 44), (9, 9), (71, 8), (40, 40), (99, 1)]
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    ref_path = _perturbed_reference(tmp_path / "ref")
    overlay = write_overlay(tmp_path / "ddp.yaml", save_dir=tmp_path / "ddp")
    command = [
        *CLI_COMMAND,
        "fit",
        "--config",
        DPO_YAML,
        "--config",
        str(overlay),
        "--trainer.devices",
        "2",
        "--trainer.strategy",
        "ddp",
        "--trainer.accumulate_grad_batches",
        "2",
        "--trainer.max_steps",
        "2",
        "--trainer.val_check_interval",
        "2",
        "--trainer.num_sanity_val_steps",
        "0",
        "--data.train_data",
        str(data),
        "--data.val_data",
        str(data),
        "--data.batch_size",
        "2",
        "--model.ref_model_name_or_path",
        str(ref_path),
        "--model.optim.learning_rate",
        "0.0",
    ]
    env = cli_env()
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _expected_means(rows, ref_path)
    log_dir = tmp_path / "ddp" / "run" / "version_0"
    train = train_rows(log_dir)
    assert [r["step"] for r in train] == [1, 2]
    val = [r for r in read_metrics(log_dir) if r.get("val/loss")]
    assert [float(r["step"]) for r in val] == [1.0, 2.0]  # val_check_interval counts micro-batches: 2 = 1 step
    for name, value in expected.items():
        for row in train:
            assert row[f"train/{name}"] == pytest.approx(value.item(), abs=2e-5), name
        for row in val:
            assert float(row[f"val/{name}"]) == pytest.approx(value.item(), abs=2e-5), name
    # The comparison can tell the bugs apart: rank 0's share (pairs 0, 2, 4, 6, as validation shards them) and the
    # mean of the two ranks' means give other values than the union, by far more than the tolerance.
    rank0 = _expected_means(rows[0::2], ref_path)
    rank1 = _expected_means(rows[1::2], ref_path)
    for name in ("loss", "rewards/accuracies", "rewards/margins"):
        union, mean_of_means = expected[name].item(), (rank0[name].item() + rank1[name].item()) / 2
        assert abs(rank0[name].item() - union) > 1e-3 and abs(mean_of_means - union) > 1e-3, name


def test_accumulation_gives_the_same_steps_as_one_big_batch(tmp_path):
    """38 pairs per epoch: 1 x 16 or 4 x 4 pairs per step; the last step has 4 + 2 real pairs in its micro-batches,
    which must weigh each pair equally (the same metrics, hence the same weights, as one batch of 6)."""
    common = (
        "--trainer.limit_val_batches",
        "0",
        "--trainer.max_steps",
        "4",
        "--data.train_data",
        "builtin:addition_preference/val",
        "--data.val_data",
        "null",
        "--model.optim.learning_rate",
        "0.001",
    )
    rows = [
        json.dumps(r)
        for r in __import__("lit_rl.data", fromlist=["load_rows"]).load_rows("builtin:addition_preference/val")[:38]
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(rows))
    one = _fit(tmp_path, *common, "--data.train_data", str(data), "--data.batch_size", "16", name="one")
    four = _fit(
        tmp_path,
        *common,
        "--data.train_data",
        str(data),
        "--data.batch_size",
        "4",
        "--trainer.accumulate_grad_batches",
        "4",
        name="four",
    )
    a, b = train_rows(one), train_rows(four)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]  # step 4 sees step 3's update
    assert_rows_match(a, b, abs=1e-5)
