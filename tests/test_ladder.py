"""A budget ladder (`sweep.ladder`): what climbs from a rung to the next (asynchronous, exact shares, ties
broken by trial number, never a configuration twice at a rung, the baseline at every rung reached), the
report's rank correlations and learning-rate fit, and a ladder sweep run end to end as a user runs it."""
from __future__ import annotations

import math
import random
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from frontier.config import FRONTIER_BUDGET as BUDGET
from frontier.ladder import (BASELINE, PROMOTED_FROM, RUNG, best_per_rung, bootstrap_interval, lr_fit, spearman,
                             table)
from frontier.study import open_storage
from hydra_plugins.frontier_sweeper._ladder import next_climb
from tests.conftest import ROOT, SWEEP_TINY
from tests.test_sweep_time import start_until

LR = "optim.matrix_lr"
RUNGS = [30.0, 120.0, 480.0]
SPACE = {LR: FloatDistribution(1e-4, 1.0, log=True)}
CLIMB = {**SPACE, BUDGET: CategoricalDistribution(RUNGS)}

optuna.logging.set_verbosity(optuna.logging.WARNING)


def new_study() -> optuna.Study:
    return optuna.create_study(storage=optuna.storages.InMemoryStorage())


def propose(study: optuna.Study, lr: float, value: float | None) -> None:
    """A rung-0 proposal of the sampler, finished with `value` (None: still running)."""
    state = TrialState.RUNNING if value is None else TrialState.COMPLETE
    study.add_trial(create_trial(params={LR: lr}, distributions=SPACE, value=value, state=state))


def take(study: optuna.Study, state=TrialState.RUNNING, value: float | None = None) -> tuple[dict, dict] | None:
    """The ladder's next trial, added to the study as a driver would start it (in `state`)."""
    found = next_climb(study.get_trials(deepcopy=False), RUNGS, 1 / 3)
    if found is not None:
        params, attrs = found
        study.add_trial(create_trial(params=params, distributions={k: CLIMB[k] for k in params}, user_attrs=attrs,
                                     state=state, value=value if state == TrialState.COMPLETE else None))
    return found


def drain(study: optuna.Study) -> list[tuple[dict, dict]]:
    """Every trial the ladder wants now, each added as running."""
    taken = []
    while (found := take(study)) is not None:
        taken.append(found)
    return taken


def test_the_baseline_runs_first_then_nothing_climbs_before_a_share_allows_it():
    study = new_study()
    assert drain(study) == [({}, {RUNG: 0, BASELINE: True})]  # first, at the first rung
    propose(study, 0.01, 3.0)
    propose(study, 0.02, 2.0)
    assert drain(study) == []  # floor(2 / 3) = 0 may climb
    propose(study, 0.03, 9.0)  # floor(3 / 3) = 1: the best of the three
    assert drain(study) == [({LR: 0.02, BUDGET: 120.0}, {RUNG: 1, PROMOTED_FROM: 2}),
                            ({BUDGET: 120.0}, {RUNG: 1, BASELINE: True})]  # the baseline at the rung just reached


def test_promotions_are_exactly_the_top_share_in_order_with_ties_by_trial_number():
    study = new_study()
    values = [5.0, 1.0, 4.0, 1.0, 7.0, 2.0, 8.0, 6.0, 3.0]  # trials 0..8; 1 and 3 tie
    for i, value in enumerate(values):
        propose(study, 0.01 * (i + 1), value)
    climbs = [params for params, attrs in drain(study) if attrs.get(PROMOTED_FROM) is not None]
    # floor(9 / 3) = 3: trials 1 and 3 (the tie, by number), then trial 5 (2.0); never trial 8 (3.0)
    assert climbs == [{LR: 0.02, BUDGET: 120.0}, {LR: 0.04, BUDGET: 120.0}, {LR: 0.06, BUDGET: 120.0}]


def test_a_configuration_never_climbs_twice_to_one_rung_and_a_failed_climb_is_retried_once():
    study = new_study()
    take(study, TrialState.COMPLETE, 9.0)  # the baseline
    for lr, value in [(0.01, 1.0), (0.01, 1.5), (0.02, 2.0), (0.03, 3.0), (0.04, 4.0), (0.05, 5.0)]:
        propose(study, lr, value)  # 0.01 twice: one configuration, 5 distinct: floor(5/3) = 1 climbs
    assert take(study, TrialState.FAIL) == ({LR: 0.01, BUDGET: 120.0}, {RUNG: 1, PROMOTED_FROM: 1})
    assert take(study, TrialState.FAIL)[0] == {LR: 0.01, BUDGET: 120.0}  # failed once: tried again
    assert next_climb(study.get_trials(deepcopy=False), RUNGS, 1 / 3) == ({BUDGET: 120.0}, {RUNG: 1, BASELINE: True})
    propose(study, 0.06, 6.0)  # 6 distinct: a second one may climb, the next best, not 0.01 again
    assert [p for p, a in drain(study) if PROMOTED_FROM in a] == [{LR: 0.02, BUDGET: 120.0}]
    rung1 = [t.params[LR] for t in study.get_trials() if t.user_attrs.get(RUNG) == 1 and LR in t.params]
    assert rung1 == [0.01, 0.01, 0.02]


