"""Where a run's workers go: Ray Train's placement strategy and node label selectors, checked up front.

Ray places a worker group as one placement group; a selector no node satisfies, or a strict
strategy the cluster cannot meet, would otherwise wait out `cluster.start_timeout_s` and fail
with a scheduling message. The check here names the problem in one line before anything starts.
"""

from __future__ import annotations

from typing import Any

from cs3ray.config import JobConfig
from cs3ray.errors import UserError


def scaling_config(cfg: JobConfig):
    """Ray Train's ScalingConfig for the run: worker count (or elastic range), resources, placement."""
    from ray.train import ScalingConfig

    c = cfg.cluster
    workers = (c.min_workers, c.max_workers) if c.elastic else c.max_workers
    return ScalingConfig(num_workers=workers, use_gpu=c.use_gpu, elastic_resize_monitor_interval_s=c.resize_interval_s,
                         resources_per_worker={"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})},
                         placement_strategy=c.placement.upper(), label_selector=dict(c.label_selector) or None)


def _plain(value: str) -> bool:
    # Ray's selector operators ('!a', 'in(a,b)', '!in(a,b)') are left for Ray to evaluate.
    return not value.startswith("!") and not value.startswith("in(")


def check_placement(cfg: JobConfig, nodes: list[dict[str, Any]]) -> None:
    """Refuse, in one sentence, a placement no alive node (of `ray.nodes()`) can satisfy for the smallest group."""
    c = cfg.cluster
    alive = [n for n in nodes if n.get("Alive")]
    wanted = {k: v for k, v in c.label_selector.items() if _plain(v)}
    fitting = [n for n in alive if all(n.get("Labels", {}).get(k) == v for k, v in wanted.items())]
    if wanted and not fitting:
        seen = sorted({f"{k}={v}" for n in alive for k, v in n.get("Labels", {}).items() if not k.startswith("ray.io/")})
        raise UserError(f"no node of the cluster has the labels cluster.label_selector asks for "
                        f"({', '.join(f'{k}={v}' for k, v in wanted.items())}); its nodes have "
                        f"{', '.join(seen) or 'no labels of their own'}")
    need = c.min_workers
    slots = [int(n.get("Resources", {}).get("CPU", 0) // c.cpus_per_worker) for n in fitting or alive]
    if c.placement == "strict_pack" and max(slots, default=0) < need:
        raise UserError(f"cluster.placement=strict_pack puts all {need} workers on one node, and no node has room for "
                        f"them ({c.cpus_per_worker:g} CPU each; the largest fits {max(slots, default=0)})")
    if c.placement == "strict_spread" and sum(1 for s in slots if s >= 1) < need:
        raise UserError(f"cluster.placement=strict_spread puts each of the {need} workers on its own node, and only "
                        f"{sum(1 for s in slots if s >= 1)} node(s) can take one")
