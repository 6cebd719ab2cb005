"""Sweep trials dispatched through a Hydra launcher (`hydra/launcher=submitit_local` here; the same
code submits to SLURM with `submitit_slurm`): each trial is a submitit job running frontier.train's
task function, reporting its checkpoints to the shared storage, so pruning and the study's values
work as with the built-in workers."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from frontier.config import ConfigError
from frontier.study import open_storage
from hydra_plugins.frontier_sweeper._objective import composite

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="pip install hydra-submitit-launcher")

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model=tiny", "data.vocab_size=1024", "data.tokenizer_train_chars=2000000", "precision=fp32",
    "budget.seconds=60", "budget.max_steps=4", "budget.excluded_steps=0",
    "train.batch_tokens=2048", "eval.checkpoint_tokens=2048", "eval.final_tokens=4096",
    "eval.every_fraction=0.25", "eval.core_max_per_task=2", "tracking.enabled=false",
]

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


@pytest.mark.slow
def test_submitit_local_trial_is_pruned_through_the_shared_storage(tmp_path):
    storage = str(tmp_path / "study.journal")
    # A finished trial far better than any tiny run: successive halving prunes the next at checkpoint 1.
    study = optuna.create_study(study_name="prune", storage=open_storage(storage))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.1, intermediate_values={1: 0.1, 2: 0.1, 3: 0.1},
                                 system_attrs={"completed_rung_0": 0.1, "completed_rung_1": 0.1}))
    launched_sweep(tmp_path / "out", "sweep=lr", "sweep.sampler=random", "sweep.pruner=successive_halving",
                   "sweep.n_trials=2", f"sweep.storage={storage}", "sweep.study_name=prune")
    trial = optuna.load_study(study_name="prune", storage=open_storage(storage)).trials[1]
    assert trial.state == TrialState.PRUNED, trial.user_attrs
    assert list(trial.intermediate_values) == [1]
    assert trial.user_attrs["prune_reason"].startswith("pruned at checkpoint 1")


def test_a_launched_trial_owns_one_process(tmp_path):
    from hydra_plugins.frontier_sweeper._launch import LaunchedTrials, is_builtin
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

    assert is_builtin(None) and not is_builtin(LocalLauncher())
    assert LaunchedTrials(LocalLauncher(), 1).local and not LaunchedTrials(SlurmLauncher(), 1).local
    with pytest.raises(ConfigError, match="sweep.devices_per_trial=2 is not allowed with a Hydra launcher"):
        LaunchedTrials(SlurmLauncher(), 2)