def test_a_contended_trial_is_not_ranked_its_re_run_is():
    study = new_study()
    take(study, TrialState.COMPLETE, 9.0)  # the baseline
    for lr, value in [(0.01, 1.0), (0.02, 2.0), (0.03, 3.0)]:
        propose(study, lr, value)
    slowed = {"1": {"speed": 1.0}}  # trial 1 (lr 0.01) was slowed by another program
    assert next_climb(study.get_trials(), RUNGS, 1 / 3, slowed) is None  # two ranked: floor(2 / 3) = 0
    study.add_trial(create_trial(params={LR: 0.01}, distributions=SPACE, value=2.5, user_attrs={"rerun_of": 1}))
    assert next_climb(study.get_trials(), RUNGS, 1 / 3, slowed) == ({LR: 0.02, BUDGET: 120.0},
                                                                   {RUNG: 1, PROMOTED_FROM: 2})  # 2.0 beats 2.5


def test_the_ladder_climbs_to_the_top_and_the_baseline_runs_once_at_every_rung():
    study = new_study()
    for i in range(9):
        propose(study, 0.01 * (i + 1), float(i))
    while (found := take(study, TrialState.COMPLETE, -1.0)) is not None:  # every climb finishes at once
        pass
    trials = study.get_trials()
    baselines = sorted(t.user_attrs[RUNG] for t in trials if t.user_attrs.get(BASELINE))
    assert baselines == [0, 1, 2]
    rungs = [(t.user_attrs.get(RUNG, 0), t.params.get(LR)) for t in trials if not t.user_attrs.get(BASELINE)]
    assert sorted(lr for rung, lr in rungs if rung == 1) == [0.01, 0.02, 0.03]
    assert [lr for rung, lr in rungs if rung == 2] == [0.01]  # floor(3 / 3) = 1 of rung 1 (ties: trial number)
    assert all(t.params.get(BUDGET, 30.0) == RUNGS[t.user_attrs.get(RUNG, 0)] for t in trials)


def test_spearman_and_its_interval_for_reversed_random_and_perfect_rankings():
    x = [float(i) for i in range(12)]
    assert spearman(x, x[::-1]) == pytest.approx(-1.0)
    assert bootstrap_interval(x, x[::-1]) == pytest.approx((-1.0, -1.0))
    rng = random.Random(1)
    y = [rng.random() for _ in range(40)]
    z = [rng.random() for _ in range(40)]
    low, high = bootstrap_interval(y, z)
    assert low < spearman(y, z) < high and low < 0 < high  # unrelated: the interval holds 0
    assert spearman(x, [v ** 3 for v in x]) == pytest.approx(1.0)  # any increasing map: the same ranking
    assert bootstrap_interval(x, [v ** 3 for v in x]) == pytest.approx((1.0, 1.0))
    assert spearman([1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(0.9486833)  # ties: mean ranks
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))
    assert bootstrap_interval([1.0, 2.0], [2.0, 1.0]) is None  # two configurations have no interval


def test_the_best_learning_rate_per_rung_and_its_power_law_extrapolated():
    study = new_study()
    for rung, seconds in enumerate(RUNGS):  # the best lr halves per 4x budget: lr = 0.08 (s/30)^-0.5
        for lr in (0.08 * (seconds / 30) ** -0.5, 0.3):
            best = lr != 0.3
            study.add_trial(create_trial(params={LR: lr, BUDGET: seconds}, distributions=CLIMB,
                                         value=1.0 if best else 2.0, user_attrs={RUNG: rung}))
    rows = table(study.get_trials(), len(RUNGS))
    best = best_per_rung(rows, RUNGS)
    assert [row["params"][LR] for row in best] == pytest.approx([0.08, 0.04, 0.02])
    fit = lr_fit(RUNGS, best, LR)
    assert fit["exponent"] == pytest.approx(-0.5)
    assert fit["at"]["phase 1"] == pytest.approx(0.08 * 60 ** -0.5)
    assert lr_fit(RUNGS[:2], best[:2], LR) is None  # two rungs: no fit


