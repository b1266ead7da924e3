"""Structured logs (`run.log_format: json`): one JSON object per line from the driver, every worker and replica.

Ray's structured logging does the encoding: `ray.LoggingConfig(encoding="JSON")` for the job's processes,
its JSONFormatter and CoreContextFilter (job_id, node_id, worker_id, actor_id) in the files written here,
Serve's `LoggingConfig(encoding="JSON")` for replicas. `RunContextFilter` adds what only cs3ray knows:
the run, the rank and the step, with an ISO 8601 `timestamp`, the `level` and the node's IP (`node`) for
an index. The driver and each training worker write their own file under Ray's log folder,
`logs/cs3/<role>-<run>-<pid>.log`, rotated as Ray rotates its own (RAY_ROTATION_MAX_BYTES,
RAY_ROTATION_BACKUP_COUNT); replicas write Serve's replica files (logs/serve/), rotated the same way.
deploy/logging/ ships these files to Elasticsearch / OpenSearch.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import logging.handlers
import os
from typing import Any, Iterator

from cs3ray.config.redact import redact_value

LOG_DIR = "cs3"  # under the Ray session's logs/ folder
# The run's own lines (progress, checkpoints, restores): only in the JSON files, never on a console, so
# `cs3 train` prints as it always did and text mode writes nothing new.
RUN_LOGGER = "cs3ray.run"
# Standard record attributes Ray's JSON formatter leaves out unless asked: the logger's name.
EXTRA_STANDARD_ATTRS = ["name"]
FIELDS = ("timestamp", "level", "run", "job_id", "node", "rank", "step", "message")  # every line has them

run_log = logging.getLogger(RUN_LOGGER)
run_log.propagate = False
run_log.addHandler(logging.NullHandler())  # text mode: nowhere (not Python's last-resort stderr handler)
run_log.setLevel(logging.INFO)


class RunContext:
    """This process's run, rank and step: one rank per process, read by every thread's log records."""

    run: str | None = None
    rank: int | None = None
    step: int | None = None


def set_step(step: int | None) -> None:
    """The step the records logged from now on belong to (a worker's training step, a replica's checkpoint)."""
    RunContext.step = step


class RunContextFilter(logging.Filter):
    """Adds run, rank, step, timestamp (ISO 8601 in UTC, e.g. 2026-01-31T12:00:00.123Z), level and node (IP) to every record it passes.

    A record's own `extra` values win: the driver logs each worker event with that event's step.
    """

    _node: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        values = {"run": RunContext.run, "rank": RunContext.rank, "step": RunContext.step,
                  # UTC with a Z: what deploy/logging's parser (Time_Format) and an index's date field read.
                  "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                  .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                  "level": record.levelname, "node": self.node(),
                  "job_id": None}  # Ray's context filter sets it in a Ray process (before this one, or over it)
        for key, value in values.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True

    @classmethod
    def node(cls) -> str | None:
        if cls._node is None:
            try:
                import ray

                cls._node = ray.util.get_node_ip_address() if ray.is_initialized() else None
            except Exception:  # noqa: BLE001 - a record without the node beats a lost record
                return None
        return cls._node


def ray_logging_config(log_format: str) -> Any:
    """Ray's job-wide logging config for `ray.init(logging_config=...)`: JSON for every process of the job."""
    if log_format != "json":
        return None
    import ray

    return ray.LoggingConfig(encoding="JSON", additional_log_standard_attrs=EXTRA_STANDARD_ATTRS)


def serve_logging_config(log_format: str) -> dict[str, Any] | None:
    """Serve's per-deployment logging config (`logging_config=`): replica files in JSON."""
    if log_format != "json":
        return None
    return {"encoding": "JSON", "additional_log_standard_attrs": EXTRA_STANDARD_ATTRS}


def rotation() -> tuple[int, int]:
    """Ray's rotation of its log files, (max bytes, backups): RAY_ROTATION_MAX_BYTES, RAY_ROTATION_BACKUP_COUNT."""
    import ray

    node = ray._private.worker._global_node  # what Serve's replica files rotate by, too
    if node is not None:
        return node.max_bytes, node.backup_count
    from ray._common.ray_constants import LOGGING_ROTATE_BACKUP_COUNT, LOGGING_ROTATE_BYTES

    return (int(os.environ.get("RAY_ROTATION_MAX_BYTES", LOGGING_ROTATE_BYTES)),
            int(os.environ.get("RAY_ROTATION_BACKUP_COUNT", LOGGING_ROTATE_BACKUP_COUNT)))


