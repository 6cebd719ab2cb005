"""Typed schemas for every config group.

Hydra merges conf/*.yaml into these dataclasses, so an unknown key or a wrong type fails at
composition. Range checks live in each ``__post_init__`` and run when ``to_config`` turns the
composed DictConfig into objects, before any data is touched.
"""
from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from frontier import budget_keys, paths, sizing  # noqa: F401  (sizing registers ${frontier.sized:...})

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the source tree (git tags); files go under paths.home()


def project_path(path: str | Path) -> Path:
    """Caches and the MLflow store live under Frontier's home (frontier/paths.py), wherever the command runs."""
    return paths.under_home(path)


class ConfigError(ValueError):
    """A config value that is out of range or inconsistent with another."""


def error_line(err: BaseException, *, named: bool = True) -> str:
    """An error as one line for a message: the first non-blank line of its text, at most 300
    characters, after its type's name (`named=False` leaves the name out, for errors whose text
    says it all). An error with no text is its type's name."""
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    text = text if len(text) <= 300 else text[:297] + "..."
    if not text:
        return type(err).__name__
    return f"{type(err).__name__}: {text}" if named else text


def raised_from(err: BaseException) -> Iterator[BaseException]:
    """`err`, then the error it was raised from or while handling, and so on: a short chain, bounded
    because a chain can loop back."""
    cause: BaseException | None = err
    for _ in range(8):
        if cause is None:
            return
        yield cause
        cause = cause.__cause__ or cause.__context__


def store_error_line(err: BaseException) -> str:
    """An error of a store (MLflow's, Optuna's) as one line, naming the database driver's own error where
    MLflow, Optuna and SQLAlchemy wrap one: their text can open with a note of where it happened ("(raised
    as a result of Query-invoked autoflush; ...)"), and Optuna's StorageInternalError blames "invalid data
    in the commit" for any failed commit, either of which would hide the cause."""
    import sqlalchemy.exc  # installed with MLflow and Optuna; imported only once a store has failed

    for cause in raised_from(err):
        if isinstance(cause, sqlalchemy.exc.DBAPIError) and isinstance(cause.orig, BaseException):
            driver = type(cause.orig)
            return f"{driver.__module__}.{driver.__qualname__}: {error_line(cause.orig, named=False)}"
    if type(err).__name__ == "StorageInternalError" and err.__cause__ is not None:  # optuna.exceptions'
        return error_line(err.__cause__)
    return error_line(err)


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed: {allowed}")


def _choice(key: str, value: str, options: tuple[str, ...]) -> None:
    _require(value in options, key, value, f"choose one of {', '.join(options)}")


def check_device(device: str) -> None:
    _require(re.fullmatch(r"auto|cpu|(cuda|neuron)(:\d+)?", device) is not None, "device", device,
             "choose one of auto, cpu, cuda, cuda:N, neuron, neuron:N")


def _fraction(key: str, value: float) -> None:
    _require(0.0 <= value <= 1.0, key, value, "must be between 0 and 1")


