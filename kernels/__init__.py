"""Operator implementations the model is built from, keyed by op and backend.

Every op has a PyTorch `reference`; other backends register faster versions of the same
signature and are tested against it. The model asks `get(op, backend)` for each op.
`attention(q, k, v, window=None)` takes grouped key/value heads and an optional sliding window
in tokens (see reference.causal_attention).
"""
from __future__ import annotations

from typing import Callable

from kernels import reference

OPS = ("rmsnorm", "relu2", "leaky_relu2", "gelu", "swiglu", "rotary", "attention")

_REGISTRY: dict[str, dict[str, Callable]] = {
    "rmsnorm": {"reference": reference.rms_norm},
    "relu2": {"reference": reference.relu2},
    "leaky_relu2": {"reference": reference.leaky_relu2},
    "gelu": {"reference": reference.gelu},
    "swiglu": {"reference": reference.swiglu},
    "rotary": {"reference": reference.apply_rotary},
    "attention": {"reference": reference.causal_attention},
}


def register(op: str, backend: str, fn: Callable) -> None:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    _REGISTRY[op][backend] = fn


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY[op])


def get(op: str, backend: str = "reference") -> Callable:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    impls = _REGISTRY[op]
    if backend not in impls:
        raise KeyError(f"no {backend!r} implementation of {op!r}; available: {', '.join(sorted(impls))}")
    return impls[backend]