def logs_dir() -> str | None:
    """This node's folder of cs3ray's JSON logs: logs/cs3/ in the Ray session this process belongs to (None for
    a Ray Client driver, which has no session folder of its own)."""
    import ray

    node = ray._private.worker._global_node
    return None if node is None else os.path.join(node.get_logs_dir_path(), LOG_DIR)


def json_handler(path: str) -> logging.Handler:
    """A rotating file handler of JSON lines with Ray's formatter and context, and the run's."""
    from ray._common.filters import CoreContextFilter
    from ray._common.formatters import JSONFormatter

    max_bytes, backups = rotation()
    handler = logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups)
    formatter = JSONFormatter()
    formatter.set_additional_log_standard_attrs(EXTRA_STANDARD_ATTRS)
    handler.setFormatter(formatter)
    handler.addFilter(CoreContextFilter())
    handler.addFilter(RunContextFilter())
    return handler


def add_context(logger: logging.Logger) -> None:
    """Put the run's fields on the lines `logger`'s own handlers write (Ray's JSON console, Ray Train's files)."""
    for handler in logger.handlers:
        if not any(isinstance(f, RunContextFilter) for f in handler.filters):
            handler.addFilter(RunContextFilter())


@contextlib.contextmanager
def process_logs(log_format: str, role: str, run: str, rank: int | None = None) -> Iterator[str | None]:
    """With json: this process's records (the root logger's and the run's own) also go, as JSON lines, to
    logs/cs3/<role>-<run>-<pid>.log; yields that path (None in text mode, where nothing changes)."""
    if log_format != "json":
        yield None
        return
    RunContext.run, RunContext.rank, RunContext.step = run, rank, None
    folder = logs_dir()
    if folder is None:
        logging.getLogger(__name__).warning("no Ray session folder in this process (Ray Client): its JSON log "
                                            "is not written; the workers' are.")
        yield None
        return
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{role}-{run}-{os.getpid()}.log")
    handler = json_handler(path)
    root = logging.getLogger()
    saved_level = root.level
    if saved_level > logging.INFO:  # the root's default, WARNING, would drop the run's INFO lines
        root.setLevel(logging.INFO)
    root.addHandler(handler)
    run_log.addHandler(handler)
    # Ray Train's own JSON files in a worker (logs/train/) and Ray's JSON console carry the fields too.
    add_context(root)
    add_context(logging.getLogger("ray.train"))
    try:
        yield path
    finally:
        root.removeHandler(handler)
        run_log.removeHandler(handler)
        root.setLevel(saved_level)
        handler.close()
        RunContext.run = RunContext.rank = RunContext.step = None


def replica_logs(run: str, step: int) -> None:
    """In a Serve replica deployed with `serve_logging_config("json")`: the run's fields on Serve's JSON
    replica file, and cs3ray's own records in it too (they would otherwise go to the process's stderr)."""
    from ray import serve

    RunContext.run, RunContext.step = run, step
    try:
        rank = serve.get_replica_context().rank
        RunContext.rank = rank if isinstance(rank, int) else rank.rank
    except Exception:  # noqa: BLE001 - a Serve without replica ranks: the replica id is in the lines anyway
        RunContext.rank = None
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addFilter(RunContextFilter())  # records Serve logs itself, should it reconfigure its handlers
    add_context(serve_logger)

    class ToServe(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            serve_logger.handle(record)

    for name in ("cs3ray", RUN_LOGGER):
        logger = logging.getLogger(name)
        logger.addHandler(ToServe())
        logger.propagate = False
        logger.setLevel(logging.INFO)


def event_message(event: dict[str, Any]) -> str:
    """One line for a worker event: its kind and scalar fields (`progress step=10 loss=3.2153 ...`)."""
    skip = ("event", "wall", "time")
    fields = " ".join(f"{k}={round(v, 4) if isinstance(v, float) else redact_value(v)}" for k, v in event.items()
                      if k not in skip and (v is None or isinstance(v, (int, float, str, bool))))
    return f"{event.get('event', 'event')} {fields}".strip()
