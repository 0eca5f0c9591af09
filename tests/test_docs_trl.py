"""docs/coming-from-trl.md cannot drift: every TRL key it names is a field of TRL's config, every lit-rl key an
option lit-rl's CLI accepts, every named value one lit-rl accepts, every config file one that exists."""

from __future__ import annotations

import dataclasses
import inspect
import re

import lightning as L
import pytest

from lit_rl.algorithms import DPO, GRPO
from lit_rl.data import PreferenceDataModule, PromptDataModule
from lit_rl.losses import AGGREGATIONS
from lit_rl.rollout import HFGenerate, VLLMColocate, VLLMServer
from tests.conftest import REPO

trl = pytest.importorskip("trl")
PAGE = (REPO / "docs" / "coming-from-trl.md").read_text()
CODE = re.compile(r"`([^`]+)`")


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after `heading`."""
    section = PAGE.split(heading, 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # without the header and its rule


def _lit_rl_keys(cell: str) -> list[str]:
    return [m.split()[0] for m in CODE.findall(cell) if re.match(r"(model|data|trainer)\.\w", m)]


def _accepts(key: str, model: type, data: tuple[type, ...]) -> bool:
    group, name, *rest = key.split(".")
    if group == "model":
        parameters = inspect.signature(model).parameters
        if name not in parameters or not rest:
            return name in parameters
        if rest[:1] == ["engine"]:  # model.rollout.engine.<option>: an option of one of the engines
            engines = (HFGenerate, VLLMColocate, VLLMServer)
            return len(rest) == 1 or any(rest[1] in inspect.signature(engine).parameters for engine in engines)
        default = parameters[name].default  # a group: its field
        return dataclasses.is_dataclass(default) and rest[0] in {f.name for f in dataclasses.fields(default)}
    if group == "data":
        return any(name in inspect.signature(cls).parameters for cls in data)
    return name in inspect.signature(L.Trainer).parameters


@pytest.mark.parametrize(
    "heading, config, model, data",
    [
        ("## GRPO: `GRPOConfig` to lit-rl", trl.GRPOConfig, GRPO, (PromptDataModule,)),
        ("## DPO: `DPOConfig` to lit-rl", trl.DPOConfig, DPO, (PreferenceDataModule,)),
    ],
)
def test_every_key_named_exists_in_both_libraries(heading, config, model, data):
    fields = {f.name for f in dataclasses.fields(config)}
    rows = _table(heading)
    assert len(rows) >= 4
    checked = 0
    for trl_cell, lit_cell, *_ in rows:
        for name in CODE.findall(trl_cell):
            trainer_argument = re.fullmatch(r"(\w+Trainer)\((\w+)=\.\.\.\)", name)
            if trainer_argument:  # an argument of the trainer, not of its config
                cls, argument = getattr(trl, trainer_argument.group(1)), trainer_argument.group(2)
                assert argument in inspect.signature(cls).parameters, name
            else:
                assert name.split(":")[0].split("=")[0] in fields, f"TRL {config.__name__} has no {name!r}"
        for key in _lit_rl_keys(lit_cell):
            assert _accepts(key, model, data), f"lit-rl has no option {key!r}"
            checked += 1
        for path in re.findall(r"configs/[\w/]+\.yaml", lit_cell):
            assert (REPO / path).is_file(), path
        if "vllm_server.yaml" in lit_cell:
            assert (REPO / "configs" / "rollout" / "vllm_server.yaml").is_file()
    assert checked >= len(rows) - 3


def test_the_loss_types_map_to_values_lit_rl_accepts():
    from lit_rl.losses.policy import POLICY_LOSSES

    rows = _table("`loss_type` (how per-token losses")
    assert [CODE.findall(row[0])[0] for row in rows] == ["grpo", "dapo", "dr_grpo", "bnpo", "cispo"]
    for _, lit_cell in rows:
        for setting in CODE.findall(lit_cell):
            key, _, value = setting.partition(" ")
            allowed = {"model.loss.aggregation": AGGREGATIONS, "model.loss.objective": POLICY_LOSSES}.get(key)
            if allowed is not None:
                assert value in allowed, setting
