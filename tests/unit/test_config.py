"""Config loading: every shipped preset loads, and every mistake is one line naming the field."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cs3ray.config import ConfigError, explain, load_config
from cs3ray_cli.main import app

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.model.args().dim > 0
    assert cfg.train.seq_len <= cfg.model.args().max_seq_len


def test_small_config_has_the_promised_shape():
    args = load_config(Path(CONFIGS[0]).parent / "small.yaml").model.args()
    from cs3ray.models import param_count

    assert (args.n_layers, args.dim, args.max_seq_len) == (8, 768, 256)
    assert 56e6 < param_count(args) < 58e6


@pytest.mark.parametrize("override,needle", [
    ("train.lr=-1", "train.lr=-1"),
    ("train.nope=3", "unknown field 'train.nope'"),
    ("precision=fp7", 'precision="fp7"'),
    ("cluster.workers=0", "cluster.workers=0"),
    ("train.steps=abc", 'train.steps="abc"'),
    ("model.dim=100", "model.dim=100 is not divisible"),
    ("train.seq_len=4096", "exceeds model.max_seq_len"),
    ("nodot", "must look like section.field=value"),
    ("train=3", "train=3"),
    ("checkpoint.every_minutes=0", "checkpoint.every_minutes=0 is invalid: must be a number of minutes above 0"),
    ("checkpoint.every_minutes=-15", "checkpoint.every_minutes=-15 is invalid: must be a number of minutes above 0"),
])
def test_bad_overrides_are_one_clear_line(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    msg = str(info.value)
    assert needle in msg and "\n" not in msg


def test_overrides_parse_yaml_scalars_and_nested_sections():
    cfg = load_config(None, ["train.lr=3e-4", "cluster.workers=3", "storage.options.client_kwargs.endpoint_url=http://x"])
    assert cfg.train.lr == 3e-4 and cfg.cluster.workers == 3
    assert cfg.storage.options["client_kwargs"]["endpoint_url"] == "http://x"


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(listy)


def test_every_field_is_explained():
    rows = explain()
    assert len(rows) > 30
    assert all(desc for _, _, desc in rows), [n for n, _, d in rows if not d]
    assert "train.lr" in {n for n, _, _ in rows}


def test_piped_explain_prints_every_field_whole_on_its_own_line():
    result = CliRunner().invoke(app, ["config", "explain"])  # its output is not a terminal
    assert result.exit_code == 0, result.output
    lines = [line.split("\t") for line in result.stdout.splitlines()]
    assert [tuple(line) for line in lines] == explain()
    assert ["checkpoint.every_minutes", "null"] == lines[[n for n, *_ in lines].index("checkpoint.every_minutes")][:2]
    assert load_config(None, ["checkpoint.every_minutes=0.01"]).checkpoint.every_minutes == 0.01


def test_cli_exits_2_with_one_line_and_no_traceback():
    runner = CliRunner()
    for override in ("train.lr=-1", "train.nope=3", "precision=fp7"):
        result = runner.invoke(app, ["train", "configs/tiny.yaml", override])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
    shown = runner.invoke(app, ["config", "show", "configs/tiny.yaml", "train.steps=7"])
    assert shown.exit_code == 0 and "steps: 7" in shown.output
    assert runner.invoke(app, ["config", "explain"]).exit_code == 0


@pytest.mark.parametrize("overrides,needle", [
    (["parallel.strategy=fsdp"], "needs parallel.strategy=ddp"),
    (["cluster.workers={min: 1, max: 2}"], "needs a fixed cluster.workers"),
])
def test_fault_tolerant_replicas_need_whole_replicas_and_a_fixed_size(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["cluster.fault_tolerance=replicas", *overrides])
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert load_config(None, ["cluster.fault_tolerance=replicas"]).cluster.fault_tolerance == "replicas"


def test_replicas_without_torchft_is_one_clear_sentence(monkeypatch):
    import sys

    from cs3ray.errors import UserError
    from cs3ray.train.replicas import torchft_config

    monkeypatch.setitem(sys.modules, "torchft", None)  # as if it were not installed
    with pytest.raises(UserError, match=r"needs torchft: pip install 'cs3ray\[ft\]'"):
        torchft_config("gloo")
    monkeypatch.undo()
    assert type(torchft_config("gloo")).__name__ == "TorchftConfig"
