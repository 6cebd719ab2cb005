"""MLflow tracking: what a run records, over SQLite and HTTP, in parallel, and when things go wrong."""
from __future__ import annotations

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
import warnings
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import requests
from hydra import compose, initialize_config_dir
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
import sqlalchemy.exc
from omegaconf import OmegaConf
from sqlalchemy.exc import SADeprecationWarning

from frontier import leaderboard, mlflow_observer, tracking
from frontier import store as store_module
from frontier.config import PROJECT_ROOT, ConfigError, TrackingConfig
from frontier.observers import MetricsFile, notify
from frontier.study import open_storage
from frontier.trainer import train
from tests.conftest import DATA_CACHE, WIKI, command_in_process, spread

pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # raised inside MLflow

# A few steps of the tiny model: every hook fires (logs, one checkpoint, final eval) in seconds.
FAST = [
    "model=tiny",
    "budget=phase1",  # pinned: the default is sized to the machine
    f"data.path={WIKI}",
    DATA_CACHE,
    "data.vocab_size=1024",
    "data.tokenizer_train_chars=2000000",
    "device=cpu",
    "budget.seconds=60",
    "budget.max_steps=2",
    "budget.excluded_steps=0",
    "model.seq_len=128",
    "train.batch_tokens=1024",
    "train.device_batch_rows=8",
    "train.log_every_fraction=0.5",
    "eval.checkpoint_tokens=512",
    "eval.final_tokens=2048",
    "eval.every_fraction=0.5",
]


@pytest.fixture(autouse=True)
def _no_env_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # tests name their own stores


@pytest.fixture(scope="module", autouse=True)
def _wiki():
    if not WIKI.is_dir():
        pytest.skip(f"shared data not found at {WIKI}")


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=[*FAST, *overrides])


