"""`python -m frontier.train`: one budgeted training run, read top to bottom.

config -> device -> data -> model -> optimizers -> loop (budget clock, schedule, evals at budget
fractions) -> final val_bpb -> checkpoint and summary. Returns val_bpb for a sweeper to minimise.
"""
from __future__ import annotations

import time

LAUNCHED = time.perf_counter()  # before the heavy imports: startup is measured from here

import json
import math
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from frontier import observers
from frontier.budget import BudgetClock
from frontier.checkpoint import save_final
from frontier.core import CoreBundleError
from frontier.config import Config, ConfigError, register_schemas, to_config
from frontier.data import DataError, PackedLoader, load_corpus, load_tokenizer, resolve_splits, validation_rows
from frontier.distributed import World, init_world
from frontier.device import Device, resolve_device
from frontier.evaluate import val_bpb
from frontier.model import GPT, Ops, build as build_model
from frontier.optim import apply_schedule, build_optimizers
from frontier.progress import RunDisplay
from frontier.schedule import lr_multiplier, muon_momentum

register_schemas()


class Diverged(RuntimeError):
    """The training loss became NaN, infinite, or absurdly large."""


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
    val_rows: torch.Tensor
    optimizers: list
    clock: BudgetClock
    world: World
    observers: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    tokens_seen: int = 0


def setup(raw: DictConfig, run_dir: Path) -> Run:
    config = to_config(raw)  # every range check, before any data is touched
    device = resolve_device(config.device, config.precision, config.neuron_logical_cores)
    world = init_world(device.kind)
    if world.active and device.kind in ("cuda", "neuron"):
        device.torch_device = torch.device(world.device)
    rows_per_step = config.train.batch_tokens // config.model.seq_len
    if rows_per_step % world.size:
        raise ConfigError(f"train.batch_tokens={config.train.batch_tokens} gives {rows_per_step} rows of "
                          f"model.seq_len per step, which the world size {world.size} does not divide")
    if config.eval.core and not (Path(config.eval.core_bundle) / "core.yaml").is_file():
        raise ConfigError(f"eval.core_bundle={config.eval.core_bundle!r} has no core.yaml; point it at a CORE "
                          "eval bundle (the offline copy is ../shared/data/core)")
    ops = Ops(config.kernel, device.kind)  # a kernel this machine cannot run stops here, before any data is read
    torch.manual_seed(config.seed)

    train_split, val_split = resolve_splits(config.data)
    tokenizer = load_tokenizer(config.data, train_split)
    train_corpus = load_corpus(train_split, tokenizer, config.data, "train")
    val_corpus = load_corpus(val_split, tokenizer, config.data, "val")
    seq = config.model.seq_len
    if train_corpus.num_tokens < seq + 1:
        raise DataError(f"the training split has {train_corpus.num_tokens} tokens, fewer than one row of "
                        f"model.seq_len + 1 = {seq + 1}")
    val_rows = validation_rows(val_corpus, seq, config.eval.final_tokens)
    data_report = {
        "data_train_tokens": train_corpus.num_tokens,
        "data_val_tokens_available": int(val_rows.numel() - val_rows.size(0)),
        "data_skipped_empty_documents": sum(c.meta.get("skipped_empty_documents", 0)
                                            for c in (train_corpus, val_corpus)),
        "data_empty_files": [f for c in (train_corpus, val_corpus) for f in c.meta.get("empty_files", [])],
    }

    model, step_model = build_model(config, tokenizer.vocab_size, device, ops)
    optimizers = build_optimizers(model.param_groups(), config.optim, device.kind, world.rank, world.size)
    # Every rank packs the same global batch and trains on its own slice of it.
    loader = PackedLoader(train_corpus, seq, rows=rows_per_step, seed=config.seed)
    clock = BudgetClock(config.budget, device.synchronize, world.max)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = Run(config, raw, run_dir, device, model, step_model, tokenizer, loader, val_rows, optimizers, clock,
              world)
    run.summary.update(data_report)
    return run


