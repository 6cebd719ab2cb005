"""`python -m frontier.model_card model=... [overrides]`: size a model before spending device time.

Prints the parameter count (embedding / non-embedding), training FLOPs per token and the tokens a
run would see in its budget on this machine, without training and without touching data (the
vocabulary size is `data.vocab_size`). Takes the trainer's Hydra overrides.

Throughput, by default, is measured: forward+backward passes of the model on random tokens at the
trainer's micro-batch (one row of `model.seq_len` on CPU) and one optimizer step, timed with the
device synchronised, then scaled to a step of `train.batch_tokens`. `--nominal` skips the model
and assumes instead the device's published bf16 peak (on CPU: its measured matmul rate) × `--mfu`.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from frontier import paths
from frontier.cli import command
from frontier.compose import one_sentence, run_config
from frontier.config import Config, ConfigError, register_schemas
from frontier.device import Device, resolve_device
from frontier.model import GPT, build, head_size, kv_heads, layer_windows, value_embed_layers
from frontier.optim import build_optimizers


def load_config(overrides: list[str]) -> Config:
    register_schemas()
    return run_config(str(paths.conf_dir()), overrides)  # Hydra's mistakes, one sentence


def describe_shape(cfg) -> str:
    windows = layer_windows(cfg)
    attention = f"{cfg.n_head} heads of {head_size(cfg)}, {kv_heads(cfg)} KV"
    if any(windows):
        short = next(w for w in windows if w)
        attention += f", windows {''.join('S' if w else 'L' for w in windows)} (S = {short} tokens)"
    extras = [f"{cfg.activation} x{cfg.mlp_ratio:g}"]
    if cfg.value_embed_layers:
        extras.append(f"value embeddings on layers {value_embed_layers(cfg)}")
    if cfg.layer_scalars:
        extras.append("layer scalars")
    if cfg.tie_embeddings:
        extras.append("tied head")
    if cfg.mtp_heads:
        extras.append(f"{cfg.mtp_heads} extra MTP heads {list(cfg.mtp_weights)}")
    return f"{cfg.depth} x {cfg.d_model} ({attention}), seq {cfg.seq_len}; " + ", ".join(extras)


def measure_tokens_per_second(config: Config, vocab: int, device: Device, rows: int,
                              steps: int) -> tuple[float, str]:
    """Times `steps` forward+backward passes of `rows` rows and one optimizer step; returns the
    tokens per second of a full training step (accumulation included) and how it was measured."""
    torch.manual_seed(config.seed)
    seq = config.model.seq_len
    model, step_model = build(config, vocab, device)
    optimizers = build_optimizers(model.param_groups(), config.optim, device.kind)
    idx = torch.randint(0, vocab, (rows, seq + 1), device=device.torch_device)

    def micro_step():
        with device.autocast():
            loss = step_model(idx[:, :-1], idx[:, 1:])
        loss.backward()

    def timed(fn, repeats: int) -> float:
        device.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        device.synchronize()
        return (time.perf_counter() - start) / repeats

    warmup = max(1, config.budget.excluded_steps) if config.kernel.name == "compiled" else 1
    timed(micro_step, warmup)  # compilation, allocator, optimizer state
    for opt in optimizers:
        opt.step()
    micro = timed(micro_step, steps)
    optimizer = timed(lambda: [opt.step() for opt in optimizers], 1)
    model.zero_grad(set_to_none=True)
    step_rows = config.train.batch_tokens // seq
    step_seconds = step_rows / rows * micro + optimizer
    how = (f"measured: {steps} forward+backward of {rows} x {seq} tokens ({micro * 1e3:,.0f} ms each) "
           f"and an optimizer step ({optimizer * 1e3:,.0f} ms), scaled to {step_rows} rows per step")
    return config.train.batch_tokens / step_seconds, how


def nominal_tokens_per_second(flops_per_token: int, device: Device, mfu: float) -> tuple[float, str]:
    peak, source = device.peak_flops()
    source = "nominal peak" if source.startswith("nominal") else f"matmul rate {source}"
    how = f"estimated: {source} {peak / 1e12:,.3g} TFLOP/s x assumed MFU {mfu:.0%}"
    return peak * mfu / flops_per_token, how


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.3g}{unit}"
    return f"{n:,.3g}"


def usage_error(message: str) -> None:
    print(f"error: {message} (see --help)", file=sys.stderr)
    raise SystemExit(2)


@command
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m frontier.model_card",
        description="Parameters, FLOPs per token and tokens per budget of a model, without training.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m frontier.train")
    parser.add_argument("--nominal", action="store_true", help="peak x MFU instead of timing the model")
    parser.add_argument("--mfu", type=float, default=0.3, help="assumed MFU for --nominal (default 0.3)")
    parser.add_argument("--rows", type=int, default=None,
                        help="rows per timed forward+backward (default train.device_batch_rows; 1 on CPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed forward+backward passes (default 2; 1 on CPU)")
    parser.error = usage_error  # one sentence, not argparse's usage block
    args = parser.parse_args(argv)
    if not 0 < args.mfu <= 1:
        parser.error(f"--mfu={args.mfu} must be in (0, 1]")
    for flag, value in (("--rows", args.rows), ("--steps", args.steps)):
        if value is not None and value < 1:
            parser.error(f"{flag}={value} is not allowed: it must be a positive integer")
    try:
        config = load_config(args.overrides)
        device = resolve_device(config.device, config.precision)
    except (ConfigError, HydraException, OmegaConfBaseException) as err:
        print(f"error: {one_sentence(err)}", file=sys.stderr)
        raise SystemExit(2) from None

    cfg, vocab = config.model, config.data.vocab_size
    with torch.device("meta"):  # sizes and costs need no memory
        meta = GPT(cfg, vocab)
    params, flops = meta.num_params(), meta.flops_per_token()
    print(f"model {cfg.name}: {describe_shape(cfg)}")
    print(f"parameters       {params['total']:>14,}  ({human(params['total'])}; vocab {vocab})")
    print(f"  embedding      {params['embedding']:>14,}  (token{' and value' if cfg.value_embed_layers else ''} "
          f"embeddings)")
    print(f"  non-embedding  {params['non_embedding']:>14,}")
    print(f"FLOPs per token  {flops:>14,}  ({human(flops)}; training: forward + backward)")

    if args.nominal:
        tokens_per_second, how = nominal_tokens_per_second(flops, device, args.mfu)
    else:
        rows = args.rows or (1 if device.kind == "cpu" else config.train.device_batch_rows)
        steps = args.steps or (1 if device.kind == "cpu" else 2)
        tokens_per_second, how = measure_tokens_per_second(config, vocab, device, rows, max(1, steps))
    budget_tokens = tokens_per_second * config.budget.seconds
    print(f"device           {device.name} ({device.precision}, kernel={config.kernel.name})")
    print(f"tokens / second  {tokens_per_second:>14,.0f}  ({how})")
    peak = device.nominal_peak_flops()
    if peak is not None and not args.nominal:
        print(f"  MFU            {tokens_per_second * flops / peak:>14.1%}  (of the nominal peak "
              f"{peak / 1e12:,.0f} TFLOP/s)")
    print(f"tokens / budget  {budget_tokens:>14,.0f}  ({human(budget_tokens)} in {config.budget.seconds:,.0f} s "
          f"of budget.{config.budget.name}; {budget_tokens / params['total']:,.3g} tokens per parameter)")


if __name__ == "__main__":
    main()