def sqlite_uri(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture
def store(mlflow_store) -> str:
    return mlflow_store


def only_run(client: MlflowClient, experiment: str = "frontier"):
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1
    return runs[0]


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for info in client.list_artifacts(run_id, path):
        found |= artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fake_run(tmp_path: Path, name: str, **tracking_fields):
    """What MlflowObserver.for_run reads from a trainer Run, without training anything."""
    return SimpleNamespace(config=SimpleNamespace(tracking=TrackingConfig(**tracking_fields)),
                           raw=OmegaConf.create({"model": {"depth": 4}, "run": name}),
                           run_dir=tmp_path / name, summary={})


def assert_recorded(client: MlflowClient, run, raw) -> None:
    """Params, curves with timestamps, final metrics and artifacts of one finished tiny run."""
    assert run.info.status == "FINISHED"
    expected = tracking.flatten(OmegaConf.to_container(raw, resolve=True))
    assert run.data.params == expected  # every key of the resolved config
    assert run.data.params["model.depth"] == "4"
    tags = run.data.tags
    assert tags["status"] == "FINISHED" and tags["device"] == "cpu" and tags["budget"] == "phase1"
    assert tags["mfu_basis"] == "cpu time"  # on a CPU, mfu is taken per CPU-second
    assert tags["torch"] and tags["host"] and tags["device_count"] == "1"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert len(losses) == 2 and all(m.timestamp > 1e12 and m.step >= 1 for m in losses)
    val = client.get_metric_history(run.info.run_id, "val_bpb")
    assert [m.step for m in val] == [1, 2]  # the checkpoint at half the budget, then the final eval
    for key in ("val_bpb", "tokens_per_second", "mfu", "budget_utilization", "params", "flops_per_token"):
        assert math.isfinite(run.data.metrics[key])
    assert {"config.yaml", "summary.json", "curves.png"} <= artifact_paths(client, run.info.run_id)


def assert_charts_view_plots(client: MlflowClient, run) -> None:
    """The experiment's saved view charts val_bpb, train/loss and tokens per second against charged
    seconds, and the run has every point it needs: the UI pairs a point with the x-axis metric's point
    at the same step, and drops one that has none."""
    view = json.loads(client.get_experiment(run.info.experiment_id).tags[store_module.CHARTS_VIEW_TAG])
    assert view["name"] == "Frontier charts"
    charts = json.loads(view["state"])["compareRunCharts"]
    assert [chart["metricKey"] for chart in charts] == ["val_bpb", "train/loss", "tokens_per_second"]
    charged = {m.step for m in client.get_metric_history(run.info.run_id, "charged_seconds")}
    for chart in charts:
        assert (chart["xAxisKey"], chart["selectedXAxisMetricKey"]) == ("metric", "charged_seconds")
        steps = {m.step for m in client.get_metric_history(run.info.run_id, chart["metricKey"])}
        assert steps and steps <= charged, chart["metricKey"]


# -----------------------------------------------------------------------------
# What a run records


def test_tiny_run_is_recorded(tmp_path, store):
    uri = store
    raw = compose_cfg(f"tracking.uri={uri}", "tracking.log_checkpoint=true", "tracking.run_name=tiny")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bpb = train(raw, tmp_path / "run")
    client = MlflowClient(uri)
    run = only_run(client)
    assert run.info.run_name == "tiny"
    assert_recorded(client, run, raw)
    assert run.data.metrics["val_bpb"] == pytest.approx(bpb)
    assert "checkpoint/final.pt" in artifact_paths(client, run.info.run_id)
    assert_charts_view_plots(client, run)
    summary = json.loads(Path(download_artifacts(run_id=run.info.run_id, artifact_path="summary.json",
                                                 dst_path=str(tmp_path), tracking_uri=uri)).read_text())
    assert summary["status"] == "FINISHED"
    # Artifacts live next to the database, not in ./mlartifacts of the working directory.
    assert run.info.artifact_uri.startswith((tmp_path / "artifacts").as_uri())
    # SADeprecationWarning: SQLAlchemy about MLflow's own internals, nothing this project calls.
    mlflow_deprecations = [w for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
                           and not issubclass(w.category, SADeprecationWarning)
                           and ("mlflow" in w.filename or "tracking" in w.filename
                                or "mlflow" in str(w.message).lower())]
    assert not mlflow_deprecations, [str(w.message) for w in mlflow_deprecations]


def test_tracking_uri_default_env_and_relative(monkeypatch):
    root_db = PROJECT_ROOT / "mlruns" / "mlflow.db"
    assert tracking.tracking_uri(TrackingConfig()) == f"sqlite:///{root_db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert tracking.tracking_uri(TrackingConfig()) == "http://tracking.example:5000"
    assert tracking.tracking_uri(TrackingConfig(uri="sqlite:////abs/x.db")) == "sqlite:////abs/x.db"
    # Relative to the project root, whatever the working directory.
    assert tracking.tracking_uri(TrackingConfig(uri="sqlite:///mlruns/mlflow.db")) == f"sqlite:///{root_db}"


def test_a_relative_store_is_taken_from_home_wherever_the_command_runs(tmp_path, monkeypatch):
    from frontier import paths
    from frontier.study import study_storage

    monkeypatch.setattr(paths, "_chosen", {})  # no paths.home= from an earlier command in this process
    monkeypatch.setenv("FRONTIER_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    home = tmp_path / "home"
    assert study_storage(None, "s") == str(home / "mlruns" / "sweeps" / "s.journal")
    assert study_storage("mlruns/sweeps/s.journal", "x") == study_storage(None, "s")
    assert study_storage("sqlite:///studies.db?timeout=5", "s") == f"sqlite:///{home / 'studies.db'}?timeout=5"
    assert study_storage("/abs/s.journal", "s") == "/abs/s.journal"
    assert study_storage("postgresql://u@h:5432/db", "s") == "postgresql://u@h:5432/db"
    assert tracking.tracking_uri(TrackingConfig(uri="sqlite:///m.db")) == f"sqlite:///{home / 'm.db'}"


# -----------------------------------------------------------------------------
# A real tracking server


@pytest.fixture
def mlflow_server(tmp_path, template_db):
    shutil.copy(template_db, tmp_path / "server.db")
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # its own group: its workers go too
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "mlflow server did not answer /health"
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.mark.slow
def test_run_over_http_server(tmp_path, mlflow_server):
    raw = compose_cfg(f"tracking.uri={mlflow_server}")
    train(raw, tmp_path / "run")
    client = MlflowClient(mlflow_server)
    assert_recorded(client, only_run(client), raw)
    assert list((tmp_path / "server-artifacts").rglob("curves.png"))  # uploaded through the server


# -----------------------------------------------------------------------------
# Parallel trials, sweeps


WORKER = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from omegaconf import OmegaConf
from frontier.config import TrackingConfig
from frontier.tracking import MlflowObserver

uri, folder, index = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
(folder / f"ready{index}").touch()
while not (folder / "go").exists():  # all four hit the fresh store at the same moment
    time.sleep(0.01)
tracking = TrackingConfig(uri=uri, experiment="race", run_name=f"worker{index}", flush_seconds=120)  # ample at load
run = SimpleNamespace(config=SimpleNamespace(tracking=tracking), raw=OmegaConf.create({"seed": index}),
                      run_dir=folder / f"run{index}", summary={})
observer = MlflowObserver.for_run(run)
observer.on_start({"device": "cpu", "budget": "race"})
for step in range(1, 11):
    observer.on_log({"train/loss": 5.0 / step, "charged_seconds": 0.1 * step}, step)
observer.on_checkpoint(1, 2.0, 10, 1.0)
observer.on_end({"val_bpb": 1.5 + index, "steps": 10}, "FINISHED", None)
sys.exit(0 if observer.delivered else 1)
"""


@pytest.mark.slow
def test_four_processes_share_a_fresh_sqlite_store(tmp_path):
    uri = sqlite_uri(tmp_path)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    workers = [subprocess.Popen([sys.executable, str(script), uri, str(tmp_path), str(i)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(4)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("ready*"))) < 4 and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0, 0], "\n".join(outputs)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("race").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"worker{i}" for i in range(4)]
    for run in runs:
        assert run.info.status == "FINISHED"
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 10


def test_sweep_parent_with_nested_trials(tmp_path, store):
    sweep_cfg = TrackingConfig(uri=store, experiment="sweeps")
    parent = tracking.start_parent_run(sweep_cfg, "sweep-1", {"space": {"optim.matrix_lr": "log(0.01, 0.1)"},
                                                              "n_trials": 2}, {"sampler": "tpe"})
    statuses = {}
    for number, status in ((0, "FINISHED"), (1, "PRUNED")):
        # A trial names another experiment by mistake: it still lands next to its parent.
        run = fake_run(tmp_path, f"trial{number}", uri=sweep_cfg.uri, experiment="elsewhere",
                       parent_run_id=parent, run_name=f"trial-{number}")
        observer = tracking.MlflowObserver.for_run(run)
        observer.on_checkpoint(1, 2.0, 10, 0.1)
        observer.on_end({"val_bpb": math.nan, "stopped_value": 2.0, "steps": 10}, status, None)
        statuses[observer.run_id] = status
    best = tmp_path / "best.json"
    best.write_text("{}")
    tracking.end_parent_run(sweep_cfg, parent, "FINISHED", {"best_val_bpb": 1.25}, [best])

    client = MlflowClient(sweep_cfg.uri)
    parent_run = client.get_run(parent)
    assert parent_run.info.status == "FINISHED"
    assert parent_run.data.metrics["best_val_bpb"] == 1.25
    assert parent_run.data.params["space.optim.matrix_lr"] == "log(0.01, 0.1)"
    assert parent_run.data.tags["sampler"] == "tpe"
    assert "best.json" in artifact_paths(client, parent)
    for run_id, status in statuses.items():
        child = client.get_run(run_id)
        assert child.data.tags["mlflow.parentRunId"] == parent
        assert child.info.experiment_id == parent_run.info.experiment_id
        assert child.data.tags["status"] == status
        assert child.info.status == {"FINISHED": "FINISHED", "PRUNED": "KILLED"}[status]
        assert "val_bpb" in child.data.metrics  # the checkpoint; the NaN final value is not logged
    assert client.get_experiment_by_name("elsewhere") is None


@pytest.mark.parametrize("kind_before, kind_after", [
    ("genai_development", "genai_development"),  # a kind a user chose in the UI stays
    (None, "custom_model_development"),  # an experiment made before Frontier said its kind
    ("no experiment", "custom_model_development"),
], ids=["chosen-kind-stays", "existing-experiment", "new-experiment"])
def test_the_experiment_is_a_model_training_one_for_mlflow_s_ui(store, kind_before, kind_after):
    """`mlflow.experimentKind` says model training in MLflow's words (custom_model_development, the value its
    UI writes), so that MLflow UIs that read it open the experiment on its runs, not on GenAI tracing."""
    client = MlflowClient(store)
    if kind_before != "no experiment":
        client.create_experiment("frontier", tags={} if kind_before is None else {"mlflow.experimentKind": kind_before})
    tracking.start_parent_run(TrackingConfig(uri=store), "sweep", {}, {})
    assert client.get_experiment_by_name("frontier").tags.get("mlflow.experimentKind") == kind_after


def test_closing_killed_trials_runs_goes_past_a_run_it_cannot_reach(tmp_path, store):
    cfg = TrackingConfig(uri=store, experiment="sweeps")
    parent = tracking.start_parent_run(cfg, "sweep-1", {}, {})
    client = MlflowClient(store)
    running = [client.create_run(client.get_run(parent).info.experiment_id).info.run_id for _ in range(2)]
    failed = tracking.close_runs(cfg, ["0" * 32, *running], "KILLED")
    assert list(failed) == ["0" * 32] and failed["0" * 32]  # why, in words
    assert [client.get_run(run_id).info.status for run_id in running] == ["KILLED", "KILLED"]
    assert client.get_run(parent).info.status == "RUNNING"  # not among the runs to close


# -----------------------------------------------------------------------------
# Failures


def test_run_that_raises_ends_failed(tmp_path, store, monkeypatch):
    def boom(run, vset):
        raise RuntimeError("boom at the checkpoint")

    monkeypatch.setattr("frontier.trainer.evaluate", boom)  # the first evaluation is a checkpoint's
    uri = store
    with pytest.raises(RuntimeError, match="boom"):
        train(compose_cfg(f"tracking.uri={uri}"), tmp_path / "run")
    client = MlflowClient(uri)
    run = only_run(client)
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == "RuntimeError: boom at the checkpoint"
    assert client.get_metric_history(run.info.run_id, "train/loss")  # the curve up to the failure
    assert {"config.yaml", "summary.json"} <= artifact_paths(client, run.info.run_id)


@pytest.mark.slow
def test_sigterm_ends_killed(tmp_path, store):
    uri = store
    args = [*FAST, "budget.seconds=600", "budget.max_steps=null", "train.log_every_fraction=0.001",
            "eval.every_fraction=0", f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen([sys.executable, "-m", "frontier.train", *args], cwd=PROJECT_ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = MlflowClient(uri)
    try:
        deadline = time.time() + 180
        while True:  # until the loop has logged: the run is RUNNING and training
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "the run never logged a training loss"
            experiment = client.get_experiment_by_name("frontier")
            runs = client.search_runs([experiment.experiment_id]) if experiment else []
            if runs and "train/loss" in runs[0].data.metrics:
                assert runs[0].info.status == "RUNNING"
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out
    run = client.get_run(runs[0].info.run_id)
    assert run.info.status == "KILLED", out
    assert run.data.tags["status"] == "KILLED"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "KILLED"


@pytest.mark.parametrize("store, reason", spread([
    ("http://127.0.0.1:{port}", "is unreachable (ConnectionError); start the server or correct the URI"),
    # MLflow's SQL store retried this for two minutes, after Hydra had written the run directory
    ("postgresql://postgres@127.0.0.1:{port}/x", "could not be opened (psycopg2.OperationalError: connection to"),
    ("foo://bar", "could not be opened (UnsupportedModelRegistryStoreURIException"),
], ["http", "postgresql", "unknown scheme"], every=3))
def test_a_store_that_cannot_be_opened_stops_the_run_before_anything_is_written(tmp_path, store, reason):
    url = store.format(port=free_port())  # nothing listens there
    done = command_in_process("frontier.train", [*FAST, f"tracking.uri={url}", f"data.cache_dir={tmp_path / 'cache'}",
                                                 f"hydra.run.dir={tmp_path / 'run'}"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and reason in errors[0], errors
    assert errors[0].endswith("; or set tracking.required=false to train without tracking")
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()  # found before any data is read


def test_a_sink_that_cannot_be_built_leaves_no_mlflow_run_running(wiki, tmp_path):
    """The MLflow run is created, then the sweep trial's study cannot be opened: the launch is
    refused, and the run it had opened ends FAILED with why instead of staying RUNNING for good."""
    uri = sqlite_uri(tmp_path)
    journal = tmp_path / "study.journal"
    optuna.create_study(study_name="another-study", storage=open_storage(str(journal)))
    cfg = compose_cfg("tracking.enabled=true", f"tracking.uri={uri}", "trial.study=no-such-study",
                      f"trial.storage={journal}", "trial.number=0")
    with pytest.raises(ConfigError, match="trial.study='no-such-study' is not a study"):
        train(cfg, tmp_path / "run")
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("frontier").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["status"] == "FAILED"
    assert run.data.tags["error"].startswith("not started: ConfigError")


def test_unreachable_server_not_required_runs_locally(tmp_path, capfd):
    url = f"http://127.0.0.1:{free_port()}"
    bpb = train(compose_cfg(f"tracking.uri={url}", "tracking.required=false"), tmp_path / "run")
    assert math.isfinite(bpb)
    err = capfd.readouterr().err
    assert f"warning: tracking: tracking.uri={url} is unreachable" in err and "training without tracking" in err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "FINISHED"
    # Later, the run goes to a store that never heard of it: sync creates its MLflow run.
    store = sqlite_uri(tmp_path)
    assert "created" in tracking.sync(tmp_path / "run", store)
    assert f"warning: tracking: there was no MLflow store at tracking.uri={store}, so sync creates one" in (
        capfd.readouterr().err)
    client = MlflowClient(store)
    run = only_run(client)
    assert run.info.status == "FINISHED" and run.data.metrics["val_bpb"] == pytest.approx(bpb)
    assert run.data.params["model.depth"] == "4" and run.data.tags["run_dir"] == str((tmp_path / "run").resolve())
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
    assert "already in sync" in tracking.sync(tmp_path / "run", store)
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_an_end_the_store_takes_just_after_flush_seconds_is_recorded_and_one_cut_short_is_not(
        tmp_path, store, monkeypatch, capfd):
    """A store slow to take the run's end after an outage: the call in flight when tracking.flush_seconds
    runs out still lands, and tracking.json says so with no warning; what waited behind it is dropped,
    said once, and tracking.json names no terminal status, so `sync` sends it."""
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("slow")).info.run_id
    landed, flush = [], 1.0

    def slow(name):  # in flight when flush_seconds runs out, landing 0.2 s later (on_end waits IN_FLIGHT_SECONDS)
        time.sleep(flush + 0.2)
        landed.append(name)

    for calls, acked in (([(slow, "end")], "FINISHED"), ([(slow, "end"), (slow, "status")], None)):
        run_dir = tmp_path / str(len(calls))
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("")
        monkeypatch.setattr(mlflow_observer, "_end_calls", lambda *args, calls=calls: calls)
        landed.clear()
        observer = tracking.MlflowObserver(client, store, run_id, run_dir,
                                           SimpleNamespace(log_checkpoint=False, flush_seconds=flush))
        observer.on_end({"steps": 3}, "FINISHED", None)
        assert landed == ["end"]
        assert tracking.read_ack(run_dir).get("terminal_status") == acked
        warned = [line for line in capfd.readouterr().err.splitlines() if "has not taken all" in line]
        assert len(warned) == (acked is None), warned


def test_store_failing_mid_run_then_sync(tmp_path, store, monkeypatch, capfd):
    original = MlflowClient.log_batch

    def outage(self, run_id, metrics=(), **entities):  # the store stops answering once training logs
        if any(m.key == "train/loss" for m in metrics):
            raise MlflowException("simulated outage")
        return original(self, run_id, metrics=metrics, **entities)

    monkeypatch.setattr(MlflowClient, "log_batch", outage)
    uri = store
    run_dir = tmp_path / "run"
    bpb = train(compose_cfg(f"tracking.uri={uri}", "tracking.flush_seconds=1"), run_dir)
    assert math.isfinite(bpb)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["val_bpb"] == pytest.approx(bpb)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: tracking:")]
    assert len(warnings) == 1 and "simulated outage" in warnings[0], warnings
    assert f"python -m frontier.tracking sync {run_dir}" in warnings[0]
    client = MlflowClient(uri)
    assert only_run(client).info.status == "RUNNING"  # the end never reached the store

    monkeypatch.undo()  # the store is back
    with open(run_dir / "metrics.jsonl", "ab") as f:  # and a failing disk left bytes that are not UTF-8
        f.write(b"\x00\x00\x00\xff\xfe\n{\"step\": \"x\"}\n"  # and lines that are no records: sync had blamed
                b"{\"step\": 9, \"time\": null, \"train/loss\": 1}\n{\"step\": 9, \"train/loss\": 1}\n"  # the store
                b"{\"step\": 9, \"tra")  # for a record without its time, and failed every time
    lines = (run_dir / "metrics.jsonl").read_bytes().count(b"\n") + 1
    assert "status FINISHED" in tracking.sync(run_dir)
    warned = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: tracking:")]
    assert warned == [f"warning: tracking: 5 line(s) of {run_dir / 'metrics.jsonl'} are not metrics records and "
                      f"are left out (line {lines - 4}, {lines - 3}, {lines - 2}, {lines - 1}, {lines})"], warned
    run = only_run(client)
    assert run.info.status == "FINISHED" and run.data.metrics["val_bpb"] == pytest.approx(bpb)
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 2
    assert "already in sync" in tracking.sync(run_dir)


def test_refused_call_is_skipped_and_the_rest_goes_on(tmp_path, store, monkeypatch, capfd):
    original = MlflowClient.log_batch

    def refuse_step_3(self, run_id, metrics=(), **entities):
        if any(m.step == 3 for m in metrics):
            raise MlflowException.invalid_parameter_value("bad value")
        return original(self, run_id, metrics=metrics, **entities)

    monkeypatch.setattr(MlflowClient, "log_batch", refuse_step_3)
    run_dir = tmp_path / "refused"
    observer = tracking.MlflowObserver.for_run(fake_run(tmp_path, "refused", uri=store))
    sinks = [MetricsFile(run_dir / "metrics.jsonl"), observer]
    for step in range(1, 6):
        notify(sinks, "on_log", {"train/loss": 5.0 / step}, step)
    summary = {"val_bpb": 1.5, "steps": 5, "status": "FINISHED", "error": None}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    notify(sinks, "on_end", summary, "FINISHED", None)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: tracking:")]
    assert len(warnings) == 1 and "refused" in warnings[0], warnings
    assert f"python -m frontier.tracking sync {run_dir}" in warnings[0]
    client = MlflowClient(store)
    run = client.get_run(observer.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["val_bpb"] == 1.5
    assert [m.step for m in client.get_metric_history(observer.run_id, "train/loss")] == [1, 2, 4, 5]

    monkeypatch.undo()  # the store takes it now (a renewed token): sync sends what was refused, once
    assert "1 new point(s), status FINISHED" in tracking.sync(run_dir)
    assert [m.step for m in client.get_metric_history(observer.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert "already in sync" in tracking.sync(run_dir)


def test_a_store_error_is_named_by_the_database_s_own_words(tmp_path, store, monkeypatch, capfd):
    """MLflow wraps SQLAlchemy's error, whose text can open with where it happened (an autoflush), not why."""
    original, full = MlflowClient.log_batch, [True]

    def disk_full(self, run_id, metrics=(), **entities):  # once, as mlflow's managed session raises it
        if not (full and any(m.key == "train/loss" for m in metrics)):
            return original(self, run_id, metrics=metrics, **entities)
        full.clear()
        error = sqlalchemy.exc.OperationalError("INSERT INTO metrics ...", (), sqlite3.OperationalError(
            "database or disk is full"))
        error.add_detail("raised as a result of Query-invoked autoflush; consider using a session.no_autoflush "
                         "block if this flush is occurring prematurely")
        try:
            raise error
        except sqlalchemy.exc.OperationalError as err:
            raise MlflowException(message=err, error_code="TEMPORARILY_UNAVAILABLE") from err

    monkeypatch.setattr(MlflowClient, "log_batch", disk_full)
    observer = tracking.MlflowObserver.for_run(fake_run(tmp_path, "full", uri=store))
    observer.on_log({"train/loss": 5.0}, 1)
    observer.on_end({"val_bpb": 1.5, "steps": 1}, "FINISHED", None)
    [warned, *_] = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: tracking:")]
    assert "does not answer (sqlite3.OperationalError: database or disk is full)" in warned, warned
    assert [m.value for m in MlflowClient(store).get_metric_history(observer.run_id, "train/loss")] == [5.0]


def test_resume_reopens_the_run_and_sends_what_it_missed(tmp_path, store):
    first = tracking.MlflowObserver.for_run(fake_run(tmp_path, "run", uri=store))
    first.on_log({"train/loss": 4.0}, 1)
    first.on_end({"steps": 1, "val_bpb": None}, "KILLED", "interrupted by SIGTERM")
    client = MlflowClient(store)
    assert client.get_run(first.run_id).data.tags["error"] == "interrupted by SIGTERM"
    # metrics.jsonl holds step 2, which the store never took, and step 3, after the resume point.
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        for step, loss in ((2, 3.0), (3, 2.5)):
            f.write(json.dumps({"step": step, "time": time.time(), "train/loss": loss}) + "\n")

    resumed = fake_run(tmp_path, "run", uri=store)
    resumed.summary.update({"mlflow_run_id": first.run_id, "resume_step": 2, "resumed": 1})
    observer = tracking.MlflowObserver.for_run(resumed)
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.tags["status"] == "RUNNING"
    assert "error" not in run.data.tags  # the interruption is over
    observer.on_log({"train/loss": 2.0}, 3)
    observer.on_end({"steps": 3, "val_bpb": 1.25}, "FINISHED", None)
    assert observer.delivered
    history = client.get_metric_history(first.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 4.0), (2, 3.0), (3, 2.0)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "FINISHED" and "error" not in run.data.tags


@pytest.mark.slow
def test_sync_refuses_what_is_not_a_run_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, says in ((["sync", str(tmp_path / "empty")], "is not a run directory"),
                       (["sync", str(tmp_path / "missing")], "no such directory"),
                       (["sync"], "needs the run directory"),
                       (["push", str(tmp_path)], "push is not allowed"),
                       (["sync", str(tmp_path / "empty"), "tracking.experiment=x"], "tracking.uri=URI only")):
        done = command_in_process("frontier.tracking", args)
        assert done.returncode == 2 and done.stderr.startswith("error: ") and says in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert not list((tmp_path / "empty").iterdir())  # nothing written


def dead_run_dir(tmp_path: Path, uri: str) -> tuple[Path, str]:
    """A run directory whose process died after logging two steps: an MLflow run, its tracking.json and
    metrics.jsonl, no summary.json, and a run.lock that nothing holds."""
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("dead")).info.run_id
    run_dir = tmp_path / "dead"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": time.time(), "train/loss": 5.0 / s})
                                                   + "\n" for s in (1, 2)))
    (run_dir / "run.lock").touch()
    tracking.write_ack(run_dir, uri, run_id, acked_records=0, terminal_status=None)
    return run_dir, run_id


