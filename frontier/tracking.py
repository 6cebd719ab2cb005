"""MLflow tracking: every run lands in one store, complete, whatever happens to the run.

The store is `sqlite:///<project root>/mlruns/mlflow.db` unless `tracking.uri` (or MLflow's own
MLFLOW_TRACKING_URI) names another one; a SQLite store keeps its artifacts in an `artifacts/`
folder next to the database file. A run records:

- params: the flattened resolved config, every key;
- tags: Hydra overrides as typed, git commit and dirty flag (the diff as `git_diff.patch`), device
  name and count, torch version, host, budget name, and the trainer's own `status`;
- metrics: whatever the trainer logs at its cadence, val_bpb at each budget checkpoint, and every
  numeric entry of the final summary (val_bpb, tokens_per_second, mfu, budget_utilization, ...);
- artifacts: `config.yaml` (resolved), `summary.json`, `curves.png` (train loss and val_bpb
  against charged seconds), and `checkpoint/final.pt` when `tracking.log_checkpoint=true`.

Trainer status -> MLflow status: FINISHED and COMPILED end FINISHED; FAILED ends FAILED (the
error is in the `error` tag); KILLED and PRUNED end KILLED, so that the UI's FINISHED filter
keeps complete runs only. The `status` tag always holds the trainer's word (e.g. PRUNED).

After the run is created, everything is logged from a background thread: a slow or dead tracking
server never stalls the training loop, and a logging error is reported once and then logging
stops, while the run itself goes on to write its summary.json.

The sweeper uses `ensure_store`, `start_parent_run`, `end_parent_run` and `close_runs`; each trial becomes a
child run by setting `tracking.parent_run_id` (and `tracking.run_name`).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import requests
from filelock import FileLock
from hydra.core.hydra_config import HydraConfig
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf

from frontier.config import PROJECT_ROOT, ConfigError, project_path

# MLflow's limits: param and tag value lengths, params/tags per log_batch call, metrics per call.
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 8000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

PROBE_SECONDS = 5.0  # how long the start-up check waits for an HTTP tracking server
FLUSH_SECONDS = 300.0  # how long the end of a run waits for logging to drain (checkpoint uploads)
LOCKED_RETRIES = 12  # "database is locked" retries, with backoff, about 30 s in all

MLFLOW_STATUS = {
    "FINISHED": "FINISHED",
    "COMPILED": "FINISHED",
    "FAILED": "FAILED",
    "KILLED": "KILLED",
    "PRUNED": "KILLED",
}
RUN_KIND_TAG = "run_kind"  # "sweep" on a sweep's parent run; the leaderboard leaves those out


# -----------------------------------------------------------------------------
# The store


def tracking_uri(tracking_cfg) -> str:
    """`tracking.uri`, else MLFLOW_TRACKING_URI, else the project's SQLite store.

    A relative SQLite path is taken from the project root, wherever the command runs.
    """
    uri = tracking_cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        return f"sqlite:///{project_path('mlruns') / 'mlflow.db'}"
    path = sqlite_path(uri)
    if path is not None and not path.is_absolute():
        query = uri.partition("?")[2]
        uri = f"sqlite:///{project_path(path)}" + (f"?{query}" if query else "")
    return uri


def ensure_store(uri: str) -> None:
    """Make the store usable before any run writes to it.

    SQLite: create the schema once under a file lock, so that parallel workers starting on a fresh
    database do not race on schema creation. HTTP: check that the server answers. Raises
    ConfigError with a one-line reason when the store cannot be used.
    """
    if _is_http(uri):
        _probe(uri)
        return
    try:
        with _store_lock(uri):
            _retry(MlflowClient(uri).search_experiments, max_results=1)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({_oneline(err)})") from None


def start_parent_run(tracking_cfg, name: str, params: dict, tags: dict, run_id: str | None = None) -> str:
    """A sweep's parent run; trials nest under it through `tracking.parent_run_id`. `run_id`: the
    study's parent run, which every driver of the study continues (reopened when it had ended)."""
    uri = tracking_uri(tracking_cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    if run_id:
        try:
            existing = _retry(client.get_run, run_id)
        except MlflowException:  # deleted, or another store: start a new one
            existing = None
        if existing is not None and existing.info.lifecycle_stage == "active":
            if existing.info.status != "RUNNING":
                _retry(client.update_run, run_id, status="RUNNING")
            return run_id
    experiment_id = _experiment_id(client, uri, tracking_cfg.experiment)
    all_tags = {RUN_KIND_TAG: "sweep", **_source_tags(), **{k: str(v) for k, v in tags.items()}}
    run = _retry(client.create_run, experiment_id, run_name=name, tags=_clip_tags(all_tags))
    _log_params(client, run.info.run_id, flatten(params))
    return run.info.run_id


def end_parent_run(tracking_cfg, run_id: str, status: str, metrics: dict,
                   artifacts: Iterable[Path] = ()) -> None:
    """Final metrics and files of a sweep, then its status (a trainer status or an MLflow one)."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    now = _now_ms()
    _log_metrics(client, run_id, [Metric(k, float(v), now, 0) for k, v in metrics.items() if _is_number(v)])
    for path in artifacts:
        _retry(client.log_artifact, run_id, str(path))
    _retry(client.set_tag, run_id, "status", status)
    _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))


def close_runs(tracking_cfg, run_ids: Iterable[str], status: str) -> None:
    """Ends the runs still RUNNING among `run_ids` (trials whose process died) with `status`."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    for run_id in run_ids:
        if _retry(client.get_run, run_id).info.status == "RUNNING":
            _retry(client.set_tag, run_id, "status", status)
            _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))


