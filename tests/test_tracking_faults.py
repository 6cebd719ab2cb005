"""Tracking that cannot lose points: a real `mlflow server` killed mid-run, a server that never comes
back (then `python -m frontier.tracking sync`), and kill -9 then resume — all through the real CLI."""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import requests
import torch
from mlflow import MlflowClient

from frontier.config import PROJECT_ROOT
from frontier.observers import read_records
from tests.conftest import WIKI, command_in_process, fill, store_in

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")]

# The tiny model for a few steps, one log per step, a val_bpb checkpoint at each quarter.
RUN = [
    "model=tiny",
    f"data.path={WIKI}",
    "data.vocab_size=1024",
    "data.tokenizer_train_chars=2000000",
    "device=cpu",
    "precision=fp32",
    "budget.seconds=600",
    "budget.excluded_steps=0",
    "model.seq_len=128",
    "train.batch_tokens=1024",
    "train.device_batch_rows=8",
    "eval.checkpoint_tokens=512",
    "eval.final_tokens=2048",
    "eval.every_fraction=0.25",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    if not WIKI.is_dir():
        pytest.skip(f"shared data not found at {WIKI}")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # tests name their own stores


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A real `mlflow server` on 127.0.0.1 over one SQLite store, killed and started again at will."""

    def __init__(self, folder: Path, template_db: Path):
        shutil.copy(template_db, folder / "server.db")
        self.folder = folder
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.folder / "server.log", "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                 f"sqlite:///{self.folder / 'server.db'}", "--artifacts-destination",
                 str(self.folder / "server-artifacts"), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
                 "--workers", "1"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,  # its own group: workers go too
                # MLflow's job runner (GenAI jobs, which no test starts) more than doubles the server's start
                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        deadline = time.time() + 120
        while True:
            assert self.proc.poll() is None, (self.folder / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow server did not answer /health"
            try:
                if requests.get(f"{self.url}/health", timeout=2).ok:
                    return
            except requests.RequestException:
                time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def server(tmp_path, template_db):
    found = Server(tmp_path, template_db)
    found.start()
    yield found
    found.kill()


class Trainer:
    """`python -m frontier.train ...` in the background, its stderr in a file the test can read."""

    def __init__(self, run_dir: Path, args: list[str], resume: bool = False):
        self.run_dir = run_dir
        self.err_path = run_dir.parent / f"{run_dir.name}{'.resume' if resume else ''}.stderr"
        where = [f"resume={run_dir}"] if resume else [*args, f"hydra.run.dir={run_dir}"]
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "frontier.train", *where],
                                         cwd=PROJECT_ROOT, stdout=subprocess.DEVNULL, stderr=err)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    def wait_for(self, what: str, condition, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before {what}:\n{self.stderr[-3000:]}"
            assert time.time() < deadline, f"timed out waiting for {what}:\n{self.stderr[-3000:]}"
            time.sleep(0.1)

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def stopped(pid: int) -> bool:
    """Whether every thread of `pid` has stopped: a SIGSTOP is sent at once and taken a moment later."""
    return all((task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
               for task in Path(f"/proc/{pid}/task").iterdir())


def freeze_between_writes(trainer: Trainer, db: Path) -> None:
    """SIGSTOP the trainer at a moment it holds no lock on its SQLite store: frozen inside a transaction,
    it would lock every other process out of the store for as long as it stays frozen. The lock is
    looked at only once every thread has stopped: one still running could take it after the look."""
    for _ in range(100):
        trainer.proc.send_signal(signal.SIGSTOP)
        trainer.wait_for("every thread to stop after SIGSTOP", lambda: stopped(trainer.proc.pid), timeout=10)
        try:
            with contextlib.closing(sqlite3.connect(db, timeout=0)) as conn:
                conn.execute("BEGIN EXCLUSIVE")  # refused while another process holds any lock
                conn.rollback()
            return
        except sqlite3.OperationalError:
            trainer.proc.send_signal(signal.SIGCONT)
            time.sleep(0.05)
    raise AssertionError(f"the trainer held a lock on {db} at each of 100 tries")


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def file_points(run_records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What MLflow should hold of metrics.jsonl: every number of a log record, val_bpb of a checkpoint."""
    points = defaultdict(list)
    for record in run_records:
        if record.get("final"):
            continue
        numbers = {"val_bpb": record["val_bpb"]} if "checkpoint" in record else record
        for key, value in numbers.items():
            if key not in ("step", "time") and isinstance(value, (int, float)) and math.isfinite(value):
                points[key].append((record["step"], float(value)))
    return points


def assert_in_mlflow_once(client: MlflowClient, run_id: str, run_dir: Path, same_values: bool = True) -> None:
    """Every point of metrics.jsonl is in the MLflow run exactly once (besides it, a key may hold one
    point for the final summary at the last step), and the final record's numbers are the run's values."""
    run_records = records(run_dir)
    final = run_records[-1]
    assert final["final"] is True
    for key, expected in file_points(run_records).items():
        got = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        final_point = (final["step"], float(final[key])) if key in final else None
        if final_point in got and final_point not in expected:
            got.remove(final_point)
        assert Counter(step for step, _ in got) == Counter(step for step, _ in expected), key
        assert all(n == 1 for n in Counter(step for step, _ in got).values()), key
        if same_values:
            assert sorted(got) == sorted(expected), key
    latest = client.get_run(run_id).data.metrics
    for key, value in final.items():
        if key not in ("step", "time", "final", "status") and isinstance(value, (int, float)):
            assert latest[key] == pytest.approx(value), key


def tracking_warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("warning: tracking:")]


