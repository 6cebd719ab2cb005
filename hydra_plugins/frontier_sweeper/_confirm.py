"""`sweep.confirm`: after the search, the best configurations and the baseline re-run with new seeds.

A search picks its best trial out of many, each trained once with one seed: on a small budget the
seed's noise can be larger than the differences it found. So once every search trial has ended, the
first driver to get there writes the study's plan (user attribute `confirm_plan`): the `confirm_top`
best distinct configurations and the baseline (the command's own configuration, no search-space
overrides), to train in blocks. A block is one run of every configuration with the block's seed (one
the search has not used), in an order shuffled per block from sweep.seed and the block's index, so
that a machine slowing down or speeding up falls on every configuration alike. The plan starts with
`sweep.confirm` blocks; once they have all run, the verdict (frontier/verdict.py) is taken, and while
it is unresolved and the plan has fewer than `sweep.confirm_max` blocks, one more block is added to
the plan in the study, then judged in turn. Each run is a trial of the study tagged with user attributes
`confirm` (its configuration's label) and `confirm_seed`; it is never pruned and does not count toward
`sweep.n_trials`. Any driver runs the runs still missing, so a sweep killed part way confirms the rest
when run again, and nothing twice.
"""
from __future__ import annotations

import random

from optuna import Study
from optuna.trial import FrozenTrial, TrialState

from frontier.config import FRONTIER_BUDGET as BUDGET
from frontier.ladder import BASELINE as LADDER_BASELINE, RUNG
from frontier.verdict import UNRESOLVED, Verdict, judge

BASELINE = "baseline"
MAX_FAILED = 2  # a run that failed this often with one seed is not tried again


def is_confirmation(trial: FrozenTrial) -> bool:
    return trial.user_attrs.get("confirm") is not None


def seeds_per_configuration(confirm: int | None, n_trials: int | None) -> int:
    """sweep.confirm, where null means 3 seeds for a search of at least 8 trials and none below."""
    if confirm is not None:
        return confirm
    return 3 if (n_trials or 0) >= 8 else 0


def blocks_at_most(confirm_max: int | None, seeds: int) -> int:
    """sweep.confirm_max, where null means twice the blocks confirmation starts with."""
    return 2 * seeds if confirm_max is None else confirm_max


def search_running(study: Study) -> bool:
    """Whether a search trial (of any driver) is still running: its value could change the ranking."""
    return any(not is_confirmation(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def make_plan(study: Study, top: int, blocks: int, max_blocks: int, run_seed: int, order_seed: int | None,
              equivalence: float, top_rung: tuple[int, float] | None = None) -> dict | None:
    """The configurations to confirm, the seeds of their first `blocks` blocks (new ones: the search
    trained with `run_seed`) and what decides more blocks; None when no search trial finished. With a
    budget ladder, `top_rung` (its index, its budget): the top rung's configurations, confirmed at its budget."""
    searched = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if not is_confirmation(t)]
    baseline = {}
    if top_rung is not None:
        searched = [t for t in searched
                    if t.user_attrs.get(RUNG, 0) == top_rung[0] and not t.user_attrs.get(LADDER_BASELINE)]
        baseline = {BUDGET: top_rung[1]}
    ranked = sorted(searched, key=lambda t: t.value)
    ranked = [t for t in ranked if str(t.number) not in study.user_attrs.get("contended", {})]  # slowed: re-run
    if not ranked:
        return None
    configs, seen = [{"label": BASELINE, "params": baseline}], []
    for trial in ranked:
        if trial.params not in seen and len(seen) < top:
            seen.append(trial.params)
            configs.append({"label": f"trial {trial.number}", "params": trial.params, "value": trial.value,
                            "number": trial.number})
    return {"configs": configs, "seeds": [run_seed + i for i in range(1, blocks + 1)], "first_blocks": blocks,
            "max_blocks": max_blocks, "order_seed": order_seed or 0, "equivalence": equivalence}


def block_order(labels: list[str], order_seed: int, block: int) -> list[str]:
    """The order block `block` runs its configurations in: a shuffle of its own, the same for every driver."""
    order = list(labels)
    random.Random(f"{order_seed}:{block}").shuffle(order)
    return order


def next_run(study: Study, plan: dict) -> tuple[dict, int] | None:
    """The first (configuration, seed) of the plan, block by block, with no run that finished, runs or
    waits, and fewer than MAX_FAILED failed ones; None when every run of the plan is done."""
    runs: dict[tuple[str, int], list[TrialState]] = {}
    for trial in study.get_trials(deepcopy=False):
        if is_confirmation(trial):
            runs.setdefault((trial.user_attrs["confirm"], trial.user_attrs.get("confirm_seed")), []).append(trial.state)
    configs = {config["label"]: config for config in plan["configs"]}
    for block, seed in enumerate(plan["seeds"]):
        for label in block_order(list(configs), plan.get("order_seed", 0), block):
            states = runs.get((label, seed), [])
            if states.count(TrialState.FAIL) < MAX_FAILED and all(state == TrialState.FAIL for state in states):
                return configs[label], seed
    return None


def confirmation_running(study: Study) -> bool:
    return any(is_confirmation(t) for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def confirmed_runs(study: Study, plan: dict) -> dict[str, list[FrozenTrial]]:
    """Each configuration's finished runs of the plan, by block."""
    runs: dict[str, list[FrozenTrial]] = {config["label"]: [] for config in plan["configs"]}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if trial.user_attrs.get("confirm") in runs and trial.user_attrs.get("confirm_seed") in plan["seeds"]:
            runs[trial.user_attrs["confirm"]].append(trial)
    for trials in runs.values():
        trials.sort(key=lambda t: plan["seeds"].index(t.user_attrs["confirm_seed"]))
    return runs


def verdict_of(study: Study, plan: dict) -> Verdict | None:
    """The verdict on the plan's finished runs (None while they cannot measure a difference)."""
    values = {label: [t.value for t in trials] for label, trials in confirmed_runs(study, plan).items()}
    baseline = values.pop(BASELINE)
    first = plan.get("first_blocks", len(plan["seeds"]))  # a plan written before blocks: one look
    return judge(baseline, values, plan.get("equivalence", 0.0), first, plan.get("max_blocks", first))


def extended(plan: dict, verdict: Verdict | None) -> dict | None:
    """The plan with one more block, when its blocks have all run, the verdict is unresolved and the plan
    may grow; else None (confirmation is over)."""
    if verdict is None or verdict.outcome != UNRESOLVED or len(plan["seeds"]) >= plan.get("max_blocks", 0):
        return None
    return {**plan, "seeds": plan["seeds"] + [plan["seeds"][-1] + 1]}
