"""`--multirun sweep=frontier`: a family of shapes x learning-rate scales x budgets, run end to end
on tiny shapes with a few steps each, as a user runs it."""
from __future__ import annotations

import math

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from frontier.sweep_report import write_report
from hydra_plugins.frontier_sweeper._frontier import DEVICE_DEPTHS, Family, next_after_grid
from hydra_plugins.frontier_sweeper._objective import counted_trials
from hydra_plugins.frontier_sweeper._workers import WAIT
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


@pytest.mark.slow
def test_a_frontier_sweep_steps_beyond_edge_scales_then_validates_its_optimum_with_new_seeds(tmp_path):
    """With two scales every shape's best is an end of its bracket: each trains one step beyond it, once;
    then sweep.validate's runs, none counted toward the grid's n_trials."""
    storage = str(tmp_path / "study.journal")
    done = run_sweep(tmp_path / "sweep", "sweep=frontier", "sweep.frontier.depths=[1,2,3]",
                     "sweep.frontier.lr_scales=[1.0,2.0]", "sweep.budgets=[3]", "sweep.validate=2",
                     f"sweep.storage={storage}", "sweep.study_name=frontier")
    study = load(storage, "frontier")
    trials = study.get_trials(deepcopy=False)
    grid = [t for t in trials if not t.user_attrs.get("lr_extension") and "validate" not in t.user_attrs]
    beyond = [t for t in trials if t.user_attrs.get("lr_extension")]
    validated = [t for t in trials if t.user_attrs.get("validate")]
    assert len(grid) == 6 and all(t.state == TrialState.COMPLETE for t in trials), done.stdout[-3000:]
    best = {d: min((t for t in grid if t.params["model.depth"] == d), key=lambda t: t.value).params["optim.lr_scale"]
            for d in (1, 2, 3)}
    assert sorted((t.params["model.depth"], t.params["optim.lr_scale"]) for t in beyond) == [
        (d, 4.0 if best[d] == 2.0 else 0.5) for d in (1, 2, 3)]
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "### Validation at 3 s" in report
    plan = study.user_attrs["validate_plan"]  # 3-s runs of tiny shapes are noisy: the fit may find no optimum
    if plan["predicted"] is None:
        assert not validated and f"the fit at 3 s has no optimum ({plan['problem']})" in report
    else:
        assert sorted((t.params["model.depth"], t.user_attrs["confirm_seed"]) for t in validated) == sorted(
            (c["params"]["model.depth"], seed) for c in plan["configs"] for seed in plan["seeds"])
        assert all(f"seed={t.user_attrs['confirm_seed']}" in t.user_attrs["overrides"] for t in validated)


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


# -----------------------------------------------------------------------------
# The trials after the grid (_frontier.next_after_grid), on an Optuna study as the grid leaves it

SCALES = [0.5, 1.0, 2.0]
BEST_SCALE = {1: 2.0, 2: 1.0, 3: 0.5, 4: 1.0, 6: 1.0}  # depth 1 tops out at the largest scale, 3 at the smallest


def after_grid_family():
    return Family(depths=[1, 2, 3, 4, 6], aspect_ratio=32, head_dim=32, lr_scales=SCALES, budgets=[60.0, 240.0],
                  device="cpu")


def shape_trial(family, depth, scale, seconds, state=TrialState.COMPLETE, **user_attrs):
    """val_bpb a parabola in ln(params) with its minimum at depth 3, worse by 0.05 per halving away from
    the shape's best scale (BEST_SCALE)."""
    params = {"model.depth": depth, "optim.lr_scale": scale, "budget.seconds": seconds}
    n = 12 * depth * family.shape(depth)["model.d_model"] ** 2 + 2 * 8192 * family.shape(depth)["model.d_model"]
    value = None if state != TrialState.COMPLETE else (
        0.3 * math.log(n / (12 * 3 * 96 ** 2 + 2 * 8192 * 96)) ** 2 + 1.5
        + 0.05 * abs(math.log2(scale / BEST_SCALE[depth])) + user_attrs.pop("noise", 0.0))
    return create_trial(state=state, params=params, distributions=family.space(), value=value,
                        user_attrs={"params": n, "tokens_seen": 1000, "tokens_per_second": 100.0, **user_attrs})


def grid_study(family, running=(), tilt=0.0):
    """The grid, run; `tilt` per unit of depth turns the parabola's minimum toward the deepest shape."""
    study = optuna.create_study(study_name="after-grid")
    study.set_user_attr("frontier", family.describe())
    for seconds in family.budgets:
        for depth in family.depths:
            for scale in family.lr_scales:
                state = TrialState.RUNNING if (depth, scale, seconds) in running else TrialState.COMPLETE
                extra = {"noise": -tilt * depth} if state == TrialState.COMPLETE else {}
                study.add_trial(shape_trial(family, depth, scale, seconds, state, **extra))
    return study


def run_after_grid(family, study, validate=0, outcome=None):
    """Asks next_after_grid until it has no more, running each trial it asks for as `outcome` says (a
    finished trial of its params by default): the trials it asked for, in order."""
    asked = []
    while (found := next_after_grid(family, study, validate, run_seed=0)) is not None:
        assert found is not WAIT and len(asked) < 50
        params, attrs = found
        asked.append((params, attrs))
        trial = (outcome or shape_trial)(family, params["model.depth"], params["optim.lr_scale"],
                                         params["budget.seconds"], **attrs)
        study.add_trial(trial)
    return asked


