"""The compute-optimal shape of a frontier sweep (frontier/shapes.py): the fit recovers a known optimum,
refuses one outside the swept shapes, and the power law recovers a known exponent."""
from __future__ import annotations

import math

import numpy as np
import optuna
import pytest

from frontier import shapes

optuna.logging.set_verbosity(optuna.logging.WARNING)
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
    assert found.resamples > 0.9 * shapes.RESAMPLES  # of 8 points, a resample rarely has fewer than 3 distinct


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
