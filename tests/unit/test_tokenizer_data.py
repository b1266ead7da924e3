"""A BPE tokenizer travels with the shards and inside checkpoints: generate and export decode with it, and a
changed tokenizer against existing shards or checkpoints is one clear error (no Ray)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_tokenizer import TEXT, write_corpus
from typer.testing import CliRunner

from cs3ray.ckpt import load_for_inference
from cs3ray.ckpt.export import export
from cs3ray.config import load_config
from cs3ray.data import (
    ShardSpec,
    ensure_shards,
    open_corpus,
    prepare_shards,
    read_split,
    shard_tokenizer,
    train_tokenizer,
)
from cs3ray.models import BPETokenizer, ByteTokenizer, TokenizerError, Transformer, load_tokenizer, tokenizer_from_json
from cs3ray.models.generate import SamplingParams, generate_ids, generate_text
from cs3ray.serve.deploy import make_spec
from cs3ray.serve.engine import Engine, EngineOptions
from cs3ray.serve.follow import Follower
from cs3ray.serve.sequence import GenRequest
from cs3ray.storage import open_url
from cs3ray.train.driver import check_tokenizer
from cs3ray_cli.main import app

from helpers.serve_checkpoints import make_checkpoint

SPEC = ShardSpec(seq_len=32, samples_per_shard=50, val_fraction=0.1, max_bytes=1_000_000, seed=0)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> tuple[str, str, BPETokenizer]:
    """(corpus dir, tokenizer dir, tokenizer): a BPE with 300 ids."""
    root = tmp_path_factory.mktemp("bpe-data")
    corpus = write_corpus(root / "corpus")
    train_tokenizer(corpus, 300, str(root / "tok"))
    return corpus, str(root / "tok"), load_tokenizer(str(root / "tok"))


def test_shards_made_with_a_bpe_carry_it_in_their_manifest(bpe, tmp_path):
    corpus, folder, tok = bpe
    dest = open_url(str(tmp_path / "shards"))
    m = prepare_shards(open_corpus(corpus), dest, SPEC, tokenizer=tok)
    assert m["tokenizer"]["type"] == "bpe" and m["tokenizer"]["vocab_size"] == 300
    assert shard_tokenizer(m, dest.url).encode(TEXT) == tok.encode(TEXT)
    train = read_split(dest, m, "train")
    assert train.shape[1] == 33 and train.max() < 300
    docs = "".join(open(f"{corpus}/doc{i}.txt", encoding="utf-8").read() for i in range(6))
    pieces = tok.decode(list(train[0])).split("\n")
    assert all(p in docs for p in pieces[1:-1])  # whole lines of the corpus, tokenized by the BPE
    # Fewer tokens than bytes: the BPE shard set is smaller than the byte one of the same corpus.
    byte = prepare_shards(open_corpus(corpus), open_url(str(tmp_path / "byte")), SPEC)
    assert m["tokens"] < 0.7 * byte["tokens"] and byte["tokenizer"] == json.loads(ByteTokenizer().to_json())
    # The cache key covers the tokenizer: byte and BPE shard sets of one corpus do not collide.
    d1, _ = ensure_shards(corpus, str(tmp_path / "cache"), SPEC)
    d2, m2 = ensure_shards(corpus, str(tmp_path / "cache"), SPEC, tokenizer=tok)
    assert d1.url != d2.url and m2["tokenizer"]["type"] == "bpe"


def test_a_changed_tokenizer_against_existing_shards_is_one_clear_error(bpe, tmp_path):
    corpus, _, tok = bpe
    dest = open_url(str(tmp_path / "shards"))
    prepare_shards(open_corpus(corpus), dest, SPEC)
    with pytest.raises(TokenizerError) as err:
        prepare_shards(open_corpus(corpus), dest, SPEC, tokenizer=tok)
    msg = str(err.value)
    assert "tokenizer byte" in msg and "bpe (vocab 300" in msg and dest.url in msg and len(msg.splitlines()) == 1
    # A manifest edited to name another tokenizer is refused by the cache lookup too.
    cached, manifest = ensure_shards(corpus, str(tmp_path / "cache"), SPEC, tokenizer=tok)
    manifest["tokenizer"] = json.loads(ByteTokenizer().to_json())
    cached.write_text(json.dumps(manifest), "manifest.json")
    with pytest.raises(TokenizerError, match="made with tokenizer byte, but the config names bpe"):
        ensure_shards(corpus, str(tmp_path / "cache"), SPEC, tokenizer=tok)


def test_a_bpe_checkpoint_loads_for_inference_and_generate_and_export_decode_with_it(bpe, tmp_path):
    _, folder, tok = bpe
    run = tmp_path / "run"
    make_checkpoint(run, step=2, overrides=[f"data.tokenizer={folder}"], tokenizer_json=tok.to_json())
    stored = json.loads((run / "step-00000002" / "tokenizer.json").read_text())
    assert stored["type"] == "bpe" and stored["hf"]["model"]["type"] == "BPE"
    loaded = load_for_inference(str(run))
    assert isinstance(loaded.tokenizer, BPETokenizer) and loaded.model.args.vocab_size == 304
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(TEXT)) == TEXT
    out = generate_text(loaded.model, loaded.tokenizer, TEXT, SamplingParams(temperature=0.0, max_tokens=8, seed=0))
    assert out == loaded.tokenizer.decode(loaded.tokenizer.encode(out))  # text made of the BPE's tokens
    res = CliRunner().invoke(app, ["generate", str(run), "--prompt", "héllo", "--max-tokens", "5",
                                   "--temperature", "0", "--dtype", "fp32"])
    assert res.exit_code == 0 and res.stdout.startswith("héllo"), res.output
    info = export(str(run), str(tmp_path / "model.safetensors"))
    with safe_open(info["path"], "pt") as f:
        exported = tokenizer_from_json(f.metadata()["tokenizer"])
    assert exported.encode(TEXT) == tok.encode(TEXT)
    info = export(str(run), str(tmp_path / "model.pt"), "torch")  # no metadata: the tokenizer goes beside it
    assert info["tokenizer"] == str(tmp_path / "model.tokenizer.json")
    assert tokenizer_from_json((tmp_path / "model.tokenizer.json").read_text()).encode(TEXT) == tok.encode(TEXT)
    # A checkpoint written before BPE support (today's byte JSON) still loads with the byte tokenizer.
    make_checkpoint(tmp_path / "old", step=1)
    assert load_for_inference(str(tmp_path / "old")).tokenizer == ByteTokenizer()


def test_resuming_or_initializing_with_another_tokenizer_is_one_clear_error(bpe, tmp_path):
    _, folder, tok = bpe
    run = tmp_path / "run"
    make_checkpoint(run, step=3, overrides=[f"data.tokenizer={folder}"], tokenizer_json=tok.to_json())
    same = load_config(None, [f"run.dir={run}", f"data.tokenizer={folder}"])
    check_tokenizer(same, open_url(str(run)), resume=True)
    byte = load_config(None, [f"run.dir={run}", "model.vocab_size=304"])
    with pytest.raises(TokenizerError) as err:
        check_tokenizer(byte, open_url(str(run)), resume=True)
    msg = str(err.value)
    assert "step-00000003" in msg and "bpe (vocab 300" in msg and "names byte" in msg and len(msg.splitlines()) == 1
    check_tokenizer(byte, open_url(str(run)), resume=False)  # a fresh run does not read old checkpoints
    fresh = load_config(None, [f"run.dir={tmp_path}/new", "model.vocab_size=304", f"train.init_from={run}"])
    with pytest.raises(TokenizerError, match="names byte"):
        check_tokenizer(fresh, open_url(str(tmp_path / "new")), resume=False)


def test_the_engine_streams_bpe_text_and_follow_refuses_weights_of_another_tokenizer(bpe, tmp_path):
    _, folder, tok = bpe
    cfg = load_config(None, [f"data.tokenizer={folder}"])
    torch.manual_seed(0)
    model = Transformer(cfg.model.args()).eval()
    prompt = [tok.eos_id] + tok.encode(TEXT)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    engine = Engine(model, tok.eos_id, EngineOptions(max_batch=1, kv_cache_mb=4), token_bytes=tok.token_bytes())
    events: list = []
    engine.submit(GenRequest(prompt, params, ignore_eos=True, emit=events.append))
    while engine.waiting or engine.running:
        engine.step()
    ref = generate_ids(model, prompt, params, stop_ids=())
    assert "".join(e.text for e in events) == tok.decode(ref) != ""
    # --follow: a newer checkpoint made with another tokenizer is not swapped in (the engine decodes with ours).
    run = tmp_path / "run"
    make_checkpoint(run, step=1, overrides=[f"data.tokenizer={folder}"], tokenizer_json=tok.to_json())
    spec = make_spec(str(run))
    swapped = []
    follower = Follower(spec, str(run / "step-00000001"), lambda m, s: swapped.append(s), "cpu", torch.float32,
                        load_for_inference(str(run)).tokenizer)
    follower.stop()
    make_checkpoint(run, step=2, overrides=[f"data.tokenizer={folder}"], tokenizer_json=tok.to_json())
    assert follower.poll() and swapped == [2]
    make_checkpoint(run, step=3, overrides=["model.vocab_size=304"])
    with pytest.raises(TokenizerError, match="step-00000003' was made with tokenizer byte, but the served model"):
        follower.poll()
    assert swapped == [2]
