"""Sweeps when things go wrong: bad sweep input through the real command line, trials that hang,
drivers that die, and the study and MLflow agreeing on every trial afterwards.

Drivers run as `python -m frontier.train --multirun sweep=lr ...` subprocesses, as a user runs them.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from frontier.study import Process, open_storage, process_start
from tests.conftest import POSTGRES, command_in_process, fill, postgres_or_skip, store_in
from tests.test_tracking_faults import MLFLOW_SIGNAL, Server

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "data.vocab_size=1024", "data.tokenizer_train_chars=2000000", "precision=fp32",
        "budget.excluded_steps=0", "train.batch_tokens=2048", "eval.checkpoint_tokens=2048",
        "eval.final_tokens=4096", "eval.every_fraction=0.25"]
SHORT = ["budget.seconds=5", "budget.max_steps=4"]
LONG = ["budget.seconds=600", "budget.max_steps=100000"]  # a trial that would train for minutes

optuna.logging.set_verbosity(optuna.logging.WARNING)


def driver_args(out: Path, *args: str) -> list[str]:
    """What follows `python -m frontier.train` for a driver of a small lr sweep into `out`."""
    return ["--multirun", *TINY, "sweep=lr", "sweep.sampler=random", "sweep.pruner=none", *args,
            f"hydra.sweep.dir={out}"]


def driver_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "frontier.train", *driver_args(out, *args)]


def load(storage: str, name: str) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def wait_for(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def trial_attr(storage: str, name: str, key: str):
    """Trial 0's user attribute `key`, once the study and the attribute exist."""
    if "://" not in storage and not Path(storage).exists():
        return None
    try:
        trials = load(storage, name).get_trials(deepcopy=False)
    except KeyError:  # the study is not created yet
        return None
    return trials[0].user_attrs.get(key) if trials else None


def gone(process: Process) -> bool:
    return process_start(process.pid) != process.start


# -----------------------------------------------------------------------------
# Bad sweep input: one sentence, exit code 2, nothing created


def existing_study(storage: Path) -> None:
    """A study whose trial ran as the command below runs without `args`: its overrides, the lr
    preset's space, the random sampler, seed 0 and no pruner, as its driver recorded them."""
    from omegaconf import OmegaConf

    from hydra_plugins.frontier_sweeper._space import parse

    space, _, _ = parse(OmegaConf.to_container(OmegaConf.load(ROOT / "sweeps" / "lr.yaml").params), [])
    study = optuna.create_study(study_name="changed", storage=open_storage(str(storage)))
    study.set_user_attr("overrides", [*TINY, *SHORT])
    study.set_user_attr("sweep", {"name": "lr", "space": {key: str(dist) for key, dist in space.items()},
                                  "sampler": "random", "seed": 0})
    study.set_user_attr("pruner", {"name": "none"})
    study.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=3.0))


CHANGED = "error: sweep.study_name='changed' is not allowed: that study's trials run with"


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["sweep.sampler=foo"], "error: sweep.sampler='foo' is not allowed: choose one of"),
    (["sweep.pruner=foo"], "error: sweep.pruner='foo' is not allowed"),
    (["sweep.storage=postgresql://nobody@127.0.0.1:1/none"],
     "error: sweep.storage='postgresql://nobody@127.0.0.1:1/none' is not reachable"),
    (["sweep.n_jobs=0"], "error: sweep.n_jobs=0 is not allowed"),
    (["sweep.n_jobs=4096"], "error: sweep.n_jobs=4096 is not allowed"),
    (["sweep.n_trials=-1"], "error: sweep.n_trials=-1 is not allowed"),
    (["sweep.study_name=changed", "optim.matrix_lr=0.02"], f"{CHANGED} the overrides"),
    (["sweep.study_name=changed", "sweep.sampler=tpe"], f"{CHANGED} sweep.sampler random, this command has tpe"),
    (["sweep.study_name=changed", "sweep.seed=1"], f"{CHANGED} sweep.seed 0, this command has 1"),
    (["sweep.study_name=changed", "sweep.pruner=median"], f"{CHANGED} sweep.pruner {{'name': 'none'}}"),
    (["sweep.study_name=changed", "optim.matrix_lr=interval(0.01,0.1)"], f"{CHANGED} the search space"),
], ids=["sampler", "pruner", "storage", "n_jobs=0", "n_jobs=4096", "n_trials", "changed-overrides",
        "changed-sampler", "changed-seed", "changed-pruner", "changed-space"])
