"""deploy/logging/: the Fluent Bit config that ships run.log_format=json logs and the index template they land in.

Fluent Bit's own validator (`fluent-bit --dry-run`) checks the config where it is installed; everywhere the
config is parsed here, and checked against the lines cs3ray writes (their files, fields and timestamps).
"""

from __future__ import annotations

import datetime
import json
import logging
import shutil
import subprocess

import pytest
from ray._common.formatters import JSONFormatter

from cs3ray.config import load_config
from cs3ray.ops import json_logs
from cs3ray.ops.json_logs import EXTRA_STANDARD_ATTRS, FIELDS, RunContext, RunContextFilter

from conftest import ROOT

LOGGING = ROOT / "deploy" / "logging"
REPEATABLE = {"add", "set", "remove", "rename", "copy", "hard_rename", "hard_copy"}


def sections(path) -> list[tuple[str, dict[str, str]]]:
    """A classic-format Fluent Bit file as [(SECTION, {key: value})], keys lower-cased as Fluent Bit reads them."""
    out: list[tuple[str, dict[str, str]]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            assert line.endswith("]") and not raw.startswith(" "), raw
            out.append((line[1:-1].upper(), {}))
            continue
        assert raw.startswith("    ") and out, f"a key outside a section, or not indented: {raw!r}"
        key, _, value = line.partition(" ")
        assert value.strip(), f"{key} has no value"
        key = key.lower()
        if key in REPEATABLE:  # the modify filter's operations: each on a line of its own
            out[-1][1][key] = (out[-1][1][key] + "\n" if key in out[-1][1] else "") + value.strip()
            continue
        assert key not in out[-1][1], f"{key} twice in [{out[-1][0]}]"
        out[-1][1][key] = value.strip()
    return out


def config() -> dict[str, list[dict[str, str]]]:
    found: dict[str, list[dict[str, str]]] = {}
    for name, keys in sections(LOGGING / "fluent-bit.conf"):
        found.setdefault(name, []).append(keys)
    return found


def a_line(**extra) -> dict:
    """What a driver or worker writes for one record: Ray's JSON formatter behind the run's context filter."""
    record = logging.LogRecord("cs3ray.run", logging.INFO, __file__, 1, "step %d loss %.4f", (4, 3.25), None)
    for key, value in extra.items():
        setattr(record, key, value)
    RunContextFilter().filter(record)
    formatter = JSONFormatter()
    formatter.set_additional_log_standard_attrs(EXTRA_STANDARD_ATTRS)
    return json.loads(formatter.format(record))


@pytest.fixture
def context(monkeypatch):
    monkeypatch.setattr(RunContext, "run", "tiny")
    monkeypatch.setattr(RunContext, "rank", 1)
    monkeypatch.setattr(RunContext, "step", 4)


def test_fluent_bit_tails_the_json_files_and_ships_them_to_one_index_a_day():
    cfg = config()
    assert set(cfg) == {"SERVICE", "INPUT", "FILTER", "OUTPUT"}
    (service,) = cfg["SERVICE"]
    assert (LOGGING / service["parsers_file"]).is_file()
    json_input, text_input = cfg["INPUT"]
    paths = json_input["path"].split(",")
    logs = "/tmp/ray/session_latest/logs"
    # Where process_logs and Serve write the structured lines, and Ray Train's own JSON files.
    assert f"{logs}/{json_logs.LOG_DIR}/*.log" in paths
    assert f"{logs}/serve/replica_*.log" in paths and f"{logs}/train/ray-train-*.log" in paths
    assert all(p.startswith(logs + "/") for p in paths + text_input["path"].split(","))
    for tail in (json_input, text_input):
        assert tail["name"] == "tail" and tail["parser"] == "cs3_json"
        assert tail["db"].startswith("/tmp/ray/")  # its read offsets survive a sidecar restart, on the shared volume
        assert int(tail["rotate_wait"]) > 0  # Ray's rotation: keep reading a rotated file's last lines
    assert json_input["db"] != text_input["db"]
    (modify,) = cfg["FILTER"]
    assert {line.split()[0] for line in modify["add"].splitlines()} == {"k8s_pod", "k8s_namespace", "ray_cluster"}
    (output,) = cfg["OUTPUT"]
    assert output["name"] == "es" and output["match"] == "*" and output["logstash_format"] == "On"
    assert output["http_passwd"].startswith("${")  # a credential comes from the environment, never the file
    template = json.loads((LOGGING / "index-template.json").read_text())
    assert any(f"{output['logstash_prefix']}-2026.01.31".startswith(p.rstrip("*")) for p in template["index_patterns"])


def test_the_parser_reads_the_timestamp_cs3ray_writes(context):
    ((name, parser),) = sections(LOGGING / "parsers.conf")
    assert name == "PARSER" and parser["name"] == "cs3_json" and parser["format"] == "json"
    line = a_line()
    # Fluent Bit's %L is the fraction of a second, Python's %f.
    when = datetime.datetime.strptime(line[parser["time_key"]], parser["time_format"].replace("%L", "%f"))
    assert abs(when.replace(tzinfo=datetime.timezone.utc).timestamp() - datetime.datetime.now().timestamp()) < 60


def test_every_field_of_a_line_has_a_mapping_of_its_type(context):
    mappings = json.loads((LOGGING / "index-template.json").read_text())["template"]["mappings"]
    props = mappings["properties"]
    assert mappings["date_detection"] is False  # Ray's asctime is no ISO date: a keyword, not a failed date
    line = a_line(event="progress")
    assert set(FIELDS) <= set(line)
    assert line["message"] == "step 4 loss 3.2500" and line["level"] == "INFO" and line["name"] == "cs3ray.run"
    assert (line["run"], line["rank"], line["step"]) == ("tiny", 1, 4)
    kinds = {"keyword": str, "text": str, "integer": int, "long": int, "date": str}
    for key, value in line.items():
        assert key in props, f"no mapping for {key}"
        assert value is None or isinstance(value, kinds[props[key]["type"]]), (key, value)
    for key in ("job_id", "node_id", "worker_id", "actor_id", "k8s_pod", "ray_cluster", "file", "log"):
        assert key in props
    assert props["timestamp"]["type"] == "date" and props["step"]["type"] == "long"


def test_a_records_own_step_wins_over_the_context(context):
    assert a_line(step=9, rank=None)["step"] == 9
    assert a_line(rank=None)["rank"] is None


def test_rotation_follows_rays_variables(monkeypatch):
    import ray

    monkeypatch.setattr(ray._private.worker, "_global_node", None)
    monkeypatch.setenv("RAY_ROTATION_MAX_BYTES", "4096")
    monkeypatch.setenv("RAY_ROTATION_BACKUP_COUNT", "3")
    assert json_logs.rotation() == (4096, 3)


def test_log_format_is_a_run_field():
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["run.log_format=json"])
    assert cfg.run.log_format == "json"
    assert load_config(ROOT / "configs" / "tiny.yaml").run.log_format == "text"
    assert json_logs.serve_logging_config("json")["encoding"] == "JSON"
    assert json_logs.serve_logging_config("text") is None and json_logs.ray_logging_config("text") is None


@pytest.mark.skipif(shutil.which("fluent-bit") is None, reason="Fluent Bit is not installed (its validator runs where it is)")
def test_fluent_bit_validates_the_config(tmp_path):
    env = {"POD_NAME": "p", "POD_NAMESPACE": "n", "RAY_CLUSTER_NAME": "c", "ES_HOST": "127.0.0.1", "ES_PORT": "9200",
           "ES_USER": "u", "ES_PASSWORD": "p", "PATH": "/usr/bin:/bin:/opt/fluent-bit/bin"}
    proc = subprocess.run([shutil.which("fluent-bit"), "--dry-run", "-c", str(LOGGING / "fluent-bit.conf")],
                          cwd=LOGGING, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
