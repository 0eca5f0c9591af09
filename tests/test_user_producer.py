"""`model.rollout.producer`: a user's producer, named by import path, replaces the one the run's settings choose."""

import sys

import pytest

from tests.conftest import FAST_GRPO, fit_config, train_rows

# A file beside the run, as a user writes one: a producer that keeps what it produced.
MY_PRODUCERS = '''
from lit_rl.rollout.producer import RolloutProducer


class Recording(RolloutProducer):
    """The synchronous producer, recording each generation it hands the module."""

    produced = []

    def generation(self, generation, rows, refills=None):
        scored = super().generation(generation, rows, refills)
        Recording.produced.append((generation, [row["prompt"] for row in rows], scored.rewards.tolist()))
        return scored
'''

SHORT = [*FAST_GRPO, "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0"]


@pytest.fixture
def beside_the_run(tmp_path, monkeypatch):
    (tmp_path / "recording_producers.py").write_text(MY_PRODUCERS)
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("recording_producers", None)  # this file's, not one another test of this process loaded
    yield tmp_path
    sys.modules.pop("recording_producers", None)


def test_a_users_producer_replaces_the_chosen_one_and_trains_the_same_numbers(beside_the_run):
    """`lit-rl fit --config configs/grpo.yaml --model.rollout.producer recording_producers.Recording`: the run's
    generations come from the user's class (a subclass of the synchronous producer that changes nothing), so it
    logs what the default producer logs, to the bit."""
    tmp_path = beside_the_run
    default = train_rows(fit_config(tmp_path, "default", "grpo.yaml", *SHORT))
    recording = ("--model.rollout.producer", "recording_producers.Recording")
    users = train_rows(fit_config(tmp_path, "users", "grpo.yaml", *SHORT, *recording))
    produced = sys.modules["recording_producers"].Recording.produced
    assert [generation for generation, _, _ in produced] == [0, 1]
    assert [rewards for _, _, rewards in produced] != [[], []] and all(len(p) == 8 for _, p, _ in produced)
    assert users == default
