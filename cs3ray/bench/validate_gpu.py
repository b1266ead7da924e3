"""`cs3 validate`'s GPU items, run as Ray actors and tasks holding GPUs on the cluster's GPU nodes.

nccl all-reduce bus bandwidth (nccl-tests' busbw) within a node and across two nodes, training MFU of a
model sized to the device against its measured bf16 peak, and every GPU node's health through NVML.
Each function returns what `validate` judges; a cluster without GPUs never reaches them.
"""

from __future__ import annotations

import statistics
from typing import Any

from .comm import busbw_gbps

MIB = 1 << 20


def gpu_nodes(nodes: list[dict[str, Any]]) -> dict[str, int]:
    """NodeID -> GPUs of every alive node that has GPUs, most GPUs first."""
    gpus = {n["NodeID"]: int(n.get("Resources", {}).get("GPU", 0)) for n in nodes if n.get("Alive", True)}
    return dict(sorted(((k, v) for k, v in gpus.items() if v > 0), key=lambda kv: -kv[1]))


def _on(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _rank_actor():
    import ray

    @ray.remote(num_gpus=1, num_cpus=1)
    class NcclRank:
        """One rank of the nccl all-reduce test on the GPU Ray gave it (cuda:0 under its CUDA_VISIBLE_DEVICES)."""

        def address(self) -> tuple[str, int]:
            from cs3ray.ops.ports import free_port

            return ray.util.get_node_ip_address(), free_port()

        def links(self, ranks_per_node: int) -> dict[str, Any]:
            from .links import infiniband, nvlink

            return {"nvlink": nvlink(), "infiniband": infiniband(ranks_per_node)}

        def allreduce(self, rank: int, world: int, master: str, port: int, sizes_mib: list[int],
                      rounds: int, iters: int) -> dict[str, list[float]]:
            """Per size, the seconds of one all-reduce in each round (the mean of `iters`, after a warm-up)."""
            import torch
            import torch.distributed as dist

            torch.cuda.set_device(0)
            dist.init_process_group("nccl", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                    device_id=torch.device("cuda", 0))
            try:
                out = {}
                for mib in sizes_mib:
                    x = torch.ones(mib * MIB // 4, device="cuda")
                    for _ in range(2):  # nccl builds its rings and buffers on the first calls
                        dist.all_reduce(x)
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(rounds):
                        dist.barrier()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        for _ in range(iters):
                            dist.all_reduce(x)
                        end.record()
                        end.synchronize()
                        times.append(start.elapsed_time(end) / 1000 / iters)
                    out[str(mib)] = times
                    del x
                return out
            finally:
                dist.destroy_process_group()

    return NcclRank


def nccl_busbw(placement: list[tuple[str, int]], sizes_mib: list[int], rounds: int,
               iters: int = 10) -> dict[str, Any]:
    """nccl all-reduce over `placement` ((node, GPUs to use), one rank per GPU): per size the busbw (Gb/s)
    of each round (the slowest rank's time), the largest size's, and the links rank 0's node sees."""
    import ray

    NcclRank = _rank_actor()
    ranks = [NcclRank.options(scheduling_strategy=_on(node)).remote() for node, n in placement for _ in range(n)]
    world = len(ranks)
    try:
        master, port = ray.get(ranks[0].address.remote())
        seen = ray.get(ranks[0].links.remote(placement[0][1]))
        per_rank = ray.get([r.allreduce.remote(i, world, master, port, sizes_mib, rounds, iters)
                            for i, r in enumerate(ranks)], timeout=600)
    finally:
        for r in ranks:
            ray.kill(r)
    busbw = {mib: [busbw_gbps(int(mib) * MIB, max(t[k] for t in (p[mib] for p in per_rank)), world)
                   for k in range(rounds)] for mib in per_rank[0]}
    largest = max(busbw, key=int)  # nccl-tests quotes the large-message plateau
    return {"world": world, "busbw_gbps": busbw, "largest_mib": int(largest), "rounds": busbw[largest],
            "median_gbps": statistics.median(busbw[largest]), **seen}


def _mfu_task():
    import ray

    @ray.remote(num_gpus=1, num_cpus=1)
    def gpu_mfu(steps: int, seq_len: int) -> dict[str, Any]:
        """MFU of bf16 training steps of a model sized to this GPU against its measured bf16 matmul peak;
        per-step MFU after the first step."""
        import dataclasses
        import time

        import torch

        from cs3ray.core.mfu import mfu
        from cs3ray.core.peak import measure_peak
        from cs3ray.models import PRESETS, Transformer
        from cs3ray.models.flops import param_count, train_flops_per_token

        free, _total = torch.cuda.mem_get_info()
        # The 7B preset's shapes (wide enough matmuls to fill a GPU) with as many of its blocks as fit:
        # fp32 weights + grads + two Adam moments (16 bytes a parameter) in at most half the free memory.
        base = PRESETS["7b"]
        one = param_count(dataclasses.replace(base, n_layers=1))
        rest = param_count(dataclasses.replace(base, n_layers=2)) - one  # one block's parameters
        layers = max(1, min(base.n_layers, int((free / 2 / 16 - (one - rest)) // rest)))
        args = dataclasses.replace(base, n_layers=layers)
        name = f"7b shapes, {layers} of {base.n_layers} blocks"
        seq = min(seq_len, args.max_seq_len)
        model = Transformer(args).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        peak = measure_peak(torch.bfloat16, 1, size=8192, seconds=2.0, device="cuda")
        per_token = train_flops_per_token(args, seq)
        batch = 16  # 16 x 1,024 tokens of 4,096 wide activations already fill tens of GB
        while True:  # the largest batch that fits
            try:
                ids = torch.randint(0, args.vocab_size, (batch, seq + 1), device="cuda")
                with torch.autocast("cuda", torch.bfloat16):
                    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(),
                                                             ids[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                break
            except torch.OutOfMemoryError:
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                if batch == 1:
                    raise
                batch //= 2
        rates = []
        for _ in range(steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            rates.append(mfu(batch * seq / (time.perf_counter() - t0), per_token, 1, peak))
        return {"model": name, "batch": batch, "seq_len": seq, "peak_tflops": peak / 1e12, "mfu": rates[1:] or rates,
                "device": torch.cuda.get_device_name(0)}

    return gpu_mfu


def training_mfu(node: str, steps: int, seq_len: int = 1024) -> dict[str, Any]:
    import ray

    return ray.get(_mfu_task().options(scheduling_strategy=_on(node)).remote(steps, seq_len), timeout=900)


def health(nodes: list[str]) -> dict[str, Any]:
    """Per GPU node, its GPUs' NVML readings (or why they could not be read)."""
    import ray

    @ray.remote(num_cpus=0)
    def read() -> Any:
        from .nvml_health import node_health

        return node_health()

    return dict(zip(nodes, ray.get([read.options(scheduling_strategy=_on(n)).remote() for n in nodes], timeout=120),
                    strict=True))
