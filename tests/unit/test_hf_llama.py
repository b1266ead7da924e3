"""Hugging Face Llama in and out: tiny random LlamaForCausalLM models made by transformers on the spot (no
download) import with equal fp32 logits, export back to a directory transformers loads with equal logits, and
bad directories end in one sentence."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from cs3ray.ckpt import list_checkpoints, load_for_inference
from cs3ray.ckpt.export import export
from cs3ray.ckpt.finetune import load_init_weights
from cs3ray.ckpt.hf_export import export_hf
from cs3ray.ckpt.hf_import import import_hf
from cs3ray.config import ConfigError, load_config
from cs3ray.errors import UserError
from cs3ray.models import BPETokenizer, ByteTokenizer, Transformer, train_bpe
from cs3ray.models.generate import SamplingParams, generate_ids

from conftest import ROOT, run_cs3
from helpers.serve_checkpoints import make_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 304
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0)


@pytest.fixture(scope="module")
def tokenizer() -> BPETokenizer:
    return train_bpe(["def f(x):\n    return x + 1\n" * 20, "hello world, some text to merge " * 20], 300)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, tokenizer):
    """`make(tie, tokenizer=True)`: (directory, model) of a random tiny Llama saved in shards with their index."""
    made = {}

    def make(tie: bool, with_tokenizer: bool = True):
        key = (tie, with_tokenizer)
        if key not in made:
            torch.manual_seed(len(made))
            config = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=tie, bos_token_id=tokenizer.bos_id,
                                              eos_token_id=tokenizer.eos_id)
            model = transformers.LlamaForCausalLM(config).eval()
            path = tmp_path_factory.mktemp("hf")
            model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB")
            if with_tokenizer:
                (path / "tokenizer.json").write_text(tokenizer.hf_text())
            made[key] = path, model
        return made[key]
    return make


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_import_gives_the_logits_of_transformers(hf_dirs, tokenizer, tmp_path, tie):
    src, hf = hf_dirs(tie)
    assert (src / "model.safetensors.index.json").exists() and not (src / "model.safetensors").exists()
    info = import_hf(str(src), str(tmp_path / "run"))
    assert info["step"] == 0 and info["params"] == sum(p.numel() for p in hf.parameters())
    assert [c["step"] for c in list_checkpoints(str(tmp_path / "run"))["checkpoints"]] == [0]

    loaded = load_for_inference(str(tmp_path / "run"))
    assert loaded.model.args.tie_embeddings is tie and loaded.model.args.norm_eps == 1e-5
    assert loaded.tokenizer.to_json() == tokenizer.to_json()  # the directory's tokenizer is kept
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), hf(x).logits, rtol=0, atol=1e-4)
        # What `cs3 generate` / serve produce: greedy tokens equal transformers' own generate.
        prompt = x[0, :8].tolist()
        ours = generate_ids(loaded.model, prompt, SamplingParams(temperature=0.0, max_tokens=8))
        theirs = hf.generate(x[:1, :8], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, 8:].tolist()
    assert ours == theirs


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_round_trip_loads_in_transformers(hf_dirs, tokenizer, tmp_path, tie):
    src, hf = hf_dirs(tie)
    import_hf(str(src), str(tmp_path / "run"))
    out = tmp_path / "out"
    # Untied through export()'s format table; tied in shards small enough to need an index.
    r = export_hf(str(tmp_path / "run"), str(out), shard_bytes=100_000) if tie else export(
        str(tmp_path / "run"), str(out), "hf")
    assert (out / "model.safetensors.index.json").exists() is tie and r["step"] == 0
    back = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert back.config.tie_word_embeddings is tie  # rope_theta 5000 (not the default) shows in the logits
    x = _ids(1)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, rtol=0, atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1"
    assert tok(text)["input_ids"] == tokenizer.encode(text) and tok.eos_token_id == tokenizer.eos_id


def test_a_directory_without_tokenizer_uses_the_byte_tokenizer_and_exports_it(hf_dirs, tmp_path):
    src, hf = hf_dirs(True, with_tokenizer=False)
    said = []
    import_hf(str(src), str(tmp_path / "run"), note=said.append)
    assert len(said) == 1 and "byte tokenizer" in said[0]
    assert isinstance(load_for_inference(str(tmp_path / "run")).tokenizer, ByteTokenizer)
    export(str(tmp_path / "run"), str(tmp_path / "out"), "hf", dtype=torch.bfloat16)
    assert json.loads((tmp_path / "out/config.json").read_text())["torch_dtype"] == "bfloat16"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("héllo")["input_ids"] == list("héllo".encode()) and tok.eos_token_id == ByteTokenizer().eos_id
    # Imported again, the exported byte tokenizer is the byte tokenizer (runs on byte shards may continue).
    import_hf(str(tmp_path / "out"), str(tmp_path / "again"), note=said.append)
    assert isinstance(load_for_inference(str(tmp_path / "again")).tokenizer, ByteTokenizer) and len(said) == 1


def test_import_from_an_fsspec_url(hf_dirs, tmp_path):
    import fsspec

    src, hf = hf_dirs(False)
    fs = fsspec.filesystem("memory")
    for f in src.iterdir():
        fs.pipe(f"/hf-import/{f.name}", f.read_bytes())
    try:
        import_hf("memory://hf-import", str(tmp_path / "run"))
    finally:
        fs.rm("/hf-import", recursive=True)
    loaded = load_for_inference(str(tmp_path / "run"))
    x = _ids(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(x), hf(x).logits, rtol=0, atol=1e-4)


def test_init_from_hf_takes_the_shape_and_weights(hf_dirs, tokenizer):
    src, hf = hf_dirs(False)
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"train.init_from=hf:{src}", f"data.tokenizer={src}",
                                                     "train.seq_len=32"])
    assert (cfg.model.dim, cfg.model.n_kv_heads, cfg.model.vocab_size, cfg.model.norm_eps) == (64, 2, VOCAB, 1e-5)
    torch.manual_seed(9)
    model = Transformer(cfg.model.args())
    assert load_init_weights(model, f"hf:{src}")["step"] == 0
    x = _ids(2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-4)
    with pytest.raises(ConfigError, match=r"model.dim=128 differs from the 64 of the Hugging Face model"):
        load_config(ROOT / "configs/tiny.yaml", [f"train.init_from=hf:{src}", "model.dim=128", "train.seq_len=32"])


def _broken(src, tmp_path, change):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    change(bad, config)
    (bad / "config.json").write_text(json.dumps(config))
    return bad


def _drop_shard(bad, config):
    sorted(bad.glob("model-*.safetensors"))[1].unlink()


BAD = {
    "missing shard": (_drop_shard, r"lacks the shard 'model-00002-of-\d+.safetensors' that model.safetensors.index"),
    "other architecture": (lambda b, c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
                           r"describes a model_type 'gpt2' model \(GPT2LMHeadModel\); cs3ray imports the Llama"),
    "scaled rope": (lambda b, c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}),
                    r"uses rope_parameters of type 'llama3'; cs3ray supports only the default"),
    "attention bias": (lambda b, c: c.update(attention_bias=True), r"has attention_bias=True; cs3ray's Llama supports"),
    "head_dim": (lambda b, c: c.update(head_dim=32), r"has head_dim=32, not hidden_size/num_attention_heads=16"),
    "shape": (lambda b, c: c.update(intermediate_size=96),
              r"holds 'model.layers.\d.mlp.\w+_proj.weight' of shape \((128, 64|64, 128)\), but its config.json "
              r"makes it \((96, 64|64, 96)\)\.$"),
    "no tokenizer, small vocab": (lambda b, c: ((b / "tokenizer.json").unlink(), c.update(vocab_size=200)),
                                  r"has no tokenizer.json and its 200 ids are too few for the byte tokenizer's 259"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_directories_are_one_sentence(hf_dirs, tmp_path, case):
    change, message = BAD[case]
    bad = _broken(hf_dirs(False)[0], tmp_path, change)
    with pytest.raises(UserError, match=message):
        import_hf(str(bad), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_cli_imports_and_refuses_in_one_line(hf_dirs, tmp_path):
    src, _ = hf_dirs(True)
    ok = run_cs3(["ckpt", "import-hf", str(src), "--name", str(tmp_path / "run"), "--json"], check=True)
    assert json.loads(ok.stdout.strip().splitlines()[-1])["step"] == 0
    # `cs3 generate` runs the imported model with the directory's tokenizer (serve loads it the same way).
    gen = run_cs3(["generate", str(tmp_path / "run"), "--prompt", "def f(x):", "--max-tokens", "6",
                   "--temperature", "0", "--dtype", "fp32"], check=True)
    assert gen.stdout.strip()
    with pytest.raises(UserError, match="already has checkpoints; import into a new run name"):
        import_hf(str(src), str(tmp_path / "run"))
    bad = _broken(src, tmp_path, lambda b, c: c.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    proc = run_cs3(["ckpt", "import-hf", str(bad), "--name", str(tmp_path / "other")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "model_type 'gpt2'" in proc.stderr


def test_export_refuses_a_custom_model_target(tmp_path):
    make_checkpoint(tmp_path / "run", overrides=["model.target=mypkg.models:build"])
    with pytest.raises(UserError, match=r"model.target 'mypkg.models:build' model; --format hf exports cs3ray's"):
        export(str(tmp_path / "run"), str(tmp_path / "out"), "hf")
