"""`cs3 report`: a run's events as PNG plots (one per figure) and a markdown summary linking them."""

from __future__ import annotations

import io
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cs3ray.storage import Storage

from .runs_overview import RunRecord

REPORT_DIR = "report"
MARKDOWN = "report.md"
COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple")  # one per series; red is for restart markers


@dataclass
class Report:
    """What `write_report` wrote: the plots (file name -> title), the plots left out and why, the summary."""

    out: str
    plots: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"out": self.out, "markdown": MARKDOWN, "plots": self.plots, "skipped": self.skipped,
                "figures": self.figures}


Points = list[tuple[int, float]]


def _progress(record: RunRecord, key: str) -> Points:
    return [(int(e["step"]), float(e[key])) for e in record.of("progress")
            if isinstance(e.get(key), (int, float)) and math.isfinite(e[key])]


def _pieces(points: Points) -> list[Points]:
    """Split a series where its step goes back (a restore from an earlier checkpoint repeats steps)."""
    pieces: list[Points] = []
    for p in points:
        if not pieces or p[0] <= pieces[-1][-1][0]:
            pieces.append([])
        pieces[-1].append(p)
    return pieces


def cache_hit_rates(record: RunRecord) -> dict[str, Points]:
    """The reporting worker's hit rates so far at each progress event: L1 of its reads, L2 of the loads reaching disk.

    Cumulative per worker process: a log window often reads nothing (decoded shards are reused), so
    per-window rates would mostly be undefined. A new process (restart, resize) counts from zero.
    """
    out: dict[str, Points] = {"L1 (memory)": [], "L2 (disk)": []}
    for e in record.of("progress"):
        c = e.get("cache")
        if not isinstance(c, dict):
            continue
        for label, tier in (("L1 (memory)", "l1"), ("L2 (disk)", "l2")):
            hits, misses = c.get(f"{tier}_hits", 0), c.get(f"{tier}_misses", 0)
            if hits + misses:
                out[label].append((int(e["step"]), hits / (hits + misses)))
    return {k: v for k, v in out.items() if v}


def _figure() -> tuple[Any, Any]:
    # The object API with the Agg canvas: no pyplot state, no display, safe in any thread.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _markers(ax: Any, record: RunRecord) -> None:
    """Checkpoints as grey dotted lines, restores (restarts, resumes) as red dashed ones."""
    for i, e in enumerate(record.of("checkpoint")):
        ax.axvline(e["step"], color="0.6", linestyle=":", linewidth=1, label="checkpoint" if i == 0 else None)
    for i, e in enumerate(record.of("restored")):
        ax.axvline(e["step"], color="tab:red", linestyle="--", linewidth=1.5,
                   label="restart (restored)" if i == 0 else None)


