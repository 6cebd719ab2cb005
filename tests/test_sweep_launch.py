"""Sweep trials dispatched through a Hydra launcher (`hydra/launcher=submitit_local` here; the same
code submits to SLURM with `submitit_slurm`): each trial is a submitit job running frontier.train's
task function, reporting its checkpoints to the shared storage, so pruning and the study's values
work as with the built-in workers."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.trial import TrialState, create_trial

from frontier.config import ConfigError
from frontier.study import open_storage
from hydra_plugins.frontier_sweeper._objective import composite

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")

from tests.conftest import ROOT, SWEEP_TINY as TINY

optuna.logging.set_verbosity(optuna.logging.WARNING)


def launched_sweep(out: Path, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", *TINY, "hydra/launcher=submitit_local",
                           *args, f"hydra.sweep.dir={out}"], cwd=ROOT, text=True, timeout=600,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    return done


@pytest.mark.slow
def test_submitit_local_trials_report_to_the_study_and_get_their_composite_values(tmp_path):
    storage = str(tmp_path / "study.journal")
    done = launched_sweep(tmp_path / "out", "sweep=lr", "sweep.sampler=random", "sweep.pruner=hyperband",
                          "sweep.objective=composite", "sweep.n_trials=2", f"sweep.storage={storage}",
                          "sweep.study_name=launched")
    study = optuna.load_study(study_name="launched", storage=open_storage(storage))
    trials = study.get_trials(deepcopy=False)
    assert [t.number for t in trials] == [0, 1]
    assert trials[0].state == TrialState.COMPLETE  # the first of a hyperband bracket is never pruned
    assert trials[1].state in (TrialState.COMPLETE, TrialState.PRUNED)
    for trial in trials:
        assert trial.value is not None and 1 in trial.intermediate_values  # checkpoints reached the storage
        assert trial.user_attrs["checkpoint_fractions"]["1"] >= 0.25
        run_dir = tmp_path / "out" / str(trial.number)
        assert (run_dir / "summary.json").exists() and (run_dir / "output.log").stat().st_size > 0
        assert f"trial {trial.number} is LocalLauncher job" in done.stdout
    first = trials[0]
    assert first.value == pytest.approx(composite(first.user_attrs["val_bpb"], first.user_attrs["core"],
                                                  [1.5, 0.8], [0.0, 0.25]))
    assert any((tmp_path / "out" / ".submitit").iterdir())  # the jobs' own folders
    # the job learnt its driver, and its worker's device share, from hydra.job.env_set
    env_set = OmegaConf.load(tmp_path / "out" / "0" / ".hydra" / "hydra.yaml").hydra.job.env_set
    assert {"FRONTIER_SWEEP_DRIVER", "OMP_NUM_THREADS"} <= set(env_set)


@pytest.mark.slow
def test_submitit_local_trial_is_pruned_through_the_shared_storage(tmp_path, shared_study):
    storage, name = shared_study
    # A finished trial far better than any tiny run: successive halving prunes the next at checkpoint 1.
    study = optuna.create_study(study_name=name, storage=open_storage(storage))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.1, intermediate_values={1: 0.1, 2: 0.1, 3: 0.1},
                                 system_attrs={"completed_rung_0": 0.1, "completed_rung_1": 0.1}))
    launched_sweep(tmp_path / "out", "sweep=lr", "sweep.sampler=random", "sweep.pruner=successive_halving",
                   "sweep.n_trials=2", f"sweep.storage={storage}", f"sweep.study_name={name}")
    trial = optuna.load_study(study_name=name, storage=open_storage(storage)).trials[1]
    assert trial.state == TrialState.PRUNED, trial.user_attrs
    assert list(trial.intermediate_values) == [1]
    assert trial.user_attrs["checkpoint_fractions"]["1"] >= 0.25  # where it was measured, at or past the mark
    assert trial.user_attrs["prune_reason"].startswith("pruned at checkpoint 1")


@pytest.mark.slow
def test_a_launched_trial_past_its_timeout_is_cancelled_and_recorded_with_why(tmp_path):
    storage = str(tmp_path / "study.journal")
    done = launched_sweep(tmp_path / "out", "sweep=lr", "sweep.sampler=random", "sweep.pruner=none",
                          "sweep.n_trials=1", "sweep.trial_timeout=2", "budget.max_steps=100000",  # runs past it
                          f"sweep.storage={storage}",
                          "sweep.study_name=slow")
    trial = optuna.load_study(study_name="slow", storage=open_storage(storage)).trials[0]
    assert trial.state == TrialState.FAIL, done.stdout[-3000:]
    assert trial.user_attrs["fail_reason"] == "killed by its driver: it ran past sweep.trial_timeout=2 s"
    # the driver moved on once the job ended, not waiting for the result a cancelled job never writes
    log = (tmp_path / "out" / "0" / "output.log").read_text()
    assert log.rstrip().endswith("job ended without a result: RuntimeError: it was cancelled before it returned")


# The trn2 line of docs/sweeps.md, as Hydra composes it.
TRN2 = ["hydra/launcher=submitit_slurm", "hydra.launcher.partition=trn2", "hydra.launcher.timeout_min=60",
        "hydra.launcher.cpus_per_task=32", "+hydra.launcher.additional_parameters.exclusive=true"]


def test_the_readme_slurm_line_submits_one_job_per_trial(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from hydra_plugins.frontier_sweeper._launch import LaunchedTrials, is_builtin, submitit_executor

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TRN2, f"hydra.sweep.dir={tmp_path}"], return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    assert not is_builtin(launcher)
    if shutil.which("srun") is None:  # no SLURM here: one sentence, before any trial
        with pytest.raises(ConfigError, match="hydra/launcher=submitit_slurm is not usable here"):
            LaunchedTrials(launcher, 1)
        fake = tmp_path / "bin"
        fake.mkdir()
        (fake / "srun").write_text("#!/bin/sh\n")
        (fake / "srun").chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert not LaunchedTrials(launcher, 1).local  # SLURM gives each job its devices
    script = submitit_executor(launcher)._executor._make_submission_file_text("python -m x", "uid")
    for line in ("#SBATCH --partition=trn2", "#SBATCH --exclusive", "#SBATCH --cpus-per-task=32",
                 "#SBATCH --time=60"):
        assert line in script
    with pytest.raises(ConfigError, match="sweep.devices_per_trial=2 is not allowed with a Hydra launcher"):
        LaunchedTrials(launcher, 2)


def test_any_other_launcher_runs_one_trial_per_launch_pinned_to_its_worker(tmp_path):
    """submitit_local gives every job the same CUDA_VISIBLE_DEVICES, so the worker's own devices
    travel in hydra.job.env_set, which Hydra applies in the job before the task function."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.plugins.launcher import Launcher

    from hydra_plugins.frontier_sweeper._launch import JobWatch, LaunchedTrials

    class Recording(Launcher):
        def __init__(self, status):
            self.status, self.calls = status, []

        def setup(self, **kwargs):
            pass

        def launch(self, job_overrides, initial_job_idx):
            self.calls.append((list(job_overrides[0]), initial_job_idx))
            failed = self.status == JobStatus.FAILED
            return [JobReturn(status=self.status, _return_value=RuntimeError("boom") if failed else 1.0)]

    run_dir = tmp_path / "7"
    run_dir.mkdir()
    launcher = Recording(JobStatus.COMPLETED)
    watch = JobWatch(None, None, trial_timeout=60, grace_period=120, heartbeat_interval=30)
    assert LaunchedTrials(launcher, 1).run(["model=tiny"], 7, run_dir, {"CUDA_VISIBLE_DEVICES": "1"}, watch) == (0, None)
    overrides, number = launcher.calls[0]
    assert number == 7 and overrides[0] == "model=tiny"
    assert {f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=7",
            "++hydra.job.env_set.CUDA_VISIBLE_DEVICES=1"} <= set(overrides)
    assert LaunchedTrials(Recording(JobStatus.FAILED), 1).run([], 7, run_dir, {}, watch) == (1, None)
    assert (run_dir / "output.log").read_text().splitlines()[-1] == "error: RuntimeError: boom"


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_trial_queued_behind_a_blocking_launcher_is_not_taken_for_dead(tmp_path):
    """Launchers such as Ray's return from launch() only when the job has ended; while it waits in
    their queue, the driver's other workers must not fail it for silence."""
    import threading
    import time

    from hydra.core.utils import JobReturn, JobStatus
    from hydra.plugins.launcher import Launcher

    from frontier.study import settle_orphans
    from hydra_plugins.frontier_sweeper._launch import JobWatch, LaunchedTrials

    storage = open_storage(str(tmp_path / "study.journal"), heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="queued", storage=storage)
    trial = study.ask()
    storage.record_heartbeat(trial._trial_id)  # as the driver does when it launches a trial

    class Queueing(Launcher):
        def setup(self, **kwargs):
            pass

        def launch(self, job_overrides, initial_job_idx):
            time.sleep(5)  # queued well past grace_period, then the job runs and ends
            return [JobReturn(status=JobStatus.COMPLETED, _return_value=1.0)]

    watch = JobWatch(study, trial, trial_timeout=60, grace_period=2, heartbeat_interval=1)
    launched = threading.Thread(target=LaunchedTrials(Queueing(), 1).run, args=([], 0, tmp_path, {}, watch))
    launched.start()
    settled = []
    while launched.is_alive():
        settled += settle_orphans(study)  # what the driver's other workers do before each trial
        time.sleep(0.5)
    launched.join()
    assert settled == [] and study.get_trials()[0].state == TrialState.RUNNING
