"""The import contract of lit-rl's layers (../shared/DESIGN.md), checked on the source and in a fresh interpreter:
the math (`losses/`, `ops`) and the rewards import no Lightning, vLLM, DeepSpeed or transformers, the math imports
nothing of lit-rl's but its primitives, and no module below `algorithms/` imports an algorithm."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lit_rl"
HEAVY = ("lightning", "vllm", "deepspeed", "transformers")
PRIMITIVES = ("lit_rl.ops", "lit_rl.types", "lit_rl.errors", "lit_rl.importing", "lit_rl.losses")
ABOVE_ALGORITHMS = ("algorithms", "callbacks", "cli.py", "entry.py")


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """Every module `path` imports, anywhere in it: (line, module name, at module level). lit-rl imports by
    absolute name only, so that a scan like this one reads what a module depends on."""
    tree = ast.parse(path.read_text(), str(path))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import"
            found.append((node.lineno, node.module, id(node) in top_level))
    return found


def _files(*names: str) -> list[Path]:
    return [f for name in names for f in ([PACKAGE / name] if name.endswith(".py") else (PACKAGE / name).rglob("*.py"))]


def test_the_math_imports_no_framework_and_nothing_of_lit_rl_but_its_primitives():
    for path in _files("losses", "ops.py"):
        for line, module, _ in _imports(path):
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}"
            assert module.split(".")[0] not in HEAVY, where
            assert not module.startswith("lit_rl") or module.startswith(PRIMITIVES), where


def test_rewards_import_no_framework_at_module_level():
    # A reward model (`lit_rl.rewards.model`) loads transformers when it is built, never on import.
    for path in _files("rewards"):
        for line, module, top in _imports(path):
            heavy = module.split(".")[0] in HEAVY
            assert not heavy or (not top and module == "transformers"), f"{path.name}:{line} imports {module}"


def test_nothing_below_the_algorithms_imports_one():
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in ABOVE_ALGORITHMS:
            continue
        for line, module, _ in _imports(path):
            assert not module.startswith("lit_rl.algorithms"), f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"


def test_importing_the_math_and_the_rewards_loads_no_framework():
    code = (
        "import importlib, pkgutil, sys, lit_rl.ops, lit_rl.losses, lit_rl.rewards\n"
        "for package in (lit_rl.losses, lit_rl.rewards):\n"
        "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(info.name)\n"
        f"print(sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_the_scan_sees_the_imports_it_checks():
    # The scan itself finds module-level and function-level imports.
    source = PACKAGE / "losses" / "resolve.py"
    modules = {module for _, module, _ in _imports(source)}
    assert "lit_rl.importing" in modules or "lit_rl.errors" in modules
    late = PACKAGE / "rewards" / "model.py"
    assert ("transformers", False) in {(module, top) for _, module, top in _imports(late)}


def test_the_class_paths_saved_configs_and_checkpoints_name_still_import():
    import importlib

    import lit_rl.training.strategies

    for path in (
        "lit_rl.algorithms.GRPO",  # a checkpoint's and a config's model class_path
        "lit_rl.algorithms.DPO",
        "lit_rl.data.PromptDataModule",
        "lit_rl.callbacks.SaveHFPretrained",
        "lit_rl.rewards.arithmetic.correctness",
        "lit_rl.strategies.DeepSpeedStrategy",  # 0.1's, moved to lit_rl.training.strategies
    ):
        module, name = path.rsplit(".", 1)
        assert callable(getattr(importlib.import_module(module), name)), path
    assert (
        importlib.import_module("lit_rl.strategies").DeepSpeedStrategy is lit_rl.training.strategies.DeepSpeedStrategy
    )
