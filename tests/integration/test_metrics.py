"""A run's figures where users watch them: every cs3_train metric on Ray's Prometheus endpoint (the session head's
`--metrics-export-port`, parsed with prometheus_client's parser) while `cs3 train` runs against the head, restore
and compression figures included once a resumed run resizes to 2 workers with int8 gradients (fp32, then fp16):
gauges, counters (tokens) and the step-time histogram, each of its Prometheus type; the shard cache's counters
of the same runs, one series for the node and run whatever the processes reading, adding up to what each
process wrote to its stats file; and, with `run.loggers`, TensorBoard event files and an MLflow run (a local
store) read back with each tool's own reader, the resumed run continuing both. A logger whose package is
missing is one line."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import time

import pytest

from cs3ray.config import load_config
from cs3ray.data.cache import read_all, total
from cs3ray.data.cache.node_metrics import COUNTERS as CACHE_COUNTERS
from cs3ray.errors import UserError
from cs3ray.ops import run_loggers
from cs3ray.ops.metrics import TRAIN_METRICS

from conftest import ROOT
from helpers.prometheus import scrape

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=3",
         "train.eval_batches=1", "checkpoint.every=3", "data.max_bytes=200000", "precision=fp32"]


def figures(url: str, run: str) -> dict[str, float]:
    """The cs3_train series of `run` on the endpoint, by sample name (a histogram's buckets by their `le`), summed
    over the processes that export them (each driver, the first run's and the resumed one's, has its own)."""
    out: dict[str, float] = {}
    for samples in scrape(url, "ray_cs3_train_").values():
        for s in samples:
            if s.labels.get("run") == run:
                name = f"{s.name}{{le={s.labels['le']}}}" if "le" in s.labels else s.name
                out[name] = out.get(name, 0.0) + s.value
    return out


def cache_series(url: str, run: str) -> dict[str, list]:
    """The cache counters' samples of `run` on the endpoint, by family name."""
    return {name: [s for s in samples if s.labels.get("run") == run]
            for name, samples in scrape(url, "ray_cs3_cache_").items()}


def watch(cmd: list[str], env: dict, url: str, run: str, wanted: set[str],
          steps: int) -> tuple[dict[str, float], dict]:
    """Run `cmd`, scraping every half second until it has ended, every wanted series was seen and the step gauge
    reads the run's last step: the run's figures, and the cache series seen while it ran or since (the node's
    cache actor outlives the run, and a short run may end before that actor's first push)."""
    seen: dict[str, float] = {}
    cache: dict[str, list] = {}
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, ended = time.time() + 300, None
        while time.time() < deadline:
            seen.update(figures(url, run))
            cache.update({k: v for k, v in cache_series(url, run).items() if v})
            if proc.poll() is not None:
                # A finished driver's gauges linger on the endpoint a while: long enough for its last push.
                ended = ended or time.time()
                last = seen.get("ray_cs3_train_step") == steps
                if (wanted <= seen.keys() and cache and last) or time.time() > ended + 20:
                    break
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    return seen, cache


def cache_counters_match_the_stats_files(url: str, run: str, disk_dir) -> dict[str, float]:
    """Wait until the node's cache counters of `run` add up to its processes' stats files; returns them."""
    written = {k: v for k, v in total(read_all(str(disk_dir))).to_dict().items() if v}
    families = {f"ray_{name}": key for key, (name, _) in CACHE_COUNTERS.items()}
    deadline = time.time() + 30
    while True:
        series = cache_series(url, run)
        # One series per family: the node's, however many processes read (Ray's WorkerId is the node actor's).
        assert all(len(samples) <= 1 for samples in series.values()), series
        got = {families[name]: samples[0].value for name, samples in series.items() if samples}
        if got.keys() == written.keys() and all(got[k] == pytest.approx(v, rel=1e-6, abs=1e-3)
                                                for k, v in written.items()):
            assert {s.labels["node"] for samples in series.values() for s in samples} == {socket.gethostname()}
            assert all(s.name.endswith("_total") for samples in series.values() for s in samples)
            return got
        assert time.time() < deadline, (got, written)
        time.sleep(0.5)


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a folder's TensorBoard event files (TFRecord frames of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


@pytest.mark.slow
def test_metrics_endpoint_and_loggers_hold_the_runs_figures(ray_head, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store for the test; users run a server
    run_dir, store = tmp_path / "metered", tmp_path / "mlruns"
    env = dict(ray_head.env(), MLFLOW_TRACKING_URI=f"file://{store}", MLFLOW_ALLOW_FILE_STORE="true")
    base = ["cs3", "train", "configs/tiny.yaml", f"run.dir={run_dir}", "run.name=metered", *SMALL,
            "run.loggers=[tensorboard, mlflow]", "run.mlflow_experiment=cs3-test", "--address", ray_head.address]
    shards = tmp_path / "shards"
    base += [f"cache.disk_dir={shards}"]  # this test's stats files alone
    series = {"gauge": "", "counter": "_total", "histogram": "_count"}
    names = {f"ray_cs3_train_{k}{series[kind]}" for k, (kind, _) in TRAIN_METRICS.items()}
    # Counted only when they happen (a Ray counter has no value before its first increment): not in these runs.
    names -= {"ray_cs3_train_restarts_total", "ray_cs3_train_recoveries_total", "ray_cs3_train_skipped_steps_total"}
    later = {"ray_cs3_train_checkpoint_restore_seconds", "ray_cs3_train_step_comm_bytes", "ray_cs3_train_wire_ratio"}

    first, cache = watch([*base, "train.steps=3", "cluster.workers=1"], env, ray_head.metrics_url, "metered",
                         names - later, steps=3)
    assert names - later <= first.keys(), sorted(names - later - first.keys())
    assert first["ray_cs3_train_step"] == 3 and first["ray_cs3_train_grad_norm"] > 0
    assert first["ray_cs3_train_checkpoint_save_seconds"] > 0
    # Tokens counted: 3 steps of 4 sequences of 32; every step timed in the histogram.
    assert first["ray_cs3_train_tokens_total"] == 3 * 4 * 32
    assert first["ray_cs3_train_step_seconds_count"] == 3 == first["ray_cs3_train_step_seconds_bucket{le=+Inf}"]
    assert first["ray_cs3_train_step_seconds_sum"] > 0
    # The cache's counters, scraped during or just after the run: one series for the node and run.
    assert {"ray_cs3_cache_l3_reads", "ray_cs3_cache_l3_bytes"} <= cache.keys(), sorted(cache)
    after_first = cache_counters_match_the_stats_files(ray_head.metrics_url, "metered", shards)

    # Resumed on 2 workers with int8 gradients in fp16 (a checkpoint loads in any precision): a restore, bytes
    # on the wire and a loss scale.
    second, cache = watch([*base, "--resume", "train.steps=6", "cluster.workers=2", "compression.codec=int8",
                           "precision=fp16"], env, ray_head.metrics_url, "metered", names, steps=6)
    assert names <= second.keys(), sorted(names - second.keys())
    assert second["ray_cs3_train_step"] == 6 and second["ray_cs3_train_workers"] == 2
    assert second["ray_cs3_train_checkpoint_restore_seconds"] > 0
    # The first driver's 3 steps of 4 sequences and the resumed 3 of 8 (train.batch_size per worker).
    assert second["ray_cs3_train_tokens_total"] == 3 * 4 * 32 + 3 * 8 * 32
    assert json.loads((run_dir / "summary.json").read_text())["tokens_seen"] == second["ray_cs3_train_tokens_total"]
    assert second["ray_cs3_train_step_seconds_count"] == 6
    # Three syncs since the resume: the process's first in fp32 (DDP's initial buckets), two in int8.
    assert 0.45 < second["ray_cs3_train_wire_ratio"] < 0.55 and second["ray_cs3_train_step_comm_bytes"] > 0
    assert second["ray_cs3_train_loss_scale"] > 1 and first["ray_cs3_train_loss_scale"] == 1
    # Two workers read on this node: their counters and the first run's add up in the node's one series.
    assert cache, "no cache series while the resumed run read"
    after_second = cache_counters_match_the_stats_files(ray_head.metrics_url, "metered", shards)
    assert len(read_all(str(shards))) >= 3 and after_second["l1_hits"] > after_first["l1_hits"]

    # The same figures in TensorBoard and MLflow, the resumed run continuing the first's.
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["cs3/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [step for step, _ in scalars["cs3/val_loss"]] == [0, 3, 6]
    assert {"cs3/tokens_per_s", "cs3/mfu", "cs3/grad_norm", "cs3/checkpoint_save_s", "cs3/checkpoint_restore_s",
            "cs3/wire_ratio"} <= scalars.keys()
    client = mlflow.tracking.MlflowClient(f"file://{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("cs3-test").experiment_id])
    assert run.info.run_name == "metered" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "3" and run.data.params["precision"] == "fp32"  # the first run's
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [1, 2, 3, 4, 5, 6]
    assert [m.value for m in losses] == pytest.approx([v for _, v in scalars["cs3/loss"]], rel=1e-6)


def wait_for(url: str, prefix: str, label: tuple[str, str], wanted: dict[str, float]) -> dict[str, list]:
    """The samples of `prefix` whose `label` has the value given, by sample name, once each wanted sample
    name has (summed over its series) the value given; fails after 30 s with what was seen."""
    deadline, got = time.time() + 30, {}
    while True:
        got = {}
        for samples in scrape(url, prefix).values():
            for s in samples:
                if s.labels.get(label[0]) == label[1] and s.labels.get("le", "+Inf") == "+Inf":
                    got.setdefault(s.name, []).append(s)
        if all(sum(x.value for x in got.get(k, [])) == pytest.approx(v) for k, v in wanted.items()):
            return got
        assert time.time() < deadline, ({k: [x.value for x in v] for k, v in got.items()}, wanted)
        time.sleep(0.5)


def test_run_metrics_count_restarts_recoveries_skipped_steps_and_time_each_step(ray_client, ray_head):
    """The driver's metrics from a run's events: the first start is no restart, each later one is; a
    heal is a recovery; a progress event adds its window's tokens and skipped steps and times each step."""
    from cs3ray.ops.metrics import RunMetrics

    metrics = RunMetrics("counted")
    for event in [{"event": "start", "step": 0}, {"event": "healed"},
                  {"event": "progress", "step": 2, "loss": 2.5, "window_tokens": 256, "window_skipped": 1,
                   "step_times_s": [0.02, 0.3]},
                  {"event": "start", "step": 2}, {"event": "checkpoint", "step": 2, "seconds": 0.4},
                  {"event": "progress", "step": 3, "window_tokens": 128, "window_skipped": 0, "step_times_s": [7.0]}]:
        metrics.observe(event)
    got = wait_for(ray_head.metrics_url, "ray_cs3_train_", ("run", "counted"), {
        "ray_cs3_train_restarts_total": 1, "ray_cs3_train_recoveries_total": 1,
        "ray_cs3_train_skipped_steps_total": 1, "ray_cs3_train_tokens_total": 384,
        "ray_cs3_train_step_seconds_count": 3, "ray_cs3_train_loss": 2.5,
        "ray_cs3_train_checkpoint_save_seconds": 0.4})
    buckets = {s.labels["le"]: s.value for s in scrape(ray_head.metrics_url, "ray_cs3_train_step_seconds")
               ["ray_cs3_train_step_seconds"] if s.labels.get("run") == "counted" and s.name.endswith("_bucket")}
    assert (buckets["0.025"], buckets["0.5"], buckets["10.0"]) == (1, 2, 3), buckets
    assert got["ray_cs3_train_step"][0].value == 3 and "ray_cs3_train_grad_norm" not in got  # no event set it


def test_cache_counters_of_a_nodes_processes_are_one_series_per_node_and_run(ray_client, ray_head):
    """Two processes of the node count for the same run: the endpoint shows one series per counter with
    their sum, tagged node and run, no process id; another run is a series of its own."""
    import ray

    from cs3ray.data.cache.stats import CacheStats, StatsWriter

    @ray.remote(num_cpus=0)
    def count(run: str, hits: int, wait_s: float) -> None:
        stats = CacheStats()
        writer = StatsWriter(stats, None, run=run)
        stats.add(l1_hits=hits, l3_bytes=1000)
        writer.flush()
        stats.add(l1_hits=1, wait_s=wait_s)
        writer.flush(final=True)

    ray.get([count.remote("node-sum", 2, 0.25), count.remote("node-sum", 5, 0.5), count.remote("other", 1, 0.0)])
    got = wait_for(ray_head.metrics_url, "ray_cs3_cache_", ("run", "node-sum"), {
        "ray_cs3_cache_l1_hits_total": 9, "ray_cs3_cache_l3_bytes_total": 2000, "ray_cs3_cache_wait_seconds_total": 0.75})
    for samples in got.values():
        ((sample,),) = [samples]  # one series each
        assert sample.labels["node"] == socket.gethostname() and "pid" not in sample.labels
    wait_for(ray_head.metrics_url, "ray_cs3_cache_", ("run", "other"), {"ray_cs3_cache_l1_hits_total": 2})


def test_a_logger_whose_package_is_missing_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = load_config(ROOT / "configs/tiny.yaml", ["run.loggers=[mlflow]"])
    with pytest.raises(UserError, match=r"^run.loggers names mlflow, but mlflow is not installed here \(pip install mlflow\)$"):
        run_loggers.check_loggers(cfg)