@dataclass
class ModelConfig:
    name: str = "base"  # the preset's name (recorded with the run)
    depth: int = 10  # transformer blocks
    d_model: int = 640  # width of the residual stream
    n_head: int = 5  # query heads
    seq_len: int = 1024  # tokens per training row (the context length)
    # attention
    n_kv_head: Optional[int] = None  # key/value heads shared by groups of query heads (GQA); null = n_head
    head_dim: Optional[int] = None  # null = d_model / n_head
    rope_base: float = 10000.0  # rotary embedding base
    qk_norm: bool = True  # RMSNorm on q and k after rotary
    window_pattern: str = "L"  # per layer, tiled over depth: S = sliding window, L = full; the last layer is L
    short_window: float = 0.5  # an S layer attends to the last short_window * seq_len tokens
    # MLP
    mlp_ratio: float = 4.0  # hidden = mlp_ratio * d_model (swiglu has three matrices of that size)
    activation: str = "relu2"  # relu2 | leaky_relu2 | swiglu | gelu
    activation_slope: float = 0.5  # leaky_relu2's negative slope
    # residual stream
    value_embed_layers: list[int] = field(default_factory=list)  # layers that mix a value embedding into v
    layer_scalars: bool = False  # learned per-layer residual and x0 (embedding skip) scalars
    # head
    softcap: Optional[float] = 15.0  # logits -> softcap * tanh(logits / softcap); null = none
    tie_embeddings: bool = False  # the head reuses the token embedding matrix
    mtp_heads: int = 0  # extra training-only heads predicting tokens t+2 ... t+1+mtp_heads
    mtp_weights: list[float] = field(default_factory=list)  # loss weight of each extra head
    # initialisation
    embed_std: float = 1.0  # standard deviation of the token embedding at initialisation
    head_std: float = 0.001  # standard deviation of the head at initialisation
    # attention and MLP output projections start at zero (each block starts as the identity)
    zero_init_proj: bool = True

    def __post_init__(self) -> None:
        for key in ("depth", "d_model", "n_head", "seq_len"):
            value = getattr(self, key)
            _require(value >= 1, f"model.{key}", value, "must be a positive integer")
        if self.head_dim is None:
            _require(self.d_model % self.n_head == 0, "model.d_model", self.d_model,
                     f"must be divisible by model.n_head={self.n_head} (or set model.head_dim)")
            _require((self.d_model // self.n_head) % 2 == 0, "model.n_head", self.n_head,
                     f"head size d_model/n_head={self.d_model / self.n_head:g} must be even for rotary "
                     "(or set model.head_dim)")
        else:
            _require(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
                     "must be a positive even number (rotary rotates pairs), or null for d_model/n_head")
        if self.n_kv_head is not None:
            _require(1 <= self.n_kv_head <= self.n_head and self.n_head % self.n_kv_head == 0,
                     "model.n_kv_head", self.n_kv_head,
                     f"must divide model.n_head={self.n_head} (1 ... n_head), or null for n_head")
        _require(self.rope_base > 0, "model.rope_base", self.rope_base, "must be positive")
        _require(len(self.window_pattern) > 0 and set(self.window_pattern) <= set("SL"),
                 "model.window_pattern", self.window_pattern,
                 "use the letters S (sliding window) and L (full causal), e.g. SSSL")
        _require(0 < self.short_window <= 1 and int(self.short_window * self.seq_len) >= 1,
                 "model.short_window", self.short_window,
                 f"a fraction of model.seq_len={self.seq_len} in (0, 1]: from one token to the whole sequence")
        _require(self.mlp_ratio > 0, "model.mlp_ratio", self.mlp_ratio, "must be positive")
        _choice("model.activation", self.activation, ("relu2", "leaky_relu2", "swiglu", "gelu"))
        _require(self.activation_slope >= 0, "model.activation_slope", self.activation_slope, "must be >= 0")
        layers = [i % self.depth if -self.depth <= i < self.depth else None for i in self.value_embed_layers]
        _require(None not in layers and len(set(layers)) == len(layers), "model.value_embed_layers",
                 list(self.value_embed_layers),
                 f"distinct layer indices in 0 ... {self.depth - 1} for model.depth={self.depth} "
                 "(negative counts from the end)")
        _require(self.softcap is None or self.softcap > 0, "model.softcap", self.softcap,
                 "must be positive or null")
        _require(0 <= self.mtp_heads < self.seq_len, "model.mtp_heads", self.mtp_heads,
                 f"must be >= 0 and below model.seq_len={self.seq_len}")
        _require(len(self.mtp_weights) == self.mtp_heads and all(w >= 0 for w in self.mtp_weights),
                 "model.mtp_weights", list(self.mtp_weights),
                 f"one weight >= 0 per extra head: model.mtp_heads={self.mtp_heads}")
        for key in ("embed_std", "head_std"):
            value = getattr(self, key)
            _require(value >= 0, f"model.{key}", value, "must be >= 0")


@dataclass
class OptimConfig:
    name: str = "muon"  # muon: Muon for block matrices + AdamW for the rest; adamw: AdamW for all
    matrix_lr: float = 0.04  # learning rate of the block matrices (Muon, or AdamW with optim=adamw)
    embedding_lr: float = 0.6  # AdamW learning rate of the token and value embeddings
    unembedding_lr: float = 0.004  # AdamW learning rate of the head
    scalar_lr: float = 0.5  # per-layer scalars (model.layer_scalars), AdamW
    lr_scale: float = 1.0  # multiplies every group's learning rate: one knob for the whole set (sweep=frontier)
    weight_decay: float = 0.2  # decoupled, on the block matrices only
    adam_betas: list[float] = field(default_factory=lambda: [0.8, 0.95])  # AdamW's (beta1, beta2)
    adam_eps: float = 1e-10  # AdamW's epsilon
    ns_coefficients: str = "polar_express"  # Newton-Schulz coefficients: classic | polar_express
    ns_steps: int = 5  # Newton-Schulz iterations per Muon update
    ns_dtype: str = "auto"  # Newton-Schulz arithmetic: auto (bf16 where the device has it natively) | bf16 | fp32

    def __post_init__(self) -> None:
        _choice("optim.name", self.name, ("muon", "adamw"))
        _choice("optim.ns_coefficients", self.ns_coefficients, ("classic", "polar_express"))
        _choice("optim.ns_dtype", self.ns_dtype, ("auto", "bf16", "fp32"))
        for key in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay"):
            value = getattr(self, key)
            _require(value >= 0, f"optim.{key}", value, "must be >= 0")
        _require(self.lr_scale > 0, "optim.lr_scale", self.lr_scale, "must be positive")
        _require(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas),
                 "optim.adam_betas", list(self.adam_betas), "two numbers in [0, 1)")
        _require(self.adam_eps > 0, "optim.adam_eps", self.adam_eps, "must be positive")
        _require(1 <= self.ns_steps <= 10, "optim.ns_steps", self.ns_steps, "between 1 and 10")


