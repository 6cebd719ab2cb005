"""`--multirun sweep=frontier`: a family of shapes x learning-rate scales x budgets, run end to end
on tiny shapes with a few steps each, as a user runs it."""
from __future__ import annotations

import optuna
from optuna.trial import TrialState

from hydra_plugins.frontier_sweeper._frontier import DEVICE_DEPTHS, Family
from tests.test_sweep import load, run_sweep


def test_a_frontier_sweep_trains_every_shape_at_every_budget_and_records_what_the_fit_needs(tmp_path):
    storage = str(tmp_path / "study.journal")
    done = run_sweep(tmp_path / "sweep", "sweep=frontier", "sweep.frontier.depths=[1,2,3]",
                     "sweep.frontier.lr_scales=[1.0]", "sweep.budgets=[4,5]", f"sweep.storage={storage}",
                     "sweep.study_name=frontier")
    study = load(storage, "frontier")
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6, done.stdout[-3000:]
    assert {(t.params["model.depth"], t.params["budget.seconds"]) for t in trials} == {
        (d, b) for d in (1, 2, 3) for b in (4.0, 5.0)}
    family = study.user_attrs["frontier"]
    assert family["budgets"] == [4.0, 5.0] and family["depths"] == [1, 2, 3]
    # model=tiny (d_model 128 over 4 layers, heads of 64): 32 per layer, rounded up to whole heads
    assert family["aspect_ratio"] == 32 and family["head_dim"] == 64
    assert family["shapes"]["3"] == {"model.depth": 3, "model.d_model": 128, "model.n_head": 2}
    for t in trials:  # the shape's width and heads are in what the trial ran, and the fit's inputs are recorded
        shape = family["shapes"][str(t.params["model.depth"])]
        assert f"model.d_model={shape['model.d_model']}" in t.user_attrs["overrides"]
        assert t.user_attrs["params"] > 0 and t.user_attrs["tokens_per_second"] > 0
    widths = {t.params["model.depth"]: t.user_attrs["params"] for t in trials}
    assert widths[1] < widths[3]
    # one validation set for the whole study, sized on the costliest point
    assert len({t.user_attrs["val_tokens"] for t in trials}) == 1


def test_the_family_rounds_width_to_whole_heads_and_is_sized_to_the_device():
    family = Family(depths=DEVICE_DEPTHS["cpu"], aspect_ratio=32, head_dim=64, lr_scales=[0.5, 1.0],
                    budgets=[60.0], device="cpu")
    widths = [family.shape(d)["model.d_model"] for d in family.depths]
    assert widths == [64, 128, 192, 256, 320, 384]  # distinct: each depth is its own size
    assert all(family.shape(d)["model.n_head"] * 64 == family.shape(d)["model.d_model"] for d in family.depths)
    assert family.derived({"model.depth": 5}) == ["model.d_model=192", "model.n_head=3"]
    assert family.costliest() == {"model.depth": 12, "optim.lr_scale": 0.5, "budget.seconds": 60.0}
    assert set(family.space()) == {"model.depth", "optim.lr_scale", "budget.seconds"}
    assert min(DEVICE_DEPTHS["accelerator"]) > min(DEVICE_DEPTHS["cpu"])
    assert isinstance(family.space()["model.depth"], optuna.distributions.CategoricalDistribution)
