"""The compute-optimal shape of a frontier sweep (frontier/shapes.py): the fit recovers a known optimum,
refuses one outside the swept shapes, the power law recovers a known exponent, and the sweep report
carries the section, its command and its plots (an unfinished sweep says what is missing)."""
from __future__ import annotations

import math

import numpy as np
import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from frontier import shapes
from frontier.sweep_report import write_report

optuna.logging.set_verbosity(optuna.logging.WARNING)
DEPTHS, LR_SCALES = [2, 4, 6, 8, 10, 12], [0.5, 1.0]
TRIED_SCALES = [0.25, 0.5, 1.0, 2.0]  # the bracket and the step beyond each end (the study's distribution)
BASE = ["model=tiny", "eval.final_tokens=65536"]  # settings of every trial the command must keep


def parabola(params, optimum, curvature=0.3, floor=1.5, noise=0.0, seed=0):
    """val_bpb = curvature (ln N - ln N*)^2 + floor, plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    return [curvature * math.log(n / optimum) ** 2 + floor + noise * rng.standard_normal() for n in params]


def points(params, bpb):
    return [shapes.Point(depth=i, lr_scale=1.0, params=int(n), val_bpb=y, tokens_seen=0, tokens_per_second=0.0)
            for i, (n, y) in enumerate(zip(params, bpb))]


def test_the_fit_recovers_a_known_optimum_within_its_bootstrap_interval():
    params = np.geomspace(1e5, 1e7, 8)
    found = shapes.fit(points(params, parabola(params, 1e6, noise=0.01)))
    assert found.problem is None
    assert found.optimum == pytest.approx(1e6, rel=0.15)
    assert found.interval[0] <= 1e6 <= found.interval[1]
    assert found.val_bpb == pytest.approx(1.5, abs=0.02)
    assert found.val_bpb_interval[0] < found.val_bpb_interval[1]
    assert found.outside < 0.01 and found.interval_problem is None  # a clear minimum, well inside the shapes


SWEPT = np.geomspace(537e3, 11e6, 6)  # six shapes over the span of a CPU's depths 1 to 8


@pytest.mark.parametrize("curvature, noise", [(0.1, 0.01), (0.03, 0.02)])  # a clear minimum; a flat, noisy one
def test_the_nominal_95_percent_interval_covers_the_true_optimum_and_its_val_bpb_95_percent_of_the_time(
        curvature, noise):
    """2000 synthetic sweeps of a known parabola plus seed noise: the share whose interval holds the truth is
    0.95 within +-2% (3 standard errors), neither too narrow nor padded. Sweeps whose interval leaves the
    shapes count with that interval, as the report would have drawn it had it been bracketed."""
    rng = np.random.default_rng(0)
    x, optimum = np.log(SWEPT), math.log(2e6)
    y = curvature * (x - optimum) ** 2 + 1.5 + noise * rng.standard_normal((2000, len(x)))
    best_x, best_y = shapes.resampled_vertices(x, y, shapes.RESAMPLES, rng)
    (low, high), (low_y, high_y) = shapes.percentiles(best_x), shapes.percentiles(best_y)
    assert 0.93 <= np.mean((low <= optimum) & (optimum <= high)) <= 0.97
    assert 0.93 <= np.mean((low_y <= 1.5) & (1.5 <= high_y)) <= 0.97


def test_an_interval_that_leaves_the_swept_shapes_is_not_given_and_says_which_way_to_extend(tmp_path):
    found = shapes.fit(points(SWEPT, parabola(SWEPT, 6e5, curvature=0.05, noise=0.02, seed=1)))
    assert found.optimum == pytest.approx(7.0e5, rel=0.05)  # the fit itself has a minimum among the shapes
    assert found.interval is None and found.val_bpb_interval is None
    assert found.interval_problem == ("not bracketed: the 95% interval reaches below the smallest shape (depth 0, "
                                      "537k params); extend the family toward smaller shapes "
                                      "(sweep.frontier.depths below 0)")
    swept = points(SWEPT, parabola(SWEPT, 6e5, curvature=0.05, noise=0.02, seed=1))
    budget = shapes.BudgetFit(60.0, [], swept, found, None, nearest=swept[0], command="python -m frontier.train")
    line = shapes.optimum_lines(budget)[0]
    assert line.startswith(f"**Optimum: 702k params** ({found.interval_problem}), predicted val_bpb")
    assert f"In {found.outside:.0%} of 1000 resamples the curve has no minimum inside the swept range." in line
    larger = shapes.fit(points(SWEPT, parabola(SWEPT, 8e6, curvature=0.05, noise=0.02, seed=3)))
    assert larger.interval is None and "above the largest shape (depth 5, 11M params)" in larger.interval_problem
    assert "toward larger shapes (sweep.frontier.depths above 5)" in larger.interval_problem


def test_the_share_of_resamples_without_a_minimum_among_the_shapes_is_reported_not_dropped():
    flat = shapes.fit(points(SWEPT, parabola(SWEPT, 6e5, curvature=0.05, noise=0.02, seed=1)))
    assert 0.1 < flat.outside < 0.3  # a minimum near the smallest shape: many resamples put it beyond
    curved = shapes.fit(points(SWEPT, parabola(SWEPT, 2e6, curvature=0.3, noise=0.01)))
    assert curved.outside == 0.0
    # a curve that opens downward in a resample is counted there, not skipped: the share equals the count
    x, y = np.log(SWEPT), np.array(parabola(SWEPT, 6e5, curvature=0.05, noise=0.02, seed=1))
    best_x, best_y = shapes.resampled_vertices(x, y, shapes.RESAMPLES, np.random.default_rng(0))
    assert best_x.shape == (shapes.RESAMPLES,) and np.isinf(best_y).sum() == np.isinf(best_x).sum() > 0
    assert flat.outside == np.mean((best_x < x.min()) | (best_x > x.max()))


def test_three_shapes_give_an_optimum_without_an_interval():
    found = shapes.fit(points(SWEPT[::2], parabola(SWEPT[::2], 2e6, noise=0.01)))
    assert found.optimum is not None and found.interval is None and found.outside is None
    assert found.interval_problem.startswith("no interval: with 3 shapes the parabola runs through each")


@pytest.mark.parametrize("optimum, curvature, words", [
    (1e9, 0.3, ["the optimum lies beyond the largest shape", "extend sweep.frontier.depths to deeper shapes"]),
    (1e3, 0.3, ["the optimum lies beyond the smallest shape", "extend sweep.frontier.depths to shallower shapes"]),
    (3e6, -0.3, ["does not curve upward", "lowest at the smallest shape", "to shallower shapes"]),
])
def test_an_optimum_outside_the_swept_shapes_is_refused_and_says_which_way_to_extend(optimum, curvature, words):
    params = np.geomspace(1e5, 1e7, 6)
    found = shapes.fit(points(params, parabola(params, optimum, curvature=curvature)))
    assert found.optimum is None and found.interval is None and found.coefficients is not None
    for word in words:
        assert word in found.problem


def test_fewer_than_three_shapes_give_no_fit():
    found = shapes.fit(points([1e5, 1e6], [1.7, 1.6]))
    assert found.optimum is None and found.coefficients is None
    assert found.problem == "the fit needs 3 shapes, 2 finished"


def test_the_power_law_recovers_a_known_exponent():
    budgets = [60.0, 240.0, 960.0]
    exponent, prefactor = shapes.power_law(budgets, [2e4 * t ** 0.55 for t in budgets])
    assert exponent == pytest.approx(0.55) and prefactor == pytest.approx(2e4)


def test_the_command_keeps_the_trials_settings_and_sets_the_shape_its_scale_and_the_budget():
    point = shapes.Point(depth=6, lr_scale=0.5, params=1, val_bpb=1.0, tokens_seen=1, tokens_per_second=1.0,
                         overrides=(*BASE, "model.depth=2", "+model.d_model=64", "model.n_head=1",
                                    "optim.lr_scale=1.0", "budget.seconds=60.0"))
    shape = {"model.depth": 6, "model.d_model": 192, "model.n_head": 3}
    assert shapes.overrides_for(point, shape, 240.0) == [*BASE, "model.depth=6", "model.d_model=192",
                                                         "model.n_head=3", "optim.lr_scale=0.5",
                                                         "budget.seconds=240.0"]


# -----------------------------------------------------------------------------
# Through the sweep report, on an Optuna study as a frontier sweep leaves it


def shape_of(depth):
    d_model = math.ceil(depth * 32 / 64) * 64
    return {"model.depth": depth, "model.d_model": d_model, "model.n_head": d_model // 64}


def params_of(depth):
    d_model = shape_of(depth)["model.d_model"]
    return 12 * depth * d_model ** 2 + 2 * 8192 * d_model  # blocks and both embeddings


def optimum_at(seconds):
    return 3e6 * (seconds / 60) ** 0.5  # N_opt ∝ T^0.5


def grid_trial(depth, lr_scale, seconds, state=TrialState.COMPLETE):
    """One trial of the grid: deep shapes prefer the smaller scale; the device slows with size."""
    params = {"model.depth": depth, "optim.lr_scale": lr_scale, "budget.seconds": seconds}
    distributions = {"model.depth": CategoricalDistribution(DEPTHS),
                     "optim.lr_scale": CategoricalDistribution(TRIED_SCALES),
                     "budget.seconds": CategoricalDistribution([60.0, 240.0])}
    if state != TrialState.COMPLETE:
        return create_trial(state=state, params=params, distributions=distributions)
    n = params_of(depth)
    speed = 1e5 * (n / 1e6) ** -0.8
    noise = parabola([n], optimum_at(seconds), noise=0.005, seed=depth * 1000 + int(lr_scale * 10 + seconds))[0]
    bpb = noise + 0.05 * abs(math.log2(lr_scale / (1.0 if depth < 6 else 0.5)))
    overrides = [*BASE, *(f"{k}={v}" for k, v in shape_of(depth).items()), f"optim.lr_scale={lr_scale}",
                 f"budget.seconds={seconds}"]
    return create_trial(params=params, distributions=distributions, value=bpb,
                        user_attrs={"params": n, "tokens_seen": int(speed * seconds), "tokens_per_second": speed,
                                    "charged_seconds": seconds, "overrides": overrides})


def frontier_study(trials):
    study = optuna.create_study(study_name="shapes")
    study.set_user_attr("frontier", {"budgets": [60.0, 240.0], "depths": DEPTHS, "lr_scales": LR_SCALES,
                                     "aspect_ratio": 32, "head_dim": 64, "device": "cpu",
                                     "shapes": {str(d): shape_of(d) for d in DEPTHS}})
    for trial in trials:
        study.add_trial(trial)
    return study


def test_the_report_of_a_frontier_sweep_gives_the_optimum_its_command_and_plots(tmp_path):
    grid = [grid_trial(d, s, t) for t in (60.0, 240.0) for d in DEPTHS for s in LR_SCALES]
    beyond = [grid_trial(d, 2.0 if d < 6 else 0.25, t) for t in (60.0, 240.0) for d in DEPTHS]  # each shape's edge
    report = write_report(frontier_study(grid + beyond), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert shapes.TITLE in text and text.index(shapes.TITLE) < text.index("## Where the time went")
    assert "Unfinished" not in text and "No optimum" not in text
    for seconds in (60.0, 240.0):
        found = report["frontier"]["budgets"][seconds]
        assert found["optimum_params"] == pytest.approx(optimum_at(seconds), rel=0.05)
        assert found["interval"][0] <= found["optimum_params"] <= found["interval"][1]
        assert found["val_bpb"] == pytest.approx(1.5, abs=0.01)
        assert found["outside"] == 0.0 and found["interval_problem"] is None
    assert "In 0% of 1000 resamples the curve has no minimum inside the swept range." in text
    # 6.0M params at 240 s: depth 6 (5.8M) is the nearest shape, best at the smaller scale.
    command = ("python -m frontier.train model=tiny eval.final_tokens=65536 model.depth=6 model.d_model=192 "
               "model.n_head=3 optim.lr_scale=0.5 budget.seconds=240.0")
    assert report["frontier"]["budgets"][240.0]["command"] == command and f"\n{command}\n" in text
    assert report["frontier"]["scaling"]["params_exponent"] == pytest.approx(0.5, abs=0.05)
    assert report["frontier"]["scaling"]["tokens_exponent"] == pytest.approx(1 - 0.8 * 0.5, abs=0.05)
    assert "**Extrapolated** to the competition's budgets" in text and "| phase 2 (14400 s) |" in text
    for name in ("frontier.png", "speed.png"):
        assert tmp_path / name in report["files"] and (tmp_path / name).stat().st_size > 0
    assert "**Note**" not in text  # each shape's best scale lies inside the scales it trained


def test_shapes_best_at_an_end_of_the_scales_they_trained_are_named_with_the_way_to_extend(tmp_path):
    trials = [grid_trial(d, s, 60.0) for d in DEPTHS for s in LR_SCALES if d < 6 or s == 1.0]  # best at 1.0
    trials += [grid_trial(10, 0.5, 60.0), grid_trial(12, 0.5, 60.0), grid_trial(12, 0.25, 60.0)]  # both best at 0.5,
    # an end of what 10 trained, inside what 12 trained
    text = write_report(frontier_study(trials), tmp_path)["text"]
    assert ("**Note**: depth 2, 4 did best at the largest optim.lr_scale trained: the best rate may lie beyond it; "
            "add a larger scale to sweep.frontier.lr_scales; depth 10 did best at the smallest optim.lr_scale "
            "trained: the best rate may lie beyond it; add a smaller scale to sweep.frontier.lr_scales.") in text


def test_the_report_of_an_unfinished_frontier_sweep_says_what_is_missing(tmp_path):
    trials = [grid_trial(d, s, 60.0) for d in DEPTHS for s in LR_SCALES]
    trials += [grid_trial(d, 1.0, 240.0) for d in (2, 4)] + [grid_trial(6, 1.0, 240.0, TrialState.RUNNING)]
    report = write_report(frontier_study(trials), tmp_path)
    text = report["text"]
    assert ("**Unfinished** budget 240 s: 2 of 6 shapes finished (depths 2, 4); 1 trial(s) running; "
            "9 of 12 grid points (depth x lr_scale) not started; the fit needs 3.") in text
    assert "budget 60 s:" not in text  # that budget is complete
    assert report["frontier"]["budgets"][240.0]["optimum_params"] is None
    assert report["frontier"]["budgets"][60.0]["optimum_params"] == pytest.approx(optimum_at(60.0), rel=0.05)
    assert report["frontier"]["scaling"] is None
    assert "the scaling needs an optimum at two budgets or more (1 so far)" in text


def test_a_study_that_is_not_a_frontier_sweep_has_no_frontier_section(tmp_path):
    study = optuna.create_study(study_name="plain")
    study.add_trial(create_trial(value=1.0, params={"x": 1.0},
                                 distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))
    report = write_report(study, tmp_path)
    assert shapes.TITLE not in report["text"] and report["frontier"] is None
    assert not (tmp_path / "frontier.png").exists()
