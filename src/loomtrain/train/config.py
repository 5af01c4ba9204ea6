"""Typed configuration: one frozen pydantic model per TOML section, unknown keys rejected.

`load_config(path, overrides)` reads a TOML file (or nothing, for the defaults), applies
`section.key=value` overrides, validates every section and the combinations between them,
and raises `ConfigError` with a one-paragraph message on any problem.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from loomtrain.errors import ConfigError


# data.source names that are not paths
BUILTIN_SOURCES = ("stdlib", "stdlib-code", "stdlib-tests", "digits")


class Section(BaseModel):
    # numbers are accepted for text keys, so `--set run.name=2024` names the run "2024"
    # inf/nan are refused: no key means "unbounded" by them, and inf breaks timedelta(timeout_s)
    model_config = ConfigDict(extra="forbid", frozen=True, coerce_numbers_to_str=True,
                              allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field("default", min_length=1)  # empty would make run.dir itself the run folder
    dir: str = "runs"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(8, ge=1)
    progress: bool = True
    # consecutive steps with a non-finite loss or gradient before the run aborts
    max_nonfinite_steps: int = Field(5, ge=1)
    # record this step's compute/communication timeline into RUN_DIR/timeline.json (0: none)
    timeline_step: int = Field(0, ge=0)


class ModelConfig(Section):
    name: Literal["gpt", "mlp"] = "gpt"
    d_model: int = Field(256, ge=8)
    n_layers: int = Field(4, ge=1)
    n_heads: int = Field(4, ge=1)
    seq_len: int = Field(128, ge=2)
    vocab_size: int = Field(256, ge=2)
    mlp_ratio: int = Field(4, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # gpt: "linear" is causal linear attention (models/linear_attention.py), with RetNet's
    # per-head decay when linear_decay is set
    attention: Literal["softmax", "linear"] = "softmax"
    linear_decay: bool = False

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "ModelConfig":
        if self.name == "gpt" and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads}"
            )
        return self

    @model_validator(mode="after")
    def _attention_keys(self) -> "ModelConfig":
        if self.attention != "softmax" and self.name != "gpt":
            raise ValueError(f"model.attention={self.attention!r} is the GPT's attention; "
                             f"model.name={self.name!r} has none: leave it \"softmax\"")
        if self.linear_decay and self.attention != "linear":
            raise ValueError(f"model.linear_decay=true decays linear attention; it needs "
                             f"model.attention=\"linear\" (got {self.attention!r})")
        return self


class DataConfig(Section):
    # "stdlib": the running interpreter's standard-library .py sources ("stdlib-code": without
    # the test modules, "stdlib-tests": those alone; data/corpus.py); "digits": scikit-learn's
    # 8x8 digit images, a classification task (data/digits.py); otherwise a path to a text
    # file, a folder of text files, or a pre-tokenized uint16 token file (*.bin / *.u16)
    source: str = "stdlib"
    val_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    # rows hold several documents (the source's files) and attention never crosses one;
    # docs/sequence.md
    packing: bool = False
    # dynamic hybrid dp x cp (ByteScale): documents dealt to ranks by attention work
    balance: bool = False
    # "by_file": each data-parallel or async worker trains on its own contiguous group of the
    # source's files (non-IID); data/partition.py
    partition: Literal["iid", "by_file"] = "iid"
    # "digits": only these digits, in training and validation (empty: all ten)
    classes: list[int] = []

    @model_validator(mode="after")
    def _partition_needs_files(self) -> "DataConfig":
        # a path that does not exist is left to the corpus loader, which names it
        source = self.source
        if self.partition == "by_file" and source not in BUILTIN_SOURCES \
                and Path(source).expanduser().is_file():
            raise ValueError(
                f"data.partition=\"by_file\" gives each worker its own group of the source's "
                f"files, but data.source={self.source!r} is a single file; give \"stdlib\" or a "
                f"folder of text files, or set data.partition=\"iid\"")
        return self

    @model_validator(mode="after")
    def _classes_of_digits(self) -> "DataConfig":
        if self.classes and self.source != "digits":
            raise ValueError(f"data.classes={self.classes} filters the digits of data.source="
                             f"\"digits\"; data.source={self.source!r} has no classes: leave it "
                             "empty")
        if any(not 0 <= c < 10 for c in self.classes) or len(set(self.classes)) != len(self.classes):
            raise ValueError(f"data.classes={self.classes} must be distinct digits 0-9 (empty: all "
                             "ten)")
        return self


class TrainConfig(Section):
    steps: int = Field(300, ge=1)
    global_batch: int = Field(32, ge=1)
    micro_batch: int = Field(8, ge=1)
    lr: float = Field(3e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.1, ge=0.0)
    warmup_steps: int = Field(20, ge=0)
    grad_clip: float = Field(1.0, ge=0.0)  # 0 disables clipping
    optimizer: Literal["adamw", "sgd"] = "adamw"
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    # bf16: compute in bfloat16 with fp32 master weights, gradients reduced in fp32
    precision: Literal["fp32", "bf16"] = "fp32"
    # a run folder (its newest checkpoint) or a checkpoint folder: the model starts from its
    # weights, the rest of the run is new (step 0, optimizer, schedule); train/init_from.py
    init_from: str | None = Field(None, min_length=1)


class ParallelConfig(Section):
    # "auto": before training, the planner (loomtrain.planner) searches the plans of this
    # model on nproc ranks at train.global_batch and runs the best; its dp, tp, pp, cp, ZeRO,
    # schedule, micro-batch, recompute and offload settings replace those given here
    # (train.precision is kept: planner/apply.py choose_here, resolve_auto), and the written
    # config.toml holds them, with "none"
    plan: Literal["none", "auto"] = "none"
    nproc: int = Field(2, ge=1)
    dp: int | None = Field(None, ge=1)  # None: whatever nproc leaves after tp, pp and cp
    tp: int = Field(1, ge=1)
    # tensor parallel: layer norms and dropout on 1/tp of the sequence (Megatron-style)
    sequence_parallel: bool = False
    pp: int = Field(1, ge=1)
    # pipeline (pp > 1): docs/pipeline.md
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "optimal", "async"] = "1f1b"
    microbatches: int | None = Field(None, ge=1)  # None: global_batch / (dp * micro_batch)
    virtual_stages: int = Field(1, ge=1)  # stages per rank (interleaved: 2 or more)
    recompute: Literal["none", "full", "selective"] = "none"
    offload_activations: float = Field(0.0, ge=0.0, le=1.0)  # fraction of stashed activations
    pipeline_balance: Literal["params", "time"] = "params"  # what stages are balanced by
    split_points: list[int] = []  # first layer of stages 1.. (layers: embed, blocks, head)
    # schedule="async" (parallel/pipeline/asynchronous.py): each stage steps after every
    # micro-batch on stashed weights; "stash": the train.optimizer as is (PipeDream),
    # "nesterov": the delay-corrected Nesterov of arXiv 2505.01099 with momentum async_momentum
    # schedule="optimal": each rank's activation memory limit (None: what 1F1B's busiest
    # rank stashes, measured); the plan keeps, offloads or recomputes each micro-batch to fit.
    # cp_method="auto": each rank's activation estimate for one micro-batch above which every
    # block is checkpointed (None: never)
    activation_budget_mb: float | None = Field(None, gt=0.0)
    async_optimizer: Literal["stash", "nesterov"] = "nesterov"
    async_momentum: float = Field(0.99, ge=0.0, lt=1.0)
    cp: int = Field(1, ge=1)
    # the context-parallel kernel (docs/sequence.md); None: "ring" for softmax attention,
    # "lasp" for linear attention
    cp_method: Literal["ring", "ulysses", "lasp", "auto"] | None = None
    zero_stage: int = Field(0, ge=0, le=3)
    hierarchical: bool = False  # ZeRO: shard inside the node, reduce across nodes in two levels
    optimizer_shard: Literal["node", "dp"] = "node"  # hierarchical: optimizer state split over
    prefetch: int = Field(1, ge=0)  # stage 3: units gathered ahead of the one computing
    offload_optimizer: bool = False  # ZeRO: master weights and optimizer state in host memory
    shard_units: list[str] = []  # ZeRO units as module-name patterns; empty: ModuleList children
    ranks_per_node: int | None = Field(None, ge=1)  # None: all ranks on one node
    bucket_mb: float = Field(4.0, gt=0.0)
    timeout_s: float = Field(300.0, gt=0.0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @property
    def dp_size(self) -> int:
        return self.dp if self.dp is not None else self.nproc // (self.tp * self.pp * self.cp)


class CommConfig(Section):
    # a simulated slow link between the nodes of parallel.ranks_per_node (comm/link.py):
    # each rank's bandwidth to other nodes in Gbit/s (None: no simulation), and the latency
    # every cross-node op pays once
    inter_node_gbps: float | None = Field(None, gt=0.0)
    inter_node_latency_ms: float = Field(0.0, ge=0.0)
    # [[after_s, gbps], ...]: the bandwidth becomes gbps after_s seconds after the link was
    # made (each rank's, as it joins the world), in strictly increasing after_s; empty: fixed
    link_changes: list[tuple[float, float]] = []
    # how a sparse tensor (a top-k payload) is summed over ranks (comm/sparse.py): an
    # all-gather of (index, value) pairs, Zen's hash-balanced partition, or the cheaper of
    # the two by their cost formulas
    sparse_allreduce: Literal["auto", "allgather", "balanced"] = "auto"


class CheckpointConfig(Section):
    every: int = Field(100, ge=0)  # 0: only at the end and on SIGINT/SIGTERM
    keep: int = Field(2, ge=1)


# the zeroth-order methods of [optim] (zeroth/, docs/zeroth.md)
ZO_METHODS = ("mezo", "mezo-svrg", "helene", "zo-momentum", "zo-adam", "sparse-mezo")


class OptimConfig(Section):
    # "backprop": forward, backward and train.optimizer (the trainer); the others train from
    # forward passes alone, ranks exchanging only (seed, scalar) pairs (zeroth/train.py)
    name: Literal["backprop", "mezo", "mezo-svrg", "helene", "zo-momentum", "zo-adam",
                  "sparse-mezo"] = "backprop"
    # the rest is read by the zeroth-order methods only. lr: the peak of train's schedule
    # (warmup, cosine) in place of train.lr (None: train.lr)
    lr: float | None = Field(None, gt=0.0)
    # the parameters trained, as name prefixes ("blocks.3.") or globs ("*.bias"); the others
    # stay frozen, bitwise; empty: all
    trainable: list[str] = []
    # the methods' own keys, each read only by the methods whose `zeroth.hyper_keys` list it;
    # None: the method's default (docs/zeroth.md, "The methods")
    eps: float | None = Field(None, gt=0.0)  # the SPSA perturbation scale
    n_perturbations: int | None = Field(None, ge=1)  # probes per rank and step, averaged
    sparsity: float | None = Field(None, ge=0.0, lt=1.0)  # sparse-mezo: share not perturbed
    mask_every: int | None = Field(None, ge=1)  # sparse-mezo: steps between thresholds
    momentum: float | None = Field(None, ge=0.0, lt=1.0)  # zo-momentum
    betas: tuple[float, float] | None = None  # zo-adam, helene
    adam_eps: float | None = Field(None, gt=0.0)  # zo-adam
    svrg_every: int | None = Field(None, ge=1)  # mezo-svrg: steps between large batches
    svrg_batches: int | None = Field(None, ge=1)  # mezo-svrg: batches in a large batch
    svrg_lr_ratio: float | None = Field(None, ge=0.0)  # mezo-svrg: a refresh's lr / lr
    anneal_steps: float | None = Field(None, gt=0.0)  # helene
    hessian_every: int | None = Field(None, ge=1)  # helene
    gamma: float | None = Field(None, gt=0.0)  # helene
    hessian_clip: float | None = Field(None, ge=0.0)  # helene
    precond_eps: float | None = Field(None, gt=0.0)  # helene

    @model_validator(mode="after")
    def _keys(self) -> "OptimConfig":
        if self.betas is not None and not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)}: both must be in [0, 1)")
        if any(not pattern for pattern in self.trainable):
            raise ValueError(f"optim.trainable={self.trainable}: a pattern is empty; give name "
                             'prefixes such as "blocks.3." or globs such as "*.bias"')
        return self


# the [lowcomm] keys each algorithm reads; a key set away from its default for an algorithm
# that does not read it is refused (it would be silently ignored)
LOWCOMM_KEYS = {
    "none": (),
    "local_sgd": ("inner_steps",),
    "diloco": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum"),
    "streaming_diloco": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum",
                         "fragments", "overlap_steps", "quantize", "mix"),
    "noloco": ("inner_steps", "outer_lr", "outer_momentum", "outer_pull"),
    "dreamddp": ("inner_steps",),
    "hpsgd": ("overlap_steps",),
    "hierarchical": ("inner_steps", "overlap_steps", "adaptive_period"),
    "lordo": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum", "rank"),
}


class LowcommConfig(Section):
    # low-communication data parallelism (lowcomm/, docs/lowcomm.md): replicas train apart
    # and synchronize every inner_steps optimizer steps; LOWCOMM_KEYS: the keys each one reads
    algorithm: Literal["none", "local_sgd", "diloco", "streaming_diloco", "noloco", "dreamddp",
                       "hpsgd", "hierarchical", "lordo"] = "none"
    inner_steps: int = Field(1, ge=1)  # H
    # DiLoCo's outer optimizer: "nesterov", SGD with Nesterov momentum; "sgd", without momentum
    outer_optimizer: Literal["sgd", "nesterov"] = "nesterov"
    outer_lr: float = Field(0.7, gt=0.0)  # DiLoCo's (Douillard et al. 2023)
    outer_momentum: float = Field(0.9, gt=0.0, lt=1.0)
    fragments: int = Field(1, ge=1)  # streaming DiLoCo: F fragments synced at staggered steps
    # optimizer steps a sync stays in flight while the replicas compute (0: wait at once)
    overlap_steps: int = Field(1, ge=0)
    quantize: Literal["none", "int8"] = "none"  # the pseudo-gradients on the wire
    # streaming DiLoCo: an overlapped sync lands as mix * local + (1 - mix) * global (the
    # paper's alpha; 0 replaces the local fragment); 1 would never adopt the global one
    mix: float = Field(0.5, ge=0.0, lt=1.0)
    rank: int = Field(16, ge=1)  # LoRDO: the rank r of the projected optimizer
    # NoLoCo's gamma: how hard an outer step pulls a replica towards its pair's mean outer
    # weights (0: no pull); 0.7, the paper's setting (equal to outer_lr)
    outer_pull: float = Field(0.7, ge=0.0)
    # hierarchical (DASO): the global period halves when the loss plateaus, from inner_steps
    # down to 1, then starts again at inner_steps (lowcomm/hierarchical.py)
    adaptive_period: bool = False

    @model_validator(mode="before")
    @classmethod
    def _lordo_averages(cls, values: Any) -> Any:
        """LoRDO's paper averages the replicas (arXiv 2602.04396, as DES-LOC): for
        algorithm="lordo" outer_optimizer defaults to "sgd", and then outer_lr to 1 (the
        mean); an explicit "nesterov" keeps DiLoCo's defaults."""
        if isinstance(values, dict) and values.get("algorithm") == "lordo":
            values = {"outer_optimizer": "sgd", **values}
            if values["outer_optimizer"] == "sgd":
                values.setdefault("outer_lr", 1.0)
        return values


