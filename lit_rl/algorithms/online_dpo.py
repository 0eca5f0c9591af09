"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback").

For each prompt the current policy samples 2 completions; the reward functions rank them (chosen = the higher
reward) and the DPO loss of `lit_rl.losses.dpo` is applied against the frozen reference. Pairs with equal
rewards carry no preference: they are skipped (weight 0) and counted in `frac_tied_pairs`. The step loss is
normalised by the untied pairs of the whole optimizer step on all ranks.

With an environment (`model.environment` or `model.tools`) each completion is a multi-turn transcript, and a
sequence's log-probability is the sum over the model's tokens alone: the environment's tokens between turns are
not the policy's to choose, and carry no loss.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from torchmetrics import MeanMetric, MetricCollection

from lit_rl.algorithms.on_policy import OnPolicyModule
from lit_rl.algorithms.rollout_checks import check_rollout_args
from lit_rl.errors import ConfigError
from lit_rl.losses import LossNormalizer
from lit_rl.losses.dpo import DPO_LOSSES, REFERENCE_FREE, dpo_loss
from lit_rl.modeling.lora import LoRAConfig
from lit_rl.rewards.model import RewardModel
from lit_rl.rollout import VLLMConfig
from lit_rl.training.metrics import DPO_PAIR_METRICS, LOCAL, metric_collection, on_policy_training_metrics
from lit_rl.types import RolloutBatch