@dataclass
class ScheduleConfig:
    """Learning-rate and momentum schedules, all functions of budget progress in [0, 1]."""

    name: str = "wsd"  # wsd | cosine | constant
    warmup_fraction: float = 0.0  # fraction of the budget over which the learning rate warms up from 0
    warmdown_fraction: float = 0.5  # wsd only: the last fraction of the budget decays linearly
    final_lr_fraction: float = 0.0  # the learning rate at the end, as a fraction of the peak
    momentum_start: float = 0.85  # Muon momentum warms up from start to end
    momentum_end: float = 0.95  # Muon's momentum after its warm-up
    momentum_warmup_fraction: float = 0.1  # fraction of the budget over which Muon's momentum warms up

    def __post_init__(self) -> None:
        _choice("schedule.name", self.name, ("wsd", "cosine", "constant"))
        for key in ("warmup_fraction", "warmdown_fraction", "final_lr_fraction",
                    "momentum_start", "momentum_end", "momentum_warmup_fraction"):
            _fraction(f"schedule.{key}", getattr(self, key))
        if self.name == "wsd":
            total = self.warmup_fraction + self.warmdown_fraction
            _require(total <= 1.0, "schedule.warmdown_fraction", self.warmdown_fraction,
                     f"warmup_fraction + warmdown_fraction must be <= 1 (is {total:g})")


KERNEL_OPS = ("attention", "rmsnorm", "relu2", "leaky_relu2", "gelu", "swiglu", "rotary", "head_loss")


@dataclass
class KernelConfig:
    """Which implementation of each op (kernels/) the model runs. `name` is the preset: reference
    (eager PyTorch), compiled (the same ops, the model wrapped in torch.compile), triton or nki (that
    backend for every op it implements, the reference for the rest). An op key overrides the preset
    for that op: kernel.rmsnorm=nki. Whether this machine can run the choice is checked when the
    model's ops are built, before any data is read."""

    name: str = "reference"  # reference | compiled | triton | nki
    compile_mode: Optional[str] = None  # compiled: passed to torch.compile (e.g. max-autotune)
    # per op: reference | triton | nki, or null for the preset's choice
    attention: Optional[str] = None
    rmsnorm: Optional[str] = None
    relu2: Optional[str] = None
    leaky_relu2: Optional[str] = None
    gelu: Optional[str] = None
    swiglu: Optional[str] = None
    rotary: Optional[str] = None
    head_loss: Optional[str] = None  # unembedding + cross-entropy, chunked over rows

    def __post_init__(self) -> None:
        _choice("kernel.name", self.name, ("reference", "compiled", "triton", "nki"))
        if self.compile_mode is not None:  # torch.compile's modes
            _choice("kernel.compile_mode", self.compile_mode,
                    ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))
        for op in KERNEL_OPS:
            backend = getattr(self, op)
            if backend is not None:
                _choice(f"kernel.{op}", backend, ("reference", "triton", "nki"))

    def overrides(self) -> dict[str, str]:
        """The ops whose backend this config names explicitly."""
        return {op: getattr(self, op) for op in KERNEL_OPS if getattr(self, op) is not None}


