"""`lit_rl.strategies.DeepSpeedStrategy`, the class path configs saved by lit-rl 0.1 name: kept so that they still
load. The strategies live in `lit_rl.training.strategies`."""

from lit_rl.training.strategies import DeepSpeedStrategy

__all__ = ["DeepSpeedStrategy"]
