"""Defaults sized to the machine: the competition's model and budget on an accelerator, and a model
and budget that a CPU finishes in minutes elsewhere, so the first command works anywhere.

conf/config.yaml picks `model` and `budget` through `${frontier.sized:GROUP,ACCELERATOR_OPTION,CPU_OPTION}`;
an explicit `model=...` or `budget=...` always wins.
"""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf

chosen: dict[str, str] = {}  # group -> the option picked for this machine, for the start-up line


# Device files without which no CUDA GPU (/dev/nvidia*, /dev/dxg under WSL) or Trainium (/dev/neuron*) can be
# seen on Linux: where none exists, torch (2 s to import) is not needed to know there is no accelerator.
ACCELERATOR_DEVICE_FILES = ("nvidia*", "dxg", "neuron*")


def accelerator() -> str | None:
    """The accelerator `device=auto` would pick, or None on a CPU-only machine."""
    if sys.platform == "linux" and not any(any(Path("/dev").glob(pattern)) for pattern in ACCELERATOR_DEVICE_FILES):
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "neuron") and torch.neuron.is_available():
        return "neuron"
    return None


def sized(group: str, on_accelerator: str, on_cpu: str) -> str:
    chosen[group] = on_accelerator if accelerator() else on_cpu
    return chosen[group]


def describe() -> str | None:
    """One line saying what was sized for this machine, or None when the command line chose."""
    if not chosen:
        return None
    picks = " ".join(f"{group}={option}" for group, option in chosen.items())
    where = accelerator() or "a CPU-only machine (no CUDA or Neuron device)"
    return f"{picks}: sized for {where}; choose others with model=... budget=..."


OmegaConf.register_new_resolver("frontier.sized", sized, replace=True)
