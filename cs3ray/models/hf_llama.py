"""Hugging Face Llama <-> cs3ray's Transformer: config fields, tensor names and the rotary layout.

Mapping only (and reading config.json): the importer and exporter (cs3ray.ckpt.hf_import, hf_export)
read and write the weights. Hugging Face rotates the halves of each head (rotate_half: dimension i pairs with
i + head_dim/2) while cs3ray rotates adjacent pairs (2i, 2i+1), so the rows of wq and wk are
permuted per head on the way in and back on the way out.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from cs3ray.errors import UserError
from cs3ray.storage import open_url

from .args import ModelArgs
from .bpe import BOS, EOS, PAD, BPETokenizer, byte_symbols
from .tokenizer import ByteTokenizer

if TYPE_CHECKING:  # torch is imported where tensors are handled: reading a config needs none
    import torch

ARCHITECTURE = "LlamaForCausalLM"
PREFIX = "hf:"  # train.init_from: hf:DIR names a Hugging Face directory, not a cs3ray run
# The `model` fields a config.json determines.
SHAPE_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len", "rope_theta",
                "norm_eps", "tie_embeddings")

# Per block: Hugging Face name (after "model.layers.N.") -> cs3ray name (after "blocks.N.").
_BLOCK = {
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "mlp.gate_proj.weight": "ffn.w1.weight",
    "mlp.up_proj.weight": "ffn.w3.weight",
    "mlp.down_proj.weight": "ffn.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_TOP = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight"}
# Derived buffers some older checkpoints carry; recomputed from the config, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFModelError(UserError):
    """A Hugging Face directory cannot be imported (architecture, field, tensor); the message names it."""


def hf_path(init_from: str) -> str | None:
    """The directory of a `hf:DIR` train.init_from value, else None."""
    return init_from[len(PREFIX):] if init_from.startswith(PREFIX) else None


def read_config(src: str, options: dict | None = None) -> dict:
    """The parsed config.json of a Hugging Face directory (a local path or an fsspec URL)."""
    storage = open_url(src, options)
    if not storage.exists():
        raise HFModelError(f"Hugging Face model directory '{storage.url}' does not exist.")
    if not storage.exists("config.json"):
        raise HFModelError(f"'{storage.url}' has no config.json: it is not a Hugging Face model directory.")
    try:
        return json.loads(storage.read_text("config.json"))
    except (ValueError, UnicodeDecodeError):
        raise HFModelError(f"'{storage.url}/config.json' is not valid JSON.") from None


def _int(config: dict, key: str, source: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFModelError(f"{source} has {key}={value!r}; a positive integer is needed.")
    return value


def _rope_theta(config: dict, source: str) -> float:
    """rope_theta of a v4 config (rope_theta + rope_scaling) or a v5 one (rope_parameters)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = config.get(key)
        if rope is None:
            continue
        if not isinstance(rope, dict):
            raise HFModelError(f"{source} has {key}={rope!r}; cs3ray reads a mapping or null there.")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise HFModelError(f"{source} uses {key} of type '{kind}'; cs3ray supports only the default (unscaled) "
                               "rotary embedding.")
        if "rope_theta" in rope:
            config = {**config, "rope_theta": rope["rope_theta"]}
    theta = config.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise HFModelError(f"{source} has rope_theta={theta!r}; a positive number is needed.")
    return float(theta)


