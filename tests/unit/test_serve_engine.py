"""The continuous-batching engine without Ray: exactness, scheduling, sampling, stops, cancellation."""

from __future__ import annotations

import pytest
import torch

from cs3ray.models import PRESETS, KVCache, Transformer
from cs3ray.models.generate import SamplingParams, generate_ids
from cs3ray.serve.engine import Engine, EngineOptions, QueueFull
from cs3ray.serve.forward import Decode, Prefill, ragged_forward
from cs3ray.serve.kv import SlotCache
from cs3ray.serve.sequence import Event, GenRequest, Sequence

EOS = 257
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
# Every precision on every host (bf16 is emulated on AVX2-only CPUs: the shapes stay tiny). The
# tolerance is how far the engine's logits may be from the model's own forward in that precision:
# on CPU the engine keeps keys/values in fp32 (see kv.cache_dtype), the model in its own dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 4e-3}


def model(dtype: torch.dtype = torch.float32) -> Transformer:
    torch.manual_seed(0)
    return Transformer(PRESETS["tiny"]).eval().to(dtype)


def prompts(n: int) -> list[list[int]]:
    return [[EOS] + list(f"def f{i}(x):\n    return x * {i}".encode())[: 4 + 3 * i] for i in range(n)]


def run(engine: Engine, reqs: list[GenRequest]) -> list[list[Event]]:
    """Submit everything, step until idle; the events each request received."""
    events: list[list[Event]] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        r.emit = events[i].append
        engine.submit(r)
    while engine.waiting or engine.running:
        engine.step()
    return events


def text(evs: list[Event]) -> str:
    return "".join(e.text for e in evs)


@pytest.mark.parametrize("precision", DTYPES)
def test_ragged_forward_matches_the_model_with_its_own_cache(precision):
    dtype, tol = DTYPES[precision], TOL[precision]
    m = model(dtype)
    cache = SlotCache(m.args, 4, dtype)
    ids = torch.randint(0, 256, (1, 17))
    slot = cache.allocate()
    got = ragged_forward(m, cache, prefill=Prefill(ids, torch.tensor([17]), torch.tensor([slot])))
    ref_cache = KVCache(m.args, 1, 32, dtype)
    with torch.inference_mode():
        ref = m(ids, ref_cache)[:, -1]
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    nxt = torch.tensor([[7]])
    got = ragged_forward(m, cache, Decode(nxt[0], torch.tensor([17]), torch.tensor([slot])))
    with torch.inference_mode():
        ref = m(nxt, ref_cache)[:, -1]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    # ... and both stay within the precision's reach of the fp32 model.
    with torch.inference_mode():
        exact = model()(torch.cat([ids, nxt], 1))[:, -1]
    torch.testing.assert_close(got.float(), exact, rtol=tol, atol=tol)


@pytest.mark.parametrize("precision", DTYPES)
def test_one_forward_decodes_and_prefills_as_separate_forwards_would(precision):
    """A step that admits prompts while others decode gives each row what it would get alone
    (rows sit in any slots: a gathered read as well as a view)."""
    dtype, tol = DTYPES[precision], TOL[precision]
    m = model(dtype)
    prompt_a, prompt_b, prompt_c = (torch.randint(0, 256, (1, n)) for n in (9, 5, 12))

    def prefill(cache: SlotCache, ids: torch.Tensor, slot: int) -> torch.Tensor:
        return ragged_forward(m, cache, prefill=Prefill(ids, torch.tensor([ids.shape[1]]), torch.tensor([slot])))

    apart = SlotCache(m.args, 4, dtype)
    prefill(apart, prompt_a, 3)
    prefill(apart, prompt_b, 1)
    decodes = ragged_forward(m, apart, Decode(torch.tensor([5, 6]), torch.tensor([5, 9]), torch.tensor([1, 3])))
    prompts_ = [prefill(apart, prompt_c, 0), prefill(apart, prompt_b[:, :3], 2)]

    together = SlotCache(m.args, 4, dtype)
    prefill(together, prompt_a, 3)
    prefill(together, prompt_b, 1)
    padded = torch.cat([prompt_c, torch.cat([prompt_b[:, :3], torch.zeros(1, 9, dtype=torch.long)], 1)])
    mixed = ragged_forward(m, together, Decode(torch.tensor([5, 6]), torch.tensor([5, 9]), torch.tensor([1, 3])),
                           Prefill(padded, torch.tensor([12, 3]), torch.tensor([0, 2])))
    torch.testing.assert_close(mixed, torch.cat([decodes, *prompts_]), rtol=tol, atol=tol)
    for slot, n in ((0, 12), (1, 6), (2, 3), (3, 10)):  # what later steps will read matches too
        torch.testing.assert_close(together.k[:, slot, :, :n], apart.k[:, slot, :, :n], rtol=tol, atol=tol)


