"""`--multirun sweep=frontier`: a family of shapes x learning-rate scales x budgets, run end to end
on tiny shapes with a few steps each, as a user runs it."""
from __future__ import annotations

import optuna
import pytest
from optuna.trial import TrialState

from hydra_plugins.frontier_sweeper._frontier import DEVICE_DEPTHS, Family
from tests.test_sweep import load, run_sweep


@pytest.mark.slow
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
    # model=tiny (d_model 128 over 4 layers): 32 per layer, in heads of 32 on a CPU
    assert family["aspect_ratio"] == 32 and family["head_dim"] == 32
    assert family["shapes"]["3"] == {"model.depth": 3, "model.d_model": 96, "model.n_head": 3}
    for t in trials:  # the shape's width and heads are in what the trial ran, and the fit's inputs are recorded
        shape = family["shapes"][str(t.params["model.depth"])]
        assert f"model.d_model={shape['model.d_model']}" in t.user_attrs["overrides"]
        assert t.user_attrs["params"] > 0 and t.user_attrs["tokens_per_second"] > 0
    widths = {t.params["model.depth"]: t.user_attrs["params"] for t in trials}
    assert widths[1] < widths[3]
    # one validation set for the whole study, sized on the costliest point
    assert len({t.user_attrs["val_tokens"] for t in trials}) == 1
    # the report fits each budget (or says why it cannot) and draws both pictures
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "## Frontier: the best shape for this device and budget" in report
    assert "### Budget 4 s" in report and "### Budget 5 s" in report
    assert (tmp_path / "sweep" / "report" / "frontier.png").is_file()
    assert (tmp_path / "sweep" / "report" / "speed.png").is_file()
    assert "frontier at 4 s: " in done.stdout and "frontier at 5 s: " in done.stdout


def test_the_family_rounds_width_to_whole_heads_and_is_sized_to_the_device():
    family = Family(depths=DEVICE_DEPTHS["cpu"], aspect_ratio=32, head_dim=32, lr_scales=[0.7, 1.4],
                    budgets=[60.0, 240.0], device="cpu")
    widths = [family.shape(d)["model.d_model"] for d in family.depths]
    assert widths == [32, 64, 96, 128, 192, 256]  # distinct: each depth is its own size
    assert all(family.shape(d)["model.n_head"] * 32 == family.shape(d)["model.d_model"] for d in family.depths)
    heads_of_64 = Family(depths=[2, 3, 5], aspect_ratio=32, head_dim=64, lr_scales=[1.0], budgets=[60.0], device="cpu")
    assert heads_of_64.derived({"model.depth": 3}) == ["model.d_model=128", "model.n_head=2"]  # 96, rounded up
    assert family.costliest() == {"model.depth": 8, "optim.lr_scale": 0.7, "budget.seconds": 60.0}
    assert set(family.space()) == {"model.depth", "optim.lr_scale", "budget.seconds"}
    assert min(DEVICE_DEPTHS["accelerator"]) > min(DEVICE_DEPTHS["cpu"])
    assert isinstance(family.space()["model.depth"], optuna.distributions.CategoricalDistribution)