@dataclass
class BudgetConfig:
    """What is charged: training-step time after the first `excluded_steps` (compilation),
    whose time is forgiven up to `startup_cap_seconds`. Evaluation is never charged."""

    name: str = "phase1"  # the preset's name (recorded with the run)
    seconds: float = 1800.0  # charged seconds of training
    excluded_steps: int = 5  # the first steps of each launch (compilation) are not charged, up to startup_cap_seconds
    startup_cap_seconds: float = 900.0  # at most this much of the excluded steps' time is forgiven per launch
    max_steps: Optional[int] = None  # also stop after this many steps; progress then = step/max_steps

    def __post_init__(self) -> None:
        _require(self.seconds > 0, "budget.seconds", self.seconds, "must be positive")
        _require(self.excluded_steps >= 0, "budget.excluded_steps", self.excluded_steps, "must be >= 0")
        _require(self.startup_cap_seconds >= 0, "budget.startup_cap_seconds",
                 self.startup_cap_seconds, "must be >= 0")
        _require(self.max_steps is None or self.max_steps >= 1, "budget.max_steps",
                 self.max_steps, "must be a positive integer or null")


@dataclass
class DataConfig:
    name: str = "local"  # the preset's name (recorded with the run)
    source: str = "local"  # local: files under `path`; hub: parquet shards of a Hugging Face dataset
    path: Optional[str] = None  # local: a directory of .parquet/.jsonl/.txt files, or one file
    hub_repo: Optional[str] = None  # hub: dataset repo with shard_%05d.parquet files
    hub_last_shard: int = 0  # hub: index of the last shard, which is the validation split
    train_shards: int = 8  # hub: how many training shards to download and use
    text_column: str = "text"  # the column of a parquet or .jsonl file that holds the text
    val_fraction: float = 0.1  # a single .txt/.jsonl file: the tail held out for validation
    vocab_size: int = 8192  # BPE merges + byte tokens; a BOS token is added on top
    tokenizer_path: Optional[str] = None  # an existing tokenizer.json instead of training one
    tokenizer_train_chars: int = 100_000_000  # characters of the training split the tokenizer is trained on
    cache_dir: str = ".cache"  # a relative path is taken from paths.home

    def __post_init__(self) -> None:
        _choice("data.source", self.source, ("local", "hub"))
        if self.source == "local":
            _require(bool(self.path), "data.path", self.path, "set it to a directory or file of text")
        else:
            _require(bool(self.hub_repo), "data.hub_repo", self.hub_repo, "set it to a dataset repo id")
            _require(self.train_shards >= 1, "data.train_shards", self.train_shards, "must be >= 1")
            _require(self.train_shards <= self.hub_last_shard, "data.train_shards", self.train_shards,
                     f"at most data.hub_last_shard={self.hub_last_shard}")
        _require(bool(self.cache_dir.strip()), "data.cache_dir", self.cache_dir, "set it to a directory for caches")
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        _require(260 <= self.vocab_size <= 65535, "data.vocab_size", self.vocab_size,
                 "between 260 (bytes + a few merges) and 65535 (tokens are stored as uint16)")
        _require(self.tokenizer_train_chars > 0, "data.tokenizer_train_chars",
                 self.tokenizer_train_chars, "must be positive")


@dataclass
class TrainConfig:
    batch_tokens: int = 65536  # global tokens per optimizer step
    device_batch_rows: int = 8  # rows of seq_len per forward/backward; the rest is accumulation
    log_every_fraction: float = 0.005  # metrics cadence, as a fraction of the budget
    loss_ceiling: float = 100.0  # a mean training loss above this (or NaN/inf) stops the run as diverged

    def __post_init__(self) -> None:
        _require(self.batch_tokens >= 1, "train.batch_tokens", self.batch_tokens, "must be positive")
        _require(self.loss_ceiling > 0, "train.loss_ceiling", self.loss_ceiling, "must be positive")

        _require(self.device_batch_rows >= 1, "train.device_batch_rows", self.device_batch_rows,
                 "must be positive")
        _require(0 < self.log_every_fraction <= 1, "train.log_every_fraction",
                 self.log_every_fraction, "must be in (0, 1]")


