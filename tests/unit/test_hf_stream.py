"""Hugging Face weights streamed: any slice read from the safetensors files equals that part of the whole,
each FSDP rank of train.init_from=hf:DIR reads about its share of the bytes and ends with the weights, and an
hf export of a checkpoint sharded over ranks' chunks holds the consolidated model's tensors."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from cs3ray.ckpt.export import consolidated_model, export
from cs3ray.ckpt.hf_import import HFWeights, read_fields, read_state
from cs3ray.ckpt.safetensors_io import SafetensorsDir
from cs3ray.errors import UserError
from cs3ray.models import ModelArgs
from cs3ray.models.hf_llama import from_hf, to_hf
from cs3ray.storage import open_url

from helpers.ranks import gloo_ranks
from helpers.strategy_checkpoints import save_and_load_every_strategy

transformers = pytest.importorskip("transformers")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=304, max_position_embeddings=64, tie_word_embeddings=False)
STRATEGIES = {"fsdp": ["parallel.strategy=fsdp"], "tp": ["parallel.tp=2"], "ddp": ["parallel.strategy=ddp"]}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """`make(precision)`: a random tiny Llama saved in that dtype, in shards with their index."""
    made = {}

    def make(precision: str):
        if precision not in made:
            torch.manual_seed(3)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).to(DTYPES[precision])
            made[precision] = tmp_path_factory.mktemp("hf")
            model.save_pretrained(made[precision], safe_serialization=True, max_shard_size="100KB")
        return made[precision]
    return make


def _whole(src) -> dict[str, torch.Tensor]:
    """The cs3ray state of a directory read by safetensors' own loader, all of it at once, as fp32."""
    fields = read_fields(open_url(str(src)))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update({k: v.float() for k, v in load_file(f).items()})
    return from_hf(tensors, ModelArgs(**{k: fields[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                                                 "vocab_size", "max_seq_len", "tie_embeddings")}))


@pytest.mark.parametrize("precision", DTYPES)
def test_any_slice_equals_that_part_of_the_whole(hf_dir, precision):
    src = hf_dir(precision)
    whole = _whole(src)
    storage = open_url(str(src))
    weights = HFWeights(storage, read_fields(storage))
    # Rows that cut q/k heads (16 rows each) in the middle, column ranges, a 1-D norm, all of a tensor.
    for key, offset, shape in [("blocks.0.attn.wq.weight", (5, 3), (40, 50)), ("blocks.1.attn.wk.weight", (9, 0), (9, 64)),
                               ("blocks.1.attn.wo.weight", (0, 33), (64, 31)), ("tok_emb.weight", (301, 7), (3, 2)),
                               ("norm.weight", (17,), (20,)), ("output.weight", (0, 0), (304, 64))]:
        out = torch.full(shape, float("nan"))
        weights.read_into(key, out, offset)
        part = whole[key][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        assert torch.equal(out, part), key
    state = read_state(storage, read_fields(storage), DTYPES[precision])
    assert set(state) == set(whole) and all(v.dtype == DTYPES[precision] for v in state.values())
    assert all(torch.equal(state[k].float(), whole[k]) for k in whole)


def _init_from(rank: int, world: int, results: dict, src: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from cs3ray.ckpt.finetune import load_init_weights
    from cs3ray.config import load_config
    from cs3ray.core.engine import ComputeCore
    from cs3ray.core.mesh import Topology

    read = []
    ranged = SafetensorsDir._range
    SafetensorsDir._range = lambda self, file, start, end: read.append(end - start) or ranged(self, file, start, end)
    for name, overrides in STRATEGIES.items():
        cfg = load_config(None, [f"train.init_from=hf:{src}", "train.seq_len=16", f"cluster.workers={world}",
                                 "precision=fp32", *overrides])
        core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, cfg.parallel.tp, ("n0",) * world))
        read.clear()
        assert load_init_weights(core.model, f"hf:{src}")["step"] == 0
        full = get_model_state_dict(core.model, options=StateDictOptions(full_state_dict=True))
        # numpy arrays travel by value (tensors through a queue need the sender alive)
        results[name] = {"bytes": sum(read), "state": {k: v.detach().float().numpy().copy() for k, v in full.items()}}


@pytest.mark.slow
@pytest.mark.parametrize("precision", DTYPES)
def test_each_rank_reads_its_share_into_its_shard(hf_dir, precision):
    src = hf_dir(precision)
    results = gloo_ranks(_init_from, 2, str(src))
    errors = [r["error"] for r in results.values() if "error" in r]
    assert not errors, errors[0]
    whole = _whole(src)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    for name in STRATEGIES:
        for rank in (0, 1):
            got = results[rank][name]["state"]
            assert set(got) == set(whole) and all(torch.equal(torch.from_numpy(got[k]), whole[k])
                                                             for k in whole), (name, rank)
        # FSDP splits every tensor by rows: half the weights each. TP splits q/k/v/w1/w3 by rows (read) and wo/w2
        # by columns (whole rows read, columns kept), and replicates the rest; DDP replicates everything.
        share = {"fsdp": (0.45, 0.55), "tp": (0.6, 0.9), "ddp": (0.95, 1.0)}[name]
        assert all(share[0] * size < results[r][name]["bytes"] <= share[1] * size for r in (0, 1)), \
            (name, size, [results[r][name]["bytes"] for r in (0, 1)])


@pytest.fixture(scope="module")
def strategy_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("strategies")
    save_and_load_every_strategy(str(root))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("precision", DTYPES)
@pytest.mark.parametrize("strategy", ["fsdp", "tp"])
def test_export_of_a_sharded_checkpoint_holds_the_consolidated_model(strategy_runs, tmp_path, strategy, precision):
    run = strategy_runs / strategy
    model, _ = consolidated_model(str(run))
    out = tmp_path / "out"
    r = export(str(run), str(out), "hf", dtype=DTYPES[precision])
    config = json.loads((out / "config.json").read_text())
    assert r["dtype"] == config["torch_dtype"] == str(DTYPES[precision]).removeprefix("torch.")
    args = ModelArgs(dim=config["hidden_size"], n_layers=config["num_hidden_layers"], n_heads=config["num_attention_heads"],
                     n_kv_heads=config["num_key_value_heads"], ffn_dim=config["intermediate_size"],
                     vocab_size=config["vocab_size"], max_seq_len=config["max_position_embeddings"],
                     tie_embeddings=config["tie_word_embeddings"])
    want = {k: v.to(DTYPES[precision]) for k, v in to_hf(model, args).items()}
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("case", ["overlong header", "past the end", "bad dtype"])
def test_a_malformed_safetensors_header_is_one_sentence(tmp_path, case):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                                 "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 300}))
    entry = {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}
    if case == "past the end":
        entry["data_offsets"] = [0, 2**40]
    if case == "bad dtype":
        entry["dtype"] = "PICKLE"
    head = json.dumps({"model.norm.weight": entry}).encode()
    n = 2**50 if case == "overlong header" else len(head)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", n) + head + b"\0" * 256)
    with pytest.raises(UserError, match=r"model.safetensors' is not a readable safetensors file \(.+\)\.$"):
        read_state(open_url(str(src)), read_fields(open_url(str(src))))
