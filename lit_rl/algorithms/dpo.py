"""Direct Preference Optimization and its variants (losses in `lit_rl.losses.dpo`) as a LightningModule.

Chosen and rejected completions go through the policy in one forward pass of the concatenated batch; sequence
log-probs are sums over completion tokens. The reference is a frozen copy of the starting policy, or, with
`precompute_ref_logprobs`, its log-probs computed once before training (cached on disk, and kept in the
checkpoint so a resumed run reads them back) so no reference model stays in memory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torchmetrics import MetricCollection

from lit_rl.algorithms.offline import OfflineModule
from lit_rl.config import OptimArgs, PolicyArgs, as_args
from lit_rl.data.contracts import PreferencePairs, data_of
from lit_rl.data.preference import TokenizedPair, batch_completion_tokens, batch_tokens, collate_pairs
from lit_rl.loss_config import DPOLoss
from lit_rl.losses.dpo import REFERENCE_FREE, dpo_loss
from lit_rl.modeling.models import resolve_model_path
from lit_rl.resume import say
from lit_rl.training.metrics import DPO_PAIR_METRICS, mean, metric_collection
from lit_rl.training.strategies import reduce_across_ranks

log = logging.getLogger(__name__)


def cast_like(module: torch.nn.Module, like: torch.nn.Module) -> torch.nn.Module:
    """`module` with its floating-point parameters and buffers in the dtypes `like`'s have (the first of each), as
    the strategy cast `like`: `*-true` precisions cast both to bf16/fp16; DeepSpeed's bf16 the parameters (ZeRO-3
    creates them and the buffers in bf16); plain `bf16-mixed` neither (autocast computes in bf16). A precomputed
    reference cast otherwise than the live one moved the log-probs by up to 1e-3."""
    kinds = ((module.parameters(), like.parameters()), (module.buffers(), like.buffers()))
    for tensors, reference in kinds:
        dtype = next((t.dtype for t in reference if t.is_floating_point()), None)
        for tensor in tensors:
            if dtype is not None and tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
    return module


class DPO(OfflineModule):
    """DPO, cDPO, robust DPO, IPO, hinge (SLiC), APO-zero and SimPO.

    The option groups it takes (`policy`, `optim`, ...) are documented in `lit_rl.config`, its `loss` group in
    `lit_rl.loss_config.DPOLoss`.

    Args:
        ref_model_name_or_path: reference model (default: the starting policy, `policy.model_name_or_path`).
        precompute_ref_logprobs: compute the reference log-probs once before training and keep no reference model.
        ref_cache_dir: where precomputed reference log-probs are cached (keyed to the model and the data).
    """

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(),
        optim: OptimArgs = OptimArgs(),
        ref_model_name_or_path: Optional[str] = None,
        loss: DPOLoss = DPOLoss(),
        precompute_ref_logprobs: bool = False,
        ref_cache_dir: str = "runs/cache",
    ) -> None:
        self.loss_args = loss = as_args(DPOLoss, loss)
        loss.check()
        super().__init__(policy, optim)
        self.save_hyperparameters()
        self.ref_model_name_or_path, self.ref_cache_dir = ref_model_name_or_path, ref_cache_dir
        self.precompute_ref_logprobs = precompute_ref_logprobs
        metrics = dpo_metrics()
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self._ref_cache: dict[str, torch.Tensor] = {}  # split -> [N, 2] (chosen, rejected) reference log-probs
        self._ref_fingerprints: dict[str, str] = {}  # split -> `pairs_fingerprint` of the pairs they belong to
        self._ref_from_checkpoint: dict[str, dict[str, Any]] = {}  # split -> {"fingerprint", "values"}, until used

    @property
    def needs_reference(self) -> bool:
        return self.loss_args.type not in REFERENCE_FREE

    @property
    def ref_path(self) -> str:
        return self.ref_model_name_or_path or self.policy_args.model_name_or_path

    def configure_model(self) -> None:
        super().configure_model()
        keeps_reference = self.needs_reference and not self.precompute_ref_logprobs
        if keeps_reference and self.ref_model is None and not self.reference_is_adapter_off(self.ref_path):
            self.ref_model = self.load_reference(self.ref_path)

    # -- reference log-probs ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        # Not in on_fit_start: DeepSpeed and FSDP restore a checkpoint, and with it the stored reference log-probs,
        # after on_fit_start. Before super(): the first step's timer starts once this one-off pass is done.
        if self.needs_reference and self.precompute_ref_logprobs:
            self._precomputed("train")
            if data_of(self, PreferencePairs).val_pairs:
                self._precomputed("val")
        super().on_train_start()

    def _precomputed(self, split: str) -> torch.Tensor:
        """[N, 2] reference log-probs of the split's pairs, on first use: from the checkpoint resumed from, else
        from the cache file, else computed."""
        if split not in self._ref_cache:
            data = data_of(self, PreferencePairs)
            pairs = data.train_pairs if split == "train" else data.val_pairs
            fingerprint = pairs_fingerprint(pairs)
            stored = self._ref_from_checkpoint.pop(split, None)
            if stored is not None and stored["fingerprint"] == fingerprint:
                log.info("reference log-probs of the %s pairs restored from the checkpoint", split)
                values = stored["values"].to(self.device)
            else:
                # Other pairs than the checkpoint's (a resume may change the data: `resume_config` compares only
                # `model.`; `validate --ckpt_path` on new pairs is a use, not a mistake). Computed for these
                # pairs, not refused: stored values never describe other pairs, and what replaces them is what a
                # fresh run on this data would compute, as a resume with a live reference does.
                if stored is not None:
                    say(
                        f"the checkpoint's reference log-probs are of other {split} pairs (data fingerprint "
                        f"{stored['fingerprint']}; this run's: {fingerprint}): computing them for this run's pairs"
                    )
                values = self._cached_ref_logprobs(pairs, split)
            self._ref_cache[split], self._ref_fingerprints[split] = values, fingerprint
        return self._ref_cache[split]

    def _cached_ref_logprobs(self, pairs: list[TokenizedPair], split: str) -> torch.Tensor:
        """[N, 2] reference log-probs of every pair, from the cache file when its key matches."""
        path = Path(self.ref_cache_dir) / f"ref_logprobs-{self._cache_key(pairs)}.pt"
        if path.exists():
            log.info("reference log-probs of the %s pairs loaded from %s", split, path)
            return torch.load(path, weights_only=True).to(self.device)
        # In batches of the training micro-batch's size, as TRL does: no more memory than a live reference's
        # forward (64 long pairs could exceed it), and the live forward's batch shape, on which a pair's log-probs
        # depend in their last bits (kernels are chosen by shape): in chunks of 64 they differed from a live
        # reference's by up to 2e-5 at batch size 1 on CPU (`test_precomputed_reference_trains_to_the_same_numbers`).
        size = data_of(self, PreferencePairs).batch_size
        values = []
        # In the trainer's precision, as the live forward runs (under `bf16-mixed`, autocast): `on_train_start` is
        # outside Lightning's step contexts, and a float32 pass differed from the live one by 1e-2 per sequence.
        forward_context = self.trainer.precision_plugin.forward_context()
        with torch.no_grad(), forward_context, self._reference_for_precompute() as ref_model:
            for start in range(0, len(pairs), size):
                chunk = pairs[start : start + size]
                batch = collate_pairs(chunk, [1.0] * len(chunk), self.tokenizer.pad_token_id)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                logps, _, _ = self.sequence_logps(ref_model, batch, metrics=False)
                values.append(torch.stack(logps.split(len(chunk)), dim=1))  # [n, 2]
        result = torch.cat(values)
        if self.trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(result.cpu(), tmp)
            os.replace(tmp, path)  # atomic: a killed run never leaves a half-written cache
        log.info("reference log-probs of %d %s pairs computed and cached at %s", len(pairs), split, path)
        return result

    @contextmanager
    def _reference_for_precompute(self) -> Iterator[torch.nn.Module]:
        """The reference model for a one-off pass: the policy with its adapter off, or a copy loaded for it."""
        if self.reference_is_adapter_off(self.ref_path):
            with self.reference_model() as ref_model:
                yield ref_model
        else:
            # A whole copy on each rank for the one pass, cast as the policy is (`cast_like`): outside the DeepSpeed
            # engine nothing would gather a ZeRO-3 partitioned one, and loading it whole is no collective (a rank
            # that finds the cache file skips the pass). Under ZeRO-3 the engine's forward runs DeepSpeed's own linear
            # layers: the pass's bf16 log-probs differ from a live reference's in their last bits (~1e-4 per pair).
            ref_model = cast_like(self.load_reference(self.ref_path, whole=True), self.policy).to(self.device)
            yield ref_model
            del ref_model

    def _cache_key(self, pairs: list[TokenizedPair]) -> str:
        """Hash of the reference model (path; name, size, mtime and first/last MiB of its config and weight files),
        the dtype, the trainer's precision, the dtype the pass computes in (the policy's parameters': DeepSpeed's
        bf16 casts them where plain `bf16-mixed` does not) and the token ids. A hub id is keyed by its name: clear
        the cache when the hub model changes."""
        digest = hashlib.sha256()
        resolved = Path(resolve_model_path(self.ref_path))
        computed_in = str(next(self.policy.parameters()).dtype)
        digest.update(json.dumps([self.ref_path, self.policy_args.dtype, str(self.trainer.precision)]).encode())
        digest.update(computed_in.encode())
        if resolved.is_dir():
            for file in sorted(resolved.iterdir()):
                if file.suffix in (".json", ".safetensors", ".bin"):
                    stat = file.stat()
                    digest.update(f"{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
                    with file.open("rb") as handle:
                        digest.update(handle.read(1 << 20))
                        handle.seek(max(file.stat().st_size - (1 << 20), 0))
                        digest.update(handle.read())
        hash_pairs(digest, pairs)
        return digest.hexdigest()[:16]

    # -- checkpoint ------------------------------------------------------------------------------------------
    # With `precompute_ref_logprobs` the reference log-probs travel in the checkpoint ([N, 2] float32 per split,
    # 78 KB for the 9744 built-in pairs): a resumed run reads them back without the cache directory and without
    # building the reference model. Keyed to the pairs only; the reference model's path and dtype cannot change
    # on resume (`resume_config`), and the stored values are the reference this run trained against even if
    # the model's files were touched since.
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self._ref_cache:
            checkpoint["lit_rl"]["ref_logprobs"] = {
                split: {"fingerprint": self._ref_fingerprints[split], "values": values.detach().cpu().clone()}
                for split, values in self._ref_cache.items()
            }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.needs_reference and self.precompute_ref_logprobs:
            self._ref_cache.clear()  # a module loaded twice reads the newer checkpoint's
            self._ref_from_checkpoint = dict(checkpoint.get("lit_rl", {}).get("ref_logprobs", {}))

    # -- forward ---------------------------------------------------------------------------------------------
    def sequence_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor], metrics: bool = True):
        """Summed completion log-probs [2B], completion lengths [2B], and (with `metrics`) vocab-mean logits per
        token [2B, T]."""
        scores = self.score_completions(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            extras=("mean_logit",) if metrics else (),
        )
        mask = batch["completion_mask"]
        return (scores.logprobs * mask).sum(dim=1), mask.sum(dim=1), scores.mean_logit

    def _reference(self, batch: dict[str, torch.Tensor], split: str) -> tuple[Optional[torch.Tensor], ...]:
        if not self.needs_reference:
            return None, None
        if self.precompute_ref_logprobs:
            values = self._precomputed(split)[batch["index"]]  # [B, 2]
            return values[:, 0], values[:, 1]
        with torch.no_grad(), self.timer.phase("ref_logprobs"), self.reference_model() as ref_model:
            logps, _, _ = self.sequence_logps(ref_model, batch, metrics=False)
        return logps.chunk(2)

    def _step(self, batch: dict[str, torch.Tensor], split: str, metrics) -> torch.Tensor:
        args = self.loss_args
        weight = batch["weight"]  # [B], 0 on padding pairs
        logps, lengths, mean_logits = self.sequence_logps(self.policy, batch)
        chosen, rejected = logps.chunk(2)
        ref_chosen, ref_rejected = self._reference(batch, split)
        if args.type == "ipo":  # IPO compares length-averaged log-probs
            len_c, len_r = lengths.chunk(2)
            chosen, rejected = chosen / len_c, rejected / len_r
            ref_chosen, ref_rejected = ref_chosen / len_c, ref_rejected / len_r
        # Normalise by the real pairs of the whole optimizer step (training) or micro-batch (validation) on every
        # rank: padding pairs and uneven shares then weigh exactly nothing.
        num_pairs = batch.get("window_pairs", weight.sum()).to(weight)
        if self.trainer.world_size > 1:
            num_pairs = reduce_across_ranks(num_pairs)
        len_c, len_r = lengths.chunk(2)
        loss, stats = dpo_loss(
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            args.type,
            args.beta,
            args.label_smoothing,
            chosen_lengths=len_c,
            rejected_lengths=len_r,
            simpo_gamma=args.simpo_gamma,
            num_pairs=num_pairs.clamp(min=1.0),
            weights=weight,
        )
        self._update_metrics(metrics, stats, chosen.detach(), rejected.detach(), mean_logits, batch, weight)
        # The denominator covers the step on all ranks (the accumulation window too, when "window_pairs" is known).
        return loss * self.step_loss_scale(accumulated="window_pairs" in batch)

    def _update_metrics(self, m, stats, chosen, rejected, mean_logits, batch, weight) -> None:
        m["loss"].update(stats["losses"], weight)
        m["rewards/chosen"].update(stats["chosen_rewards"], weight)
        m["rewards/rejected"].update(stats["rejected_rewards"], weight)
        m["rewards/margins"].update(stats["margins"], weight)
        m["rewards/accuracies"].update(stats["accuracies"], weight)
        m["logps/chosen"].update(chosen, weight)
        m["logps/rejected"].update(rejected, weight)
        mask = batch["completion_mask"]  # [2B, T]
        token_weight = mask * weight.repeat(2)[:, None]
        chosen_w, rejected_w = token_weight.chunk(2)
        chosen_l, rejected_l = mean_logits.chunk(2)
        m["logits/chosen"].update(chosen_l[chosen_w > 0], chosen_w[chosen_w > 0])
        m["logits/rejected"].update(rejected_l[rejected_w > 0], rejected_w[rejected_w > 0])

    # -- Lightning hooks -------------------------------------------------------------------------------------
    def training_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.timer.count("trained_tokens", float(batch_completion_tokens(batch)))
        self.count_micro_batch_tokens(batch_tokens(batch))
        return self._step(batch, "train", self.train_metrics)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._step(batch, "val", self.val_metrics)


def hash_pairs(digest: Any, pairs: list[TokenizedPair]) -> None:
    """Feed every pair's token ids, in order, to a hashlib `digest`."""
    for pair in pairs:
        digest.update(json.dumps([pair.prompt_ids, pair.chosen_ids, pair.rejected_ids]).encode())


def pairs_fingerprint(pairs: list[TokenizedPair]) -> str:
    """16 hex digits of a hash of the pairs' token ids: what the reference log-probs stored in a checkpoint are
    keyed to (row order and tokenization included)."""
    digest = hashlib.sha256()
    hash_pairs(digest, pairs)
    return digest.hexdigest()[:16]


# -- metrics ----------------------------------------------------------------------------------------------------------
def dpo_metrics() -> MetricCollection:
    """Per-pair means (weighted by pair, padding pairs weigh 0); `logits/*` are token-weighted means of the
    vocabulary-mean logit over completion tokens."""
    per_pair = {name: mean("pair") for name in ["loss", *DPO_PAIR_METRICS]}
    return metric_collection({**per_pair, "logits/chosen": mean("token"), "logits/rejected": mean("token")})