@dataclass
class CheckpointConfig:
    every_fraction: float = 0.25  # a resumable resume.pt at each such fraction of the budget; 0 = off

    def __post_init__(self) -> None:
        _fraction("checkpoint.every_fraction", self.every_fraction)


@dataclass
class EvalConfig:
    every_fraction: float = 0.1  # val_bpb at each k-th fraction of the budget (0 = only at the end)
    # tokens of the fixed subset evaluated at each checkpoint; null: sized to the device and budget
    checkpoint_tokens: Optional[int] = None
    # tokens of the final evaluation (capped by the split); null: sized to the device and budget
    final_tokens: Optional[int] = None
    batch_rows: int = 8  # rows per forward pass during evaluation
    core: bool = False  # CORE after training, outside the budget
    core_bundle: str = "${oc.select:paths.data,${frontier.data:}}/core"  # paths.data, or frontier/paths.py alone
    # CORE on at most this many items per task (the first after the fixed shuffle); null = every item
    core_max_per_task: Optional[int] = None

    def __post_init__(self) -> None:
        _fraction("eval.every_fraction", self.every_fraction)
        _require(self.core_max_per_task is None or self.core_max_per_task >= 1, "eval.core_max_per_task",
                 self.core_max_per_task, "a positive number of items per task, or null for every item")
        for key in ("checkpoint_tokens", "final_tokens", "batch_rows"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"eval.{key}", value,
                     "must be positive" + ("" if key == "batch_rows" else ", or null to size it to the device and budget"))


@dataclass
class TrackingConfig:
    enabled: bool = True  # record the run in MLflow
    uri: Optional[str] = None  # default: MLFLOW_TRACKING_URI, else sqlite:///<root>/mlruns/mlflow.db
    experiment: str = "frontier"  # the MLflow experiment runs go to
    required: bool = True  # an unreachable store stops the run before training
    log_checkpoint: bool = False  # also upload final.pt as an MLflow artifact
    run_name: Optional[str] = None  # the MLflow run's name
    parent_run_id: Optional[str] = None  # set by the sweeper: trials are nested under the sweep's run
    flush_seconds: float = 10.0  # at the end, how long to wait for the store; the rest is left to `sync`

    def __post_init__(self) -> None:
        _require(bool(self.experiment), "tracking.experiment", self.experiment, "name an MLflow experiment")
        _require(not in_memory_sqlite(self.uri), "tracking.uri", self.uri, "an in-memory database ends with the process, so "
                 "no later command could find the run; name a file, e.g. sqlite:///mlruns/mlflow.db")
        _require(0 <= self.flush_seconds < float("inf"), "tracking.flush_seconds", self.flush_seconds,
                 "a finite number of seconds >= 0")


@dataclass
class TrialConfig:
    """Set by the sweeper: which Optuna trial this job reports to."""

    study: Optional[str] = None  # the Optuna study this run is a trial of
    storage: Optional[str] = None  # that study's storage
    number: Optional[int] = None  # the trial's number in the study
    heartbeat_interval: Optional[int] = None  # seconds between the trial's heartbeats (null: none)
    grace_period: float = 120.0  # a driver on another machine silent this long is gone


SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp")
PRUNERS = ("hyperband", "successive_halving", "median", "none")
OBJECTIVES = ("val_bpb", "composite", "pareto")


# the keys a frontier sweep crosses: the sweeper writes them into each trial, the fit reads them back
FRONTIER_DEPTH, FRONTIER_LR_SCALE, FRONTIER_BUDGET = "model.depth", "optim.lr_scale", "budget.seconds"
# and the user attributes of the trials that follow its grid: a step beyond the bracket; sweep.validate's plan
FRONTIER_EXTENSION, FRONTIER_VALIDATE_PLAN = "lr_extension", "validate_plan"