def stop_and_kill_server(trainer: Trainer, server: Server) -> None:
    """Once the MLflow run exists: the server dies while the run goes on."""
    trainer.wait_for("the MLflow run", lambda: (trainer.run_dir / "tracking.json").exists())
    trainer.proc.send_signal(signal.SIGSTOP)  # the server dies while the run is frozen mid-way
    server.kill()
    trainer.proc.send_signal(signal.SIGCONT)


def test_server_killed_mid_run_and_restarted(tmp_path, server):
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=12", "train.log_every_fraction=0.08",
                                f"tracking.uri={server.url}", "tracking.flush_seconds=240"])
    stop_and_kill_server(trainer, server)
    trainer.wait_for("the outage warning", lambda: "does not answer" in trainer.stderr)
    server.start()  # same store, same port, before the run has ended
    assert trainer.finish() == 0, trainer.stderr
    warnings = tracking_warnings(trainer.stderr)
    assert len(warnings) == 2 and "does not answer" in warnings[0] and "answers again" in warnings[1], warnings

    client = MlflowClient(server.url)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    run = client.get_run(run_id)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "FINISHED"
    assert run.data.metrics["val_bpb"] == pytest.approx(summary["val_bpb"])
    assert_in_mlflow_once(client, run_id, run_dir)
    assert json.loads((run_dir / "tracking.json").read_text())["terminal_status"] == "FINISHED"


