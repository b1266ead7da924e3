"""A stored file cannot send the user's credentials anywhere: the URLs and storage options a checkpoint's
stored config names (checkpoint.replicas, run.dir, train.init_from, storage.options) are never contacted
by `cs3 generate`, `cs3 ckpt export` or the readers behind them, unless the user confirms them."""

from __future__ import annotations

import http.server
import os
import threading
from pathlib import Path

import pytest
import torch
import yaml

from cs3ray.ckpt import CheckpointManager, load_for_inference
from cs3ray.ckpt.export import consolidated_model
from cs3ray.ckpt.hf_export import export_hf
from cs3ray.errors import UserError
from cs3ray.models.generate import SamplingParams, generate_text

from conftest import run_cs3
from helpers.ckpt_runs import save, small_model
from helpers.untrusted import plant


class Listener:
    """An HTTP server on 127.0.0.1 that records every request it gets (and answers 404)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict]] = []
        seen = self.requests

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                seen.append((self.command, self.path, dict(self.headers)))
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_HEAD = do_PUT = do_POST = _record

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def listener():
    srv = Listener()
    yield srv
    srv.close()


def edit_stored_config(folder: Path, change) -> None:
    """Rewrite the checkpoint's config.yaml with `change(cfg_dict)` and its manifest to match (as a copier could)."""
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    change(cfg)
    plant(folder, "config.yaml", yaml.safe_dump(cfg).encode())


def crafted_run(tmp_path: Path, listener: Listener) -> Path:
    """A good checkpoint whose stored config names the listener everywhere it can name a location."""
    run = tmp_path / "run"
    folder = Path(save(CheckpointManager(str(run)), small_model(1), 1))

    def change(cfg: dict) -> None:
        cfg["checkpoint"]["replicas"] = [f"{listener.url}/replica-a", "s3://bucket/x"]
        cfg["run"]["dir"] = f"{listener.url}/run-dir"
        cfg["train"]["init_from"] = f"{listener.url}/init-run"
        cfg["storage"]["options"] = {"client_kwargs": {"endpoint_url": listener.url}}
    edit_stored_config(folder, change)
    return run


def user_env(tmp_path: Path) -> dict:
    """The environment of a user with no AWS credentials (so an S3 attempt fails at once)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}


def test_cli_generate_and_export_contact_nothing_the_stored_config_names(tmp_path, listener):
    run = crafted_run(tmp_path, listener)
    env = user_env(tmp_path)
    gen = run_cs3(["generate", str(run), "--prompt", "a", "--max-tokens", "2", "--seed", "0", "--dtype", "fp32"],
                  env=env, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("a") and gen.stderr.strip() == ""
    out = tmp_path / "m.safetensors"
    exp = run_cs3(["ckpt", "export", str(run), "--out", str(out)], env=env, timeout=120)
    assert exp.returncode == 0, exp.stderr
    assert out.exists() and "Traceback" not in exp.stderr
    assert listener.requests == []

    # Confirmed, the stored replicas are what the fallback tries: reached, or one warning line each.
    gen = run_cs3(["generate", str(run), "--prompt", "a", "--max-tokens", "2", "--dtype", "fp32",
                   "--use-stored-replicas"], env=env, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert [r[1] for r in listener.requests] and all(r[1].startswith("/replica-a") for r in listener.requests)
    assert "Traceback" not in gen.stderr and "replica 's3://bucket/x' unreachable" in gen.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_a_model_loads_and_generates_without_contacting_the_stored_urls(tmp_path, listener, dtype):
    run = crafted_run(tmp_path, listener)
    loaded = load_for_inference(str(run), dtype=dtype)
    assert loaded.step == 1 and {p.dtype for p in loaded.model.parameters()} == {dtype}
    text = generate_text(loaded.model, loaded.tokenizer, "ab", SamplingParams(temperature=0.0, max_tokens=3))
    assert isinstance(text, str)
    model, manifest = consolidated_model(str(run))
    assert manifest["step"] == 1 and model
    assert listener.requests == []


def test_stored_storage_options_never_carry_the_users_credentials(tmp_path, listener, monkeypatch):
    """A stored init_from=hf:s3://... with a stored endpoint_url: validating the config opened it with the
    user's AWS credentials (a signed request, key id included, at the stored endpoint)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASTOREDCONFIGTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    run = tmp_path / "run"
    folder = Path(save(CheckpointManager(str(run)), small_model(1), 1))

    def change(cfg: dict) -> None:
        cfg["train"]["init_from"] = "hf:s3://bucket/hf-model"
        del cfg["model"]["dim"]  # so validation would read the shape from the model's config.json
        cfg["storage"]["options"] = {"client_kwargs": {"endpoint_url": listener.url}}
    edit_stored_config(folder, change)
    with pytest.raises(UserError, match="stored config"):
        load_for_inference(str(run))
    with pytest.raises(UserError, match="stored config"):
        export_hf(str(run / "step-00000001"), str(tmp_path / "hf"))
    assert consolidated_model(str(run))[1]["step"] == 1  # reads the weights, validates no config
    assert listener.requests == []


def test_serve_reads_the_checkpoint_without_contacting_the_stored_urls(tmp_path, listener):
    from cs3ray.serve.deploy import make_spec

    spec = make_spec(str(crafted_run(tmp_path, listener)))
    assert spec.ckpt_replicas == [] and not spec.stored_replicas
    assert listener.requests == []
