"""What a data module and the algorithm it feeds use of each other, declared as protocols and checked with
`isinstance` once, where one first reaches for the other (nothing is read by attribute name):

- `PromptDataModule` feeds an algorithm that samples (`SchedulesRollouts`: its loader follows the algorithm's
  rollout schedule), which reads the rows back (`PromptRows`) for the checks it makes before training;
- `SFTDataModule` and `PreferenceDataModule` feed an algorithm that trains on fixed data (`CountsBatches`: the
  batches it has trained on, checkpointed, from which a resumed loader starts), SFT's regrouped by tokens one that
  counts a row's tokens as it will tokenize it (`CountsRowTokens`); DPO reads the pairs back (`PreferencePairs`),
  which the data module renders with DPO's own prompt encoder (`EncodesPrompts`). SFT's and DPO's data modules may
  cut batches by tokens (`BatchesByTokens`), which the algorithm reads to log the micro-batches' sizes, and its
  checkpoints keep their batch size (`FixedBatches`), the unit of the place in the data they count;
- every algorithm's checkpoints keep the data and the seed its order comes from (`OrderedData`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, TypeVar, runtime_checkable

from lit_rl.errors import ConfigError

if TYPE_CHECKING:
    from lit_rl.data.preference import TokenizedPair
    from lit_rl.data.schedule import RolloutSchedule
    from lit_rl.modeling.prompts import PromptEncoder


@runtime_checkable
class SchedulesRollouts(Protocol):
    """An algorithm that samples its completions (GRPO, PPO, RLOO, OnlineDPO)."""

    def rollout_schedule(self) -> RolloutSchedule: ...


@runtime_checkable
class CountsBatches(Protocol):
    """An algorithm that trains on fixed data (SFT, DPO): the training batches it has consumed, in its checkpoint."""

    train_batches_done: int


@runtime_checkable
class CountsRowTokens(Protocol):
    """An algorithm whose rows a loader regroups by tokens (SFT with `data.micro_batch_tokens`)."""

    def row_tokens(self, rows: list[dict[str, Any]]) -> list[int]: ...


@runtime_checkable
class EncodesPrompts(Protocol):
    """An algorithm whose prompts a data module renders as it does (DPO's pairs: `PreferenceDataModule`)."""

    prompt_encoder: PromptEncoder


@runtime_checkable
class BatchesByTokens(Protocol):
    """A data module that may cut its training batches by tokens (`data.micro_batch_tokens`: SFT's and DPO's)."""

    micro_batch_tokens: Optional[int]


@runtime_checkable
class FixedBatches(Protocol):
    """A data module whose training batches hold `data.batch_size` rows or pairs on each rank (SFT's and DPO's)."""

    batch_size: int


@runtime_checkable
class OrderedData(Protocol):
    """A data module whose training order is a function of its data and its seed (each of lit-rl's): a checkpoint's
    place in the data is a place in that order, which another data set or seed would move."""

    train_data: str
    seed: int


@runtime_checkable
class PromptRows(Protocol):
    """A data module of prompt rows (`PromptDataModule`): where they come from, and the rows."""

    train_data: str
    val_data: Optional[str]
    train_rows: list[dict[str, Any]]
    val_rows: list[dict[str, Any]]


@runtime_checkable
class PreferencePairs(Protocol):
    """A data module of tokenized preference pairs (`PreferenceDataModule`)."""

    train_pairs: list[TokenizedPair]
    val_pairs: list[TokenizedPair]
    batch_size: int


Contract = TypeVar("Contract")

# The data module each algorithm takes, and the shipped config that sets it.
DATA_MODULES = {
    "SFT": ("SFTDataModule", "configs/sft.yaml"),
    "DPO": ("PreferenceDataModule", "configs/dpo.yaml"),
}
SAMPLING = ("PromptDataModule", "configs/grpo.yaml")


def takes(module: Any) -> tuple[str, str]:
    """(the data module `module`'s algorithm takes, the shipped config that sets it), by the algorithm's classes (a
    subclass of DPO takes DPO's)."""
    for cls in type(module).__mro__:
        if cls.__name__ in DATA_MODULES:
            return DATA_MODULES[cls.__name__]
    return SAMPLING


def fed_algorithm(data_module: Any, module: Any, contract: type[Contract], feeds: str) -> Contract:
    """`module`, the algorithm `data_module` feeds, when it keeps `contract` and takes this data module; otherwise a
    one-line error saying what `data_module` feeds (`feeds`) and naming the data module the algorithm takes."""
    data_module_name, config = takes(module)
    fits = data_module_name in {cls.__name__ for cls in type(data_module).__mro__}
    if not (fits and isinstance(module, contract)):
        raise ConfigError(
            f"data: {type(data_module).__name__} feeds {feeds}; {type(module).__name__} takes {data_module_name}: "
            f"start from {config}"
        )
    return module


def data_of(module: Any, contract: type[Contract]) -> Contract:
    """The data module attached to `module`'s trainer, when it keeps `contract`; otherwise a one-line error."""
    data_module = module.trainer.datamodule
    if not isinstance(data_module, contract):
        name = type(data_module).__name__
        raise ConfigError(f"data: {type(module).__name__} reads its rows from a {takes(module)[0]}, not from {name}")
    return data_module