@dataclass
class FrontierConfig:
    """The family of shapes a frontier sweep trains: depth grows, d_model = depth x aspect_ratio rounded
    up to whole heads of head_dim, crossed with a bracket of learning-rate scales (sweeps/frontier.yaml)."""

    depths: Optional[list[int]] = None  # null: sized to the device (CPU 1, 2, 3, 4, 6, 8; accelerators 6 ... 16 by 2)
    aspect_ratio: Optional[int] = None  # null: the composed model's d_model / depth
    head_dim: Optional[int] = None  # null: 32 on a CPU, else the composed model's head size
    lr_scales: list[float] = field(default_factory=lambda: [0.7, 1.4])  # optim.lr_scale of each shape's runs

    def __post_init__(self) -> None:
        if self.depths is not None:
            _require(len(set(self.depths)) == len(self.depths) >= 3 and min(self.depths) >= 1,
                     "sweep.frontier.depths", list(self.depths),
                     "at least three distinct positive depths: a parabola needs three shapes")
        _require(self.aspect_ratio is None or self.aspect_ratio >= 1, "sweep.frontier.aspect_ratio",
                 self.aspect_ratio, "a positive integer (d_model per layer), or null for the model's own")
        _require(self.head_dim is None or (self.head_dim >= 2 and self.head_dim % 2 == 0),
                 "sweep.frontier.head_dim", self.head_dim,
                 "a positive even number (rotary rotates pairs), or null for the model's own")
        _require(len(self.lr_scales) >= 1 and all(s > 0 for s in self.lr_scales)
                 and len(set(self.lr_scales)) == len(self.lr_scales), "sweep.frontier.lr_scales",
                 list(self.lr_scales), "distinct positive multipliers of the learning rates, e.g. [0.5, 1.0]")


