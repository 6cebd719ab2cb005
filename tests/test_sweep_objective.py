"""What a sweep optimises: sweep.objective=val_bpb|composite|pareto, sweep.count_failed, and the
report's plots (checkpoints where they were measured, the pareto front)."""
from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import sys

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from optuna.trial import TrialState, create_trial

from frontier.config import ConfigError
from frontier.leaderboard import phase2_scores
from frontier.study import open_storage, outcome
from frontier import sweep_report
from frontier.sweep_report import curve, write_report
from hydra_plugins.frontier_sweeper._objective import composite, counted_trials, trial_values

from tests.conftest import ROOT, SWEEP_TINY as TINY
ANCHORS = {"name": "composite", "directions": ["minimize"], "val_bpb_anchors": [1.5, 0.8],
           "core_anchors": [0.0, 0.25]}

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture()
def make_sweep(tmp_path):
    """A Sweep from composed config, as the sweeper builds it (every check up front)."""
    from hydra_plugins.frontier_sweeper._study import Sweep

    built = itertools.count()  # each Sweep a folder of its own: it claims it for its study

    def build(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*TINY, f"sweep.storage={tmp_path / 'study.journal'}",
                                               f"hydra.sweep.dir={tmp_path / 'sweep' / str(next(built))}", *overrides],
                          return_hydra_config=True)
            return Sweep(cfg, list(overrides), GlobalHydra.instance().config_loader())

    yield build
    GlobalHydra.instance().clear()


# -----------------------------------------------------------------------------
# The objective's values


def test_composite_is_the_phase2_score_as_a_loss_against_fixed_anchors():
    assert composite(0.8, 0.25, [1.5, 0.8], [0.0, 0.25]) == pytest.approx(0.0)  # both at the best anchor
    assert composite(1.5, 0.0, [1.5, 0.8], [0.0, 0.25]) == pytest.approx(1.0)  # both at the worst
    # With the pool's min and max as anchors it ranks as the leaderboard's phase-2 score (reversed).
    rows = [{"val_bpb": 0.9, "core": 0.10}, {"val_bpb": 1.1, "core": 0.20}, {"val_bpb": 1.0, "core": 0.12}]
    scores = phase2_scores(rows)
    losses = [composite(r["val_bpb"], r["core"], [1.1, 0.9], [0.10, 0.20]) for r in rows]
    assert losses == pytest.approx([1 - s for s in scores])
    # A trial's value depends on its own run and the anchors only, never on other trials.
    assert composite(1.0, 0.12, [1.5, 0.8], [0.0, 0.25]) == pytest.approx(1 - (0.5 * 0.5 / 0.7 + 0.5 * 0.12 / 0.25))


def test_each_objective_takes_its_values_from_the_summary():
    summary = {"status": "FINISHED", "val_bpb": 1.0, "core": 0.12}
    assert trial_values(None, summary)[0] == [1.0]
    assert trial_values({"name": "pareto"}, summary)[0] == [1.0, 0.12]
    assert trial_values(ANCHORS, summary)[0] == [pytest.approx(composite(1.0, 0.12, [1.5, 0.8], [0.0, 0.25]))]
    values, why = trial_values(ANCHORS, {"status": "FINISHED", "val_bpb": 1.0})
    assert values is None and "no CORE" in why
    assert trial_values(None, {"val_bpb": float("nan")})[0] is None


def test_a_run_scored_on_another_validation_set_fails_unranked():
    summary = {"status": "FINISHED", "val_bpb": 1.0, "val_bpb_se": 0.01, "val_fingerprint": "aaaa", "val_documents": 9}
    state, value, attrs = outcome(summary, "unused", None, "aaaa")
    assert (state, value) == (TrialState.COMPLETE, 1.0)
    assert attrs["val_bpb_se"] == 0.01 and attrs["val_fingerprint"] == "aaaa" and attrs["val_documents"] == 9
    state, value, attrs = outcome(summary, "unused", ANCHORS | {"name": "val_bpb"}, "bbbb")
    assert (state, value) == (TrialState.FAIL, None)
    assert attrs["fail_reason"].startswith("scored on another validation set (val_fingerprint aaaa, the study's is "
                                           "bbbb: another model.seq_len, tokenizer, data or eval.final_tokens)")
    assert outcome({**summary, "core": 0.1}, "", {"name": "pareto"}, "bbbb")[0] == TrialState.FAIL
    no_print = {k: v for k, v in summary.items() if k != "val_fingerprint"}
    assert outcome(no_print, "", None, "aaaa")[0] == TrialState.FAIL  # a run that cannot say what it was scored on
    assert outcome(summary, "", None, None)[0] == TrialState.COMPLETE  # a study from before fingerprints
    pruned = {**summary, "status": "PRUNED", "error": "pruned at checkpoint 1"}
    assert outcome(pruned, "", None, "bbbb")[0] == TrialState.PRUNED  # no value to rank either way