class OnlineDPO(OnPolicyModule):
    """Online DPO with reward functions as the judge.

    Args:
        model_name_or_path: policy to train: a hub id, a local directory, or `lit-rl/<asset>` for a shipped one.
        reward_funcs: import paths of reward functions `(prompts, completions, **columns) -> list[float]` that
            rank the two completions of each prompt.
        reward_model_name_or_path: a sequence-classification reward model (hub id or local directory) whose score
            is added to the reward functions' (weight: the last entry of `reward_weights` when it has one more
            entry than `reward_funcs`, else 1.0). With no `reward_funcs` given, it is the only judge.
        reward_weights: one weight per reward function (default: all 1.0).
        num_generations: completions per prompt; must be 2 (one pair).
        micro_batch_size: completions per `training_step` on each rank (even: pairs are never split).
        steps_per_generation: optimizer steps taken on each generation's buffer (per pass).
        num_iterations: passes over each generation's buffer.
        max_new_tokens: completion budget.
        min_new_tokens: no completion stops (EOS or a stop id) before this many tokens.
        temperature: sampling temperature; log-probs are computed at this temperature.
        top_p: nucleus sampling threshold (1.0 disables).
        top_k: top-k sampling (0 disables).
        loss_type: DPO loss (`sigmoid`, `robust`, `hinge`, `ipo`, `apo_zero`); see `lit_rl.losses.dpo`.
        beta: inverse temperature of the implicit reward `beta * (logp - ref_logp)`.
        label_smoothing: probability that a preference is flipped (cDPO / robust).
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
            count in a sequence's log-probability (module docstring). None (default): single completions.
        environment_args: keyword arguments of the environment class.
        tools: import paths of tools (`lit_rl.envs.tools.calc`); alone they run in the built-in
            `ToolEnvironment` (a turn's `<name>argument</name>` is answered `<result>value</result>`).
        max_turns: the most model turns of an episode.
        max_total_tokens: the most tokens of a transcript after the prompt, model and observation tokens (None:
            `max_turns x max_new_tokens`).
    """

    micro_batch_unit = 2  # a pair's two completions are adjacent rows, compared within one micro-batch

    def __init__(
        self,
        model_name_or_path: str = "lit-rl/tiny-qwen2-addition-sft",
        reward_funcs: Optional[list[str]] = None,
        reward_weights: Optional[list[float]] = None,
        reward_model_name_or_path: Optional[str] = None,
        num_generations: int = 2,
        micro_batch_size: int = 16,
        steps_per_generation: int = 1,
        num_iterations: int = 1,
        max_new_tokens: int = 16,
        min_new_tokens: int = 0,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        loss_type: str = "sigmoid",
        beta: float = 0.1,
        label_smoothing: float = 0.0,
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
        if num_generations != 2:
            raise ConfigError(
                f"model.num_generations must be 2 for Online DPO (one pair per prompt), got {num_generations}"
            )
        if micro_batch_size % 2:
            raise ConfigError(f"model.micro_batch_size must be even (pairs are never split), got {micro_batch_size}")
        if loss_type not in DPO_LOSSES or loss_type in REFERENCE_FREE:
            allowed = [t for t in DPO_LOSSES if t not in REFERENCE_FREE]
            raise ConfigError(f"model.loss_type must be one of {allowed}, got {loss_type!r}")
        if not 0 <= label_smoothing < 0.5:
            raise ConfigError(f"model.label_smoothing must be in [0, 0.5), got {label_smoothing}")
        # A reward model is one more judge after the reward functions: its weight is the extra last entry of
        # reward_weights, if any. New names, so save_hyperparameters keeps the arguments as given.
        judge_weight = 1.0
        funcs, weights = reward_funcs, reward_weights
        if reward_model_name_or_path is not None:
            funcs = list(reward_funcs or [])
            if reward_weights is not None and len(reward_weights) == len(funcs) + 1:
                weights, judge_weight = list(reward_weights[:-1]), reward_weights[-1]
        super().__init__(
            model_name_or_path,
            funcs,
            weights or None,
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
        if reward_model_name_or_path is not None:
            # A plain callable, never an nn.Module attribute: the reward model is not trained or checkpointed.
            self.add_reward_function("reward_model", RewardModel(reward_model_name_or_path), judge_weight)
        self.train_metrics = self.rollout_train_metrics(online_dpo_metrics(self.reward_names))
        self.val_metrics = self.rollout_val_metrics()

    def uses_reference(self) -> bool:
        return True

    def setup(self, stage: str) -> None:
        super().setup(stage)
        judge = self.reward_fns.get("reward_model")
        if isinstance(judge, RewardModel):
            judge.to(self.device)

    def finish_rollout(self, batch: RolloutBatch, all_rewards: torch.Tensor) -> None:
        """Advantages as preference labels: +1 on the chosen row, -1 on the rejected, 0 on both rows of a tie."""
        pairs = batch.rewards.view(-1, 2)  # [B, 2]
        first_wins = (pairs[:, 0] > pairs[:, 1]).float()
        second_wins = (pairs[:, 1] > pairs[:, 0]).float()
        batch.advantages = torch.stack([first_wins - second_wins, second_wins - first_wins], dim=1).reshape(-1)

    def micro_batch_loss(
        self, mb: RolloutBatch, logprobs: torch.Tensor, normalizer: LossNormalizer
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        hp = self.hparams
        mask = self.loss_mask(mb)  # the model's tokens: every completion token without an environment
        labels = mb.advantages.view(-1, 2)  # [n/2, 2]
        seq_logps = (logprobs * mask).sum(dim=1).view(-1, 2)  # [n/2, 2]
        ref_logps = (mb.ref_logprobs * mask).sum(dim=1).view(-1, 2)
        if hp.loss_type == "ipo":  # IPO compares length-averaged log-probs, as in DPO
            lengths = mask.sum(dim=1).clamp(min=1).view(-1, 2)
            seq_logps, ref_logps = seq_logps / lengths, ref_logps / lengths
        chosen_col = (labels[:, 1] > 0).long()  # 0 when the first completion is chosen (or tied)
        pick = lambda values, col: values.gather(1, col[:, None]).squeeze(1)  # noqa: E731
        untied = (labels[:, 0] != 0).float()  # [n/2]
        loss, stats = dpo_loss(
            pick(seq_logps, chosen_col),
            pick(seq_logps, 1 - chosen_col),
            pick(ref_logps, chosen_col),
            pick(ref_logps, 1 - chosen_col),
            hp.loss_type,
            hp.beta,
            hp.label_smoothing,
            num_pairs=max(normalizer.num_active_sequences / 2, 1.0),
            weights=untied,
        )
        stats["untied"] = untied
        stats["chosen_logps"] = pick(seq_logps, chosen_col).detach()
        stats["rejected_logps"] = pick(seq_logps, 1 - chosen_col).detach()
        return loss, stats

    def update_algorithm_metrics(self, mb: RolloutBatch, loss: torch.Tensor, stats: dict[str, torch.Tensor]) -> None:
        m = self.train_metrics
        untied = stats["untied"]
        m["loss"].update(loss.detach())
        m["frac_tied_pairs"].update(1.0 - untied)
        for name, key in [
            ("rewards/chosen", "chosen_rewards"),
            ("rewards/rejected", "rejected_rewards"),
            ("rewards/accuracies", "accuracies"),
            ("rewards/margins", "margins"),
            ("logps/chosen", "chosen_logps"),
            ("logps/rejected", "rejected_logps"),
        ]:
            # Always updated (ties weigh 0), so every rank takes part in the metric's sync.
            m[name].update(stats[key], untied)


# -- metrics ----------------------------------------------------------------------------------------------------------
def online_dpo_metrics(reward_names: Iterable[str]) -> MetricCollection:
    """Metrics of Online DPO: the rollout's rewards, the DPO pair metrics over untied pairs, `frac_tied_pairs`."""
    return metric_collection(
        {
            **on_policy_training_metrics(reward_names),
            "frac_tied_pairs": MeanMetric(**LOCAL),
            **{name: MeanMetric(**LOCAL) for name in DPO_PAIR_METRICS},
        }
    )
