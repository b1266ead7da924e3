"""`cs3 train`: run a job on an embedded local Ray cluster or an existing one."""

from __future__ import annotations

import json
from typing import Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .common import AddressOpt, JsonOpt, OverridesArg, console, err_console, fail, overrides_list, user_errors


class TrainProgress:
    """Rich progress for a run: shard preparation, then steps with loss, tokens/s and ETA."""

    def __init__(self, total_steps: int, enabled: bool) -> None:
        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"),
                            TimeRemainingColumn(), console=err_console, disable=not enabled)
        self.total = total_steps
        self.task = None
        self.prep = None
        self.val_loss: float | None = None

    def __enter__(self) -> "TrainProgress":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, e: dict[str, Any]) -> None:
        kind = e["event"]
        if kind == "prepare":
            if self.prep is None:
                self.prep = self.bar.add_task("preparing shards", total=e["total"], info="")
            self.bar.update(self.prep, completed=e["bytes"])
            return
        if self.task is None and kind in ("start", "eval", "progress"):
            if self.prep is not None:
                self.bar.update(self.prep, completed=self.bar.tasks[self.prep].total)
            self.task = self.bar.add_task("training", total=self.total, completed=e.get("step", 0),
                                          info="starting workers")
        if kind == "start":
            self.bar.console.print(f"{e['workers']} workers, {e['params']:,} parameters, "
                                   f"from step {e['step']} to {e['total_steps']}")
        elif kind == "eval":
            self.val_loss = e["val_loss"]
            self.bar.console.print(f"step {e['step']}: validation loss {e['val_loss']:.4f}")
        elif kind == "progress":
            info = f"loss {e['loss']:.3f}  {e['tokens_per_s']:,.0f} tok/s"
            self.bar.update(self.task, completed=e["step"], info=info)
        elif kind == "checkpoint":
            self.bar.console.print(f"checkpoint step {e['step']} -> {e['url']} ({e['seconds']:.1f}s)", markup=False)
        elif kind == "stopping":
            self.bar.console.print("stopping: taking a checkpoint (Ctrl-C again to abort)")
        elif kind == "restart":
            self.bar.console.print(f"restart {e['attempt']}: {e['cause']}", markup=False, highlight=False)
        elif kind == "preemption":
            from cs3ray.train.restarts import preemption_cause

            self.bar.console.print(f"{preemption_cause(e)}: taking a snapshot of the current step", markup=False,
                                   highlight=False)
        elif kind == "restored":
            self.bar.console.print(f"resumed from step {e['step']}")


@user_errors
def train_cmd(config: str = typer.Argument(..., help="YAML job config (see configs/)."),
              overrides: Optional[list[str]] = OverridesArg,
              name: Optional[str] = typer.Option(None, "--name", help="Run name (overrides run.name)."),
              resume: bool = typer.Option(False, "--resume", help="Continue the run from its newest checkpoint."),
              overwrite: bool = typer.Option(False, "--overwrite", help="Delete an existing run of this name first."),
              address: Optional[str] = AddressOpt,
              as_json: bool = JsonOpt,
              verbose: bool = typer.Option(False, "--verbose", "-v", help="Show Ray's and the workers' logs.")) -> None:
    """Train a model: prepare shards if needed, start the workers, checkpoint, summarise."""
    from cs3ray.config import load_config
    from cs3ray.train import TrainingError, train

    extra = overrides_list(overrides) + ([f"run.name={name}"] if name else [])
    cfg = load_config(config, extra)
    with TrainProgress(cfg.train.steps, enabled=not as_json) as progress:
        try:
            summary = train(cfg, resume=resume, overwrite=overwrite, address=address, on_event=progress,
                            quiet=not verbose)
        except TrainingError as exc:
            fail(f"training failed: {exc}", 1)
    if as_json:
        print(json.dumps(summary))
        return
    console.print(f"[bold]run {summary['run']}[/]: {summary['steps']} steps on {summary['workers']} workers, "
                  f"validation loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}, "
                  f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['wall_s']:.0f}s"
                  + (" (stopped early)" if summary["stopped_early"] else ""))
    console.print(f"checkpoint: {summary['checkpoint']}", markup=False, highlight=False)
