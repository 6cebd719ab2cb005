"""The grid a frontier sweep trains: a family of shapes along model.depth, a bracket of learning-rate
scales per shape, and the budgets (sweep.budgets), sized by default to the device.

Each trial's Optuna parameters are the depth, the scale and the budget; the shape's width and heads
follow from the depth and join the trial's overrides, so its record and command are complete.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from optuna.distributions import BaseDistribution, CategoricalDistribution

from frontier.config import FRONTIER_BUDGET as BUDGET, FRONTIER_DEPTH as DEPTH, FRONTIER_LR_SCALE as LR_SCALE
from frontier.config import ConfigError, FrontierConfig

# Small depths where a CPU trains a shape in minutes; the competition's base region on accelerators.
DEVICE_DEPTHS = {"cpu": [1, 2, 3, 4, 6, 8], "accelerator": [6, 8, 10, 12, 14, 16]}
# A CPU's optimum at minutes of training lies at widths of 32 to 128: heads of 32 keep each width whole.
CPU_HEAD_DIM = 32
BYTES_PER_PARAM = 16  # fp32 weights, gradients and two optimizer moments


@dataclass(frozen=True)
class Family:
    depths: list[int]
    aspect_ratio: int
    head_dim: int
    lr_scales: list[float]
    budgets: list[float]
    device: str

    def shape(self, depth: int) -> dict[str, int]:
        """The overrides of one shape: d_model rounded up to whole heads, as nanochat does."""
        d_model = math.ceil(depth * self.aspect_ratio / self.head_dim) * self.head_dim
        return {DEPTH: depth, "model.d_model": d_model, "model.n_head": d_model // self.head_dim}

    def space(self) -> dict[str, BaseDistribution]:
        return {DEPTH: CategoricalDistribution(self.depths), LR_SCALE: CategoricalDistribution(self.lr_scales),
                BUDGET: CategoricalDistribution(self.budgets)}

    def costliest(self) -> dict:
        """The point whose evaluation costs most against its budget: the largest shape, the shortest budget."""
        return {DEPTH: max(self.depths), LR_SCALE: self.lr_scales[0], BUDGET: min(self.budgets)}

    def derived(self, params: dict) -> list[str]:
        """A trial's width and heads, from its depth."""
        if DEPTH not in params:
            return []
        return [f"{key}={value}" for key, value in self.shape(params[DEPTH]).items() if key != DEPTH]

    def describe(self) -> dict:
        """The study's `frontier` user attribute, which frontier/shapes.py fits from."""
        return {"depths": self.depths, "aspect_ratio": self.aspect_ratio, "head_dim": self.head_dim,
                "lr_scales": self.lr_scales, "budgets": self.budgets, "device": self.device,
                "shapes": {str(d): self.shape(d) for d in self.depths}}


def family(frontier: FrontierConfig, budgets: list[float] | None, model, budget_seconds: float,
           device_kind: str) -> Family:
    """The family for this command: the given settings, else the device's depths, the composed model's
    aspect ratio, and its head size (on a CPU, CPU_HEAD_DIM)."""
    kind = "cpu" if device_kind == "cpu" else "accelerator"
    head_dim = CPU_HEAD_DIM if kind == "cpu" else model.head_dim or model.d_model // model.n_head
    return Family(depths=sorted(frontier.depths or DEVICE_DEPTHS[kind]),
                  aspect_ratio=frontier.aspect_ratio or max(1, round(model.d_model / model.depth)),
                  head_dim=frontier.head_dim or head_dim, lr_scales=sorted(frontier.lr_scales),
                  budgets=sorted(budgets or [budget_seconds]), device=device_kind)


def check_space(space: dict, frontier: FrontierConfig | None, budgets: list[float] | None) -> None:
    """The frontier's axes and sweep.budgets are the sweeper's own: the search space must not set them too."""
    owned = {BUDGET: "sweep.budgets"} if budgets is not None else {}
    if frontier is not None:
        owned = {DEPTH: "sweep.frontier.depths", "model.d_model": "sweep.frontier.aspect_ratio",
                 "model.n_head": "sweep.frontier.head_dim", LR_SCALE: "sweep.frontier.lr_scales",
                 BUDGET: "sweep.budgets"}
    for key, owner in owned.items():
        if key in space:
            raise ConfigError(f"{key} is not allowed in this search space: {owner} sets it; drop it from "
                              "the params (or the command line) and set that instead")


def check_fits(family_: Family, run) -> None:
    """Refuses a family whose largest shape cannot train on this device: its weights, gradients and
    optimizer state alone above the device's memory. `run` is that shape's config (Family.costliest)."""
    import torch

    from frontier.model import GPT, Ops

    memory = device_memory(family_.device)
    if memory is None:
        return
    with torch.device("meta"):
        params = GPT(run.model, run.data.vocab_size, Ops(run.kernel, family_.device)).num_params()["total"]
    if params * BYTES_PER_PARAM > memory:
        raise ConfigError(f"sweep.frontier.depths={family_.depths} is not allowed on this {family_.device}: depth "
                          f"{max(family_.depths)} ({params:,} parameters) needs about "
                          f"{params * BYTES_PER_PARAM / 2**30:.1f} GiB for its weights and optimizer state alone, "
                          f"and the device has {memory / 2**30:.1f} GiB; choose smaller depths")


def device_memory(kind: str) -> float | None:
    """Bytes a trial's model may use: the machine's memory on a CPU, the GPU's own on CUDA."""
    import os

    import torch

    if kind == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if kind == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return None  # a NeuronCore's share of HBM is the runtime's to tell
