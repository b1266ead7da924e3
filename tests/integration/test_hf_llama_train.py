"""`cs3 train` with train.init_from: hf:DIR fine-tunes a Hugging Face Llama made by transformers on the spot:
the model's shape comes from config.json, and training on 2 FSDP workers starts from its weights and moves them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from cs3ray.ckpt.export import consolidated_model
from cs3ray.ckpt.hf_import import read_fields, read_state
from cs3ray.models import train_bpe
from cs3ray.storage import open_url

from conftest import run_cs3

transformers = pytest.importorskip("transformers")

LR, STEPS = 1e-3, 2


@pytest.mark.slow
def test_cs3_train_fine_tunes_a_hugging_face_llama(ray_head, tmp_path):
    tok = train_bpe(["def f(x):\n    return x + 1\n" * 20, "import os, sys\nclass A:\n    pass\n" * 20], 300)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=304, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    src = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(src, max_shard_size="100KB")
    (src / "tokenizer.json").write_text(tok.hf_text())

    run_dir = tmp_path / "run"
    proc = run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", f"train.init_from=hf:{src}",
                    f"data.tokenizer={src}", "precision=fp32", "train.seq_len=32", "train.batch_size=4",
                    f"train.steps={STEPS}", f"train.lr={LR}", "train.warmup_steps=0", "train.eval_every=2",
                    "train.log_every=1", "train.eval_batches=1", f"checkpoint.every={STEPS}", "cluster.workers=2",
                    "parallel.strategy=fsdp",
                    "data.max_bytes=50000", "--address", ray_head.address, "--json"], env=ray_head.env(), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == STEPS and math.isfinite(summary["final_loss"])
    assert math.isfinite(summary["initial_val_loss"]) and math.isfinite(summary["final_val_loss"])

    # Each FSDP worker kept its shard of the Hugging Face weights (a fresh init differs from them by ~0.02 per
    # weight), and training moved them by AdamW's bounded steps of about the learning rate each.
    storage = open_url(str(src))
    start = read_state(storage, read_fields(storage))
    trained, _ = consolidated_model(str(run_dir))
    assert set(trained) == set(start)
    moved = max((trained[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved <= 3 * LR * STEPS