def test_greedy_is_identical_alone_and_in_a_full_batch_fp32():
    m = model()
    ps = prompts(8)
    alone = [run(Engine(m, EOS, EngineOptions(max_batch=1)), [GenRequest(p, GREEDY)])[0] for p in ps]
    batched = run(Engine(m, EOS, EngineOptions(max_batch=8)), [GenRequest(p, GREEDY) for p in ps])
    assert [text(e) for e in batched] == [text(e) for e in alone]
    # ... and both equal plain generation with the model's own KV cache.
    for p, evs in zip(ps, alone, strict=True):
        ref = generate_ids(m, p, GREEDY, stop_ids=(EOS,))
        assert text(evs) == bytes(t for t in ref if t < 256).decode("utf-8", errors="replace")
        assert evs[-1].completion_tokens == len(ref) and evs[-1].prompt_tokens == len(p)


@pytest.mark.parametrize("precision", DTYPES)
def test_engine_runs_prefill_decode_and_mixed_steps_in_every_precision(precision, monkeypatch):
    """Requests arriving while another decodes (mixed steps) in each precision: every token the
    engine picks greedily is the argmax of the model's own forward over the same ids, up to
    the precision's tolerance."""
    dtype, tol = DTYPES[precision], TOL[precision]
    m = model(dtype)
    picked: dict[int, list[int]] = {}
    accept = Sequence.accept
    monkeypatch.setattr(Sequence, "accept", lambda s, tok: (picked.setdefault(id(s.req), []).append(tok),
                                                            accept(s, tok))[1])
    engine = Engine(m, EOS, EngineOptions(max_batch=3))
    reqs = [GenRequest(p, SamplingParams(temperature=0.0, max_tokens=6), ignore_eos=True, emit=lambda e: None)
            for p in prompts(3)]
    engine.submit(reqs[0])
    engine.step()  # prefill only
    engine.step()  # decode only
    for r in reqs[1:]:
        engine.submit(r)
    mixed = False
    while engine.running or engine.waiting:
        mixed |= bool(engine.waiting) and any(s.pending is not None for s in engine.running)
        engine.step()
    assert mixed  # a step decoded and prefilled together
    for r in reqs:
        out = picked[id(r)]
        assert len(out) == 6
        with torch.inference_mode():
            logits = m(torch.tensor([r.prompt_ids + out[:-1]]))[0, len(r.prompt_ids) - 1:].float()
        chosen = logits.gather(1, torch.tensor(out).view(-1, 1)).squeeze(1)
        assert bool((logits.max(1).values - chosen <= 2 * tol).all()), (precision, out)


def test_sequences_join_and_leave_between_steps_and_queue_when_slots_are_full():
    m = model()
    engine = Engine(m, EOS, EngineOptions(max_batch=3))
    lengths = [2, 9, 4, 6, 3]
    reqs = [GenRequest(p, SamplingParams(temperature=0.0, max_tokens=n), ignore_eos=True)
            for p, n in zip(prompts(5), lengths, strict=True)]
    seen_running = []
    for r in reqs:
        engine.submit(r)
    events: list[list[Event]] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        r.emit = events[i].append
    while engine.waiting or engine.running:
        engine.step()
        seen_running.append(len(engine.running))
        assert engine.cache.free_slots == 3 - len(engine.running)
        # Running sequences always sit in the lowest slots (the cache is read as a view).
        assert sorted(s.slot for s in engine.running) == list(range(len(engine.running)))
    assert max(seen_running) == 3  # never more than the slots
    assert [e[-1].completion_tokens for e in events] == lengths
    assert all(e[-1].finish_reason == "length" for e in events)
    # The short first request finished long before the 9-token one: a new one took its slot.
    assert engine.steps < sum(lengths)


