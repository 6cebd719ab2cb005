"""One budgeted training run, read top to bottom; `python -m frontier.train` is its command line.

config checks -> sinks (MLflow, the sweep trial: an unreachable one fails here, in seconds) ->
data -> model -> optimizers -> loop (budget clock, schedule, evals at budget fractions, stops only
at step boundaries) -> final val_bpb -> checkpoint and summary. Returns val_bpb for a sweeper to
minimise. The run's states and terminal writes belong to frontier.lifecycle.
"""
from __future__ import annotations

import math
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

import frontier
from frontier import lifecycle, sizing
from frontier.budget import BudgetClock
from frontier.checkpoint import CheckpointError, read_checkpoint, save_final, write_torch
from frontier.config import Config, ConfigError, error_line, register_schemas, to_config
from frontier.core import check_bundle, core_metrics
from frontier.data import DataError, PackedLoader, ValidationSet, load_corpus, load_tokenizer, resolve_splits, validation_set
from frontier.device import Device, device_kind, peak_figures, resolve_device
from frontier.distributed import World, init_world
from frontier.evaluate import Score, val_bpb
from frontier.lifecycle import Lifecycle, RunInfo
from frontier.model import GPT, Ops, build as build_model
from frontier.observers import StopRun
from frontier.optim import apply_schedule, build_optimizers
from frontier.progress import RunDisplay
from frontier.schedule import lr_multiplier, muon_momentum
from frontier.timing import TimeAccount

register_schemas()

MLFLOW_RUN_ID = re.compile(r"[0-9a-f]{32}")


class Diverged(RuntimeError):
    """The training loss became NaN, infinite, or absurdly large."""


class StepTime:
    """The budget clock's one collective per step: every rank charges the slowest rank's step time, and
    the same all-reduce says whether any rank was asked to stop, so data-parallel ranks stop at the next
    step boundary rather than the next log point, at no extra cost (torchrun kills its ranks 30 s after
    it passes a signal on, and phase 2's log points lie 72 s apart)."""

    def __init__(self, world: World | None = None):
        self.world = world or World()
        self.stop_seen = False  # at the end of the last step, on any rank

    def __call__(self, seconds: float) -> float:
        seconds, stop = self.world.max(seconds, float(lifecycle.stop_requested() is not None))
        self.stop_seen = stop > 0
        return seconds


@dataclass
class Run:
    """Everything one training run builds, so that phases can be read one at a time."""

    config: Config
    raw: DictConfig
    run_dir: Path
    device: Device
    model: GPT
    step_model: torch.nn.Module  # the model the loop calls: compiled or not
    tokenizer: object
    loader: PackedLoader
    val_set: ValidationSet  # the final evaluation's
    checkpoint_set: ValidationSet  # each periodic evaluation's: the final set's first rows
    optimizers: list
    clock: BudgetClock
    world: World
    step_time: StepTime = field(default_factory=StepTime)  # the clock's collective (the loop reads its stop)
    summary: dict = field(default_factory=dict)
    account: TimeAccount = field(default_factory=TimeAccount)  # where this launch's wall time goes
    tokens_seen: int = 0


@dataclass
class Plan:
    """What is decided before any data is read: every check a user's mistake can fail."""

    config: Config
    device: Device
    world: World
    ops: Ops
    splits: tuple  # (train, val) files: listed, not read


def check_runnable(config: Config) -> None:
    """What a configuration needs of this machine, touching nothing: its device, its kernels (one this
    machine cannot run stops here) and the CORE bundle. The command line checks it before Hydra runs."""
    kind = device_kind(config.device)
    if config.eval.core:
        check_bundle(str(config.eval.core_bundle))
    Ops(config.kernel, kind)


def eval_sizing(config: Config, device: Device, ops: Ops) -> tuple[int, int, str]:
    """eval.final_tokens and eval.checkpoint_tokens as the config gives them, and where it leaves them
    null as sizing.eval_tokens picks them for this configuration on this device (the model's FLOPs per
    token from a model on the meta device: nothing is allocated); and why."""
    with torch.device("meta"):
        flops_per_token = GPT(config.model, config.data.vocab_size, ops).flops_per_token()
    peak, _ = device.peak_flops()
    final, checkpoint, why = sizing.eval_tokens(config.budget.seconds, config.eval.every_fraction, peak,
                                                flops_per_token, config.model.seq_len)
    final = config.eval.final_tokens or final
    return final, config.eval.checkpoint_tokens or min(checkpoint, final), why


