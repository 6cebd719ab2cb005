"""`sweep.ladder`: what climbs to the next rung of a budget ladder (frontier/ladder.py says why).

The sampler proposes at the first rung. Asynchronously, as ASHA does: a configuration climbs from a rung
when it is among the best `promote` share of the rung's finished configurations (by val_bpb, ties by the
trial number) and that share's count, floor(finished x promote), exceeds the configurations that climbed
from the rung so far. Unlike ASHA's, a climb trains again from scratch at the next budget (the schedules
are keyed to the budget, so a longer run is not a shorter one continued). The baseline (no search-space
point) trains at the first rung, and at every rung that a configuration has reached. A climb is a trial
tagged with user attributes `rung` and `promoted_from` (the baseline's: `rung` and `ladder_baseline`); it
does not count toward `sweep.n_trials`. All of it is read from the study's trials, so any driver, or a
driver run again after a kill, goes on where the study stands, never running a configuration twice at one
rung (a failed one is tried again, as a confirmation run is, up to MAX_FAILED times).
"""
from __future__ import annotations

import math

from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from frontier.config import FRONTIER_BUDGET as BUDGET, ConfigError
from frontier.ladder import BASELINE, PROMOTED_FROM, RUNG, configuration, rung_of
from hydra_plugins.frontier_sweeper._confirm import MAX_FAILED, is_confirmation


def ladder_space(space: dict, rungs: list[float] | None) -> tuple[list[str], dict]:
    """What a ladder adds to a sweep: the override that trains each proposal at the first rung, and the
    distribution a climb asks its budget from (nothing without a ladder)."""
    if rungs is None:
        return [], {}
    if BUDGET in space:
        raise ConfigError(f"{BUDGET} is not allowed in this search space: sweep.ladder sets it; drop it from "
                          "the params (or the command line)")
    return [f"{BUDGET}={rungs[0]:g}"], {BUDGET: CategoricalDistribution(list(rungs))}


def is_baseline(trial: FrozenTrial) -> bool:
    return bool(trial.user_attrs.get(BASELINE))


def taken(trials: list[FrozenTrial], rung: int) -> set[tuple]:
    """The configurations that have run, run or wait at `rung`, or failed there MAX_FAILED times."""
    failed: dict[tuple, int] = {}
    found = set()
    for trial in trials:
        if is_confirmation(trial) or rung_of(trial) != rung:
            continue
        key = configuration(trial.params) if not is_baseline(trial) else None
        if trial.state == TrialState.FAIL:
            failed[key] = failed.get(key, 0) + 1
            if failed[key] >= MAX_FAILED:
                found.add(key)
        else:
            found.add(key)
    return found


def promotion(trials: list[FrozenTrial], rung: int, promote: float, contended=()) -> FrozenTrial | None:
    """The finished trial of `rung` whose configuration climbs next, or None while none may (a contended
    trial, by number in `contended`, is not ranked: its re-run is, _fairness.py)."""
    best: dict[tuple, FrozenTrial] = {}
    for trial in trials:
        if (trial.state == TrialState.COMPLETE and rung_of(trial) == rung and not is_confirmation(trial)
                and not is_baseline(trial) and str(trial.number) not in contended):
            key = configuration(trial.params)
            if key not in best or (trial.value, trial.number) < (best[key].value, best[key].number):
                best[key] = trial
    ranked = sorted(best.values(), key=lambda t: (t.value, t.number))
    allowed = math.floor(len(ranked) * promote + 1e-9)  # 1e-9: 3 x 0.333... is one
    climbed = taken(trials, rung + 1) - {None}
    if allowed <= len(climbed):
        return None
    return next((t for t in ranked[:allowed] if configuration(t.params) not in climbed), None)


def next_climb(trials: list[FrozenTrial], rungs: list[float], promote: float,
               contended=()) -> tuple[dict, dict] | None:
    """The next trial the ladder needs, as (params, user attributes), or None: the highest promotion
    first, then a baseline missing at the first rung or at a rung some configuration reached."""
    for rung in reversed(range(1, len(rungs))):
        found = promotion(trials, rung - 1, promote, contended)
        if found is not None:
            return ({**dict(configuration(found.params)), BUDGET: rungs[rung]},
                    {RUNG: rung, PROMOTED_FROM: found.number})
    for rung in range(len(rungs)):
        reached = rung == 0 or any(rung_of(t) == rung and not is_confirmation(t) for t in trials)
        if reached and None not in taken(trials, rung):
            return ({BUDGET: rungs[rung]} if rung else {}), {RUNG: rung, BASELINE: True}
    return None
