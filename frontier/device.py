"""The one place where CPU, CUDA and Trainium (PyTorch's native `neuron` device) differ."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from filelock import FileLock

from frontier.config import ConfigError, project_path

# Dense bf16 peak FLOP/s per device, for MFU against the nominal figure.
NOMINAL_PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10G": 70e12,
    "neuron": 667e12 / 8,  # one NeuronCore-v3: a Trainium2 chip has 8
}

# Measured matmul rates, once per machine, device, dtype, torch version and thread count.
PEAK_CACHE: Path | None = None  # None: <home>/.cache/peak_flops.json (frontier/paths.py)
MEASURE_SECONDS = 3.0  # long enough that one busy moment does not decide the figure

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def neuron_available() -> bool:
    return hasattr(torch, "neuron") and torch.neuron.is_available()


def cpu_bf16_features() -> list[str]:
    """The CPU features that make bf16 matmuls fast (torch's capability string stops at "AVX512")."""
    checks = {"AMX": "_is_amx_tile_supported", "AVX512_BF16": "_is_avx512_bf16_supported"}
    return [name for name, check in checks.items() if getattr(torch.cpu, check, lambda: False)()]


def bf16_native(kind: str) -> tuple[bool, str]:
    """Whether this kind of device computes bf16 natively and faster than fp32, and why.

    A CPU needs AVX512_BF16 or AMX, and then its bf16 matmuls must also outrun its fp32 ones:
    without AMX they may not (an AVX512_BF16 Xeon was seen at half the fp32 rate), so both
    rates are measured once and cached (matmul_rate).
    """
    if kind == "neuron":
        return True, "Trainium computes bf16 natively"
    if kind == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, "the CUDA GPU computes bf16 natively"
        return False, "the CUDA GPU has no native bf16"
    features = cpu_bf16_features()
    if not features:
        return False, (f"cpu has neither AVX512_BF16 nor AMX (torch capability "
                       f"{torch.backends.cpu.get_cpu_capability()})")
    cpu = Device(torch.device("cpu"), "cpu", "cpu", "fp32")
    bf16, fp32 = (matmul_rate(cpu, precision)["flops"] / 1e9 for precision in ("bf16", "fp32"))
    rates = f"{bf16:,.1f} GFLOP/s against {fp32:,.1f} in fp32"
    has = f"cpu has {' and '.join(features)}"
    if bf16 >= fp32:
        return True, f"{has}, its bf16 matmuls run at {rates}"
    return False, f"{has}, but its bf16 matmuls run at only {rates}"


@dataclass
class Device:
    torch_device: torch.device
    kind: str  # cpu | cuda | neuron
    name: str
    precision: str  # bf16 | fp32, resolved (never auto)
    precision_reason: str = ""

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16" else None

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.kind, dtype=self.autocast_dtype)

    def synchronize(self) -> None:
        """Wait for queued device work, so that a clock read after it is honest."""
        if self.kind == "cuda":
            torch.cuda.synchronize(self.torch_device)
        elif self.kind == "neuron":
            torch.neuron.synchronize()

    def nominal_peak_flops(self) -> float | None:
        if self.kind == "neuron":
            return NOMINAL_PEAK_FLOPS["neuron"]
        for key, flops in NOMINAL_PEAK_FLOPS.items():
            if key in self.name:
                return flops
        return None

    def peak_flops(self) -> tuple[float, str]:
        """The rate MFU is taken against: the published peak, or the matmul rate measured once here."""
        nominal = self.nominal_peak_flops()
        if nominal is not None:
            return nominal, f"nominal bf16 peak of {self.name}"
        entry = matmul_rate(self, self.precision)
        return entry["flops"], describe_measurement(entry)


def peak_figures(device: Device) -> dict:
    """The rate mfu is taken against, and where that is a nominal peak (an accelerator) the matmul rate
    measured here beside it: a run's own figure to compare with when the nominal peak is out of reach."""
    peak, source = device.peak_flops()
    figures = {"peak_flops": peak, "peak_flops_source": source}
    if device.nominal_peak_flops() is not None:
        entry = matmul_rate(device, device.precision)
        figures.update(measured_matmul_flops=entry["flops"], measured_matmul_source=describe_measurement(entry))
    return figures


def device_kind(name: str) -> str:
    """cpu, cuda or neuron: what `device=name` runs on here (`auto` picks cuda, then neuron, then cpu);
    a device this machine lacks is a ConfigError. Nothing is started."""
    kind = name.split(":")[0]
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not available: torch {torch.__version__} sees no CUDA GPU "
                          "(use device=cpu or device=auto)")
    if kind == "neuron" and not neuron_available():
        raise ConfigError(f"device={name!r} is not available: no Trainium device (install the Neuron SDK's "
                          "torch-neuronx on a trn instance, or use device=cpu or device=auto)")
    return kind