def test_budget_limits_slots():
    m = model()
    per_slot = m.args.n_layers * 2 * m.args.kv_heads * m.args.head_dim * 4 * m.args.max_seq_len
    cache = SlotCache.for_budget(m.args, 64, 5 * per_slot, torch.bfloat16)
    assert cache.slots == 5  # fp32 keys on CPU, whatever the model's dtype
    try:
        SlotCache.for_budget(m.args, 64, per_slot // 2, torch.float32)
    except ValueError as exc:
        assert "kv_cache_mb" in str(exc)
    else:
        raise AssertionError("a budget below one context must be refused")


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_tokens=16, seed=1234),
                                    SamplingParams(temperature=0.7, max_tokens=16, seed=99)])
def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(params):
    m = model()
    alone = run(Engine(m, EOS), [GenRequest(prompts(1)[0], params, ignore_eos=True)])[0]
    others = [GenRequest(p, SamplingParams(temperature=1.0, max_tokens=16, seed=i)) for i, p in enumerate(prompts(4))]
    mixed = run(Engine(m, EOS), others[:2] + [GenRequest(prompts(1)[0], params, ignore_eos=True)] + others[2:])[2]
    assert text(mixed) == text(alone)
    again = run(Engine(m, EOS), [GenRequest(prompts(1)[0], params, ignore_eos=True)])[0]
    assert text(again) == text(alone)  # same seed, same tokens


def test_stop_strings_are_cut_and_never_streamed():
    m = model()
    full = text(run(Engine(m, EOS), [GenRequest(prompts(1)[0], GREEDY, ignore_eos=True)])[0])
    stop = full[5:8]
    evs = run(Engine(m, EOS), [GenRequest(prompts(1)[0], GREEDY, stop=(stop,), ignore_eos=True)])[0]
    assert text(evs) == full[:full.index(stop)]
    assert evs[-1].finish_reason == "stop"


def test_cancel_frees_the_slot_and_queue_limit():
    m = model()
    engine = Engine(m, EOS, EngineOptions(max_batch=2, max_waiting=1))
    long = GenRequest(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=200), ignore_eos=True)
    events: list[Event] = []
    long.emit = events.append
    engine.submit(long)
    engine.step()
    engine.submit(GenRequest(prompts(1)[0], GREEDY, emit=lambda e: None))
    try:
        engine.submit(GenRequest(prompts(1)[0], GREEDY, emit=lambda e: None))
    except QueueFull:
        pass
    else:
        raise AssertionError("the waiting queue should be full")
    engine.cancel(long)
    engine.step()
    assert events[-1].finish_reason == "cancelled"
    assert all(s.req is not long for s in engine.running)
    # A request cancelled while still queued behind others never runs.
    blocker = [GenRequest(p, SamplingParams(temperature=0.0, max_tokens=50), ignore_eos=True, emit=lambda e: None)
               for p in prompts(2)]
    engine = Engine(m, EOS, EngineOptions(max_batch=1))
    queued: list[Event] = []
    late = GenRequest(prompts(1)[0], GREEDY, emit=queued.append)
    for r in [*blocker, late]:
        engine.submit(r)
    engine.step()
    engine.cancel(late)
    engine.step()
    assert late not in engine.waiting and queued[-1].finish_reason == "cancelled"


def test_swap_model_keeps_running_sequences():
    m = model()
    engine = Engine(m, EOS)
    req = GenRequest(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=20), ignore_eos=True)
    events: list[Event] = []
    req.emit = events.append
    engine.submit(req)
    for _ in range(5):
        engine.step()
    torch.manual_seed(1)
    engine.swap_model(Transformer(PRESETS["tiny"]).eval())
    while engine.running:
        engine.step()
    assert engine.model is not m
    assert events[-1].finish_reason == "length" and events[-1].completion_tokens == 20
    try:
        engine.swap_model(Transformer(PRESETS["small"]))
    except ValueError as exc:
        assert "shape" in str(exc)
    else:
        raise AssertionError("a different shape must be refused")
