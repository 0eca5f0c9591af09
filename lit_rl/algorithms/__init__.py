"""One LightningModule per algorithm."""

from lit_rl.algorithms.dpo import DPO
from lit_rl.algorithms.grpo import GRPO
from lit_rl.algorithms.online_dpo import OnlineDPO
from lit_rl.algorithms.ppo import PPO
from lit_rl.algorithms.rloo import RLOO
from lit_rl.algorithms.sft import SFT

__all__ = ["DPO", "GRPO", "PPO", "RLOO", "SFT", "OnlineDPO"]
