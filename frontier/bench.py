"""`python -m frontier.bench [bench.KEY=VALUE ...] [trainer overrides ...]`: speed, side by side.

In one process it measures the machine's matmul rate (bf16 and fp32), the training-step throughput
of every model x kernel configuration in the grid (the trainer's own step, on random tokens), and
each op's forward+backward time per kernel backend against its reference. Figures, not tests. On a
CPU the step and the matmul are also timed in process CPU time, so that their ratio (the share of
the matmul rate a step reaches) and the speed-ups stay fair on a machine other jobs share.

bench keys: models=[tiny] (model presets), kernels=[reference,compiled], warmup=2, steps=5, ops=true,
output=PATH (the rows as JSON), results=PATH (append each row, with the machine, torch version, date
and commit, to a JSON-lines record such as benchmarks/results.jsonl), mlflow=false (log them to the
experiment "bench"), profile=0 (top ops of one profiled step). Any other override is the trainer's,
e.g. model.seq_len=512 precision=fp32.
"""
from __future__ import annotations

import json
import statistics
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
from frontier import bench_results, paths
from frontier.cli import command, print_help_if_asked, unwritable
from frontier.compose import run_config
from frontier.config import ConfigError, error_line, register_schemas, to_config
from frontier.device import DTYPES, matmul_rate, measure_matmul_flops, resolve_device


@dataclass
class BenchConfig:
    models: list[str] = field(default_factory=lambda: ["tiny"])
    kernels: list[str] = field(default_factory=lambda: ["reference", "compiled"])
    warmup: int = 2  # untimed steps first (compilation, allocator warm-up)
    steps: int = 5
    ops: bool = True  # also time each op's implementations against the reference
    output: Optional[str] = None  # write the rows as JSON here
    results: Optional[str] = None  # append each row, with where it was measured, to this JSON-lines file
    mlflow: bool = False  # log the figures as an MLflow run (experiment "bench")
    profile: int = 0  # > 0: after timing, profile one more step and print its top this-many ops


class RandomRows:
    """Stands in for the data loader: random token rows of the configured shape."""

    def __init__(self, rows: int, seq_len: int, vocab: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.shape, self.vocab = (rows, seq_len + 1), vocab

    def next_rows(self) -> np.ndarray:
        return self.rng.integers(0, self.vocab, self.shape, dtype=np.int64)


def parse(argv: list[str]) -> tuple[BenchConfig, list[str]]:
    for arg in argv:
        if arg.startswith("-"):  # not Hydra's command line: its options would be read as overrides
            raise ConfigError(f"{arg} is not allowed: frontier.bench takes bench.KEY=VALUE and trainer overrides "
                              "only (see docs/benchmarks.md)")
    mine = [a[len("bench."):] for a in argv if a.startswith("bench.")]
    try:
        bench = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BenchConfig),
                                                    OmegaConf.from_dotlist(mine)))
    except OmegaConfBaseException as err:  # a key it lacks, a value of the wrong type: name the argument
        given = next((a for a in argv if a.partition("=")[0] == f"bench.{getattr(err, 'full_key', None)}"), None)
        raise ConfigError(f"{given or 'bench'}{' is not allowed' if given else ''}: "
                          f"{error_line(err, named=False)}") from None
    for key, least in (("warmup", 0), ("steps", 1), ("profile", 0)):
        if getattr(bench, key) < least:
            raise ConfigError(f"bench.{key}={getattr(bench, key)} is not allowed: must be at least {least}")
    found = unwritable(Path(bench.output).absolute().parent) if bench.output is not None else None
    if found:  # found now, not after the whole benchmark has run
        raise ConfigError(f"bench.output={bench.output} is not allowed: its folder cannot be created ({found[1]}); "
                          f"{found[0]} is not a writable directory")
    if bench.output is not None and Path(bench.output).is_dir():
        raise ConfigError(f"bench.output={bench.output} is not allowed: it is a folder; name the JSON file to write")
    found = unwritable(Path(bench.results).absolute().parent) if bench.results is not None else None
    if found:
        raise ConfigError(f"bench.results={bench.results} is not allowed: its folder cannot be created ({found[1]}); "
                          f"{found[0]} is not a writable directory")
    if bench.results is not None and Path(bench.results).is_dir():
        raise ConfigError(f"bench.results={bench.results} is not allowed: it is a folder; name the JSON-lines file "
                          "to append to")
    for group, names, options in (("model", bench.models, presets("model")),
                                  ("kernel", bench.kernels, kernels.PRESETS)):
        unknown = [name for name in names if name not in options]
        if not names or unknown:
            reason = f"{unknown[0]} is not a {group} preset" if unknown else f"it names no {group}"
            raise ConfigError(f"bench.{group}s=[{','.join(names)}] is not allowed: {reason}; choose from "
                              f"{', '.join(options)}")
    overrides = [a for a in argv if not a.startswith("bench.")]
    for model in bench.models:  # every pair a valid run, found before anything is measured
        for kernel in bench.kernels:
            run_config(str(paths.conf_dir()), [f"model={model}", f"kernel={kernel}", *overrides])
    return bench, overrides


