"""Write `docs/config-reference.md` from the code: every key of every algorithm, option group, data module and
callback, with its type, default and docstring, read from the signatures and dataclasses LightningCLI reads.

    python docs/config_reference.py            # rewrites docs/config-reference.md
    python docs/config_reference.py --check    # exit 1 when the committed page differs (tests/test_docs_site.py)
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any, Iterable

import docstring_parser
from generated_page import write_or_check  # noqa: E402  (docs/ is the script's own folder)

from lit_rl.algorithms import DPO, GRPO, PPO, RLOO, SFT, OnlineDPO
from lit_rl.callbacks import GracefulStop, NonFiniteGuard, RunSummary, SaveHFPretrained
from lit_rl.config import GROUP_NAMES, GROUPS, MOVED_KEYS
from lit_rl.data import PreferenceDataModule, PromptDataModule, SFTDataModule
from lit_rl.loss_config import LOSS_GROUPS
from lit_rl.modeling.lora import LoRAConfig
from lit_rl.rollout import HFGenerate, VLLMColocate, VLLMServer, WeightTransfer

PAGE = Path(__file__).resolve().parent / "config-reference.md"
ALGORITHMS = (GRPO, PPO, RLOO, OnlineDPO, DPO, SFT)
DATA_MODULES = (PromptDataModule, SFTDataModule, PreferenceDataModule)
CALLBACKS = (SaveHFPretrained, NonFiniteGuard, GracefulStop, RunSummary)
NESTED = (("model.policy.lora", LoRAConfig),)
ENGINES = (HFGenerate, VLLMColocate, VLLMServer)


def _docs(obj: Any) -> dict[str, str]:
    """Parameter name -> its docstring text on one line (the class's `Args:` section)."""
    parsed = docstring_parser.parse(inspect.getdoc(obj) or "")
    return {p.arg_name: " ".join((p.description or "").split()) for p in parsed.params}


def _summary(obj: Any) -> str:
    """The docstring's first paragraph, on one line."""
    return " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if dataclasses.is_dataclass(value):
        return f"{type(value).__name__}()"
    return repr(value) if isinstance(value, str) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: Iterable[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{key}` | `{_cell(kind)}` | `{_cell(default)}` | {_cell(doc)} |" for key, kind, default, doc in rows]
    return lines + [""]


def _parameters(cls: type) -> list[inspect.Parameter]:
    parameters = inspect.signature(cls.__init__).parameters.items()
    return [p for name, p in parameters if name not in ("self", "args", "kwargs")]


def _type(annotation: Any, owner: type) -> str:
    """An annotation as written; a named `Literal` of the owner's module (`TransferMethod`) as its values."""
    if isinstance(annotation, str):
        alias = getattr(sys.modules[owner.__module__], annotation, None)
        if typing.get_origin(alias) is typing.Literal:
            return f"Literal[{', '.join(repr(value) for value in typing.get_args(alias))}]"
        return annotation
    return getattr(annotation, "__name__", str(annotation))


def _class_rows(prefix: str, cls: type, skip: Iterable[str] = ()) -> list[tuple[str, str, str, str]]:
    docs = _docs(cls)
    return [
        (f"{prefix}.{p.name}", _type(p.annotation, cls), _value(p.default), docs.get(p.name, ""))
        for p in _parameters(cls)
        if p.name not in skip
    ]


def _dataclass_rows(prefix: str, cls: type) -> list[tuple[str, str, str, str]]:
    docs = _docs(cls)
    defaults = cls()
    return [
        (f"{prefix}.{f.name}", _type(f.type, cls), _value(getattr(defaults, f.name)), docs.get(f.name, ""))
        for f in dataclasses.fields(cls)
    ]


def _anchor(title: str) -> str:
    return title.lower().replace(" ", "-").replace(".", "")


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Every key `lit-rl fit` takes under `model`, `data` and the lit-rl callbacks, with its type, default and",
        "documentation. Generated from the code by `python docs/config_reference.py` (a test fails when this page and",
        "the code differ); `lit-rl fit --model.help GRPO` prints the same for one algorithm. Set a key in a config",
        "(`model: init_args: sampling: temperature: 0.7`) or on the command line (`--model.sampling.temperature 0.7`).",
        "",
        "## Algorithms",
        "",
        "Each algorithm takes some of the [option groups](#option-groups), listed with the defaults it gives them, and",
        "options of its own.",
        "",
    ]
    for cls in ALGORITHMS:
        params = _parameters(cls)
        groups = [p for p in params if p.name in GROUP_NAMES]
        out += [f"### {cls.__name__}", "", f"`--model {cls.__name__}`: {_summary(cls)}", ""]
        group_notes = []
        for p in groups:
            group_cls = type(p.default)  # the algorithm's own instance: its class (the loss's) and defaults
            changed = [
                f"`{f.name}: {_value(getattr(p.default, f.name))}`"
                for f in dataclasses.fields(group_cls)
                if getattr(p.default, f.name) != getattr(group_cls(), f.name)
            ]
            note = f" (here {', '.join(changed)})" if changed else ""
            anchor = group_cls.__name__.lower() if p.name == "loss" else f"model{p.name}"
            group_notes.append(f"[`{p.name}`](#{anchor}){note}")
        out += [f"Groups: {', '.join(group_notes)}.", ""]
        out += _table(_class_rows("model", cls, skip=GROUP_NAMES))
    out += ["## Option groups", ""]
    for name, cls in GROUPS.items():
        out += [f"### model.{name}", "", _summary(cls), ""]
        out += _table(_dataclass_rows(f"model.{name}", cls))
    out += [
        "## Loss groups",
        "",
        "`model.loss` holds the objective's options; its class is the algorithm's (`lit_rl.loss_config`), and names",
        "agree across algorithms where the meaning does (`beta`, `epsilon`, `epsilon_high`, `aggregation`).",
        "",
    ]
    for cls in LOSS_GROUPS:
        users = [a.__name__ for a in ALGORITHMS if type(_parameter_default(a, "loss")) is cls]
        out += [f"### {cls.__name__}", "", f"`model.loss` of {', '.join(users)}: {_summary(cls)}", ""]
        out += _table(_dataclass_rows("model.loss", cls))
    out += [
        "## Rollout engines",
        "",
        "`model.rollout.engine` is one of these classes (`--model.rollout.engine VLLMServer`), or the import path of",
        "a subclass of `lit_rl.rollout.EngineConfig`; its options follow it (`--model.rollout.engine.server_url ...`).",
        "",
    ]
    for cls in ENGINES:
        out += [f"### {cls.__name__}", "", f"`--model.rollout.engine {cls.__name__}`: {_summary(cls)}", ""]
        rows = _class_rows("model.rollout.engine", cls)
        out += _table(rows) if rows else ["No options.", ""]
    out += ["### model.rollout.engine.transfer", "", _summary(WeightTransfer), ""]
    out += _table(_dataclass_rows("model.rollout.engine.transfer", WeightTransfer))
    for prefix, cls in NESTED:
        out += [f"### {prefix}", "", _summary(cls), ""]
        out += _table(_dataclass_rows(prefix, cls))
    out += ["## Data modules", ""]
    for cls in DATA_MODULES:
        out += [f"### {cls.__name__}", "", f"`--data {cls.__name__}`: {_summary(cls)}", ""]
        out += _table(_class_rows("data", cls))
    out += [
        "## Callbacks",
        "",
        "`NonFiniteGuard`, `GracefulStop` and `RunSummary` run in every `lit-rl fit` with these defaults unless the",
        "config lists one; `SaveHFPretrained` runs where the config lists it (every shipped config does).",
        "",
    ]
    for cls in CALLBACKS:
        out += [f"### {cls.__name__}", "", _summary(cls), ""]
        out += _table(_class_rows(f"{cls.__name__}.init_args", cls))
    out += [
        "## Keys that moved in lit-rl 0.2",
        "",
        "lit-rl 0.1 took these keys flat under `model`; an old key stops a run in one line that names its new place,",
        "and `python -m lit_rl.migrate --in-place my.yaml` moves them in a config (keeping its comments). SFT keeps",
        "`model.max_prompt_length` as its own option (it truncates its data).",
        "",
        "| 0.1 | 0.2 |",
        "|---|---|",
    ]
    out += [f"| `model.{old}` | `model.{new}` |" for old, new in sorted(MOVED_KEYS.items())]
    return "\n".join(out) + "\n"


def _parameter_default(cls: type, name: str) -> Any:
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    return None if parameter is None else parameter.default


def main(argv: list[str] | None = None) -> None:
    write_or_check(PAGE, render, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
