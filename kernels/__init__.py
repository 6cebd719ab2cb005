"""Operator implementations the model is built from, keyed by op and backend.

Every op has a PyTorch `reference`; other backends register faster versions of the same
signature and are tested against it. The model asks `get(op, backend)` for each op.
`attention(q, k, v, window=None)` takes grouped key/value heads and an optional sliding window
in tokens (see reference.causal_attention). `head_loss(x, weight, targets, softcap=None,
reduction="mean")` is the unembedding and cross-entropy in one, chunked over rows so that the
full fp32 logits never exist at once (see head_loss.py).

Backends: `reference` (eager PyTorch, runs anywhere), `triton` (CUDA; kernels/triton_ops.py) and
`nki` (Trainium; kernels/nki_ops.py). The accelerator backends are imported on first use, so the
registry can be listed and a configuration checked on a machine without their packages.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Callable

from kernels import head_loss as _head_loss
from kernels import reference

OPS = ("attention", "rmsnorm", "relu2", "leaky_relu2", "gelu", "swiglu", "rotary", "head_loss")
BACKENDS = ("reference", "triton", "nki")
# kernel=NAME presets: which backend each op takes unless the config names one for it
PRESETS = ("reference", "compiled", "triton", "nki")


class KernelError(ValueError):
    """A kernel choice that names an op, backend or preset that does not exist."""


_REGISTRY: dict[str, dict[str, Callable | str]] = {
    "attention": {"reference": reference.causal_attention},
    "rmsnorm": {"reference": reference.rms_norm, "triton": "kernels.triton_ops:rms_norm",
                "nki": "kernels.nki_ops:rms_norm"},
    "relu2": {"reference": reference.relu2, "nki": "kernels.nki_ops:relu2"},
    "leaky_relu2": {"reference": reference.leaky_relu2},
    "gelu": {"reference": reference.gelu},
    "swiglu": {"reference": reference.swiglu},
    "rotary": {"reference": reference.apply_rotary},
    "head_loss": {"reference": _head_loss.head_loss, "triton": "kernels.triton_ops:head_loss"},
}


def register(op: str, backend: str, fn: Callable) -> None:
    _check_op(op)
    _REGISTRY[op][backend] = fn


def backends(op: str) -> list[str]:
    _check_op(op)
    return sorted(_REGISTRY[op])


def get(op: str, backend: str = "reference") -> Callable:
    _check_op(op)
    impls = _REGISTRY[op]
    if backend not in impls:
        raise KeyError(f"no {backend!r} implementation of {op!r}; available: {', '.join(sorted(impls))}")
    fn = impls[backend]
    if isinstance(fn, str):  # "module:attribute", imported now that it is asked for
        module, attr = fn.split(":")
        fn = impls[backend] = getattr(importlib.import_module(module), attr)
    return fn


def choose(preset: str = "reference", overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """The backend of every op: a preset's backend wherever it has an implementation, the
    reference elsewhere, then the per-op overrides, which must name an existing implementation."""
    if preset not in PRESETS:
        raise KernelError(f"unknown kernel preset {preset!r}; choose one of {', '.join(PRESETS)}")
    preferred = preset if preset in BACKENDS else "reference"
    chosen = {op: preferred if preferred in _REGISTRY[op] else "reference" for op in OPS}
    for op, backend in (overrides or {}).items():
        if backend is None:
            continue
        if op not in _REGISTRY:
            raise KernelError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
        if backend not in _REGISTRY[op]:
            raise KernelError(f"kernel.{op}={backend}: there is no {backend} implementation of {op}; "
                           f"choose one of {', '.join(sorted(_REGISTRY[op]))}")
        chosen[op] = backend
    return chosen


def unavailable(backend: str, device_kind: str) -> str | None:
    """Why `backend` cannot run on a `device_kind` (cpu | cuda | neuron) device here, or None if it can."""
    if backend == "reference":
        return None
    if backend == "triton":
        # found, not imported: TRITON_INTERPRET only takes effect if set before triton's first import
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (pip install triton; CUDA builds of torch bring it along)"
        # the interpreter runs Triton kernels on CPU tensors: far too slow to train, but exact
        if device_kind != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return (f"Triton kernels need a CUDA GPU and this run is on {device_kind} "
                    "(use device=cuda on a GPU machine, or TRITON_INTERPRET=1 to interpret them on the CPU)")
        return None
    if backend == "nki":
        try:
            import nki
            import nki.isa  # noqa: F401
            import nki.language  # noqa: F401
            nki.jit  # the PyPI placeholder named nki has none of this
        except (ImportError, AttributeError):
            return ("the Neuron SDK's nki package is not installed: on a Trainium (trn) instance, "
                    "pip install neuronx-cc nki --extra-index-url https://pip.repos.neuron.amazonaws.com")
        if device_kind != "neuron" and os.environ.get("NKI_SIMULATOR") != "1":
            return (f"NKI kernels need a Trainium device and this run is on {device_kind} "
                    "(use device=neuron on a trn instance, or NKI_SIMULATOR=1 for the CPU simulator)")
        return None
    raise KernelError(f"unknown backend {backend!r}; backends are {', '.join(BACKENDS)}")


def _check_op(op: str) -> None:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
