"""`cs3 up` / `cs3 status` / `cs3 submit` / `cs3 jobs` / `cs3 down` as from a new user's shell (an empty home folder,
no RAY_* variable): the cluster is authenticated whether or not a token existed, binds loopback only, refuses a
tokenless job-API request and a tokenless `ray.init`, is used by the other commands without --address, and is
stopped without touching any other Ray (the session's head)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cs3ray.ops.watchdog import processes, tree

from conftest import ROOT, run_cs3

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.steps=2", "train.warmup_steps=0", "cluster.workers=1", "data.max_bytes=200000",
         "precision=fp32"]


def user_shell(home: Path) -> dict[str, str]:
    """The environment of a user's shell: this one without any Ray or cs3 variable, HOME an empty folder."""
    home.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CS3_"))}
    return dict(env, HOME=str(home))


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _status_of_job_api(url: str, token: str | None) -> int:
    request = urllib.request.Request(f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _assert_closed_to_strangers(cluster: dict, token: str, tmp_path: Path) -> None:
    """No token: the job API and joining the GCS are refused; with it, the job API answers."""
    assert _status_of_job_api(cluster["dashboard"], None) in (401, 403)
    assert _status_of_job_api(cluster["dashboard"], token) == 200
    # Another user of this machine, no token, joining as operations.md says a script joins a loopback cluster.
    stranger = dict(user_shell(tmp_path / "stranger"), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    joined = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={cluster['address']!r})"],
                            env=stranger, capture_output=True, text=True, timeout=120)
    assert joined.returncode != 0 and re.search(r"auth|token", joined.stderr, re.I), joined.stderr[-2000:]


def _listeners_beyond_loopback(pids: list[int]) -> list[str]:
    """Listening TCP sockets of the cluster's processes (the trees under its `ray start`s) not on loopback."""
    tree_pids = tree(set(pids), processes())
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & tree_pids
            and not re.search(r"\s(127\.\d+\.\d+\.\d+|\[::ffff:127\.\d+\.\d+\.\d+\]|\[::1\]):\d+\s", line)]


@pytest.mark.slow
def test_a_new_user_gets_an_authenticated_loopback_cluster_that_the_other_commands_use(ray_head, tmp_path):
    home = tmp_path / "home"
    env = user_shell(home)
    none = run_cs3(["status"], env=env)
    assert none.returncode == 2 and "start one with `cs3 up`" in none.stderr
    try:
        first = _json(run_cs3(["up", "--workers", "1", "--num-cpus", "2", "--labels", "zone=a,tier=cpu", "--json"],
                              env=env, timeout=240))
        assert first["started"] and first["nodes"] == 2
        token_file = home / ".ray/auth_token"  # made by cs3, where Ray looks for it, the owner's alone
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        again = _json(run_cs3(["up", "--json"], env=env))
        assert not again["started"] and again["address"] == first["address"]

        status = _json(run_cs3(["status", "--json"], env=env))  # no --address: the recorded cluster
        assert status["address"] == first["address"] and len(status["nodes"]) == 2
        assert all(n["labels"] == {"zone": "a", "tier": "cpu"} for n in status["nodes"])
        assert status["resources"]["CPU"]["total"] == 4 and status["trainings"] == [] and status["serve_apps"] == {}
        _assert_closed_to_strangers(first, token_file.read_text().strip(), tmp_path)
        record = json.loads((home / ".cs3/cluster.json").read_text())
        assert _listeners_beyond_loopback(record["pids"]) == []

        submitted = run_cs3(["submit", "configs/tiny.yaml", *SMALL, f"run.dir={tmp_path / 'runs'}", "--no-wait"],
                            env=env, cwd=ROOT, timeout=240)
        assert submitted.returncode == 0, submitted.stdout[-2000:] + submitted.stderr[-2000:]
        job_id = submitted.stderr.split("submitted job ", 1)[1].split()[0]
        jobs = run_cs3(["jobs", "ls", "--json"], env=env)  # the job API of the same cluster
        listed = _json(jobs)
        assert [j["status"] for j in listed if "cs3 status" in j["entrypoint"]] == ["SUCCEEDED"]
        assert job_id in [j["id"] for j in listed] and first["dashboard"] in jobs.stderr
    finally:
        record = json.loads((home / ".cs3/cluster.json").read_text())
        stopped = run_cs3(["down"], env=env, timeout=120)
    assert stopped.returncode == 0 and f"stopped the cluster at {first['address']}" in stopped.stdout
    assert not any(_running(p) for p in record["pids"])
    assert "no cluster started by `cs3 up`" in run_cs3(["down"], env=env).stdout
    assert ray_head.proc.poll() is None  # the session's head (another Ray on this machine) still runs


@pytest.mark.slow
def test_a_token_that_already_exists_is_used_and_kept(tmp_path):
    home = tmp_path / "home"
    env = user_shell(home)
    token_file = home / ".ray/auth_token"  # as `ray get-auth-token --generate` leaves it: the umask's mode
    token_file.parent.mkdir(parents=True)
    token_file.write_text("ab" * 32)
    token_file.chmod(0o644)
    try:
        cluster = _json(run_cs3(["up", "--num-cpus", "2", "--json"], env=env, timeout=240))
        status = run_cs3(["status", "--json"], env=env)
        assert len(_json(status)["nodes"]) == 1 and "InvalidAuthToken" not in status.stderr
        assert _json(run_cs3(["jobs", "ls", "--json"], env=env)) is not None
        _assert_closed_to_strangers(cluster, "ab" * 32, tmp_path)
    finally:
        assert run_cs3(["down"], env=env, timeout=120).returncode == 0
    assert token_file.read_text() == "ab" * 32 and stat.S_IMODE(token_file.stat().st_mode) == 0o600


def _documented_listeners() -> list[str]:
    """The processes docs/operations.md lists as listening beyond loopback (its table's process column)."""
    text = (ROOT / "docs/operations.md").read_text()
    table = re.split(r"What\s+still\s+listens\s+beyond\s+loopback", text, maxsplit=1)[1].split("\n\n", 2)[1]
    return [name for row in table.splitlines()[2:] for name in re.findall(r"`([^`]+)`", row.split("|")[2])]


@pytest.mark.slow
def test_an_embedded_training_listens_beyond_loopback_only_where_the_docs_say(tmp_path):
    documented = _documented_listeners()
    env = user_shell(tmp_path / "home")
    events = tmp_path / "run" / "events.jsonl"
    proc = subprocess.Popen(["cs3", "train", "configs/tiny.yaml", *SMALL, "cluster.workers=2", "train.steps=400",
                             f"run.dir={tmp_path / 'run'}"], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    seen: set[str] = set()
    looks_after_training = 0  # the process group and its store are up once a step is logged
    try:
        while proc.poll() is None and looks_after_training < 4:
            seen.update(re.search(r'users:\(\("([^"]+)"', line).group(1) for line in _listeners_beyond_loopback([proc.pid]))
            if events.exists() and '"event": "progress"' in events.read_text():
                looks_after_training += 1
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: a checkpoint, then everything stops
        proc.wait(timeout=120)
    assert looks_after_training == 4, "the run ended before it logged a step"
    # ss shows a process's name cut to 15 characters.
    assert all(any(name.startswith(seen_name) or fnmatch.fnmatch(seen_name, name) for name in documented)
               for seen_name in seen), seen