def presets(group: str) -> list[str]:
    return sorted(path.stem for path in (paths.conf_dir() / group).glob("*.yaml"))


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(paths.conf_dir()), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def time_training_step(raw, bench: BenchConfig) -> dict:
    """The trainer's train_step on random tokens after the warm-up steps: wall-clock and process CPU
    seconds per step."""
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
    run = Run(config, raw, Path("."), device, model, step_model, None, loader, None, None, optimizers,
              BudgetClock(config.budget, device.synchronize), World())
    print(f"timing {config.model.name} {config.kernel.name}: {bench.warmup} warm-up and {bench.steps} steps", flush=True)
    for _ in range(bench.warmup):
        train_step(run)
    device.synchronize()
    walls, cpus = [], []
    for _ in range(bench.steps):  # each step on its own: the median is not moved by one slow moment
        start, cpu_start = time.perf_counter(), time.process_time()
        train_step(run)
        device.synchronize()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)
    seconds = statistics.median(walls)
    profile = profile_step(run, bench.profile) if bench.profile > 0 else []
    return {"profile": profile, "tokens_per_second": config.train.batch_tokens / seconds, "step_seconds": seconds,
            "cpu_seconds_per_step": statistics.median(cpus),
            "params": model.num_params()["total"], "flops_per_token": model.flops_per_token(),
            "batch_tokens": config.train.batch_tokens, "device": device, "nominal_peak": device.nominal_peak_flops()}


