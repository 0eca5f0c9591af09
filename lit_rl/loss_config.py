"""The `loss` group of each objective: its coefficients, clip ranges, advantage estimator and aggregation.

Each algorithm takes one of these as `loss` (`--model.loss.beta 0.04`, `--model.loss.aggregation token`). The
names agree across algorithms wherever the meaning does:
- `beta` is the weight of the KL term to the reference (GRPO, PPO, RLOO) or DPO's inverse temperature;
- `epsilon` is the clip range of the ratio, `[1 - epsilon, 1 + epsilon_high]`, with `epsilon_high` None meaning
  `epsilon` (TRL's convention; DAPO's clip-higher sets it larger);
- `aggregation` names how per-token losses become one number (`lit_rl.losses.aggregation`);
- `normalize_advantages` whitens the advantages over the whole generation, all ranks (`(A - mean) / std`), where
  GRPO's `scale_rewards` only divides by a standard deviation (its group mean is already subtracted).
The formulas are in `lit_rl.losses` and on the docs' formulas page.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lit_rl.errors import ConfigError
from lit_rl.losses.advantages import SCALE_REWARDS
from lit_rl.losses.aggregation import AGGREGATIONS
from lit_rl.losses.dpo import DPO_LOSSES


def _check_beta(beta: float) -> None:
    if beta < 0:
        raise ConfigError(f"model.loss.beta must be >= 0 (0 loads no reference model), got {beta}")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ConfigError(f"model.loss.aggregation must be one of {sorted(AGGREGATIONS)}, got {aggregation!r}")


# The clip range every clipped objective shares. Functions rather than a base class: jsonargparse expands a plain
# dataclass into its keys (`--model.loss.beta`), but takes a class with a base for a choice of subclasses.
def _clip_high(args) -> float:
    """The upper clip range: `epsilon_high`, or `epsilon` when it is None."""
    return args.epsilon if args.epsilon_high is None else args.epsilon_high


def _check_clip(args) -> None:
    if args.epsilon < 0 or (args.epsilon_high is not None and args.epsilon_high < 0):
        raise ConfigError("model.loss.epsilon and model.loss.epsilon_high must be >= 0")
    if _clip_high(args) < args.epsilon:
        raise ConfigError(
            f"model.loss.epsilon_high ({args.epsilon_high}) must be >= model.loss.epsilon ({args.epsilon}): "
            "clip-higher widens the upper range, never narrows it"
        )


@dataclass(frozen=True)
class GRPOLoss:
    """GRPO's objective: group-relative advantages, a clipped per-token surrogate and a per-token KL term.

    Args:
        beta: weight of the per-token k3 KL to a frozen reference model; 0 loads no reference model.
        epsilon: lower clip range of the ratio, `1 - epsilon` (and the upper one when `epsilon_high` is None).
        epsilon_high: upper clip range, `1 + epsilon_high` (DAPO's "clip-higher" when larger); None: `epsilon`.
        aggregation: `sequence` (GRPO paper), `token`, `constant` (Dr. GRPO) or `dapo`.
        scale_rewards: advantage scaling: `group` std, `batch` std, or `none` (Dr. GRPO).
        objective: the per-token objective (formulas in `lit_rl.losses.policy`): `ppo_clip` (PPO's clipped
            surrogate: GRPO, DAPO), `gspo` or `gspo_token` (GSPO's length-normalised sequence ratio; its paper clips
            at epsilon 3e-4 / 4e-4), `cispo` (CISPO: REINFORCE weighted by the clipped ratio, no token dropped), or
            the import path of a function with the same signature.
        advantage: the advantage estimator (formulas in `lit_rl.losses.advantages`): `group` (GRPO, scaled by
            `scale_rewards`), `rloo` (leave-one-out), `reinforce_pp` (REINFORCE++: global batch normalisation),
            `reinforce_pp_baseline` (group mean subtracted, then batch-normalised), or an import path.
        overlong_filter: truncated completions (no EOS within `max_new_tokens`) get no loss: their tokens leave the
            policy and KL terms and the loss denominators (DAPO's overlong filtering). Metrics still count them.
        overlong_buffer: DAPO's soft overlong punishment: completions longer than `max_new_tokens - overlong_buffer`
            tokens lose up to `overlong_penalty` reward, linearly (`lit_rl.losses.overlong`); 0 (default): off.
            `train/reward` includes the penalty, `train/rewards/<fn>` are the functions' own values.
        overlong_penalty: the largest penalty, at `max_new_tokens` tokens.
    """

    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    aggregation: str = "sequence"
    scale_rewards: str = "group"
    objective: str = "ppo_clip"
    advantage: str = "group"
    overlong_filter: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    clip_high = property(_clip_high)

    def check(self, max_new_tokens: int) -> None:
        _check_beta(self.beta)
        _check_clip(self)
        _check_aggregation(self.aggregation)
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(
                f"model.loss.scale_rewards must be one of {list(SCALE_REWARDS)}, got {self.scale_rewards!r}"
            )
        if not 0 <= self.overlong_buffer <= max_new_tokens:
            raise ConfigError(
                f"model.loss.overlong_buffer must be in [0, model.sampling.max_new_tokens={max_new_tokens}], "
                f"got {self.overlong_buffer}"
            )


@dataclass(frozen=True)
class PPOLoss:
    """PPO's objective: GAE advantages from a critic, the clipped per-token surrogate and a clipped value loss.

    Args:
        beta: per-token KL penalty in the reward, `r_t = -beta (logp_t - ref_logp_t)` (+ the reward at the last
            token); 0 loads no reference model.
        epsilon: lower clip range of the per-token ratio, `1 - epsilon` (and the upper one when `epsilon_high` is
            None).
        epsilon_high: upper clip range, `1 + epsilon_high`; None: `epsilon`.
        aggregation: how per-token losses become one number (`lit_rl.losses.aggregation`): `token` (default),
            `sequence`, `constant` or `dapo`.
        normalize_advantages: whiten the advantages over every real token of the generation (all ranks).
        gamma: GAE discount.
        lam: GAE lambda (1: Monte-Carlo returns minus the critic's value; 0: one-step TD errors).
        value_clip: c, how far the critic's values may move from their sampling-time values before the clipped
            error takes over (None: the plain squared error).
        value_loss_coef: weight of the value loss in the one loss both networks train on (it matters through
            `gradient_clip_val` only: the learning rates set each network's step).
    """

    beta: float = 0.05
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    aggregation: str = "token"
    normalize_advantages: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: Optional[float] = 0.2
    value_loss_coef: float = 0.1

    clip_high = property(_clip_high)

    def check(self) -> None:
        _check_beta(self.beta)
        _check_clip(self)
        _check_aggregation(self.aggregation)
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"model.loss.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.value_clip is not None and self.value_clip <= 0:
            raise ConfigError(f"model.loss.value_clip must be > 0 (or null: no clipping), got {self.value_clip}")
        if self.value_loss_coef < 0:
            raise ConfigError(f"model.loss.value_loss_coef must be >= 0, got {self.value_loss_coef}")


@dataclass(frozen=True)
class RLOOLoss:
    """RLOO's objective: leave-one-out advantages of KL-penalised rewards and a clipped sequence-level ratio.

    Args:
        beta: KL penalty in the reward, `r - beta * sum_t (logp - ref_logp)`; 0 loads no reference model.
        epsilon: lower clip range of the sequence-level ratio, `1 - epsilon` (and the upper one when
            `epsilon_high` is None).
        epsilon_high: upper clip range, `1 + epsilon_high`; None: `epsilon`.
        normalize_advantages: whiten the advantages over the whole generation batch (all ranks).
    """

    beta: float = 0.05
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    normalize_advantages: bool = False

    clip_high = property(_clip_high)

    def check(self) -> None:
        _check_beta(self.beta)
        _check_clip(self)


# The DPO losses that read `label_smoothing` (`lit_rl.losses.dpo.dpo_loss`): the others have no label to smooth.
SMOOTHED_DPO_LOSSES = ("sigmoid", "robust", "simpo")


@dataclass(frozen=True)
class DPOLoss:
    """The DPO family's objective on preference pairs (`lit_rl.losses.dpo`), for DPO and Online DPO.

    Args:
        type: `sigmoid` (DPO), `robust`, `hinge` (SLiC), `ipo`, `apo_zero`, or `simpo` (reference-free; DPO only).
        beta: inverse temperature of the implicit reward `beta * (logp - ref_logp)`.
        label_smoothing: probability that a preference label is flipped (cDPO / robust DPO; `sigmoid`, `robust`
            and `simpo` only).
        simpo_gamma: target reward margin of SimPO.
    """

    type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def check(self, allowed: tuple[str, ...] = DPO_LOSSES) -> None:
        """`allowed`: the loss types the algorithm takes (Online DPO has no reference-free one)."""
        if self.type not in allowed:
            raise ConfigError(f"model.loss.type must be one of {list(allowed)}, got {self.type!r}")
        if self.beta <= 0:
            raise ConfigError(f"model.loss.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"model.loss.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.type not in SMOOTHED_DPO_LOSSES:
            raise ConfigError(
                f"model.loss.label_smoothing={self.label_smoothing}: model.loss.type {self.type!r} has no label "
                f"smoothing (only {', '.join(SMOOTHED_DPO_LOSSES)}): leave it at 0"
            )


# Every objective's group; an algorithm names one as its `loss` argument.
LOSS_GROUPS: tuple[type, ...] = (GRPOLoss, PPOLoss, RLOOLoss, DPOLoss)