@pytest.mark.parametrize("overrides, message", [
    (["sweep.objective=pareto"], "sweep.pruner='hyperband' is not allowed with sweep.objective=pareto: "
                                 "Optuna's multi-objective studies cannot prune; add sweep.pruner=none"),
    (["sweep.objective=best"], "sweep.objective='best' is not allowed: choose one of val_bpb, composite, pareto"),
    (["sweep.objective=composite", "eval.core=false"], "eval.core=False is not allowed with sweep.objective=composite"),
    (["sweep.objective=composite", "eval.core_bundle=/nowhere"], "it has no core.yaml"),
    (["sweep.objective=composite", "sweep.composite_core=[0.1,0.1]"], "sweep.composite_core=[0.1, 0.1] is not allowed"),
])
def test_bad_objective_input_is_one_clear_error(make_sweep, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_sweep("sweep=lr", *overrides)


def test_a_study_keeps_its_objective(make_sweep):
    make_sweep("sweep=lr", "sweep.study_name=keep").study.add_trial(create_trial(value=1.0))
    with pytest.raises(ConfigError, match="sweep.objective=composite is not allowed for sweep.study_name='keep'"):
        make_sweep("sweep=lr", "sweep.study_name=keep", "sweep.objective=composite")


def test_composite_and_pareto_trials_compute_core(make_sweep):
    sweep = make_sweep("sweep=lr", "sweep.objective=pareto", "sweep.pruner=none")
    assert "eval.core=true" in sweep.fixed
    assert sweep.study.directions == [optuna.study.StudyDirection.MINIMIZE, optuna.study.StudyDirection.MAXIMIZE]


def test_failed_trials_need_not_count_toward_n_trials(make_sweep):
    sweep = make_sweep("sweep=lr", "sweep.n_trials=2", "sweep.count_failed=false")
    for state in (TrialState.FAIL, TrialState.FAIL, TrialState.COMPLETE):
        sweep.study.add_trial(create_trial(state=state, value=1.0 if state == TrialState.COMPLETE else None))
    assert counted_trials(sweep.study, count_failed=False) == 1 and counted_trials(sweep.study, True) == 3
    assert sweep.limit_reached() == ""  # one counted trial of two
    sweep.failures = 11  # ... but sweep.max_failures still stops it
    assert "sweep.max_failures=10" in sweep.limit_reached()
    counting = make_sweep("sweep=lr", "sweep.n_trials=2", "sweep.study_name=counting")
    counting.study.add_trial(create_trial(state=TrialState.FAIL))
    counting.study.add_trial(create_trial(state=TrialState.FAIL))
    assert "sweep.n_trials=2" in counting.limit_reached()


# -----------------------------------------------------------------------------
# The report


def test_the_report_plots_each_checkpoint_where_it_was_measured():
    measured = create_trial(value=3.9, intermediate_values={1: 4.3, 2: 4.1},
                            user_attrs={"checkpoint_fractions": {"1": 0.17, "2": 0.52}})
    assert curve(measured, 0.25) == [(0.17, 4.3), (0.52, 4.1), (1.0, 3.9)]
    older = create_trial(state=TrialState.PRUNED, value=4.3, intermediate_values={1: 4.3})
    assert curve(older, 0.25) == [(0.25, 4.3)]  # no fractions recorded: k * every_fraction


def test_the_report_draws_the_pareto_front(tmp_path):
    study = optuna.create_study(study_name="front", directions=["minimize", "maximize"],
                                storage=open_storage(str(tmp_path / "s.journal")))
    study.set_user_attr("objective", {"name": "pareto", "directions": ["minimize", "maximize"]})
    for bpb, core in [(1.0, 0.10), (1.1, 0.20), (1.2, 0.05)]:  # the last is beaten on both
        study.add_trial(create_trial(values=[bpb, core], params={"x": bpb},
                                     distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))
    report = write_report(study, tmp_path / "report")
    assert report["front"] == [0, 1] and report["best"] is None
    assert (tmp_path / "report" / "pareto.png").stat().st_size > 0
    assert "## Pareto front" in report["text"] and "# trial 1" in report["text"]


def test_the_report_warns_of_trials_scored_on_different_validation_sets(tmp_path):
    """Equal token counts on other rows (another seq_len, say) are different sets: the fingerprint tells."""
    study = optuna.create_study(study_name="sets", storage=open_storage(str(tmp_path / "s.journal")))
    study.set_user_attr("eval_tokens", {"final_tokens": 4096, "checkpoint_tokens": 1024, "how": "given"})
    study.set_user_attr("val_fingerprint", "aaaa")
    distributions = {"x": optuna.distributions.FloatDistribution(0, 2)}
    for x, fingerprint in [(0.5, "aaaa"), (1.0, "aaaa")]:
        study.add_trial(create_trial(value=x, params={"x": x}, distributions=distributions,
                                     user_attrs={"val_tokens": 4096, "val_fingerprint": fingerprint}))
    text = write_report(study, tmp_path / "one")["text"]
    assert "different validation sets" not in text
    assert "eval.final_tokens=4096 (eval.checkpoint_tokens=1024 at each checkpoint), the validation set aaaa." in text
    study.add_trial(create_trial(value=0.7, params={"x": 0.7}, distributions=distributions,
                                 user_attrs={"val_tokens": 4096, "val_fingerprint": "bbbb"}))
    text = write_report(study, tmp_path / "two")["text"]
    assert ("**Warning**: these trials were evaluated on different validation sets (val_fingerprint aaaa, bbbb): "
            "their val_bpb do not compare.") in text


def importance_study(n_trials):
    """x decides the value, y barely: PED-ANOVA should find x, given enough trials to tell."""
    study = optuna.create_study(study_name="importances", sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda t: t.suggest_float("x", 0, 1) + 0.01 * t.suggest_float("y", 0, 1), n_trials=n_trials)
    return study


def test_importances_are_withheld_below_the_trials_ped_anova_needs(tmp_path):
    needed = sweep_report.MIN_IMPORTANCE_TRIALS
    report = write_report(importance_study(needed - 1), tmp_path)
    assert report["importances"] == {}
    assert f"Importances need {needed} complete trials; this study has {needed - 1}." in report["text"]
    assert not (tmp_path / "importances.png").exists()


def test_importances_with_enough_trials_find_the_parameter_that_matters(tmp_path):
    report = write_report(importance_study(sweep_report.MIN_IMPORTANCE_TRIALS), tmp_path)
    assert max(report["importances"], key=report["importances"].get) == "x"
    assert report["importances"]["x"] > 3 * report["importances"]["y"]
    assert "Importances need" not in report["text"] and "| x | " in report["text"]
    assert tmp_path / "importances.png" in report["files"]


# -----------------------------------------------------------------------------
# Through the command line


@pytest.mark.slow
def test_pareto_sweep_records_val_bpb_and_core_and_draws_the_front(tmp_path, shared_study):
    storage, name = shared_study
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", *TINY, "sweep=lr",
                           "sweep.sampler=random", "sweep.objective=pareto", "sweep.pruner=none",
                           "sweep.n_trials=2", f"sweep.storage={storage}", f"sweep.study_name={name}",
                           f"hydra.sweep.dir={tmp_path / 'out'}"],
                          cwd=ROOT, text=True, timeout=600, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    for t in trials:
        assert t.values == [t.user_attrs["val_bpb"], t.user_attrs["core"]]
        assert t.user_attrs["checkpoint_fractions"]  # recorded, though a pareto study takes no reports
    assert "pareto front (val_bpb, core): trials" in done.stdout
    assert (tmp_path / "out" / "report" / "pareto.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["sweep.objective=pareto"], "error: sweep.pruner='hyperband' is not allowed with sweep.objective=pareto"),
    (["hydra/launcher=submitit_slurm"], "error: hydra/launcher=submitit_slurm is not usable here"),
])
def test_a_refused_objective_or_launcher_is_one_sentence_and_creates_nothing(tmp_path, args, message):
    if "submitit_slurm" in args[0]:
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
        if shutil.which("srun"):
            pytest.skip("SLURM is here")
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", "model=tiny", "sweep=lr", *args,
                           f"sweep.storage={tmp_path / 'out' / 'study.journal'}", f"hydra.sweep.dir={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
