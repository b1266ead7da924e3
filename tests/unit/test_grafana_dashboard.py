"""deploy/grafana/cs3ray.json: a well-formed Grafana dashboard whose queries name only metrics cs3ray exports,
and every one of them (tests/integration/test_metrics.py and test_serve.py see them on Ray's endpoint)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from cs3ray.data.cache.stats import CacheStats
from cs3ray.ops.metrics import TRAIN_GAUGES
from cs3ray.serve.metrics import SERVE_METRICS

from conftest import ROOT

DASHBOARD = ROOT / "deploy" / "grafana" / "cs3ray.json"
# What each Prometheus type adds to a name on the endpoint (Ray adds the "ray_" prefix to all).
SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> dict[str, str]:
    """Every series name cs3ray puts on Ray's endpoint -> the metric it belongs to."""
    metrics = {f"cs3_train_{k}": "gauge" for k in TRAIN_GAUGES}
    metrics |= {f"cs3_cache_{f.name}": "gauge" for f in dataclasses.fields(CacheStats)}
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
    for expr in queries(dashboard):  # every $variable a query uses is defined
        assert set(re.findall(r"\$(\w+)", expr)) <= variables.keys(), expr
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
