"""A sweep's verdict (frontier/verdict.py) and its blocked, sequential confirmation plan
(hydra_plugins/frontier_sweeper/_confirm.py), by calling their functions on synthetic runs."""
from __future__ import annotations

import numpy as np
import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from frontier.sweep_report import write_report
from frontier.verdict import ALPHA, BEATS, EQUIVALENT, KEEP_DEFAULTS, UNRESOLVED, judge
from hydra_plugins.frontier_sweeper._confirm import (BASELINE, MAX_FAILED, block_order, extended, make_plan, next_run,
                                                     verdict_of)

MARGIN = 0.002


def runs(mean: float, sd: float, n: int = 3) -> list[float]:
    """n val_bpb values whose mean and sample standard deviation are exactly `mean` and `sd`."""
    z = np.random.default_rng(n).standard_normal(n)
    return list(mean + sd * (z - z.mean()) / z.std(ddof=1))


# -- the verdict, the unwelcome outcomes first ------------------------------------------------------------


def test_defaults_better_by_four_standard_errors_is_keep_defaults_in_words():
    """The real sweep: baseline 1.9860 +- 0.0063, the search's best 2.0192 +- 0.0115 and its runner-up
    2.0237 +- 0.0070, 3 seeds each. Two standard errors of the old rule said "no winner beyond the noise"."""
    verdict = judge(runs(1.9860, 0.0063), {"trial 3": runs(2.0192, 0.0115), "trial 7": runs(2.0237, 0.0070)},
                    MARGIN, first_blocks=3, max_blocks=6)
    assert verdict.outcome == KEEP_DEFAULTS
    assert verdict.best.label == "trial 3" and verdict.best.difference == pytest.approx(0.0332)
    assert all(c.low > 0 for c in verdict.comparisons)
    assert verdict.text.startswith("keep the defaults: every configuration the search found is worse; the best, "
                                   "trial 3, is 0.0332 worse (95% interval +0.0")
    assert verdict.text.endswith("Bonferroni over 2 contenders and 4 looks)")
    assert "better" not in verdict.text and verdict.seeds_needed is None


def test_a_contender_too_few_runs_to_tell_keeps_keep_defaults_unresolved():
    """keep_defaults needs every contender shown worse: the best is, but one with a single run (its others
    failed) could still be better than the defaults."""
    verdict = judge(runs(1.9860, 0.0063), {"trial 3": runs(2.0192, 0.0115), "trial 7": [1.9910]}, MARGIN, 3, 6)
    assert verdict.best.label == "trial 7" and verdict.best.low < 0 < verdict.best.high
    assert verdict.outcome == UNRESOLVED


def test_unresolved_says_how_many_seeds_would_settle_it_and_that_many_do():
    base, best = runs(1.9860, 0.0063), runs(1.9820, 0.0063)
    verdict = judge(base, {"trial 3": best}, MARGIN, 3, 6)
    assert verdict.outcome == UNRESOLVED and verdict.best.low < 0 < verdict.best.high
    seeds = verdict.seeds_needed
    assert seeds > 6
    assert verdict.text.startswith("unresolved: the best, trial 3, is 0.0040 better than the defaults (95% interval -")
    assert f"about {seeds} seeds a configuration would settle it" in verdict.text
    assert verdict.text.endswith(f"run the same sweep command with sweep.confirm_max={seeds}")
    # the same means and noise with that many seeds, in a plan of that many blocks: settled; one fewer: not
    at = judge(runs(1.9860, 0.0063, seeds), {"trial 3": runs(1.9820, 0.0063, seeds)}, MARGIN, 3, seeds)
    below = judge(runs(1.9860, 0.0063, seeds - 1), {"trial 3": runs(1.9820, 0.0063, seeds - 1)}, MARGIN, 3, seeds - 1)
    assert at.outcome == BEATS and below.outcome == UNRESOLVED


def test_no_number_of_seeds_settles_equal_runs_without_a_margin():
    verdict = judge([2.0, 2.0, 2.0], {"trial 3": [2.0, 2.0, 2.0]}, 0.0, 3, 6)
    assert verdict.outcome == UNRESOLVED and verdict.seeds_needed is None
    assert verdict.text.endswith("no number of seeds would settle it")