def profile_step(run, top: int) -> list[dict]:
    """One more training step under torch.profiler: the ops with the most self time (CPU time on a
    CPU, device time on an accelerator), each with its share of the step."""
    from torch.profiler import ProfilerActivity, profile

    from frontier.trainer import train_step

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.device.kind == "cuda" else [])
    with profile(activities=activities) as prof:
        train_step(run)
        run.device.synchronize()
    attr = "self_device_time_total" if run.device.kind == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [{"op": e.key, "seconds": getattr(e, attr) / 1e6, "share": getattr(e, attr) / total, "calls": e.count}
            for e in events[:top]]


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
    on_cpu = device.kind == "cpu"
    capability = torch.backends.cpu.get_cpu_capability() if on_cpu else None
    cpu_rates: dict[str, float] = {}  # matmul FLOPs per CPU-second by precision, measured when a row needs it
    if on_cpu:
        console.print(f"CPU capability {capability}, {torch.get_num_threads()} threads")
    where = bench_results.machine(device) if bench.results else {}
    rows = []
    for model in bench.models:
        for kernel in bench.kernels:
            raw = compose([f"model={model}", f"kernel={kernel}", *overrides])
            figures = time_training_step(raw, bench)
            precision = figures["device"].precision  # precision=auto resolved
            flops = figures["tokens_per_second"] * figures["flops_per_token"]
            nominal = figures["nominal_peak"]
            step_flops = figures["batch_tokens"] * figures["flops_per_token"]
            if on_cpu:  # the step's FLOPs per CPU-second against the matmul's: load on the machine cancels
                if precision not in cpu_rates:
                    # one thread's matmul rate per CPU-second (the device's measurement is that times the threads)
                    cpu_rates[precision] = measure_matmul_flops(figures["device"], dtype=DTYPES[precision],
                                                                seconds=1.0) / torch.get_num_threads()
                measured = step_flops / figures["cpu_seconds_per_step"] / cpu_rates[precision]
            else:
                measured = flops / rates[f"matmul_{precision}_flops"]
            rows.append({
                "model": model, "kernel": kernel,
                "tokens_per_second": figures["tokens_per_second"],
                "step_seconds": figures["step_seconds"],
                "cpu_seconds_per_step": figures["cpu_seconds_per_step"],
                "mfu_nominal": flops / nominal if nominal else None,
                "mfu_measured": measured,
                "matmul_cpu_flops": cpu_rates.get(precision), "cpu_capability": capability,
                "params": figures["params"], "flops_per_token": figures["flops_per_token"],
                "batch_tokens": figures["batch_tokens"], "precision": figures["device"].precision, **rates,
                "profile": figures["profile"],
            })
            compare_with_reference(rows, on_cpu)
            if bench.output:  # after every row: a benchmark cut short keeps what it measured
                write_rows(Path(bench.output), rows)
            if bench.results:
                bench_results.append(Path(bench.results), rows[-1:], where, argv)
            r = rows[-1]
            console.print(f"{model} {kernel}: {r['tokens_per_second']:,.0f} tokens/s, {r['mfu_measured']:.1%} of the "
                          f"matmul rate")

    for precision, rate in cpu_rates.items():
        console.print(f"matmul {precision}: {rate / 1e9:,.1f} GFLOP per CPU-second")
    table = Table(title="training step throughput")
    for column in ("model", "kernel", "dtype", "tokens/s", "step s", "CPU s/step", "vs reference",
                   "MFU nominal", "of matmul rate"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["kernel"], r["precision"], f"{r['tokens_per_second']:,.0f}",
                      f"{r['step_seconds']:.3f}", f"{r['cpu_seconds_per_step']:.3f}",
                      f"{r['speedup_vs_reference']:.2f}x" if r["speedup_vs_reference"] else "-",
                      f"{r['mfu_nominal']:.1%}" if r["mfu_nominal"] is not None else "n/a",
                      f"{r['mfu_measured']:.1%}")
    console.print(table)
    for r in rows:
        if r["profile"]:
            table = Table(title=f"top ops of one step, {r['model']} {r['kernel']} (self time)")
            for column in ("op", "calls", "s", "share"):
                table.add_column(column, justify="right")
            for o in r["profile"]:
                table.add_row(o["op"], str(o["calls"]), f"{o['seconds']:.3f}", f"{o['share']:.1%}")
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

    report = {"rows": rows, "ops": ops, **rates, "device": device.name, "cpu_capability": capability}
    if bench.output:
        console.print(f"wrote {bench.output}")
    if bench.results:
        console.print(f"appended {len(rows)} row(s) to {bench.results} ({where['machine']})")
    if bench.mlflow:
        log_to_mlflow(report, first)
    return report


def compare_with_reference(rows: list[dict], on_cpu: bool) -> None:
    """Each row's speed-up over the reference kernel of the same model, measured in this process."""
    key = "cpu_seconds_per_step" if on_cpu else "step_seconds"  # CPU time: fair when the load changed
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"] and r["kernel"] == "reference"), None)
        row["speedup_vs_reference"] = base[key] / row[key] if base else None


def write_rows(path: Path, rows: list[dict]) -> None:
    partial = path.with_name(path.name + ".partial")
    try:
        partial.write_text(json.dumps(rows, indent=2))
        partial.replace(path)  # whole or not at all, should the benchmark be stopped while it writes
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


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


@command
def cli() -> None:
    """`python -m frontier.bench` and the `frontier-bench` command."""
    print_help_if_asked(sys.argv[1:], __doc__)
    try:
        main(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