def test_bad_sweep_input_is_one_sentence_and_creates_nothing(tmp_path, args, message):
    storage = tmp_path / "study.journal"
    if "sweep.study_name=changed" in args:
        existing_study(storage)
    before = storage.read_bytes() if storage.exists() else None
    mlflow_db = tmp_path / "mlflow.db"
    storage_args = [] if any(a.startswith("sweep.storage=") for a in args) else [f"sweep.storage={storage}"]
    done = command_in_process("frontier.train", driver_args(tmp_path / "out", *SHORT, *args, *storage_args,
                                                            "tracking.enabled=true", f"tracking.uri=sqlite:///{mlflow_db}"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().startswith(message), done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stdout + done.stderr
    assert not (tmp_path / "out").exists()  # no sweep directory
    assert not mlflow_db.exists()  # no MLflow run
    # no study created, and an existing one untouched
    assert (storage.read_bytes() if storage.exists() else None) == before


def outputs(folder: Path) -> dict:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file() and path.name != "run.lock"}


@pytest.mark.slow
def test_a_sweep_into_another_studys_sweep_dir_is_refused_and_its_trials_kept(tmp_path):
    """hydra.sweep.dir of another study's sweep: trial 0 would write over that sweep's trial 0 (and the
    driver would read its summary.json for its own). Exit 2, one sentence, no study made and the other
    sweep's files as they were; the same study's next sweep there numbers its trials on."""
    storage, out = str(tmp_path / "study.journal"), tmp_path / "out"
    first = subprocess.run(driver_command(out, *SHORT, "sweep.n_trials=1", f"sweep.storage={storage}",
                                          "sweep.study_name=first", "tracking.enabled=false"),
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    kept, journal = outputs(out), Path(storage).read_bytes()

    other = subprocess.run(driver_command(out, *SHORT, "sweep.n_trials=1", f"sweep.storage={storage}",
                                          "sweep.study_name=second", "tracking.enabled=false"),
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert other.returncode == 2, other.stderr[-3000:]
    assert other.stderr.strip().splitlines() == [
        f"error: hydra.sweep.dir={out} is not allowed: another sweep's trials left their outputs there "
        f"({out / '0'}), which the trials of study 'second' would write over; give this sweep a directory "
        "of its own"], other.stderr
    assert outputs(out) == kept and Path(storage).read_bytes() == journal

    more = subprocess.run(driver_command(out, *SHORT, "sweep.n_trials=2", f"sweep.storage={storage}",
                                         "sweep.study_name=first", "tracking.enabled=false"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert more.returncode == 0, more.stderr[-3000:]
    assert [t.state for t in load(storage, "first").trials] == [TrialState.COMPLETE] * 2
    assert all(outputs(out)[path] == content for path, content in kept.items() if path.parent.name == "0")


@pytest.mark.slow
def test_a_trial_folder_written_by_another_sweep_meanwhile_is_neither_overwritten_nor_read(tmp_path):
    """Another sweep writes into this sweep's directory after its start was checked: the trial whose
    folder holds that run's records does not start (FAIL, with why), the sweep stops with one error
    line, and the other run's summary.json is neither written over nor taken as this trial's result."""
    storage, out = str(tmp_path / "study.journal"), tmp_path / "out"
    driver = subprocess.Popen(driver_command(out, *SHORT, "sweep.n_trials=2", f"sweep.storage={storage}",
                                             "sweep.study_name=raced", "tracking.enabled=false"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: driver.poll() is not None or (out / "multirun.yaml").exists(), 300, "the sweep to start")
        theirs = out / "1" / "summary.json"
        theirs.parent.mkdir()
        theirs.write_text(json.dumps({"status": "FINISHED", "val_bpb": 1.0}))
        stdout, stderr = driver.communicate(timeout=600)
    finally:
        driver.kill()
    reason = (f"{out / '1'} holds another run's records (summary.json), so trial 1 did not start there; give each "
              "sweep a hydra.sweep.dir of its own")
    assert driver.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    assert [line for line in (stdout + stderr).splitlines() if line.startswith("error:")] == [
        f"error: the sweep stopped: {reason}"], stderr[-3000:]
    assert json.loads(theirs.read_text()) == {"status": "FINISHED", "val_bpb": 1.0}
    trials = load(storage, "raced").trials
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.FAIL]
    assert trials[1].user_attrs["fail_reason"] == reason


def test_a_trial_that_cannot_be_started_ends_fail_saying_why(tmp_path):
    """Its folder cannot be made (a file in its place; so fails a full disk): the trial ends FAIL with the
    reason, where it had stayed RUNNING until another driver took it for dead, and the sweep stops with
    one error line."""
    storage, out = str(tmp_path / "study.journal"), tmp_path / "out"
    out.mkdir()
    (out / "0").write_text("")
    done = subprocess.run(driver_command(out, *SHORT, "sweep.n_trials=2", f"sweep.storage={storage}",
                                         "sweep.study_name=unstartable", "tracking.enabled=false"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    cause = f"FileExistsError: [Errno 17] File exists: '{out / '0'}'"
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, (done.stdout + done.stderr)[-3000:]
    assert [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")] == [
        f"error: the sweep stopped: a worker failed ({cause}); each trial's summary.json and output.log are "
        f"under {out}"], done.stderr[-3000:]
    [trial] = load(storage, "unstartable").trials
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_reason"] == f"it could not be started: {cause}"


# -----------------------------------------------------------------------------
# Supervised trials


def wait_for_training(driver: subprocess.Popen, metrics: Path) -> None:
    """Until the trial has logged metrics; at once, with the driver's output, if the sweep ends first."""
    wait_for(lambda: driver.poll() is not None or (metrics.exists() and metrics.stat().st_size > 0), 300,
             "the trial to start training")
    assert driver.poll() is None, driver.communicate()[0][-3000:]  # the sweep ended before it trained


# A trial's silence counts from its launch, and its process beats only once it has imported torch and
# opened its stores: seconds on a loaded two-core machine, where 6 s once killed a healthy trial.
GRACE = 15


@pytest.mark.slow
def test_a_silent_trial_is_killed_and_failed_with_the_reason(tmp_path, shared_study):
    storage, name = shared_study
    driver = subprocess.Popen(driver_command(tmp_path / "out", *LONG, "tracking.enabled=false", "sweep.n_trials=1",
                                             "sweep.heartbeat_interval=1", f"sweep.grace_period={GRACE}",
                                             f"sweep.storage={storage}", f"sweep.study_name={name}"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # training has started (metrics logged), so the trial's own heartbeat runs: then it goes silent
        wait_for_training(driver, tmp_path / "out" / "0" / "metrics.jsonl")
        trial = Process.parse(trial_attr(storage, name, "process"))
        os.kill(trial.pid, signal.SIGSTOP)  # alive, but silent
        output, _ = driver.communicate(timeout=300)
        assert driver.returncode == 0, output[-3000:]
        (trial_0,) = load(storage, name).get_trials(deepcopy=False)
        assert trial_0.state == TrialState.FAIL, output[-3000:]
        reason = f"killed by its driver: it sent no heartbeat for sweep.grace_period={GRACE} s"
        assert trial_0.user_attrs["fail_reason"] == reason
        assert "trial 0 FAIL after" in output and reason in output
        assert gone(trial)
    finally:
        driver.kill()


@pytest.mark.slow
def test_a_trial_past_its_timeout_is_killed_and_failed(tmp_path):
    storage = str(tmp_path / "study.journal")
    done = subprocess.run(driver_command(tmp_path / "out", *LONG, "tracking.enabled=false", "sweep.n_trials=1",
                                         "sweep.trial_timeout=8", f"sweep.storage={storage}",
                                         "sweep.study_name=slow"),
                          cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    (trial,) = load(storage, "slow").get_trials(deepcopy=False)
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs["fail_reason"] == "killed by its driver: it ran past sweep.trial_timeout=8 s"
    assert gone(Process.parse(trial.user_attrs["process"]))


@pytest.mark.slow
def test_a_trial_stops_when_its_driver_is_killed_and_the_next_driver_closes_its_runs(tmp_path, shared_study,
                                                                                    mlflow_store):
    from mlflow import MlflowClient

    storage, name = shared_study
    uri = mlflow_store
    args = [*LONG, "tracking.enabled=true", f"tracking.uri={uri}", "tracking.experiment=orphans",
            "sweep.n_trials=1", "sweep.heartbeat_interval=2", "sweep.grace_period=10", f"sweep.storage={storage}",
            f"sweep.study_name={name}"]
    driver = subprocess.Popen(driver_command(tmp_path / "first", *args), cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        # the driver is killed as soon as it has launched the trial: the trial is still starting up
        trial = Process.parse(wait_for(lambda: trial_attr(storage, name, "process"), 300, "the trial's launch"))
    finally:
        driver.kill()
        driver.wait()
    wait_for(lambda: gone(trial), 120, "the orphaned trial to exit")

    # the next driver of the study: the trial's end is recorded, no trial left RUNNING, and MLflow
    # holds one parent run, now ended, with the trial's run not left RUNNING
    done = subprocess.run(driver_command(tmp_path / "second", *args), cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    (trial_0,) = load(storage, name).get_trials(deepcopy=False)
    assert trial_0.state == TrialState.FAIL
    assert "driver" in trial_0.user_attrs["fail_reason"] or "exited" in trial_0.user_attrs["fail_reason"]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("orphans").experiment_id])
    parents = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert all(r.info.status in ("KILLED", "FAILED") for r in runs if r.data.tags.get("run_kind") != "sweep")


@pytest.mark.slow
def test_sweep_report_ends_the_parent_run_of_a_killed_driver_killed_once_no_driver_is_left(tmp_path, mlflow_store):
    """The study's only driver is killed (kill -9) while its trial trains, and no driver follows: its
    MLflow parent run once stayed RUNNING for good, as sweep_report ended only runs whose driver had
    recorded its end. While the driver lives, sweep_report leaves the run RUNNING."""
    from mlflow import MlflowClient

    storage = str(tmp_path / "study.journal")
    uri = mlflow_store
    args = [*LONG, "tracking.enabled=true", f"tracking.uri={uri}", "sweep.n_trials=1", f"sweep.storage={storage}",
            "sweep.study_name=killed"]
    driver = subprocess.Popen(driver_command(tmp_path / "out", *args), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    report = [sys.executable, "-m", "frontier.sweep_report", "study=killed", f"storage={storage}"]
    try:
        wait_for_training(driver, tmp_path / "out" / "0" / "metrics.jsonl")
        trial = Process.parse(trial_attr(storage, "killed", "process"))
        done = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        run_id = load(storage, "killed").user_attrs["mlflow_run_id"]
        client = MlflowClient(uri)
        assert client.get_run(run_id).info.status == "RUNNING"  # its driver still runs the sweep
    finally:
        driver.kill()
        driver.wait()
    wait_for(lambda: gone(trial), 120, "the orphaned trial to exit")
    done = subprocess.run(report, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"ended the sweep's MLflow run {run_id} KILLED" in done.stdout
    assert client.get_run(run_id).info.status == "KILLED"
    (trial_0,) = load(storage, "killed").get_trials(deepcopy=False)
    assert trial_0.state == TrialState.FAIL
    assert client.get_run(trial_0.user_attrs["mlflow_run_id"]).info.status == "KILLED"


# -----------------------------------------------------------------------------
# Two drivers of one PostgreSQL study: distinct proposals, one MLflow parent run


@pytest.mark.slow
def test_two_drivers_of_a_postgresql_study_propose_distinct_points_under_one_parent_run(tmp_path, mlflow_store):
    postgres = postgres_or_skip()
    from mlflow import MlflowClient

    name = f"test-drivers-{uuid.uuid4().hex[:8]}"
    uri = mlflow_store
    args = [*SHORT, "tracking.enabled=true", f"tracking.uri={uri}", "tracking.experiment=drivers",
            "sweep.n_trials=4", "sweep.min_relative_speed=0.01",  # other tests share the machine: no re-runs
            f"sweep.storage={POSTGRES}", f"sweep.study_name={name}"]
    try:
        drivers = [subprocess.Popen(driver_command(tmp_path / f"driver{i}", *args), cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
        for driver in drivers:
            output, _ = driver.communicate(timeout=600)
            assert driver.returncode == 0, output[-3000:]
        trials = optuna.load_study(study_name=name, storage=postgres).get_trials(deepcopy=False)
        assert sorted(t.number for t in trials) == [0, 1, 2, 3]
        assert all(t.state == TrialState.COMPLETE for t in trials)
        assert len({tuple(sorted(t.params.items())) for t in trials}) == 4  # no repeated proposal
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("drivers").experiment_id])
        parents = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED"
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id]
        assert sorted(r.info.run_name.split()[0] for r in children) == [f"trial-{n}" for n in range(4)]
        assert all(r.info.status == "FINISHED" for r in children)  # as COMPLETE in the study
    finally:
        optuna.delete_study(study_name=name, storage=postgres)


def drivers_ended(study: optuna.Study) -> list[bool]:
    """Whether each driver of the study recorded its end."""
    records = study._storage.get_study_system_attrs(study._study_id)
    return [record["ended"] for key, record in records.items() if key.startswith("driver:")]


@pytest.mark.slow
def test_a_driver_interrupted_as_its_sweep_starts_leaves_no_trial_running(tmp_path):
    """SIGTERM the moment the sweep starts, its workers starting or not: exit 130, no traceback, the
    report written, the driver recorded as ended and no trial left RUNNING."""
    storage = str(tmp_path / "study.journal")
    driver = subprocess.Popen(driver_command(tmp_path / "out", *LONG, "tracking.enabled=false", "sweep.n_trials=2",
                                             f"sweep.storage={storage}", "sweep.study_name=early"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in driver.stdout:
            lines.append(line)
            if "sweep 'early':" in line:
                driver.send_signal(signal.SIGTERM)
                break
        output = "".join(lines) + driver.communicate(timeout=300)[0]
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    study = load(storage, "early")
    assert all(t.state == TrialState.FAIL for t in study.get_trials(deepcopy=False))
    assert (tmp_path / "out" / "report" / "report.md").exists()
    assert drivers_ended(study) == [True]


@pytest.mark.slow
@pytest.mark.parametrize("signals, sigint_ignored", [([signal.SIGTERM], False), ([signal.SIGTERM, signal.SIGINT], False),
                                                     ([signal.SIGINT, signal.SIGTERM], True)],
                         ids=["once", "twice", "sigint-ignored-by-its-shell"])
def test_an_interrupted_driver_stops_its_trial_records_why_and_exits_130(tmp_path, signals, sigint_ignored):
    """Preemption or Ctrl-C; a second signal (an impatient user) kills the trial at once, and the
    trial, the report and the driver's end are still recorded. A driver started with SIGINT ignored
    (`cmd &` in a script) keeps ignoring it."""
    storage = str(tmp_path / "study.journal")
    driver = subprocess.Popen(driver_command(tmp_path / "out", *LONG, "tracking.enabled=false", "sweep.n_trials=1",
                                             f"sweep.storage={storage}", "sweep.study_name=stopped"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None)
    try:
        wait_for_training(driver, tmp_path / "out" / "0" / "metrics.jsonl")
        trial = Process.parse(trial_attr(storage, "stopped", "process"))
        for signum in signals:
            driver.send_signal(signum)
            time.sleep(0.1)
            if sigint_ignored and signum == signal.SIGINT:
                time.sleep(3)
                assert driver.poll() is None and not gone(trial)
        output, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    study = load(storage, "stopped")
    (trial_0,) = study.get_trials(deepcopy=False)
    assert trial_0.state == TrialState.FAIL
    assert trial_0.user_attrs["fail_reason"] == "stopped by its driver (interrupted)"
    assert gone(trial)
    assert (tmp_path / "out" / "report" / "report.md").exists()
    assert drivers_ended(study) == [True]
    if len(signals) == 1 or sigint_ignored:
        summary = json.loads((tmp_path / "out" / "0" / "summary.json").read_text())
        assert summary["status"] == "KILLED"  # the trial ended itself at a step boundary
        assert (tmp_path / "out" / "0" / "resume.pt").exists()
    if len(signals) == 1:  # resume= of that trial: one sentence, where it was stopped again every time
        run_dir = tmp_path / "out" / "0"
        records = [path for path in run_dir.iterdir() if path.is_file()]  # Hydra's record of commands aside
        before = {path: path.read_bytes() for path in records}
        again = subprocess.run([sys.executable, "-m", "frontier.train", f"resume={run_dir}"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 2 and "Traceback" not in again.stderr, again.stderr[-3000:]
        assert again.stderr.splitlines()[-1].startswith(
            f"error: resume={run_dir} is not allowed: it is trial 0 of study 'stopped', which has ended FAIL "
            "(stopped by its driver (interrupted)) and takes no more reports; run its sweep again for new trials, "
            "or train these settings as a run of their own: python -m frontier.train "), again.stderr[-3000:]
        assert {path: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before
        assert [p.name for p in (run_dir / ".hydra").iterdir() if p.is_dir()] == []  # no record of a resume


# A test-only sitecustomize.py for the trials: a run's end reaches its first sink (metrics.jsonl) 5 s
# after summary.json, as it can reach a slow MLflow store, before the trial tells the study.
SLOW_END = """
import time
from frontier.observers import MetricsFile

real = MetricsFile.on_end

def slow(self, *args):
    time.sleep(5)
    real(self, *args)

MetricsFile.on_end = slow
"""


@pytest.mark.slow
def test_a_driver_interrupted_while_its_trial_records_its_end_keeps_that_trials_value(tmp_path):
    """Ctrl-C to the driver after the trial's summary.json says FINISHED, while its sinks are told: the
    driver does not record it FAIL ("interrupted") over the value it is about to report."""
    storage, out = str(tmp_path / "study.journal"), tmp_path / "out"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_END)
    driver = subprocess.Popen(driver_command(out, *SHORT, "tracking.enabled=false", "sweep.n_trials=1",
                                             f"sweep.storage={storage}", "sweep.study_name=ending"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])})
    try:
        wait_for(lambda: driver.poll() is not None or (out / "0" / "summary.json").exists(), 300,
                 "the trial's summary.json")
        driver.send_signal(signal.SIGINT)
        output, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 130, output[-3000:]
    summary = json.loads((out / "0" / "summary.json").read_text())
    (trial,) = load(storage, "ending").trials
    assert summary["status"] == "FINISHED" and trial.state == TrialState.COMPLETE, (trial.user_attrs, output[-3000:])
    assert trial.value == pytest.approx(summary["val_bpb"])


def tracked_sweep(tmp_path: Path, template_db: Path, study: str,
                  site_code: str = MLFLOW_SIGNAL) -> tuple[str, str, list[str], dict]:
    """A one-trial sweep tracked in a SQLite store of its own: its store, journal, command, and an
    environment that runs `site_code` as it starts (by default: FRONTIER_TEST_MLFLOW_SIGNAL signals it
    inside an MLflow call)."""
    uri = store_in(tmp_path, template_db)
    storage = str(tmp_path / "study.journal")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(site_code)
    command = driver_command(tmp_path / "out", *SHORT, "tracking.enabled=true", f"tracking.uri={uri}",
                             "sweep.n_trials=1", f"sweep.storage={storage}", f"sweep.study_name={study}")
    return uri, storage, command, {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["create_run:1", "log_batch:1"])
def test_sigterm_while_the_parent_run_is_created_ends_it_killed_and_the_study_keeps_it(tmp_path, template_db,
                                                                                        moment):
    """SIGTERM as the sweep's MLflow parent run is created (create_run:1: it exists in the store, its
    id not yet returned) or takes its params: such a run once stayed RUNNING for good, unknown to the
    study, and the study's next driver opened a second parent run."""
    from mlflow import MlflowClient

    uri, storage, command, env = tracked_sweep(tmp_path, template_db, "signalled")
    done = subprocess.run(command, cwd=ROOT, env={**env, "FRONTIER_TEST_MLFLOW_SIGNAL": moment}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    client = MlflowClient(uri)
    (parent,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert parent.data.tags["run_kind"] == "sweep" and parent.info.status == "KILLED", moment
    study = load(storage, "signalled")
    assert study.user_attrs["mlflow_run_id"] == parent.info.run_id  # the next driver reopens it
    assert not study.trials and drivers_ended(study) == [True]


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["create_run:1:SIGKILL", "log_batch:1:SIGKILL"])
def test_a_driver_killed_as_it_makes_the_parent_run_leaves_one_run_the_next_driver_continues(tmp_path, template_db,
                                                                                             moment):
    """kill -9 as the parent run is created: the run is in the store, its id nowhere in the study. The
    next driver opened a second parent run and the first stayed RUNNING for good."""
    from mlflow import MlflowClient

    uri, storage, command, env = tracked_sweep(tmp_path, template_db, "orphan")
    killed = subprocess.run(command, cwd=ROOT, env={**env, "FRONTIER_TEST_MLFLOW_SIGNAL": moment},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "mlflow_run_id" not in load(storage, "orphan").user_attrs  # the run was made, and never recorded

    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [run for run in runs if run.data.tags.get("run_kind") == "sweep"]
    assert parent.info.status == "FINISHED"
    assert load(storage, "orphan").user_attrs["mlflow_run_id"] == parent.info.run_id
    assert [run.data.tags.get("mlflow.parentRunId") for run in runs if run is not parent] == [parent.info.run_id]


# A test-only sitecustomize.py: the tracking store fails every MlflowClient.log_batch, as one that goes away
# between the command line's check and the sweep's start.
FAILING_LOG_BATCH = """
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

def failing(self, *args, **kwargs):
    raise MlflowException("the store went away")

MlflowClient.log_batch = failing
"""


@pytest.mark.slow
def test_a_store_failing_as_the_parent_run_starts_is_one_error_line_and_the_run_ends_failed(tmp_path, template_db):
    """The store fails while the sweep's parent run takes its params: this was a traceback, with the
    run left RUNNING, no report and the driver never recorded as ended."""
    from mlflow import MlflowClient

    uri, storage, command, env = tracked_sweep(tmp_path, template_db, "failing", FAILING_LOG_BATCH)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: the sweep stopped before its first trial: tracking.uri={uri} could not start the "
                      "sweep's MLflow run (MlflowException: the store went away)"], output[-3000:]
    (parent,) = MlflowClient(uri).search_runs([e.experiment_id for e in MlflowClient(uri).search_experiments()])
    assert parent.info.status == "FAILED"
    study = load(storage, "failing")
    assert study.user_attrs["mlflow_run_id"] == parent.info.run_id
    assert not study.trials and drivers_ended(study) == [True]
    assert (tmp_path / "out" / "report" / "report.md").exists()


@pytest.mark.slow
def test_a_sweep_stopped_by_max_failures_is_one_error_line_and_a_failed_parent_run(tmp_path, mlflow_store):
    """Every trial diverges: the sweep stops after the first (sweep.max_failures=0), says why in one
    line, exits 1, and its MLflow parent run ends FAILED."""
    from mlflow import MlflowClient

    uri = mlflow_store
    # four steps whatever the machine's speed: fewer (a busy CPU within budget.seconds=5) may not diverge
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", *TINY, "budget.seconds=600",
                           "budget.max_steps=4", "sweep=custom", "sweep.sampler=grid", "sweep.pruner=none",
                           "optim.matrix_lr=1e9,2e9",
                           "sweep.max_failures=0", f"sweep.storage={tmp_path / 'study.journal'}",
                           "tracking.enabled=true", f"tracking.uri={uri}", "tracking.experiment=failures",
                           f"hydra.sweep.dir={tmp_path / 'out'}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: the sweep stopped early: 1 trials failed (sweep.max_failures=0); see each trial's output.log "
        f"under {tmp_path / 'out'}")
    assert [line for line in output.splitlines() if line.startswith("error:")] == [done.stderr.strip()
                                                                                  .splitlines()[-1]]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("failures").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
    assert parent.info.status == "FAILED"


# -----------------------------------------------------------------------------
# The sweep's end: each step tried, whatever became of the one before


@pytest.mark.slow
@pytest.mark.parametrize("end", ["finished", "interrupted"])
def test_a_tracking_server_gone_when_the_sweep_ends_is_a_warning_and_sweep_report_ends_the_run(
        tmp_path, template_db, end):
    """The MLflow server dies while the trial trains; the sweep then ends (its trial finished, or
    SIGTERM): the report is written, the driver recorded ended, the exit code is the
    sweep's, and one warning names the command that later ends the parent run."""
    from mlflow import MlflowClient

    server = Server(tmp_path, template_db)
    server.start()
    storage = str(tmp_path / "study.journal")
    args = [*LONG, "tracking.enabled=true", f"tracking.uri={server.url}", "tracking.experiment=down",
            "tracking.flush_seconds=2", "sweep.n_trials=1", f"sweep.storage={storage}", "sweep.study_name=down",
            *(["budget.seconds=8"] if end == "finished" else [])]  # it trains on past the server's end
    try:
        driver = subprocess.Popen(driver_command(tmp_path / "out", *args), cwd=ROOT, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            wait_for_training(driver, tmp_path / "out" / "0" / "metrics.jsonl")
            server.kill()
            if end == "interrupted":
                driver.send_signal(signal.SIGTERM)
            output, _ = driver.communicate(timeout=300)
        finally:
            driver.kill()
        assert driver.returncode == {"finished": 0, "interrupted": 130}[end], output[-3000:]
        assert "Traceback" not in output, output[-3000:]
        study = load(storage, "down")
        assert drivers_ended(study) == [True]
        assert (tmp_path / "out" / "report" / "report.md").exists()
        redo = f"python -m frontier.sweep_report study=down storage={storage}"
        (warning,) = [line for line in output.splitlines() if "could not end the sweep's MLflow run" in line]
        assert redo in warning, warning

        server.start()
        run_id = study.user_attrs["mlflow_run_id"]
        client = MlflowClient(server.url)
        assert client.get_run(run_id).info.status == "RUNNING"
        done = subprocess.run([sys.executable, *redo.split()[1:]], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        status = {"finished": "FINISHED", "interrupted": "KILLED"}[end]
        assert client.get_run(run_id).info.status == status
        assert "report/report.md" in [a.path for a in client.list_artifacts(run_id, "report")]
    finally:
        server.kill()


@pytest.mark.slow
def test_a_report_that_cannot_be_written_is_a_warning_and_the_sweep_still_ends(tmp_path, mlflow_store):
    from mlflow import MlflowClient

    storage, uri = str(tmp_path / "study.journal"), mlflow_store
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "report").write_text("")  # a file where the report's folder goes
    done = subprocess.run(driver_command(tmp_path / "out", *SHORT, "sweep.n_trials=1", f"sweep.storage={storage}",
                                         "sweep.study_name=unwritable", "tracking.enabled=true",
                                         f"tracking.uri={uri}", "tracking.experiment=unwritable"),
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    (warning,) = [line for line in output.splitlines() if "could not write the report" in line]
    assert f"python -m frontier.sweep_report study=unwritable storage={storage} out={tmp_path / 'out' / 'report'}" \
        in warning
    assert drivers_ended(load(storage, "unwritable")) == [True]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("unwritable").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
    assert parent.info.status == "FINISHED"


# -----------------------------------------------------------------------------
# The study's storage gone mid-sweep


@pytest.fixture(params=["journal", "postgresql"])
def doomed_storage(request, tmp_path):
    """(storage, delete): a storage of its own and how to make it vanish — the journal's folder
    removed, or a PostgreSQL database of its own dropped (skipped, saying why, with no server)."""
    if request.param == "journal":
        folder = tmp_path / "store"
        folder.mkdir()

        def remove():  # renamed first, at once: the sweep's lock files, made meanwhile, cannot stop an rmtree
            folder.rename(tmp_path / "removed")
            shutil.rmtree(tmp_path / "removed")

        yield str(folder / "study.journal"), remove
        return
    postgres_or_skip()
    from sqlalchemy import create_engine, text

    from frontier.paths import database_url

    database = f"frontier_fault_{uuid.uuid4().hex[:8]}"
    server = POSTGRES.rsplit("/", 1)[0]
    admin = create_engine(database_url(f"{server}/postgres"), isolation_level="AUTOCOMMIT")

    def drop():
        with admin.connect() as conn:  # FORCE: the sweep's open connections too
            conn.execute(text(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)"))

    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {database}"))
    try:
        yield f"{server}/{database}", drop
    finally:
        drop()
        admin.dispose()


@pytest.mark.slow
def test_a_storage_gone_mid_sweep_is_one_error_line_and_keeps_the_finished_trials(tmp_path, doomed_storage,
                                                                                  mlflow_store):
    """The study's storage vanishes while trial 1 trains, trial 0 done: exit 1 with one line naming the
    storage, no traceback, the running trial stopped (KILLED, not orphaned), the MLflow parent run
    ended FAILED, and trial 0's result kept in MLflow and its summary.json; no journal made anew."""
    from mlflow import MlflowClient

    storage, delete = doomed_storage
    uri = mlflow_store
    out = tmp_path / "out"
    driver = subprocess.Popen(driver_command(out, *SHORT, "sweep.n_trials=4", "sweep.heartbeat_interval=1",
                                             f"sweep.storage={storage}", "sweep.study_name=gone",
                                             "tracking.enabled=true", f"tracking.uri={uri}",
                                             "tracking.experiment=gone"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_training(driver, out / "1" / "metrics.jsonl")
        delete()
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert errors == [stderr.strip().splitlines()[-1]], stderr[-3000:]
    assert errors[0].startswith(f"error: the sweep stopped: its storage {storage} failed ("), errors[0]
    if "://" not in storage:
        assert not Path(storage).exists()  # not a new journal holding only the driver's last records

    client = MlflowClient(uri)
    runs = {r.info.run_name.split()[0]: r for r in client.search_runs([client.get_experiment_by_name("gone").experiment_id])}
    assert runs["sweep-gone"].info.status == "FAILED"
    first = json.loads((out / "0" / "summary.json").read_text())
    assert first["status"] == "FINISHED" and runs["trial-0"].info.status == "FINISHED"
    assert runs["trial-0"].data.metrics["val_bpb"] == pytest.approx(first["val_bpb"])
    running = json.loads((out / "1" / "summary.json").read_text())
    assert running["status"] in ("KILLED", "FINISHED"), (running, (out / "1" / "output.log").read_text()[-3000:])
    assert runs["trial-1"].info.status == running["status"]
    assert not (out / "2").exists()  # no trial launched after the storage went


# -----------------------------------------------------------------------------
# A trial ended in the study by a driver while its process still trains


@pytest.mark.slow
@pytest.mark.parametrize("cadence", [["budget.max_steps=60"], ["budget.max_steps=100000", "eval.every_fraction=0"]],
                         ids=["at its next checkpoint", "without periodic evaluations"])
def test_a_trial_ended_by_a_driver_while_it_trains_stops_killed_and_counts_as_failed(tmp_path, cadence, mlflow_store):
    """Another driver of the study takes trial 0 for stale and ends it FAIL while it trains: its
    process stops KILLED at its next checkpoint, or within seconds when it makes none (resume.pt
    written, exit 130, its MLflow run KILLED), not FAILED with exit 0; the study keeps that driver's
    reason, and with sweep.max_failures=0 the sweep exits 1 naming the failure (not the n_trials it
    also reached)."""
    from mlflow import MlflowClient

    from frontier.study import STALE_REASON, end_trial

    storage, uri, out = str(tmp_path / "study.journal"), f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "out"
    driver = subprocess.Popen(driver_command(out, "budget.seconds=600", *cadence, "sweep.n_trials=1",
                                             "sweep.max_failures=0", f"sweep.storage={storage}",
                                             "sweep.study_name=ended", "tracking.enabled=true",
                                             f"tracking.uri={uri}", "tracking.experiment=ended"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_training(driver, out / "0" / "metrics.jsonl")
        study = load(storage, "ended")
        (trial,) = study.get_trials(deepcopy=False)
        assert end_trial(study, trial._trial_id, TrialState.FAIL, None, {"fail_reason": STALE_REASON})
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 1, stderr[-3000:]
    assert "Traceback" not in stdout + stderr, (stdout + stderr)[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"error: the sweep stopped early: 1 trials failed (sweep.max_failures=0); see each trial's output.log "
        f"under {out}")
    (trial_0,) = load(storage, "ended").get_trials(deepcopy=False)
    assert trial_0.state == TrialState.FAIL and trial_0.user_attrs["fail_reason"] == STALE_REASON
    summary = json.loads((out / "0" / "summary.json").read_text())
    assert summary["status"] == "KILLED", summary
    assert summary["error"] == f"trial 0 was ended FAIL in the study ({STALE_REASON})"
    assert (out / "0" / "resume.pt").exists()
    client = MlflowClient(uri)
    runs = {r.info.run_name.split()[0]: r for r in client.search_runs([client.get_experiment_by_name("ended").experiment_id])}
    assert runs["trial-0"].info.status == "KILLED" and runs["sweep-ended"].info.status == "FAILED"


# -----------------------------------------------------------------------------
# A full disk


@pytest.mark.slow
def test_a_sweep_on_a_full_disk_is_one_line_and_leaves_no_empty_journal(tmp_path, small_disk):
    """Its journal, or its folder, on a disk with no space left: one sentence, exit 2, before a study is
    made; tracebacks from deep inside had ended the sweep (exit 1), leaving an empty journal, or a study
    whose driver never ended."""
    filler = fill(small_disk)
    journal = small_disk / "study.journal"
    on_disk = subprocess.run(driver_command(tmp_path / "out", *SHORT, "sweep.n_trials=1", f"sweep.storage={journal}",
                                            "tracking.enabled=false"), cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert on_disk.returncode == 2 and "Traceback" not in on_disk.stderr, on_disk.stderr[-3000:]
    assert on_disk.stderr.splitlines()[-1] == (
        f"error: sweep.storage='{journal}' cannot be written (OSError: [Errno 28] No space left on device); free space "
        "there or give another storage"), on_disk.stderr[-3000:]
    assert not journal.exists() and not (tmp_path / "out").exists()  # (its lock file stays, as beside any journal)

    storage = tmp_path / "study.journal"
    out = small_disk / "out"
    folder_full = subprocess.run(driver_command(out, *SHORT, "sweep.n_trials=1", f"sweep.storage={storage}",
                                                "sweep.study_name=full", "tracking.enabled=false"),
                                 cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert folder_full.returncode == 2 and "Traceback" not in folder_full.stdout + folder_full.stderr, (
        folder_full.stdout + folder_full.stderr)[-3000:]
    assert folder_full.stderr.splitlines()[-1] == (
        f"error: hydra.sweep.dir={out} is not allowed: it cannot be written (OSError: [Errno 28] No space left on "
        "device)"), folder_full.stderr[-3000:]
    assert not storage.exists()  # no study was created
    filler.unlink()


@pytest.mark.slow
def test_a_journal_whose_disk_filled_mid_sweep_goes_on_when_run_again(tmp_path, small_disk):
    """The disk fills while trial 1 trains: the sweep stops with one line; once there is space, the same
    command goes on with the study. A record cut short by the full disk had been glued to the next
    driver's first one, and every read of the study failed from then on: its finished trial was lost."""
    journal = small_disk / "study.journal"
    command = driver_command(tmp_path / "out", *SHORT, "sweep.n_trials=3", "sweep.heartbeat_interval=1",
                             f"sweep.grace_period={GRACE}", f"sweep.storage={journal}", "sweep.study_name=filled",
                             "tracking.enabled=false")
    driver = subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_training(driver, tmp_path / "out" / "1" / "metrics.jsonl")
        filler = fill(small_disk)
        _, stderr = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.splitlines()[-1].startswith(f"error: the sweep stopped: its storage {journal} failed ("), stderr[-3000:]
    first = load(str(journal), "filled").trials[0]
    assert first.state == TrialState.COMPLETE

    filler.unlink()
    time.sleep(GRACE + 1)  # trial 1's heartbeats are stale: the next driver fails it, once
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(json.loads(line) for line in journal.read_bytes().splitlines())  # each line a whole record
    trials = load(str(journal), "filled").trials
    assert len(trials) == 3 and trials[0].state == TrialState.COMPLETE and trials[0].value == first.value


@pytest.mark.slow
def test_two_studies_started_into_one_sweep_folder_at_once_run_one_and_refuse_the_other(tmp_path):
    """Both passed the check of the folder's trial records before either wrote one: the first sweep wrote
    over the other's trial 0 (its output.log) and went on."""
    out = tmp_path / "out"
    drivers = {name: subprocess.Popen(driver_command(out, *SHORT, "sweep.n_trials=1", "tracking.enabled=false",
                                                     f"sweep.storage={tmp_path / name}.journal",
                                                     f"sweep.study_name={name}"),
                                      cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for name in ("first", "second")}
    ended = {name: (driver.communicate(timeout=300), driver.returncode) for name, driver in drivers.items()}
    codes = sorted(code for _, code in ended.values())
    assert codes == [0, 2], {name: (code, err[-2000:]) for name, ((_, err), code) in ended.items()}
    [(ran, _)] = [(name, err) for name, ((_, err), code) in ended.items() if code == 0]
    [(refused, err)] = [(name, err) for name, ((_, err), code) in ended.items() if code == 2]
    assert err.splitlines()[-1] == (
        f"error: hydra.sweep.dir={out} is not allowed: it holds the trials of study {ran!r}, which the trials of "
        f"study {refused!r} would write over; give this sweep a directory of its own"), err[-3000:]
    assert not (tmp_path / f"{refused}.journal").exists() or not load(str(tmp_path / f"{refused}.journal"),
                                                                       refused).trials
    assert (out / ".study").read_text() == f"{ran}\n"
    assert json.loads((out / "0" / "summary.json").read_text())["status"] == "FINISHED"


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", ["30m"], indirect=True)  # room for the trials once the filler is gone
def test_a_trial_failed_on_a_full_disk_stops_the_sweep_uncounted_and_the_same_command_with_space_finishes(
        tmp_path, small_disk, mlflow_store):
    """The disk of the sweep's folder fills while trial 0 trains: the sweep stops there with one line naming
    the folder, exit 1, its MLflow run FAILED, and trial 0 does not count; given space, the same command
    finishes the study with its n_trials. Every later trial had failed the same way, counted, and the sweep
    ended FINISHED with exit 0 (the disk looked full no more once a failed write's file was gone), so that no
    rerun could get those trials back."""
    from mlflow import MlflowClient

    out = small_disk / "out"
    journal = str(tmp_path / "study.journal")
    command = driver_command(out, "budget.seconds=8", "sweep.n_trials=1", f"sweep.storage={journal}",
                             "sweep.study_name=nospace", "tracking.enabled=true", f"tracking.uri={mlflow_store}",
                             "tracking.experiment=nospace")
    driver = subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for_training(driver, out / "0" / "metrics.jsonl")
        filler = fill(small_disk)
        stdout, stderr = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 1 and "Traceback" not in stdout + stderr, stderr[-3000:]
    errors = [line for line in (stdout + stderr).splitlines() if line.startswith("error:")]
    assert errors == [stderr.splitlines()[-1]], stderr[-3000:]
    assert errors[0].startswith(f"error: the sweep stopped: the disk of its folder {out} is full (trial 0 failed: ")
    assert errors[0].endswith("the same command goes on with the study, without counting that trial")
    study = load(journal, "nospace")
    assert [t.state for t in study.trials] == [TrialState.FAIL] and list(study.user_attrs["uncounted"]) == ["0"]
    client = MlflowClient(mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("nospace").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("run_kind") == "sweep"]
    assert parent.info.status == "FAILED"

    filler.unlink()
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    states = [t.state for t in load(journal, "nospace").trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE], again.stderr[-3000:]


@pytest.mark.slow
def test_a_trial_killed_from_outside_carries_its_reason_into_its_mlflow_run(tmp_path, mlflow_store):
    """kill -9 of a trial's process: FAIL with its reason in the study, and its MLflow run KILLED with that
    reason as its `error` tag (it had none)."""
    from mlflow import MlflowClient

    journal = str(tmp_path / "study.journal")
    driver = subprocess.Popen(driver_command(tmp_path / "out", *LONG, "sweep.n_trials=1", f"sweep.storage={journal}",
                                             "sweep.study_name=killed", "tracking.enabled=true",
                                             f"tracking.uri={mlflow_store}", "tracking.experiment=killed"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_training(driver, tmp_path / "out" / "0" / "metrics.jsonl")
        wait_for(lambda: trial_attr(journal, "killed", "mlflow_run_id"), 60, "the trial's MLflow run")
        os.kill(Process.parse(trial_attr(journal, "killed", "process")).pid, signal.SIGKILL)
        output, _ = driver.communicate(timeout=300)
    finally:
        driver.kill()
    assert driver.returncode == 0, output[-3000:]
    (trial,) = load(journal, "killed").trials
    assert trial.state == TrialState.FAIL and trial.user_attrs["fail_reason"].startswith("killed by SIGKILL")
    run = MlflowClient(mlflow_store).get_run(trial.user_attrs["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags.get("error") == trial.user_attrs["fail_reason"]
