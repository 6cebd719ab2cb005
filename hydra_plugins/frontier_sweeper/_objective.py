"""What a sweep optimises (`sweep.objective`), and which trials count toward `sweep.n_trials`.

  val_bpb    minimise the final val_bpb (the default)
  composite  minimise 1 - (0.5 norm(val_bpb) + 0.5 norm(core)): the leaderboard's phase-2 score
             turned into a loss, with each metric normalised against fixed anchors
             (`sweep.composite_val_bpb`, `sweep.composite_core`: [worst, best]) instead of the
             min and max of a pool, so that a trial's value never changes as later trials arrive
  pareto     a two-objective study: val_bpb (minimise) and core (maximise); no pruning

composite and pareto need CORE from every trial, so they add `eval.core=true` to its overrides.
Checkpoints (and so pruning) stay on val_bpb for composite: CORE exists only at the end of a run.
"""
from __future__ import annotations

import math
from pathlib import Path

import optuna
from optuna.trial import TrialState

from frontier.config import FRONTIER_EXTENSION, ConfigError, SweepConfig
from frontier.ladder import RUNG


def normalise(value: float, worst: float, best: float) -> float:
    """0 at `worst`, 1 at `best`, linear (values outside the anchors go beyond 0..1)."""
    return (value - worst) / (best - worst)


def composite(val_bpb: float, core: float, bpb_anchors, core_anchors) -> float:
    return 1.0 - (0.5 * normalise(val_bpb, *bpb_anchors) + 0.5 * normalise(core, *core_anchors))


class Objective:
    def __init__(self, sweep: SweepConfig, eval_core: bool, core_bundle: str, overrides: list[str]):
        self.name = sweep.objective
        self.bpb_anchors = tuple(sweep.composite_val_bpb)
        self.core_anchors = tuple(sweep.composite_core)
        self.directions = ["minimize", "maximize"] if self.name == "pareto" else ["minimize"]
        if self.name == "pareto" and sweep.pruner != "none":
            raise ConfigError(f"sweep.pruner={sweep.pruner!r} is not allowed with sweep.objective=pareto: "
                              "Optuna's multi-objective studies cannot prune; add sweep.pruner=none")
        if self.needs_core:
            if any(o.startswith("eval.core=") and o != "eval.core=true" for o in overrides):
                raise ConfigError(f"eval.core={eval_core} is not allowed with sweep.objective={self.name}: "
                                  "every trial needs CORE; drop the override")
            if not (Path(core_bundle) / "core.yaml").is_file():
                raise ConfigError(f"sweep.objective={self.name} is not allowed with eval.core_bundle="
                                  f"{core_bundle!r}: it has no core.yaml, and every trial needs CORE "
                                  "(the offline bundle is ../shared/data/core)")

    @property
    def value_names(self) -> list[str]:
        return ["val_bpb", "core"] if self.name == "pareto" else [self.name]

    @property
    def needs_core(self) -> bool:
        return self.name in ("composite", "pareto")

    def trial_overrides(self, overrides: list[str]) -> list[str]:
        """What every trial must add to the command's overrides."""
        return ["eval.core=true"] if self.needs_core and "eval.core=true" not in overrides else []

    def describe(self) -> dict:
        described = {"name": self.name, "directions": self.directions}
        if self.name == "composite":
            described.update(val_bpb_anchors=list(self.bpb_anchors), core_anchors=list(self.core_anchors))
        return described

    def check_study(self, study: optuna.Study) -> None:
        """A study keeps the objective it started with: its values would not be comparable."""
        legacy = {"name": "val_bpb", "directions": ["minimize"]}  # a study from before sweep.objective
        ran_with = study.user_attrs.get("objective", legacy if study.trials else None)
        directions = [d.name.lower() for d in study.directions]
        if ran_with is None and directions != self.directions:  # created, but no trial yet
            ran_with = {"directions": directions}
        if ran_with is not None and ran_with != self.describe():
            raise ConfigError(f"sweep.objective={self.name} is not allowed for sweep.study_name="
                              f"{study.study_name!r}: its trials ran with {ran_with}; choose another "
                              "sweep.study_name")


def trial_values(objective: dict | None, summary: dict) -> tuple[list[float] | None, str]:
    """The values to tell the study for a run's summary (the study's `objective` user attribute
    says which; None: val_bpb), or None and why there are none."""
    name = (objective or {}).get("name", "val_bpb")
    bpb, core = summary.get("val_bpb"), summary.get("core")
    if not _finite(bpb):
        return None, "no finite val_bpb"
    if name == "val_bpb":
        return [float(bpb)], f"val_bpb {bpb:.4f}"
    if not _finite(core):
        return None, "no CORE in its summary (eval.core did not run)"
    if name == "pareto":
        return [float(bpb), float(core)], f"val_bpb {bpb:.4f}, core {core:.4f}"
    value = composite(bpb, core, objective["val_bpb_anchors"], objective["core_anchors"])
    return [value], f"composite {value:.4f} (val_bpb {bpb:.4f}, core {core:.4f})"


def counted_trials(study: optuna.Study, count_failed: bool) -> int:
    """Search trials that count toward sweep.n_trials: all of them, or all but the failed ones.
    Confirmation runs, a frontier's steps beyond its bracket, a ladder's climbs and re-runs of contended
    trials (_fairness.py) never count, nor a trial that failed because the sweep's folder could not be
    written (the study's `uncounted`): the same command, given space, runs it again."""
    uncounted = study.user_attrs.get("uncounted", {})
    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("confirm") is None  # searched
              and not t.user_attrs.get(FRONTIER_EXTENSION) and t.user_attrs.get("rerun_of") is None
              and t.user_attrs.get(RUNG) is None and str(t.number) not in uncounted]
    return len(trials) if count_failed else sum(t.state != TrialState.FAIL for t in trials)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