def test_a_shape_best_at_an_end_of_its_bracket_trains_one_step_beyond_it_once_per_budget():
    family = after_grid_family()
    assert family.beyond() == {0.5: 0.25, 2.0: 4.0}  # the bracket's own ratio, past each end
    assert family.grid()["optim.lr_scale"] == SCALES  # the grid trains the bracket only
    study = grid_study(family)
    asked = run_after_grid(family, study, outcome=lambda *a, **attrs: shape_trial(*a, noise=-1.0, **attrs))
    # each step beyond did best (noise -1): it is still asked only once per shape and budget
    assert [(p["model.depth"], p["optim.lr_scale"], p["budget.seconds"]) for p, _ in asked] == [
        (1, 4.0, 60.0), (3, 0.25, 60.0), (1, 4.0, 240.0), (3, 0.25, 240.0)]
    assert all(attrs == {"lr_extension": True} for _, attrs in asked)
    assert counted_trials(study, count_failed=True) == 5 * 3 * 2  # the grid alone counts toward n_trials


def test_the_trials_after_the_grid_wait_for_the_grid_and_none_follow_a_bracket_that_held():
    family = after_grid_family()
    assert next_after_grid(family, grid_study(family, running={(1, 2.0, 60.0)}), 0, 0) is WAIT
    inside = Family(depths=[2, 4, 6], aspect_ratio=32, head_dim=32, lr_scales=SCALES, budgets=[60.0], device="cpu")
    assert next_after_grid(inside, grid_study(inside), 0, 0) is None  # every best scale is inside the bracket
    single = Family(depths=[1, 3], aspect_ratio=32, head_dim=32, lr_scales=[1.0], budgets=[60.0], device="cpu")
    assert single.beyond() == {} and next_after_grid(single, grid_study(single), 0, 0) is None


def test_validation_trains_the_predicted_shape_and_its_neighbours_at_the_longest_budget_with_new_seeds():
    family = after_grid_family()
    study = grid_study(family)
    asked = run_after_grid(family, study, validate=2)
    validated = [(p, a) for p, a in asked if "validate" in a]
    assert len(asked) - len(validated) == 4  # the steps beyond come first
    # the optimum is depth 3, best at 0.5 (0.25 beyond it did worse); its neighbours 2 and 4 at 1.0
    runs = [(p["model.depth"], p["optim.lr_scale"], p["budget.seconds"], a["confirm_seed"]) for p, a in validated]
    assert sorted(runs) == [(2, 1.0, 240.0, 1), (2, 1.0, 240.0, 2), (3, 0.5, 240.0, 1), (3, 0.5, 240.0, 2),
                            (4, 1.0, 240.0, 1), (4, 1.0, 240.0, 2)]
    assert [seed for *_, seed in runs] == [1, 1, 1, 2, 2, 2]  # in blocks: each seed of every shape in turn
    assert {a["confirm"] for _, a in validated} == {"validate depth 2", "validate depth 3", "validate depth 4"}
    assert counted_trials(study, count_failed=True) == 5 * 3 * 2
    plan = study.user_attrs["validate_plan"]
    assert plan["predicted"] == "validate depth 3" and plan["seeds"] == [1, 2] and plan["seconds"] == 240.0


def seed_noise(shift=None):
    """A run's outcome: the curve plus 0.002 per seed (a spread to compare), and `shift` of one validated depth."""
    def outcome(family, depth, scale, seconds, **attrs):
        noise = 0.002 * attrs.get("confirm_seed", 0) + ((shift or {}).get(depth, 0.0) if "validate" in attrs else 0)
        return shape_trial(family, depth, scale, seconds, noise=noise, **attrs)
    return outcome


def test_a_neighbour_beating_the_predicted_shape_beyond_the_noise_says_the_optimum_did_not_hold(tmp_path):
    family = after_grid_family()
    study = grid_study(family)
    run_after_grid(family, study, validate=3, outcome=seed_noise(shift={4: -0.2}))
    report = write_report(study, tmp_path)
    assert report["frontier"]["validation_held"] is False
    assert "### Validation at 240 s" in report["text"]
    assert ("**The optimum did not hold**: depth 4 (p = " in report["text"]
            and "has a lower mean val_bpb than depth 3 beyond the seeds' noise (Welch's t-test, one-sided, "
                "p < 0.05); the optimum lies toward it." in report["text"])


def test_neighbours_no_better_than_the_predicted_shape_say_the_optimum_held(tmp_path):
    family = after_grid_family()
    study = grid_study(family)
    run_after_grid(family, study, validate=3, outcome=seed_noise())
    report = write_report(study, tmp_path)
    assert report["frontier"]["validation_held"] is True
    assert ("**The optimum held**: no neighbour's mean val_bpb is lower than depth 3's beyond the seeds' noise "
            "(Welch's t-test, one-sided, p < 0.05).") in report["text"]


def test_validation_still_running_gives_no_verdict_and_a_fit_without_optimum_validates_nothing(tmp_path):
    family = after_grid_family()
    study = grid_study(family)
    run_after_grid(family, study)  # the steps beyond, no validation yet
    assert next_after_grid(family, study, 2, 0) is not None  # plans it and asks its first run; none finished
    report = write_report(study, tmp_path / "running")
    assert report["frontier"]["validation_held"] is None and "**Unfinished**: the comparison needs 2" in report["text"]
    deepest = grid_study(family, tilt=1.0)  # val_bpb falls with every shape: the fit has no minimum
    run_after_grid(family, deepest, validate=2)
    assert deepest.user_attrs["validate_plan"]["configs"] == []
    text = write_report(deepest, tmp_path / "deepest")["text"]
    assert "sweep.validate trained nothing: the fit at 240 s has no optimum (" in text