def size_evaluation(config: Config, raw: DictConfig, device: Device, ops: Ops) -> str | None:
    """Fills eval.final_tokens and eval.checkpoint_tokens where the command left them null, in the config
    and in the record of it (MLflow's params, resume.pt, final.pt); returns the line that says so."""
    if config.eval.final_tokens is not None and config.eval.checkpoint_tokens is not None:
        return None
    config.eval.final_tokens, config.eval.checkpoint_tokens, why = eval_sizing(config, device, ops)
    with open_dict(raw), read_write(raw):
        raw.eval.final_tokens, raw.eval.checkpoint_tokens = config.eval.final_tokens, config.eval.checkpoint_tokens
    return (f"evaluation: {config.eval.final_tokens:,} tokens at the end, {config.eval.checkpoint_tokens:,} at each "
            f"checkpoint ({why})")


def prepare(raw: DictConfig, run_dir: Path) -> Plan:
    """Every check a configuration can fail, before any data is read or any sink is built."""
    config = to_config(raw)  # every range check
    check_runnable(config)
    device = resolve_device(config.device, config.precision, config.neuron_logical_cores)
    ops = Ops(config.kernel, device.kind)
    sized = size_evaluation(config, raw, device, ops)
    if sized:
        print(sized, file=sys.stderr)
    splits = resolve_splits(config.data)  # a data.path with no data in it stops here
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"the run directory {run_dir} cannot be created ({err.strerror or err})") from None
    world = init_world(device.kind)
    try:
        check_micro_batches(config, world.size)
    except ConfigError:
        world.close()
        raise
    if world.active and device.kind in ("cuda", "neuron"):
        device.torch_device = torch.device(world.device)
    return Plan(config, device, world, ops, splits)


def check_micro_batches(config: Config, world_size: int) -> None:
    """Each rank's share of a step must split into whole micro-batches, or the gradient is mis-scaled."""
    batch, seq, micro = config.train.batch_tokens, config.model.seq_len, config.train.device_batch_rows
    rows = batch // seq
    if rows % world_size:
        raise ConfigError(f"train.batch_tokens={batch} is not allowed: it gives {rows} rows of model.seq_len={seq} "
                          f"per step, which the world size {world_size} does not divide")
    share = rows // world_size
    if share > micro and share % micro:
        raise ConfigError(f"train.device_batch_rows={micro} is not allowed: each of the {world_size} rank(s) gets "
                          f"{share} rows per step (train.batch_tokens={batch} / model.seq_len={seq} / "
                          f"{world_size}), which do not split into whole micro-batches of {micro} rows")