def test_sync_leaves_a_dead_run_that_mlflow_has_ended_already_as_it_is(tmp_path, store):
    """A sweep driver ends the MLflow run of a trial whose process died: sync keeps its status and error."""
    run_dir, run_id = dead_run_dir(tmp_path, store)
    client = MlflowClient(store)
    client.set_tag(run_id, "error", "trial 3's process died (found by the sweep driver)")
    client.set_terminated(run_id, "FAILED")
    done = tracking.sync(run_dir)
    assert "2 new point(s)" in done and "MLflow has the run FAILED already" in done, done
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith("trial 3's process died")
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [1, 2]
    assert "already in sync" in tracking.sync(run_dir)


def test_a_filesystem_that_cannot_lock_runs_unguarded_with_a_warning(tmp_path, store, monkeypatch, capfd):
    import errno
    import fcntl

    from frontier import lifecycle

    flock = fcntl.flock

    def no_locks(fd, operation):  # the run directory's filesystem (the store's file lock still works)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("run.lock"):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return flock(fd, operation)

    run_dir, run_id = dead_run_dir(tmp_path, store)
    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert lifecycle.own(run_dir, "hydra.run.dir") is None  # the run goes on
    warned = capfd.readouterr().err.splitlines()
    assert warned == [f"warning: {run_dir / 'run.lock'} cannot be locked on this filesystem (No locks available): "
                      "a second process is not kept out of this run directory, and `frontier.tracking sync` "
                      "cannot tell whether the run is alive"], warned
    lifecycle.check_not_running(run_dir, "resume")  # nothing to refuse on
    assert "no summary.json, so the run is left RUNNING" in tracking.sync(run_dir)  # alive or not: unknown
    assert MlflowClient(store).get_run(run_id).info.status == "RUNNING"


