"""Contended trials: a trial that another program slowed down trained fewer steps in its charged budget
than its configuration would have, so its value is a verdict on the machine, not on its parameters.

A finished trial (complete or pruned: a pruned one was compared at equal charged time with fewer steps)
is contended when its tokens/s is below `sweep.min_relative_speed` of the median of its peers: the
study's other finished search trials of the same shape (`params`, the model's parameter count) on the
same kind of device (`device_kind`, recorded as the trial starts). Confirmation runs are neither judged
nor peers: they start once the search's judgements are made, and a later one must not undo the plan.
Fewer than MIN_PEERS peers make no judgement yet: each finished trial is judged again whenever the driver
looks for its next trial, so the first trials are judged once their peers have run. A contended trial is
recorded in the study's user attribute `contended` (Optuna takes no attributes on a finished trial) and
runs again, with the same parameters, once the search's trials are done: the re-run (user attribute
`rerun_of`) does not count toward `sweep.n_trials`, and the ranking and the confirmation use it instead
of the slowed run. A re-run that is itself contended is recorded, not run a third time.
"""
from __future__ import annotations

import logging
import statistics

import optuna
from optuna.trial import FrozenTrial, TrialState

from frontier.ladder import LADDER_ATTRS
from hydra_plugins.frontier_sweeper._confirm import search_running
from hydra_plugins.frontier_sweeper._workers import WAIT

log = logging.getLogger(__package__ + "._study")  # the sweep driver's lines under one name, whichever part logs

MIN_PEERS = 3  # fewer other trials of a shape give a median that one more slowed trial can drag down
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def speed_peers(trial: FrozenTrial, trials: list[FrozenTrial]) -> list[float]:
    """The tokens/s of the finished trials other than `trial` of its shape on its kind of device."""
    key = (trial.user_attrs.get("params"), trial.user_attrs.get("device_kind"))
    return [t.user_attrs["tokens_per_second"] for t in trials
            if t.number != trial.number and t.state in FINISHED and t.user_attrs.get("tokens_per_second")
            and (t.user_attrs.get("params"), t.user_attrs.get("device_kind")) == key]


def contention(trial: FrozenTrial, trials: list[FrozenTrial], min_relative_speed: float) -> dict | None:
    """{speed, median, peers, device_kind} when `trial` trained below `min_relative_speed` of its peers'
    median tokens/s; None when it did not, when it has no speed, shape or device kind, or has fewer
    than MIN_PEERS peers."""
    speed = trial.user_attrs.get("tokens_per_second")
    if trial.state not in FINISHED or not speed or None in (trial.user_attrs.get("params"),
                                                             trial.user_attrs.get("device_kind")):
        return None
    peers = speed_peers(trial, trials)
    if len(peers) < MIN_PEERS:
        return None
    median = statistics.median(peers)
    if speed >= min_relative_speed * median:
        return None
    return {"speed": speed, "median": median, "peers": len(peers), "device_kind": trial.user_attrs["device_kind"]}


def contended(study: optuna.Study) -> dict[str, dict]:
    """The study's contended trials so far, by trial number (a string: the study's attributes are JSON)."""
    return study.user_attrs.get("contended", {})


def newly_contended(study: optuna.Study, min_relative_speed: float) -> dict[str, dict]:
    """The search's finished trials that are contended and not yet recorded so."""
    searched = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("confirm") is None]
    known = contended(study)
    found = {}
    for trial in searched:
        if str(trial.number) in known:
            continue
        slowed = contention(trial, searched, min_relative_speed)
        if slowed is not None:
            found[str(trial.number)] = slowed
    return found


def describe(number: int | str, slowed: dict) -> str:
    return (f"trial {number} trained at {slowed['speed']:,.0f} tokens/s, {slowed['speed'] / slowed['median']:.0%} "
            f"of the median {slowed['median']:,.0f} of {slowed['peers']} trials of its shape on "
            f"{slowed['device_kind']}")


def next_rerun(study: optuna.Study) -> FrozenTrial | None:
    """The first contended search trial with no re-run yet (a re-run is not run again)."""
    trials = study.get_trials(deepcopy=False)
    rerun = {t.user_attrs.get("rerun_of") for t in trials}
    for number in sorted(map(int, contended(study))):
        trial = trials[number]
        if number not in rerun and trial.user_attrs.get("rerun_of") is None:
            return trial
    return None


class FairTrials:
    """The sweep driver's side: judges the finished trials whenever a worker looks for its next trial (the
    study lock held), and runs the re-runs once the search's trials are done."""

    def judge_speeds(self) -> None:
        found = newly_contended(self.study, self.sweep.min_relative_speed)
        if not found:
            return
        self.study.set_user_attr("contended", {**contended(self.study), **found})
        trials = self.study.get_trials(deepcopy=False)
        for number, slowed in found.items():
            trial = trials[int(number)]
            what = describe(number, slowed)
            again = ("it runs again once the search's trials are done" if trial.user_attrs.get("rerun_of") is None
                     else f"a re-run of trial {trial.user_attrs['rerun_of']}, not run again")
            log.warning(f"{what}: contended (below sweep.min_relative_speed={self.sweep.min_relative_speed:g}), "
                        f"so not ranked; {again}")
            self.tag_trial_run(trial, {"contended": what})

    def reruns_due(self) -> bool:
        """Whether a re-run may yet follow: a search trial still runs (it, or the trials it adds to the
        peers, may turn out contended), or a contended trial waits for its re-run."""
        return search_running(self.study) or next_rerun(self.study) is not None

    def next_rerun(self) -> optuna.Trial | None | object:
        """The next contended trial's re-run as a trial; WAIT while a search trial runs; None when none is due."""
        if search_running(self.study):
            return WAIT
        trial = next_rerun(self.study)
        if trial is None:
            return None
        rung = {key: value for key, value in trial.user_attrs.items() if key in LADDER_ATTRS}  # at its rung
        return self.enqueued(trial.params, {"rerun_of": trial.number, **rung})