# -----------------------------------------------------------------------------
# The observer


class MlflowObserver:
    """Follows one training run; see frontier/observers.py for when each hook is called."""

    def __init__(self, client: MlflowClient | None, run_id: str | None, run_dir: Path,
                 log_checkpoint: bool):
        self.client = client  # None: tracking is off for this run (unreachable, not required)
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.log_checkpoint = log_checkpoint
        self.failed = False
        self.loss_points: list[tuple[float, float]] = []  # (charged seconds, train loss)
        self.val_points: list[tuple[float, float]] = []  # (charged seconds, val_bpb)
        self.seconds_at_step: dict[int, float] = {}
        self._queue: queue.Queue = queue.Queue()
        self._thread = None
        if client is not None:
            self._thread = threading.Thread(target=self._drain, name="mlflow-logging", daemon=True)
            self._thread.start()

    @classmethod
    def for_run(cls, run) -> "MlflowObserver":
        """Creates the MLflow run before training starts, so a bad store fails fast."""
        cfg = run.config.tracking
        try:
            client, run_id = _start_run(cfg, run)
        except ConfigError as err:
            if cfg.required:
                raise
            _warn(f"{err}; training without tracking (tracking.required=false)")
            return cls(None, None, run.run_dir, cfg.log_checkpoint)
        return cls(client, run_id, run.run_dir, cfg.log_checkpoint)

    def on_start(self, summary: dict) -> None:
        tags = {
            "device": summary.get("device"),
            "device_count": summary.get("world_size", 1),
            "torch": summary.get("torch"),
            "host": summary.get("host"),
            "budget": summary.get("budget"),
        }
        tags = {k: str(v) for k, v in tags.items() if v is not None}
        self._submit(_log_batch, self.client, self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])

    def on_log(self, metrics: dict, step: int) -> None:
        now = _now_ms()
        seconds = metrics.get("charged_seconds")
        if seconds is not None:
            self.seconds_at_step[step] = seconds
            if "train/loss" in metrics:
                self.loss_points.append((seconds, metrics["train/loss"]))
        points = [Metric(k, float(v), now, step) for k, v in metrics.items() if _is_number(v)]
        self._submit(_log_metrics, self.client, self.run_id, points)

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        self.val_points.append((self._seconds_at(step), val_bpb))
        point = Metric("val_bpb", float(val_bpb), _now_ms(), step)
        self._submit(_log_metrics, self.client, self.run_id, [point])

    def on_end(self, summary: dict, status: str, error: str | None) -> None:
        if self._thread is None:
            return
        self._submit(self._finish, dict(summary), status, error)
        self._queue.put(None)  # the worker stops after this
        self._thread.join(5.0)
        if self._thread.is_alive():
            _warn(f"waiting up to {FLUSH_SECONDS:.0f} s for the tracking store to take the last results")
            self._thread.join(FLUSH_SECONDS)
        if self._thread.is_alive():
            _warn(f"the tracking store did not take the final results of run {self.run_id}; they are in "
                  f"{self.run_dir / 'summary.json'}")

    # -- internals

    def _submit(self, fn: Callable, *args, **kwargs) -> None:
        if self._thread is not None and not self.failed:
            self._queue.put((fn, args, kwargs))

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.failed:
                continue  # after the first error nothing more is sent
            fn, args, kwargs = item
            try:
                fn(*args, **kwargs)
            except Exception as err:
                self.failed = True
                _warn(f"logging to the tracking store failed ({_oneline(err)}); logging stops for run "
                      f"{self.run_id}, training goes on and its results will be in "
                      f"{self.run_dir / 'summary.json'}")

    def _seconds_at(self, step: int) -> float:
        """Charged seconds at a step: the last log at or before it (the loop logs before it evaluates)."""
        earlier = [s for s in self.seconds_at_step if s <= step]
        return self.seconds_at_step[max(earlier)] if earlier else 0.0

    def _finish(self, summary: dict, status: str, error: str | None) -> None:
        client, run_id = self.client, self.run_id
        try:
            step = int(summary.get("steps", 0) or 0)
            now = _now_ms()
            finals = [Metric(k, float(v), now, step) for k, v in summary.items()
                      if _is_number(v) and math.isfinite(v)]
            _log_metrics(client, run_id, finals)
            _retry(client.log_text, run_id, json.dumps(summary, indent=2, default=str), "summary.json")
            bpb = summary.get("val_bpb")
            if _is_number(bpb) and math.isfinite(bpb):
                self.val_points.append((summary.get("charged_seconds", 0.0), bpb))
            if self.loss_points or self.val_points:
                _retry(client.log_figure, run_id, curves(self.loss_points, self.val_points), "curves.png")
            checkpoint = self.run_dir / "final.pt"
            if self.log_checkpoint and status == "FINISHED" and checkpoint.exists():
                _retry(client.log_artifact, run_id, str(checkpoint), "checkpoint")
                _retry(client.log_artifact, run_id, str(self.run_dir / "tokenizer.json"), "checkpoint")
        finally:  # an artifact that fails to upload must not leave the run RUNNING forever
            tags = {"status": status, **({"error": error} if error else {})}
            _log_batch(client, run_id, tags=[RunTag(k, v) for k, v in _clip_tags(tags).items()])
            _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, "FAILED"))


