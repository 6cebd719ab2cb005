"""`python -m frontier.train`: one budgeted training run, read top to bottom.

config -> device -> data -> model -> optimizers -> loop (budget clock, schedule, evals at budget
fractions) -> final val_bpb -> checkpoint and summary. Returns val_bpb for a sweeper to minimise.
"""
from __future__ import annotations

import json
import math
import signal
import socket
import sys
import threading
import time
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
from frontier.device import Device, measure_matmul_flops, resolve_device
from frontier.evaluate import val_bpb
from frontier.model import GPT, Ops
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
    observers: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def setup(raw: DictConfig, run_dir: Path) -> Run:
    config = to_config(raw)  # every range check, before any data is touched
    device = resolve_device(config.device, config.precision)
    if config.eval.core and not (Path(config.eval.core_bundle) / "core.yaml").is_file():
        raise ConfigError(f"eval.core_bundle={config.eval.core_bundle!r} has no core.yaml; point it at a CORE "
                          "eval bundle (the offline copy is ../shared/data/core)")
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

    model = GPT(config.model, tokenizer.vocab_size, Ops("reference")).to(device.torch_device)
    step_model = model
    if config.kernel.name == "compiled":
        backend = "neuron" if device.kind == "neuron" else "inductor"
        step_model = torch.compile(model, backend=backend, mode=config.kernel.compile_mode, dynamic=False)
    optimizers = build_optimizers(model.param_groups(), config.optim, device.kind)
    loader = PackedLoader(train_corpus, seq, rows=config.train.batch_tokens // seq, seed=config.seed)
    clock = BudgetClock(config.budget, device.synchronize)
    return Run(config, raw, run_dir, device, model, step_model, tokenizer, loader, val_rows,
               optimizers, clock)


def describe(run: Run) -> dict:
    """Static facts of the run: sizes, cost per token, the device and its peak rate."""
    params = run.model.num_params()
    peak = run.device.nominal_peak_flops()
    peak_source = "nominal"
    if peak is None:  # no published figure (CPU): what this machine's matmul actually reaches
        peak, peak_source = measure_matmul_flops(run.device), "measured"
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
        "world_size": 1,
    }


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over `train.batch_tokens` tokens; returns the mean loss (on device)."""
    cfg = run.config
    progress = run.clock.progress
    apply_schedule(run.optimizers, lr_multiplier(cfg.schedule, progress), muon_momentum(cfg.schedule, progress))
    rows = torch.from_numpy(run.loader.next_rows()).to(run.device.torch_device, non_blocking=True)
    micro = min(cfg.train.device_batch_rows, rows.size(0))
    accumulation = rows.size(0) // micro
    total = torch.zeros((), device=run.device.torch_device)
    for chunk in rows.split(micro):
        with run.device.autocast():
            loss = run.step_model(chunk[:, :-1], chunk[:, 1:])
        (loss / accumulation).backward()
        total += loss.detach()
    for opt in run.optimizers:
        opt.step()
    run.model.zero_grad(set_to_none=True)
    return total / accumulation


def evaluate_checkpoint(run: Run, tokens: int) -> float:
    rows = run.val_rows[: max(1, -(-tokens // run.config.model.seq_len))]
    bpb, _ = val_bpb(run.step_model, rows, run.tokenizer.token_bytes, run.device, run.config.eval.batch_rows)
    return bpb


def loop(run: Run, display: RunDisplay) -> None:
    cfg = run.config
    clock = run.clock
    log_every = cfg.train.log_every_fraction
    eval_every = cfg.eval.every_fraction
    next_log, next_eval = 0.0, eval_every if eval_every > 0 else math.inf
    loss_sum, loss_count, tokens = torch.zeros(()), 0, 0
    log_start = time.perf_counter(), clock.charged
    while not clock.done:
        with clock.step():
            loss = train_step(run)
        tokens += cfg.train.batch_tokens
        loss_sum = loss_sum.to(loss.device) + loss
        loss_count += 1
        if cfg.compile_only and clock.steps >= max(cfg.budget.excluded_steps, 1):
            break
        progress = clock.progress
        if progress >= next_log or clock.done:
            mean_loss = (loss_sum / loss_count).item()  # the only host sync, at the log cadence
            if not math.isfinite(mean_loss) or mean_loss > 1e3:
                raise Diverged(f"diverged at step {clock.steps} (loss={mean_loss})")
            interval = clock.charged - log_start[1]
            metrics = {
                "train/loss": mean_loss,
                "lr_multiplier": lr_multiplier(cfg.schedule, progress),
                "tokens_seen": tokens,
                "charged_seconds": clock.charged,
                "progress": progress,
                "tokens_per_second": loss_count * cfg.train.batch_tokens / interval if interval > 0 else 0.0,
            }
            metrics["mfu"] = metrics["tokens_per_second"] * run.summary["flops_per_token"] / run.summary["peak_flops"]
            observers.notify(run.observers, "on_log", metrics, clock.steps)
            display.update(progress, metrics, clock.seconds_left)
            loss_sum, loss_count, log_start = torch.zeros(()), 0, (time.perf_counter(), clock.charged)
            while next_log <= progress:
                next_log += log_every
        if progress >= next_eval - 1e-9 and not clock.done:
            k = int(progress / eval_every + 1e-9)  # a long step may cross several fractions: report the last
            bpb = evaluate_checkpoint(run, cfg.eval.checkpoint_tokens)  # outside clock.step: uncharged
            display.note(f"checkpoint {k}: val_bpb {bpb:.4f} at {progress:.0%} of the budget")
            observers.notify(run.observers, "on_checkpoint", k, bpb, clock.steps, progress)
            next_eval = (k + 1) * eval_every
    run.summary["tokens_seen"] = tokens


def finish(run: Run, status: str) -> float:
    """Final full evaluation (uncharged), checkpoint, summary.json."""
    cfg, clock, summary = run.config, run.clock, run.summary
    bpb, val_tokens = math.nan, 0
    if status == "FINISHED":
        bpb, val_tokens = val_bpb(run.step_model, run.val_rows, run.tokenizer.token_bytes, run.device,
                                  cfg.eval.batch_rows)
        save_final(run.run_dir / "final.pt", run.model, OmegaConf.to_container(run.raw, resolve=True),
                   run.tokenizer)
        if cfg.eval.core:
            summary.update(core_metrics(run.model, run.tokenizer, cfg.eval, run.device, cfg.model.seq_len,
                                        log=None))
    tokens_per_second = summary.get("tokens_seen", 0) / clock.charged if clock.charged > 0 else 0.0
    summary.update({
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
    """Runs one configuration and returns its final val_bpb."""
    run = setup(raw, run_dir)
    display = display or RunDisplay(enabled=sys.stderr.isatty())
    run.summary.update(describe(run))
    run.observers = observers.for_run(run)
    observers.notify(run.observers, "on_start", run.summary)
    status, error = "FAILED", None
    try:
        with display:
            loop(run, display)
        result = finish(run, "COMPILED" if run.config.compile_only else "FINISHED")
        status = run.summary["status"]
        return result
    except observers.StopRun as stop:  # e.g. pruned by the sweeper: a normal, early end
        status, error = stop.status, str(stop)
        run.summary["stopped_value"] = stop.value
        return stop.value
    except KeyboardInterrupt:
        status, error = "KILLED", "interrupted (SIGINT or SIGTERM)"
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


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM (preemption, time limits) ends the run like Ctrl-C


USER_ERRORS = (ConfigError, DataError, CoreBundleError, FileNotFoundError)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return train(cfg, Path(hydra_cfg.runtime.output_dir))
    except USER_ERRORS as err:
        if hydra_cfg.mode == RunMode.MULTIRUN:
            raise  # the sweeper records the trial as failed and goes on
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
