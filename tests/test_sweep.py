"""Budgeted Optuna sweeps (`--multirun sweep=NAME`): search, pruning, failures, resume, parallel
workers on a journal file and on PostgreSQL, MLflow nesting, and the plain Hydra grid.

Sweeps run as `python -m frontier.train --multirun ...` subprocesses, as a user runs them, with a
CPU-sized model and budgets of a few steps, so that a trial takes seconds.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from optuna.trial import TrialState

from frontier.config import ConfigError
from frontier.study import STALE_REASON, Process, open_storage, settle_orphans
from tests.conftest import command_in_process, gc_probe, gc_records, spread

# one worker builds this module's fixtures once (tpe_sweep, two sweeps): pytest-xdist --dist loadgroup
pytestmark = pytest.mark.xdist_group("test_sweep")

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=tiny", "data.vocab_size=1024", "data.tokenizer_train_chars=2000000",
    "budget.seconds=5", "budget.max_steps=4", "budget.excluded_steps=0",
    "train.batch_tokens=2048", "eval.checkpoint_tokens=2048", "eval.final_tokens=4096",
    "eval.every_fraction=0.25", "tracking.enabled=false", "precision=fp32",
]
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"

optuna.logging.set_verbosity(optuna.logging.WARNING)


def sweep_args(out: Path, *args: str) -> list[str]:
    """What follows `python -m frontier.train` for a sweep of tiny trials into `out`."""
    return ["--multirun", *TINY, *args, f"hydra.sweep.dir={out}"]


def sweep_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "frontier.train", *sweep_args(out, *args)]


def run_sweep(out: Path, *args: str, ok: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(sweep_command(out, *args), cwd=ROOT, text=True, timeout=600, env={**os.environ, **(env or {})},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # Hydra logs to stdout
    if ok:
        assert done.returncode == 0, done.stdout[-3000:]
    return done


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def states(study: optuna.Study) -> list[str]:
    return [t.state.name for t in study.get_trials(deepcopy=False)]


# -----------------------------------------------------------------------------
# Search, resume, report


@pytest.fixture(scope="module")
def tpe_sweep(tmp_path_factory):
    """sweep=lr with TPE: 4 trials, then the same command asking for 6 in total, all in TPE's
    random start-up (where a shared seed used to repeat the first run's points)."""
    tmp = tmp_path_factory.mktemp("tpe")
    storage = str(tmp / "study.journal")
    # trials share this machine with other tests: their speeds tell nothing of a trial's fairness
    args = ["sweep=lr", "sweep.n_jobs=2", "sweep.n_startup_trials=10", "sweep.pruner=none",
            "sweep.min_relative_speed=0.01", f"sweep.storage={storage}", "sweep.study_name=tpe"]
    run_sweep(tmp / "first", *args, "sweep.n_trials=4")
    second = run_sweep(tmp / "second", *args, "sweep.n_trials=6")
    return tmp, storage, second


@pytest.mark.slow
def test_tpe_sweep_completes_and_resumes_to_the_total_asked(tpe_sweep):
    tmp, storage, second = tpe_sweep
    study = load(storage, "tpe")
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == list(range(6))
    assert states(study) == ["COMPLETE"] * 6
    assert sorted(p.name for p in (tmp / "first").iterdir() if p.name.isdigit()) == ["0", "1", "2", "3"]
    assert sorted(p.name for p in (tmp / "second").iterdir() if p.name.isdigit()) == ["4", "5"]
    assert {tuple(sorted(t.params)) for t in trials} == {
        ("optim.embedding_lr", "optim.matrix_lr", "optim.unembedding_lr")}
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 6  # the re-run repeated no point
    best = study.best_trial
    assert f"best: trial {best.number}, val_bpb {best.value:.4f}" in second.stdout
    assert "optim.matrix_lr=" in " ".join(best.user_attrs["overrides"])
    assert "device utilisation" in second.stdout
    report = (tmp / "second" / "report" / "report.md").read_text()
    assert f"trial {best.number}, val_bpb **{best.value:.4f}**" in report


@pytest.mark.slow
def test_sweep_report_command_writes_tables_and_plots(tpe_sweep):
    tmp, storage, _ = tpe_sweep
    out = tmp / "report"
    done = subprocess.run([sys.executable, "-m", "frontier.sweep_report", "study=tpe", f"storage={storage}",
                           f"out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "## Top 10" in done.stdout and "Importances need 50 complete trials; this study has 6." in done.stdout
    for name in ("report.md", "history.png", "val_bpb_vs_budget.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "importances.png").exists()  # 6 trials say nothing of which parameter matters
    missing = subprocess.run([sys.executable, "-m", "frontier.sweep_report", "study=nope", f"storage={storage}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "studies there: tpe" in missing.stderr


# -----------------------------------------------------------------------------
# Pruning, failures, MLflow


@pytest.mark.slow
def test_aggressive_pruner_records_pruned_trials(tmp_path):
    storage = str(tmp_path / "study.journal")
    # A finished trial far better than any tiny run at every checkpoint: successive halving
    # must prune each new trial at its first checkpoint.
    study = optuna.create_study(study_name="prune", storage=open_storage(storage))
    study.add_trial(optuna.trial.create_trial(
        state=TrialState.COMPLETE, value=0.1, intermediate_values={1: 0.1, 2: 0.1, 3: 0.1},
        system_attrs={"completed_rung_0": 0.1, "completed_rung_1": 0.1}))
    done = run_sweep(tmp_path / "out", "sweep=lr", "sweep.sampler=random", "sweep.pruner=successive_halving",
                     "sweep.n_trials=3", "sweep.n_jobs=2", f"sweep.storage={storage}", "sweep.study_name=prune")
    study = load(storage, "prune")
    assert states(study) == ["COMPLETE", "PRUNED", "PRUNED"], done.stdout[-3000:]
    for trial in study.get_trials(deepcopy=False)[1:]:
        assert list(trial.intermediate_values) == [1]
        assert trial.user_attrs["budget_fraction"] == 0.25
        assert trial.user_attrs["checkpoint_fractions"] == {"1": 0.25}  # where checkpoint 1 was measured
        assert trial.user_attrs["prune_reason"].startswith("pruned at checkpoint 1")
        summary = json.loads((tmp_path / "out" / str(trial.number) / "summary.json").read_text())
        assert summary["status"] == "PRUNED"


@pytest.mark.slow
def test_diverging_trial_fails_the_sweep_goes_on_and_mlflow_nests_trials(tmp_path, mlflow_store):
    pytest.importorskip("frontier.tracking", reason="frontier/tracking.py is not there yet")
    from mlflow import MlflowClient

    storage = str(tmp_path / "study.journal")
    uri = mlflow_store
    # grid: one sane trial, and one whose absurd learning rate makes the loss explode
    done = run_sweep(tmp_path / "out", "sweep=custom", "sweep.sampler=grid", "sweep.pruner=none",
                     "optim.matrix_lr=0.04,1e9", "sweep.n_jobs=2", f"sweep.storage={storage}",
                     "sweep.study_name=diverge", "tracking.enabled=true", f"tracking.uri={uri}",
                     "tracking.experiment=sweep-test")
    study = load(storage, "diverge")
    sane, absurd = sorted(study.get_trials(deepcopy=False), key=lambda t: t.params["optim.matrix_lr"])
    assert sane.state == TrialState.COMPLETE and absurd.state == TrialState.FAIL
    assert absurd.user_attrs["fail_reason"].startswith("diverged at step")
    assert f"trial {absurd.number} FAIL after" in done.stdout

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("sweep-test")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.metrics["trials_complete"] == 1 and parents[0].data.metrics["trials_fail"] == 1
    children = {r.info.run_name.split()[0]: r for r in runs
                if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) == {f"trial-{sane.number}", f"trial-{absurd.number}"}
    # a child's name says what it tried: its trial number and parameters
    assert children[f"trial-{sane.number}"].info.run_name == f"trial-{sane.number} optim.matrix_lr=0.04"
    assert children[f"trial-{sane.number}"].info.status == "FINISHED"
    assert children[f"trial-{absurd.number}"].info.status == "FAILED"
    assert children[f"trial-{absurd.number}"].data.params["trial.number"] == str(absurd.number)


# -----------------------------------------------------------------------------
# Several workers, one study


def run_two_workers(tmp_path: Path, storage: str, name: str, n_trials: int) -> None:
    args = ["sweep=lr", "sweep.sampler=random", "sweep.pruner=none", f"sweep.n_trials={n_trials}",
            "sweep.n_jobs=1", f"sweep.storage={storage}", f"sweep.study_name={name}"]
    workers = [subprocess.Popen(sweep_command(tmp_path / f"worker{i}", *args), cwd=ROOT, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    for worker in workers:
        output, _ = worker.communicate(timeout=600)
        assert worker.returncode == 0, output[-3000:]


def check_shared(tmp_path: Path, study: optuna.Study, n_trials: int) -> None:
    trials = study.get_trials(deepcopy=False)
    assert sorted(t.number for t in trials) == list(range(n_trials))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({tuple(sorted(t.params.items())) for t in trials}) == n_trials  # no repeated proposal
    dirs = [p.name for i in range(2) for p in (tmp_path / f"worker{i}").iterdir() if p.name.isdigit()]
    assert sorted(dirs) == [str(n) for n in range(n_trials)]  # each trial ran once, in one worker


@pytest.mark.slow
def test_two_workers_share_a_journal_file(tmp_path):
    storage = str(tmp_path / "study.journal")
    run_two_workers(tmp_path, storage, "shared", 3)
    check_shared(tmp_path, load(storage, "shared"), 3)


def test_parallel_cpu_trials_share_the_cores_and_keep_to_the_drivers_thread_cap(monkeypatch):
    from hydra_plugins.frontier_sweeper._study import device_slots

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [slot.env["OMP_NUM_THREADS"] for slot in device_slots("cpu", 1)] == [str(cores)]
    if cores >= 2:
        assert [slot.env["OMP_NUM_THREADS"] for slot in device_slots("cpu", 2)] == [str(cores // 2)] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the driver's own cap wins where it is fewer
    (slot,) = device_slots("cpu", 1)
    assert slot.env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} and slot.label == "cpu (1 threads)"
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores * 4))
    assert [slot.env["OMP_NUM_THREADS"] for slot in device_slots("cpu", 1)] == [str(cores)]


# -----------------------------------------------------------------------------
# Without a preset: Hydra's grid


def test_plain_multirun_grid_still_works(tmp_path):
    done = run_sweep(tmp_path / "out", "optim=muon,adamw")
    for job in ("0", "1"):
        summary = json.loads((tmp_path / "out" / job / "summary.json").read_text())
        assert summary["status"] == "FINISHED"
    names = [(tmp_path / "out" / job / ".hydra" / "overrides.yaml").read_text() for job in ("0", "1")]
    assert "optim=muon" in names[0] and "optim=adamw" in names[1], done.stdout


# -----------------------------------------------------------------------------
# Bad input: one sentence, before any trial starts


@pytest.fixture()
def compose_sweep(tmp_path):
    """Builds the sweeper's Sweep from composed config, which validates everything up front."""
    from hydra_plugins.frontier_sweeper._study import Sweep

    built = itertools.count()  # each Sweep a folder of its own: it claims it for its study

    def build(*overrides: str, params: dict | None = None):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[*TINY, f"hydra.sweep.dir={tmp_path / 'sweep' / str(next(built))}",
                                               *overrides], return_hydra_config=True)
            if params is not None:
                cfg.sweep.params = params
            return Sweep(cfg, list(overrides), GlobalHydra.instance().config_loader())

    yield build
    GlobalHydra.instance().clear()


@pytest.mark.parametrize("overrides, params, message", [
    (["sweep=lr"], {"optim.matrix_lr": "interval(0.1"},
     "sweep.params.optim.matrix_lr='interval(0.1' is not a valid search-space expression"),
    (["sweep=lr"], {"optim.matrix_lr": "tag(log, interval(0, 1))"}, "is not a valid search space"),
    (["sweep=lr"], {"optim.matrix_lrr": "interval(0.1, 0.2)"},
     "optim.matrix_lrr=0.1 is not allowed: optim has no key 'matrix_lrr'; did you mean matrix_lr? (from the search "
     "space sweep.params.optim.matrix_lrr='interval(0.1, 0.2)')"),
    (["sweep=lr"], {"model.depth": "choice(abc, 4)"}, "model.depth=abc is not allowed: must be an integer (from the "
                                                      "search space sweep.params.model.depth='choice(abc, 4)')"),
    (["sweep=lr"], {"model": "choice(tiny, huge)"},
     "model=huge is not allowed: model has no such option; choose one of"),
    (["sweep=lr"], {"data.path": "choice(/no/such/a, /no/such/b)"}, "data.path='/no/such/a' does not exist"),
    (["sweep=lr"], {"model.depth": "range(1, 10, -1)"},
     "sweep.params.model.depth='range(1, 10, -1)' is not a valid search space (the range holds no values)"),
    (["sweep=lr"], {"model.depth": "int(interval(5.5, 5.7))"},
     "sweep.params.model.depth='int(interval(5.5, 5.7))' is not a valid search space (an interval from 5 to 5 "
     "holds one value (int(...) truncates its bounds)"),
    (["sweep=lr"], {"optim.matrix_lr": "interval(0.2, 0.1)"}, "(an interval from 0.2 to 0.1 holds no values"),
    (["sweep=lr"], {"model.depth": "range(5, 5)"},
     "sweep.params.model.depth='range(5, 5)' is not a valid search space (the range holds no values)"),
    (["sweep=lr", "sweep.sampler=bayes"], None,
     "sweep.sampler='bayes' is not allowed: choose one of tpe, random, grid, cmaes, gp"),
    (["sweep=lr", "sweep.pruner=asha"], None, "sweep.pruner='asha' is not allowed"),
    (["sweep=lr", "sweep.sampler=grid"], None, "is not allowed with sweep.sampler='grid'"),
    (["sweep=lr", "sweep.n_jobs=4096"], None, "sweep.n_jobs=4096 is not allowed"),
    (["sweep=lr", "sweep.storage=postgresql://nobody@127.0.0.1:1/none"], None,
     "sweep.storage='postgresql://nobody@127.0.0.1:1/none' is not reachable"),
    (["sweep=lr", "eval.every_fraction=0"], None, "sweep.pruner='hyperband' is not allowed with eval.every_fraction=0"),
    (["sweep=custom"], None, "sweep=custom is not allowed without a search space"),
])
def test_bad_input_is_one_clear_error(compose_sweep, overrides, params, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose_sweep(*overrides, params=params)


PRESETS = sorted(path.stem for path in (ROOT / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("preset", spread([(name,) for name in PRESETS], PRESETS, every=3))
def test_every_preset_is_ready_to_run(compose_sweep, preset, tmp_path):
    space = {"optim.matrix_lr": "interval(0.01, 0.1)"} if preset == "custom" else None  # custom has none of its own
    sweep = compose_sweep(f"sweep={preset}", f"sweep.storage={tmp_path / 'study.journal'}", params=space)
    assert sweep.study.study_name == preset
    assert sweep.space


@pytest.mark.parametrize("expr, values", [
    ("range(10, 1, -1)", range(10, 1, -1)), ("range(10, 1, -3)", range(10, 1, -3)),
    ("range(4, 17, 2)", range(4, 17, 2)),
    ("range(1.0, 0.0, -0.25)", [1.0, 0.75, 0.5, 0.25]), ("range(1.0, 0.0, -0.3)", [1.0, 0.7, 0.4, 0.1]),
])
def test_a_range_holds_pythons_values_descending_too(expr, values):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.frontier_sweeper._space import distribution, grid_values

    dist = distribution(OverridesParser.create().parse_override(f"model.depth={expr}"))
    assert grid_values({"model.depth": dist})["model.depth"] == pytest.approx(sorted(values))


@pytest.mark.slow
def test_a_descending_range_sweeps_its_values(tmp_path):
    storage = tmp_path / "study.journal"
    run_sweep(tmp_path / "out", "sweep=custom", "sweep.sampler=grid", "sweep.pruner=none", f"sweep.storage={storage}",
              "model.depth=range(2,0,-1)", env=gc_probe(tmp_path / "probe"))
    study = load(str(storage), "custom")
    assert states(study) == ["COMPLETE", "COMPLETE"]
    assert sorted(t.params["model.depth"] for t in study.trials) == [1, 2]
    # the driver and each trial start with Python's collector off and turn it on (frontier.startup_over)
    records = gc_records(tmp_path / "probe")
    driver = [r for r in records if "--multirun" in r["argv"]]
    trials = [r for r in records if "--multirun" not in r["argv"] and not r["argv"][0].endswith("standby.py")]
    assert len(driver) == 1 and len(trials) == 2, records  # (a standby left waiting at the end never trains)
    assert all(r["startup"] is False and r["exit"] is True and r["frozen"] > 100_000 and r["garbage_collected"]
               and r["frozen_at_exit"] == 0 for r in driver + trials), records


@pytest.mark.parametrize("space, message", [
    ("model.dpeth=choice(2,4)", "model.dpeth=2 is not allowed: model has no key 'dpeth'; did you mean depth? (from "
                                "the search space 'model.dpeth=choice(2,4)')"),
    ("model.depth=choice(abc,4)", "model.depth=abc is not allowed: must be an integer (from the search space "
                                  "'model.depth=choice(abc,4)')"),
    ("data.path=choice({wiki},/no/such/folder)", "data.path='/no/such/folder' does not exist (looked in "
                                                 "/no/such/folder)"),
    ("model.depth=range(1,10,-1)", "'model.depth=range(1,10,-1)' is not a valid search space (the range holds no "
                                   "values)"),
], ids=["key", "value", "data.path", "empty range"])
def test_a_bad_value_in_the_search_space_is_one_sentence_before_anything_runs(tmp_path, space, message):
    from tests.conftest import WIKI

    done = command_in_process("frontier.train", sweep_args(tmp_path / "out", "sweep=lr",
                                                         f"sweep.storage={tmp_path / 'study.journal'}",
                                                         space.format(wiki=WIKI)))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(f"error: {message}")
    assert list(tmp_path.iterdir()) == []  # no study, no sweep directory, no trial


def test_bad_input_on_the_command_line_starts_no_trial(tmp_path):
    done = command_in_process("frontier.train", sweep_args(tmp_path / "out", "sweep=lr", "sweep.sampler=bayes"))
    assert done.returncode == 2
    assert "sweep.sampler='bayes' is not allowed" in done.stderr
    assert not any(p.name.isdigit() for p in (tmp_path / "out").glob("*"))


# -----------------------------------------------------------------------------
# Heartbeats


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_running_trial_without_heartbeats_is_failed(tmp_path):
    storage = open_storage(str(tmp_path / "study.journal"), heartbeat_interval=1, grace_period=5)
    study = optuna.create_study(study_name="stale", storage=storage)
    dead, alive = study.ask(), study.ask()
    storage.set_trial_system_attr(dead._trial_id, "heartbeat", time.time() - 60)
    storage.record_heartbeat(alive._trial_id)
    assert [t.number for t in settle_orphans(study)] == [dead.number]
    dead_trial, alive_trial = study.get_trials(deepcopy=False)
    assert dead_trial.state == TrialState.FAIL and dead_trial.user_attrs["fail_reason"] == STALE_REASON
    assert alive_trial.state == TrialState.RUNNING


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_that_never_beat_is_failed_after_the_grace_period_on_every_storage(tmp_path):
    """A driver killed between creating a trial and launching it leaves a trial with no heartbeat at
    all; Optuna's RDB storage alone would never call it stale."""
    grace = 4  # ample for two asks at load
    studies = []
    try:
        for spec in every_storage(tmp_path):  # one grace period for all: the waiting is the test's cost
            name = f"never-beat-{uuid.uuid4().hex[:8]}"
            storage = open_storage(spec, heartbeat_interval=1, grace_period=grace)
            study = optuna.create_study(study_name=name, storage=storage)
            studies.append((spec, storage, study, study.ask(), study.ask()))
            assert settle_orphans(study) == [], f"{spec}: a trial younger than the grace period was failed"
        time.sleep(grace + 0.5)
        for spec, storage, study, orphan, beating in studies:
            storage.record_heartbeat(beating._trial_id)
            assert [t.number for t in settle_orphans(study)] == [orphan.number], spec
            states = [t.state for t in study.get_trials(deepcopy=False)]
            assert states == [TrialState.FAIL, TrialState.RUNNING], spec
    finally:
        for _, storage, study, _, _ in studies:
            optuna.delete_study(study_name=study.study_name, storage=storage)


def test_an_orphaned_trial_keeps_a_finished_result_and_fails_otherwise(tmp_path):
    """A trial left RUNNING by a process that died: its summary.json decides, else FAIL with why."""
    study = optuna.create_study(study_name="orphans", storage=open_storage(str(tmp_path / "study.journal")))
    finished, crashed = study.ask(), study.ask()
    exited = subprocess.Popen(["true"])
    exited.wait()
    for trial in (finished, crashed):
        trial.set_user_attr("process", str(Process(socket.gethostname(), exited.pid, "")))
        trial.set_user_attr("run_dir", str(tmp_path / str(trial.number)))
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "FINISHED", "val_bpb": 3.25, "steps": 7}))
    assert [t.number for t in settle_orphans(study)] == [0, 1]
    done, failed = study.get_trials(deepcopy=False)
    assert done.state == TrialState.COMPLETE and done.value == 3.25 and done.user_attrs["steps"] == 7
    assert failed.state == TrialState.FAIL
    assert failed.user_attrs["fail_reason"] == "its process exited without a result"


def test_a_trial_whose_driver_died_before_recording_its_process_is_settled_at_once(tmp_path):
    """A driver killed between starting a trial and recording its process: the trial is ended at
    once on this machine, not after the grace period; a launcher's job (run elsewhere) and a trial
    of a live driver are left to their heartbeats."""
    study = optuna.create_study(study_name="unstarted", storage=open_storage(str(tmp_path / "study.journal")))
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead_driver, live_driver = Process(socket.gethostname(), exited.pid, ""), Process.this()
    for driver, launched in ((dead_driver, False), (dead_driver, True), (live_driver, False)):
        trial = study.ask()
        trial.set_user_attr("driver", str(driver))
        trial.set_user_attr("launched", launched)
    assert [t.number for t in settle_orphans(study)] == [0]
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.FAIL, TrialState.RUNNING, TrialState.RUNNING]
    assert study.trials[0].user_attrs["fail_reason"] == "its driver exited as it started the trial"


# -----------------------------------------------------------------------------
# Proposals: distinct across drivers and re-runs, reproducible for one driver


def storages(tmp_path: Path) -> list[str]:
    found = [str(tmp_path / "study.journal")]
    try:
        open_storage(POSTGRES)
        found.append(POSTGRES)
    except Exception as err:
        print(f"PostgreSQL not tested: no server answers at {POSTGRES} ({type(err).__name__})")
    return found


def every_storage(tmp_path: Path) -> list[str]:
    """Those, and SQLite, which takes its study lock beside the database file."""
    return [*storages(tmp_path), f"sqlite:///{tmp_path / 'study.db'}"]


@pytest.mark.parametrize("sampler", [pytest.param("random", marks=pytest.mark.slow), "tpe"])
def test_drivers_of_one_study_never_repeat_a_proposal(compose_sweep, tmp_path, sampler):
    for storage in storages(tmp_path):
        name = f"seeds-{sampler}-{uuid.uuid4().hex[:8]}"
        args = ["sweep=lr", f"sweep.sampler={sampler}", f"sweep.storage={storage}", f"sweep.study_name={name}"]
        try:
            first, second = compose_sweep(*args), compose_sweep(*args)  # two drivers, the same sweep.seed
            asked = [driver.next_trial() for driver in (first, second, first, second)]
            assert [t.number for t in asked] == [0, 1, 2, 3]
            assert len({tuple(sorted(t.params.items())) for t in asked}) == 4
            # the same study run again from scratch (one driver) proposes the same points
            again = compose_sweep(*args[:-1], f"sweep.study_name={name}-again")
            try:
                assert [again.next_trial().params for _ in range(4)] == [t.params for t in asked]
            finally:
                optuna.delete_study(study_name=f"{name}-again", storage=again.study._storage)
        finally:
            optuna.delete_study(study_name=name, storage=open_storage(storage))


@pytest.mark.slow
def test_two_drivers_of_one_study_take_its_lock_in_turn(compose_sweep, tmp_path):
    """The lock around "count, then ask" and the parent run's creation; a lock not taken on an RDB
    once let two drivers starting together each open a parent run."""
    for storage in every_storage(tmp_path):
        name = f"lock-{uuid.uuid4().hex[:8]}"
        args = ["sweep=lr", f"sweep.storage={storage}", f"sweep.study_name={name}"]
        first, second = compose_sweep(*args), compose_sweep(*args)
        try:
            second_has_it = threading.Event()

            def take_it():
                with second.locked():
                    second_has_it.set()

            with first.locked():
                waiter = threading.Thread(target=take_it)
                waiter.start()
                assert not second_has_it.wait(1.5), f"two drivers held the lock of {storage} at once"
            assert second_has_it.wait(30), f"the lock of {storage} was not handed on"
            waiter.join()
        finally:
            optuna.delete_study(study_name=name, storage=open_storage(storage))


@pytest.mark.slow
def test_a_second_driver_with_other_overrides_is_refused_before_any_trial(compose_sweep, tmp_path):
    """Two drivers starting together on one study: the second must not overwrite the first's overrides,
    nor its pruner, its space, nor its sampler's proposals."""
    args = ["sweep=lr", f"sweep.storage={tmp_path / 'study.journal'}", "sweep.study_name=shared"]
    compose_sweep(*args)  # running (this process), no trial yet
    with pytest.raises(ConfigError, match="sweep.study_name='shared' is not allowed: that study's trials run with"):
        compose_sweep(*args, "optim.weight_decay=0.05")
    space = {"optim.matrix_lr": "interval(0.01, 0.1)"}
    for change, params, what in [("sweep.pruner=median", None, "sweep.pruner"), ("sweep.seed=1", None, "sweep.seed"),
                                 ("sweep.sampler=random", None, "sweep.sampler"),
                                 ("tracking.experiment=x", space, "the search space")]:
        with pytest.raises(ConfigError, match=f"that study's trials run with {what} "):
            compose_sweep(*args, change, params=params)
    compose_sweep(*args, "tracking.experiment=elsewhere")  # where it is recorded changes no trial


def test_the_lock_refuses_a_storage_it_cannot_lock(tmp_path):
    from frontier.study import ask_lock

    url = f"sqlite:///{tmp_path / 'study.db'}"
    cached = optuna.storages.get_storage(url)  # what a study holds as its _storage: Optuna's cache
    with pytest.raises(TypeError, match="needs the RDBStorage"):
        with ask_lock(url, cached, "any"):
            pass


# -----------------------------------------------------------------------------
# The trial's side: exact checkpoints, its own end, its driver


def reporter_for(tmp_path: Path, driver: Process | None = None):
    from frontier.trial import TrialReporter

    study = optuna.create_study(study_name="reporter", storage=open_storage(str(tmp_path / "study.journal")),
                                load_if_exists=True)
    run = SimpleNamespace(summary={}, run_dir=tmp_path)
    return study, TrialReporter(run, study, study.ask(), driver, heartbeat_interval=None, grace_period=120)


def test_the_trial_reports_each_checkpoint_where_it_was_measured_and_tells_its_end(tmp_path):
    study, reporter = reporter_for(tmp_path)
    reporter.on_checkpoint(1, 3.0, 10, 0.2504)
    reporter.on_checkpoint(2, 2.9, 30, 0.7612)  # one long step crossed marks 2 and 3: each is reported
    reporter.on_checkpoint(3, 2.9, 30, 0.7612)
    reporter.on_end({"status": "FINISHED", "val_bpb": 2.5, "progress": 1.0, "steps": 40}, "FINISHED", None)
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.COMPLETE and trial.value == 2.5
    assert trial.intermediate_values == {1: 3.0, 2: 2.9, 3: 2.9}
    assert trial.user_attrs["checkpoint_fractions"] == {"1": 0.2504, "2": 0.7612, "3": 0.7612}
    assert trial.user_attrs["budget_fraction"] == 1.0 and trial.user_attrs["steps"] == 40


def test_a_trial_whose_driver_is_gone_stops_itself_and_says_why(tmp_path):
    lifecycle = pytest.importorskip("frontier.lifecycle")
    exited = subprocess.Popen(["true"])
    exited.wait()
    lifecycle._reset()
    try:
        study, reporter = reporter_for(tmp_path, Process(socket.gethostname(), exited.pid, ""))
        reason = f"its sweep driver (pid {exited.pid} on {socket.gethostname()}) has exited"
        for _ in range(50):
            if lifecycle.stop_requested():
                break
            time.sleep(0.1)
        assert lifecycle.stop_requested() == reason
        reporter.on_end({"status": "KILLED", "error": lifecycle.stop_requested(), "progress": 0.1}, "KILLED",
                        lifecycle.stop_requested())
    finally:
        lifecycle._reset()
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_reason"] == reason


def test_a_trial_ended_in_the_study_stops_itself_without_a_checkpoint_to_report(tmp_path, monkeypatch):
    """No periodic evaluation (eval.every_fraction=0) and no driver to watch: its own state in the
    study, read every STATE_SECONDS, still tells it that another driver ended it."""
    lifecycle = pytest.importorskip("frontier.lifecycle")
    from frontier import trial as trial_module
    from frontier.study import STALE_REASON, end_trial

    monkeypatch.setattr(trial_module, "STATE_SECONDS", 1.0)
    lifecycle._reset()
    try:
        study, reporter = reporter_for(tmp_path)
        time.sleep(2)
        assert lifecycle.stop_requested() is None  # running in the study: it trains on
        assert end_trial(study, reporter.trial._trial_id, TrialState.FAIL, None, {"fail_reason": STALE_REASON})
        for _ in range(50):
            if lifecycle.stop_requested():
                break
            time.sleep(0.1)
        assert lifecycle.stop_requested() == f"trial 0 was ended FAIL in the study ({STALE_REASON})"
        reporter.on_end({"status": "KILLED", "progress": 0.1}, "KILLED", lifecycle.stop_requested())
    finally:
        lifecycle._reset()
    (trial,) = study.get_trials(deepcopy=False)
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_reason"] == STALE_REASON  # the driver's


def test_only_an_unexplained_sigkill_suggests_memory(tmp_path):
    from hydra_plugins.frontier_sweeper._study import describe_exit

    (tmp_path / "output.log").write_text("step 3\nValueError: boom\n")
    assert describe_exit(1, tmp_path / "output.log") == "ValueError: boom"
    assert describe_exit(-signal.SIGTERM, tmp_path / "output.log") == "killed by SIGTERM"
    assert "out of host memory" in describe_exit(-signal.SIGKILL, tmp_path / "output.log")


def test_a_journal_write_that_fails_part_way_is_taken_back_and_a_half_record_is_cut_off(tmp_path, monkeypatch):
    """A full disk cut a record short; the next driver appended after it, making one line that is not
    JSON, and every later read of the study failed: the study, and its finished trials, were lost."""
    journal = tmp_path / "study.journal"
    storage = open_storage(str(journal))
    study = optuna.create_study(study_name="s", storage=storage)
    study.enqueue_trial({"x": 1.0})
    whole = journal.read_bytes()

    real_write = os.write

    def disk_fills(fd, data):  # the first bytes fit, then the disk is full
        real_write(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(OSError):
        study.enqueue_trial({"x": 2.0})
    monkeypatch.undo()
    assert journal.read_bytes() == whole  # taken back

    with open(journal, "ab") as f:  # what a process killed inside its write leaves
        f.write(b'{"op_code":5,"worker')
    assert optuna.load_study(study_name="s", storage=open_storage(str(journal))).trials  # readable as it is
    again = optuna.load_study(study_name="s", storage=open_storage(str(journal)))
    again.enqueue_trial({"x": 3.0})  # cuts the half record off first
    assert journal.read_bytes().startswith(whole) and all(json.loads(line) for line in journal.read_bytes().splitlines())
    reread = optuna.load_study(study_name="s", storage=open_storage(str(journal)))
    assert [t.params.get("x", t.system_attrs.get("fixed_params", {}).get("x")) for t in reread.trials] == [1.0, 3.0]


def test_a_journal_that_is_not_one_is_refused_and_left_as_it_was(tmp_path):
    journal = tmp_path / "notes.journal"
    journal.write_text("my notes\nmore notes\n")
    result = command_in_process("frontier.train", sweep_args(tmp_path / "out", "sweep=lr", f"sweep.storage={journal}"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: sweep.storage='{journal}' is not allowed: its line 1 is not an Optuna journal record (a file that "
        "is not a journal, or one damaged); give another file"], result.stderr[-3000:]
    report = command_in_process("frontier.sweep_report", ["study=lr", f"storage={journal}"])
    assert report.returncode == 2 and report.stderr == (
        f"error: storage='{journal}' is not allowed: its line 1 is not an Optuna journal record (a file that is not a "
        "journal, or one damaged)\n"), report.stderr
    assert journal.read_text() == "my notes\nmore notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.journal"]