def model_fields(config: Any, source: str = "config.json") -> dict[str, Any]:
    """The `model` section fields of a Llama config.json; anything cs3ray's Transformer cannot run is refused."""
    if not isinstance(config, dict):
        raise HFModelError(f"{source} is not a JSON object.")
    kind, archs = config.get("model_type"), config.get("architectures")
    if kind != "llama" or (archs is not None and archs != [ARCHITECTURE]):
        named = ", ".join(map(str, archs or [])) or "no architectures"
        raise HFModelError(f"{source} describes a model_type '{kind}' model ({named}); cs3ray imports the Llama "
                           f"architecture ({ARCHITECTURE}) only.")
    refused = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
    for key, wanted in refused.items():
        if config.get(key, wanted) != wanted:
            raise HFModelError(f"{source} has {key}={config[key]!r}; cs3ray's Llama supports only {key}={wanted!r}.")
    if config.get("attention_dropout", 0.0) not in (0, 0.0):
        raise HFModelError(f"{source} has attention_dropout={config['attention_dropout']!r}; cs3ray's transformer "
                           "has no dropout (set it to 0).")
    dim, heads = _int(config, "hidden_size", source), _int(config, "num_attention_heads", source)
    kv_heads = _int(config, "num_key_value_heads", source, heads)
    if dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise HFModelError(f"{source} has hidden_size={dim}, num_attention_heads={heads} and num_key_value_heads="
                           f"{kv_heads}; cs3ray needs heads dividing hidden_size, an even head size and kv heads "
                           "dividing heads.")
    if config.get("head_dim") not in (None, dim // heads):
        raise HFModelError(f"{source} has head_dim={config['head_dim']!r}, not hidden_size/num_attention_heads="
                           f"{dim // heads}; cs3ray derives the head size from the width.")
    eps = config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise HFModelError(f"{source} has rms_norm_eps={eps!r}; a positive number is needed.")
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise HFModelError(f"{source} has tie_word_embeddings={tie!r}; true or false is needed.")
    return {"preset": None, "dim": dim, "n_layers": _int(config, "num_hidden_layers", source), "n_heads": heads,
            "n_kv_heads": kv_heads, "ffn_dim": _int(config, "intermediate_size", source),
            "vocab_size": _int(config, "vocab_size", source),
            "max_seq_len": _int(config, "max_position_embeddings", source, 2048),
            "rope_theta": _rope_theta(config, source), "norm_eps": float(eps), "tie_embeddings": tie}


def hf_config(args: ModelArgs, bos_id: int, eos_id: int, pad_id: int, dtype: str = "float32") -> dict[str, Any]:
    """config.json of a cs3ray model for transformers' LlamaForCausalLM (the inverse of model_fields)."""
    return {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": args.dim,
            "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "vocab_size": args.vocab_size,
            "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta,
            "rope_scaling": None, "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "bos_token_id": bos_id,
            "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": dtype, "use_cache": True}


def _rotary_rows(w: torch.Tensor, heads: int, to_pairs: bool) -> torch.Tensor:
    """Reorder the output rows of a q/k projection per head: halves -> adjacent pairs, or back."""
    hd = w.shape[0] // heads
    split = (heads, 2, hd // 2) if to_pairs else (heads, hd // 2, 2)
    return w.reshape(*split, w.shape[1]).transpose(1, 2).reshape(w.shape).contiguous()


def from_hf(tensors: dict[str, torch.Tensor], args: ModelArgs,
            source: str = "the checkpoint") -> dict[str, torch.Tensor]:
    """cs3ray state dict (tied output included) from Hugging Face Llama tensors; extra or missing names are refused."""
    import torch

    from .transformer import Transformer

    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        expected = Transformer(args).state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        parts = name.split(".", 3)
        if name in _TOP:
            key = _TOP[name]
        elif parts[:2] == ["model", "layers"] and len(parts) == 4 and parts[3] in _BLOCK and parts[2].isdigit() \
                and int(parts[2]) < args.n_layers:
            key = f"blocks.{int(parts[2])}.{_BLOCK[parts[3]]}"
        else:
            raise HFModelError(f"{source} holds tensor '{name}', which cs3ray's Llama has no place for.")
        if t.shape != expected[key].shape:
            raise HFModelError(f"{source} holds '{name}' of shape {tuple(t.shape)}, but its config.json makes it "
                               f"{tuple(expected[key].shape)}.")
        if key.endswith(("wq.weight", "wk.weight")):
            t = _rotary_rows(t, args.n_heads if key.endswith("wq.weight") else args.kv_heads, to_pairs=True)
        out[key] = t
    if args.tie_embeddings:
        head, emb = out.get("output.weight"), out.get("tok_emb.weight")
        if head is not None and emb is not None and not torch.equal(head, emb):
            raise HFModelError(f"{source} sets tie_word_embeddings but holds an lm_head.weight different from the "
                               "embedding.")
        if "tok_emb.weight" in out:
            out["output.weight"] = out["tok_emb.weight"]
    missing = [hf for hf, cs in names(args).items() if cs not in out]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise HFModelError(f"{source} lacks tensor '{missing[0]}'{more}.")
    return out


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face Llama tensors of a cs3ray state dict (lm_head left out when the embeddings are tied)."""
    out = {}
    for hf, cs in names(args).items():
        t = state[cs]
        if cs.endswith(("wq.weight", "wk.weight")):
            t = _rotary_rows(t, args.n_heads if cs.endswith("wq.weight") else args.kv_heads, to_pairs=False)
        out[hf] = t.contiguous()
    return out


def names(args: ModelArgs) -> dict[str, str]:
    """Hugging Face name -> cs3ray name of every tensor a Llama of this shape stores."""
    out = {hf: cs for hf, cs in _TOP.items() if not (args.tie_embeddings and hf == "lm_head.weight")}
    for i in range(args.n_layers):
        out.update({f"model.layers.{i}.{hf}": f"blocks.{i}.{cs}" for hf, cs in _BLOCK.items()})
    return out


def _byte_tokenizer_json(tok: ByteTokenizer) -> str:
    """The byte tokenizer as a Hugging Face tokenizer.json: ids 0..255 the bytes (no merges), then its specials."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(byte_symbols())}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    specials = sorted([(tok.bos_id, BOS), (tok.eos_id, EOS), (tok.pad_id, PAD)])
    if [i for i, _ in specials] != list(range(256, 256 + len(specials))):
        raise HFModelError(f"the byte tokenizer's specials {specials} do not follow the 256 bytes.")
    hf.add_special_tokens([AddedToken(name, special=True) for _, name in specials])
    return hf.to_str(pretty=True)


def tokenizer_from_hf(text: str, source: str) -> ByteTokenizer | BPETokenizer:
    """The tokenizer of a Hugging Face tokenizer.json; the byte tokenizer an export wrote comes back as itself."""
    tok = BPETokenizer(text, source=source)
    byte = ByteTokenizer()
    if tok.vocab_size == byte.vocab_size and tok.hf_json == BPETokenizer(_byte_tokenizer_json(byte)).hf_json:
        return byte
    return tok


def tokenizer_files(tok: ByteTokenizer | BPETokenizer, max_len: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer

    text = tok.hf_text() if isinstance(tok, BPETokenizer) else _byte_tokenizer_json(tok)
    hf = Tokenizer.from_str(text)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "bos_token": hf.id_to_token(tok.bos_id), "eos_token": hf.id_to_token(tok.eos_id),
              "pad_token": hf.id_to_token(tok.pad_id), "clean_up_tokenization_spaces": False}
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2)}
