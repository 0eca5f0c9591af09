"""The documentation: the docs site builds with `mkdocs build --strict` (a broken link or a missing page fails), every
page is in its navigation, and every link of the README leads to a file of the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

yaml = pytest.importorskip("yaml")


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("material")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "getting-started" / "index.html").exists()


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    in_nav = {page for entry in config["nav"] for page in entry.values()}
    assert in_nav == {path.name for path in (REPO / "docs").glob("*.md")}


def test_the_readmes_links_lead_to_files_of_the_repository():
    readme = (REPO / "README.md").read_text()
    links = [target for target in re.findall(r"\]\(([^)\s]+)\)", readme) if "://" not in target]
    assert len(links) >= 15  # the docs pages, the curves, ...
    for target in links:
        assert (REPO / target.split("#", 1)[0]).exists(), target


def test_the_config_reference_is_what_the_code_says():
    """docs/config-reference.md is generated from the signatures LightningCLI reads: it cannot drift."""
    result = subprocess.run(
        [sys.executable, str(REPO / "docs" / "config_reference.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "config-reference.md").read_text()
    for key in ("`model.sampling.temperature`", "`model.policy.lora.r`", "`model.rollout.engine`", "`data.train_data`"):
        assert key in page, key
    assert "| `model.temperature` | `model.sampling.temperature` |" in page


def test_the_metric_reference_is_what_the_metric_factories_declare():
    """docs/metric-reference.md is generated from the reductions the metric factories declare: it cannot drift."""
    result = subprocess.run(
        [sys.executable, str(REPO / "docs" / "metric_reference.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "metric-reference.md").read_text()
    for row in (
        "| `train/entropy` | mean per token, over ranks and micro-batches | always |",
        "| `train/rewards/chosen` | mean per pair, over ranks and micro-batches | always |",
        "| `val/loss` | mean per token, over ranks and validation batches | always |",
    ):
        assert row in page, row
    assert "not declared" not in page


def test_the_architecture_pages_walk_is_a_traced_grpo_step():
    """docs/architecture.md's walk is generated from one traced optimizer step of configs/grpo.yaml: it cannot
    drift from the code."""
    if sys.version_info < (3, 11):  # the trace names functions by `co_qualname`
        pytest.skip("the walk is traced on Python 3.11 and later")
    result = subprocess.run(
        [sys.executable, str(REPO / "docs" / "step_walk.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    walk = (REPO / "docs" / "architecture.md").read_text().split("from a traced step: do not edit it. -->", 1)[1]
    for entered in ("`lit_rl/data/schedule.py`", "\u21b3 `OnPolicyModule.training_step`", "`GRPO.micro_batch_loss`"):
        assert entered in walk, entered


def test_the_walks_calls_keep_the_layers_the_page_describes():
    """What the page's prose says of the traced step's calls between files (its table, which the test above holds
    to a new trace): no two files call each other both ways, no rollout part calls into the algorithms, and the
    algorithm (`grpo.py`) calls nothing of the skeleton (`on_policy.py`)."""
    walk = (REPO / "docs" / "architecture.md").read_text().split("from a traced step: do not edit it. -->", 1)[1]
    calls = {}  # (caller file, callee file) -> distinct calls
    for a, b, forth, back in re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| (\d+) \| (\d+) \|$", walk, re.MULTILINE):
        calls[a, b], calls[b, a] = int(forth), int(back)
        assert not (int(forth) and int(back)), f"{a} and {b} call each other both ways"
    assert len(calls) > 80  # the table was read (two directions of every pair)
    upward = [pair for pair, n in calls.items() if n and "/rollout/" in pair[0] and "/algorithms/" in pair[1]]
    assert not upward, f"rollout parts call into the algorithms: {upward}"
    assert calls["lit_rl/algorithms/on_policy.py", "lit_rl/algorithms/grpo.py"] > 0  # the hooks
    assert calls["lit_rl/algorithms/grpo.py", "lit_rl/algorithms/on_policy.py"] == 0


def test_the_formulas_page_is_what_the_losses_docstrings_say():
    """docs/formulas.md is generated from the docstrings of lit_rl/losses/: every objective and estimator on it."""
    result = subprocess.run(
        [sys.executable, str(REPO / "docs" / "formulas.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "formulas.md").read_text()
    from lit_rl.losses.advantages import ADVANTAGES
    from lit_rl.losses.policy import POLICY_LOSSES

    for name in [*POLICY_LOSSES, *ADVANTAGES, "dpo_loss", "gae", "aggregate", "rloo_loss"]:
        assert f"`{name}`" in page or f"{name} " in page, name


def _config_blocks() -> list[tuple[str, str]]:
    """(page, block) for each YAML block of the README and the docs pages that sets lit-rl fit's config keys."""
    blocks = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for block in re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S):
            text = textwrap.dedent(block)
            if set(yaml.safe_load(text) or {}) & {"model", "data", "trainer"}:
                blocks.append((page.name, text))
    return blocks


@pytest.mark.parametrize("page, block", _config_blocks(), ids=lambda value: value if value.endswith(".md") else "")
def test_every_config_snippet_of_the_docs_is_accepted_over_the_demo_config(tmp_path, page, block):
    """A reader copies a snippet onto `configs/grpo.yaml`: `lit-rl fit --print_config` must take it as printed (a key
    that moved since the page was written fails here, with the CLI's one line)."""
    snippet = tmp_path / "snippet.yaml"
    snippet.write_text(block)
    command = ["lit-rl", "fit", "--config", str(REPO / "configs" / "grpo.yaml"), "--config", str(snippet)]
    result = subprocess.run([*command, "--print_config"], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, f"{page}: {result.stderr.strip().splitlines()[-1:]}"
    assert yaml.safe_load(result.stdout)["model"]["class_path"] == "lit_rl.algorithms.GRPO"
