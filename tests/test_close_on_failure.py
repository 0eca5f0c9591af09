"""`ClosesRolloutsOnFailure`: a failed run closes its rollouts, unless a checkpoint callback saves on the exception;
a close that fails too is said in one line by the rank it failed on."""

from __future__ import annotations

from types import SimpleNamespace

from lightning.pytorch.callbacks import OnExceptionCheckpoint

from lit_rl.training.close_on_failure import ClosesRolloutsOnFailure


class _Producer:
    def __init__(self, fails: bool = False) -> None:
        self.closed, self.fails = 0, fails

    def close(self) -> None:
        self.closed += 1
        if self.fails:
            raise RuntimeError("the server\nwould not stop")


def _trainer(rank: int = 0, world_size: int = 1, callbacks: tuple = ()) -> SimpleNamespace:
    return SimpleNamespace(global_rank=rank, world_size=world_size, callbacks=list(callbacks))


def test_a_failed_run_closes_its_rollouts_unless_a_checkpoint_saves_on_the_exception(tmp_path):
    module = SimpleNamespace(producer=_Producer())
    ClosesRolloutsOnFailure().on_exception(_trainer(), module, RuntimeError("step failed"))
    assert module.producer.closed == 1
    saving = OnExceptionCheckpoint(dirpath=tmp_path)
    ClosesRolloutsOnFailure().on_exception(_trainer(callbacks=(saving,)), module, RuntimeError("step failed"))
    assert module.producer.closed == 1  # its checkpoint records the generations in flight: left open for it


def test_a_close_that_fails_is_said_by_the_rank_it_failed_on(capsys):
    module = SimpleNamespace(producer=_Producer(fails=True))
    ClosesRolloutsOnFailure().on_exception(_trainer(rank=1, world_size=2), module, RuntimeError("step failed"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["lit-rl: rank 1: closing the rollouts after the run's error failed too: RuntimeError: the server"]
    ClosesRolloutsOnFailure().on_exception(_trainer(), module, RuntimeError("step failed"))
    assert capsys.readouterr().err.startswith("lit-rl: closing the rollouts after the run's error failed too:")
