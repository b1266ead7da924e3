"""Optional experiment trackers a run also logs to (`run.loggers`): TensorBoard and MLflow.

The driver feeds them the events its workers report, as it does the Prometheus gauges, so a
retried or resized run stays one TensorBoard run and one MLflow run. Each needs its package:
tensorboardX (what Ray's own TensorBoard logger writes with) and mlflow (or mlflow-skinny).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Protocol

from cs3ray.config import JobConfig, redact_config, to_yaml
from cs3ray.errors import UserError
from cs3ray.storage import PRIVATE_FILE, Storage, is_remote, makedirs_private

from .metrics import event_figures

log = logging.getLogger(__name__)
TENSORBOARD_DIR = "tensorboard"


class RunLogger(Protocol):
    def observe(self, event: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars in TensorBoard event files under <run dir>/tensorboard/ (copied there at the end for remote runs)."""

    def __init__(self, cfg: JobConfig, run: Storage) -> None:
        from tensorboardX import SummaryWriter

        self.run = run
        self._tmp = tempfile.mkdtemp(prefix="cs3-tb-") if is_remote(run.url) else None  # mkdtemp: 0700
        if self._tmp is None:
            # tensorboardX creates its files with the umask's mode: a 0700 folder keeps them the owner's,
            # and close() makes them 0600 as every file of a run.
            makedirs_private(run.path(TENSORBOARD_DIR))
        self.writer = SummaryWriter(self._tmp or run.path(TENSORBOARD_DIR), flush_secs=10)
        self.writer.add_text("config", "```yaml\n" + to_yaml(cfg) + "\n```", 0)

    def observe(self, event: dict[str, Any]) -> None:
        step = event.get("step")
        if not isinstance(step, int):
            return
        for key, value in event_figures(event).items():
            if key != "step":
                self.writer.add_scalar(f"cs3/{key}", value, step)

    def close(self) -> None:
        self.writer.close()
        if self._tmp is None:
            folder = self.run.path(TENSORBOARD_DIR)
            for name in os.listdir(folder):
                os.chmod(os.path.join(folder, name), PRIVATE_FILE)
        if self._tmp:
            for name in sorted(os.listdir(self._tmp)):
                with open(os.path.join(self._tmp, name), "rb") as f:
                    self.run.write_bytes(f.read(), TENSORBOARD_DIR, name)
            shutil.rmtree(self._tmp, ignore_errors=True)


class MlflowLogger:
    """One MLflow run per cs3ray run: the config (credentials masked) as parameters, the figures as metrics.

    A resumed run continues the MLflow run of the same name in the experiment rather than starting another.
    """

    def __init__(self, cfg: JobConfig) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(cfg.run.mlflow_experiment)
        found = mlflow.search_runs(filter_string=f"tags.mlflow.runName = '{cfg.run.name}'", max_results=1,
                                   output_format="list")
        if found:
            self.active = mlflow.start_run(run_id=found[0].info.run_id)
        else:
            self.active = mlflow.start_run(run_name=cfg.run.name)
            mlflow.log_params(_flat(redact_config(cfg.model_dump(mode="json"))))

    def observe(self, event: dict[str, Any]) -> None:
        step = event.get("step")
        figures = {k: v for k, v in event_figures(event).items() if k != "step"}
        if isinstance(step, int) and figures:
            self.mlflow.log_metrics(figures, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


PACKAGES = {"tensorboard": "tensorboardX", "mlflow": "mlflow"}


def check_loggers(cfg: JobConfig) -> None:
    """Before anything starts: every package `run.loggers` needs is installed (one clear error if not)."""
    import importlib.util

    for name in cfg.run.loggers:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise UserError(f"run.loggers names {name}, but {PACKAGES[name]} is not installed here "
                            f"(pip install {PACKAGES[name]})")


def open_loggers(cfg: JobConfig, run: Storage) -> list[RunLogger]:
    """The trackers `run.loggers` names, started; a tracker that cannot start is one clear error."""
    # MLflow retries an unreachable server for minutes by default; a wrong URI should fail in seconds.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    out: list[RunLogger] = []
    try:
        for name in cfg.run.loggers:
            out.append(TensorBoardLogger(cfg, run) if name == "tensorboard" else MlflowLogger(cfg))
    except Exception as exc:  # noqa: BLE001 - the tracker's own error, in one line
        close_loggers(out)
        raise UserError(f"run.loggers: cannot start {name} logging: {str(exc).splitlines()[0][:300]}") from None
    return out


def observe_all(loggers: list[RunLogger], event: dict[str, Any]) -> None:
    """Hand an event to each tracker; a tracker that fails mid-run is dropped with a warning, never the run."""
    for logger in list(loggers):
        try:
            logger.observe(event)
        except Exception as exc:  # noqa: BLE001 - logging must not stop training
            log.warning("%s logging stopped: %s", type(logger).__name__, str(exc).splitlines()[0][:300])
            loggers.remove(logger)


def close_loggers(loggers: list[RunLogger]) -> None:
    for logger in loggers:
        try:
            logger.close()
        except Exception as exc:  # noqa: BLE001 - the run itself is done
            log.warning("%s: could not close: %s", type(logger).__name__, str(exc).splitlines()[0][:300])


def _flat(data: Any, prefix: str = "") -> dict[str, str]:
    """Nested config as MLflow parameters: dotted keys, string values."""
    if isinstance(data, dict):
        out: dict[str, str] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(data)[:500]}
