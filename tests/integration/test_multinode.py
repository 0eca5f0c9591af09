"""Two "nodes" on localhost: two launches of `lit-rl fit --trainer.num_nodes 2`, one process each, with Lightning's
own launcher (`NODE_RANK` 0 and 1, a loopback `MASTER_ADDR`) or with torchrun. They must log the numbers of 1 node x
2 processes, save checkpoints at exactly N, 2N, ... and resume from one to the same numbers (the launch scripts for
real clusters are `configs/launch/`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lit_rl.rollout.server.client import free_port
from tests.conftest import (
    CLI_COMMAND,
    CONFIGS,
    FAST_GRPO,
    assert_rows_match,
    cli_env,
    fit_in_subprocess,
    saved_steps,
    train_rows,
    without_engine_gap,
    write_overlay,
)

pytestmark = pytest.mark.slow

COMMON = [
    *FAST_GRPO,
    "--model.schedule.micro_batch_size",
    "4",
    "--model.loss.beta",
    "0.04",
    "--model.optim.learning_rate",
    "1e-3",
    "--trainer.accumulate_grad_batches",
    "2",
    "--trainer.limit_val_batches",
    "0",
    "--trainer.strategy",
    "ddp",
]


def _two_nodes(tmp_path: Path, name: str, launcher: str, *args: str) -> Path:
    """Both "nodes" of one run, launched as a cluster's launcher would on each machine: `lightning` (Lightning's own
    environment: `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`) or `torchrun` (its static rendezvous, one process per
    node); the run's log directory."""
    overlay = write_overlay(tmp_path / f"{name}.yaml", every_n_train_steps=2, save_dir=tmp_path / name)
    cli = ["fit", "--config", str(CONFIGS / "grpo.yaml"), "--config", str(overlay), *COMMON]
    cli += ["--trainer.num_nodes", "2", "--trainer.devices", "1", *args]
    port = str(free_port())
    commands, envs = [], []
    for rank in (0, 1):
        if launcher == "torchrun":
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            torchrun += ["--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port]
            commands.append([*torchrun, "-m", "lit_rl.cli", *cli])
            envs.append(cli_env())
        else:
            commands.append([*CLI_COMMAND, *cli])
            envs.append({**cli_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(rank)})
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command, env in zip(commands, envs)
    ]
    for rank, node in enumerate(nodes):
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, f"node {rank}: {err[-3000:]}"
    return tmp_path / name / "run" / "version_0"


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """1 node x 2 processes: the numbers every 2-node run must log."""
    tmp_path = tmp_path_factory.mktemp("one_node")
    log_dir = fit_in_subprocess(
        tmp_path, "one_node", "grpo.yaml", *COMMON, "--trainer.devices", "2", "--trainer.max_steps", "4"
    )
    rows = without_engine_gap(train_rows(log_dir))
    assert [row["step"] for row in rows] == [1, 2, 3, 4] and rows[-1]["train/kl"] > 0
    return rows


def test_two_nodes_log_one_nodes_numbers_keep_the_cadence_and_resume(tmp_path, one_node):
    two_nodes = _two_nodes(tmp_path, "two_nodes", "lightning", "--trainer.max_steps", "4")
    assert saved_steps(two_nodes) == [2, 4]
    assert_rows_match(without_engine_gap(train_rows(two_nodes)), one_node, rel=1e-5, abs=1e-6)

    checkpoint = str(two_nodes / "checkpoints" / "step=2.ckpt")
    resumed = _two_nodes(tmp_path, "resumed", "lightning", "--trainer.max_steps", "4", "--ckpt_path", checkpoint)
    assert saved_steps(resumed) == [4]
    rows = without_engine_gap(train_rows(resumed))
    assert [row["step"] for row in rows] == [3, 4]
    assert_rows_match(rows, one_node, rel=1e-5, abs=1e-6)


def test_two_torchrun_nodes_log_one_nodes_numbers(tmp_path, one_node):
    log_dir = _two_nodes(tmp_path, "torchrun", "torchrun", "--trainer.max_steps", "4")
    assert saved_steps(log_dir) == [2, 4]
    assert_rows_match(without_engine_gap(train_rows(log_dir)), one_node, rel=1e-5, abs=1e-6)