def test_a_ladder_sweep_climbs_confirms_at_the_top_rung_and_reports(wiki, tmp_path):
    """sweep=ladder at rungs of 2 and 4 s: 3 proposals, the best climbs, the baseline at both rungs, and the
    top rung's winner confirmed against the baseline at the top rung's budget; the report's ladder section."""
    storage = str(tmp_path / "study.journal")
    args = [*[o for o in SWEEP_TINY if not o.startswith("eval.core")], "sweep=ladder", "sweep.ladder=[2,4]",
            "sweep.n_trials=3", "sweep.n_jobs=1", "sweep.confirm=2", f"sweep.storage={storage}",
            "sweep.min_relative_speed=0.01",  # other tests share the machine: no re-runs
            "sweep.study_name=ladder", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", *args], cwd=ROOT, text=True,
                          timeout=900, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    trials = optuna.load_study(study_name="ladder", storage=open_storage(storage)).get_trials()
    assert all(t.state == TrialState.COMPLETE for t in trials)
    proposals = [t for t in trials if RUNG not in t.user_attrs and "confirm" not in t.user_attrs]
    climbs = [t for t in trials if PROMOTED_FROM in t.user_attrs]
    assert len(proposals) == 3 and len(climbs) == 1  # n_trials counts the proposals; floor(3 x 1/3) climbs
    best = min(proposals, key=lambda t: (t.value, t.number))
    assert climbs[0].user_attrs[PROMOTED_FROM] == best.number and climbs[0].params[LR] == best.params[LR]
    assert sorted(t.user_attrs[RUNG] for t in trials if t.user_attrs.get(BASELINE)) == [0, 1]
    budgets = {t.number: next(o for o in reversed(t.user_attrs["overrides"]) if o.startswith(f"{BUDGET}="))
               for t in trials}
    assert all(budgets[t.number] == f"{BUDGET}=2" for t in proposals)
    confirmed = [t for t in trials if "confirm" in t.user_attrs]
    assert len(confirmed) == 4 and all(budgets[t.number] == f"{BUDGET}=4.0" for t in confirmed)
    assert {t.user_attrs["confirm"] for t in confirmed} == {"baseline", f"trial {climbs[0].number}"}
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "## Budget ladder" in report and "| 2 s | 4 s | 2 |" in report  # both configurations at both rungs
    assert "**Verdict**: " in report and (tmp_path / "sweep" / "report" / "ladder.png").is_file()


def test_a_ladder_killed_between_rungs_completes_on_a_rerun_with_nothing_repeated_or_lost(wiki, tmp_path):
    """kill -9 of the driver while the first climb trains: the same command runs the climb again (its
    first run failed with its driver), proposes no more, and completes the ladder."""
    storage = str(tmp_path / "study.journal")
    args = [*[o for o in SWEEP_TINY if not o.startswith("eval.core")], "sweep=ladder", "sweep.ladder=[2,4]",
            "sweep.n_trials=3", "sweep.n_jobs=1", "sweep.confirm=0", f"sweep.storage={storage}",
            "sweep.min_relative_speed=0.01",  # other tests share the machine: no re-runs
            "sweep.study_name=ladder"]
    command = [sys.executable, "-m", "frontier.train", "--multirun", *args]
    driver, seen = start_until(command + [f"hydra.sweep.dir={tmp_path / 'a'}"], f"{BUDGET}=4.0")
    driver.kill()
    driver.wait(timeout=60)
    assert f"{BUDGET}=4.0" in seen[-1], "".join(seen)[-3000:]
    done = subprocess.run(command + [f"hydra.sweep.dir={tmp_path / 'b'}"], cwd=ROOT, text=True, timeout=900,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    trials = optuna.load_study(study_name="ladder", storage=open_storage(storage)).get_trials()
    finished = [(t.user_attrs.get(RUNG, 0), t.params.get(LR)) for t in trials if t.state == TrialState.COMPLETE]
    assert sorted(finished, key=str) == sorted(set(finished), key=str)  # nothing twice at a rung
    assert len([t for t in trials if RUNG not in t.user_attrs]) == 3  # no proposal repeated
    assert sorted(rung for rung, lr in finished if lr is None) == [0, 1]  # the baseline at both rungs
    climbs = [t for t in trials if PROMOTED_FROM in t.user_attrs]
    assert [t.state for t in climbs] == [TrialState.FAIL, TrialState.COMPLETE]  # killed, then run again
    assert climbs[0].params == climbs[1].params

