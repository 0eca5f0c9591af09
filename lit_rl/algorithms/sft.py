"""Supervised fine-tuning on prompt/completion pairs: the warm start of the RL demos.

Loss: mean negative log-likelihood of the completion tokens (and the EOS after them) of the optimizer step, each
micro-batch's part divided by the step's tokens on every rank (`lit_rl.losses.sft.sft_loss`),

    L_mb = - sum_{i,t in mb} m_it log p(y_it | x_i, y_i,<t) / N_step,    N_step = sum over the step and ranks of m

prompt tokens are context only (m = 0 there). `train/loss` and `val/loss` log the token mean over every rank and batch.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import MetricCollection

from lit_rl.algorithms.offline import OfflineModule
from lit_rl.config import OptimArgs, PolicyArgs, check_length_limit
from lit_rl.losses.sft import sft_loss
from lit_rl.training.metrics import mean, metric_collection, total
from lit_rl.training.strategies import reduce_across_ranks


class SFT(OfflineModule):
    """Supervised fine-tuning of a causal LM on the completions of prompt/completion pairs.

    The option groups it takes (`policy`, `optim`, ...) are documented in `lit_rl.config`.

    Args:
        random_init: build the model from its config with random weights instead of loading weights.
        max_prompt_length: truncate prompts to their last `max_prompt_length` tokens (None: no limit).
        max_completion_length: truncate completions to this many tokens, EOS included (None: no limit).
    """

    disable_dropout = False

    def __init__(
        self,
        policy: PolicyArgs = PolicyArgs(model_name_or_path="lit-rl/tiny-qwen2-base"),
        optim: OptimArgs = OptimArgs(learning_rate=1e-3),
        random_init: bool = False,
        max_prompt_length: Optional[int] = None,
        max_completion_length: Optional[int] = None,
    ) -> None:
        check_length_limit("model.max_prompt_length", max_prompt_length)
        check_length_limit("model.max_completion_length", max_completion_length)
        super().__init__(policy, optim, random_init=random_init, max_prompt_length=max_prompt_length)
        self.save_hyperparameters()
        self.max_completion_length = max_completion_length
        metrics = sft_metrics()
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self._warned_no_window = False
        self._step_tokens: Optional[tuple[int, torch.Tensor]] = None  # (global_step, its tokens on all ranks)

    def encode_completions(self, completions: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded completion ids followed by EOS, and their mask [B, T]."""
        ids = self.completion_token_ids(completions)
        pad = self.tokenizer.pad_token_id
        T = max(len(seq) for seq in ids)
        out = torch.full((len(ids), T), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), T), dtype=torch.float32)
        for row, seq in enumerate(ids):
            out[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1.0
        return out.to(self.device), mask.to(self.device)

    def completion_token_ids(self, completions: list[str]) -> list[list[int]]:
        """Each completion's token ids and EOS, cut to `max_completion_length`."""
        eos, limit = self.tokenizer.eos_token_id, self.max_completion_length
        ids = [self.tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for c in completions]
        return [seq[:limit] if limit else seq for seq in ids]

    def row_tokens(self, rows: list[dict[str, Any]], chunk: int = 1024) -> list[int]:
        """Each row's prompt and completion tokens as `_step` tokenizes them (for token-budget micro-batches)."""
        counts = []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            _, prompt_mask = self.prompt_encoder.encode([row["prompt"] for row in part])
            completions = self.completion_token_ids([row["completion"] for row in part])
            counts += [int(p) + len(c) for p, c in zip(prompt_mask.sum(dim=1).tolist(), completions)]
        return counts

    def step_tokens(self, window_rows: list[dict[str, Any]]) -> torch.Tensor:
        """The completion tokens of the whole optimizer step: this rank's window, summed over ranks. Counted on the
        step's first micro-batch and kept for the others (every rank starts a step at the same micro-batch, so the
        collective stays in step)."""
        step = self.trainer.global_step
        if self._step_tokens is None or self._step_tokens[0] != step:
            self._step_tokens = (step, self.tokens_on_all_ranks(window_rows))
        return self._step_tokens[1]

    def tokens_on_all_ranks(self, rows: list[dict[str, Any]]) -> torch.Tensor:
        """The completion tokens (EOS included) of `rows`, summed over ranks."""
        count = sum(len(seq) for seq in self.completion_token_ids([row["completion"] for row in rows]))
        tokens = torch.tensor(float(count), device=self.device)
        return reduce_across_ranks(tokens) if self.trainer.world_size > 1 else tokens

    def _step(self, batch: dict[str, Any], metrics, denominator: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The micro-batch's part of the loss, - sum m log p / `denominator` (its own tokens when None)."""
        rows = batch["rows"]
        prompt_ids, prompt_mask = self.prompt_encoder.encode([row["prompt"] for row in rows], device=self.device)
        completion_ids, completion_mask = self.encode_completions([row["completion"] for row in rows])
        completion_mask = completion_mask * batch["weight"].to(completion_mask)[:, None]  # padding rows weigh 0
        scores = self.score_completions(
            self.policy, prompt_ids, prompt_mask, completion_ids, completion_mask, extras=("argmax",)
        )
        logprobs = scores.logprobs  # [B, T]
        tokens = completion_mask > 0
        self.timer.count("trained_tokens", float(completion_mask.sum()))
        if metrics is self.train_metrics:  # padding rows weigh 0 in both masks' counts
            prompt_tokens = (prompt_mask.sum(dim=1) * batch["weight"].to(prompt_mask)).sum()
            self.count_micro_batch_tokens(prompt_tokens + tokens.sum())
        loss = sft_loss(logprobs, completion_mask, completion_mask.sum() if denominator is None else denominator)
        with torch.no_grad():
            correct = (scores.argmax == completion_ids).float()
            metrics["loss"].update(-logprobs.detach()[tokens])  # token-weighted across micro-batches and ranks
            metrics["token_accuracy"].update(correct[tokens])
            metrics["num_tokens"].update(completion_mask.sum())
        return loss

    def training_loss(self, batch: dict[str, Any]) -> torch.Tensor:
        if "window_rows" not in batch:  # a data module of the user's that does not say the step's rows
            return self._step_without_window(batch)
        loss = self._step(batch, self.train_metrics, self.step_tokens(batch["window_rows"]))
        # Normalised over the whole step: undo Lightning's division by the accumulation and the ranks' averaging.
        return loss * self.step_loss_scale()

    def _step_without_window(self, batch: dict[str, Any]) -> torch.Tensor:
        """The loss normalised by the micro-batch's tokens on all ranks; Lightning then averages the micro-batches
        of the step: exact without accumulation, a mean of micro-batch means with it (said once)."""
        if self.trainer.accumulate_grad_batches > 1 and not self._warned_no_window:
            self._warned_no_window = True
            rank_zero_warn(
                "SFT: the training batches carry no `window_rows` (the rows of this rank's optimizer step), so with "
                "trainer.accumulate_grad_batches > 1 the loss is a mean of micro-batch token means, not the step's "
                "token mean: yield batches as lit_rl.data.sharding.ShardedTrainBatches does to make it exact"
            )
        weight = batch["weight"].to(self.device)
        rows = [row for row, w in zip(batch["rows"], weight.tolist()) if w > 0]
        loss = self._step(batch, self.train_metrics, self.tokens_on_all_ranks(rows))
        return loss * self.step_loss_scale(accumulated=False)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._step(batch, self.val_metrics)


# -- metrics ----------------------------------------------------------------------------------------------------------
def sft_metrics() -> MetricCollection:
    """Token-weighted negative log-likelihood and next-token accuracy of the completion tokens, and their count."""
    return metric_collection(
        {"loss": mean("token"), "token_accuracy": mean("token"), "num_tokens": total("completion tokens")}
    )