def test_a_significant_gain_smaller_than_the_margin_is_no_difference_that_matters():
    """Equivalence comes before beats: a gain the interval shows smaller than sweep.equivalence is not
    worth a change of configuration, however significant."""
    base, best = runs(1.9860, 0.0002), runs(1.9850, 0.0002)
    verdict = judge(base, {"trial 3": best}, MARGIN, 3, 6)
    assert verdict.best.high < 0 and verdict.best.low > -MARGIN
    assert verdict.outcome == EQUIVALENT
    assert verdict.text.startswith("no difference that matters, keep the defaults: the best, trial 3, is 0.0010 "
                                   "better than the defaults, within sweep.equivalence=0.002 (95% interval -0.00")
    assert judge(base, {"trial 3": best}, 0.0, 3, 6).outcome == BEATS  # every difference counts at 0


def test_a_worse_contender_inside_the_margin_is_equivalent_too():
    verdict = judge(runs(1.9860, 0.0002), {"trial 3": runs(1.9865, 0.0003)}, MARGIN, 3, 6)
    assert verdict.outcome == EQUIVALENT and "0.0005 worse than the defaults" in verdict.text


def test_a_clear_gain_beats_the_defaults():
    verdict = judge(runs(1.9860, 0.0063), {"trial 3": runs(1.9500, 0.0060), "trial 5": runs(1.9700, 0.0070)},
                    MARGIN, 3, 6)
    assert verdict.outcome == BEATS and verdict.best.label == "trial 3" and verdict.best.high < -MARGIN
    assert verdict.text.startswith("use trial 3: it beats the defaults, 0.0360 better (95% interval -0.0")
    assert verdict.text.endswith("Bonferroni over 2 contenders and 4 looks)")


def test_more_contenders_and_looks_widen_the_interval():
    base, best = runs(1.9860, 0.0063), runs(1.9700, 0.0063)
    one = judge(base, {"trial 3": best}, MARGIN, 3, 3).best
    many = judge(base, {"trial 3": best, "trial 4": runs(1.99, 0.0063)}, MARGIN, 3, 6).best
    assert many.low < one.low < one.high < many.high


def test_no_verdict_until_the_runs_measure_noise():
    assert judge([1.98], {"trial 3": [1.97]}, MARGIN, 3, 6) is None
    assert judge([1.98, 1.99], {"trial 3": []}, MARGIN, 3, 6) is None
    assert judge([], {"trial 3": [1.97, 1.98]}, MARGIN, 3, 6) is None


def test_the_sequential_procedure_calls_a_false_winner_at_most_alpha_of_the_time():
    """No true difference: 2000 studies of a baseline and 2 contenders, 3 blocks then one more while
    unresolved, up to 6. Stopping at the first look that decides, "beats" comes out at most alpha of
    the time (no margin: the easiest to call); so does any wrong call. Without the correction (the
    better contender judged alone, each look at the full alpha) the same studies call far more."""
    rng = np.random.default_rng(7)
    studies, calls, uncorrected = 2000, {BEATS: 0, KEEP_DEFAULTS: 0}, 0
    for values in rng.normal(2.0, 0.01, size=(studies, 3, 6)):
        for blocks in range(3, 7):
            verdict = judge(values[0, :blocks], {"trial 1": values[1, :blocks], "trial 2": values[2, :blocks]},
                            0.0, 3, 6)
            if verdict.outcome != UNRESOLVED:
                calls[verdict.outcome] += 1
                break
        for blocks in range(3, 7):
            better = min(values[1, :blocks], values[2, :blocks], key=np.mean)
            verdict = judge(values[0, :blocks], {"trial": better}, 0.0, blocks, blocks)
            if verdict.outcome != UNRESOLVED:
                uncorrected += verdict.outcome == BEATS
                break
    assert calls[BEATS] / studies <= ALPHA
    assert (calls[BEATS] + calls[KEEP_DEFAULTS]) / studies <= ALPHA
    assert uncorrected / studies > ALPHA


# -- the block plan ---------------------------------------------------------------------------------------

SPACE = {"optim.matrix_lr": FloatDistribution(0.01, 0.1)}


