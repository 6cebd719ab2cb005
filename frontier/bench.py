"""`python -m frontier.bench [bench.KEY=VALUE ...] [trainer overrides ...]`: speed, side by side.

In one process it measures the machine's matmul rate (bf16 and fp32), the training-step throughput
of every model x kernel configuration in the grid (the trainer's own step, on random tokens), and
each op's forward+backward time per kernel backend against its reference. Figures, not tests.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from rich.console import Console
from rich.table import Table

import kernels
from frontier.config import ConfigError, PROJECT_ROOT, register_schemas, to_config
from frontier.device import matmul_rate, resolve_device


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["tiny"])
    kernels: list[str] = field(default_factory=lambda: ["reference", "compiled"])
    warmup: int = 2  # untimed steps first (compilation, allocator warm-up)
    steps: int = 5
    ops: bool = True  # also time each op's implementations against the reference
    output: Optional[str] = None  # write the rows as JSON here
    mlflow: bool = False  # log the figures as an MLflow run (experiment "bench")


class RandomRows:
    """Stands in for the data loader: random token rows of the configured shape."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.shape, self.vocab = (rows, seq_len + 1), vocab

    def next_rows(self) -> np.ndarray:
        return self.rng.integers(0, self.vocab, self.shape, dtype=np.int64)