@dataclass
class SweepConfig:
    """A budgeted Optuna search: `--multirun sweep=NAME` (presets in sweeps/, run by
    hydra_plugins/frontier_sweeper). Checkpoint k is the k-th `eval.every_fraction` of the budget."""

    name: str = "custom"  # the preset's name; the study's default name
    # key -> Hydra sweep syntax: choice(a, b), range(lo, hi, step), interval(lo, hi),
    # tag(log, interval(lo, hi)); a plain value is passed to every trial
    params: dict[str, str] = field(default_factory=dict)
    study_name: Optional[str] = None  # default: `name`; the same study name continues the study
    storage: Optional[str] = None  # RDB URL (postgresql://...) or a journal file; default mlruns/sweeps/<study>.journal
    n_trials: Optional[int] = 20  # trials in the study in total, across re-runs and machines (grid: null = all)
    timeout: Optional[float] = None  # seconds after which this command starts no new trial
    n_jobs: int = 1  # trials at once on this machine, each on its own device(s)
    devices_per_trial: int = 1  # > 1: each trial is a torchrun job over that many devices (or CPU processes)
    max_failures: int = 10  # this command starts no new trial once more trials than this have failed
    sampler: str = "tpe"  # tpe | random | grid | cmaes | gp
    seed: Optional[int] = 0  # the sampler's seed: trial N's sampler is seeded from it and N
    n_startup_trials: int = 10  # tpe, gp, cmaes: random trials before the model guides the search
    pruner: str = "hyperband"  # hyperband | successive_halving | median | none
    objective: str = "val_bpb"  # val_bpb | composite (phase-2 score as a loss) | pareto (val_bpb and core)
    composite_val_bpb: list[float] = field(default_factory=lambda: [1.5, 0.8])  # [worst, best] anchors
    composite_core: list[float] = field(default_factory=lambda: [0.0, 0.25])  # [worst, best] anchors
    count_failed: bool = True  # false: failed trials do not count toward n_trials (max_failures still stops)
    min_resource: int = 1  # the first checkpoint at which a trial can be pruned
    reduction_factor: int = 3  # hyperband, successive_halving: keep 1 in this many at each rung
    heartbeat_interval: int = 30  # seconds between a running trial's (and a driver's) heartbeats
    grace_period: int = 120  # a trial silent this long is killed and FAIL; a silent driver is gone
    # a trial running longer is killed and FAIL; null: its budget, startup cap and an evaluation allowance
    trial_timeout: Optional[float] = None
    confirm: Optional[int] = None  # blocks (a seed each) of the best and the baseline; null: 3 for >= 8 trials
    confirm_top: int = 2  # how many of the best configurations are confirmed
    confirm_max: Optional[int] = None  # blocks at most while the verdict is unresolved; null: twice `confirm`
    equivalence: float = 0.002  # the val_bpb difference that does not matter: ~1 place in the competition's top 10
    budgets: Optional[list[float]] = None  # budget.seconds of each trial, a grid axis; null: the run's budget
    ladder: Optional[list[float]] = None  # increasing budgets: the best `promote` share of a rung trains the next
    promote: float = 1 / 3  # the share of a rung's finished configurations that climbs (frontier/ladder.py)
    frontier: Optional[FrontierConfig] = None  # a frontier sweep's family of shapes (sweeps/frontier.yaml)
    validate: int = 0  # seeds of the frontier fit's optimum shape and its two neighbours, trained after the fit
    min_relative_speed: float = 0.8  # below this share of its shape's median tokens/s a trial is contended

    def __post_init__(self) -> None:
        _choice("sweep.sampler", self.sampler, SAMPLERS)
        _choice("sweep.pruner", self.pruner, PRUNERS)
        _choice("sweep.objective", self.objective, OBJECTIVES)
        for key in ("composite_val_bpb", "composite_core"):
            anchors = getattr(self, key)
            _require(len(anchors) == 2 and anchors[0] != anchors[1], f"sweep.{key}", anchors,
                     "two different values, [worst, best]")
        _require(self.name.strip() != "", "sweep.name", self.name, "name the sweep (its study's default name)")
        _require(self.study_name is None or self.study_name.strip() != "", "sweep.study_name", self.study_name,
                 "name a study, or leave it null for the preset's name")
        _require(not in_memory_sqlite(self.storage), "sweep.storage", self.storage, "an in-memory database ends "
                 "with the driver, and no trial's process could reach it; name a file or a database server")
        _require(self.n_trials is None or self.n_trials >= 1, "sweep.n_trials", self.n_trials,
                 "a positive integer or null")
        _require(self.timeout is None or self.timeout > 0, "sweep.timeout", self.timeout,
                 "positive seconds or null")
        _require(self.n_jobs >= 1, "sweep.n_jobs", self.n_jobs, "must be a positive integer")
        _require(self.seed is None or 0 <= self.seed < 2**32, "sweep.seed", self.seed,
                 "an integer in 0 ... 4294967295 (numpy's seed range) or null")
        _require(self.devices_per_trial >= 1, "sweep.devices_per_trial", self.devices_per_trial,
                 "must be a positive integer")
        _require(self.max_failures >= 0, "sweep.max_failures", self.max_failures, "must be >= 0")
        _require(self.n_startup_trials >= 0, "sweep.n_startup_trials", self.n_startup_trials, "must be >= 0")
        _require(self.min_resource >= 1, "sweep.min_resource", self.min_resource, "must be >= 1")
        _require(self.reduction_factor >= 2, "sweep.reduction_factor", self.reduction_factor, "must be >= 2")
        _require(self.heartbeat_interval >= 1, "sweep.heartbeat_interval", self.heartbeat_interval,
                 "must be >= 1 second")
        _require(self.trial_timeout is None or self.trial_timeout > 0, "sweep.trial_timeout",
                 self.trial_timeout, "positive seconds or null")
        _require(self.confirm is None or self.confirm >= 0, "sweep.confirm", self.confirm,
                 "seeds per confirmed configuration: 0 (off), a positive integer, or null (3 for >= 8 trials)")
        _require(self.confirm != 1, "sweep.confirm", self.confirm,
                 "at least 2 seeds, or the seeds' noise cannot be measured; 0 turns confirmation off")
        _require(0 < self.min_relative_speed <= 1, "sweep.min_relative_speed", self.min_relative_speed,
                 "a fraction in (0, 1] of the median speed of a trial's peers")
        _require(self.confirm_top >= 1, "sweep.confirm_top", self.confirm_top, "must be a positive integer")
        _require(self.validate == 0 or (self.validate >= 2 and self.frontier is not None), "sweep.validate",
                 self.validate, "0 (off), or at least 2 seeds (a comparison needs each shape's spread) on a "
                 "frontier sweep (sweep=frontier), whose fit predicts the shape to validate")
        first = 3 if self.confirm is None else self.confirm  # the blocks confirmation starts with
        _require(self.confirm_max is None or self.confirm_max >= first, "sweep.confirm_max", self.confirm_max,
                 f"at least the {first} blocks confirmation starts with (sweep.confirm), or null for twice that")
        _require(self.equivalence >= 0, "sweep.equivalence", self.equivalence, "a val_bpb difference >= 0")
        _require(self.grace_period > self.heartbeat_interval, "sweep.grace_period", self.grace_period,
                 f"must be longer than sweep.heartbeat_interval={self.heartbeat_interval}")
        budget_keys.check(self, _require)