def curves(loss_points: list, val_points: list) -> Figure:
    """Train loss and val_bpb against charged seconds, one above the other."""
    figure = Figure(figsize=(7, 6), layout="constrained")  # no pyplot: no global backend state
    loss_ax, val_ax = figure.subplots(2, 1, sharex=True)
    if loss_points:
        loss_ax.plot(*zip(*loss_points), color="tab:blue")
    loss_ax.set_ylabel("train loss")
    if val_points:
        val_ax.plot(*zip(*val_points), marker="o", color="tab:orange")
    val_ax.set_ylabel("val_bpb")
    val_ax.set_xlabel("charged seconds")
    for ax in (loss_ax, val_ax):
        ax.grid(alpha=0.3)
    return figure


# -----------------------------------------------------------------------------
# Helpers


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """{"model": {"depth": 10}} -> {"model.depth": "10"}; lists stay whole, as one value."""
    if isinstance(tree, dict):
        flat: dict[str, str] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: str(tree)[:MAX_PARAM_CHARS]}


def run_dir_of(tracking_cfg, run_id: str) -> Path:
    """The directory a run wrote to (its `run_dir` tag)."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    try:
        run = _retry(client.get_run, run_id)
    except Exception as err:
        raise ConfigError(f"no MLflow run {run_id!r} in tracking.uri={tracking_uri(tracking_cfg)} "
                          f"({_oneline(err)})") from None
    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        raise ConfigError(f"MLflow run {run_id!r} has no run_dir tag; pass its directory instead")
    return Path(run_dir)


def checkpoint_of_run(tracking_cfg, run_id: str) -> Path:
    """A run's final.pt: in its run directory, else its logged `checkpoint/` artifact."""
    local = run_dir_of(tracking_cfg, run_id) / "final.pt"
    if local.is_file():
        return local
    client = MlflowClient(tracking_uri(tracking_cfg))
    try:
        folder = _retry(client.download_artifacts, run_id, "checkpoint")
    except Exception as err:
        raise FileNotFoundError(f"MLflow run {run_id!r} has neither {local} nor a logged checkpoint "
                                f"(train with tracking.log_checkpoint=true) ({_oneline(err)})") from None
    return Path(folder) / "final.pt"