def parse(argv: list[str]) -> tuple[BenchConfig, list[str]]:
    mine = [a[len("bench."):] for a in argv if a.startswith("bench.")]
    try:
        bench = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchConfig),
                                                    OmegaConf.from_dotlist(mine)))
    except OmegaConfBaseException as err:
        raise ConfigError(f"bench: {str(err).splitlines()[0]}") from None
    return bench, [a for a in argv if not a.startswith("bench.")]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def time_training_step(raw, bench: BenchConfig) -> dict:
    """The trainer's train_step on random tokens: tokens per second after the warm-up steps."""
    from frontier.budget import BudgetClock
    from frontier.distributed import World
    from frontier.model import build
    from frontier.optim import build_optimizers
    from frontier.trainer import Run, train_step

    config = to_config(raw)
    device = resolve_device(config.device, config.precision)
    torch.manual_seed(config.seed)
    vocab = config.data.vocab_size
    model, step_model = build(config, vocab, device)
    optimizers = build_optimizers(model.param_groups(), config.optim, device.kind)
    loader = RandomRows(config.train.batch_tokens // config.model.seq_len, config.model.seq_len, vocab)
    run = Run(config, raw, Path("."), device, model, step_model, None, loader, None, optimizers,
              BudgetClock(config.budget, device.synchronize), World())
    for _ in range(bench.warmup):
        train_step(run)
    device.synchronize()
    start = time.perf_counter()
    for _ in range(bench.steps):
        train_step(run)
    device.synchronize()
    seconds = (time.perf_counter() - start) / bench.steps
    return {"tokens_per_second": config.train.batch_tokens / seconds, "step_seconds": seconds,
            "params": model.num_params()["total"], "flops_per_token": model.flops_per_token(),
            "batch_tokens": config.train.batch_tokens, "device": device, "nominal_peak": device.nominal_peak_flops()}


def op_inputs(op: str, rows: int, seq: int, d_model: int, n_head: int, vocab: int, device: torch.device):
    """Representative inputs for one op at the model's shapes (None: no benchmark for it)."""
    head = d_model // n_head

    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    if op == "rmsnorm":
        return (leaf(rows, seq, d_model),)
    if op in ("relu2", "leaky_relu2", "gelu"):
        return (leaf(rows, seq, 4 * d_model),)
    if op == "rotary":
        angles = torch.rand(seq, head // 2, device=device)
        return leaf(rows, n_head, seq, head), angles.cos(), angles.sin()
    if op == "attention":
        return leaf(rows, n_head, seq, head), leaf(rows, n_head, seq, head), leaf(rows, n_head, seq, head)
    if op == "head_loss":
        return leaf(rows, seq, d_model), leaf(vocab, d_model), torch.randint(0, vocab, (rows, seq), device=device), 15.0
    return None


def time_op(fn, inputs, repeats: int = 5) -> float:
    def once():
        out = fn(*inputs)
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats


def time_ops(raw) -> list[dict]:
    config = to_config(raw)
    device = resolve_device(config.device, config.precision)
    rows = max(1, min(config.train.device_batch_rows, config.train.batch_tokens // config.model.seq_len))
    head_count = config.model.n_head
    results = []
    for op in kernels.OPS:
        inputs = op_inputs(op, rows, config.model.seq_len, config.model.d_model, head_count,
                           config.data.vocab_size, device.torch_device)
        if inputs is None:
            continue
        reference = time_op(kernels.get(op, "reference"), inputs)
        for backend in kernels.backends(op):
            reason = kernels.unavailable(backend, device.kind)
            if reason is not None:
                results.append({"op": op, "backend": backend, "error": reason})
                continue
            try:
                seconds = reference if backend == "reference" else time_op(kernels.get(op, backend), inputs)
            except Exception as err:  # a backend this machine cannot run: say why, keep going
                results.append({"op": op, "backend": backend, "error": f"{type(err).__name__}: {err}"})
                continue
            results.append({"op": op, "backend": backend, "seconds": seconds, "speedup": reference / seconds})
    return results


def main(argv: list[str]) -> dict:
    register_schemas()
    bench, overrides = parse(argv)
    console = Console()
    first = compose([f"model={bench.models[0]}", *overrides])  # the device, op shapes and tracking come from it
    device = resolve_device(to_config(first).device, "fp32")
    # Measured afresh, and cached as the peak every later run's MFU is taken against.
    rates = {f"matmul_{p}_flops": matmul_rate(device, p, refresh=True)["flops"] for p in ("bf16", "fp32")}
    console.print(f"{device.name}: matmul bf16 {rates['matmul_bf16_flops'] / 1e9:,.0f} GFLOP/s, "
                  f"fp32 {rates['matmul_fp32_flops'] / 1e9:,.0f} GFLOP/s")
    rows = []
    for model in bench.models:
        for kernel in bench.kernels:
            raw = compose([f"model={model}", f"kernel={kernel}", *overrides])
            figures = time_training_step(raw, bench)
            achievable = rates[f"matmul_{figures['device'].precision}_flops"]  # precision=auto resolved
            flops = figures["tokens_per_second"] * figures["flops_per_token"]
            nominal = figures["nominal_peak"]
            rows.append({
                "model": model, "kernel": kernel,
                "tokens_per_second": figures["tokens_per_second"],
                "step_seconds": figures["step_seconds"],
                "mfu_nominal": flops / nominal if nominal else None,
                "mfu_measured": flops / achievable,
                "params": figures["params"], "flops_per_token": figures["flops_per_token"],
                "batch_tokens": figures["batch_tokens"], "precision": figures["device"].precision, **rates,
            })
    for row in rows:  # each kernel against the reference of the same model, measured in this process
        base = next((r for r in rows if r["model"] == row["model"] and r["kernel"] == "reference"), None)
        row["speedup_vs_reference"] = row["tokens_per_second"] / base["tokens_per_second"] if base else None

    table = Table(title="training step throughput")
    for column in ("model", "kernel", "tokens/s", "step s", "vs reference", "MFU nominal", "MFU measured"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["kernel"], f"{r['tokens_per_second']:,.0f}", f"{r['step_seconds']:.3f}",
                      f"{r['speedup_vs_reference']:.2f}x" if r["speedup_vs_reference"] else "-",
                      f"{r['mfu_nominal']:.1%}" if r["mfu_nominal"] is not None else "n/a",
                      f"{r['mfu_measured']:.1%}")
    console.print(table)

    ops = time_ops(first) if bench.ops else []
    if ops:
        table = Table(title=f"ops, forward + backward at model={bench.models[0]}'s shapes")
        for column in ("op", "backend", "ms", "vs reference"):
            table.add_column(column, justify="right")
        for o in ops:
            if "error" in o:
                table.add_row(o["op"], o["backend"], "-", o["error"][:60])
            else:
                table.add_row(o["op"], o["backend"], f"{o['seconds'] * 1e3:.2f}", f"{o['speedup']:.2f}x")
        console.print(table)

    report = {"rows": rows, "ops": ops, **rates, "device": device.name}
    if bench.output:
        Path(bench.output).write_text(json.dumps(rows, indent=2))
        console.print(f"wrote {bench.output}")
    if bench.mlflow:
        log_to_mlflow(report, first)
    return report


def log_to_mlflow(report: dict, raw) -> None:
    from mlflow import MlflowClient

    from frontier.tracking import ensure_store, tracking_uri

    uri = tracking_uri(to_config(raw).tracking)
    ensure_store(uri)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("bench") or client.get_experiment(client.create_experiment("bench"))
    run = client.create_run(experiment.experiment_id, run_name=f"bench {report['device']}")
    for r in report["rows"]:
        prefix = f"{r['model']}.{r['kernel']}"
        client.log_metric(run.info.run_id, f"{prefix}.tokens_per_second", r["tokens_per_second"])
        client.log_metric(run.info.run_id, f"{prefix}.mfu_measured", r["mfu_measured"])
    client.log_text(run.info.run_id, json.dumps(report, indent=2, default=str), "bench.json")
    client.set_terminated(run.info.run_id)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