# the [compression] keys each method reads (besides method, error_feedback and applies_to)
COMPRESSION_KEYS = {"none": (), "topk": ("ratio",), "randomk": ("ratio",), "powersgd": ("rank",),
                    "int8": (), "sign": ()}


class CompressionConfig(Section):
    # gradient compression (comm/compress/, docs/compression.md): what each rank sends of a
    # gradient bucket (applies_to="gradients", the data-parallel engine) or of DiLoCo's
    # pseudo-gradient (applies_to="pseudo_gradients")
    method: Literal["none", "topk", "randomk", "powersgd", "int8", "sign"] = "none"
    ratio: float = Field(0.01, gt=0.0, le=1.0)  # top-k, random-k: the fraction of values sent
    rank: int = Field(4, ge=1)  # PowerSGD's rank r
    # keep what compression dropped and add it to the next bucket; None: the method's default
    # (on for topk, randomk, powersgd and sign; off for int8)
    error_feedback: bool | None = None
    applies_to: Literal["gradients", "pseudo_gradients"] = "gradients"
    # every N optimizer steps, measure the error of the compressed sum against the dense sum
    # (a dense all-reduce off the simulated link, counted apart as "all_reduce_diagnostic");
    # 0: never
    error_every: int = Field(0, ge=0)


# the [sparsity] keys each method reads (besides method and the SAM keys sam, rho, zo_eps,
# and sparse_comm); a key set away from its default for a method that does not read it is
# refused (it would be silently ignored)
SPARSITY_KEYS = {
    "none": (),
    "static": ("density", "distribution"),
    "nm": ("n", "m"),
    "prune": ("density", "distribution", "schedule", "start_step", "end_step", "update_every"),
    "set": ("density", "distribution", "schedule", "end_step", "update_every", "alpha"),
    "rigl": ("density", "distribution", "schedule", "end_step", "update_every", "alpha"),
}
# the schedules each method can follow, its default first
SPARSITY_SCHEDULES = {"prune": ("cubic",), "set": ("cosine", "constant"),
                      "rigl": ("cosine", "constant")}


