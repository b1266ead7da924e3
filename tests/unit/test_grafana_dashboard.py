"""deploy/grafana/cs3ray.json: a well-formed Grafana dashboard whose queries name only metrics cs3ray exports,
and every one of them (tests/integration/test_metrics.py and test_serve.py see them on Ray's endpoint), each
read as its Prometheus type asks: counters through rate()/increase(), histograms through histogram_quantile()
of their buckets' rate, never a raw cumulative series."""

from __future__ import annotations

import json
import re

import pytest

from cs3ray.data.cache.node_metrics import COUNTERS as CACHE_COUNTERS
from cs3ray.ops.metrics import TRAIN_METRICS
from cs3ray.serve.metrics import SERVE_METRICS

from conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "cs3ray.json"
# What each Prometheus type adds to a name on the endpoint (Ray adds the "ray_" prefix to all).
SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict[str, str]:
    """Every series name cs3ray puts on Ray's endpoint -> the metric it belongs to."""
    metrics = {f"cs3_train_{k}": kind for k, (kind, _) in TRAIN_METRICS.items()}
    metrics |= {name: "counter" for name, _ in CACHE_COUNTERS.values()}
    metrics |= {name: kind for name, (kind, _) in SERVE_METRICS.items()}
    return {f"ray_{name}{suffix}": name for name, kind in metrics.items() for suffix in SUFFIXES[kind]}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_structure_is_a_grafana_dashboard(dashboard):
    assert {"title", "uid", "schemaVersion", "panels", "templating", "time"} <= dashboard.keys()
    assert isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in dashboard["panels"]:
        assert p["type"] in ("row", "timeseries", "stat") and p["title"]
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh") and g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
    for expr in queries(dashboard):  # every $variable a query uses is defined (or one of Grafana's, $__...)
        assert {v for v in re.findall(r"\$(\w+)", expr) if not v.startswith("__")} <= variables.keys(), expr
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_queries_name_only_exported_metrics_and_all_of_them(dashboard):
    series = exported()
    named = {m for expr in queries(dashboard) for m in re.findall(r"\bray_cs3_\w+", expr)}
    named.update(re.findall(r"\bray_cs3_\w+", json.dumps(dashboard["templating"])))
    assert named <= series.keys(), sorted(named - series.keys())
    # Histograms are read through their buckets (quantiles) or counts; every metric is on a panel,
    # except the cache's misses and evictions (reads by tier show the same).
    covered = {series[m] for m in named}
    left = {name for name in series.values()} - covered
    assert all(re.fullmatch(r"cs3_cache_(l[12]_(misses|evictions)|l2_corrupt|prefetched)", n) for n in left), left


CUMULATIVE = re.compile(r"\b[a-zA-Z_:][\w:]*_(total|count|sum|bucket)\b")
GAUGE = re.compile(r"\bray_cs3_\w+")


def enclosing_calls(expr: str, at: int) -> list[str]:
    """The functions (or aggregations: sum, ...) whose parentheses hold position `at`, innermost first."""
    calls, depth = [], 0
    for i in range(at - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            name = re.search(r"(\w*)\s*(?:by|without)?\s*(?:\([^()]*\))?\s*$", expr[:i]).group(1)
            calls.append(name)
    return calls


def misread_series(expr: str) -> list[str]:
    """What a query plots wrongly: a cumulative series (a counter's _total, a histogram's _count, _sum or
    _bucket) outside rate()/increase(), buckets outside histogram_quantile(), or the rate of a gauge."""
    out = []
    for m in CUMULATIVE.finditer(expr):
        calls = enclosing_calls(expr, m.start())
        if not calls or calls[0] not in ("rate", "increase", "irate"):
            out.append(f"{m.group()} plotted raw")
        elif m.group(1) == "bucket" and "histogram_quantile" not in calls:
            out.append(f"{m.group()} outside histogram_quantile")
    for m in GAUGE.finditer(expr):
        if not CUMULATIVE.fullmatch(m.group()) and set(enclosing_calls(expr, m.start())[:1]) & {"rate", "increase", "irate"}:
            out.append(f"rate of the gauge {m.group()}")
    return out


def test_no_panel_plots_a_raw_counter_or_histogram(dashboard):
    wrong = {expr: misread_series(expr) for expr in queries(dashboard) if misread_series(expr)}
    assert not wrong, wrong


@pytest.mark.parametrize("expr, problem", [
    ("ray_cs3_train_tokens_total", "plotted raw"),
    ('sum by (node) (ray_cs3_cache_l1_hits_total{run=~"$run"})', "plotted raw"),
    ("rate(ray_cs3_serve_ttft_seconds_sum[1m]) / ray_cs3_serve_ttft_seconds_count", "plotted raw"),
    ("sum by (le) (rate(ray_cs3_train_step_seconds_bucket[5m]))", "outside histogram_quantile"),
    ("rate(ray_cs3_train_loss[5m])", "rate of the gauge"),
])
def test_the_checker_catches_each_misread(expr, problem):
    assert any(problem in p for p in misread_series(expr)), misread_series(expr)
    assert not misread_series('sum by (run) (rate(ray_cs3_train_tokens_total{run=~"$run"}[$__rate_interval]))')
