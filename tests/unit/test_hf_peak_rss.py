"""Peak resident memory of `cs3 ckpt import-hf` and `--format hf` export of a ~300M-parameter Llama (bf16
files, written here with safetensors): import holds its shard (all of the fp32 state: one process) plus at
most 1.5x the largest tensor, export no more than 1.5x the largest tensor, beyond what the interpreter, torch
and cs3ray take alone. Each runs in a fresh child that reports its VmHWM (peak RSS, file pages included)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

# ~301M parameters: 20 layers of width 1024 (GQA 16/8 heads), untied 32000-token embedding and head.
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 8,
          "vocab_size": 32000, "max_position_embeddings": 2048, "tie_word_embeddings": False}
CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from cs3ray.ckpt.hf_import import import_hf
from cs3ray.ckpt.hf_export import export_hf
what, a, b = sys.argv[1:4]
if what == "import":
    import_hf(a, b, note=lambda line: None)
elif what == "export":
    export_hf(a, b, dtype=torch.bfloat16)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"peak": int(status["VmHWM"].split()[0]) * 1024}))
"""


def _shapes() -> dict[str, tuple[int, ...]]:
    c = CONFIG
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,),
           "lm_head.weight": (c["vocab_size"], d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                    p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                    p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                    p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                    p + "post_attention_layernorm.weight": (d,)})
    return out


def _write_model(path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Shards of ~200 MB of bf16 tensors, each a distinct constant (no two chunks alike), and their index."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    shards: list[dict[str, tuple[int, ...]]] = [{}]
    for name, shape in shapes.items():
        if sum(torch.Size(s).numel() for s in shards[-1].values()) * 2 > 200 * 2**20:
            shards.append({})
        shards[-1][name] = shape
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: torch.full(s, (len(weight_map) + j) / 1024, dtype=torch.bfloat16)
                   for j, (n, s) in enumerate(shard.items())}, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _peak(*args: str) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.slow
def test_import_and_export_peak_rss_stay_within_a_shard_and_one_and_a_half_tensors(tmp_path):
    shapes = _shapes()
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 290e6 < params < 310e6
    largest = max(torch.Size(s).numel() for s in shapes.values()) * 4  # fp32, as the checkpoint holds it
    shard = params * 4  # import-hf is one process: its shard is the whole fp32 state
    _write_model(tmp_path / "hf", shapes)

    base = _peak("none", "", "")  # interpreter, torch and the cs3ray modules, nothing read
    imported = _peak("import", str(tmp_path / "hf"), str(tmp_path / "run"))
    exported = _peak("export", str(tmp_path / "run"), str(tmp_path / "out"))
    mb = lambda n: f"{n / 2**20:,.0f} MB"  # noqa: E731
    print(f"baseline {mb(base)}; import {mb(imported - base)} over it (shard {mb(shard)}, largest tensor "
          f"{mb(largest)}); export {mb(exported - base)} over it")
    assert imported - base <= shard + 1.5 * largest, (mb(imported - base), mb(shard + 1.5 * largest))
    assert exported - base <= 1.5 * largest, (mb(exported - base), mb(1.5 * largest))
    with safe_open(tmp_path / "out/model.safetensors", "pt") as f:  # 600 MB of bf16: one file
        assert set(f.keys()) == set(shapes)
        assert torch.equal(f.get_tensor("model.norm.weight"), torch.full((1024,), 1 / 1024, dtype=torch.bfloat16))