def setup(raw: DictConfig, run_dir: Path, plan: Plan, summary: dict) -> Run:
    """Reads the data and builds the model, optimizers, loader and clock."""
    config, device, world = plan.config, plan.device, plan.world
    torch.manual_seed(config.seed)
    train_split, val_split = plan.splits
    tokenizer = load_tokenizer(config.data, train_split)
    train_corpus = load_corpus(train_split, tokenizer, config.data, "train")
    val_corpus = load_corpus(val_split, tokenizer, config.data, "val")
    seq = config.model.seq_len
    if train_corpus.num_tokens < seq + 1:
        raise DataError(f"the training split has {train_corpus.num_tokens} tokens, fewer than one row of "
                        f"model.seq_len + 1 = {seq + 1}")
    val_set = validation_set(val_corpus, tokenizer, seq, config.eval.final_tokens)
    summary.update({
        "data_train_tokens": train_corpus.num_tokens,
        "data_val_tokens_available": val_corpus.num_tokens,
        "val_fingerprint": val_set.fingerprint(),  # what val_bpb is scored on: runs compare only when equal
        "data_val_documents": val_corpus.num_documents,
        "data_skipped_empty_documents": sum(c.meta.get("skipped_empty_documents", 0)
                                            for c in (train_corpus, val_corpus)),
        "data_empty_files": [f for c in (train_corpus, val_corpus) for f in c.meta.get("empty_files", [])],
    })
    model, step_model = build_model(config, tokenizer.vocab_size, device, plan.ops)
    optimizers = build_optimizers(model.param_groups(), config.optim, device.kind, world.rank, world.size)
    # Every rank packs the same global batch and trains on its own slice of it.
    loader = PackedLoader(train_corpus, seq, rows=config.train.batch_tokens // seq, seed=config.seed)
    step_time = StepTime(world)
    clock = BudgetClock(config.budget, device.synchronize, step_time)
    return Run(config, raw, run_dir, device, model, step_model, tokenizer, loader, val_set,
               val_set.head(config.eval.checkpoint_tokens), optimizers, clock, world, step_time, summary)


def describe(run: Run) -> dict:
    """Static facts of the run: sizes, cost per token, the device, its precision and peak rate."""
    params = run.model.num_params()
    return {
        "params": params["total"],
        "params_embedding": params["embedding"],
        "params_non_embedding": params["non_embedding"],
        "flops_per_token": run.model.flops_per_token(),
        "vocab_size": run.tokenizer.vocab_size,
        "device": run.device.name,
        "precision": run.device.precision,
        "precision_reason": getattr(run.device, "precision_reason", ""),
        **peak_figures(run.device),
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "budget": run.config.budget.name,
        "budget_seconds": run.config.budget.seconds,
        "world_size": run.world.size,
        "threads": torch.get_num_threads(),
        "mfu_basis": "cpu time" if run.device.kind == "cpu" else "wall clock",
    }


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over `train.batch_tokens` tokens; returns the mean loss (on device)."""
    cfg = run.config
    progress = run.clock.progress
    apply_schedule(run.optimizers, lr_multiplier(cfg.schedule, progress), muon_momentum(cfg.schedule, progress))
    rows = torch.from_numpy(run.loader.next_rows())
    share = rows.size(0) // run.world.size
    rows = rows[run.world.rank * share:(run.world.rank + 1) * share].to(run.device.torch_device, non_blocking=True)
    micro = min(cfg.train.device_batch_rows, rows.size(0))  # whole micro-batches: check_micro_batches
    accumulation = rows.size(0) // micro
    total = torch.zeros((), device=run.device.torch_device)
    for chunk in rows.split(micro):
        with run.device.autocast():
            loss = run.step_model(chunk[:, :-1], chunk[:, 1:])
        (loss / accumulation).backward()
        total += loss.detach()
    run.world.average_gradients(run.model)
    for opt in run.optimizers:
        opt.step()
    run.model.zero_grad(set_to_none=True)
    return total / accumulation


def evaluate(run: Run, vset: ValidationSet) -> Score:
    return val_bpb(run.step_model, vset, run.tokenizer.token_bytes, run.device, run.config.eval.batch_rows)


def next_mark(progress: float, every: float) -> float:
    """The first multiple of `every` after `progress` (inf when `every` is 0)."""
    return (int(progress / every + 1e-9) + 1) * every if every > 0 else math.inf


def marks_reached(progress: float, every: float) -> int:
    """How many multiples of `every` lie at or below `progress`."""
    return int(progress / every + 1e-9) if every > 0 else 0


def mfu(tokens: float, seconds: float, cpu_seconds: float, summary: dict) -> float | None:
    """Model FLOPs over the peak. On a CPU per CPU-second (`mfu_basis`: a busy neighbour takes wall-clock
    time from a run, not CPU time) against the peak of the run's threads; elsewhere per second."""
    peak = summary.get("peak_flops")
    if not peak:
        return None
    if summary.get("mfu_basis") == "cpu time" and cpu_seconds > 0:
        return tokens / cpu_seconds * summary["threads"] * summary["flops_per_token"] / peak
    return tokens / seconds * summary["flops_per_token"] / peak if seconds > 0 else 0.0


def loop(run: Run, display: RunDisplay, life: Lifecycle, started: float) -> str | None:
    """Trains until the budget is spent; returns the reason when a signal or `request_stop` ended it
    early (always at a step boundary, so resume.pt can be written consistently)."""
    cfg, clock = run.config, run.clock
    log_every, eval_every = cfg.train.log_every_fraction, cfg.eval.every_fraction
    save_every = cfg.checkpoint.every_fraction
    # Derived from progress, so a resumed run keeps the same cadence.
    next_log = next_mark(clock.progress, log_every) if clock.steps else 0.0
    next_save = next_mark(clock.progress, save_every)
    marks_reported = marks_reached(clock.progress, eval_every)
    loss_sum, loss_count = torch.zeros(()), 0
    log_start, log_tokens, log_cpu = clock.charged, clock.charged_tokens, clock.charged_cpu
    stopping, check_stop = False, True
    loop_start = time.perf_counter()
    run.summary["startup_seconds"] = loop_start - started  # this launch's train() call to the first step
    run.account.mark_startup()
    frontier.startup_over()
    while not clock.done:
        if stopping or (check_stop and agreed_stop(run)):
            break
        with clock.step(cfg.train.batch_tokens):
            loss = train_step(run)
        run.tokens_seen += cfg.train.batch_tokens
        loss_sum = loss_sum.to(loss.device) + loss
        loss_count += 1
        if cfg.compile_only and clock.launch_steps >= max(cfg.budget.excluded_steps, 1):
            break
        progress = clock.progress
        # The step a stop arrived in is logged too, so no step's loss is left out: all ranks agree on it
        # through the step's own collective (the mean below is one too). A single process checks again
        # before the next step; data-parallel ranks learn of a later stop from that step's collective.
        stopping = run.step_time.stop_seen if run.world.active else lifecycle.stop_requested() is not None
        logged = progress >= next_log - 1e-9 or clock.done or stopping
        check_stop = not run.world.active
        if logged:
            mean_loss = run.world.mean((loss_sum / loss_count).item())  # the only host sync, at the log cadence
            if not math.isfinite(mean_loss) or mean_loss > cfg.train.loss_ceiling:
                raise Diverged(f"diverged at step {clock.steps} (loss={mean_loss:g})")
            interval = clock.charged - log_start  # charged tokens over charged time: never the excluded steps
            metrics = {
                "train/loss": mean_loss,
                "lr_multiplier": lr_multiplier(cfg.schedule, progress),
                "tokens_seen": run.tokens_seen,
                "charged_seconds": clock.charged,
                "progress": progress,
            }
            if interval > 0:  # no rate over the excluded steps alone: a 0 would be plotted as one
                metrics["tokens_per_second"] = (clock.charged_tokens - log_tokens) / interval
                metrics["mfu"] = mfu(clock.charged_tokens - log_tokens, interval, clock.charged_cpu - log_cpu,
                                     run.summary) or 0.0
            life.notify("on_log", metrics, clock.steps)
            display.update(progress, metrics, clock.seconds_left)
            loss_sum, loss_count = torch.zeros(()), 0
            log_start, log_tokens, log_cpu = clock.charged, clock.charged_tokens, clock.charged_cpu
            next_log = next_mark(progress, log_every)
        if clock.done:
            break
        # Evaluation and checkpoint writing happen outside clock.step(): never charged.
        reached = marks_reached(progress, eval_every)
        if reached > marks_reported:  # one evaluation, reported for each mark this step crossed
            with run.account.timed("evaluation"):
                bpb = evaluate(run, run.checkpoint_set).val_bpb
            marks = f" {reached}" if reached == marks_reported + 1 else f"s {marks_reported + 1}-{reached}"
            display.note(f"checkpoint{marks}: val_bpb {bpb:.4f} at {progress:.0%} of the budget")
            stop = None
            try:
                for k in range(marks_reported + 1, reached + 1):
                    life.notify("on_checkpoint", k, bpb, clock.steps, progress)
            except StopRun as err:  # sinks live on rank 0: every rank must stop with it
                stop = err
            marks_reported = reached
            if run.world.any(stop is not None):
                raise stop or StopRun("PRUNED", "stopped by rank 0", bpb)
        if progress >= next_save - 1e-9 and run.world.is_main:
            with run.account.timed("checkpoint"):
                save_resume(run)
            next_save = next_mark(progress, save_every)
    run.summary["loop_wall_seconds"] = time.perf_counter() - loop_start
    return agreed_stop(run)  # so a stop during the last step also ends the run here, before any final evaluation


def agreed_stop(run: Run) -> str | None:
    """Why the run must stop now, if any rank was asked to (a collective in a data-parallel run)."""
    if run.world.any(lifecycle.stop_requested() is not None):
        return lifecycle.stop_requested() or "stopped because another rank was interrupted"
    return None


RESUMED_SUMMARY_KEYS = ("mlflow_run_id", "resumed")
RESUME_KEYS = ("config", "model", "optimizers", "clock", "loader", "rng", "tokens_seen", "summary")
RESUME_FORMAT = 2  # 2: torch.optim optimizers, groups keeping `initial_lr`; 1 (saved without "format"): own ones


def save_resume(run: Run) -> None:
    """Everything needed to continue this run exactly, all at the same step: written atomically."""
    state = {
        "format": RESUME_FORMAT,
        "config": OmegaConf.to_container(run.raw, resolve=True),
        "model": run.model.state_dict(),
        "optimizers": [opt.state_dict() for opt in run.optimizers],
        "clock": run.clock.state_dict(),
        "loader": run.loader.state_dict(),
        "rng": torch.get_rng_state(),
        "tokens_seen": run.tokens_seen,
        "summary": {k: run.summary[k] for k in RESUMED_SUMMARY_KEYS if k in run.summary},
    }
    lifecycle.atomic_write(run.run_dir / "resume.pt", lambda tmp: write_torch(state, tmp))


def restore(run: Run, state: dict) -> None:
    try:
        run.model.load_state_dict(state["model"])
        for opt, saved in zip(run.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(saved)
        run.clock.load_state_dict(state["clock"])
        run.loader.load_state_dict(state["loader"])
        torch.set_rng_state(state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as err:  # weights or state of another shape
        raise CheckpointError(f"resume={run.run_dir / 'resume.pt'} is not allowed: its saved state does not fit "
                              f"the run its config builds ({error_line(err)})") from None
    run.tokens_seen = state["tokens_seen"]


def resume_location(resume: str) -> Path | None:
    """The run directory `resume=` names (None for an MLflow run id): checked without any store."""
    run_dir = Path(resume).expanduser()
    if MLFLOW_RUN_ID.fullmatch(str(resume)) and not run_dir.exists():
        return None  # only a run id is looked up in the tracking store
    if not run_dir.exists():
        raise ConfigError(f"resume={resume} is not allowed: {run_dir} does not exist (give a run directory "
                          "or an MLflow run id)")
    if not run_dir.is_dir():
        raise ConfigError(f"resume={resume} is not allowed: {run_dir} is not a run directory (give the folder "
                          "holding resume.pt, or an MLflow run id)")
    if not (run_dir / "resume.pt").is_file():
        raise ConfigError(f"resume={resume} is not allowed: {run_dir / 'resume.pt'} does not exist (the run "
                          "wrote no checkpoint yet, or it finished)")
    return run_dir


def resume_point(resume: str, tracking_cfg, mmap: bool = False) -> tuple[DictConfig, Path, dict]:
    """The saved config, run directory and state of `resume=RUN_DIR_OR_MLFLOW_RUN_ID`, of a run that can
    continue (a sweep's trial only while its study has it running). `mmap`: for a check, which needs no
    tensor read."""
    run_dir = resume_location(resume)
    if run_dir is None:
        from frontier.store import run_dir_of

        run_dir = run_dir_of(tracking_cfg, resume, "resume")
    path = run_dir / "resume.pt"
    if not path.is_file():
        raise ConfigError(f"resume={resume} is not allowed: {path} does not exist (the run wrote no checkpoint "
                          "yet, or it finished)")
    state = read_checkpoint(path, "resume=", keys=RESUME_KEYS, mmap=mmap)
    if state.get("format", 1) != RESUME_FORMAT:
        raise CheckpointError(f"resume={path} is not allowed: it has format {state.get('format', 1)!r}, this version "
                              f"reads format {RESUME_FORMAT} (its optimizer state is laid out otherwise); start the "
                              "run again without resume=")
    try:
        raw = OmegaConf.merge(OmegaConf.structured(Config), state["config"])
    except Exception as err:  # a resume.pt of another version, or edited: its config is not this schema's
        raise CheckpointError(f"resume={path} is not allowed: its saved config does not fit this version's "
                              f"schema ({error_line(err)})") from None
    raw.resume = None
    if raw.trial.number is not None:
        from frontier.trial import check_resumable

        check_resumable(raw.trial, run_dir)
    return raw, run_dir, state


def summarize(run: Run, score: Score | None) -> None:
    """The run's final numbers, whatever ended it."""
    cfg, clock, summary = run.config, run.clock, run.summary
    tokens_per_second = clock.charged_tokens / clock.charged if clock.charged > 0 else 0.0
    if summary.get("mfu_basis") == "cpu time" and clock.charged_cpu > 0:  # beside the wall-clock rate
        summary["tokens_per_cpu_second"] = clock.charged_tokens / clock.charged_cpu
    summary.update({
        "tokens_seen": run.tokens_seen,
        "val_bpb": score.val_bpb if score else None,
        "val_bpb_se": score.se if score else None,  # the evaluation's own noise, over its documents
        "val_tokens": score.tokens if score else 0,
        "val_documents": score.documents if score else 0,
        "steps": clock.steps,
        "progress": clock.progress,
        "tokens_per_second": tokens_per_second,
        "mfu": mfu(clock.charged_tokens, clock.charged, clock.charged_cpu, summary),
        "charged_seconds": clock.charged,
        "excluded_seconds": clock.excluded,
        "excluded_seconds_per_launch": clock.excluded_per_launch,
        "budget_utilization": clock.charged / cfg.budget.seconds,
    })
    if summary.get("loop_wall_seconds"):  # how much of the loop's wall time went into training steps
        stepping = clock.launch_charged + clock.launch_excluded  # this launch's steps, as loop_wall_seconds is
        summary["step_time_fraction"] = stepping / summary["loop_wall_seconds"]
    if (summary["mfu"] or 0) > 1:
        summary["mfu_note"] = (f"mfu {summary['mfu']:.2f} is above 1: the peak ({summary['peak_flops_source']}) "
                               "is lower than what this run reached; compare mfu only between runs on this machine")
        print(f"warning: {summary['mfu_note']}", file=sys.stderr)


def finish(run: Run) -> float:
    """Final full evaluation (uncharged), then on rank 0 the checkpoint and CORE."""
    cfg = run.config
    with run.account.timed("evaluation"):
        score = evaluate(run, run.val_set)
    summarize(run, score)
    if run.world.is_main:
        final = run.run_dir / "final.pt"
        with run.account.timed("checkpoint"), \
                lifecycle.writing(final, final.with_suffix(".tmp"), run.run_dir / "tokenizer.tmp"):
            save_final(final, run.model, OmegaConf.to_container(run.raw, resolve=True), run.tokenizer)
        if cfg.eval.core:
            with run.account.timed("evaluation"):
                run.summary.update(core_metrics(run.model, run.tokenizer, cfg.eval, run.device, cfg.model.seq_len,
                                                log=None))
    return score.val_bpb


def train(raw: DictConfig, run_dir: Path, display: RunDisplay | None = None) -> float:
    """Runs one configuration (or continues one, with `resume=`) and returns its final val_bpb.

    Raises lifecycle.Killed (a KeyboardInterrupt) when a signal or request_stop ended it; the run
    is then recorded KILLED with resume.pt written at the step boundary where it stopped.
    """
    started = time.perf_counter()  # this launch's start: startup_seconds is measured from here
    with lifecycle.signals_handled():
        return _train(raw, Path(run_dir), display, started)


def _train(raw: DictConfig, run_dir: Path, display: RunDisplay | None, started: float) -> float:
    state = None
    if raw.get("resume"):
        raw, run_dir, state = resume_point(raw.resume, raw.tracking)
    try:
        plan = prepare(raw, run_dir)
    except KeyboardInterrupt as err:
        if state is None:  # a new run stopped before it owned its directory still ends recorded
            lifecycle.record_stopped_in_prepare(run_dir, err)
        raise
    summary: dict = {}
    if state is not None:
        summary.update(state["summary"])
        summary["resumed"] = summary.get("resumed", 0) + 1
        summary["resume_step"] = state["clock"]["steps"]  # sinks drop what they recorded after it
    if not plan.world.is_main:  # one rank speaks for the job
        display = RunDisplay(enabled=False, quiet=True)
    else:
        display = display or RunDisplay(enabled=sys.stderr.isatty())
    run, status, error, trained, owner, owned = None, "FAILED", None, False, None, False
    try:
        if plan.world.is_main:  # rank 0 writes the run directory, so it owns it
            owner = lifecycle.own(run_dir, "resume" if state is not None else "hydra.run.dir", new=state is None)
            owned = True
        life = Lifecycle(RunInfo(plan.config, raw, run_dir, summary), plan.world.is_main)
    except BaseException as err:
        if owned and state is None:  # a new run stopped or refused while its sinks were built still ends recorded
            lifecycle.record_not_started(run_dir, summary, err)
        lifecycle.disown(owner)
        plan.world.close()
        raise
    try:  # no call lies between the sinks' start and here, where a signal could leave the run unrecorded
        run = setup(raw, run_dir, plan, summary)
        summary.update(describe(run))
        if state is not None:
            restore(run, state)
            display.note(f"resumed {run_dir} at step {run.clock.steps} "
                         f"({run.clock.charged:.1f} s of {run.config.budget.seconds:g} s charged)")
        life.notify("on_start", summary)
        with display, lifecycle.deferred_signals():
            stopped = loop(run, display, life, started)
            trained = stopped is None  # here, where a signal cannot land between the loop and this
        if stopped is not None:
            status, error = "KILLED", stopped
            if run.clock.steps > 0 and run.world.is_main:
                with run.account.timed("checkpoint"):
                    save_resume(run)
                display.note(f"stopped at step {run.clock.steps} ({stopped}); continue with resume={run_dir}")
            raise lifecycle.Killed(stopped)
        lifecycle.raise_if_stopped()  # one that came after the loop's last look ends the run here, trained
        if run.config.compile_only:  # compiled and warmed up: nothing trained to evaluate
            summarize(run, None)
            status = "COMPILED"
            return math.nan
        result = finish(run)
        status = "FINISHED"
        (run_dir / "resume.pt").unlink(missing_ok=True)  # final.pt supersedes it
        return result
    except StopRun as stop:  # e.g. pruned by the sweeper: a normal, early end
        status, error = stop.status, str(stop)
        summary["stopped_value"] = stop.value
        return stop.value
    except lifecycle.Killed:
        raise
    except KeyboardInterrupt as err:  # a signal outside the loop, or a second one: no step boundary
        status, error = "KILLED", str(err) or "interrupted"
        if trained and run.world.is_main:  # stopped in the final evaluation: resume= only evaluates again
            save_resume(run)
        raise
    except lifecycle.RunWriteError as err:
        error = f"{error}; {err}" if status == "KILLED" else str(err)
        raise
    except BaseException as err:
        error = str(err) if isinstance(err, Diverged) else f"{type(err).__name__}: {err}"
        raise
    finally:
        lifecycle.closing()
        if run is not None and status not in ("FINISHED", "COMPILED"):
            summarize(run, None)
        if run is not None:
            summary.update(run.account.summary(run.clock.launch_excluded, run.clock.launch_charged))
        try:
            life.end(status, error)
        finally:
            display.table(summary)
            plan.world.close(together=status in ("FINISHED", "COMPILED", "PRUNED"))  # every rank ended it
            lifecycle.disown(owner)