def searched(values: list[float]) -> optuna.Study:
    """A study whose search ended: one complete trial per value."""
    study = optuna.create_study()
    for i, value in enumerate(values):
        lr = 0.01 * (i + 1)
        study.add_trial(create_trial(value=value, params={"optim.matrix_lr": lr}, distributions=SPACE,
                                     user_attrs={"overrides": ["model=tiny", f"optim.matrix_lr={lr}"]}))
    return study


def confirm(study: optuna.Study, plan: dict, value_of, stop_after: int | None = None, fail: set = frozenset()):
    """A driver confirming as the sweeper does: each next run of the plan trained (`value_of(label, seed)`,
    or FAIL for a (label, seed) in `fail`), a block more while the verdict is unresolved. Stops after
    `stop_after` runs (a kill); returns the plan and the (label, seed) it ran, in order."""
    ran = []
    while stop_after is None or len(ran) < stop_after:
        found = next_run(study, plan)
        if found is None:
            more = extended(plan, verdict_of(study, plan))
            if more is None:
                break
            study.set_user_attr("confirm_plan", more)
            plan = more
            continue
        config, seed = found
        key = (config["label"], seed)
        state = TrialState.FAIL if key in fail else TrialState.COMPLETE
        study.add_trial(create_trial(state=state, value=None if key in fail else value_of(*key),
                                     params=config["params"], distributions={k: SPACE[k] for k in config["params"]},
                                     user_attrs={"confirm": config["label"], "confirm_seed": seed,
                                                 "tokens_seen": 1_250_000, "overrides": ["model=tiny", f"seed={seed}"]}))
        ran.append(key)
    return plan, ran


def planned(study: optuna.Study, blocks: int = 3, max_blocks: int = 6) -> dict:
    plan = make_plan(study, top=2, blocks=blocks, max_blocks=max_blocks, run_seed=1337, order_seed=0,
                     equivalence=MARGIN)
    study.set_user_attr("confirm_plan", plan)
    return plan


DEVIATIONS = np.random.default_rng(0).standard_normal(64)


def noisy(means: dict[str, float], sd: float):
    """val_bpb of (label, seed): the configuration's mean and the seed's deviation, the same for every
    configuration (so the measured differences are the means')."""
    return lambda label, seed: means[label] + sd * DEVIATIONS[seed - 1338]


def test_each_block_runs_every_configuration_once_in_an_order_of_its_own():
    study = searched([2.02, 2.03, 2.05])
    plan = planned(study)
    _, ran = confirm(study, plan, noisy({BASELINE: 1.98, "trial 0": 2.02, "trial 1": 2.03}, 0.005))
    labels = [c["label"] for c in plan["configs"]]
    assert labels == [BASELINE, "trial 0", "trial 1"]
    blocks = [ran[i:i + 3] for i in range(0, len(ran), 3)]
    for block, (seed, order) in enumerate(zip(plan["seeds"], blocks)):
        assert [label for label, _ in order] == block_order(labels, 0, block)  # the same for every driver
        assert sorted(label for label, _ in order) == sorted(labels) and {s for _, s in order} == {seed}
    orders = [tuple(block_order(labels, 0, block)) for block in range(6)]
    assert len(set(orders)) > 1 and orders[0] != tuple(labels)  # shuffled, not the baseline first each time
    assert [tuple(block_order(labels, 1, block)) for block in range(6)] != orders  # sweep.seed's own


def test_confirmation_stops_as_soon_as_the_verdict_is_resolved():
    study = searched([2.02, 2.03, 2.05])
    plan, ran = confirm(study, planned(study), noisy({BASELINE: 1.98, "trial 0": 2.02, "trial 1": 2.03}, 0.003))
    assert plan["seeds"] == [1338, 1339, 1340] and len(ran) == 9
    assert verdict_of(study, plan).outcome == KEEP_DEFAULTS


def test_an_unresolved_verdict_adds_blocks_up_to_confirm_max_and_stops_there():
    study = searched([1.980, 1.981])
    plan, ran = confirm(study, planned(study, 3, 5), noisy({BASELINE: 1.98, "trial 0": 1.98, "trial 1": 1.981}, 0.01))
    assert plan["seeds"] == [1338, 1339, 1340, 1341, 1342] and study.user_attrs["confirm_plan"] == plan
    assert sorted(ran) == sorted({(label, seed) for label in (BASELINE, "trial 0", "trial 1")
                                  for seed in plan["seeds"]})  # each run once
    verdict = verdict_of(study, plan)
    assert verdict.outcome == UNRESOLVED and verdict.looks == 3 and verdict.seeds_needed > 5
    assert extended(plan, verdict) is None


