"""Model shapes, KV-cache equivalence, tokenizer round trip, FLOPs by hand."""

import pytest
import torch

from cs3ray.models import PRESETS, ByteTokenizer, KVCache, ModelArgs, Transformer, param_count, train_flops_per_token
from cs3ray.models.generate import SamplingParams, generate_ids, sample_next
from cs3ray.models.transformer import rope_tables

SMALL = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=264, max_seq_len=64)


def test_shapes_and_param_count():
    for args in (SMALL, PRESETS["tiny"]):
        model = Transformer(args)
        out = model(torch.randint(0, 256, (3, 17)))
        assert out.shape == (3, 17, args.vocab_size)
        assert param_count(args) == sum(p.numel() for p in model.parameters())


def test_untied_embeddings_count_both_matrices():
    args = ModelArgs(dim=32, n_layers=1, n_heads=4, ffn_dim=64, vocab_size=264, max_seq_len=16, tie_embeddings=False)
    assert param_count(args) == sum(p.numel() for p in Transformer(args).parameters())


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    tokens = torch.randint(0, 256, (2, 20))
    full = model(tokens)
    cache = KVCache(SMALL, 2, 20, torch.float32)
    pieces = [model(tokens[:, :7], cache)]  # prefill
    for i in range(7, 20):  # then one token at a time
        pieces.append(model(tokens[:, i:i + 1], cache))
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_cast_to_half_keeps_its_rotary_tables_fp32(dtype):
    # bf16 has 8 mantissa bits: a bf16 cos/sin table rotates late positions by visibly wrong angles.
    model = Transformer(SMALL).to(dtype)
    cos, sin = rope_tables(SMALL.head_dim, SMALL.max_seq_len, SMALL.rope_theta)
    assert model.tok_emb.weight.dtype == dtype
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    assert model.float().rope_cos.dtype == torch.float32


def test_context_overflow_is_refused():
    model = Transformer(SMALL)
    try:
        model(torch.zeros(1, 65, dtype=torch.long))
    except ValueError as exc:
        assert "exceeds the model's context" in str(exc)
    else:
        raise AssertionError("no error")


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, 世界 \n\tdef f(): pass"
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == text
    assert ByteTokenizer.from_json(tok.to_json()) == tok
    assert tok.vocab_size <= PRESETS["tiny"].vocab_size


def test_flops_by_hand_for_a_tiny_model():
    args = ModelArgs(dim=8, n_layers=1, n_heads=2, ffn_dim=16, vocab_size=264, max_seq_len=16)
    # matmul params: q,k,v,o 4*8*8=256, mlp 3*8*16=384, output 264*8=2112 -> 2752
    # 6 * 2752 = 16512; attention: 6 * layers(1) * seq(4) * heads*head_dim(8) = 192
    assert train_flops_per_token(args, seq_len=4) == 16512 + 192


def test_sampling_greedy_topk_topp():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.9]])
    assert sample_next(logits, SamplingParams(temperature=0), None).item() == 1
    g = torch.Generator().manual_seed(0)
    picks = {sample_next(logits, SamplingParams(temperature=1.0, top_k=2), g).item() for _ in range(50)}
    assert picks <= {1, 3}
    picks = {sample_next(logits, SamplingParams(temperature=1.0, top_p=0.3), g).item() for _ in range(50)}
    assert picks == {1}


def test_generation_is_reproducible_with_a_seed():
    model = Transformer(SMALL).eval()
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=10, seed=3)
    a, b = generate_ids(model, [1, 2, 3], params), generate_ids(model, [1, 2, 3], params)
    assert a == b and len(a) == 10
