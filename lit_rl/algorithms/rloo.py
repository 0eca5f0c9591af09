"""RLOO (Ahmadian et al. 2024): REINFORCE with a leave-one-out baseline, a KL penalty folded into the reward,
and a sequence-level PPO-clipped importance ratio (`lit_rl.losses.rloo`).

The rollout schedule, buffer, validation and checkpoint state are `OnPolicyModule`'s, so `global_step` is
Lightning's: the checkpoint cadence is exact for any accumulation, `num_iterations` or resume.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torchmetrics import MeanMetric, MetricCollection

from lit_rl.algorithms.on_policy import OnPolicyModule
from lit_rl.algorithms.rollout_checks import check_rollout_args
from lit_rl.errors import ConfigError
from lit_rl.losses import LossNormalizer
from lit_rl.losses.rloo import kl_penalized_rewards, rloo_advantages, rloo_loss
from lit_rl.modeling.lora import LoRAConfig
from lit_rl.rollout import VLLMConfig
from lit_rl.training.metrics import LOCAL, metric_collection, on_policy_training_metrics
from lit_rl.types import RolloutBatch


class RLOO(OnPolicyModule):
    """REINFORCE Leave-One-Out.

    Args:
        model_name_or_path: policy to train: a hub id, a local directory, or `lit-rl/<asset>` for a shipped one.
        reward_funcs: import paths of reward functions `(prompts, completions, **columns) -> list[float]`.
        reward_weights: one weight per reward function (default: all 1.0); the reward is the weighted sum.
        num_generations: k, completions sampled per prompt (>= 2 for the leave-one-out baseline).
        micro_batch_size: completions per `training_step` on each rank.
        steps_per_generation: optimizer steps taken on each generation's buffer (per pass).
        num_iterations: passes over each generation's buffer; > 1 uses the clipped importance ratio.
        max_new_tokens: completion budget.
        min_new_tokens: no completion stops (EOS or a stop id) before this many tokens.
        temperature: sampling temperature; log-probs are computed at this temperature.
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        beta: KL penalty in the reward, `r - beta * sum_t (logp - ref_logp)`; 0 loads no reference model.
        epsilon: clip range of the sequence-level ratio, `[1 - epsilon, 1 + epsilon]`.
        normalize_advantages: standardise the advantages over the whole generation batch (all ranks).
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        dtype: dtype the policy is loaded in (`float32`, `bfloat16`, `float16`, `auto`).
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        trust_remote_code: allow model code from the model repository (off by default).
        max_prompt_length: truncate prompts to their last `max_prompt_length` tokens (None: no limit).
        val_temperature: sampling temperature for validation (0: greedy).
        val_num_generations: completions per validation prompt.
        invalid_reward: what a NaN/None/inf reward value does: `zero` counts it as 0 (and in the metric
            `frac_invalid_reward`), `error` stops the run naming the reward function.
        vllm: generate rollouts with vLLM (`configs/rollout/vllm_colocate.yaml`, `vllm_server.yaml`); None: HF
            `generate` on the policy. See `lit_rl.rollout.VLLMConfig` for the keys (`--model.vllm.mode ...`).
        padding_free: run the training forwards (policy, reference, old log-probs) on the rows' real tokens laid
            end to end, without padding (`lit_rl.modeling.packing`): the same values to float rounding, less compute
            when lengths vary. It replaces the shared-prompt forward.
        head_chunk_tokens: run the output head on that many completion tokens at a time (`lit_rl.modeling.head`), so the
            `[tokens, vocab]` logits never exist beyond one chunk: the memory of long completions at a large
            vocabulary, for one more head forward per trained token. None: the whole micro-batch's logits at once.
        micro_batch_tokens: group each optimizer step's completions into at most `accumulate_grad_batches`
            micro-batches of at most this many real (prompt + completion) tokens instead of `micro_batch_size`
            each (`lit_rl.training.micro_batches`); the step's completions and loss stay the same. None: fixed counts.
        lora: train a LoRA adapter (`configs/peft/lora.yaml`) instead of the full weights; the reference is then
            the policy with its adapter disabled. See `lit_rl.modeling.lora.LoRAConfig` for the keys
            (`--model.lora.r 8`).
        max_staleness: asynchronous rollouts: generation g is sampled in the background by the weights of
            optimizer step max(0, g*m - k) (m = steps_per_generation x num_iterations), so each sample is at most
            k steps older than the policy it first updates (`lit_rl.rollout.producer`); needs the vLLM server
            engine. 0 (default): synchronous.
        environment: multi-turn episodes: the import path of an environment class (`lit_rl.envs.Environment`:
            `reset(row)`, `step(turn_text)`), one per episode, built with `environment_args`. Each completion is then
            the episode's transcript, token-in and token-out (`lit_rl.rollout.multi_turn`); only the model's tokens
            are trained. None (default): single completions.
        environment_args: keyword arguments of the environment class.
        tools: import paths of tools (`lit_rl.envs.tools.calc`); alone they run in the built-in
            `ToolEnvironment` (a turn's `<name>argument</name>` is answered `<result>value</result>`).
        max_turns: the most model turns of an episode.
        max_total_tokens: the most tokens of a transcript after the prompt, model and observation tokens (None:
            `max_turns x max_new_tokens`).
    """

    def __init__(
        self,
        model_name_or_path: str = "lit-rl/tiny-qwen2-addition-sft",
        reward_funcs: Optional[list[str]] = None,
        reward_weights: Optional[list[float]] = None,
        num_generations: int = 4,
        micro_batch_size: int = 16,
        steps_per_generation: int = 1,
        num_iterations: int = 1,
        max_new_tokens: int = 16,
        min_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        beta: float = 0.05,
        epsilon: float = 0.2,
        normalize_advantages: bool = False,
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        max_prompt_length: Optional[int] = None,
        val_temperature: float = 0.0,
        val_num_generations: int = 1,
        invalid_reward: str = "zero",
        vllm: Optional[VLLMConfig] = None,
        lora: Optional[LoRAConfig] = None,
        padding_free: bool = False,
        head_chunk_tokens: Optional[int] = None,
        micro_batch_tokens: Optional[int] = None,
        max_staleness: int = 0,
        environment: Optional[str] = None,
        environment_args: Optional[dict[str, Any]] = None,
        tools: Optional[list[str]] = None,
        max_turns: int = 4,
        max_total_tokens: Optional[int] = None,
    ) -> None:
        check_rollout_args(locals())
        if epsilon < 0:
            raise ConfigError(f"model.epsilon must be >= 0, got {epsilon}")
        super().__init__(
            model_name_or_path,
            reward_funcs,
            reward_weights,
            dtype=dtype,
            gradient_checkpointing=gradient_checkpointing,
            trust_remote_code=trust_remote_code,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            max_prompt_length=max_prompt_length,
            vllm=vllm,
            lora=lora,
            padding_free=padding_free,
            head_chunk_tokens=head_chunk_tokens,
            micro_batch_tokens=micro_batch_tokens,
            max_staleness=max_staleness,
            environment=environment,
            environment_args=environment_args,
            tools=tools,
            max_turns=max_turns,
            max_total_tokens=max_total_tokens,
        )
        self.save_hyperparameters()
        self.train_metrics = self.rollout_train_metrics(rloo_metrics(self.reward_names))
        self.val_metrics = self.rollout_val_metrics()

    def uses_reference(self) -> bool:
        return self.hparams.beta != 0.0

    def needs_old_logprobs(self) -> bool:
        # The KL penalty is part of the reward, so it needs the sampling policy's log-probs at generation time.
        return self.hparams.beta != 0.0 or super().needs_old_logprobs()

    def finish_rollout(self, batch: RolloutBatch, all_rewards: torch.Tensor) -> None:
        hp = self.hparams
        rewards = batch.rewards
        if batch.ref_logprobs is not None:
            rewards, batch.kl = kl_penalized_rewards(
                rewards, batch.old_logprobs, batch.ref_logprobs, self.loss_mask(batch), hp.beta
            )
        all_penalized = self.all_gather(rewards).reshape(-1) if self.trainer.world_size > 1 else rewards
        advantages = rloo_advantages(all_penalized, hp.num_generations, hp.normalize_advantages)
        batch.advantages = advantages[self.local_slice(len(batch))]
        batch.advantage_std = advantages.std().expand(len(batch)).clone()

    def micro_batch_loss(
        self, mb: RolloutBatch, logprobs: torch.Tensor, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # The old log-probs exist for the KL penalty even when the policy has not moved since generation; then the
        # ratio is 1 by definition, so use this pass's own log-probs (no numerical drift into the clipping).
        policy_moved = OnPolicyModule.needs_old_logprobs(self)
        old_logprobs = mb.old_logprobs if policy_moved else logprobs.detach()
        return rloo_loss(
            logprobs,
            old_logprobs,
            mb.advantages,
            self.loss_mask(mb),
            self.hparams.epsilon,
            num_sequences=normalizer.num_sequences,
        )

    def update_algorithm_metrics(self, mb: RolloutBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m = self.train_metrics
        m["loss"].update(loss.detach())
        m["clip_ratio"].update(stats["clipped"])
        m["advantage_std"].update(mb.advantage_std)
        if mb.kl is not None:
            m["kl"].update(mb.kl)


# -- metrics ----------------------------------------------------------------------------------------------------------
def rloo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of RLOO: `reward` is the task reward (before the KL penalty); `kl` the mean per-sequence KL."""
    return metric_collection(
        {
            **on_policy_training_metrics(reward_names),
            "kl": MeanMetric(**LOCAL),
            "advantage_std": MeanMetric(**LOCAL),
            "clip_ratio": MeanMetric(**LOCAL),
        }
    )
