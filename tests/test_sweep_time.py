"""Sweeps whose time goes into training and whose winners are real: evaluation sized to the work and
the same for every trial of a study, each run's time accounted, standby trial processes, and
`sweep.confirm` (the best configurations and the baseline again with new seeds)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from frontier import sizing
from frontier.verdict import judge
from frontier.study import open_storage
from tests.conftest import ROOT, SWEEP_TINY, command_in_process, run_cli

TINY = [o for o in SWEEP_TINY if not o.startswith("eval.core")]


def sweep_args(out: Path, *args: str) -> list[str]:
    """What follows `python -m frontier.train` for a sweep of tiny trials into `out`."""
    return ["--multirun", *TINY, *args, f"hydra.sweep.dir={out}"]


def sweep(out: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontier.train", *sweep_args(out, *args)], cwd=ROOT, text=True,
                          timeout=timeout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def refused_sweep(out: Path, *args: str) -> subprocess.CompletedProcess:
    """A sweep command that refuses its input, run in this process (conftest.command_in_process)."""
    return command_in_process("frontier.train", sweep_args(out, *args))


def start_until(command: list[str], text: str) -> tuple[subprocess.Popen, list[str]]:
    """A sweep driver started, and its output read up to the first line holding `text`."""
    driver = subprocess.Popen(command, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    for line in driver.stdout:
        lines.append(line)
        if text in line:
            break
    return driver, lines


def trials_of(storage: str, name: str) -> list:
    return optuna.load_study(study_name=name, storage=open_storage(storage)).get_trials(deepcopy=False)


# -- the sizing rule ---------------------------------------------------------------------------------


def test_eval_tokens_cost_about_a_tenth_of_the_budget_and_are_powers_of_two():
    peak, flops, seq = 100e9, 12_582_912, 256
    final, checkpoint, why = sizing.eval_tokens(60, 0.1, peak, flops, seq)
    rate = sizing.EVAL_EFFICIENCY * peak / (flops / 3)  # the forward-pass rate the rule assumes
    assert final & (final - 1) == 0 and checkpoint & (checkpoint - 1) == 0
    assert 0.05 * 60 < final / rate <= 0.1 * 60  # the final evaluation: at most a tenth of the budget
    assert 0.05 * 60 < 9 * checkpoint / rate <= 0.1 * 60  # nine checkpoints together: at most a tenth
    assert "eval.final_tokens=20971520" in why  # the full split, one override away
    # nearby peaks (a measurement repeated) give the same validation set; longer budgets a larger one
    assert sizing.eval_tokens(60, 0.1, 1.1 * peak, flops, seq)[0] == final
    assert sizing.eval_tokens(600, 0.1, peak, flops, seq)[0] > final
    assert sizing.eval_tokens(1e9, 0.1, peak, flops, seq)[0] == sizing.FULL_EVAL_TOKENS  # capped at the full set
    tiny = sizing.eval_tokens(1, 0.1, 1e6, flops, seq)  # a slow device: the smallest set, never zero rows
    assert tiny[:2] == (sizing.MIN_FINAL_ROWS * seq, sizing.MIN_CHECKPOINT_ROWS * seq)


@pytest.mark.slow
def test_a_run_sizes_its_evaluation_and_accounts_its_wall_time(wiki, tmp_path):
    run_dir = tmp_path / "run"
    small = [o for o in TINY if not o.startswith("eval.")] + ["budget.max_steps=6", "eval.every_fraction=0.25"]
    started = time.time()
    done = run_cli(small + [f"hydra.run.dir={run_dir}"])
    outside = time.time() - started
    assert done.returncode == 0, done.stderr[-2000:]
    assert "evaluation: " in done.stderr and "sized to ~10% of the 60 s budget" in done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    config = (run_dir / ".hydra" / "config.yaml").read_text()
    assert "final_tokens: null" in config  # the command left them to the run ...
    saved = __import__("torch").load(run_dir / "final.pt", map_location="cpu", weights_only=False)["config"]["eval"]
    assert saved["final_tokens"] == summary["val_tokens"] and saved["checkpoint_tokens"] >= 256  # ... which chose
    parts = [summary[f"time_{part}_seconds"] for part in ("startup", "excluded", "charged", "evaluation",
                                                          "checkpoint", "idle")]
    assert all(part >= 0 for part in parts) and summary["time_evaluation_seconds"] > 0
    assert abs(sum(parts) - summary["wall_seconds"]) <= 0.02 * summary["wall_seconds"]
    # the wall counts from the process's start (imports included), not from the run's: most of what the
    # command took from outside, the rest being Python's own start before /proc counts and its exit
    assert 0.6 * outside < summary["wall_seconds"] <= outside
    assert summary["training_share"] == pytest.approx(summary["time_charged_seconds"] / summary["wall_seconds"])


# -- a study's one validation set --------------------------------------------------------------------


@pytest.mark.slow
def test_a_study_evaluates_every_trial_on_one_set_and_refuses_another(wiki, tmp_path):
    storage = str(tmp_path / "study.journal")
    auto = [o for o in TINY if not o.startswith("eval.final_tokens") and not o.startswith("eval.checkpoint")]
    args = ["sweep=lr", "sweep.n_trials=2", "sweep.pruner=none", f"sweep.storage={storage}", "sweep.study_name=one"]
    done = subprocess.run([sys.executable, "-m", "frontier.train", "--multirun", *auto, *args,
                           f"hydra.sweep.dir={tmp_path / 'a'}"], cwd=ROOT, text=True, timeout=600,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    study = optuna.load_study(study_name="one", storage=open_storage(storage))
    chosen = study.user_attrs["eval_tokens"]
    tokens = {t.user_attrs["val_tokens"] for t in study.trials}
    assert tokens == {chosen["final_tokens"]}  # the rows every trial was scored on
    assert {t.user_attrs["val_fingerprint"] for t in study.trials} == {study.user_attrs["val_fingerprint"]}
    assert all(f"eval.final_tokens={chosen['final_tokens']}" in t.user_attrs["overrides"] for t in study.trials)

    other = command_in_process("frontier.train", ["--multirun", *auto, *args, "sweep.n_trials=3",
                                                  f"eval.final_tokens={2 * chosen['final_tokens']}",
                                                  f"hydra.sweep.dir={tmp_path / 'b'}"])
    assert other.returncode == 2, other.stderr[-2000:]
    assert other.stderr.strip().splitlines()[-1].startswith("error: ")
    assert len(trials_of(storage, "one")) == 2 and not (tmp_path / "b").exists()

    swept = refused_sweep(tmp_path / "c", "sweep=lr", "eval.final_tokens=4096,8192", f"sweep.storage={storage}",
                          "sweep.study_name=two")
    assert swept.returncode == 2 and "eval.final_tokens is not allowed in the search space" in swept.stderr


@pytest.mark.slow
def test_a_trial_scored_on_other_rows_fails_with_the_reason_and_is_not_ranked(wiki, tmp_path):
    """The same token count on another model.seq_len is other rows: that trial fails, the other is ranked."""
    storage = str(tmp_path / "study.journal")
    done = sweep(tmp_path / "a", "sweep=custom", "model.seq_len=128,256", "sweep.sampler=grid", "sweep.pruner=none",
                 "sweep.confirm=0", f"sweep.storage={storage}", "sweep.study_name=rows")
    assert done.returncode == 0, done.stdout[-3000:]
    trials = {t.params["model.seq_len"]: t for t in trials_of(storage, "rows")}
    assert trials[256].state == TrialState.COMPLETE  # the baseline's seq_len: the study's validation set
    assert trials[128].state == TrialState.FAIL and trials[128].user_attrs["val_tokens"] == trials[256].user_attrs["val_tokens"]
    assert trials[128].user_attrs["fail_reason"].startswith("scored on another validation set (val_fingerprint "
                                                            f"{trials[128].user_attrs['val_fingerprint']}")


# -- confirmation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, why", [("-1", "sweep.confirm=-1 is not allowed"),
                                        ("1", "sweep.confirm=1 is not allowed: at least 2 seeds")])
def test_a_bad_confirm_is_one_sentence(tmp_path, value, why):
    done = refused_sweep(tmp_path / "out", "sweep=lr", f"sweep.confirm={value}", f"sweep.storage={tmp_path / 's.journal'}")
    assert done.returncode == 2 and why in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not (tmp_path / "s.journal").exists()


@pytest.mark.slow
def test_confirmation_runs_the_promised_blocks_and_resumes_after_a_kill(wiki, tmp_path, mlflow_store):
    """Two search trials, then the best one and the baseline in blocks of one run each with a new seed:
    two blocks, and a third only if the verdict after two is unresolved; tagged, never pruned, not counted
    in n_trials, in Optuna and MLflow. The driver is killed (kill -9) as the first confirmation run
    trains; the same command runs the rest. The verdict is the driver's last line, the report's
    headline and the parent run's tag."""
    storage, store = str(tmp_path / "study.journal"), mlflow_store
    args = ["sweep=lr", "sweep.n_trials=2", "sweep.confirm=2", "sweep.confirm_max=3", "sweep.confirm_top=1",
            "sweep.pruner=median", f"sweep.storage={storage}", "sweep.study_name=confirm", "tracking.enabled=true",
            f"tracking.uri={store}", "budget.max_steps=8"]
    command = [sys.executable, "-m", "frontier.train", "--multirun", *TINY, *args, f"hydra.sweep.dir={tmp_path / 'a'}"]
    driver, seen = start_until(command, "(confirmation: ")
    driver.kill()
    driver.wait(timeout=60)
    assert "seed=1338)" in seen[-1], "".join(seen)[-3000:]  # the first block first
    deadline = time.time() + 60  # the standby process and the running trial see their driver gone
    while time.time() < deadline and _frontier_processes(tmp_path / "a"):
        time.sleep(1)
    assert not _frontier_processes(tmp_path / "a")

    done = subprocess.run(command[:-1] + [f"hydra.sweep.dir={tmp_path / 'b'}"], cwd=ROOT, text=True, timeout=900,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.returncode == 0, done.stdout[-3000:]
    trials = trials_of(storage, "confirm")
    search = [t for t in trials if "confirm" not in t.user_attrs]
    confirmed = [t for t in trials if "confirm" in t.user_attrs and t.state == TrialState.COMPLETE]
    assert len(search) == 2  # n_trials counts the search only
    best = min((t for t in search if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    label = f"trial {best.number}"
    two = judge([t.value for t in confirmed if t.user_attrs["confirm"] == "baseline"][:2],
                {label: [t.value for t in confirmed if t.user_attrs["confirm"] == label][:2]}, 0.002, 2, 3)
    seeds = [1338, 1339, 1340] if two.outcome == "unresolved" else [1338, 1339]
    pairs = sorted((t.user_attrs["confirm"], t.user_attrs["confirm_seed"]) for t in confirmed)
    assert pairs == sorted((name, seed) for name in ("baseline", label) for seed in seeds)  # each run once
    assert [t.user_attrs["confirm_seed"] for t in confirmed] == sorted(t.user_attrs["confirm_seed"] for t in confirmed)
    assert all(t.params == best.params for t in confirmed if t.user_attrs["confirm"] != "baseline")
    assert all(not t.params for t in confirmed if t.user_attrs["confirm"] == "baseline")
    assert all(t.intermediate_values and "prune_reason" not in t.user_attrs for t in confirmed)
    assert all(f"seed={t.user_attrs['confirm_seed']}" in t.user_attrs["overrides"] and t.user_attrs["tokens_seen"]
               for t in confirmed)
    report = (tmp_path / "b" / "report" / "report.md").read_text()
    headline = next(line for line in report.splitlines() if line.startswith("**Verdict**: "))
    verdict = headline.removeprefix("**Verdict**: ")
    assert "## Confirmed with new seeds" in report and "pooled standard deviation" in report
    assert "## Where the time went" in report and (tmp_path / "b" / "report" / "confirm.png").is_file()
    assert "**Best**" not in report  # the search's best of one seed each is no answer once confirmed
    assert ("python -m frontier.train" in report.split("## ")[0]) == (not verdict.startswith("unresolved"))
    last = [line for line in done.stdout.splitlines() if "[HYDRA]" in line][-1]  # the driver's log lines
    assert f"verdict: {verdict}" in last and "training share" in done.stdout

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    names = {r.info.run_name for r in runs if r.info.status == "FINISHED"}
    assert {f"trial-{t.number} confirm {t.user_attrs['confirm']} seed={t.user_attrs['confirm_seed']}"
            for t in confirmed} <= names
    parent = next(r for r in runs if r.info.run_name == "sweep-confirm")
    assert {"baseline_mean", "confirmed_winner_mean", "confirmed_difference", "confirmed_low", "confirmed_high",
            "training_share"} <= set(parent.data.metrics)
    assert parent.data.tags["verdict_text"] == verdict
    assert parent.data.tags["verdict"] in ("beats", "keep_defaults", "equivalent", "unresolved")


@pytest.mark.slow
def test_a_confirm_on_a_study_with_no_finished_trial_is_one_sentence(wiki, tmp_path):
    storage = str(tmp_path / "study.journal")
    args = ["sweep=lr", "sweep.n_trials=1", f"sweep.storage={storage}", "sweep.study_name=none"]
    failed = sweep(tmp_path / "a", *args, "sweep.confirm=0", "train.loss_ceiling=0.01")  # every trial diverges
    assert failed.returncode == 0, failed.stdout[-2000:]
    done = refused_sweep(tmp_path / "b", *args, "sweep.confirm=2", "train.loss_ceiling=0.01")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "sweep.confirm=2 is not allowed for sweep.study_name='none'" in done.stderr
    assert len(trials_of(storage, "none")) == 1 and not (tmp_path / "b").exists()


# -- standby trial processes -------------------------------------------------------------------------


@pytest.mark.slow
def test_trials_run_in_standby_processes_and_a_dead_standby_is_replaced(wiki, tmp_path):
    """The second trial's process was started while the first trained (its start-up counts from
    when it got its trial); a standby killed while it waits is replaced by a new process."""
    storage = str(tmp_path / "study.journal")
    command = [sys.executable, "-m", "frontier.train", "--multirun", *TINY, "sweep=lr", "sweep.n_trials=3",
               "sweep.pruner=none", f"sweep.storage={storage}", "sweep.study_name=warm", "budget.max_steps=12",
               f"hydra.sweep.dir={tmp_path / 'out'}"]
    driver, lines = start_until(command, "trial 1 started")
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline:  # the standby the second trial started beside it
        trials = trials_of(storage, "warm")
        if not any(t.number == 1 and "process" in t.user_attrs for t in trials):
            time.sleep(0.2)  # trial 1 is handed to its standby before the next standby starts
            continue
        running = {int(str(t.user_attrs["process"]).rsplit(":", 2)[1]) for t in trials if "process" in t.user_attrs}
        standby = [pid for pid, args in _processes() if "frontier.standby" in args and pid not in running
                   and pid in _frontier_processes(tmp_path / "out") and _waiting(pid)]
        if standby:
            killed = standby[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.2)
    lines += driver.stdout.readlines()
    assert driver.wait(timeout=600) == 0, "".join(lines)[-3000:]
    assert killed is not None
    assert any("is gone; starting the trial anew" in line for line in lines), "".join(lines)[-3000:]
    trials = trials_of(storage, "warm")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    started = {t.number: t.user_attrs["process"] for t in trials}
    assert len(set(started.values())) == 3  # a process of its own for every trial
    assert not _frontier_processes(tmp_path / "out")  # no standby left once the sweep ended


def _processes() -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found.append((int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
            except OSError:
                pass
    return found


def _waiting(pid: int) -> bool:
    """A standby process still waiting for its trial reads a pipe (a trial's process reads nothing)."""
    try:
        return os.readlink(f"/proc/{pid}/fd/0").startswith("pipe:")
    except OSError:
        return False


def _frontier_processes(sweep_dir: Path) -> list[int]:
    """This sweep's trial and standby processes still alive: their command line names its folder, or
    their output goes there (a standby's log, a trial's output.log)."""
    alive = []
    for pid, args in _processes():
        try:
            output = os.readlink(f"/proc/{pid}/fd/1")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (str(sweep_dir) in args or output.startswith(str(sweep_dir))) and state not in ("Z", "X"):
            alive.append(pid)
    return alive


def test_the_leaderboard_gives_a_configuration_run_with_several_seeds_its_mean_and_sd(tmp_path, capsys, mlflow_store):
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    from frontier import leaderboard

    uri = mlflow_store
    client = MlflowClient(uri)
    experiment = client.create_experiment("seeds", artifact_location=(tmp_path / "artifacts").as_uri())
    runs = [({"optim.matrix_lr": "0.04", "seed": "1"}, 2.01), ({"optim.matrix_lr": "0.04", "seed": "2"}, 2.03),
            ({"optim.matrix_lr": "0.06", "seed": "1"}, 1.94), ({"optim.matrix_lr": "0.06", "seed": "2"}, 1.96),
            ({"optim.matrix_lr": "0.02", "seed": "1"}, 2.10)]  # one seed: no spread to show
    for i, (params, bpb) in enumerate(runs):
        run = client.create_run(experiment, run_name=f"run-{i}")
        client.log_batch(run.info.run_id, metrics=[Metric("val_bpb", bpb, 0, 0)],
                         params=[Param(k, v) for k, v in {**params, "budget.name": "smoke", "trial.number": str(i)}.items()])
        client.set_terminated(run.info.run_id, "FINISHED")
    assert leaderboard.main([f"tracking.uri={uri}", "experiment=seeds"]) == 0
    out = capsys.readouterr().out.splitlines()
    groups = out[out.index("configurations trained with several seeds (val_bpb mean +- sd, best mean first):") + 1:]
    assert groups == ["1  1.9500 +- 0.0141  2 seeds  (best)",
                      "2  2.0200 +- 0.0141  2 seeds  optim.matrix_lr=0.04"]


def test_the_leaderboard_gives_each_sweep_its_verdict(tmp_path, capsys, mlflow_store):
    """A sweep's parent run is no row of the table; its confirmation's verdict is listed below it."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from frontier import leaderboard
    from frontier.store import RUN_KIND_TAG

    client = MlflowClient(mlflow_store)
    experiment = client.create_experiment("verdicts", artifact_location=(tmp_path / "artifacts").as_uri())
    text = "keep the defaults: every configuration the search found is worse; the best, trial 3, is 0.0332 worse"
    for name, tags in (("sweep-showcase", {"verdict": "keep_defaults", "verdict_text": text}), ("sweep-lr", {})):
        run = client.create_run(experiment, run_name=name, tags={RUN_KIND_TAG: "sweep", **tags})
        client.set_terminated(run.info.run_id, "FINISHED")
    trial = client.create_run(experiment, run_name="trial-3")
    client.log_batch(trial.info.run_id, metrics=[Metric("val_bpb", 2.0192, 0, 0)])
    client.set_terminated(trial.info.run_id, "FINISHED")
    assert leaderboard.main([f"tracking.uri={mlflow_store}", "experiment=verdicts"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2:] == ["sweeps' verdicts (the best configuration each found, confirmed against the defaults):",
                        f"sweep-showcase  keep_defaults  {text}"]
    assert sum("trial-3" in line for line in out) == 1 and not any(line.startswith("2  ") for line in out)
