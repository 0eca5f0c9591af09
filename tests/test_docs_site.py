"""The documentation: the docs site builds with `mkdocs build --strict` (a broken link or a missing page fails), every
page is in its navigation, and every link of the README leads to a file of the repository."""

from __future__ import annotations

import os
import re
import subprocess
import sys

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
