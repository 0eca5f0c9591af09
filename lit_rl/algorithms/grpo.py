"""GRPO (Shao et al. 2024, "DeepSeekMath") as a LightningModule, with Dr. GRPO and DAPO aggregations.

One `training_step` is one micro-step of a fixed schedule (see `lit_rl.data.schedule`): a generation fills a
buffer of B*G completions per rank; then `num_iterations` passes over it, each `steps_per_generation` optimizer
steps of `accumulate_grad_batches` micro-batches of `micro_batch_size` completions. Lightning's automatic
optimization does the accumulation, clipping, precision and `global_step`, so checkpoint cadence cannot drift.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from lit_rl.algorithms.base import PolicyModule, completion_forward, completion_logprobs
from lit_rl.data.schedule import RolloutSchedule
from lit_rl.losses import AGGREGATIONS, LossNormalizer, group_advantages, grpo_loss
from lit_rl.metrics import grpo_metrics, rollout_eval_metrics
from lit_rl.ops import entropy_from_logits, token_logprobs
from lit_rl.rewards import call_reward_function, import_reward_function, reward_name
from lit_rl.rollout import HFGenerateEngine, RolloutEngine, SamplingParams
from lit_rl.rollout.hf import model_eos_token_ids
from lit_rl.types import RolloutBatch

_ZERO_STD = 1e-6


class GRPO(PolicyModule):
    """Group Relative Policy Optimization.

    Args:
        model_name_or_path: policy to train: a hub id, a local directory, or `lit-rl/<asset>` for a shipped one.
        reward_funcs: import paths of reward functions `(prompts, completions, **columns) -> list[float]`.
        reward_weights: one weight per reward function (default: all 1.0); the reward is the weighted sum.
        num_generations: G, completions sampled per prompt (the group).
        micro_batch_size: completions per `training_step` on each rank.
        steps_per_generation: optimizer steps taken on each generation's buffer (per pass).
        num_iterations: passes over each generation's buffer (PPO epochs); > 1 computes old log-probs.
        max_new_tokens: completion budget T_max.
        temperature: sampling temperature; log-probs are computed at this temperature.
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        beta: weight of the per-token k3 KL to a frozen reference model; 0 loads no reference model.
        epsilon_low: lower clip range of the ratio, `1 - epsilon_low`.
        epsilon_high: upper clip range of the ratio, `1 + epsilon_high` (DAPO "clip-higher" when larger).
        loss_aggregation: `sequence` (GRPO paper), `token`, `constant` (Dr. GRPO) or `dapo`.
        scale_rewards: advantage scaling: `group` std, `batch` std, or `none` (Dr. GRPO).
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        dtype: dtype the policy is loaded in (`float32`, `bfloat16`, `float16`, `auto`).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        trust_remote_code: allow model code from the model repository (off by default).
        max_prompt_length: truncate prompts to their last `max_prompt_length` tokens (None: no limit).
        val_temperature: sampling temperature for validation (0: greedy).
        val_num_generations: completions per validation prompt.
    """

    def __init__(
        self,
        model_name_or_path: str = "lit-rl/tiny-qwen2-addition-sft",
        reward_funcs: Optional[list[str]] = None,
        reward_weights: Optional[list[float]] = None,
        num_generations: int = 8,
        micro_batch_size: int = 16,
        steps_per_generation: int = 1,
        num_iterations: int = 1,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.0,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        loss_aggregation: str = "sequence",
        scale_rewards: str = "group",
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_length: Optional[int] = None,
        val_temperature: float = 0.0,
        val_num_generations: int = 1,
    ) -> None:
        _check_grpo_args(locals())
        super().__init__(
            model_name_or_path,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            max_prompt_length=max_prompt_length,
        )
        reward_funcs = reward_funcs or ["lit_rl.rewards.arithmetic.correctness"]
        self.save_hyperparameters()
        self.reward_fns = {reward_name(path): import_reward_function(path) for path in reward_funcs}
        self.reward_weights = torch.tensor(reward_weights or [1.0] * len(reward_funcs))
        if len(self.reward_weights) != len(reward_funcs):
            raise ValueError(
                f"model.reward_weights has {len(self.reward_weights)} values for {len(reward_funcs)} reward_funcs"
            )
        metrics = grpo_metrics(self.reward_fns, with_kl=beta != 0.0)
        self.train_metrics = metrics.clone(prefix="train/")
        self.val_metrics = rollout_eval_metrics(self.reward_fns).clone(prefix="val/")
        self.ref_model: Optional[torch.nn.Module] = None
        self.rollout_engine: Optional[RolloutEngine] = None  # a plain object, never an nn.Module attribute
        self._micro_steps_done = 0
        self._buffer: Optional[RolloutBatch] = None
        self._normalizers: list[LossNormalizer] = []

    # -- set-up ----------------------------------------------------------------------------------------------
    def configure_model(self) -> None:
        super().configure_model()
        if self.hparams.beta != 0.0 and self.ref_model is None:
            self.ref_model = self.load_model().eval().requires_grad_(False)

    def engine(self) -> RolloutEngine:
        """The rollout engine (HF `generate` on the policy unless one was injected), created on first use."""
        if self.rollout_engine is None:
            eos_ids = model_eos_token_ids(self.policy, self.tokenizer.eos_token_id)
            self.rollout_engine = HFGenerateEngine(self.policy, eos_ids, self.tokenizer.pad_token_id)
        return self.rollout_engine

    def setup(self, stage: str) -> None:
        limit = self.trainer.limit_train_batches if stage == "fit" else None
        if limit is not None and (isinstance(limit, float) and limit != 1.0 or isinstance(limit, int)):
            # A truncated epoch would end inside a generation, where Lightning forces a partial optimizer step.
            if not isinstance(limit, int) or limit % self.micro_steps_per_generation != 0:
                raise ValueError(
                    f"trainer.limit_train_batches={limit} must be an integer multiple of the "
                    f"{self.micro_steps_per_generation} micro-steps of a generation"
                )
        if stage == "fit":
            completions = self.completions_per_generation
            if completions % self.hparams.num_generations != 0:
                raise ValueError(
                    f"model.micro_batch_size x trainer.accumulate_grad_batches x model.steps_per_generation = "
                    f"{completions} completions per rank must be a multiple of model.num_generations="
                    f"{self.hparams.num_generations}"
                )

    @property
    def accumulate(self) -> int:
        return self.trainer.accumulate_grad_batches

    @property
    def completions_per_generation(self) -> int:
        """Completions one rank generates at a time: B*G = micro_batch_size x accumulation x steps_per_generation."""
        return self.hparams.micro_batch_size * self.accumulate * self.hparams.steps_per_generation

    @property
    def micro_steps_per_generation(self) -> int:
        micro_batches = self.completions_per_generation // self.hparams.micro_batch_size
        return micro_batches * self.hparams.num_iterations

    def rollout_schedule(self) -> RolloutSchedule:
        """How the training loader must feed this module (see `lit_rl.data.schedule`)."""
        return RolloutSchedule(
            prompts_per_rank=self.completions_per_generation // self.hparams.num_generations,
            micro_steps_per_generation=self.micro_steps_per_generation,
            start_micro_step=lambda: self._micro_steps_done,
        )

    # -- rollout ---------------------------------------------------------------------------------------------
    def sampling_params(self, training: bool) -> SamplingParams:
        hp = self.hparams
        return SamplingParams(
            max_new_tokens=hp.max_new_tokens,
            temperature=hp.temperature if training else hp.val_temperature,
            top_p=hp.top_p,
            top_k=hp.top_k,
        )

    def score(self, rows: list[dict[str, Any]], completions: list[str], repeat: int) -> torch.Tensor:
        """Reward components [N, F] (one column per reward function) for rows repeated `repeat` times."""
        prompts = [row["prompt"] for row in rows for _ in range(repeat)]
        columns = {
            key: [row.get(key) for row in rows for _ in range(repeat)] for key in rows[0] if key != "prompt"
        }
        values = [
            call_reward_function(name, fn, prompts, completions, columns) for name, fn in self.reward_fns.items()
        ]
        return torch.tensor(values, dtype=torch.float32, device=self.device).T.reshape(len(completions), -1)

    def sample(self, rows: list[dict[str, Any]], repeat: int, params: SamplingParams):
        """Prompt ids [N, P], mask, engine output, decoded completions and reward components for `rows` x `repeat`."""
        prompt_ids, prompt_mask = self.encode_prompts([row["prompt"] for row in rows])
        prompt_ids = prompt_ids.repeat_interleave(repeat, dim=0)  # [B*G, P]
        prompt_mask = prompt_mask.repeat_interleave(repeat, dim=0)
        out = self.engine().generate(prompt_ids, prompt_mask, params)
        completions = self.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return prompt_ids, prompt_mask, out, self.score(rows, completions, repeat)

    @torch.no_grad()
    def make_rollout(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        """Generate, score and compute advantages (and old/reference log-probs when needed) for this rank."""
        hp = self.hparams
        G = hp.num_generations
        prompt_ids, prompt_mask, out, components = self.sample(rows, G, self.sampling_params(training=True))
        rewards = (components.nan_to_num(0.0) * self.reward_weights.to(components)).sum(dim=1)  # [N]
        # Groups never span ranks here, but `batch` scaling needs every rank's rewards: normalise globally.
        all_rewards = self.all_gather(rewards).reshape(-1)  # [world * N]
        advantages, stats = group_advantages(all_rewards, G, hp.scale_rewards)
        local = slice(self.global_rank * len(rewards), (self.global_rank + 1) * len(rewards))
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            rollout_logprobs=out.logprobs,
            rewards=rewards,
            reward_components=components,
            advantages=advantages[local],
            group_reward_std=stats["group_std"][local],
        )
        policy_changes_before_use = hp.num_iterations > 1 or hp.steps_per_generation > 1
        if policy_changes_before_use:
            batch.old_logprobs = self._logprobs_in_chunks(self.policy, batch)
        if self.ref_model is not None:
            batch.ref_logprobs = self._logprobs_in_chunks(self.ref_model, batch)
        self._normalizers = self._step_normalizers(batch)
        return batch

    def _logprobs_in_chunks(self, model: torch.nn.Module, batch: RolloutBatch) -> torch.Tensor:
        chunks = []
        for start in range(0, len(batch), self.hparams.micro_batch_size):
            mb = batch.select(slice(start, start + self.hparams.micro_batch_size))
            chunks.append(
                completion_logprobs(
                    model, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask,
                    self.hparams.temperature,
                )
            )
        return torch.cat(chunks) * batch.completion_mask

    def _step_normalizers(self, batch: RolloutBatch) -> list[LossNormalizer]:
        """Loss denominators for each optimizer step of this generation, summed over ranks."""
        per_step = self.accumulate * self.hparams.micro_batch_size
        tokens = batch.completion_mask.sum(dim=1)  # [N]
        counts = torch.stack([chunk.sum() for chunk in tokens.split(per_step)] + [tokens.sum()])
        counts = self.trainer.strategy.reduce(counts, reduce_op="sum") if self.trainer.world_size > 1 else counts
        num_sequences = float(per_step * self.trainer.world_size)
        return [
            LossNormalizer(num_sequences, float(c), float(counts[-1]), self.hparams.max_new_tokens)
            for c in counts[:-1]
        ]

    # -- training --------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        hp = self.hparams
        if batch["micro_step"] != self._micro_steps_done:
            raise RuntimeError(
                f"rollout schedule drifted: loader gave micro-step {batch['micro_step']}, "
                f"the module expected {self._micro_steps_done}"
            )
        generation_micro_step = batch["micro_step"] % self.micro_steps_per_generation
        if generation_micro_step == 0:
            self._buffer = self.make_rollout(batch["rows"])
        micro_batches = self.micro_steps_per_generation // hp.num_iterations
        index = generation_micro_step % micro_batches
        if self._buffer.prompt_ids.device != self.device:  # restored from a checkpoint on CPU
            self._buffer = self._buffer.to(self.device)
        mb = self._buffer.select(slice(index * hp.micro_batch_size, (index + 1) * hp.micro_batch_size))

        logits = completion_forward(self.policy, mb.prompt_ids, mb.prompt_mask, mb.completion_ids, mb.completion_mask)
        logprobs = token_logprobs(logits, mb.completion_ids, hp.temperature)  # [n, T]
        old_logprobs = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
        loss, stats = grpo_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            mb.completion_mask,
            aggregation=hp.loss_aggregation,
            normalizer=self._normalizers[index // self.accumulate],
            ref_logprobs=mb.ref_logprobs,
            beta=hp.beta,
            epsilon_low=hp.epsilon_low,
            epsilon_high=hp.epsilon_high,
        )
        first_pass = generation_micro_step < micro_batches
        self._update_train_metrics(mb, loss, stats, logits, logprobs if first_pass else None)
        self._micro_steps_done += 1
        # The aggregation's denominators cover the whole step on every rank; Lightning divides by the
        # accumulation and data-parallel strategies average gradients over ranks, so undo both.
        return loss * self.accumulate * self.trainer.world_size

    def _update_train_metrics(
        self,
        mb: RolloutBatch,
        loss: torch.Tensor,
        stats: dict[str, torch.Tensor],
        logits: torch.Tensor,
        fresh_logprobs: Optional[torch.Tensor],
    ) -> None:
        m = self.train_metrics
        tokens = mb.completion_mask > 0  # [n, T]
        m["loss"].update(loss.detach())
        self._update_rollout_metrics(m, mb.rewards, mb.reward_components, mb.completion_mask, mb.group_reward_std)
        m["frac_reward_zero_std"].update((mb.group_reward_std < _ZERO_STD).float())
        m["entropy"].update(entropy_from_logits(logits.detach(), self.hparams.temperature)[tokens])
        m["clip_ratio/low"].update(stats["clipped_low"][tokens])
        m["clip_ratio/high"].update(stats["clipped_high"][tokens])
        if "kl" in stats:
            m["kl"].update(stats["kl"][tokens])
        # Compare the engine's log-probs with the trainer's at the same weights: the old log-probs when they
        # were computed at generation time, else this (first, on-policy) pass.
        trainer_logprobs = mb.old_logprobs if mb.old_logprobs is not None else fresh_logprobs
        if trainer_logprobs is not None:
            diff = (trainer_logprobs.detach() - mb.rollout_logprobs).abs()[tokens]
            m["rollout_logprob_diff/mean"].update(diff)
            m["rollout_logprob_diff/max"].update(diff)

    def _update_rollout_metrics(self, m, rewards, components, completion_mask, group_std, weight=None) -> None:
        weight = torch.ones_like(rewards) if weight is None else weight
        m["reward"].update(rewards, weight)
        m["reward_std"].update(group_std, weight)
        m["completion_length"].update(completion_mask.sum(dim=1), weight)
        for column, name in enumerate(self.reward_fns):
            m[f"rewards/{name}"].update(components[:, column], weight)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Called once per optimizer step, after every micro-batch of the window has run its backward.
        self.log_collection(self.train_metrics, on_step=True, prog_bar=("reward", "loss"))

    # -- validation ------------------------------------------------------------------------------------------
    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        hp = self.hparams
        G = hp.val_num_generations
        # Validation samples with its own RNG stream, so it cannot change what training samples next.
        # fork_rng saves and restores the CPU RNG and, listed here, this GPU's.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(7919 * (batch_idx + 1))
            _, _, out, components = self.sample(batch["rows"], G, self.sampling_params(training=False))
        rewards = (components.nan_to_num(0.0) * self.reward_weights.to(components)).sum(dim=1)
        group_std = rewards.view(-1, G).std(dim=1).repeat_interleave(G) if G > 1 else torch.zeros_like(rewards)
        weight = batch["weight"].to(rewards).repeat_interleave(G)  # 0 on rows that pad this rank's share
        self._update_rollout_metrics(self.val_metrics, rewards, components, out.completion_mask, group_std, weight)

    def on_validation_epoch_end(self) -> None:
        self.log_collection(self.val_metrics, on_step=False, prog_bar=("reward",))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # The reference model is frozen and reloaded from its path: keep it out of the checkpoint.
        checkpoint["state_dict"] = {
            k: v for k, v in checkpoint["state_dict"].items() if not k.startswith("ref_model.")
        }
        # Every rank has its own buffer and RNG stream, but only rank 0 writes the file: gather them all.
        local = {
            "buffer": None if self._buffer is None else self._buffer.state_dict(),
            "normalizers": [vars(n) for n in self._normalizers],
            "rng": rng_state(self.device),
        }
        per_rank = [local]
        if self.trainer.world_size > 1:
            per_rank = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(per_rank, local)
        checkpoint["lit_rl"] = {"micro_steps_done": self._micro_steps_done, "per_rank": per_rank}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.ref_model is not None:
            for key, value in self.ref_model.state_dict().items():
                checkpoint["state_dict"][f"ref_model.{key}"] = value
        state = checkpoint.get("lit_rl")
        if state is None:
            return
        per_rank = state["per_rank"]
        if len(per_rank) != self.trainer.world_size:
            raise ValueError(
                f"checkpoint was written by {len(per_rank)} ranks, this run has {self.trainer.world_size}: "
                "GRPO resumes its rollout buffer per rank, so resume with the same number of devices"
            )
        mine = per_rank[self.global_rank]
        self._micro_steps_done = state["micro_steps_done"]
        # Kept on CPU here: the module is moved to its device after this hook; training_step moves it.
        self._buffer = None if mine["buffer"] is None else RolloutBatch.from_state_dict(mine["buffer"])
        self._normalizers = [LossNormalizer(**n) for n in mine["normalizers"]]
        set_rng_state(mine["rng"])


def rng_state(device: torch.device) -> dict[str, Any]:
    """CPU and (on GPU) this device's RNG state: what sampling draws from."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