def test_an_added_block_is_judged_with_the_rest():
    """Resolved only with more seeds: the plan grows block by block and stops at the first that decides."""
    study = searched([1.95, 1.99])
    means = {BASELINE: 1.98, "trial 0": 1.97, "trial 1": 1.99}
    plan, ran = confirm(study, planned(study, 3, 12), noisy(means, 0.01))
    blocks = len(plan["seeds"])
    assert 3 < blocks < 12 and verdict_of(study, plan).outcome != UNRESOLVED
    first = {**plan, "seeds": plan["seeds"][:-1]}  # the plan one block earlier, on its blocks' runs only
    assert verdict_of(study, first).outcome == UNRESOLVED


def test_a_killed_confirmation_run_again_runs_only_what_is_missing():
    study = searched([2.02, 2.03, 2.05])
    value = noisy({BASELINE: 1.98, "trial 0": 1.981, "trial 1": 1.982}, 0.01)
    plan, before = confirm(study, planned(study, 3, 4), value, stop_after=10)  # killed in block 4, once added
    assert len(before) == 10 and study.user_attrs["confirm_plan"]["seeds"] == [1338, 1339, 1340, 1341]
    plan, after = confirm(study, study.user_attrs["confirm_plan"], value)  # the next driver, from the study
    assert not set(before) & set(after) and len(before) + len(after) == 12


def test_a_run_that_fails_is_tried_again_once():
    study = searched([2.02, 2.03])
    plan = planned(study, 2, 2)
    failing = ("trial 0", 1338)
    _, ran = confirm(study, plan, noisy({BASELINE: 1.98, "trial 0": 2.02, "trial 1": 2.03}, 0.003), fail={failing})
    assert ran.count(failing) == MAX_FAILED and len(ran) == 6 + MAX_FAILED - 1
    assert next_run(study, plan) is None


# -- the report: its headline is the verdict ----------------------------------------------------------


def report_of(means: dict[str, float], sd: float, tmp_path) -> str:
    study = searched([means["trial 0"], means["trial 1"]])
    plan, _ = confirm(study, planned(study, 3, 4), noisy(means, sd))
    report = write_report(study, tmp_path)
    assert (tmp_path / "confirm.png").is_file() and report["confirmation"]["verdict"] is verdict_headline(report)
    return report["text"]


def verdict_headline(report: dict):
    """The verdict whose text the report's headline gives (the one it computed)."""
    verdict = report["confirmation"]["verdict"]
    assert f"**Verdict**: {verdict.text}" in report["text"].split("## ")[0]  # above the first section
    return verdict


def test_a_report_whose_defaults_win_offers_their_command_and_no_best_trial(tmp_path):
    text = report_of({BASELINE: 1.98, "trial 0": 2.02, "trial 1": 2.03}, 0.003, tmp_path)
    assert "**Verdict**: keep the defaults: every configuration the search found is worse" in text
    assert "**Best**" not in text and "```\npython -m frontier.train model=tiny\n```" in text
    assert "| trial 0 | 3 | 2.0206 | 0.0012 | +0.0400 (+0.03" in text and "(1.25M)" in text  # each run's tokens seen beside its val_bpb


def test_a_report_left_unresolved_says_how_to_go_on_and_offers_no_command(tmp_path):
    text = report_of({BASELINE: 1.98, "trial 0": 1.98, "trial 1": 1.981}, 0.01, tmp_path)
    assert "**Verdict**: unresolved: the best, trial 0" in text and "sweep.confirm_max=" in text
    assert "**Best**" not in text and "python -m frontier.train" not in text


def test_a_report_whose_search_wins_offers_the_winners_command(tmp_path):
    text = report_of({BASELINE: 1.98, "trial 0": 1.94, "trial 1": 1.96}, 0.003, tmp_path)
    assert "**Verdict**: use trial 0: it beats the defaults, 0.0400 better" in text
    assert "```\npython -m frontier.train model=tiny optim.matrix_lr=0.01\n```" in text
