"""Every tensor cs3ray allocates for the data it serves follows that data's device.

No GPU here: the step runs on fake CPU tensors while cs3ray's own device-less allocations are sent
to `meta` (cs3ray.ops.device_probe), so one that would sit in host memory beside GPU data raises
FakeTensorDeviceMismatchError. The whole compute core runs that way (a rehearsal) for ddp, zero1
and fsdp, with and without tensor parallelism, codecs and precisions; the compressed all-reduce
also runs on its own under a fake process group.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

from cs3ray.core.compress.allreduce import CompressedAllReduce
from cs3ray.core.compress.codec import make_codec
from cs3ray.ops.device_probe import cs3ray_allocations_on
from cs3ray.ops.planner import PlanInput, shape
from cs3ray.ops.rehearsal import plan_config, rehearse

ARGS, N = shape(None, None, 2, 256, 4, 2, 768, 512, 128)


def _rehearse(precision: str, codec: str, ac: bool = False, strategy: str = "fsdp", tp: int = 1,
              workers: int = 8, pp: int = 1) -> dict:
    dp = workers // (tp * pp)
    p = PlanInput(ARGS, N, precision=precision, strategy=strategy, tp=tp, pp=pp, seq_len=128, codec=codec,
                  activation_checkpointing=ac, micro_batch=pp, global_batch=2 * pp * dp)  # two micro-batches a step
    return rehearse(plan_config(p, workers), workers, device_check=True)


# (strategy, tp, pp, workers): DDP and ZeRO-1 replicate tensor-parallel shards only without data parallelism.
LAYOUTS = [("ddp", 1, 1, 8), ("zero1", 1, 1, 8), ("fsdp", 2, 1, 8), ("zero1", 2, 1, 2), ("fsdp", 1, 2, 8),
           ("ddp", 1, 2, 4), ("zero1", 1, 2, 8), ("fsdp", 2, 2, 8), ("ddp", 2, 2, 4)]


def _layout_params(cases: list[dict]) -> list[int]:
    return [_rehearse(**case)["per_worker"]["param_bytes"] for case in cases]


def _rehearse_layout(cases: list[dict]) -> list[int]:
    """Rehearsals of one layout in a fresh process: torch's DTensor caches keep the meshes of an earlier fake
    group, and a later layout's tensors would get them (one rehearsal per process, as `cs3 plan` runs them)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_layout_params, (cases,))


@pytest.mark.parametrize("strategy, tp, pp, workers, precision, codec", [
    ("ddp", 1, 1, 8, "bf16", "int8"), ("zero1", 1, 1, 8, "fp16", "int4_sparse"), ("fsdp", 2, 1, 8, "bf16", "none"),
    ("ddp", 2, 1, 2, "fp16", "none"), ("fsdp", 2, 2, 8, "fp16", "none")])
def test_ddp_zero1_tensor_and_pipeline_parallel_allocate_on_their_datas_device(strategy, tp, pp, workers, precision,
                                                                               codec):
    case = {"precision": precision, "codec": codec, "strategy": strategy, "tp": tp, "workers": workers, "pp": pp}
    assert _rehearse_layout([case])[0] > 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy, tp, pp, workers", LAYOUTS)
def test_every_layout_allocates_on_its_datas_device(strategy, tp, pp, workers):
    # A codec compresses data-parallel traffic, and the config refuses it with pipelines.
    codecs = ["none"] if workers == tp * pp or pp > 1 else ["none", "int8", "int4_sparse"]
    cases = [{"precision": precision, "codec": codec, "strategy": strategy, "tp": tp, "workers": workers, "pp": pp}
             for precision in ("bf16", "fp16") for codec in codecs]
    assert all(n > 0 for n in _rehearse_layout(cases))


@pytest.mark.parametrize("precision, codec", [("bf16", "none"), ("fp16", "int8"), ("bf16", "int4_sparse")])
def test_the_compute_core_allocates_on_its_datas_device(precision, codec):
    out = _rehearse(precision, codec)
    assert out["per_worker"]["param_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("codec", ["none", "int8", "int4_sparse"])
@pytest.mark.parametrize("ac", [False, True])
def test_every_fsdp_combination_allocates_on_its_datas_device(precision, codec, ac):
    _rehearse(precision, codec, ac)


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("codec", ["int8", "int4_sparse", "bf16"])
def test_the_compressed_all_reduce_allocates_on_its_datas_device(fake_group, codec):
    reducer = CompressedAllReduce(make_codec(codec, 0.1))
    try:
        with FakeTensorMode(), cs3ray_allocations_on("meta"):
            grads = torch.randn(4 * 1000 + 3)  # a length that needs padding
            out, _ = reducer.all_reduce("bucket", grads)
            assert out.device == grads.device
            shard = torch.empty(1001)
            reducer.reduce_scatter("shards", grads[:4 * 1001], shard)  # the zero1 / FSDP form
            assert all(r.device == grads.device for r in reducer.feedback.residuals.values())
    finally:
        reducer.close()  # (its communication thread, the DDP hook's, is not used: fake mode stays on this thread)


def test_a_host_allocation_beside_the_data_is_caught():
    # What the check finds: a buffer made without `device=` in a cs3ray module, met by the data.
    scope = {"__name__": "cs3ray.example", "torch": torch}
    exec("def scale(x):\n    return x * torch.ones(x.shape)\n", scope)  # noqa: S102 - a module of our own
    with FakeTensorMode():
        x = torch.randn(8)
        assert scope["scale"](x).shape == x.shape
        with cs3ray_allocations_on("meta"), pytest.raises(FakeTensorDeviceMismatchError):
            scope["scale"](x)


def test_serving_allocates_on_the_models_device():
    # The built-in engine (continuous batching, slot KV cache, sampling) and `cs3 generate`'s loop, with every
    # device-less allocation of cs3ray's sent to `meta`: the model's data is on the CPU, so any such tensor
    # meeting it (or read back to the host) raises. Outputs equal the same runs without the check.
    from cs3ray.models import PRESETS, Transformer
    from cs3ray.models.generate import SamplingParams, generate_ids
    from cs3ray.serve.engine import Engine
    from cs3ray.serve.sequence import GenRequest

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    prompts = [[257, *range(40 + i, 44 + 3 * i)] for i in range(4)]

    def serve() -> list:
        reqs = [GenRequest(p, SamplingParams(temperature=0.8 * (i % 2), top_k=20, top_p=0.9, max_tokens=8, seed=i),
                           ignore_eos=True) for i, p in enumerate(prompts)]
        out = [""] * len(reqs)
        engine = Engine(model, 257)
        for i, r in enumerate(reqs):
            r.emit = lambda ev, i=i: out.__setitem__(i, out[i] + ev.text)
            engine.submit(r)
        while engine.waiting or engine.running:
            engine.step()
        generated = generate_ids(model, prompts[0], SamplingParams(temperature=0.7, max_tokens=6, seed=3))
        return [*out, generated]

    expected = serve()
    assert all(expected[:4]) and expected[4]
    with cs3ray_allocations_on("meta"):
        assert serve() == expected