class SparsityConfig(Section):
    # sparse training (sparsity/, docs/sparsity.md): masks on every untied nn.Linear weight
    method: Literal["none", "static", "nm", "prune", "set", "rigl"] = "none"
    density: float = Field(0.5, gt=0.0, lt=1.0)  # the kept fraction of the sparse layers' weights
    # per-layer densities: "erk" (Erdos-Renyi-Kernel: small layers denser) or "uniform"
    distribution: Literal["erk", "uniform"] = "erk"
    n: int = Field(2, ge=1)  # N:M: keep n of every m consecutive input weights of a row
    m: int = Field(4, ge=2)
    # prune: "cubic" (Zhu & Gupta); set, rigl: the swapped fraction, "cosine" (RigL's decay
    # from alpha) or "constant" (alpha, SET's paper); None: the method's first
    schedule: Literal["cubic", "cosine", "constant"] | None = None
    start_step: int = Field(0, ge=0)  # prune: the schedule's first step (dense until then)
    end_step: int | None = Field(None, ge=1)  # None: 75% of train.steps
    update_every: int = Field(100, ge=1)  # steps between mask updates
    alpha: float = Field(0.3, gt=0.0, le=1.0)  # set, rigl: the swapped fraction at step 0
    # sharpness-aware gradients: "sam" (two backwards per step) or "zo-sam" (a zeroth-order
    # ascent direction from two forwards, one backward); any method, "none" included
    sam: Literal["none", "sam", "zo-sam"] = "none"
    rho: float = Field(0.05, gt=0.0)  # the perturbation's radius
    zo_eps: float = Field(1e-3, gt=0.0)  # zo-sam: the SPSA probe's step
    # only the kept gradient entries are all-reduced (the sparse-aware data-parallel engine)
    sparse_comm: bool = False


class AsyncConfig(Section):
    # asynchronous SGD with a parameter server (asyncsgd/, docs/async.md): mode "ps" makes
    # rank 0 the server and ranks 1.. its workers; the other keys are read only then
    mode: Literal["none", "ps"] = "none"
    # server ranks sharding the parameters (asyncsgd/shard.py): ranks 0..servers-1 each own a
    # contiguous slice, ranks servers.. are the workers
    servers: int = Field(1, ge=1)
    # the staleness policy (asyncsgd/policies.py: POLICIES)
    policy: Literal["plain", "bounded", "drop_stale", "staleness_scaled", "ringleader"] = "plain"
    max_staleness: int = Field(4, ge=0)  # "bounded": the spread s; "drop_stale": the threshold
    # per worker (ranks servers..), a factor >= 1 on its step time: it sleeps (f - 1) x its measured
    # compute time after each gradient; empty: every worker at full speed. With mode "none",
    # one factor per rank of the synchronous trainer (a straggler for synchronous DP)
    worker_slowdown: list[float] = []
    # a worker that sends nothing for this long after the server expects it is dropped
    worker_timeout_s: float = Field(60.0, gt=0.0)
    # adaptive communication load (asyncsgd/adaptive.py): each worker pushes the mean of k
    # gradients, k in [1, max_accumulation] chosen from its measured round trip so that at
    # most comm_fraction of its cycle is spent not computing
    adaptive: bool = False
    max_accumulation: int = Field(8, ge=1)
    comm_fraction: float = Field(0.25, gt=0.0, lt=1.0)


