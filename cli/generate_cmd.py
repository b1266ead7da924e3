"""`cs3 generate`: sample text from a trained run or checkpoint."""

from __future__ import annotations

from typing import Optional

import typer

from .common import ReplicaOpt, ServeOverridesArg, StorageOptionsOpt, StoredReplicasOpt, console, user_errors


@user_errors
def generate(run: str = typer.Argument(..., help="Run name (under runs/), run directory or checkpoint folder/URL."),
             storage: Optional[list[str]] = ServeOverridesArg,
             prompt: str = typer.Option("", "--prompt", "-p", help="Text to continue."),
             max_tokens: int = typer.Option(64, min=1, help="Tokens to generate."),
             temperature: float = typer.Option(0.8, min=0.0, help="0 means greedy."),
             top_k: int = typer.Option(0, min=0, help="Keep the k most likely tokens (0: all)."),
             top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="Nucleus sampling mass."),
             seed: int = typer.Option(None, help="Seed for reproducible sampling."),
             trust_code: bool = typer.Option(False, "--trust-code", help="Import and run the model.target code the "
                                                                         "checkpoint's config names."),
             dtype: Optional[str] = typer.Option(None, help="Inference precision: auto, bf16, fp16 or fp32 "
                                                            "(default: serve.dtype of the run's config)."),
             device: str = typer.Option("auto", "--device", help="Where the model runs: auto (a CUDA GPU when one "
                                                                 "is visible, else the CPU), cpu or cuda."),
             replica: Optional[list[str]] = ReplicaOpt, use_stored_replicas: bool = StoredReplicasOpt,
             storage_options: Optional[str] = StorageOptionsOpt) -> None:
    """Continue PROMPT with the newest checkpoint of RUN."""
    from cs3ray.ckpt import load_for_inference
    from cs3ray.config import runtime_serve_options
    from cs3ray.core.precision import inference_dtype
    from cs3ray.models.generate import SamplingParams
    from cs3ray.serve.deploy import merged_serve

    where = pick_device(device)  # a bad name or a missing GPU is refused before loading
    options, values = runtime_serve_options(storage or [], storage_options)
    if dtype:
        values["dtype"] = dtype
    if values.get("engine") == "vllm":
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed)
        text = generate_vllm(run, options, values | ({"num_gpus": values.get("num_gpus") or 1.0}
                                                     if where.type == "cuda" else {}),
                             prompt, params, trust_code, replica or [], use_stored_replicas)
        console.print(prompt + text, highlight=False, markup=False, soft_wrap=True)
        return
    loaded = load_for_inference(run, options, trust_code=trust_code,
                                replicas=replica or [], stored_replicas=use_stored_replicas)
    serve_cfg = merged_serve(loaded.config.serve, values)  # serve.KEY=VALUE checked as `cs3 serve` checks them
    # Whatever precision the run trained in: the checkpoint holds fp32 weights, cast here.
    loaded.model.to(device=where, dtype=inference_dtype(serve_cfg.dtype, where))
    budget = loaded.model.args.max_seq_len - len(loaded.tokenizer.encode(prompt)) - 1
    if budget <= 0:
        raise typer.BadParameter(f"the prompt is longer than the model's context ({loaded.model.args.max_seq_len} tokens)")
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                            max_tokens=min(max_tokens, budget), seed=seed)
    text = generate_text(loaded.model, loaded.tokenizer, prompt, params)
    console.print(prompt + text, highlight=False, markup=False, soft_wrap=True)


def pick_device(name: str):
    """The torch device for --device: auto takes CUDA when torch sees a GPU; cuda without one is refused."""
    import torch

    from cs3ray.errors import UserError

    if name not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown --device '{name}': use auto, cpu or cuda.")
    has_cuda = torch.cuda.is_available()
    if name == "cuda" and not has_cuda:
        raise UserError("--device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU visible); "
                        "use --device cpu or auto.")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and has_cuda) else "cpu")


def generate_text(*args, **kwargs) -> str:
    """cs3ray.models.generate.generate_text, imported on the first call (a name tests can patch)."""
    from cs3ray.models.generate import generate_text as sample

    return sample(*args, **kwargs)


def generate_vllm(run: str, options: dict, values: dict, prompt: str, params, trust_code: bool,
                  replicas: list[str], stored_replicas: bool) -> str:
    """serve.engine=vllm: the same continuation through vLLM over the checkpoint's HF export (cached per step)."""
    from cs3ray.serve.deploy import make_spec
    from cs3ray.serve.vllm_replica import generate_once

    spec = make_spec(run, name="generate", overrides=values, storage_options=options, trust_code=trust_code,
                     ckpt_replicas=replicas, stored_replicas=stored_replicas)
    return generate_once(spec, prompt, params)