def log_metrics_to_run(tracking_cfg, run_id: str, metrics: dict) -> None:
    """Adds metrics to an existing run (finished or not), e.g. CORE computed later."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    now = _now_ms()
    _log_metrics(client, run_id, [Metric(k, float(v), now, 0) for k, v in metrics.items()
                                  if _is_number(v) and math.isfinite(v)])


def _start_run(cfg, run) -> tuple[MlflowClient, str]:
    uri = tracking_uri(cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    try:
        if cfg.parent_run_id:  # a trial: same experiment as its sweep, or the UI will not nest it
            experiment_id = _retry(client.get_run, cfg.parent_run_id).info.experiment_id
        else:
            experiment_id = _experiment_id(client, uri, cfg.experiment)
        resumed = run.summary.get("mlflow_run_id")
        if resumed:  # `resume=`: the same MLflow run goes on
            _retry(client.update_run, resumed, status="RUNNING")
            run.summary["mlflow_run_id"] = resumed
            return client, resumed
        tags = {**_source_tags(), "run_dir": str(Path(run.run_dir).resolve())}
        if cfg.parent_run_id:
            tags[MLFLOW_PARENT_RUN_ID] = cfg.parent_run_id
        created = _retry(client.create_run, experiment_id, run_name=cfg.run_name, tags=_clip_tags(tags))
        run_id = created.info.run_id
        run.summary["mlflow_run_id"] = run_id  # in summary.json and resume.pt: how to find this run again
        _log_params(client, run_id, flatten(OmegaConf.to_container(run.raw, resolve=True)))
        # The config and the diff go in first, so that even a run that crashes has them.
        _retry(client.log_text, run_id, OmegaConf.to_yaml(run.raw, resolve=True), "config.yaml")
        if tags.get("git.dirty") == "true":
            diff = _git("diff", "HEAD")
            if diff:
                _retry(client.log_text, run_id, diff, "git_diff.patch")
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not start an MLflow run ({_oneline(err)})") from None
    return client, run_id


def _experiment_id(client: MlflowClient, uri: str, name: str) -> str:
    with _store_lock(uri):  # two fresh workers must not both create the experiment
        found = _retry(client.get_experiment_by_name, name)
        if found is None:
            try:
                return _retry(client.create_experiment, name, artifact_location=_artifact_location(uri, name))
            except MlflowException as err:  # a server store: another worker created it first
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                found = _retry(client.get_experiment_by_name, name)
        if found.lifecycle_stage == "deleted":
            raise ConfigError(f"tracking.experiment={name!r} is deleted in {uri}; restore it with "
                              f"`mlflow experiments restore` or choose another name")
        return found.experiment_id


def _artifact_location(uri: str, experiment: str) -> str | None:
    """Next to a SQLite database; the server's choice for a server; the project's mlruns/ otherwise.

    (MLflow's own default for a database store is ./mlartifacts in whatever the working directory is.)
    """
    if _is_http(uri) or uri.startswith("databricks"):
        return None
    folder = re.sub(r"[^\w.-]", "_", experiment)
    db = sqlite_path(uri)
    root = db.parent if db is not None else project_path("mlruns")
    return (root / "artifacts" / folder).as_uri()


def _source_tags() -> dict[str, str]:
    tags = {}
    if HydraConfig.initialized():
        tags["hydra.overrides"] = " ".join(HydraConfig.get().overrides.task)
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no") or ""
        tags["git.commit"] = commit.strip()
        tags["mlflow.source.git.commit"] = commit.strip()  # the UI shows this one on the run page
        tags["git.dirty"] = "true" if status.strip() else "false"
    return tags


def _git(*args: str) -> str | None:
    """Git's output in the project root, or None without git or outside a repository."""
    try:
        done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), PARAMS_PER_BATCH):
        _log_batch(client, run_id, params=items[i:i + PARAMS_PER_BATCH])


def _log_metrics(client: MlflowClient, run_id: str, metrics: list[Metric]) -> None:
    for i in range(0, len(metrics), METRICS_PER_BATCH):
        _log_batch(client, run_id, metrics=metrics[i:i + METRICS_PER_BATCH])


def _log_batch(client: MlflowClient, run_id: str, **entities) -> None:
    _retry(client.log_batch, run_id, **entities)


def _retry(fn: Callable, *args, **kwargs):
    """Calls fn, retrying with backoff while SQLite reports another process holding the lock."""
    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if "database is locked" not in str(err) or attempt == LOCKED_RETRIES:
                raise
            time.sleep(min(0.05 * 2 ** attempt, 5.0) * random.uniform(0.5, 1.5))


def _store_lock(uri: str):
    path = sqlite_path(uri)
    if path is None:
        return contextlib.nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{path}.lock")


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _probe(uri: str) -> None:
    """Any HTTP answer means the server is there; MLflow's own client would retry for minutes."""
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=PROBE_SECONDS)
    except requests.exceptions.SSLError:
        return  # something answers; TLS settings are MLflow's business (MLFLOW_TRACKING_INSECURE_TLS, ...)
    except requests.RequestException as err:
        raise ConfigError(f"tracking.uri={uri} is unreachable ({type(err).__name__}); start the server, "
                          f"correct the URI, or set tracking.required=false to train without tracking") from None


def _clip_tags(tags: dict[str, str]) -> dict[str, str]:
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _oneline(err: BaseException) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _warn(message: str) -> None:
    print(f"warning: tracking: {message}", file=sys.stderr, flush=True)