def sync(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontier.tracking", "sync", str(run_dir), *args], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)


# A test-only sitecustomize.py: metrics.jsonl on a slow disk (NFS), 5 ms a write.
SLOW_METRICS_FILE = """
import time
from frontier.observers import MetricsFile

real = MetricsFile._write

def slow(self, record):
    time.sleep(0.005)
    real(self, record)

MetricsFile._write = slow
"""


def test_a_sync_while_the_run_sends_what_the_store_missed_adds_no_point_twice(tmp_path, server, monkeypatch):
    """The store comes back while the run still trains, and `sync` pushes metrics.jsonl before the run's
    own logging thread sends what it holds: both send the same points, stamped with the record's time,
    which the store keeps once. They had two timestamps (the file's, then the observer's own, which a
    slow write of metrics.jsonl put milliseconds later), so the store kept both."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_METRICS_FILE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(PROJECT_ROOT)]))
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=12", "train.log_every_fraction=0.08",
                                f"tracking.uri={server.url}", "tracking.flush_seconds=240"])
    stop_and_kill_server(trainer, server)
    trainer.wait_for("the outage warning", lambda: "does not answer" in trainer.stderr)
    trainer.wait_for("points the store missed", lambda: len(read_records(run_dir / "metrics.jsonl")) >= 3)
    trainer.proc.send_signal(signal.SIGSTOP)  # its logging thread holds them
    try:
        server.start()
        pushed = sync(run_dir)
    finally:
        trainer.proc.send_signal(signal.SIGCONT)
    assert pushed.returncode == 0 and "new point(s)" in pushed.stdout, pushed.stdout + pushed.stderr
    assert trainer.finish() == 0, trainer.stderr
    client = MlflowClient(server.url)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_in_mlflow_once(client, run_id, run_dir)


def test_server_that_never_comes_back_then_sync(tmp_path, server):
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=8", "train.log_every_fraction=0.125",
                                f"tracking.uri={server.url}", "tracking.flush_seconds=2"])
    stop_and_kill_server(trainer, server)
    assert trainer.finish() == 0, trainer.stderr  # within finish()'s timeout: not MLflow's own retries
    warnings = tracking_warnings(trainer.stderr)
    assert len(warnings) == 1 and f"python -m frontier.tracking sync {run_dir}" in warnings[0], warnings
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and math.isfinite(summary["val_bpb"])

    server.start()  # the same store, later
    pushed = sync(run_dir)
    assert pushed.returncode == 0 and "status FINISHED" in pushed.stdout, pushed.stderr
    client = MlflowClient(server.url)
    run_id = summary["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "FINISHED"
    assert run.data.metrics["val_bpb"] == pytest.approx(summary["val_bpb"])
    assert_in_mlflow_once(client, run_id, run_dir)
    artifacts = {info.path for info in client.list_artifacts(run_id)}
    assert {"config.yaml", "summary.json", "curves.png"} <= artifacts

    histories = {key: client.get_metric_history(run_id, key) for key in run.data.metrics}
    again = sync(run_dir)
    assert again.returncode == 0 and "already in sync" in again.stdout, again.stderr
    (run_dir / "tracking.json").unlink()  # without the acknowledgement record: compared point by point
    again = sync(run_dir)
    assert again.returncode == 0 and "0 new point(s)" in again.stdout, again.stdout + again.stderr
    assert {key: client.get_metric_history(run_id, key) for key in run.data.metrics} == histories
    assert client.get_run(run_id).info.end_time == run.info.end_time


def test_kill_9_then_resume_logs_each_step_once(tmp_path, template_db):
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=20", "train.log_every_fraction=0.05",
                                "checkpoint.every_fraction=0.25", f"tracking.uri={uri}"])  # resume.pt every 5 steps
    client = MlflowClient(uri)

    def logged_past_checkpoint() -> bool:  # metrics.jsonl and MLflow hold steps after the last resume point
        if not (run_dir / "resume.pt").exists() or not (run_dir / "tracking.json").exists():
            return False
        resume_step = torch.load(run_dir / "resume.pt", weights_only=False)["clock"]["steps"]
        run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
        last = max((m.step for m in client.get_metric_history(run_id, "train/loss")), default=0)
        written = max((r["step"] for r in read_records(run_dir / "metrics.jsonl")), default=0)
        return min(last, written) > resume_step

    for _ in range(10):  # MLflow's thread lags the trainer, which may checkpoint again before it is frozen
        trainer.wait_for("steps after a checkpoint", logged_past_checkpoint)
        freeze_between_writes(trainer, tmp_path / "mlflow.db")
        if logged_past_checkpoint():
            break
        trainer.proc.send_signal(signal.SIGCONT)
    else:
        raise AssertionError("the trainer was never frozen with steps logged past its last checkpoint")
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    # While its process lives (frozen here), no second process may write into the run directory.
    hydra_record = (run_dir / ".hydra" / "config.yaml").read_text()
    for args, key in (([f"resume={run_dir}"], "resume"), ([*RUN, f"hydra.run.dir={run_dir}"], "hydra.run.dir")):
        refused = command_in_process("frontier.train", args)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.splitlines() == [
            f"error: {key}={run_dir} is not allowed: another process is running the run there (it holds "
            f"{run_dir / 'run.lock'}); wait for it to end, or stop it first"], refused.stderr
    assert (run_dir / ".hydra" / "config.yaml").read_text() == hydra_record
    assert [p.name for p in (run_dir / ".hydra").iterdir() if p.is_dir()] == []  # no resumed-<time> record
    live = sync(run_dir)
    assert live.returncode == 0 and "its process is still running, so the run is left RUNNING" in live.stdout, (
        live.stdout + live.stderr)
    assert client.get_run(run_id).info.status == "RUNNING"

    trainer.proc.send_signal(signal.SIGKILL)
    trainer.finish()
    resume_step = torch.load(run_dir / "resume.pt", weights_only=False)["clock"]["steps"]
    assert max(r["step"] for r in records(run_dir)) > resume_step  # what a resume must not log twice
    assert max(m.step for m in client.get_metric_history(run_id, "train/loss")) > resume_step
    dead = sync(run_dir)  # nothing holds run.lock now: the run's end was never recorded, and sync says so
    assert dead.returncode == 0 and "status KILLED" in dead.stdout, dead.stdout + dead.stderr
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert f"resume={run_dir}" in run.data.tags["error"] and "kill -9" in run.data.tags["error"]

    # resumed by its MLflow run id: the store names its run directory (Hydra's record of the command goes apart)
    done = subprocess.run([sys.executable, "-m", "frontier.train", f"resume={run_id}", f"tracking.uri={uri}",
                           f"hydra.run.dir={tmp_path / 'resume-command'}"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    steps = [r["step"] for r in records(run_dir) if "checkpoint" not in r and "final" not in r]
    assert steps == list(range(1, 21))
    checkpoints = [r["checkpoint"] for r in records(run_dir) if "checkpoint" in r]
    assert len(checkpoints) == len(set(checkpoints))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    # Steps the killed process sent keep its values there (MLflow cannot delete a point): compare steps,
    # and the losses, which an exact resume reproduces.
    assert_in_mlflow_once(client, run_id, run_dir, same_values=False)
    losses = dict(file_points(records(run_dir))["train/loss"])
    assert {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")} == pytest.approx(losses)


def test_kill_9_before_the_first_checkpoint_then_sync_ends_the_run_killed(tmp_path, template_db):
    """A run killed before it wrote any resume.pt cannot be resumed: `sync` ends its MLflow run, once."""
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=400", "train.log_every_fraction=0.01",
                                "checkpoint.every_fraction=0", f"tracking.uri={uri}"])
    trainer.wait_for("a logged step", lambda: any("train/loss" in r for r in read_records(run_dir / "metrics.jsonl")))
    trainer.proc.send_signal(signal.SIGKILL)
    trainer.finish()
    assert not (run_dir / "resume.pt").exists() and not (run_dir / "summary.json").exists()
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"  # what nothing else would ever end

    dead = sync(run_dir)
    assert dead.returncode == 0, dead.stderr
    assert "status KILLED: its process ended without recording its end" in dead.stdout, dead.stdout
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert "it wrote no resume.pt, so it cannot be resumed" in run.data.tags["error"]
    written = read_records(run_dir / "metrics.jsonl")  # without a line kill -9 may have cut short
    logged = [r["step"] for r in written if "train/loss" in r]
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == logged
    assert run.info.end_time == int(written[-1]["time"] * 1000)  # its last sign of life
    again = sync(run_dir)
    assert again.returncode == 0 and "already in sync" in again.stdout, again.stdout + again.stderr


def test_a_resumed_run_is_not_ended_by_the_summary_of_the_launch_it_continues(tmp_path, template_db):
    """A launch stopped by SIGTERM wrote summary.json (KILLED); once `resume=` continues the run, that file
    no longer describes it: `sync` leaves the live run RUNNING, and after a kill -9 names what happened."""
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    first = Trainer(run_dir, [*RUN, "budget.max_steps=20", "train.log_every_fraction=0.05",
                              "checkpoint.every_fraction=0.25", f"tracking.uri={uri}"])
    first.wait_for("the first resume.pt", lambda: (run_dir / "resume.pt").exists())
    first.proc.send_signal(signal.SIGTERM)
    assert first.finish() == 130, first.stderr
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["status"] == "KILLED", stopped
    run_id, resume_step = stopped["mlflow_run_id"], stopped["steps"]
    client = MlflowClient(uri)

    second = Trainer(run_dir, [], resume=True)
    second.wait_for("a step after the resume point", lambda: any(
        r["step"] > resume_step and "train/loss" in r for r in read_records(run_dir / "metrics.jsonl")))
    freeze_between_writes(second, tmp_path / "mlflow.db")  # alive, and holding run.lock
    live = sync(run_dir)
    assert live.returncode == 0, live.stderr
    assert "its process is still running, so the run is left RUNNING" in live.stdout, live.stdout
    assert client.get_run(run_id).info.status == "RUNNING"

    second.proc.send_signal(signal.SIGKILL)
    second.finish()
    dead = sync(run_dir)
    assert dead.returncode == 0, dead.stderr
    assert "status KILLED: its process ended without recording its end" in dead.stdout, dead.stdout
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"
    assert "kill -9" in run.data.tags["error"] and f"resume={run_dir}" in run.data.tags["error"], run.data.tags


@pytest.mark.filterwarnings("ignore:Heartbeat of storage is supposed to be used with Study.optimize")
def test_a_failed_trials_run_the_store_could_not_close_is_closed_at_the_sweeps_end(tmp_path, server):
    """A trial's process died while the tracking server was down: its run is closed once it is back."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from optuna.trial import TrialState

    from frontier.study import end_trial
    from hydra_plugins.frontier_sweeper._study import Sweep

    client = MlflowClient(server.url)
    run_id = client.create_run(client.create_experiment("sweeps")).info.run_id
    overrides = ["model=tiny", "sweep=lr", f"sweep.storage={tmp_path / 'study.journal'}", "sweep.study_name=closing",
                 "tracking.enabled=true", f"tracking.uri={server.url}", "tracking.experiment=sweeps",
                 f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
            config = compose("config", overrides=overrides, return_hydra_config=True)
            sweep = Sweep(config, overrides, GlobalHydra.instance().config_loader())
    finally:
        GlobalHydra.instance().clear()
    trial = sweep.study.ask()
    end_trial(sweep.study, trial._trial_id, TrialState.FAIL, None, {"mlflow_run_id": run_id})
    server.kill()
    sweep.close_trial_runs([sweep.study._storage.get_trial(trial._trial_id)])
    assert list(sweep.unclosed) == [run_id]
    server.start()
    sweep.end_tracking("KILLED", {}, [])
    assert client.get_run(run_id).info.status == "KILLED" and not sweep.unclosed


# A test-only sitecustomize.py (put on PYTHONPATH): SIGTERM (or the signal named third) to the process as
# the K-th call of one MlflowClient method returns, before its caller has the result
# (FRONTIER_TEST_MLFLOW_SIGNAL="create_run:1", "create_run:1:SIGKILL"; several moments separated by commas).
MLFLOW_SIGNAL = """
import os, signal, time
moments = [m.split(":") for m in os.environ.get("FRONTIER_TEST_MLFLOW_SIGNAL", "").split(",") if m]
if moments:
    from mlflow import MlflowClient

for method, at, *name in moments:
    def signalled(self, *args, _real=getattr(MlflowClient, method), _calls=[], _at=int(at),
                  _signal=getattr(signal, name[0] if name else "SIGTERM"), **kwargs):
        result = _real(self, *args, **kwargs)
        _calls.append(1)
        if len(_calls) == _at:
            os.kill(os.getpid(), _signal)
            time.sleep(5)  # the handler runs in here
        return result

    setattr(MlflowClient, method, signalled)
"""


def signalled_launch(tmp_path: Path, args: list[str], moment: str,
                     module: str = "frontier.train") -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(MLFLOW_SIGNAL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_ROOT)]),
           "FRONTIER_TEST_MLFLOW_SIGNAL": moment}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def runs_of(client: MlflowClient, run_dir: Path) -> list:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(experiments, filter_string=f"tags.run_dir = '{run_dir.resolve()}'")


