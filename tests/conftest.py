"""Shared fixtures: one real Ray head per test session, a real S3 endpoint (moto server), CLI runner, and
a stand-in clock for the storage retries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray Train's controller looks at its workers every 2 s by default, so each of the suite's many
# short runs waited up to that to start and again to end; Ray Train passes this on to its actors.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# No Ray auth mode or token is set for the session: commands run as from a user's shell. The
# session's head has a token of its own, which `ray_head.env()` hands to the clients of that head.
from cs3ray.ops.cluster_env import export_cluster_env  # noqa: E402

from helpers.cluster import HeadNode, start_head  # noqa: E402

# The test head runs Serve's proxy as `cs3 serve` runs it on an embedded cluster (gRPC to replicas).
export_cluster_env()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Unit tests first, each folder in its own order: they need no Ray, and once the session's head is up
    its processes (and this process as its driver) share the cores with the unit tests' torch threads."""
    items.sort(key=lambda item: "integration" in item.path.parts)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory) -> HeadNode:
    """One `ray start --head` on 127.0.0.1 with token auth for the whole session; CLI tests reach it with
    --address and the environment `ray_head.env()` (which names its token file)."""
    node = start_head(num_cpus=8, token_dir=tmp_path_factory.mktemp("ray-token"))
    yield node
    node.stop()


@pytest.fixture(scope="session")
def ray_client(ray_head):
    """This test process connected to the session's head node (for in-process API tests)."""
    import ray

    from cs3ray.ops.ray_auth import join_with_token

    os.environ.update({k: v for k, v in ray_head.env().items() if k.startswith("RAY_")})
    join_with_token()  # this process imported ray before the head's auth variables were set
    if not ray.is_initialized():
        ray.init(address=ray_head.address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


HALF_PRECISIONS = ("bf16", "fp16")


@pytest.fixture(scope="session")
def short_run(ray_head, tmp_path_factory):
    """`short_run(precision)`: (run dir, summary) of 4 steps of a small model that `cs3 train` ran on the
    session's head in that precision, trained once per precision (bf16 is emulated on AVX2-only CPUs).
    One worker: the strategies across ranks run in every precision in tests/unit/test_core_equivalence.py.
    The first call trains both half precisions side by side (the suite uses both): most of a short run is
    starting processes, which two runs overlap. The second starts once the first has written its config,
    after the data preparation they share."""
    import json
    import time

    runs: dict[str, tuple[Path, dict]] = {}

    def start(precision: str) -> tuple[Path, subprocess.Popen]:
        run_dir = tmp_path_factory.mktemp(f"short-{precision}") / "run"
        args = ["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"precision={precision}",
                "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128",
                "train.seq_len=32", "train.batch_size=4", "train.steps=4", "train.warmup_steps=0",
                "train.log_every=1", "train.eval_every=4", "checkpoint.every=4", "cluster.workers=1",
                "--address", ray_head.address, "--json"]
        return run_dir, subprocess.Popen(["cs3", *args], env=ray_head.env(), cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True)

    def train(precision: str) -> tuple[Path, dict]:
        if precision not in runs:
            others = HALF_PRECISIONS if precision in HALF_PRECISIONS else ()
            wanted = [precision, *(p for p in others if p != precision and p not in runs)]
            started = [start(wanted[0])]
            deadline = time.time() + 300
            while len(wanted) > 1 and time.time() < deadline and started[0][1].poll() is None \
                    and not (started[0][0] / "config.yaml").exists():
                time.sleep(0.2)
            started += [start(p) for p in wanted[1:]]
            for p, (run_dir, proc) in zip(wanted, started, strict=True):
                out, err = proc.communicate(timeout=600)
                if proc.returncode != 0:
                    raise AssertionError(f"cs3 train precision={p} exited {proc.returncode}:\n{out}\n{err}")
                runs[p] = run_dir, json.loads(out.strip().splitlines()[-1])
        return runs[precision]
    return train


TRAINED_STEPS = 10  # the steps of `trained_run`, of 8 samples per worker each


@pytest.fixture(scope="session")
def trained_run(ray_head, tmp_path_factory):
    """(run dir, summary) of `cs3 train` on the session's head: TRAINED_STEPS steps of the tiny model on 2 FSDP
    workers in fp32 (the same run on every host), with its data trace. Trained once: tests read it, or continue
    a copy of it (tests/integration/test_resharding.py)."""
    import json

    run_dir = tmp_path_factory.mktemp("trained") / "tiny"
    # Half of tiny.yaml's batch: shorter steps, and the model still learns plenty in 10 of them
    # (the validation loss falls by a third within the first 5).
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.steps={TRAINED_STEPS}",
                    "train.eval_every=5", "train.log_every=5", "checkpoint.every=5", "train.warmup_steps=2",
                    "train.batch_size=8", "parallel.strategy=fsdp", "cache.trace=true", "precision=fp32",
                    "--address", ray_head.address, "--json"], env=ray_head.env(), check=True)
    return run_dir, json.loads(proc.stdout.strip().splitlines()[-1])


def run_cs3(args: list[str], env: dict | None = None, cwd: Path | None = None, timeout: float = 600,
            check: bool = False) -> subprocess.CompletedProcess:
    """Run the installed `cs3` console script as a user would."""
    proc = subprocess.run(["cs3", *args], env=env or dict(os.environ), cwd=cwd or ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"cs3 {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


class RetryClock:
    """cs3ray.storage's retry clock and sleep: time passes only in the backoff waits, which are recorded, not slept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from cs3ray import storage

        self.now: float = 0.0
        self.waits: list[float] = []
        monkeypatch.setattr(storage, "_clock", lambda: self.now)
        monkeypatch.setattr(storage, "_sleep", self.sleep)

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


@pytest.fixture
def retry_clock(monkeypatch) -> RetryClock:
    """Storage retries under a RetryClock: a test checks their waits and deadline instead of timing them."""
    return RetryClock(monkeypatch)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol endpoint on 127.0.0.1 (moto in server mode, in a subprocess).

    Yields (endpoint_url, storage_options); a bucket named 'cs3' exists.
    """
    from cs3ray.bench.loopback_s3 import MotoServer, make_bucket, s3_options

    moto = MotoServer()
    make_bucket(moto.url, "cs3")
    yield moto.url, s3_options(moto.url)
    moto.stop()
