"""Bugs users met in other RL trainers, planted through lit-rl's extension points (an objective, an advantage
estimator, a callback given by import path): `lit-rl check` must fail each, naming the pair that shows it."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_rl.losses.policy import ppo_clip
from lit_rl.training.strategies import is_accumulating_micro_batch


def loss_over_the_micro_batch_tokens(
    logprobs, old_logprobs, advantages, completion_mask, epsilon_low=0.2, epsilon_high=0.2
):
    """PPO's clipped objective with each token weighted by 1 / (its micro-batch's token count): a loss normalised
    per micro-batch instead of per optimizer step (TRL #6024: DAPO and CISPO mis-scaled by accumulation)."""
    per_token, stats = ppo_clip(logprobs, old_logprobs, advantages, completion_mask, epsilon_low, epsilon_high)
    return per_token * 100.0 / completion_mask.sum().clamp(min=1.0), stats


def advantages_normalised_per_rank(rewards, group_size, scale_rewards="group", eps=1e-4):
    """(r - mean) / std over this rank's share of the generation's rewards, as a trainer that never gathered the
    rewards across ranks computes it. `rewards` is the whole generation [B*G]; rank r's share is the r-th of
    `world_size` consecutive slices (`lit_rl.data.schedule`)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    shares = rewards.view(world, -1)
    advantages = (shares - shares.mean(dim=1, keepdim=True)) / (shares.std(dim=1, keepdim=True) + eps)
    return advantages.reshape(-1), {}


class EntropyAsMeanOfRankMeans(L.Callback):
    """Logs `train/entropy_of_ranks`: each rank's own per-token entropy mean, averaged over ranks by Lightning's
    `sync_dist`: a mean of rank means, where a rank with more tokens should weigh more."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        entropy = pl_module.train_metrics["entropy"]  # a MeanMetric: its states are this rank's, before the sync
        if is_accumulating_micro_batch(trainer) or entropy.weight == 0:
            return
        pl_module.log("train/entropy_of_ranks", entropy.mean_value / entropy.weight, sync_dist=True)


class ValidationRewardsCountedAsTraining(L.Callback):
    """Adds each validation batch's rewards to the train reward metric (the train/eval mix-up of a library that
    keeps one metric for both): a step whose accumulation a validation interrupts logs a `train/reward` that is
    not the training rows' alone. (The validation's own rewards stand in as zeros, one per validation row.)"""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if trainer.state.fn == "fit":
            pl_module.train_metrics["reward"].update(torch.zeros(len(batch["rows"])))


class StepCountOutsideTheCheckpoint(L.Callback):
    """Logs `train/steps_this_process`: the optimizer steps since the process started, kept in the callback and not
    in the checkpoint (a callback, a reward or a curriculum whose state is not saved): a resumed run counts from 0
    again where the run that never stopped goes on."""

    def __init__(self) -> None:
        self.count = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if is_accumulating_micro_batch(trainer):
            return
        self.count += 1
        pl_module.log("train/steps_this_process", float(self.count))


class CadenceCountedFromTheStart(ModelCheckpoint):
    """ModelCheckpoint whose `every_n_train_steps` counts the steps this process ran instead of `global_step` (a
    step counter of the callback's own, not restored): a resumed run saves N steps after its resume, off the cadence
    of the run that never stopped."""

    def on_train_start(self, trainer, pl_module) -> None:
        super().on_train_start(trainer, pl_module)
        self.started_at = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        steps_here = trainer.global_step - self.started_at
        if steps_here == 0 or steps_here % self._every_n_train_steps or self._should_skip_saving_checkpoint(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)