class _Sections(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    comm: CommConfig = CommConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    lowcomm: LowcommConfig = LowcommConfig()
    compression: CompressionConfig = CompressionConfig()
    sparsity: SparsityConfig = SparsityConfig()
    optim: OptimConfig = OptimConfig()

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        p, t = self.parallel, self.train
        _check_tensor_parallel(p, self.model)
        engine = p.zero_stage > 0 or t.precision == "bf16"  # the sharded engine runs these
        for key, needs in (("hierarchical", p.zero_stage > 0), ("offload_optimizer", p.zero_stage > 0),
                           ("shard_units", engine)):
            if getattr(p, key) and not needs:
                also = ' (or train.precision="bf16")' if key == "shard_units" else ""
                raise ValueError(f"parallel.{key}={getattr(p, key)!r} needs ZeRO: set "
                                 f"parallel.zero_stage to 1, 2 or 3{also}")
        if p.optimizer_shard == "dp" and not p.hierarchical:
            raise ValueError(
                'parallel.optimizer_shard="dp" splits the optimizer state across nodes in '
                "hierarchical ZeRO; set parallel.hierarchical=true (flat ZeRO already splits it "
                "over all dp ranks)")
        mesh_size = p.dp_size * p.tp * p.pp * p.cp
        if mesh_size != p.nproc or p.dp_size < 1:
            raise ValueError(
                f"the mesh dp*tp*pp*cp = {p.dp_size}*{p.tp}*{p.pp}*{p.cp} = {mesh_size} must equal "
                f"parallel.nproc={p.nproc}"
            )
        if p.ranks_per_node is not None and p.nproc % p.ranks_per_node:
            raise ValueError(
                f"parallel.ranks_per_node={p.ranks_per_node} must divide parallel.nproc={p.nproc}"
            )
        _check_link(self.comm, p)
        _check_async_sgd(self)
        per_rank = self.batch_ranks * t.micro_batch
        if t.global_batch % per_rank:
            ranks = "workers" if self.asgd.mode == "ps" else "dp"
            raise ValueError(
                f"train.global_batch={t.global_batch} must be divisible by {ranks}*micro_batch = "
                f"{self.batch_ranks}*{t.micro_batch} = {per_rank}"
            )
        _check_pipeline(p, self.model, t)
        _check_sequence(p, self.model, t, self.data)
        _check_lowcomm(self)
        _check_compression(self)
        _check_sparsity(self)
        _check_task(self)
        _check_init_from(self)
        _check_optim(self)
        _check_plan(self)
        if p.schedule == "async" and self.run.timeline_step:
            raise ValueError('run.timeline_step records one step of a fixed schedule; parallel.'
                             'schedule="async" streams micro-batches across steps: set '
                             "run.timeline_step=0")
        return self

    @property
    def asgd(self) -> AsyncConfig:
        """The [async] section (`async` is a Python keyword: no attribute can have its name)."""
        return getattr(self, "async")

    @property
    def batch_ranks(self) -> int:
        """The ranks that share each step's global batch: dp, or the workers (nproc - servers)
        of an asynchronous parameter server, which take global_batch / workers rows per step."""
        if self.asgd.mode == "ps":
            return self.parallel.nproc - self.asgd.servers
        return self.parallel.dp_size

    @property
    def accumulation_steps(self) -> int:
        return self.train.global_batch // (self.batch_ranks * self.train.micro_batch)


# `async` is a keyword, so the [async] section is added by name instead of in the class body;
# code reads it as `cfg.asgd`
Config = create_model("Config", __base__=_Sections, __module__=__name__,
                      **{"async": (AsyncConfig, AsyncConfig())})


def _check_async_sgd(cfg) -> None:
    """[async] mode="ps" (asyncsgd/train.py): ranks 0..servers-1 serve fp32 parameters (all, or
    a slice each) to plain single-rank workers; its keys mean nothing without it, except
    worker_slowdown, which with mode "none" slows ranks of the synchronous trainer
    (trainer.train_backprop): one factor per rank."""
    a, p, t = cfg.asgd, cfg.parallel, cfg.train
    if a.mode == "none":
        changed = [k for k in AsyncConfig.model_fields if k not in ("mode", "worker_slowdown")
                   and getattr(a, k) != AsyncConfig.model_fields[k].default]
        if changed:
            raise ValueError(f'async.{changed[0]} is a setting of the asynchronous parameter '
                             f'server, which is off (async.mode="none"): set async.mode="ps" '
                             "or leave the key unset")
        if a.worker_slowdown and len(a.worker_slowdown) != p.nproc:
            raise ValueError(f'async.worker_slowdown={a.worker_slowdown} with async.mode="none" '
                             "slows ranks of synchronous training: it needs one factor per rank, "
                             f"parallel.nproc={p.nproc} (got {len(a.worker_slowdown)}); leave it "
                             "empty for all at full speed")
        _check_slowdown_factors(a.worker_slowdown)
        return
    if p.nproc < a.servers + 1:
        raise ValueError(f'async.mode="ps" runs the parameter server on ranks 0..{a.servers - 1} '
                         f"(async.servers={a.servers}) and workers on ranks {a.servers}..: it "
                         f"needs parallel.nproc >= {a.servers + 1} (got {p.nproc})")
    others = {"parallel.tp": (p.tp, 1), "parallel.pp": (p.pp, 1), "parallel.cp": (p.cp, 1),
              "parallel.zero_stage": (p.zero_stage, 0), "train.precision": (t.precision, "fp32"),
              "lowcomm.algorithm": (cfg.lowcomm.algorithm, "none"),
              "compression.method": (cfg.compression.method, "none"),
              "data.packing": (cfg.data.packing, False), "data.balance": (cfg.data.balance, False),
              "run.timeline_step": (cfg.run.timeline_step, 0)}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f'async.mode="ps" with {key}={value!r} is not supported: the server '
                             "and every worker hold the whole fp32 model, each worker computes "
                             f"its gradient alone, with no collective ({key}={allowed!r})")
    workers = p.nproc - a.servers
    if a.worker_slowdown and len(a.worker_slowdown) != workers:
        servers = ("rank 0 is the server" if a.servers == 1
                   else f"ranks 0..{a.servers - 1} are servers")
        raise ValueError(f"async.worker_slowdown={a.worker_slowdown} needs one factor per worker: "
                         f"parallel.nproc={p.nproc} gives {workers} (ranks {a.servers}.."
                         f"{p.nproc - 1}; {servers}); leave it empty for all at full speed")
    _check_slowdown_factors(a.worker_slowdown)
    _check_adaptive(a)
    _check_sharded_servers(a, cfg.checkpoint)


def _check_sharded_servers(a: AsyncConfig, c: CheckpointConfig) -> None:
    """What several servers (asyncsgd/shard.py) cannot do: hold workers back each on its own
    (bounded), and save their independent states as one checkpoint while they serve."""
    if a.servers == 1:
        return
    if a.policy == "bounded":
        raise ValueError(f'async.servers={a.servers} with async.policy="bounded" is not supported: '
                         "each server would hold workers back by its own versions, and a worker "
                         "that one server has answered can be held by another, so two servers can "
                         "each wait for a worker the other holds (a deadlock until "
                         'worker_timeout_s); use "plain", "drop_stale", "staleness_scaled" or '
                         '"ringleader", which never hold a worker back, or async.servers=1')
    if c.every:
        raise ValueError(f"async.servers={a.servers} with checkpoint.every={c.every} is not "
                         "supported: the servers keep independent versions and never wait for "
                         "one another, so no moment holds a consistent state of all of them; "
                         "only the final model is saved (whole, at the end or at a stop). Set "
                         "checkpoint.every=0")


def _check_adaptive(a: AsyncConfig) -> None:
    """max_accumulation and comm_fraction are read by the adaptive controller only; the bounded
    policy's waits would read to it as link time."""
    if not a.adaptive:
        changed = [k for k in ("max_accumulation", "comm_fraction")
                   if getattr(a, k) != AsyncConfig.model_fields[k].default]
        if changed:
            raise ValueError(f"async.{changed[0]}={getattr(a, changed[0])} belongs to the adaptive "
                             "communication load, which is off: set async.adaptive=true or leave "
                             "the key unset")
    elif a.policy == "bounded":
        raise ValueError('async.adaptive=true with async.policy="bounded" is not supported: a '
                         "worker measures the time the server holds it back as round-trip time "
                         "and would raise its accumulation for it, not for the link; use "
                         '"plain", "drop_stale", "staleness_scaled" or "ringleader"')


def _check_slowdown_factors(factors: list[float]) -> None:
    if any(f < 1.0 for f in factors):
        raise ValueError(f"async.worker_slowdown={factors}: each factor must be >= 1 "
                         "(a worker with factor f sleeps (f - 1) x its compute time per step)")


def _check_link(c: CommConfig, p: ParallelConfig) -> None:
    """The simulated link joins nodes: it needs more than one, and its latency needs it."""
    if c.inter_node_gbps is None:
        if c.inter_node_latency_ms:
            raise ValueError(f"comm.inter_node_latency_ms={c.inter_node_latency_ms} belongs to the "
                             "simulated inter-node link, which is off: set comm.inter_node_gbps")
        if c.link_changes:
            raise ValueError(f"comm.link_changes={[list(x) for x in c.link_changes]} changes the "
                             "simulated inter-node link, which is off: set comm.inter_node_gbps")
        return
    times = [after for after, _ in c.link_changes]
    if any(not after > 0 or not gbps > 0 for after, gbps in c.link_changes) \
            or times != sorted(set(times)):
        raise ValueError(f"comm.link_changes={[list(x) for x in c.link_changes]}: each entry is "
                         "[after_s, gbps], seconds since the link was made (> 0, strictly "
                         "increasing) and the new bandwidth in Gbit/s (> 0)")
    if p.ranks_per_node is None or p.ranks_per_node >= p.nproc:
        rpn = "unset" if p.ranks_per_node is None else p.ranks_per_node
        raise ValueError(f"comm.inter_node_gbps={c.inter_node_gbps} simulates the link between "
                         f"nodes, but parallel.ranks_per_node={rpn} puts all parallel.nproc="
                         f"{p.nproc} ranks on one node: set parallel.ranks_per_node to a divisor "
                         "of nproc below it, or leave comm.inter_node_gbps unset")


