"""The grid a frontier sweep trains: a family of shapes along model.depth, a bracket of learning-rate
scales per shape, and the budgets (sweep.budgets), sized by default to the device; and the trials
that follow the grid.

Each trial's Optuna parameters are the depth, the scale and the budget; the shape's width and heads
follow from the depth and join the trial's overrides, so its record and command are complete.

Once every grid trial has ended, a shape whose best scale is an end of the bracket trains once more
one step beyond it (the bracket's own ratio; user attribute `lr_extension`): its rate was not tuned
otherwise. Then, with `sweep.validate=N`, the predicted optimum's nearest shape and its two neighbours
at the longest budget train N seeds each (`validate_plan`; its runs are tagged as confirmation runs
are, `confirm` and `confirm_seed`, and with `validate`). Neither counts toward sweep.n_trials.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from frontier.config import FRONTIER_BUDGET as BUDGET, FRONTIER_DEPTH as DEPTH, FRONTIER_LR_SCALE as LR_SCALE
from frontier.config import FRONTIER_EXTENSION as EXTENSION, FRONTIER_VALIDATE_PLAN as VALIDATE_PLAN
from frontier.config import ConfigError, FrontierConfig
from hydra_plugins.frontier_sweeper._confirm import confirmation_running, is_confirmation, next_run, search_running
from hydra_plugins.frontier_sweeper._workers import WAIT

# Small depths where a CPU trains a shape in minutes; the competition's base region on accelerators.
DEVICE_DEPTHS = {"cpu": [1, 2, 3, 4, 6, 8], "accelerator": [6, 8, 10, 12, 14, 16]}
# A CPU's optimum at minutes of training lies at widths of 32 to 128: heads of 32 keep each width whole.
CPU_HEAD_DIM = 32
BYTES_PER_PARAM = 16  # fp32 weights, gradients and two optimizer moments
VALIDATE = "validate"  # the label's prefix and a user attribute of a sweep.validate run


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

    def beyond(self) -> dict[float, float]:
        """Each end of the bracket and the scale one step past it, by the ratio of the bracket's end step."""
        scales = self.lr_scales
        if len(scales) < 2:
            return {}
        return {scales[0]: round(scales[0] ** 2 / scales[1], 12), scales[-1]: round(scales[-1] ** 2 / scales[-2], 12)}

    def grid(self) -> dict[str, list]:
        """The points every sweep trains: the bracket, not the steps beyond it."""
        return {DEPTH: self.depths, LR_SCALE: self.lr_scales, BUDGET: self.budgets}

    def space(self) -> dict[str, BaseDistribution]:
        """The trials' distributions: an Optuna parameter keeps its choices through a study, so the scale's
        holds the steps beyond the bracket that an edge shape may train later."""
        scales = sorted([*self.lr_scales, *self.beyond().values()])
        return {DEPTH: CategoricalDistribution(self.depths), LR_SCALE: CategoricalDistribution(scales),
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


def extensions(family_: Family, trials: list[FrozenTrial]) -> list[dict]:
    """The trials one step beyond the bracket: one for each shape and budget whose best finished scale is
    an end of the bracket and that has not trained that step yet."""
    beyond, wanted = family_.beyond(), []
    for seconds in family_.budgets:
        for depth in family_.depths:
            shape = [t for t in trials if t.params.get(DEPTH) == depth and t.params.get(BUDGET) == seconds]
            done = [t for t in shape if t.state == TrialState.COMPLETE and t.value is not None]
            if not done:
                continue
            edge = min(done, key=lambda t: t.value).params[LR_SCALE]
            if edge in beyond and all(t.params.get(LR_SCALE) != beyond[edge] for t in shape):
                wanted.append({DEPTH: depth, LR_SCALE: beyond[edge], BUDGET: seconds})
    return wanted


def validate_plan(study: optuna.Study, seeds: int, run_seed: int) -> dict:
    """sweep.validate's runs: at the longest budget, the swept shape nearest the predicted optimum and its
    neighbours along the depths, each at its best scale, with `seeds` seeds the grid did not use."""
    from frontier import shapes  # the fit, only once a sweep asks for validation

    seconds = max(study.user_attrs["frontier"]["budgets"])
    points = shapes.best_points(shapes.at_budget(shapes.search_trials(study), seconds))
    found = shapes.fit(points)
    plan = {"seconds": seconds, "seeds": [run_seed + i for i in range(1, seeds + 1)], "configs": [],
            "predicted": None, "problem": found.problem}
    if found.optimum is None:
        return plan
    at = points.index(shapes.nearest(points, found.optimum))
    plan["predicted"] = f"{VALIDATE} depth {points[at].depth}"
    plan["configs"] = [{"label": f"{VALIDATE} depth {p.depth}",
                        "params": {DEPTH: p.depth, LR_SCALE: p.lr_scale, BUDGET: seconds}}
                       for p in points[max(at - 1, 0):at + 2]]
    return plan


def next_after_grid(family_: Family, study: optuna.Study, validate: int, run_seed: int):
    """The next trial once the grid is run, as (params, user attributes): an edge shape's step beyond its
    bracket, then sweep.validate's runs. WAIT while a running trial may change what follows (or fail and be
    retried); None when none is left."""
    if search_running(study):
        return WAIT
    searched = [t for t in study.get_trials(deepcopy=False) if not is_confirmation(t)]
    wanted = extensions(family_, searched)
    if wanted:
        return wanted[0], {EXTENSION: True}
    if not validate:
        return None
    plan = study.user_attrs.get(VALIDATE_PLAN)
    if plan is None:
        plan = validate_plan(study, validate, run_seed)
        study.set_user_attr(VALIDATE_PLAN, plan)
    found = next_run(study, plan)
    if found is None:
        return WAIT if confirmation_running(study) else None
    config, seed = found
    return config["params"], {"confirm": config["label"], "confirm_seed": seed, VALIDATE: True}


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