@dataclass
class PathsConfig:
    """Where files live (frontier/paths.py). Defaults: FRONTIER_HOME / FRONTIER_DATA, else the checkout."""

    home: str = "${frontier.home:}"  # mlruns/, .cache/, outputs/, multirun/
    data: str = "${frontier.data:}"  # text shards and the CORE bundle


@dataclass
class Config:
    model: ModelConfig = MISSING
    optim: OptimConfig = MISSING
    schedule: ScheduleConfig = MISSING
    kernel: KernelConfig = MISSING
    budget: BudgetConfig = MISSING
    data: DataConfig = MISSING
    paths: PathsConfig = field(default_factory=PathsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)
    sweep: Optional[SweepConfig] = None  # selected with sweep=NAME; read by the sweeper only
    device: str = "auto"  # auto | cpu | cuda | neuron (a specific index like cuda:1 also works)
    precision: str = "auto"  # auto: bf16 where the device computes it natively, else fp32; bf16: autocast; fp32
    neuron_logical_cores: Optional[int] = None  # Trainium2: 2 pairs the 8 NeuronCores into 4 (LNC=2); 1 = all 8
    seed: int = 1337  # seeds the model's initialisation and the order of the training rows
    compile_only: bool = False  # build and compile the model, run the excluded steps, then exit
    resume: Optional[str] = None  # a run directory (or MLflow run id) to continue from its resume.pt

    def __post_init__(self) -> None:
        check_device(self.device)
        _choice("precision", self.precision, ("auto", "bf16", "fp32"))
        _require(0 <= self.seed < 2**32, "seed", self.seed, "an integer in 0 ... 4294967295 (numpy's seed range)")
        _require(self.neuron_logical_cores in (None, 1, 2), "neuron_logical_cores", self.neuron_logical_cores,
                 "1 (8 logical cores per Trainium2 chip), 2 (4 logical cores) or null (the runtime's default)")
        rows_per_step, remainder = divmod(self.train.batch_tokens, self.model.seq_len)
        _require(remainder == 0, "train.batch_tokens", self.train.batch_tokens,
                 f"must be a multiple of model.seq_len={self.model.seq_len}")
        _require(rows_per_step % self.train.device_batch_rows == 0 or
                 rows_per_step < self.train.device_batch_rows, "train.device_batch_rows",
                 self.train.device_batch_rows,
                 f"must divide the {rows_per_step} rows of a step (train.batch_tokens / model.seq_len)")


SCHEMA_NAME = "frontier_schema"  # the typed config a primary config builds on


def in_memory_sqlite(url: Optional[str]) -> bool:
    return url is not None and re.fullmatch(r"sqlite://(/:memory:)?(\?.*)?", url) is not None


def register_schemas() -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations and build the typed objects, running every range check."""
    check_keys(cfg)
    if "paths" in cfg:  # before anything resolves: every default path (data, caches, the store) follows it
        paths.use(cfg.paths)
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def check_keys(cfg: DictConfig, path: str = "") -> None:
    """What the schema alone lets through: Hydra's `+key=value` adds a key even to a typed group,
    and inf or nan pass as floats."""
    schema = OmegaConf.get_type(cfg)
    names = [f.name for f in fields(schema)] if is_dataclass(schema) else None
    for key, value in cfg.items_ex(resolve=True):
        if names is not None and key not in names:
            raise ConfigError(f"{path}{key}={value!r} is not allowed: {key_hint(path.rstrip('.'), str(key), names)}")
        if isinstance(value, DictConfig):
            check_keys(value, f"{path}{key}.")
        for number in value if isinstance(value, ListConfig) else [value]:
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"{path}{key}={value!r} is not allowed: numbers must be finite")


def key_hint(where: str, key: str, names: list[str]) -> str:
    """`where` has no `key`: the nearest key, else all of them."""
    group = where or "the config"
    nearest = difflib.get_close_matches(key, names, n=1)
    if nearest:
        return f"{group} has no key {key!r}; did you mean {nearest[0]}?"
    return f"{group} has no key {key!r}; its keys are {', '.join(names)}"