def _check_pipeline(p: ParallelConfig, m: ModelConfig, t: TrainConfig) -> None:
    """The pipeline keys: a schedule's own rules, what pp composes with, and a split that
    gives every stage at least one layer (the model's layers: embed, blocks, head)."""
    _check_async(p)
    _check_optimal(p)
    if p.pp == 1:
        changed = [k for k in ("microbatches", "recompute", "offload_activations", "split_points",
                               "virtual_stages") if k in p.model_fields_set
                   and getattr(p, k) != ParallelConfig.model_fields[k].default]
        if p.schedule in ("async", "optimal"):
            changed.append("schedule")
        if changed:
            raise ValueError(f"parallel.{changed[0]} is a pipeline setting: it needs parallel.pp > 1")
        return
    micro = t.global_batch // (p.dp_size * t.micro_batch)
    if p.microbatches is not None and p.microbatches != micro:
        raise ValueError(
            f"parallel.microbatches={p.microbatches} must equal train.global_batch / (dp * "
            f"train.micro_batch) = {t.global_batch}/({p.dp_size}*{t.micro_batch}) = {micro}; "
            f"set train.micro_batch={max(1, t.global_batch // (p.dp_size * p.microbatches))} "
            "(or leave parallel.microbatches unset)")
    for key, allowed in (("tp", 1), ("cp", 1)):
        if getattr(p, key) != allowed:
            raise ValueError(f"parallel.pp={p.pp} with parallel.{key}={getattr(p, key)} is not "
                             f"supported yet: the pipeline composes with dp and ZeRO-1")
    if p.zero_stage > 1 or t.precision != "fp32":
        raise ValueError(f"parallel.pp={p.pp} runs in fp32 with parallel.zero_stage 0 or 1 "
                         f"(got zero_stage={p.zero_stage}, train.precision={t.precision!r}): "
                         "stages 2-3 would reduce or gather on every micro-batch of the schedule")
    if p.schedule == "interleaved":
        if p.virtual_stages < 2 or micro % p.pp:
            raise ValueError(
                f'parallel.schedule="interleaved" needs parallel.virtual_stages >= 2 (got '
                f"{p.virtual_stages}) and micro-batches divisible by parallel.pp={p.pp} (got {micro})")
    elif p.virtual_stages != 1:
        raise ValueError(f"parallel.virtual_stages={p.virtual_stages} is for "
                         f'parallel.schedule="interleaved" (got {p.schedule!r}); set it to 1')
    if p.recompute == "selective" and m.name != "gpt":
        raise ValueError('parallel.recompute="selective" recomputes the GPT\'s attention; '
                         f'model.name={m.name!r} has none: use "full"')
    layers, stages = m.n_layers + 2, p.pp * p.virtual_stages
    if p.split_points:
        points = [0, *p.split_points, layers]
        if len(p.split_points) != stages - 1 or any(a >= b for a, b in zip(points, points[1:])):
            raise ValueError(
                f"parallel.split_points={p.split_points} must be {stages - 1} increasing layer "
                f"indices between 1 and {layers - 1} (the model has {layers} layers: embed, "
                f"{m.n_layers} blocks, head; pp*virtual_stages = {stages} stages)")
    elif stages > layers:
        raise ValueError(f"parallel.pp*virtual_stages = {stages} stages exceed the model's "
                         f"{layers} layers (embed, {m.n_layers} blocks, head)")


def _check_sequence(p: ParallelConfig, m: ModelConfig, t: TrainConfig, d: DataConfig) -> None:
    """Context parallelism and packing: the kernel matches the attention, the row splits
    evenly under the kernel's layout, and the axes it composes with today (dp, fp32)."""
    if d.balance and not d.packing:
        raise ValueError("data.balance=true deals the documents of packed rows to ranks: it "
                         "needs data.packing=true")
    if d.balance and (m.attention != "softmax" or p.cp_method not in (None, "ring")):
        raise ValueError("data.balance=true splits long documents with ring attention: it needs "
                         f'model.attention="softmax" (got {m.attention!r}) and parallel.cp_method '
                         f'unset or "ring" (got {p.cp_method!r})')
    if p.cp_method is not None and p.cp == 1:
        raise ValueError(f"parallel.cp_method={p.cp_method!r} is a context-parallel setting: it "
                         "needs parallel.cp > 1")
    if p.cp == 1 and not d.packing:
        return
    used = f"parallel.cp={p.cp}" if p.cp > 1 else "data.packing=true"
    if m.name != "gpt":
        raise ValueError(f"{used} splits or masks the GPT's attention; model.name={m.name!r} "
                         "has none: use model.name=\"gpt\"")
    others = {"parallel.tp": (p.tp, 1), "parallel.pp": (p.pp, 1),
              "parallel.zero_stage": (p.zero_stage, 0)}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f"{used} with {key}={value} is not supported yet: sequence "
                             "parallelism and packing compose with data parallelism (zero_stage=0, "
                             "fp32) today")
    if t.precision != "fp32":
        raise ValueError(f"{used} runs in fp32 today (got train.precision={t.precision!r})")
    if p.cp == 1:
        return
    method = p.cp_method or ("lasp" if m.attention == "linear" else "ring")
    if method == "auto" and (m.attention != "softmax" or m.dropout):
        raise ValueError('parallel.cp_method="auto" rewrites the model\'s causal '
                         "scaled_dot_product_attention calls, without dropout: it needs "
                         f'model.attention="softmax" (got {m.attention!r}) and model.dropout=0 '
                         f"(got {m.dropout})")
    needs = {"ring": "softmax", "lasp": "linear"}.get(method)
    if needs is not None and m.attention != needs:
        other = "lasp" if method == "ring" else "ring"
        raise ValueError(f"parallel.cp_method={method!r} is for {needs} attention, but "
                         f"model.attention={m.attention!r}: use {other!r} or \"ulysses\"")
    if method == "ulysses" and m.n_heads % p.cp:
        raise ValueError(f'parallel.cp_method="ulysses" gives each of parallel.cp={p.cp} ranks '
                         f"whole heads, but model.n_heads={m.n_heads} is not divisible by {p.cp}; "
                         'use "ring" or "lasp", or a cp that divides the heads')
    pieces = 2 * p.cp if method in ("ring", "auto") else p.cp  # auto may choose ring
    if m.seq_len % pieces:
        why = "two zig-zag chunks per rank" if method != "ulysses" else "one chunk per rank"
        raise ValueError(f"model.seq_len={m.seq_len} must be divisible by {pieces} for "
                         f"parallel.cp_method={method!r} at parallel.cp={p.cp} ({why})")


def _refuse_unread(name: str, section: Section, selector: str, table: dict, keys) -> None:
    """Refuse the first of `keys` set away from its default that the section's chosen
    `selector` value does not read (`table`: value -> the keys it reads)."""
    chosen = getattr(section, selector)
    fields = type(section).model_fields
    unread = [k for k in keys if getattr(section, k) != fields[k].default and k not in table[chosen]]
    if unread:
        readers = [m for m, read in table.items() if unread[0] in read]
        raise ValueError(f"{name}.{unread[0]} is not read by {name}.{selector}={chosen!r}; it is a "
                         f"setting of {', '.join(repr(m) for m in readers)}: set {name}.{selector} "
                         "to one of them or leave the key at its default")


