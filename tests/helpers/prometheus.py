"""Read Ray's Prometheus endpoint as a scraper would: the text parsed by prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

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