def _plot(series: dict[str, Points], record: RunRecord, title: str, ylabel: str,
          ylim: tuple[float, float] | None = None) -> bytes:
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    for color, (label, points) in zip(COLOURS, series.items(), strict=False):
        for i, piece in enumerate(_pieces(points)):
            ax.plot([s for s, _ in piece], [v for _, v in piece], color=color, marker="o", markersize=3,
                    label=label if i == 0 else None)
    _markers(ax, record)
    ax.set_title(f"{record.name}: {title}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _loss(record: RunRecord) -> tuple[dict[str, Points], str]:
    val = [(int(e["step"]), float(e["val_loss"])) for e in record.of("eval")
           if isinstance(e.get("val_loss"), (int, float)) and math.isfinite(e["val_loss"])]
    return {"training loss": _progress(record, "loss"), "validation loss": val}, "no progress or eval events"


def _tokens(record: RunRecord) -> tuple[dict[str, Points], str]:
    return {"tokens/s (all workers)": _progress(record, "tokens_per_s")}, "no progress events"


def _mfu(record: RunRecord) -> tuple[dict[str, Points], str]:
    points = [(s, v) for s, v in _progress(record, "mfu") if v > 0]
    return {"MFU": points}, "no progress event has an MFU (no peak FLOPs known for the device)"


def _cache(record: RunRecord) -> tuple[dict[str, Points], str]:
    return cache_hit_rates(record), ("no cache counters in the progress events (runs fed by a Ray Dataset or "
                                     "with data.loader=ray_data count their cache reads in Ray Data tasks)")


# file -> (title, y label, y range or None, the data and why it may be missing)
PLOTS: dict[str, tuple[str, str, tuple[float, float] | None, Callable[[RunRecord], tuple[dict[str, Points], str]]]] = {
    "loss.png": ("loss and validation loss", "loss", None, _loss),
    "tokens_per_s.png": ("throughput", "tokens/s", None, _tokens),
    "mfu.png": ("model FLOPs utilisation", "MFU (0-1)", None, _mfu),
    "cache_hit_rate.png": ("shard cache hit rate (reporting worker, so far)", "hit rate", (0.0, 1.05), _cache),
}


def figures(record: RunRecord) -> dict[str, Any]:
    """The summary figures: summary.json's where the run wrote one, else what the events say."""
    s = record.summary or {}
    end = next((e for e in reversed(record.events) if e.get("event") == "end"), {})
    start = next((e for e in reversed(record.events) if e.get("event") == "start"), {})
    progress = record.of("progress")
    first = record.of("eval")[0].get("val_loss") if record.of("eval") else None
    return {
        "status": record.status,
        "steps": record.step, "total_steps": record.total_steps,
        "workers": s.get("workers", start.get("workers")), "precision": s.get("precision", start.get("precision")),
        "strategy": s.get("strategy", start.get("strategy")),
        "initial_val_loss": s.get("initial_val_loss", end.get("initial_val_loss", first)),
        "final_val_loss": s.get("final_val_loss", end.get("val_loss")), "best_val_loss": record.best_val_loss,
        "final_loss": s.get("final_loss", progress[-1].get("loss") if progress else None),
        "tokens_per_s": s.get("tokens_per_s"), "mfu": s.get("mfu"),
        "tokens_seen": s.get("tokens_seen", progress[-1].get("tokens_seen") if progress else None),
        "checkpoints": len(record.checkpoints), "newest_checkpoint": record.checkpoint_url(),
        "restores": len(record.of("restored")), "restarts": len(record.of("restart")), "wall_s": s.get("wall_s"),
    }


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def markdown(record: RunRecord, report: Report) -> str:
    """report.md: the summary figures as a table, then each plot (and the ones left out, with why)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.last_event_time or time.time()))
    lines = [f"# Run report: {record.name}", "", f"`{record.storage.url}`, last event {when}.", "",
             "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {_cell(v)} |" for k, v in report.figures.items()]
    if not record.summary:
        lines += ["", "No summary.json: the figures come from the events alone."]
    lines += ["", "## Plots", "", "Dotted grey lines mark checkpoints, dashed red lines restores (restarts, resumes).",
              ""]
    for name, title in report.plots.items():
        lines += [f"### {title}", "", f"![{title}]({name})", ""]
    restarts = record.of("restart")
    if restarts:
        lines += ["## Restarts", ""] + [f"- restart {e.get('attempt')}, training again from step {e.get('step')}: "
                                        f"{e.get('cause')}" for e in restarts] + [""]
    if report.skipped:
        lines += ["## Not plotted", ""] + [f"- {name}: {why}." for name, why in report.skipped.items()] + [""]
    return "\n".join(lines)


def write_report(record: RunRecord, out: Storage) -> Report:
    """Write the run's plots and report.md under `out`; a plot without data is left out and listed."""
    report = Report(out=out.url, figures=figures(record))
    for name, (title, ylabel, ylim, data) in PLOTS.items():
        series, why = data(record)
        series = {k: v for k, v in series.items() if v}
        if not series:
            report.skipped[name] = why
            continue
        out.write_bytes(_plot(series, record, title, ylabel, ylim), name)
        report.plots[name] = title
    out.write_text(markdown(record, report), MARKDOWN)
    return report