def _check_compression(cfg: Config) -> None:
    """Compression runs in the plain data-parallel engine (fp32, no ZeRO, no low-communication
    wrapper) for gradients, and in DiLoCo's outer all-reduce for pseudo-gradients."""
    c, p = cfg.compression, cfg.parallel
    _refuse_unread("compression", c, "method", COMPRESSION_KEYS, ("ratio", "rank"))
    if c.method == "none":
        others = [k for k in ("error_feedback", "applies_to", "error_every")
                  if getattr(c, k) != CompressionConfig.model_fields[k].default]
        if others:
            raise ValueError(f"compression.{others[0]} is set but compression.method=\"none\": "
                             "choose a method (topk, randomk, powersgd, int8, sign) or leave it unset")
        return
    if c.applies_to == "pseudo_gradients":
        if cfg.lowcomm.algorithm != "diloco":
            raise ValueError(
                f'compression.applies_to="pseudo_gradients" compresses DiLoCo\'s outer all-reduce; '
                f"lowcomm.algorithm={cfg.lowcomm.algorithm!r} has none to compress: set "
                'lowcomm.algorithm="diloco", or applies_to="gradients" without lowcomm')
        return
    if cfg.lowcomm.algorithm != "none":
        raise ValueError(
            f"compression.method={c.method!r} on gradients needs the data-parallel engine, but "
            f"lowcomm.algorithm={cfg.lowcomm.algorithm!r} reduces no gradients: set "
            'compression.applies_to="pseudo_gradients" (DiLoCo) or lowcomm.algorithm="none"')
    if p.zero_stage > 0 or cfg.train.precision != "fp32":
        raise ValueError(
            f"compression.method={c.method!r} runs in the plain data-parallel engine (fp32, "
            f"ZeRO stage 0); parallel.zero_stage={p.zero_stage}, train.precision="
            f"{cfg.train.precision!r} use the sharded engine, whose reduce-scatter it does not "
            "compress: set parallel.zero_stage=0 and train.precision=\"fp32\"")


def _check_sparsity(cfg: Config) -> None:
    """[sparsity]: the keys each method reads, a schedule that fits in training, N:M groups
    that divide the layers' inputs, and the engine it runs in today: plain data parallelism
    (fp32, ZeRO stage 0, no tp, pp or cp), whose replicas hold every weight and the
    all-reduced gradient, so masks computed on each rank agree."""
    s = cfg.sparsity
    _refuse_unread("sparsity", s, "method", SPARSITY_KEYS,
                   [k for k in SparsityConfig.model_fields
                    if k not in ("method", "sam", "rho", "zo_eps", "sparse_comm")])
    default = {k: SparsityConfig.model_fields[k].default for k in ("rho", "zo_eps")}
    if s.sam == "none" and (s.rho != default["rho"] or s.zo_eps != default["zo_eps"]):
        key = "rho" if s.rho != default["rho"] else "zo_eps"
        raise ValueError(f'sparsity.{key} is a setting of sharpness-aware training, which is off '
                         '(sparsity.sam="none"): set sparsity.sam to "sam" or "zo-sam" or leave it unset')
    if s.sam == "sam" and s.zo_eps != default["zo_eps"]:
        raise ValueError('sparsity.zo_eps is the probe step of sparsity.sam="zo-sam"; "sam" takes '
                         "its ascent direction from a backward pass: leave it unset")
    if s.method in SPARSITY_SCHEDULES and s.schedule not in (None, *SPARSITY_SCHEDULES[s.method]):
        raise ValueError(f"sparsity.schedule={s.schedule!r} is not a schedule of sparsity.method="
                         f"{s.method!r}; it follows "
                         f"{' or '.join(repr(x) for x in SPARSITY_SCHEDULES[s.method])}")
    steps = cfg.train.steps
    end = s.end_step if s.end_step is not None else max(1, round(0.75 * steps))
    if s.end_step is not None and s.end_step > steps:
        raise ValueError(f"sparsity.end_step={s.end_step} is after the last step, train.steps={steps}")
    if s.method == "prune" and end <= s.start_step:
        raise ValueError(f"sparsity.start_step={s.start_step} must be before sparsity.end_step="
                         f"{end}{'' if s.end_step is not None else ' (75% of train.steps)'}: the "
                         "cubic schedule prunes from dense at start_step to sparsity.density at end_step")
    if s.method == "nm":
        _check_nm(s, cfg)
    if s.sparse_comm and s.method == "none":
        raise ValueError("sparsity.sparse_comm=true all-reduces only the kept gradient entries; "
                         'sparsity.method="none" keeps them all: choose a sparsity method')
    if s.method == "none" and s.sam == "none":
        return
    p, t = cfg.parallel, cfg.train
    used = f"sparsity.method={s.method!r}" if s.method != "none" else f"sparsity.sam={s.sam!r}"
    others = {"parallel.tp": (p.tp, 1), "parallel.pp": (p.pp, 1), "parallel.cp": (p.cp, 1),
              "parallel.zero_stage": (p.zero_stage, 0), "train.precision": (t.precision, "fp32"),
              "lowcomm.algorithm": (cfg.lowcomm.algorithm, "none"),
              "compression.method": (cfg.compression.method, "none"),
              "async.mode": (cfg.asgd.mode, "none"), "data.balance": (cfg.data.balance, False)}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f"{used} with {key}={value!r} is not supported yet: sparse training "
                             "runs in the plain data-parallel engine, whose replicas hold whole fp32 "
                             "weights and the all-reduced gradient, so that every rank computes the "
                             f"same masks ({key}={allowed!r})")


def _check_nm(s: SparsityConfig, cfg: Config) -> None:
    """N:M groups run along each Linear's inputs: d_model (and mlp_ratio * d_model), and the
    digits classifier's 64 pixels."""
    if s.n >= s.m:
        raise ValueError(f"sparsity.n={s.n} must be less than sparsity.m={s.m} (N:M keeps n of "
                         "every m weights; 2:4 is the one sparse tensor cores run)")
    inputs = {"model.d_model": cfg.model.d_model}
    if cfg.data.source == "digits":
        inputs["the digits' 64 features"] = 64
    for key, width in inputs.items():
        if width % s.m:
            raise ValueError(f"sparsity.m={s.m} must divide {key} = {width}: N:M groups m "
                             "consecutive inputs of each nn.Linear row")