@pytest.mark.parametrize("moment", ["create_run:1", "log_batch:1", "log_text:1",
                                    "create_run:1:SIGINT,get_run:1:SIGINT", "log_text:1:SIGINT,get_run:1:SIGINT"])
def test_sigterm_while_the_mlflow_run_is_created_ends_it_killed(tmp_path, template_db, moment):
    """create_run:1 is the moment the run exists in the store but its id is not known yet. A second
    Ctrl-C while that run is being ended (get_run, then its tags and status) waits for it, where it had
    left it RUNNING."""
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    done = signalled_launch(tmp_path, [*RUN, "budget.max_steps=2", f"tracking.uri={uri}",
                                       f"hydra.run.dir={run_dir}"], moment)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    first = moment.split(",")[0].split(":")[2:] or ["SIGTERM"]
    if "," in moment:
        assert "SIGINT: the run is already ending; its records are being written" in done.stderr, done.stderr
    [run] = runs_of(MlflowClient(uri), run_dir)
    assert run.info.status == "KILLED", moment
    assert run.data.tags["error"] == f"not started: KeyboardInterrupt: interrupted by {first[0]}"
    # the run directory says so too (it had no summary.json), and sync finds the same run, no twin
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("KILLED", run.data.tags["error"])
    synced = subprocess.run([sys.executable, "-m", "frontier.tracking", "sync", str(run_dir)], cwd=PROJECT_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert synced.returncode == 0, synced.stderr
    [again] = runs_of(MlflowClient(uri), run_dir)
    assert (again.info.run_id, again.info.status) == (run.info.run_id, "KILLED")


SIGNAL_IN_INIT_WORLD = """
import importlib.abc, importlib.machinery, os, signal, sys, time

class SignalInInitWorld(importlib.abc.MetaPathFinder):  # SIGTERM inside frontier.distributed.init_world
    def find_spec(self, name, path=None, target=None):
        if name != "frontier.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            real = module.init_world

            def init_world(*args, **kwargs):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler runs in here
                return real(*args, **kwargs)

            module.init_world = init_world

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, SignalInInitWorld())
"""


STORE_CUT_OFF = """
import os, signal, time
import mlflow.store.db.utils as db_utils

real = db_utils._initialize_tables

def cut_off(engine):  # SIGTERM while MLflow migrates a new store, one temporary table made already
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE _alembic_tmp_experiments (x INTEGER)")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # the handler runs in here
    return real(engine)

db_utils._initialize_tables = cut_off
"""


def test_sigterm_while_a_new_sqlite_store_is_made_leaves_no_half_made_store(tmp_path):
    """The store is made whole or not at all: after the stopped launch the next command makes it and
    records the run, where a cut-off migration had left a database that nothing could open."""
    db = tmp_path / "store" / "mlflow.db"
    run_dir = tmp_path / "run"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STORE_CUT_OFF)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(PROJECT_ROOT)])}
    done = subprocess.run([sys.executable, "-m", "frontier.train", *RUN, "budget.max_steps=2",
                           f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={run_dir}"], cwd=PROJECT_ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not db.exists() and not [p for p in db.parent.iterdir() if "partial" in p.name]
    synced = sync(run_dir, f"tracking.uri=sqlite:///{db}")
    assert synced.returncode == 0, synced.stderr
    [run] = runs_of(MlflowClient(f"sqlite:///{db}"), run_dir)
    assert run.info.status == "KILLED" and run.data.tags["error"].startswith("not started: ")


def test_sigterm_before_a_new_run_owns_its_directory_still_ends_it_recorded(tmp_path, template_db):
    """A signal in the trainer's checks, before its sinks exist, leaves summary.json (no MLflow run yet);
    sync then records that run once, KILLED, and a second sync adds nothing."""
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SIGNAL_IN_INIT_WORLD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(PROJECT_ROOT)])}
    done = subprocess.run([sys.executable, "-m", "frontier.train", *RUN, "budget.max_steps=2", f"tracking.uri={uri}",
                           f"hydra.run.dir={run_dir}"], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {"status": "KILLED", "error": "not started: KeyboardInterrupt: interrupted by SIGTERM"}
    assert runs_of(MlflowClient(uri), run_dir) == []
    for _ in range(2):
        assert sync(run_dir, f"tracking.uri={uri}").returncode == 0
        [run] = runs_of(MlflowClient(uri), run_dir)
        assert (run.info.status, run.data.tags["error"]) == ("KILLED", summary["error"])


def finished_offline(run_dir: Path) -> Path:
    """The records of a small run that finished with no store (no tracking.json)."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  depth: 4\n")
    now = time.time()
    written = [{"step": step, "time": now + step, "train/loss": 5.0 - step} for step in (1, 2, 3)]
    written.append({"step": 3, "time": now + 4, "final": True, "status": "FINISHED", "val_bpb": 3.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written))
    (run_dir / "summary.json").write_text(json.dumps({"status": "FINISHED", "error": None, "steps": 3, "val_bpb": 3.0}))
    return run_dir


def test_two_syncs_of_one_run_at_once_make_one_mlflow_run(tmp_path, template_db):
    """Both had looked for the run directory's MLflow run before either made it: two runs, twice in three."""
    uri = store_in(tmp_path, template_db)
    run_dir = finished_offline(tmp_path / "run")
    both = [subprocess.Popen([sys.executable, "-m", "frontier.tracking", "sync", str(run_dir), f"tracking.uri={uri}"],
                             cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in both]
    assert [proc.returncode for proc in both] == [0, 0], outputs
    client = MlflowClient(uri)
    [run] = runs_of(client, run_dir)
    assert sorted("already in sync" in out for out, _ in outputs) == [False, True], outputs
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (1, 4.0), (2, 3.0), (3, 2.0)]


def test_a_folder_in_place_of_tracking_json_is_refused_before_sync_makes_a_run(tmp_path, template_db):
    """sync records the run it made in tracking.json; where that could not be written, each sync made
    another MLflow run of the same directory."""
    uri = store_in(tmp_path, template_db)
    run_dir = finished_offline(tmp_path / "run")
    (run_dir / "tracking.json").mkdir()
    for _ in range(2):
        done = sync(run_dir, f"tracking.uri={uri}")
        assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
        assert done.stderr.startswith(f"error: RUN_DIR={run_dir} is not allowed: ") and "tracking.json" in done.stderr
        assert len(done.stderr.splitlines()) == 1, done.stderr
    assert runs_of(MlflowClient(uri), run_dir) == []

    (run_dir / "tracking.json").rmdir()
    assert sync(run_dir, f"tracking.uri={uri}").returncode == 0
    assert sync(run_dir, f"tracking.uri={uri}").returncode == 0
    assert len(runs_of(MlflowClient(uri), run_dir)) == 1


@pytest.mark.parametrize("moment", ["create_run:1", "create_run:1:SIGKILL", "log_batch:1", "log_batch:1:SIGKILL"])
def test_a_sync_stopped_while_it_creates_the_mlflow_run_leaves_no_run_behind_and_no_twin(tmp_path, template_db,
                                                                                          moment):
    """SIGTERM while `sync` makes a run directory's MLflow run takes that run back; after kill -9 the next
    sync takes it up again. Either way the run directory ends with one run, holding each point once."""
    uri = store_in(tmp_path, template_db)
    run_dir = finished_offline(tmp_path / "run")
    stopped = signalled_launch(tmp_path, ["sync", str(run_dir), f"tracking.uri={uri}"], moment, "frontier.tracking")
    client = MlflowClient(uri)
    if moment.endswith("SIGKILL"):
        assert stopped.returncode == -signal.SIGKILL, stopped.stderr
        assert [r.info.status for r in runs_of(client, run_dir)] == ["RUNNING"]
    else:
        assert stopped.returncode == 130 and stopped.stderr == "interrupted\n", stopped.stderr
        assert runs_of(client, run_dir) == []
    assert not (run_dir / "tracking.json").exists()

    done = sync(run_dir, f"tracking.uri={uri}")
    assert done.returncode == 0 and "status FINISHED" in done.stdout, done.stdout + done.stderr
    [run] = runs_of(client, run_dir)
    assert run.info.status == "FINISHED" and run.data.params["model.depth"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [
        (1, 4.0), (2, 3.0), (3, 2.0)]
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run.info.run_id


def test_sigterm_while_a_resume_reopens_its_mlflow_run_ends_it_killed_again(tmp_path, template_db):
    uri = store_in(tmp_path, template_db)
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=8", "checkpoint.every_fraction=0.25", f"tracking.uri={uri}"])
    trainer.wait_for("resume.pt", lambda: (run_dir / "resume.pt").exists())
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.finish() == 130, trainer.stderr[-3000:]
    client = MlflowClient(uri)

    done = signalled_launch(tmp_path, [f"resume={run_dir}"], "update_run:1")  # reopened: RUNNING in the store
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr[-3000:]
    [run] = runs_of(client, run_dir)
    assert run.info.status == "KILLED" and run.data.tags["status"] == "KILLED"

    done = subprocess.run([sys.executable, "-m", "frontier.train", f"resume={run_dir}"], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [run] = runs_of(client, run_dir)
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert_in_mlflow_once(client, run.info.run_id, run_dir, same_values=False)


def test_store_on_a_disk_that_fills_up_mid_run_then_sync(tmp_path, template_db, small_disk):
    uri = store_in(small_disk, template_db)
    run_dir = tmp_path / "run"
    trainer = Trainer(run_dir, [*RUN, "budget.max_steps=12", f"tracking.uri={uri}", "tracking.flush_seconds=3"])
    trainer.wait_for("the MLflow run", lambda: (run_dir / "tracking.json").exists())
    trainer.proc.send_signal(signal.SIGSTOP)
    filler = fill(small_disk)
    trainer.proc.send_signal(signal.SIGCONT)
    assert trainer.finish() == 0, trainer.stderr[-3000:]
    assert "Traceback" not in trainer.stderr, trainer.stderr[-3000:]
    warned = tracking_warnings(trainer.stderr)
    # SQLite names ENOSPC "database or disk is full" or, when it hits the rollback journal, "disk I/O error"
    assert warned and "sqlite3.OperationalError" in warned[0], "\n".join(warned) or trainer.stderr[-3000:]
    assert f"frontier.tracking sync {run_dir}" in warned[0], warned
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "FINISHED"

    filler.unlink()  # space again: sync pushes what the full disk refused, each point once
    done = sync(run_dir)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    assert_in_mlflow_once(MlflowClient(uri), run_id, run_dir)