def describe(run: Run) -> dict:
    """Static facts of the run: sizes, cost per token, the device and its peak rate."""
    params = run.model.num_params()
    peak, peak_source = run.device.peak_flops()
    return {
        "params": params["total"],
        "params_embedding": params["embedding"],
        "params_non_embedding": params["non_embedding"],
        "flops_per_token": run.model.flops_per_token(),
        "vocab_size": run.tokenizer.vocab_size,
        "device": run.device.name,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "budget": run.config.budget.name,
        "budget_seconds": run.config.budget.seconds,
        "world_size": run.world.size,
    }


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over `train.batch_tokens` tokens; returns the mean loss (on device)."""
    cfg = run.config
    progress = run.clock.progress
    apply_schedule(run.optimizers, lr_multiplier(cfg.schedule, progress), muon_momentum(cfg.schedule, progress))
    rows = torch.from_numpy(run.loader.next_rows())
    share = rows.size(0) // run.world.size
    rows = rows[run.world.rank * share:(run.world.rank + 1) * share].to(run.device.torch_device, non_blocking=True)
    micro = min(cfg.train.device_batch_rows, rows.size(0))
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


def evaluate_checkpoint(run: Run, tokens: int) -> float:
    rows = run.val_rows[: max(1, -(-tokens // run.config.model.seq_len))]
    bpb, _ = val_bpb(run.step_model, rows, run.tokenizer.token_bytes, run.device, run.config.eval.batch_rows)
    return bpb


def next_mark(progress: float, every: float) -> float:
    """The first multiple of `every` after `progress` (inf when `every` is 0)."""
    return (int(progress / every + 1e-9) + 1) * every if every > 0 else math.inf


def loop(run: Run, display: RunDisplay) -> None:
    cfg, clock = run.config, run.clock
    log_every, eval_every = cfg.train.log_every_fraction, cfg.eval.every_fraction
    save_every = cfg.checkpoint.every_fraction
    # Derived from progress, so a resumed run keeps the same cadence.
    next_log = next_mark(clock.progress, log_every) if clock.steps else 0.0
    next_eval, next_save = next_mark(clock.progress, eval_every), next_mark(clock.progress, save_every)
    loss_sum, loss_count, log_start = torch.zeros(()), 0, clock.charged
    loop_start = time.perf_counter()
    run.summary["startup_seconds"] = loop_start - LAUNCHED  # launch to the first step
    while not clock.done:
        with clock.step():
            loss = train_step(run)
        run.tokens_seen += cfg.train.batch_tokens
        loss_sum = loss_sum.to(loss.device) + loss
        loss_count += 1
        if cfg.compile_only and clock.steps >= max(cfg.budget.excluded_steps, 1):
            break
        progress = clock.progress
        if progress >= next_log - 1e-9 or clock.done:
            mean_loss = run.world.mean((loss_sum / loss_count).item())  # the only host sync, at the log cadence
            if not math.isfinite(mean_loss) or mean_loss > cfg.train.loss_ceiling:
                raise Diverged(f"diverged at step {clock.steps} (loss={mean_loss:g})")
            interval = clock.charged - log_start
            tokens_per_second = loss_count * cfg.train.batch_tokens / interval if interval > 0 else 0.0
            metrics = {
                "train/loss": mean_loss,
                "lr_multiplier": lr_multiplier(cfg.schedule, progress),
                "tokens_seen": run.tokens_seen,
                "charged_seconds": clock.charged,
                "progress": progress,
                "tokens_per_second": tokens_per_second,
                "mfu": tokens_per_second * run.summary["flops_per_token"] / run.summary["peak_flops"],
            }
            observers.notify(run.observers, "on_log", metrics, clock.steps)
            display.update(progress, metrics, clock.seconds_left)
            loss_sum, loss_count, log_start = torch.zeros(()), 0, clock.charged
            next_log = next_mark(progress, log_every)
        if clock.done:
            break
        # Evaluation and checkpoint writing happen outside clock.step(): never charged.
        if progress >= next_eval - 1e-9:
            k = int(progress / eval_every + 1e-9)  # a long step may cross several fractions: report the last
            bpb = evaluate_checkpoint(run, cfg.eval.checkpoint_tokens)
            display.note(f"checkpoint {k}: val_bpb {bpb:.4f} at {progress:.0%} of the budget")
            stop = None
            try:
                observers.notify(run.observers, "on_checkpoint", k, bpb, clock.steps, progress)
            except observers.StopRun as err:  # observers live on rank 0: every rank must stop with it
                stop = err
            if run.world.any(stop is not None):
                raise stop or observers.StopRun("PRUNED", "stopped by rank 0", bpb)
            next_eval = next_mark(progress, eval_every)
        if progress >= next_save - 1e-9 and run.world.is_main:
            save_resume(run)
            next_save = next_mark(progress, save_every)
    run.summary["loop_wall_seconds"] = time.perf_counter() - loop_start


def save_resume(run: Run) -> None:
    """Everything needed to continue this run exactly: written atomically as resume.pt."""
    state = {
        "config": OmegaConf.to_container(run.raw, resolve=True),
        "model": run.model.state_dict(),
        "optimizers": [opt.state_dict() for opt in run.optimizers],
        "clock": run.clock.state_dict(),
        "loader": run.loader.state_dict(),
        "rng": torch.get_rng_state(),
        "tokens_seen": run.tokens_seen,
        "summary": {k: run.summary[k] for k in RESUMED_SUMMARY_KEYS if k in run.summary},
    }
    tmp = run.run_dir / "resume.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(run.run_dir / "resume.pt")


RESUMED_SUMMARY_KEYS = ("mlflow_run_id", "resumed")


def restore(run: Run, state: dict) -> None:
    run.model.load_state_dict(state["model"])
    for opt, saved in zip(run.optimizers, state["optimizers"]):
        opt.load_state_dict(saved)
    run.clock.load_state_dict(state["clock"])
    run.loader.load_state_dict(state["loader"])
    torch.set_rng_state(state["rng"])
    run.tokens_seen = state["tokens_seen"]
    run.summary.update(state["summary"])
    run.summary["resumed"] = run.summary.get("resumed", 0) + 1


def resume_point(resume: str, tracking_cfg) -> tuple[DictConfig, Path, dict]:
    """The saved config, run directory and state of `resume=RUN_DIR_OR_MLFLOW_RUN_ID`."""
    run_dir = Path(resume).expanduser()
    if not run_dir.is_dir():
        from frontier.tracking import run_dir_of

        run_dir = run_dir_of(tracking_cfg, resume)
    path = run_dir / "resume.pt"
    if not path.is_file():
        raise FileNotFoundError(f"resume={resume!r}: {path} does not exist (the run wrote no checkpoint yet)")
    state = torch.load(path, map_location="cpu", weights_only=False)
    raw = OmegaConf.merge(OmegaConf.structured(Config), state["config"])
    raw.resume = None
    return raw, run_dir, state


def finish(run: Run, status: str) -> float:
    """Final full evaluation (uncharged), then on rank 0 the checkpoint, CORE and summary.json."""
    cfg, clock, summary = run.config, run.clock, run.summary
    bpb, val_tokens = math.nan, 0
    if status == "FINISHED":
        bpb, val_tokens = val_bpb(run.step_model, run.val_rows, run.tokenizer.token_bytes, run.device,
                                  cfg.eval.batch_rows)
    # Throughput over charged steps only: the excluded (compilation) steps' time is not on the clock.
    charged_tokens = run.tokens_seen - min(clock.steps, cfg.budget.excluded_steps) * cfg.train.batch_tokens
    tokens_per_second = charged_tokens / clock.charged if clock.charged > 0 else 0.0
    summary.update({
        "tokens_seen": run.tokens_seen,
        "status": status,
        "val_bpb": bpb,
        "val_tokens": val_tokens,
        "steps": clock.steps,
        "tokens_per_second": tokens_per_second,
        "mfu": tokens_per_second * summary["flops_per_token"] / summary["peak_flops"],
        "charged_seconds": clock.charged,
        "excluded_seconds": clock.excluded,
        "budget_utilization": clock.charged / cfg.budget.seconds,
    })
    if summary.get("loop_wall_seconds"):  # how much of the loop's wall time went into training steps
        summary["step_time_fraction"] = (clock.charged + clock.excluded) / summary["loop_wall_seconds"]
    if run.world.is_main:
        if status == "FINISHED":
            save_final(run.run_dir / "final.pt", run.model, OmegaConf.to_container(run.raw, resolve=True),
                       run.tokenizer)
            if cfg.eval.core:
                summary.update(core_metrics(run.model, run.tokenizer, cfg.eval, run.device, cfg.model.seq_len,
                                            log=None))
        write_summary(run.run_dir, summary)
    return bpb


def core_metrics(model: torch.nn.Module, tokenizer, eval_cfg, device: Device, seq_len: int, log=print) -> dict:
    """CORE of a trained model (never charged to the budget), as flat metrics."""
    from frontier.core import evaluate_core

    with device.autocast():
        result = evaluate_core(model, tokenizer, eval_cfg.core_bundle, max_per_task=eval_cfg.core_max_per_task,
                               device=device.torch_device, max_seq_len=seq_len, batch_size=eval_cfg.batch_rows * 2,
                               log=log)
    print(f"{result.describe()} ({result.items_per_second:,.1f} items/s)", file=sys.stderr)
    return result.metrics()


def write_summary(run_dir: Path, summary: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(run_dir / "summary.json")


def train(raw: DictConfig, run_dir: Path, display: RunDisplay | None = None) -> float:
    """Runs one configuration (or continues one, with `resume=`) and returns its final val_bpb."""
    state = None
    if raw.get("resume"):
        raw, run_dir, state = resume_point(raw.resume, raw.tracking)
    run = setup(raw, run_dir)
    if not run.world.is_main:  # one rank speaks for the job
        display = RunDisplay(enabled=False, quiet=True)
    else:
        display = display or RunDisplay(enabled=sys.stderr.isatty())
    run.summary.update(describe(run))
    if state is not None:
        restore(run, state)
        display.note(f"resumed {run_dir} at step {run.clock.steps} "
                     f"({run.clock.charged:.1f} s of {run.config.budget.seconds:g} s charged)")
    run.observers = observers.for_run(run) if run.world.is_main else []
    observers.notify(run.observers, "on_start", run.summary)
    status, error = "FAILED", None
    try:
        with display:
            loop(run, display)
        result = finish(run, "COMPILED" if run.config.compile_only else "FINISHED")
        status = run.summary["status"]
        (run.run_dir / "resume.pt").unlink(missing_ok=True)  # final.pt supersedes it
        return result
    except observers.StopRun as stop:  # e.g. pruned by the sweeper: a normal, early end
        status, error = stop.status, str(stop)
        run.summary["stopped_value"] = stop.value
        return stop.value
    except KeyboardInterrupt:
        status, error = "KILLED", "interrupted (SIGINT or SIGTERM)"
        if run.clock.steps > 0 and run.world.is_main:
            save_resume(run)
            display.note(f"interrupted at step {run.clock.steps}; continue with resume={run.run_dir}")
        raise
    except BaseException as err:
        error = f"{type(err).__name__}: {err}"
        raise
    finally:
        if status not in ("FINISHED", "COMPILED"):
            run.summary["error"] = error
            finish(run, status)
        display.table(run.summary)
        observers.notify(run.observers, "on_end", run.summary, status, error)
        run.world.close()


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (preemption, time limits) ends the run like Ctrl-C


USER_ERRORS = (ConfigError, DataError, CoreBundleError, FileNotFoundError)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    if cfg.get("sweep") is not None and hydra_cfg.mode != RunMode.MULTIRUN:
        print(f"warning: sweep={cfg.sweep.name} needs --multirun; training one run with the base config",
              file=sys.stderr)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return train(cfg, Path(hydra_cfg.runtime.output_dir))
    except USER_ERRORS as err:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # the sweeper records the trial as failed and goes on
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one rank says it
            print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise
        raise SystemExit(130) from None  # the run is recorded KILLED; resume.pt was written


if __name__ == "__main__":
    main()