def _check_lowcomm(cfg: Config) -> None:
    """Low-communication replicas run today as plain fp32 replicas of the whole model over dp,
    each on its own rows, checkpointed only where they are synchronized."""
    lc, p, t = cfg.lowcomm, cfg.parallel, cfg.train
    changed = [k for k in LowcommConfig.model_fields if k != "algorithm"
               and getattr(lc, k) != LowcommConfig.model_fields[k].default]
    unread = [k for k in changed if k not in LOWCOMM_KEYS[lc.algorithm]]
    if unread:
        readers = [a for a, keys in LOWCOMM_KEYS.items() if unread[0] in keys]
        raise ValueError(f"lowcomm.{unread[0]} is not read by lowcomm.algorithm="
                         f"{lc.algorithm!r}; it is a setting of "
                         f"{', '.join(repr(a) for a in readers)}: set lowcomm.algorithm to one "
                         "of them or leave the key at its default")
    if lc.outer_optimizer == "sgd" and "outer_momentum" in changed:
        raise ValueError('lowcomm.outer_momentum is the Nesterov momentum; lowcomm.'
                         'outer_optimizer="sgd" has none: use "nesterov" or leave it unset')
    if lc.algorithm == "noloco" and lc.outer_pull >= 2 * (1 + lc.outer_momentum):
        raise ValueError(
            f"lowcomm.outer_pull={lc.outer_pull} must be below 2 x (1 + lowcomm.outer_momentum) "
            f"= {2 * (1 + lc.outer_momentum):g}: NoLoCo's outer step maps the difference between "
            "two partners' weights through x <- (1 + momentum - pull) x - momentum x_prev, which "
            "grows instead of shrinking from that pull on, so paired replicas would move apart; "
            "the paper uses 0.7 (the default)")
    if lc.algorithm == "none":
        return
    if lc.algorithm == "hpsgd" and lc.overlap_steps > 1:
        raise ValueError(f"lowcomm.overlap_steps={lc.overlap_steps} with lowcomm.algorithm="
                         "'hpsgd': HPSGD keeps at most one step's synchronization in flight "
                         "while the next step computes (1, the paper's setting and the default; "
                         "0: wait for it at once, synchronous data parallelism with plain SGD); "
                         "set lowcomm.overlap_steps to 0 or 1")
    others = {"parallel.tp": (p.tp, 1), "parallel.pp": (p.pp, 1), "parallel.cp": (p.cp, 1),
              "parallel.zero_stage": (p.zero_stage, 0), "train.precision": (t.precision, "fp32"),
              "data.packing": (cfg.data.packing, False), "data.balance": (cfg.data.balance, False)}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f"lowcomm.algorithm={lc.algorithm!r} with {key}={value!r} is not "
                             f"supported yet: its replicas are whole fp32 models over dp ({key}="
                             f"{allowed!r})")
    if lc.algorithm == "streaming_diloco":
        _check_streaming(lc, cfg.model)
    if lc.algorithm == "hierarchical":
        _check_hierarchical(lc, p)
    if lc.algorithm == "lordo" and t.optimizer != "adamw":
        raise ValueError(f'lowcomm.algorithm="lordo" replaces train.optimizer with its own '
                         f"low-rank AdamW (the moments of each matrix in a rank-lowcomm.rank "
                         f"subspace), built from train.lr, beta1, beta2 and weight_decay; "
                         f'train.optimizer={t.optimizer!r} has no moments to project: set '
                         f'train.optimizer="adamw"')
    every = cfg.checkpoint.every
    if every % lc.inner_steps:
        fit = -(-every // lc.inner_steps) * lc.inner_steps
        raise ValueError(f"checkpoint.every={every} must be a multiple of lowcomm.inner_steps="
                         f"{lc.inner_steps}: a checkpoint holds one model, so it is written where "
                         f"the replicas synchronize; set checkpoint.every={fit} (or 0: only at "
                         "the end and on a signal)")


def _check_streaming(lc: LowcommConfig, m: ModelConfig) -> None:
    """Streaming DiLoCo (lowcomm/streaming.py): fragments are whole blocks, one sync of each
    per inner_steps steps at offsets H/F apart, and a sync lands before the next one starts."""
    if lc.fragments > m.n_layers:
        raise ValueError(f"lowcomm.fragments={lc.fragments} is more than the model's "
                         f"model.n_layers={m.n_layers} blocks: a fragment is made of whole blocks; "
                         f"set lowcomm.fragments to at most {m.n_layers}")
    if lc.inner_steps % lc.fragments:
        fit = -(-lc.inner_steps // lc.fragments) * lc.fragments
        raise ValueError(f"lowcomm.inner_steps={lc.inner_steps} must be a multiple of "
                         f"lowcomm.fragments={lc.fragments}: fragment p syncs at steps p*H/F "
                         f"(mod H), evenly staggered; set lowcomm.inner_steps={fit}")
    spacing = lc.inner_steps // lc.fragments
    if lc.overlap_steps >= spacing:
        raise ValueError(f"lowcomm.overlap_steps={lc.overlap_steps} must be less than "
                         f"lowcomm.inner_steps / lowcomm.fragments = {lc.inner_steps}/"
                         f"{lc.fragments} = {spacing}, the steps between two fragments' syncs, "
                         "so that one sync lands before the next starts; set lowcomm."
                         f"overlap_steps to at most {spacing - 1} (0: wait at once) or raise "
                         "lowcomm.inner_steps")


def _check_hierarchical(lc: LowcommConfig, p: ParallelConfig) -> None:
    """DASO syncs inside nodes every step and between them every inner_steps steps: it needs
    several nodes, one step of staleness at most, and a period that can change."""
    if p.ranks_per_node is None or p.ranks_per_node >= p.nproc:
        rpn = "unset" if p.ranks_per_node is None else p.ranks_per_node
        raise ValueError(f'lowcomm.algorithm="hierarchical" averages gradients inside each node and '
                         f"parameters between nodes, but parallel.ranks_per_node={rpn} puts all "
                         f"parallel.nproc={p.nproc} ranks on one node: set parallel.ranks_per_node "
                         "to a divisor of nproc below it (e.g. 2 ranks per node)")
    if lc.overlap_steps > 1:
        raise ValueError(f'lowcomm.overlap_steps={lc.overlap_steps} with lowcomm.algorithm='
                         '"hierarchical": its global sync is either waited for at once (0) or '
                         "merged one step stale (1, DASO's asynchronous mode); set 0 or 1")
    if lc.adaptive_period and lc.inner_steps == 1:
        raise ValueError("lowcomm.adaptive_period=true halves the global period from "
                         "lowcomm.inner_steps down to 1, but inner_steps=1 leaves nothing to "
                         "adapt: set lowcomm.inner_steps >= 2 or adaptive_period=false")


def _check_optimal(p: ParallelConfig) -> None:
    """schedule="optimal" decides recomputation and offload per micro-batch itself."""
    if p.schedule != "optimal":
        if p.activation_budget_mb is not None and p.cp_method != "auto":
            raise ValueError('parallel.activation_budget_mb is for parallel.schedule="optimal" '
                             f'or parallel.cp_method="auto" (got schedule={p.schedule!r}, '
                             f"cp_method={p.cp_method!r})")
        return
    for key, default in (("recompute", "none"), ("offload_activations", 0.0)):
        if getattr(p, key) != default:
            raise ValueError(f'parallel.schedule="optimal" chooses recomputation and offload '
                             f"per micro-batch under parallel.activation_budget_mb: leave "
                             f"parallel.{key} at {default!r} (got {getattr(p, key)!r})")


def _check_async(p: ParallelConfig) -> None:
    """schedule="async" steps its own (unsharded) optimizer on every stage and runs its
    forwards on stashed weights, without recomputation or offload: it composes with plain dp
    only. Its keys mean nothing to the other schedules."""
    if p.schedule != "async":
        changed = [k for k in ("async_optimizer", "async_momentum")
                   if getattr(p, k) != ParallelConfig.model_fields[k].default]
        if changed:
            raise ValueError(f'parallel.{changed[0]} is for parallel.schedule="async" (got '
                             f"{p.schedule!r})")
        return
    for key, default in (("zero_stage", 0), ("recompute", "none"), ("offload_activations", 0.0)):
        if getattr(p, key) != default:
            raise ValueError(f'parallel.schedule="async" runs with parallel.{key}={default!r} '
                             f"(got {getattr(p, key)!r}): each stage steps its own optimizer "
                             "after every micro-batch, on stashed weights")


def _check_tensor_parallel(p: ParallelConfig, m: ModelConfig) -> None:
    """tp must split whole attention heads, the vocabulary (the GPT's embedding and head are
    vocabulary-parallel) and the MLP's hidden width; sequence parallelism splits the sequence."""
    if p.sequence_parallel and (p.tp == 1 or m.name != "gpt"):
        raise ValueError("parallel.sequence_parallel=true splits the GPT's layer norms over the "
                         "tensor-parallel ranks; it needs parallel.tp > 1 and model.name=\"gpt\"")
    if p.tp == 1:
        return
    if m.linear_decay:
        # tensor parallelism re-slices the heads but not their decays (attn.decay)
        raise ValueError(f"parallel.tp={p.tp} with model.linear_decay=true is not supported yet; "
                         "use parallel.tp=1 or model.linear_decay=false")
    sizes = {"model.mlp_ratio*model.d_model": m.mlp_ratio * m.d_model}
    if m.name == "gpt":
        sizes = {"model.n_heads": m.n_heads, "model.vocab_size": m.vocab_size, **sizes}
    if p.sequence_parallel:
        sizes["model.seq_len"] = m.seq_len
    for key, n in sizes.items():
        if n % p.tp:
            raise ValueError(f"parallel.tp={p.tp} must divide {key} = {n} (tensor parallelism "
                             f"splits it evenly); choose parallel.tp among its divisors")


def _check_plan(cfg: Config) -> None:
    """parallel.plan="auto" plans the backprop GPT's layouts (planner/cost.py): not the MLP,
    the zeroth-order methods, the parameter server or the low-communication replicas."""
    if cfg.parallel.plan == "none":
        return
    others = {"model.name": (cfg.model.name, "gpt"), "optim.name": (cfg.optim.name, "backprop"),
              "async.mode": (cfg.asgd.mode, "none"), "lowcomm.algorithm": (cfg.lowcomm.algorithm, "none")}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f'parallel.plan="auto" with {key}={value!r} is not supported: the '
                             "planner's cost model covers the backprop GPT on dp, tp, pp, cp and "
                             f"ZeRO ({key}={allowed!r})")


def _check_task(cfg: Config) -> None:
    """data.source="digits" (train/task.py) trains the MLP classifier on whole examples, in
    the engines that split no example or layer: dp, ZeRO, low communication, compression."""
    if cfg.data.source != "digits":
        return
    p = cfg.parallel
    if cfg.model.name != "mlp":
        raise ValueError(f'data.source="digits" is a classification task, trained by the MLP '
                         f'classifier: set model.name="mlp" (got {cfg.model.name!r})')
    others = {"parallel.tp": (p.tp, 1), "parallel.pp": (p.pp, 1), "parallel.cp": (p.cp, 1),
              "data.packing": (cfg.data.packing, False),
              "data.partition": (cfg.data.partition, "iid"), "async.mode": (cfg.asgd.mode, "none")}
    for key, (value, allowed) in others.items():
        if value != allowed:
            raise ValueError(f'data.source="digits" with {key}={value!r} is not supported: an '
                             "example is 64 pixels, with no sequence, vocabulary or files to "
                             f"split, and the classifier runs in the data-parallel engines ({key}="
                             f"{allowed!r})")


def _check_init_from(cfg: Config) -> None:
    """train.init_from loads the model before `parallelize` (train/init_from.py), so every
    synchronous layout accepts it; the parameter server builds its model elsewhere."""
    if cfg.train.init_from is not None and cfg.asgd.mode != "none":
        raise ValueError(f'train.init_from with async.mode={cfg.asgd.mode!r} is not supported yet: '
                         "the parameter server starts from its own initialization; fine-tune with "
                         'the synchronous trainer (async.mode="none"), or resume the server\'s own '
                         "run with --resume")


# what a zeroth-order method cannot run with, and why: {key: (allowed value, reason)}
_ZO_REFUSED = {
    "parallel.tp": (1, "the ranks are data-parallel replicas of the whole model, which perturb "
                       "and update every parameter from the seeds"),
    "parallel.pp": (1, "the ranks are data-parallel replicas of the whole model, which perturb "
                       "and update every parameter from the seeds"),
    "parallel.cp": (1, "the ranks are data-parallel replicas of the whole model, each running "
                       "the forward on whole rows"),
    "parallel.zero_stage": (0, "ZeRO shards gradients and optimizer state; a zeroth-order step "
                               "has no gradient, and its memory is already that of inference"),
    "train.precision": ("fp32", "the probes run the fp32 model (bf16 with fp32 master weights "
                                "is the backprop engine's)"),
    "lowcomm.algorithm": ("none", "the ranks exchange only seeds and scalars every step and "
                                  "stay bitwise identical: there are no replicas to average"),
    "compression.method": ("none", "there is no gradient to compress: the ranks exchange 12 "
                                   "bytes per probe"),
    "async.mode": ("none", "the parameter server applies workers' gradients, and a zeroth-order "
                           "rank computes none"),
    "async.worker_slowdown": ([], "it slows the ranks of the backprop trainer, which the "
                                  "zeroth-order loop is not"),
    "data.packing": (False, "the zeroth-order loop runs the plain model, without the "
                            "sequence runtime that masks documents"),
    "data.balance": (False, "the zeroth-order loop runs the plain model, without the "
                            "sequence runtime that deals documents"),
    "sparsity.method": ("none", "sparse training masks gradients and regrows from them "
                                "(RigL); sparse MeZO (optim.name=\"sparse-mezo\") is the "
                                "zeroth-order method that perturbs only part of the weights"),
    "sparsity.sam": ("none", "SAM and ZO-SAM take backprop steps at perturbed weights"),
    "run.timeline_step": (0, "the timeline is recorded by the backprop engines"),
}
# train.optimizer's keys: backprop's update rule, which a zeroth-order method replaces
_BACKPROP_KEYS = ("optimizer", "beta1", "beta2", "weight_decay", "grad_clip")


def _check_optim(cfg: Config) -> None:
    """[optim]: its zeroth-order keys only with a zeroth-order name, each read by the method
    (`zeroth.hyper_keys`); a zeroth-order method with neither backprop's keys nor the
    engines and layouts it does not run in (zeroth/train.py)."""
    o = cfg.optim
    fields = OptimConfig.model_fields
    changed = [k for k in fields if k != "name" and getattr(o, k) != fields[k].default]
    if o.name == "backprop":
        if changed:
            raise ValueError(f"optim.{changed[0]} is a setting of the zeroth-order methods, but "
                             'optim.name="backprop" (the default) trains with train.optimizer: '
                             f"set optim.name to one of {', '.join(ZO_METHODS)} or leave the "
                             "key unset")
        return
    from loomtrain.zeroth import hyper_keys

    unread = [k for k in changed if k not in ("lr", "trainable") and k not in hyper_keys(o.name)]
    if unread:
        readers = [m for m in ZO_METHODS if unread[0] in hyper_keys(m)]
        raise ValueError(f"optim.{unread[0]} is not read by optim.name={o.name!r}; it is a "
                         f"setting of {', '.join(repr(m) for m in readers)}: set optim.name to "
                         "one of them or leave the key unset")
    for key in _BACKPROP_KEYS:
        value, default = getattr(cfg.train, key), TrainConfig.model_fields[key].default
        if value != default:
            raise ValueError(f"train.{key}={value!r} is a setting of backprop's optimizer; "
                             f"optim.name={o.name!r} updates from forward passes by its own "
                             f"rule and does not read it: leave it at its default ({default!r})")
    for key, (allowed, why) in _ZO_REFUSED.items():
        section, name = key.split(".")
        value = getattr(cfg.asgd if section == "async" else getattr(cfg, section), name)
        if value != allowed:
            raise ValueError(f"optim.name={o.name!r} with {key}={value!r} is not supported: "
                             f"{why} ({key}={allowed!r})")


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value); the value is read as a TOML literal,
    and as a plain string when it is not one (so `--set data.source=/tmp/x.txt` works)."""
    key = text.split("=", 1)[0]
    if "=" not in text or "." not in key or not all(part.strip() for part in key.split(".")):
        raise ConfigError(
            f"--set {text!r} is not of the form section.key=value (for example "
            "--set train.steps=100)"
        )
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def _merge(tree: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {part!r} is a value, not a section")
        tree = node
    tree[path[-1]] = value


def _explain(err: ValidationError) -> str:
    sections = ", ".join(Config.model_fields)
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            section = e["loc"][0] if len(e["loc"]) > 1 else None
            if section in Config.model_fields:
                known = ", ".join(Config.model_fields[section].annotation.model_fields)
                msg = f"unknown key; valid keys in [{section}] are: {known}"
            else:
                msg = f"unknown section; valid sections are: {sections}"
        elif "input" in e and e["type"] != "value_error":
            msg = f"{msg} (got {e['input']!r})"
            if e["type"] == "string_type":
                msg += "; quote text that TOML reads as a value, e.g. --set run.name='\"true\"'"
        # a combination rule names its keys itself: "model: model.d_model=30 ..." says it twice
        named = e["type"] == "value_error" and f"{loc}." in msg
        parts.append(f"{loc}: {msg}" if loc and not named else msg)
    return "invalid configuration: " + "; ".join(parts) + "."


def config_from_dict(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_explain(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist (give a TOML file path)")
        try:
            tree = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    for text in overrides:
        key, value = parse_override(text)
        _merge(tree, key, value)
    return config_from_dict(tree)


def config_to_toml(cfg: Config) -> str:
    data = cfg.model_dump(exclude_none=True)
    return tomli_w.dumps(data)