def resolve_device(name: str, precision: str, neuron_logical_cores: int | None = None) -> Device:
    """`auto` picks cuda, then neuron, then cpu; an explicit device must exist.

    precision=auto is bf16 where the device computes it natively, else fp32; the choice and its
    reason go to stderr as one line (and into Device for the run's summary).
    """
    if precision not in ("auto", *DTYPES):
        raise ConfigError(f"precision={precision!r} is not allowed: choose one of auto, bf16, fp32")
    if neuron_logical_cores is not None:
        # Read by the Neuron runtime when it starts, so it must be set before the device is touched.
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(neuron_logical_cores)
    kind = device_kind(name)
    torch_device = torch.device(kind if name.startswith("auto") else name)
    if kind == "cuda":
        label = torch.cuda.get_device_name(torch_device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    elif kind == "neuron":
        label = "Trainium NeuronCore"
    else:
        label = "cpu"
        keep_freed_memory()
    if precision == "fp32":  # asked for, and never slow: nothing to measure
        native, device = False, Device(torch_device, kind, label, "fp32", "precision=fp32")
    else:
        native, why = bf16_native(kind)
        if precision == "auto":
            device = Device(torch_device, kind, label, "bf16" if native else "fp32", f"auto: {why}")
        else:
            device = Device(torch_device, kind, label, "bf16", f"precision=bf16 ({why})")
    print(f"precision {device.precision}: {device.precision_reason}", file=sys.stderr)
    if device.precision == "bf16" and not native:
        print(f"warning: {bf16_slowdown(device)}", file=sys.stderr)
    return device


def keep_freed_memory() -> None:
    """glibc hands every freed block of 32 MiB or more (a [8192, 1024] fp32 activation) straight back
    to the kernel, so each step faults the same pages in again, zeroed: serve every block from the
    heap and never shrink it. Nothing changes where the C library is not glibc."""
    import ctypes
    import ctypes.util

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
    with contextlib.suppress(OSError, AttributeError, TypeError):  # no mallopt: another C library
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(M_MMAP_MAX, 0)
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def bf16_slowdown(device: Device) -> str:
    """One sentence on what bf16 costs on a device where it is not native and fast, from the cached matmul rates."""
    advice = "precision=auto or precision=fp32 is faster here"
    if device.kind != "cpu":
        return f"precision=bf16 without native bf16 on {device.name}; {advice}"
    bf16, fp32 = matmul_rate(device, "bf16")["flops"], matmul_rate(device, "fp32")["flops"]
    return (f"precision=bf16 on this cpu: its matmuls run {fp32 / bf16:,.1f}x slower than "
            f"fp32 here ({bf16 / 1e9:,.1f} vs {fp32 / 1e9:,.1f} GFLOP/s); {advice}")


def mfu_note(mfu: float | None, peak_source: str = "") -> str | None:
    """Why an MFU above 1 cannot be right, so that it is never reported silently; None when it is <= 1."""
    if mfu is None or mfu <= 1:
        return None
    against = f" ({peak_source})" if peak_source else ""
    return (f"mfu {mfu:.2f} > 1: the peak it is taken against{against} looks too low, measured while the "
            "machine was busy; `python -m frontier.bench` measures it again")


# ---------------------------------------------------------------------------------------------
# The matmul rate, measured once


def measure_matmul_flops(device: Device, size: int | None = None, dtype: torch.dtype | None = None,
                         seconds: float = MEASURE_SECONDS) -> float:
    """The matmul rate this machine reaches: the fastest of the matmuls timed over `seconds`.

    Without a size, the largest square (up to 2048 on CPU, 8192 elsewhere) whose single matmul
    takes under a twentieth of `seconds`, so a slow dtype still gets several timings. The fastest
    matmul, not the mean, so that a load spike during the measurement lowers the figure less. On a
    CPU, one thread's rate per CPU-second times the threads a run uses: another process busy beside
    it takes wall-clock time from a measurement, not CPU time.
    """
    if device.kind != "cpu":
        return _fastest_matmul(device, size, dtype, seconds, time.perf_counter)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return threads * _fastest_matmul(device, size, dtype, seconds, time.process_time)
    finally:
        torch.set_num_threads(threads)


def _fastest_matmul(device: Device, size: int | None, dtype: torch.dtype | None, seconds: float, clock) -> float:
    dtype = dtype or device.autocast_dtype or torch.float32

    def operands(n):  # the product goes into one buffer, so the figure holds no allocation
        # from a generator of its own: a run that measures must draw the same random numbers as one
        # that finds the rate cached (its seeded model and data would differ otherwise)
        gen = torch.Generator().manual_seed(n)
        return [torch.randn(n, n, generator=gen, dtype=dtype).to(device.torch_device) for _ in range(3)]

    def timed(a, b, out) -> float:
        start = clock()
        torch.mm(a, b, out=out)
        device.synchronize()
        return max(clock() - start, 1e-9)

    if size is None:
        largest = 2048 if device.kind == "cpu" else 8192
        size = 256
        while size < largest:
            mats = operands(size)
            timed(*mats)  # warm up this size
            if timed(*mats) > seconds / 20:
                break
            size *= 2
    mats = operands(size)
    timed(*mats)
    best, spent = float("inf"), 0.0
    while spent < seconds:
        took = timed(*mats)
        best, spent = min(best, took), spent + took
    return 2 * size**3 / best


def rate_key(device: Device, precision: str) -> str:
    # The capability is part of the key: ATEN_CPU_CAPABILITY (with MKL_ENABLE_INSTRUCTIONS and
    # ONEDNN_MAX_CPU_ISA) makes one CPU behave like an older one, at another matmul rate.
    # a CPU's rate is per CPU-second (measure_matmul_flops): rates measured by wall clock are not reused
    capability = f" | {torch.backends.cpu.get_cpu_capability()} | per CPU-second" if device.kind == "cpu" else ""
    return (f"{socket.gethostname()} | {device.name}{capability} | {precision} | torch {torch.__version__} | "
            f"{torch.get_num_threads()} threads")


def matmul_rate(device: Device, precision: str, refresh: bool = False, cache: Path | None = None) -> dict:
    """The cached measurement for this machine, device and dtype, measuring it first if needed.

    One process measures while others wait on the lock (two measuring at once would disturb each
    other), and the file is replaced atomically so a reader never sees half of it.
    """
    cache = cache or PEAK_CACHE or project_path(".cache") / "peak_flops.json"
    key = rate_key(device, precision)
    if not refresh and key in read_rates(cache):
        return read_rates(cache)[key]
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        rates = read_rates(cache)
        if key in rates and not refresh:
            return rates[key]  # another process measured it while we waited
        print(f"measuring the {precision} matmul rate of {device.name} once (a few seconds; cached in {cache})",
              file=sys.stderr)
        load = os.getloadavg()[0]
        flops, settled = settled_rate(device, DTYPES[precision])
        entry = {"flops": flops, "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "load_avg_1min": round(load, 2), "seconds": MEASURE_SECONDS,
                 "basis": (f"one thread per CPU-second x {torch.get_num_threads()} threads" if device.kind == "cpu"
                           else "wall clock")}
        if not settled:  # used for this run, and measured again by the next
            print(f"warning: the {precision} matmul rate of {device.name} did not settle in {MEASURE_TRIES} "
                  f"measurements (each re-checked within {RECHECK_TOLERANCE:.0%}); not cached", file=sys.stderr)
            return entry
        rates[key] = entry
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(rates, indent=2, sort_keys=True))
        os.replace(tmp, cache)
        return rates[key]


RECHECK_SECONDS, RECHECK_TOLERANCE, MEASURE_TRIES = 1.0, 0.15, 3


def settled_rate(device: Device, dtype: torch.dtype) -> tuple[float, bool]:
    """A matmul rate that a quick re-check agrees with (within RECHECK_TOLERANCE), and whether one did:
    a measurement a busy moment disturbed is taken again, up to MEASURE_TRIES times."""
    for _ in range(MEASURE_TRIES):
        flops = measure_matmul_flops(device, dtype=dtype)
        again = measure_matmul_flops(device, dtype=dtype, seconds=RECHECK_SECONDS)
        if abs(again - flops) <= RECHECK_TOLERANCE * max(flops, again):
            return max(flops, again), True
    return max(flops, again), False


def read_rates(cache: Path) -> dict:
    try:
        rates = json.loads(cache.read_text())
    except (OSError, ValueError):  # absent or damaged: measure again
        return {}
    return rates if isinstance(rates, dict) else {}


def describe_measurement(entry: dict) -> str:
    basis = f", {entry['basis']}" if entry.get("basis") else ""
    return f"measured {entry['measured']}, load average {entry['load_avg_1min']}{basis}"