def _check_grpo_args(args: dict[str, Any]) -> None:
    """Reject impossible settings at construction, naming the offending key."""
    positive = ("num_generations", "micro_batch_size", "steps_per_generation", "num_iterations", "max_new_tokens")
    for key in positive:
        if args[key] < 1:
            raise ValueError(f"model.{key} must be >= 1, got {args[key]}")
    if args["num_generations"] < 2:
        raise ValueError(f"model.num_generations must be >= 2 (advantages compare completions), got {args['num_generations']}")
    if args["loss_aggregation"] not in AGGREGATIONS:
        raise ValueError(f"model.loss_aggregation must be one of {sorted(AGGREGATIONS)}, got {args['loss_aggregation']!r}")
    if args["scale_rewards"] not in ("group", "batch", "none"):
        raise ValueError(f"model.scale_rewards must be 'group', 'batch' or 'none', got {args['scale_rewards']!r}")
    if args["temperature"] <= 0 or not math.isfinite(args["temperature"]):
        raise ValueError(f"model.temperature must be > 0 for training rollouts, got {args['temperature']}")
    if args["epsilon_low"] < 0 or args["epsilon_high"] < 0:
        raise ValueError("model.epsilon_low and model.epsilon_high must be >= 0")
    if args["beta"] < 0:
        raise ValueError(f"model.beta must be >= 0, got {args['beta']}")
