"""Data: built-in tasks, local files, DataModules and the rollout schedule loader."""

from lit_rl.data.files import load_rows, validate_rows
from lit_rl.data.modules import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_rl.data.schedule import RolloutSchedule, RolloutScheduleLoader

__all__ = [
    "PreferenceDataModule",
    "PromptDataModule",
    "RolloutSchedule",
    "RolloutScheduleLoader",
    "SFTDataModule",
    "load_rows",
    "validate_rows",
]
