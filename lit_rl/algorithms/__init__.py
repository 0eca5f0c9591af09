"""One LightningModule per algorithm."""

from lit_rl.algorithms.grpo import GRPO
from lit_rl.algorithms.sft import SFT

__all__ = ["GRPO", "SFT"]
