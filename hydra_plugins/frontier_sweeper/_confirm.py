"""`sweep.confirm`: after the search, the best configurations and the baseline re-run with new seeds.

A search picks its best trial out of many, each trained once with one seed: on a small budget the
seed's noise can be larger than the differences it found. So once every search trial has ended, the
first driver to get there writes the study's plan (user attribute `confirm_plan`): the `confirm_top`
best distinct configurations and the baseline (the command's own configuration, no search-space
overrides), each to train `sweep.confirm` times with seeds it has not used. Each run is a trial of
the study tagged with user attributes `confirm` (its configuration's label) and `confirm_seed`;
it is never pruned and does not count toward `sweep.n_trials`. Any driver runs the runs still
missing, so a sweep killed part way confirms the rest when run again.
"""
from __future__ import annotations

from optuna import Study
from optuna.trial import FrozenTrial, TrialState

BASELINE = "baseline"
MAX_FAILED = 2  # a run that failed this often with one seed is not tried again


def is_confirmation(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("confirm") is not None


def seeds_per_configuration(confirm: int | None, n_trials: int | None) -> int:
    """sweep.confirm, where null means 3 seeds for a search of at least 8 trials and none below."""
    if confirm is not None:
        return confirm
    return 3 if (n_trials or 0) >= 8 else 0


def search_running(study: Study) -> bool:
    """Whether a search trial (of any driver) is still running: its value could change the ranking."""
    return any(not is_confirmation(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def make_plan(study: Study, top: int, seeds: int, run_seed: int) -> dict | None:
    """The configurations to confirm and their seeds (new ones: the search trained with `run_seed`),
    or None when no search trial finished."""
    ranked = sorted((t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                     if not is_confirmation(t)), key=lambda t: t.value)
    ranked = [t for t in ranked if str(t.number) not in study.user_attrs.get("contended", {})]  # slowed: re-run
    if not ranked:
        return None
    configs, seen = [{"label": BASELINE, "params": {}}], []
    for trial in ranked:
        if trial.params not in seen and len(seen) < top:
            seen.append(trial.params)
            configs.append({"label": f"trial {trial.number}", "params": trial.params, "value": trial.value})
    return {"configs": configs, "seeds": [run_seed + i for i in range(1, seeds + 1)]}


def next_run(study: Study, plan: dict) -> tuple[dict, int] | None:
    """The first (configuration, seed) of the plan with no run that finished, runs or waits, and fewer
    than MAX_FAILED failed ones; None when every run of the plan is done."""
    runs: dict[tuple[str, int], list[TrialState]] = {}
    for trial in study.get_trials(deepcopy=False):
        if is_confirmation(trial):
            runs.setdefault((trial.user_attrs["confirm"], trial.user_attrs.get("confirm_seed")), []).append(trial.state)
    for config in plan["configs"]:
        for seed in plan["seeds"]:
            states = runs.get((config["label"], seed), [])
            if states.count(TrialState.FAIL) < MAX_FAILED and all(state == TrialState.FAIL for state in states):
                return config, seed
    return None


def confirmation_running(study: Study) -> bool:
    return any(is_confirmation(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))
