"""Read Ray's Prometheus endpoint as a scraper would: the text parsed by prometheus_client's own parser."""

from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from typing import Iterable

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str, prefix: str = "ray_cs3_") -> dict[str, list[Sample]]:
    """The samples of each metric family whose name starts with `prefix` ({} while the endpoint is not up)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except OSError:  # the node's metrics agent starts a little after the head accepts jobs
        return {}
    return {f.name: f.samples for f in text_string_to_metric_families(text) if f.name.startswith(prefix)}


@dataclass
class ServeSeries:
    """cs3_serve_* families as scraped (without Ray's `ray_` prefix), optionally one application's only."""

    found: dict[str, list[Sample]]
    application: str | None = None

    def total(self, family: str, suffix: str) -> float:
        """The sum of `family`'s samples whose name ends with `suffix` (`_total`, `_count`...)."""
        return sum(s.value for s in self.found.get(family, []) if s.name.endswith(suffix)
                   and (self.application is None or s.labels.get("application") == self.application))


def wait_serve_metrics(metrics_url: str, families: Iterable[str], tokens: int, application: str | None = None,
                       timeout: float = 60.0) -> ServeSeries:
    """Scrape until every family is there with `tokens` generated tokens and the `tokens - 1` gaps between
    them counted: each replica pushes its series every few seconds. Returns the last scrape (the caller
    asserts on it, so a timeout reads as the figure that is missing)."""
    wanted, deadline = set(families), time.time() + timeout
    series = ServeSeries({}, application)
    while time.time() < deadline:
        found = {name[len("ray_"):]: samples for name, samples in scrape(metrics_url, "ray_cs3_serve_").items()}
        series = ServeSeries(found, application)
        if (wanted <= found.keys() and series.total("cs3_serve_generated_tokens", "_total") >= tokens
                and series.total("cs3_serve_inter_token_seconds", "_count") >= tokens - 1):
            break
        time.sleep(0.5)
    return series
