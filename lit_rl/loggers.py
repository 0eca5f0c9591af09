"""Loggers Lightning does not ship: Trackio (the tracker TRL's `report_to="trackio"` writes to).

    lit-rl fit --config configs/grpo.yaml --trainer.logger lit_rl.loggers.TrackioLogger \
        --trainer.logger.project my-project            # pip install -e ".[trackio]"; `trackio show` to look

Like every Lightning logger it receives each optimizer step's metrics once, from rank 0 (the values are already
global: `lit_rl/training/metrics.py`).
"""

from __future__ import annotations

import dataclasses
import time
from argparse import Namespace
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from lightning.pytorch.loggers.logger import Logger, rank_zero_experiment
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_rl.errors import refuse_unwritable_folder


class TrackioLogger(Logger):
    """Logs to a Trackio project: locally (`$TRACKIO_DIR`, default `~/.cache/huggingface/trackio`), or to a
    Hugging Face Space when `space_id` is given.

    Args:
        project: the Trackio project; runs of one project are compared in its dashboard.
        name: the run's name; None: `<project>-<date>-<time>`. The run's checkpoints, config and export go to
            `<save_dir>/<project>/<name>/`.
        group: a group of runs inside the project.
        space_id: a Space (`owner/name`) to log to instead of the local database.
        resume: Trackio's `resume` ("never", "allow", "must"): "allow" continues the run called `name`.
        save_dir: where lit-rl writes the run's files (Trackio's own data is in `$TRACKIO_DIR`).
    """

    def __init__(
        self,
        project: str = "lit-rl",
        name: Optional[str] = None,
        group: Optional[str] = None,
        space_id: Optional[str] = None,
        resume: str = "never",
        save_dir: str = "runs",
    ) -> None:
        super().__init__()
        import trackio  # noqa: F401  (fail here, where the CLI names the extra that installs it)

        if space_id is None:  # Trackio itself only warns, at its first write, and the run's metrics are lost
            from trackio.utils import TRACKIO_DIR

            refuse_unwritable_folder(Path(TRACKIO_DIR), "Trackio's database ($TRACKIO_DIR)")

        self._project = project
        # Named now, not by Trackio when the run starts on rank 0: the run directory must be known on every rank
        # before training starts (Lightning lays out checkpoints as `<save_dir>/<name>/<version>`).
        self._run_name = name or f"{project}-{time.strftime('%Y%m%d-%H%M%S')}"
        self._save_dir = save_dir
        self._group = group
        self._space_id = space_id
        self._resume = resume
        self._config: dict[str, Any] = {}
        self._run: Any = None

    @property
    def name(self) -> str:
        return self._project

    @property
    def version(self) -> str:
        return self._run_name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The Trackio run, started on first use with the hyperparameters logged so far as its config."""
        if self._run is None:
            import trackio

            self._run = trackio.init(
                project=self._project,
                name=self._run_name,
                group=self._group,
                space_id=self._space_id,
                resume=self._resume,
                config=dict(self._config),
                embed=False,
            )
        return self._run

    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace], *args: Any, **kwargs: Any) -> None:
        values = vars(params) if isinstance(params, Namespace) else dict(params)
        self._config.update({key: _loggable(value) for key, value in values.items()})
        if self._run is not None and isinstance(getattr(self._run, "config", None), dict):
            self._run.config.update(self._config)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        self.experiment.log({key: float(value) for key, value in metrics.items()}, step=step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _loggable(value: Any) -> Any:
    """A hyperparameter as Trackio's config can store it (numbers, strings, lists and dicts of them)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # an option group of a module built in Python
        value = dataclasses.asdict(value)
    if isinstance(value, Mapping):
        return {str(k): _loggable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_loggable(v) for v in value]
    return str(value)
