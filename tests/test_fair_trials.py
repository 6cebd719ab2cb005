"""Fair trials: a trial another program slowed is found by its speed against its peers (the study's other
trials of its shape on its kind of device), is not ranked, and runs again; a trial that failed because
the sweep's folder could not be written does not count toward sweep.n_trials.

The comparison, the counting and the report are called directly on studies made with Optuna's public
API; then a real sweep whose trial shares its core with busy programs.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from frontier.sweep_report import write_report
from hydra_plugins.frontier_sweeper._confirm import make_plan
from hydra_plugins.frontier_sweeper._fairness import MIN_PEERS, contention, newly_contended, next_rerun
from hydra_plugins.frontier_sweeper._objective import counted_trials
from hydra_plugins.frontier_sweeper._workers import unwritable
from tests.conftest import fill
from tests.test_sweep_faults import ROOT, driver_command, load, wait_for, wait_for_training

optuna.logging.set_verbosity(optuna.logging.WARNING)

CPU = "AMD EPYC cpu, 2 threads"
SPACE = {"optim.matrix_lr": FloatDistribution(0.001, 1.0)}


def trial(number: int, speed: float | None, *, params: int = 1000, kind: str = CPU, value: float = 3.0,
          state: TrialState = TrialState.COMPLETE, lr: float | None = None, **attrs) -> optuna.trial.FrozenTrial:
    made = create_trial(state=state, value=value if state == TrialState.COMPLETE else None,
                        params={"optim.matrix_lr": lr if lr is not None else 0.01 * (number + 1)},
                        distributions=SPACE, intermediate_values={1: value} if state == TrialState.PRUNED else None,
                        user_attrs={"params": params, "device_kind": kind,
                                    **({"tokens_per_second": speed} if speed is not None else {}), **attrs})
    made.number = number
    return made


def peers(speeds: list[float], first: int = 1, **how) -> list:
    return [trial(first + i, speed, **how) for i, speed in enumerate(speeds)]


# -- the comparison -------------------------------------------------------------------------------


def test_a_trial_below_the_fraction_of_its_peers_median_is_contended_with_its_speed_and_that_median():
    others = peers([20_000, 21_500, 23_000, 30_000])
    slowed = contention(trial(0, 5_449), [trial(0, 5_449), *others], 0.8)
    assert slowed == {"speed": 5_449, "median": 22_250, "peers": 4, "device_kind": CPU}


def test_a_trial_at_the_fraction_or_above_is_not_contended():
    others = peers([20_000, 20_000, 20_000])
    assert contention(trial(0, 16_000), others, 0.8) is None  # exactly 0.8 of the median
    assert contention(trial(0, 15_999), others, 0.8) is not None  # just below it
    assert contention(trial(0, 25_000), others, 0.8) is None


def test_too_few_peers_make_no_judgement():
    assert MIN_PEERS == 3
    assert contention(trial(0, 1_000), peers([20_000] * (MIN_PEERS - 1)), 0.8) is None
    assert contention(trial(0, 1_000), peers([20_000] * MIN_PEERS), 0.8) is not None


def test_peers_of_another_shape_or_another_kind_of_device_do_not_count():
    other_shape = peers([20_000] * 3, params=2000)
    other_kind = peers([20_000] * 3, first=4, kind="NVIDIA H100 80GB HBM3")
    assert contention(trial(0, 1_000), other_shape + other_kind, 0.8) is None
    # the same peers judge the trials of their own shape and kind
    assert contention(trial(0, 1_000, params=2000), other_shape, 0.8) is not None
    assert contention(trial(0, 1_000, kind="NVIDIA H100 80GB HBM3"), other_kind, 0.8) is not None


def test_failed_and_running_trials_are_neither_judged_nor_peers_and_a_pruned_one_is_both():
    fast = peers([20_000] * 3)
    failed = peers([20_000] * 3, first=4, state=TrialState.FAIL)
    assert contention(trial(0, 1_000), failed, 0.8) is None
    assert contention(trial(0, 1_000, state=TrialState.FAIL), fast, 0.8) is None
    assert contention(trial(0, 1_000, state=TrialState.RUNNING), fast, 0.8) is None
    pruned = peers([20_000] * 3, first=4, state=TrialState.PRUNED)
    assert contention(trial(0, 1_000, state=TrialState.PRUNED), pruned, 0.8) is not None


def test_a_trial_without_its_speed_shape_or_device_kind_is_not_judged():
    fast = peers([20_000] * 3)
    assert contention(trial(0, None), fast, 0.8) is None
    assert contention(trial(0, 1_000, kind=None), fast, 0.8) is None
    assert contention(trial(0, 1_000, params=None), fast, 0.8) is None


# -- the study: judged late, re-run once, not counted, not ranked ---------------------------------------


def study_of(trials: list, **attrs) -> optuna.Study:
    study = optuna.create_study()
    for t in trials:
        study.add_trial(t)
    for key, value in attrs.items():
        study.set_user_attr(key, value)
    return study


def test_the_first_trials_are_judged_once_their_peers_have_run_and_confirmation_runs_play_no_part():
    slow_first = [trial(0, 5_000), trial(1, 21_000)]
    assert newly_contended(study_of(slow_first), 0.8) == {}  # no peers yet
    confirmed = [trial(2, 22_000, confirm="baseline"), trial(3, 20_000, confirm="baseline"),
                 trial(4, 4_000, confirm="baseline")]
    assert newly_contended(study_of([*slow_first, *confirmed]), 0.8) == {}  # neither peers nor judged
    later = study_of([*slow_first, trial(2, 22_000), trial(3, 20_000)])
    assert set(newly_contended(later, 0.8)) == {"0"}
    known = study_of([*slow_first, trial(2, 22_000), trial(3, 20_000)], contended={"0": {}})
    assert newly_contended(known, 0.8) == {}  # recorded once


def test_a_contended_trial_is_re_run_once_and_a_contended_re_run_is_not_run_again():
    fast = [trial(1, 21_000), trial(2, 22_000), trial(3, 20_000)]
    study = study_of([trial(0, 5_000), *fast], contended={"0": {}})
    assert next_rerun(study).number == 0
    rerun = study_of([trial(0, 5_000), *fast, trial(4, 5_000, lr=0.01, rerun_of=0)], contended={"0": {}, "4": {}})
    assert next_rerun(rerun) is None


def test_re_runs_and_trials_failed_for_an_unwritable_folder_do_not_count_toward_n_trials():
    study = study_of([trial(0, 5_000), trial(1, 21_000, state=TrialState.FAIL), trial(2, 22_000, state=TrialState.FAIL),
                      trial(3, 20_000, lr=0.01, rerun_of=0), trial(4, 20_000, confirm="baseline")],
                     uncounted={"2": "cannot write final.pt: No space left on device"})
    assert counted_trials(study, count_failed=True) == 2  # trials 0 and 1
    assert counted_trials(study, count_failed=False) == 1


def test_the_report_and_the_confirmation_rank_the_re_run_not_the_slowed_trial(tmp_path):
    # the slowed trial scored best by chance: its value must not make it the best, nor be confirmed
    study = study_of([trial(0, 5_000, value=2.0), trial(1, 21_000, value=3.0), trial(2, 22_000, value=3.5),
                      trial(3, 20_000, value=3.2), trial(4, 20_500, value=2.9, lr=0.01, rerun_of=0)],
                     contended={"0": {"speed": 5_000, "median": 21_000, "peers": 3, "device_kind": CPU}})
    report = write_report(study, tmp_path)
    assert report["best"]["number"] == 4
    text = report["text"]
    top = text.split("## Top 10")[1].split("##")[0]
    assert "| 1 | 4 (re-run of 0) |" in top and "| 0 |" not in top
    contended_part = text.split("## Contended")[1].split("##")[0]
    assert "| 0 | 5,000 | 24% of 21,000 | 3 | AMD EPYC cpu, 2 threads | trial 4: complete, 2.9000 |" in contended_part
    plan = make_plan(study, top=2, blocks=2, max_blocks=4, run_seed=0, order_seed=0, equivalence=0.002)
    assert [c["label"] for c in plan["configs"]] == ["baseline", "trial 4", "trial 1"]


# -- a folder that cannot be written ---------------------------------------------------------------------


def test_a_failure_for_want_of_space_stops_the_sweep_even_once_its_space_is_freed(tmp_path):
    reason = f"cannot write {tmp_path}/0/final.pt: {os.strerror(errno.ENOSPC)}"
    assert unwritable(tmp_path, reason) == os.strerror(errno.ENOSPC)  # the folder has room again
    assert unwritable(tmp_path, "diverged: val_bpb nan at step 4") is None
    assert not list(tmp_path.iterdir())  # the probe leaves nothing


def test_a_folder_whose_disk_is_full_is_found_by_a_write_into_it(small_disk):
    filler = fill(small_disk)
    try:
        assert unwritable(small_disk, "exit code 1") == os.strerror(errno.ENOSPC)
    finally:
        filler.unlink()
    assert unwritable(small_disk, "exit code 1") is None


# -- a real slowed trial ---------------------------------------------------------------------------------


def hog(core: int) -> subprocess.Popen:
    """A process that keeps CPU core `core` busy, ahead of others where it may be: on a machine already busy,
    one more program of the same weight slows a trial too little to tell. Linux shares a core between
    sessions (autogroups) before their processes, and each trial has a session of its own, so the hog
    takes one too, and raises its weight (which needs root)."""
    def pin() -> None:
        os.sched_setaffinity(0, {core})
        with contextlib.suppress(OSError), open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write("-10")

    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin, start_new_session=True)


@pytest.mark.slow
def test_a_trial_slowed_by_programs_on_its_core_is_contended_re_run_and_ranked_on_its_re_run(tmp_path, mlflow_store):
    """The sweep runs on one core; from trial 0's first step to its last, three busy programs of a higher
    priority share it. Once its peers
    have run, trial 0 is found contended: a log line, the study's record, its MLflow run's tag; it runs
    again with the same parameters, uncounted, and the report ranks that re-run, not trial 0."""
    from mlflow import MlflowClient

    core = max(os.sched_getaffinity(0))
    journal = str(tmp_path / "study.journal")
    out = tmp_path / "out"
    driver = subprocess.Popen(driver_command(out, "budget.seconds=4", "sweep.n_trials=4",
                                             "sweep.min_relative_speed=0.5", f"sweep.storage={journal}",
                                             "sweep.study_name=slowed", "tracking.enabled=true",
                                             f"tracking.uri={mlflow_store}", "tracking.experiment=slowed"),
                              cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              preexec_fn=lambda: os.sched_setaffinity(0, {core}))  # its trials inherit the core
    hogs = []
    try:
        metrics = out / "0" / "metrics.jsonl"
        wait_for_training(driver, metrics)  # its first step: a trial starved as it starts up sends no heartbeat
        hogs = [hog(core) for _ in range(3)]
        wait_for(lambda: driver.poll() is not None or '"progress": 1.0' in metrics.read_text(), 300,
                 "trial 0's last step", poll=0.2)
        for process in hogs:
            process.kill()
        output, _ = driver.communicate(timeout=600)
    finally:
        for process in [*hogs, driver]:
            process.kill()
            process.wait()
    assert driver.returncode == 0, output[-3000:]
    study = load(journal, "slowed")
    trials = study.trials
    slowed = study.user_attrs["contended"]
    assert "0" in slowed and slowed["0"]["speed"] < 0.5 * slowed["0"]["median"], (slowed, output[-3000:])
    assert f"trial 0 trained at {slowed['0']['speed']:,.0f} tokens/s" in output and "contended" in output
    # each contended search trial ran once more with its parameters, and those re-runs did not count
    reruns = {t.user_attrs["rerun_of"]: t for t in trials if t.user_attrs.get("rerun_of") is not None}
    assert set(reruns) == {int(n) for n in slowed if trials[int(n)].user_attrs.get("rerun_of") is None}
    assert reruns[0].params == trials[0].params and reruns[0].state == TrialState.COMPLETE
    assert len(trials) - len(reruns) == 4
    run = MlflowClient(mlflow_store).get_run(trials[0].user_attrs["mlflow_run_id"])
    assert run.data.tags["contended"].startswith(f"trial 0 trained at {slowed['0']['speed']:,.0f} tokens/s")
    # ranked on the re-run: trial 0 is in no ranked row, its re-run is, whatever their values
    report = (out / "report" / "report.md").read_text()
    top = report.split("## Top 10")[1].split("##")[0]
    assert f"| {reruns[0].number} (re-run of 0) |" in top and "| 0 |" not in top, report
    assert "## Contended" in report


def test_a_cpu_slot_s_kind_of_device_is_its_cpu_and_its_threads(monkeypatch):
    from frontier.bench_results import cpu_family
    from hydra_plugins.frontier_sweeper._workers import device_slots

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (slot,) = device_slots("cpu", 1)
    assert slot.kind == f"{cpu_family()} cpu, 1 threads"
