"""The one place where CPU, CUDA and Trainium (PyTorch's native `neuron` device) differ."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from frontier.config import ConfigError

# Dense bf16 peak FLOP/s per device, for MFU against the nominal figure.
NOMINAL_PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "A10G": 70e12,
    "neuron": 667e12 / 8,  # one NeuronCore-v3: a Trainium2 chip has 8
}


def neuron_available() -> bool:
    return hasattr(torch, "neuron") and torch.neuron.is_available()


@dataclass
class Device:
    torch_device: torch.device
    kind: str  # cpu | cuda | neuron
    name: str
    precision: str

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
        """The rate MFU is taken against: the published peak, or (CPU) what this machine's matmul reaches."""
        nominal = self.nominal_peak_flops()
        if nominal is not None:
            return nominal, "nominal"
        return measure_matmul_flops(self), "measured"


def resolve_device(name: str, precision: str, neuron_logical_cores: int | None = None) -> Device:
    """`auto` picks cuda, then neuron, then cpu; an explicit device must exist."""
    if neuron_logical_cores is not None:
        # Read by the Neuron runtime when it starts, so it must be set before the device is touched.
        os.environ["NEURON_LOGICAL_NC_CONFIG"] = str(neuron_logical_cores)
    kind = name.split(":")[0]
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
        name = kind
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} is not available: torch {torch.__version__} sees no CUDA GPU "
                          "(use device=cpu or device=auto)")
    if kind == "neuron" and not neuron_available():
        raise ConfigError(f"device={name!r} is not available: no Trainium device (install the Neuron SDK's "
                          "torch-neuronx on a trn instance, or use device=cpu or device=auto)")
    torch_device = torch.device(name)
    if kind == "cuda":
        label = torch.cuda.get_device_name(torch_device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    elif kind == "neuron":
        label = "Trainium NeuronCore"
    else:
        label = "cpu"
    return Device(torch_device, kind, label, precision)


def measure_matmul_flops(device: Device, size: int = 1024, dtype: torch.dtype | None = None,
                         seconds: float = 0.3) -> float:
    """The matmul rate this machine actually reaches, for MFU against what is achievable."""
    dtype = dtype or device.autocast_dtype or torch.float32
    a = torch.randn(size, size, device=device.torch_device, dtype=dtype)
    b = torch.randn(size, size, device=device.torch_device, dtype=dtype)
    a @ b  # warm up
    device.synchronize()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
        device.synchronize()
    return 2 * size**3 * count / (time.perf_counter() - start)