def damage_summary_into_a_folder(run_dir: Path) -> None:
    (run_dir / "summary.json").unlink()
    (run_dir / "summary.json").mkdir()


def damage_metrics_into_a_folder(run_dir: Path) -> None:
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").mkdir()


DAMAGED_RUN_FILES = [  # (what breaks a run directory's file, what sync says of it)
    (lambda d: (d / "summary.json").write_text("[1, 2]"), "summary.json is not a JSON object"),
    (lambda d: (d / "summary.json").write_text("null"), "summary.json is not a JSON object"),
    (lambda d: (d / "summary.json").write_text('{"status": 5}'), "summary.json has status 5, not one of"),
    (damage_summary_into_a_folder, "summary.json cannot be read (Is a directory)"),
    (damage_metrics_into_a_folder, "metrics.jsonl cannot be read (Is a directory)"),
    (lambda d: (d / ".hydra" / "config.yaml").write_text("a: [\n"), "config.yaml is not YAML"),
    (lambda d: (d / ".hydra" / "config.yaml").write_text("- 1\n"), "config.yaml is not a mapping"),
]


@pytest.mark.parametrize("damage, says", spread(DAMAGED_RUN_FILES, [says for _, says in DAMAGED_RUN_FILES], every=7))
def test_sync_names_a_run_file_it_cannot_read_and_leaves_the_run_as_it_was(tmp_path, store, damage, says):
    """A run directory's own file that is unreadable or of the wrong kind is one sentence naming it, exit 2:
    never blamed on the store (exit 1, "run it again when the store answers"), never a status it did not end with."""
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  depth: 4\n")
    now = time.time()
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "time": now, "train/loss": 4.0}) + "\n"
        + json.dumps({"step": 1, "time": now, "final": True, "status": "FINISHED", "val_bpb": 3.0}) + "\n")
    (run_dir / "summary.json").write_text(json.dumps({"status": "FINISHED", "error": None, "steps": 1,
                                                       "val_bpb": 3.0}))

    assert "status FINISHED" in tracking.sync(run_dir, store)  # recorded first, here: the damaged sync is the subject
    client = MlflowClient(store)
    run_id = only_run(client).info.run_id
    damage(run_dir)
    done = subprocess.run([sys.executable, "-m", "frontier.tracking", "sync", str(run_dir), f"tracking.uri={store}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: RUN_DIR={run_dir} is not allowed: {run_dir}") and says in done.stderr, (
        done.stderr)
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["status"] == "FINISHED"


# -----------------------------------------------------------------------------
# Leaderboard


def add_run(client, experiment_id, name, params, metrics, status="FINISHED", tags=None):
    run = client.create_run(experiment_id, run_name=name, tags=tags or {})
    now = int(time.time() * 1000)
    client.log_batch(run.info.run_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
                     params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run.info.run_id, status)


def test_leaderboard_orders_runs_and_shows_differences(tmp_path, store, capsys):
    uri = store
    client = MlflowClient(uri)
    exp = client.create_experiment("lb", artifact_location=(tmp_path / "artifacts").as_uri())
    base = {"model.depth": 10, "optim.matrix_lr": 0.04, "budget.name": "phase1"}
    add_run(client, exp, "deeper", {**base, "model.depth": 12, "tracking.run_name": "deeper"},
            {"val_bpb": 1.05, "tokens_per_second": 900.0, "core": 0.15})
    add_run(client, exp, "baseline", {**base, "tracking.run_name": "baseline"},
            {"val_bpb": 1.10, "tokens_per_second": 1000.0, "core": 0.20})
    add_run(client, exp, "slow-lr", {**base, "optim.matrix_lr": 0.02},
            {"val_bpb": 1.20, "tokens_per_second": 1100.0})
    add_run(client, exp, "shallow", {**base, "model.depth": 6}, {"val_bpb": 1.30, "core": 0.30})
    add_run(client, exp, "crashed", base, {"val_bpb": 0.50}, status="FAILED")
    add_run(client, exp, "sweep", base, {"val_bpb": 0.40}, tags={tracking.RUN_KIND_TAG: "sweep"})
    add_run(client, exp, "other-budget", {**base, "budget.name": "phase2"}, {"val_bpb": 0.90})

    assert leaderboard.main([f"tracking.uri={uri}", "experiment=lb", "budget=phase1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = lines[2:]  # title, header
    assert [line.split()[1] for line in body] == ["deeper", "baseline", "slow-lr", "shallow"]
    assert body[0].endswith("(best)")
    assert body[1].endswith("model.depth=10")  # tracking.run_name differs too, but is bookkeeping
    assert body[2].endswith("model.depth=10 optim.matrix_lr=0.02")
    assert "1,100" in body[2] and "phase1" in body[2]

    assert leaderboard.main([f"tracking.uri={uri}", "experiment=lb", "budget=phase1", "phase=2", "top=2"]) == 0
    out = capsys.readouterr().out
    assert "1 run(s) without a core metric left out" in out
    # bpb 1.05/1.10/1.30 -> 1, 0.8, 0; core 0.15/0.20/0.30 -> 0, 1/3, 1: baseline .567, deeper .5, shallow .5
    body = out.splitlines()[3:]
    assert [line.split()[1] for line in body] == ["baseline", "deeper"]
    assert body[0].split()[2] == "0.567"

    assert leaderboard.main([f"tracking.uri={uri}", "experiment=lb", "budget=phase9"]) == 2  # a typo, not 0 runs
    assert capsys.readouterr().err == ("error: budget=phase9 is not allowed: no finished run of experiment 'lb' has "
                                       "that budget; theirs: phase1, phase2\n")
    assert leaderboard.main([f"tracking.uri={uri}", "experiment=missing"]) == 2  # a mistake: one sentence
    assert leaderboard.main(["depth"]) == 2


def test_leaderboard_flags_runs_scored_on_another_validation_set(tmp_path, store, capsys):
    uri = store
    client = MlflowClient(uri)
    exp = client.create_experiment("sets", artifact_location=(tmp_path / "artifacts").as_uri())
    base = {"model.depth": 10, "budget.name": "phase1"}
    add_run(client, exp, "best", {**base, "seed": 1}, {"val_bpb": 1.00}, tags={"val_fingerprint": "aaaa"})
    add_run(client, exp, "same-set", {**base, "seed": 2}, {"val_bpb": 1.02}, tags={"val_fingerprint": "aaaa"})
    add_run(client, exp, "other-set", {**base, "seed": 3}, {"val_bpb": 1.01}, tags={"val_fingerprint": "bbbb"})
    add_run(client, exp, "unknown-set", {**base, "seed": 4}, {"val_bpb": 1.03})  # recorded before fingerprints
    assert leaderboard.main([f"tracking.uri={uri}", "experiment=sets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = {line.split()[1]: line for line in lines[2:6]}
    assert body["best"].endswith("(best)") and body["same-set"].endswith("seed=2")
    assert body["other-set"].endswith("seed=3 val_fingerprint=bbbb (another validation set)")
    assert body["unknown-set"].endswith("seed=4 val_fingerprint=- (another validation set)")
    groups = lines[lines.index("configurations trained with several seeds (val_bpb mean +- sd, best mean first):") + 1:]
    assert groups == ["1  1.0100 +- 0.0141  2 seeds  (best)"]  # only the two runs scored on one set


def test_phase2_scores_hand_computed():
    rows = [{"val_bpb": 1.0, "core": 0.10}, {"val_bpb": 1.2, "core": 0.30}, {"val_bpb": 1.1, "core": 0.25}]
    # val_bpb (lower better) -> 1, 0, 0.5; core (higher better) -> 0, 1, 0.75
    assert leaderboard.phase2_scores(rows) == pytest.approx([0.5, 0.5, 0.625])
    assert leaderboard.phase2_scores([{"val_bpb": 1.0, "core": 0.2}]) == [1.0]


@pytest.mark.slow
def test_a_postgresql_tracking_uri_records_the_run_with_the_driver_that_is_installed(tmp_path):
    """`tracking.uri=postgresql://…` as docs/tracking.md gives it: SQLAlchemy would read it as psycopg 3, which the
    project does not install; the run must be recorded through psycopg2, and `sync` finds it again."""
    psycopg2 = pytest.importorskip("psycopg2")
    database = f"frontier_tracking_{os.getpid()}_{time.time_ns()}"
    try:
        admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/test", connect_timeout=5)
    except psycopg2.OperationalError as err:
        pytest.skip(f"no PostgreSQL on 127.0.0.1:5432 ({err})")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {database}")
    uri = f"postgresql://postgres@127.0.0.1:5432/{database}"
    try:
        run_dir = tmp_path / "run"
        done = subprocess.run([sys.executable, "-m", "frontier.train", *FAST, "tracking.enabled=true",
                               f"tracking.uri={uri}", f"hydra.run.dir={run_dir}"], cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        client = MlflowClient(f"postgresql+psycopg2://postgres@127.0.0.1:5432/{database}")
        run = only_run(client)
        assert run.info.status == "FINISHED" and run.data.tags["run_dir"] == str(run_dir.resolve())
        assert run.info.run_id == json.loads((run_dir / "summary.json").read_text())["mlflow_run_id"]
        again = subprocess.run([sys.executable, "-m", "frontier.tracking", "sync", str(run_dir), f"tracking.uri={uri}"],
                               cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "already in sync" in again.stdout, again.stdout + again.stderr
    finally:
        admin.cursor().execute(f"DROP DATABASE {database} WITH (FORCE)")  # MLflow's client may still be connected
        admin.close()


def test_a_tracking_json_field_of_another_kind_counts_as_not_there(tmp_path):
    """An edited tracking.json (a number for the run id) made every sync stop, blamed on the store."""
    (tmp_path / "tracking.json").write_text(json.dumps({"uri": 5, "run_id": "abc", "acked_records": "3",
                                                        "terminal_status": None}))
    assert tracking.read_ack(tmp_path) == {"run_id": "abc"}
