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

Nothing is lost when the store fails. Every point is in the run's metrics.jsonl before it is sent
(frontier.observers.MetricsFile); after the run is created everything is sent from one background
thread, which retries with backoff while the store does not answer and never drops a later point;
the end of the run waits a bounded time (`tracking.flush_seconds`) for it. What the store has not
acknowledged (recorded in the run's tracking.json) is replayed from metrics.jsonl on `resume=` and
by `python -m frontier.tracking sync RUN_DIR`, which also creates the MLflow run if it never
existed; a (key, step) the run already holds is never sent twice.

The sweeper uses `ensure_store`, `start_parent_run`, `end_parent_run` and `close_runs`; each trial becomes a
child run by setting `tracking.parent_run_id` (and `tracking.run_name`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
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
from typing import Any, Callable, Iterable, Iterator

import requests
import sqlalchemy.exc
from filelock import FileLock
from hydra.core.hydra_config import HydraConfig
from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig, ListConfig, OmegaConf

from frontier import lifecycle, paths
from frontier.cli import NAME_ERRORS, command, print_help_if_asked, refused_path, unwritable
from frontier.config import PROJECT_ROOT, ConfigError, TrackingConfig, error_line, project_path, store_error_line
from frontier.observers import RECORD_FIELDS, event_time, final_record, is_finite_number, read_records

# MLflow's limits: param and tag value lengths, params/tags per log_batch call, metrics per call.
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 8000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

PROBE_SECONDS = 5.0  # how long the start-up check waits for an HTTP tracking server
LOCKED_RETRIES = 12  # "database is locked" retries, with backoff, about 30 s in all
IN_FLIGHT_SECONDS = 1.0  # after flush_seconds, how long on_end waits for the call in flight to land
MAX_BACKOFF_SECONDS = 8.0  # the logging thread's longest pause between tries while the store is down
ACK_FILE = "tracking.json"
# Errors with which a store refuses a call (retrying cannot help), as opposed to not answering it.
REFUSED_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
                  "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND"}

# MLflow's HTTP client would retry one call for minutes (7 tries, 120-s timeout): our calls fail fast
# instead, and the logging thread paces its own retries. A user's own settings win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
# A SQL store's OperationalError (a full disk, a lost database) is logged by MLflow with its traceback
# and then raised as an MlflowException, which the callers here report in one line.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

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

    A relative SQLite path is taken from home (paths.store_under_home), wherever the command runs; a
    postgresql:// URL names the driver that is installed (paths.database_url).
    """
    uri = tracking_cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        return f"sqlite:///{project_path('mlruns') / 'mlflow.db'}"
    return paths.store_under_home(uri) if uri.startswith("sqlite:///") else paths.database_url(uri)


def probe_store(tracking_cfg) -> None:
    """The tracking store must answer before anything is written: an HTTP server or a database server
    is asked once (MLflow's own client would retry each for minutes) and any other URI but SQLite is
    opened (a SQLite file is created when the run starts: check_store_folder)."""
    uri = tracking_uri(tracking_cfg)
    if _is_http(uri):
        _probe(uri)
    elif _is_database(uri):
        _probe_database(uri)
    elif not uri.startswith("sqlite:"):
        try:
            MlflowClient(uri)  # an unknown scheme or a retired store fails here, at once
        except Exception as err:
            raise ConfigError(f"tracking.uri={uri} could not be opened ({error_line(err)})") from None


def check_store_folder(tracking_cfg) -> None:
    """A SQLite store must be a database, or one that can be created where it is named, found out before anything is
    written (the database itself is made when the run or sweep starts, after Hydra has written its
    run or sweep directory and a sweep its study)."""
    uri = tracking_uri(tracking_cfg)
    db = paths.sqlite_path(uri)
    if db is None:
        return
    db = db.expanduser()
    if db.is_dir():
        raise ConfigError(f"tracking.uri={uri} is not allowed: {db} is a directory; name the database "
                          "file, e.g. sqlite:///mlruns/mlflow.db")
    with contextlib.suppress(OSError):  # one that cannot be read is told when it is opened
        if db.is_file() and not paths.is_sqlite_file(db):  # MLflow would fail only once Hydra has written
            raise ConfigError(f"tracking.uri={uri} is not allowed: {db} is a file that is not a SQLite "
                              "database; name the MLflow store, or a file that does not exist yet")
    found = unwritable(db.parent)
    if found:
        raise ConfigError(f"tracking.uri={uri} is not allowed: its database cannot be created "
                          f"({found[1]}); {found[0]} is not a writable directory")


def ensure_store(uri: str) -> None:
    """Make the store usable before any run writes to it.

    SQLite: create the schema once under a file lock, so that parallel workers starting on a fresh
    database do not race on schema creation. HTTP: check that the server answers. Raises
    ConfigError with a one-line reason when the store cannot be used.
    """
    if _is_http(uri):
        _probe(uri)
        return
    if _is_database(uri):
        _probe_database(uri)
    try:
        with _store_lock(uri):
            _create_sqlite_whole(uri)
            _retry(MlflowClient(uri).search_experiments, max_results=1)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)})") from None


def _create_sqlite_whole(uri: str) -> None:
    """A new SQLite store is made whole or not at all: MLflow builds its schema in a dozen migrations,
    and one cut off by a signal or kill -9 left a database that no later command could open. So the
    schema is built in a file beside it, which then takes the store's name in one rename. (MLflow keeps
    an idle engine for the file's first name; it holds no lock.)"""
    db = paths.sqlite_path(uri)
    if db is None:
        return
    db = db.expanduser()
    if db.exists() and db.stat().st_size > 0:
        return
    partial = db.with_name(f".{db.name}.{os.getpid()}.partial")
    _, sep, query = uri.partition("?")
    try:
        MlflowClient(f"sqlite:///{partial}{sep}{query}").search_experiments(max_results=1)
        os.replace(partial, db)
    finally:
        for leftover in (partial, Path(f"{partial}-journal")):
            leftover.unlink(missing_ok=True)


def start_parent_run(tracking_cfg, name: str, params: dict, tags: dict, run_id: str | None = None,
                     opened: dict | None = None) -> str:
    """A sweep's parent run; trials nest under it through `tracking.parent_run_id`. `run_id`: the
    study's parent run, which every driver of the study continues (reopened when it had ended).
    `opened["run_id"]` names the run as soon as it is RUNNING in the store, also when a signal or an
    error breaks the start off (inside `create_run` too: the run is then found by `tags`, which
    should name this caller alone), so that the caller can end it instead of leaving it RUNNING."""
    opened = {} if opened is None else opened
    uri = tracking_uri(tracking_cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    if run_id:
        try:
            existing = _retry(client.get_run, run_id)
        except MlflowException as err:  # deleted, or another store: start a new one
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise  # a store that failed to answer: a second parent run would split the sweep
            existing = None
        if existing is not None and existing.info.lifecycle_stage == "active":
            opened["run_id"] = run_id
            if existing.info.status != "RUNNING":
                _retry(client.update_run, run_id, status="RUNNING")
            return run_id
    experiment_id = _experiment_id(client, uri, tracking_cfg.experiment)
    all_tags = {RUN_KIND_TAG: "sweep", **_source_tags(), **{k: str(v) for k, v in tags.items()}}
    try:
        run = _retry(client.create_run, experiment_id, run_name=name, tags=_clip_tags(all_tags))
    except BaseException:
        with contextlib.suppress(Exception):  # the store is what failed: nothing to find then
            found = _running_with_tags(client, experiment_id, tags)
            if len(found) == 1:
                opened["run_id"] = found[0]
        raise
    opened["run_id"] = run.info.run_id
    _log_params(client, run.info.run_id, flatten(params))
    return run.info.run_id


def orphaned_parent_run(tracking_cfg, tags: dict, creators: set[str]) -> str | None:
    """The one RUNNING run carrying `tags` whose `sweep.driver` tag names a driver in `creators`: a parent
    run that a driver killed inside its creation (kill -9) made but never recorded in its study."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    experiment = _retry(client.get_experiment_by_name, tracking_cfg.experiment)
    if experiment is None:
        return None
    found = [run_id for run_id in _running_with_tags(client, experiment.experiment_id, tags)
             if _retry(client.get_run, run_id).data.tags.get("sweep.driver") in creators]
    return found[0] if len(found) == 1 else None


def _running_with_tags(client: MlflowClient, experiment_id: str, tags: dict) -> list[str]:
    """The RUNNING runs of an experiment that carry every one of `tags`."""
    if not tags or any("'" in str(value) or "`" in key for key, value in tags.items()):
        return []  # nothing to tell the run by, or not expressible in MLflow's filter syntax
    conditions = [f"tags.`{key}` = '{value}'" for key, value in tags.items()]
    found = client.search_runs([experiment_id], max_results=10,
                               filter_string=" and ".join([*conditions, "attributes.status = 'RUNNING'"]))
    return [run.info.run_id for run in found]


def end_parent_run(tracking_cfg, run_id: str, status: str, metrics: dict,
                   artifacts: Iterable[Path] = ()) -> None:
    """Final metrics and files of a sweep, then its status (a trainer status or an MLflow one): the
    status is set even where the metrics or files were not taken (their error is raised after)."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    now = _now_ms()
    try:
        _log_metrics(client, run_id, [Metric(k, float(v), now, 0) for k, v in metrics.items() if _is_number(v)])
        for path in artifacts:
            _retry(client.log_artifact, run_id, str(path))
    finally:
        _retry(client.set_tag, run_id, "status", status)
        _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))


def close_runs(tracking_cfg, run_ids: Iterable[str], status: str) -> dict[str, str]:
    """Ends the runs still RUNNING among `run_ids` (trials whose process died) with `status`. Every
    run is tried; returns why, for each run that could not be closed."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    failed = {}
    for run_id in run_ids:
        try:
            if _retry(client.get_run, run_id).info.status == "RUNNING":
                _retry(client.set_tag, run_id, "status", status)
                _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))
        except Exception as err:  # the store is down, or the run was deleted: the others still close
            failed[run_id] = store_error_line(err)
    return failed


# -----------------------------------------------------------------------------
# The observer


class MlflowObserver:
    """Follows one training run; see frontier/observers.py for when each hook is called.

    The hooks only queue work, which one logging thread sends in order: a slow or dead store never
    stalls training. A call the store does not answer is retried with backoff until it does, so no
    later point is ever dropped (one warning when the store goes away, one when it is back); a call
    the store refuses (a deleted run, a value it rejects) is skipped with one warning. `on_end`
    waits up to `tracking.flush_seconds` for the thread; whatever the store has not taken by then is
    in metrics.jsonl and summary.json, and `python -m frontier.tracking sync RUN_DIR` pushes it.
    """

    def __init__(self, client: MlflowClient | None, uri: str | None, run_id: str | None, run_dir: Path,
                 cfg, resume_step: int | None = None):
        self.client = client  # None: tracking is off for this run (unreachable, not required)
        self.uri = uri
        self.run_id = run_id
        self.run_dir = Path(run_dir)
        self.log_checkpoint = cfg.log_checkpoint
        self.flush_seconds = cfg.flush_seconds
        self.delivered = False  # every call taken and the terminal status set
        self.have: set[tuple[str, int]] = set()  # (key, step) of the points the run holds in MLflow
        self._queue: queue.Queue = queue.Queue()
        self._give_up = threading.Event()
        self._exit_deadline: float | None = None
        self._down = False  # the store stopped answering (and we said so)
        self._refused = False  # the store refused a call (and we said so)
        self._skipped = False  # a call was dropped because on_end stopped waiting
        self._thread = None
        if client is not None:
            # Not a daemon: what is queued is sent before the process exits (within flush_seconds).
            self._thread = threading.Thread(target=self._drain, name="mlflow-logging")
            self._thread.start()
            if resume_step is not None:
                self._submit(self._catch_up, resume_step)

    @classmethod
    def for_run(cls, run) -> "MlflowObserver":
        """Creates (or, on `resume=`, reopens) the MLflow run before training, so a bad store fails fast."""
        cfg = run.config.tracking
        try:
            client, uri, run_id = _start_run(cfg, run)
        except ConfigError as err:
            if cfg.required:
                raise
            _warn(f"{err}; training without tracking (tracking.required=false)")
            return cls(None, None, None, run.run_dir, cfg)
        return cls(client, uri, run_id, run.run_dir, cfg, run.summary.get("resume_step"))

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
        self._submit(self._send_points, _points(metrics, step, _ms(event_time())))

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        self._submit(self._send_points, _points({"val_bpb": val_bpb}, step, _ms(event_time())))

    def on_end(self, summary: dict, status: str, error: str | None) -> None:
        if self._thread is None:
            return
        summary = {**summary, "status": status, "error": error}
        self._submit(self._replay)  # whatever metrics.jsonl holds that MLflow does not
        for fn, *args in _end_calls(self.client, self.run_id, self.run_dir, summary,
                                    final_record(summary, status), self.log_checkpoint):
            self._submit(fn, *args)
        self._queue.put(None)  # the thread stops after this
        self._thread.join(self.flush_seconds)
        if self._thread.is_alive():
            self._give_up.set()  # the call in flight may still land; what waits behind it is skipped
            self._thread.join(IN_FLIGHT_SECONDS)
        if self._thread.is_alive() or self._skipped:
            if not self._down:  # the warning of an outage already named the sync command
                _warn(f"{self.uri} has not taken all of run {self.run_id} within tracking.flush_seconds="
                      f"{self.flush_seconds:g}; push the rest later with "
                      f"`python -m frontier.tracking sync {self.run_dir}`")
            return
        self._acknowledged(status)  # only once the store has taken every call: sync trusts this record

    # -- the logging thread

    def _submit(self, fn: Callable, *args, **kwargs) -> None:
        if self._thread is not None:
            self._queue.put((fn, args, kwargs))

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                if threading.main_thread().is_alive():
                    continue
                return  # the process is exiting without on_end, and nothing is left to send
            if item is None:
                return
            fn, args, kwargs = item
            if not self._call(fn, *args, **kwargs) and self._give_up.is_set():
                self._skipped = True

    def _call(self, fn: Callable, *args, **kwargs) -> bool:
        """fn(...) until the store takes it; False when the store refused it or we gave up."""
        delay = 0.5
        while not self._giving_up():
            try:
                fn(*args, **kwargs)
            except Exception as err:
                if not _transient(err):
                    if not self._refused:
                        self._refused = True
                        _warn(f"{self.uri} refused a call for run {self.run_id} ({store_error_line(err)}); it is "
                              f"skipped and logging goes on; once the store takes it, `python -m frontier.tracking "
                              f"sync {self.run_dir}` sends what was refused")
                    return False
                if not self._down:
                    self._down = True
                    _warn(f"{self.uri} does not answer ({store_error_line(err)}); retrying in the background, every "
                          f"point is kept in {self.run_dir / 'metrics.jsonl'}; if the store is still down "
                          f"when the run ends, push it later with `python -m frontier.tracking sync {self.run_dir}`")
                self._give_up.wait(delay)
                delay = min(2 * delay, MAX_BACKOFF_SECONDS)
                continue
            if self._down:
                self._down = False
                _warn(f"{self.uri} answers again; sending what it missed")
            return True
        return False

    def _giving_up(self) -> bool:
        if not self._give_up.is_set() and not threading.main_thread().is_alive():
            # The process is exiting without on_end: the same bounded wait, then stop.
            now = time.monotonic()
            self._exit_deadline = self._exit_deadline or now + self.flush_seconds
            if now > self._exit_deadline:
                self._give_up.set()
        return self._give_up.is_set()

    def _send_points(self, points: list[Metric]) -> None:
        missing = [m for m in points if (m.key, m.step) not in self.have]  # a resumed run's steps may be there
        _log_metrics(self.client, self.run_id, missing)
        self.have.update((m.key, m.step) for m in missing)

    def _catch_up(self, resume_step: int) -> None:
        """On `resume=`: what MLflow holds, then what the stopped process logged but never sent."""
        self.have = _history(self.client, self.run_id)
        records = [r for r in read_records(self.run_dir / "metrics.jsonl") if r["step"] <= resume_step]
        _send_missing(self.client, self.run_id, records, self.have)

    def _replay(self) -> None:
        _send_missing(self.client, self.run_id, read_records(self.run_dir / "metrics.jsonl"), self.have)

    def _acknowledged(self, status: str) -> None:
        """What the store has taken, for `sync`: after a refused call, no end it can trust, so that
        `sync` compares point by point and sends what was refused once the store takes it."""
        lines = len(read_records(self.run_dir / "metrics.jsonl"))
        write_ack(self.run_dir, self.uri, self.run_id, acked_records=lines,
                  terminal_status=None if self._refused else status)
        self.delivered = not self._refused


# -----------------------------------------------------------------------------
# What both the observer and `sync` send


def _points(metrics: dict, step: int, timestamp_ms: int) -> list[Metric]:
    return [Metric(k, float(v), timestamp_ms, step) for k, v in metrics.items()
            if k not in RECORD_FIELDS and is_finite_number(v)]


def _record_points(record: dict) -> list[Metric]:
    """The points of one metrics.jsonl record, as the observer sent them live (a checkpoint: val_bpb)."""
    metrics = {"val_bpb": record["val_bpb"]} if "checkpoint" in record else record
    return _points(metrics, record["step"], _ms(record["time"]))


def _history(client: MlflowClient, run_id: str) -> set[tuple[str, int]]:
    """(key, step) of every point the run holds."""
    keys = _retry(client.get_run, run_id).data.metrics
    return {(key, m.step) for key in keys for m in _retry(client.get_metric_history, run_id, key)}


def _send_missing(client: MlflowClient, run_id: str, records: list[dict], have: set) -> int:
    """Sends the points of `records` (not the final record) that MLflow does not hold; how many."""
    missing = {}
    for record in records:
        if "final" not in record:
            for m in _record_points(record):
                if (m.key, m.step) not in have:
                    missing.setdefault((m.key, m.step), m)  # the first, as live logging would have kept it
    _log_metrics(client, run_id, list(missing.values()))
    have.update(missing)
    return len(missing)


def _push_final(client: MlflowClient, run_id: str, final: dict) -> int:
    """The summary's numbers as the run's latest values, at its last step; those already latest are skipped.
    A killed launch, which `resume=` goes on from, adds no second point at a step its log points hold."""
    latest = _retry(client.get_run, run_id).data.metrics
    points = [m for m in _record_points(final) if latest.get(m.key) != m.value]
    if final.get("status") == "KILLED":
        points = [m for m in points if m.key not in latest
                  or all(h.step != m.step for h in _retry(client.get_metric_history, run_id, m.key))]
    _log_metrics(client, run_id, points)
    return len(points)


def _end_calls(client: MlflowClient, run_id: str, run_dir: Path, summary: dict, final: dict,
               log_checkpoint: bool) -> list[tuple]:
    """The end of a run in MLflow, one call each, so that one failing never skips the next: final
    metrics, summary.json, curves.png, the checkpoint when asked for, then tags and status."""
    calls = [(_push_final, client, run_id, final),
             (_retry, client.log_text, run_id, json.dumps(summary, indent=2, default=str), "summary.json"),
             (_log_curves, client, run_id, run_dir, summary)]
    if log_checkpoint and summary["status"] == "FINISHED" and (run_dir / "final.pt").exists():
        calls.append((_log_checkpoint, client, run_id, run_dir))
    calls.append((_set_status, client, run_id, summary["status"], summary.get("error"), _ms(final["time"])))
    return calls


def _log_curves(client: MlflowClient, run_id: str, run_dir: Path, summary: dict) -> None:
    loss_points, val_points, seconds = [], [], 0.0
    for record in read_records(run_dir / "metrics.jsonl"):
        if "final" in record:
            continue
        if "checkpoint" in record:  # the loop logs before it evaluates: the last log's charged seconds
            val_points.append((seconds, record["val_bpb"]))
        elif is_finite_number(record.get("charged_seconds")):
            seconds = record["charged_seconds"]
            if is_finite_number(record.get("train/loss")):
                loss_points.append((seconds, record["train/loss"]))
    if is_finite_number(summary.get("val_bpb")):
        val_points.append((summary.get("charged_seconds") or seconds, summary["val_bpb"]))
    if loss_points or val_points:
        _retry(client.log_figure, run_id, curves(loss_points, val_points), "curves.png")


def _log_checkpoint(client: MlflowClient, run_id: str, run_dir: Path) -> None:
    if any(info.path == "checkpoint/final.pt" for info in _retry(client.list_artifacts, run_id, "checkpoint")):
        return  # already uploaded (by an earlier sync)
    _retry(client.log_artifact, run_id, str(run_dir / "tokenizer.json"), "checkpoint")
    _retry(client.log_artifact, run_id, str(run_dir / "final.pt"), "checkpoint")


def _set_status(client: MlflowClient, run_id: str, status: str, error: str | None, end_time_ms: int) -> None:
    """The `status` and `error` tags, then the MLflow status (left alone when it is already right)."""
    run = _retry(client.get_run, run_id)
    tags = {"status": status, **({"error": error} if error else {})}
    _log_batch(client, run_id, tags=[RunTag(k, v) for k, v in _clip_tags(tags).items()])
    if not error and "error" in run.data.tags:
        _retry(client.delete_tag, run_id, "error")
    if run.info.status != MLFLOW_STATUS.get(status, "FAILED"):
        _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, "FAILED"), end_time_ms)


def _transient(err: Exception) -> bool:
    """A store that does not answer (worth retrying), as opposed to one that refuses the call."""
    if isinstance(err, MlflowException):
        return err.error_code not in REFUSED_ERRORS
    return isinstance(err, (requests.RequestException, OSError, sqlalchemy.exc.OperationalError))


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


def run_dir_of(tracking_cfg, run_id: str, key: str) -> Path:
    """The directory a run wrote to (its `run_dir` tag); `key` is the argument that gave the run id."""
    uri = tracking_uri(tracking_cfg)
    if paths.missing_sqlite_store(uri):
        raise ConfigError(f"{key}={run_id} is not allowed: there is no MLflow store at tracking.uri={uri} (name the "
                          "store the run went to)")
    probe_store(tracking_cfg)  # a server that does not answer: one line now, not minutes of retries
    try:
        run = _retry(MlflowClient(uri).get_run, run_id)  # a file that is not a store fails as it is opened
    except Exception as err:
        raise ConfigError(f"{key}={run_id} is not allowed: it is not found in tracking.uri={uri} "
                          f"({store_error_line(err)})") from None
    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        raise ConfigError(f"{key}={run_id} is not allowed: that MLflow run has no run_dir tag; pass its "
                          "directory instead")
    return Path(run_dir)


def checkpoint_of_run(tracking_cfg, run_id: str) -> Path:
    """A run's final.pt: in its run directory, else its logged `checkpoint/` artifact."""
    local = run_dir_of(tracking_cfg, run_id, "run_id") / "final.pt"
    if local.is_file():
        return local
    client = MlflowClient(tracking_uri(tracking_cfg))
    try:
        folder = _retry(client.download_artifacts, run_id, "checkpoint")
    except Exception as err:
        raise FileNotFoundError(f"MLflow run {run_id!r} has neither {local} nor a logged checkpoint "
                                f"(train with tracking.log_checkpoint=true) ({store_error_line(err)})") from None
    return Path(folder) / "final.pt"


def log_metrics_to_run(uri: str, run_id: str, metrics: dict) -> None:
    """Adds metrics to an existing run (finished or not) in the store at `uri`, e.g. CORE computed later:
    each at the last step its key already has there, so that it becomes the run's latest value (MLflow
    shows the point of the highest step: at step 0, a CORE of the training's last step would hide it)."""
    missing = paths.missing_sqlite_store(uri)
    if missing:
        raise FileNotFoundError(f"there is no MLflow store at {missing}")
    client = MlflowClient(uri)
    now = _now_ms()
    logged = _retry(client.get_run, run_id).data.metrics

    def last_step(key: str) -> int:
        return max((m.step for m in _retry(client.get_metric_history, run_id, key)), default=0) if key in logged else 0

    _log_metrics(client, run_id, [Metric(k, float(v), now, last_step(k)) for k, v in metrics.items()
                                  if _is_number(v) and math.isfinite(v)])


def _start_run(cfg, run) -> tuple[MlflowClient, str, str]:
    uri = tracking_uri(cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    opened: dict[str, str] = {}  # experiment_id, then run_id, as soon as each is known
    try:
        resumed = run.summary.get("mlflow_run_id")
        ack = read_ack(run.run_dir)
        if "resume_step" in run.summary and not resumed and ack.get("uri") == uri:
            resumed = ack.get("run_id")  # created later by `sync`
        if resumed:  # `resume=`: the same MLflow run goes on
            opened["run_id"] = resumed
            _reopen(client, resumed)
            run_id = resumed
        else:
            run_id = _create_run(client, uri, cfg, run, opened)
    except BaseException as err:  # a signal, or the store failing half-way
        _end_broken_start(client, uri, run, opened, err)
        if isinstance(err, ConfigError) or not isinstance(err, Exception):
            raise
        raise ConfigError(f"tracking.uri={uri} could not start an MLflow run ({store_error_line(err)})") from None
    run.summary["mlflow_run_id"] = run_id  # in summary.json and resume.pt: how to find this run again
    write_ack(run.run_dir, uri, run_id, acked_records=0, terminal_status=None)
    return client, uri, run_id


def _create_run(client: MlflowClient, uri: str, cfg, run, opened: dict[str, str]) -> str:
    if cfg.parent_run_id:  # a trial: same experiment as its sweep, or the UI will not nest it
        parent = _active_run(client, cfg.parent_run_id)
        if parent is None:
            raise ConfigError(f"tracking.parent_run_id={cfg.parent_run_id} is not allowed: tracking.uri={uri} "
                              "has no such active run to nest this run under")
        experiment_id = parent.info.experiment_id
    else:
        experiment_id = _experiment_id(client, uri, cfg.experiment)
    opened["experiment_id"] = experiment_id
    tags = {**_source_tags(), "run_dir": str(Path(run.run_dir).resolve())}
    if cfg.parent_run_id:
        tags[MLFLOW_PARENT_RUN_ID] = cfg.parent_run_id
    run_id = _retry(client.create_run, experiment_id, run_name=cfg.run_name, tags=_clip_tags(tags)).info.run_id
    opened["run_id"] = run_id
    _log_params(client, run_id, flatten(OmegaConf.to_container(run.raw, resolve=True)))
    # The config and the diff go in first, so that even a run that crashes has them.
    _retry(client.log_text, run_id, OmegaConf.to_yaml(run.raw, resolve=True), "config.yaml")
    if tags.get("git.dirty") == "true":
        diff = _git("diff", "HEAD")
        if diff:
            _retry(client.log_text, run_id, diff, "git_diff.patch")
    return run_id


def _end_broken_start(client: MlflowClient, uri: str, run, opened: dict[str, str], err: BaseException) -> None:
    """Ends the run a start that broke off had created or reopened, so that none is left RUNNING, and
    records a new one in tracking.json, where `sync` finds it rather than making a twin. A signal
    inside `create_run` leaves no id: the run is then found by its run_dir tag."""
    status, _ = lifecycle.not_started(err)  # the error names the store's own failure (store_error_line)
    run_dir = str(Path(run.run_dir).resolve())
    # the store is what failed (or a signal): the run's own files hold what there is
    with lifecycle.recording_end(), contextlib.suppress(Exception):
        for run_id in _made_by_broken_start(client, opened.get("run_id"), opened.get("experiment_id"), run_dir):
            _set_status(client, run_id, status, f"{lifecycle.NOT_STARTED}{store_error_line(err)}", _now_ms())
            if "resume_step" not in run.summary:  # a resumed run's record already names it
                write_ack(run.run_dir, uri, run_id, acked_records=0, terminal_status=status)


def _made_by_broken_start(client: MlflowClient, run_id: str | None, experiment_id: str | None,
                          run_dir: str) -> list[str]:
    """The run a start that broke off made: its id, or, as a signal inside `create_run` leaves none, the
    RUNNING runs of its experiment tagged with its run directory."""
    if run_id:
        return [run_id]
    return _running_with_tags(client, experiment_id, {"run_dir": run_dir}) if experiment_id else []


def _reopen(client: MlflowClient, run_id: str) -> None:
    """A resumed run is RUNNING again, and the error of its interruption goes."""
    run = _retry(client.get_run, run_id)
    _retry(client.update_run, run_id, status="RUNNING")
    _retry(client.set_tag, run_id, "status", "RUNNING")
    if "error" in run.data.tags:
        _retry(client.delete_tag, run_id, "error")


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
    db = paths.sqlite_path(uri)
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
    path = paths.sqlite_path(uri)
    if path is None:
        return contextlib.nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{path}.lock")


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _is_database(uri: str) -> bool:
    return uri.partition("://")[0].partition("+")[0] in ("postgresql", "mysql", "mssql")


def _probe(uri: str) -> None:
    """Any HTTP answer means the server is there; MLflow's own client would retry for minutes."""
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=PROBE_SECONDS)
    except requests.exceptions.SSLError:
        return  # something answers; TLS settings are MLflow's business (MLFLOW_TRACKING_INSECURE_TLS, ...)
    except requests.RequestException as err:
        raise ConfigError(f"tracking.uri={uri} is unreachable ({type(err).__name__}); start the server "
                          "or correct the URI") from None


def _probe_database(uri: str) -> None:
    """One connection to a database store: MLflow's SQL store retries its first one for two minutes."""
    timeout = {"connect_timeout": int(PROBE_SECONDS)} if not uri.startswith("mssql") else {}
    try:  # a database driver that is not installed fails here (ModuleNotFoundError)
        engine = sqlalchemy.create_engine(uri, poolclass=sqlalchemy.pool.NullPool, connect_args=timeout)
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)}); install the "
                          "database's driver or correct the URI") from None
    try:
        with engine.connect():
            pass
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)}); start the "
                          "database server or correct the URI") from None
    finally:
        engine.dispose()


def _clip_tags(tags: dict[str, str]) -> dict[str, str]:
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ms(seconds: float) -> int:
    """MLflow's timestamp of a time in seconds: the live observer and `sync` turn a record's time into
    the same one."""
    return int(seconds * 1000)


def _now_ms() -> int:
    return _ms(time.time())


def _warn(message: str) -> None:
    print(f"warning: tracking: {message}", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# The acknowledgement record: tracking.json in the run directory


def read_ack(run_dir: Path) -> dict:
    """tracking.json: the store and MLflow run of this run directory, how many records of
    metrics.jsonl the store has taken, and the terminal status it has (None while it has none)."""
    try:
        ack = json.loads((Path(run_dir) / ACK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(ack, dict):
        return {}
    # a field of another kind (an edited file) is as good as none: sync then compares point by point
    return {key: ack[key] for key, kind in ACK_FIELDS.items() if isinstance(ack.get(key), kind)}


ACK_FIELDS = {"uri": str, "run_id": str, "acked_records": int, "terminal_status": str}


def write_ack(run_dir: Path, uri: str, run_id: str, acked_records: int, terminal_status: str | None,
              required: bool = False) -> None:
    """`required`: an OSError is raised (sync: a run it made but could not record would get a twin
    from the next sync); else it is left for the trainer to report (a full disk). No .tmp is left."""
    ack = {"uri": uri, "run_id": run_id, "acked_records": acked_records, "terminal_status": terminal_status}
    path = Path(run_dir) / ACK_FILE
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(ack, indent=2))
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if required:
            raise


# -----------------------------------------------------------------------------
# `python -m frontier.tracking sync RUN_DIR [tracking.uri=URI]`


def sync(run_dir: Path, uri: str | None = None) -> str:
    """Pushes to MLflow what it lacks of a run directory, and returns one line saying what was done.

    Creates the MLflow run if it never existed (params from the run's config), sends the points of
    metrics.jsonl it does not hold (a (key, step) it has is never sent again), the final summary,
    summary.json, curves.png, the status tags and the terminal status. A run whose process died
    without recording its end (no summary.json, and nothing holds its run.lock) ends KILLED, saying so.
    Running it again sends nothing.
    """
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR={run_dir} is not allowed: no such directory")
    # one sync of a run directory at a time (a second waits, then finds the run the first made), and
    # run.lock held while syncing: no resume= can reopen the run meanwhile
    with _one_sync_at_a_time(run_dir), lifecycle.claimed(run_dir) as ended:
        return _sync(run_dir, uri, ended)


@contextlib.contextmanager
def _one_sync_at_a_time(run_dir: Path) -> Iterator[None]:
    """An exclusive lock on the run directory itself, so that syncing writes no file of its own there."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sync(run_dir: Path, uri: str | None, ended: bool | None) -> str:
    metrics_path, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    if not metrics_path.is_file() and not summary_path.is_file():
        raise ConfigError(f"RUN_DIR={run_dir} is not allowed: it is not a run directory (it has neither "
                          f"metrics.jsonl nor summary.json)")
    summary = None
    if summary_path.exists():  # a folder or an unreadable file in its place is not "no summary": its run ended
        summary = _load_run_file(run_dir, summary_path, lambda path: json.loads(path.read_text()), "JSON")
        if not isinstance(summary, dict):
            raise _not_allowed(run_dir, f"{summary_path} is not a JSON object (it holds {json.dumps(summary)[:40]})")
        if summary.get("status") not in lifecycle.TERMINAL:  # sync would end the run with a status it never had
            raise _not_allowed(run_dir, f"{summary_path} has status {summary.get('status')!r}, not one of "
                                        f"{', '.join(lifecycle.TERMINAL)}")
    ack_path = run_dir / ACK_FILE
    if ack_path.exists() and not ack_path.is_file():  # sync could not record the run it makes: a twin each time
        raise _not_allowed(run_dir, f"{ack_path} is not a file; sync records there which MLflow run holds the "
                                    "directory (move it away)")
    unreadable: list[int] = []
    records = _load_run_file(run_dir, metrics_path, lambda path: read_records(path, unreadable), "text")
    if unreadable:  # a line cut short by kill -9, or a damaged file: what it held cannot be sent
        lines = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        _warn(f"{len(unreadable)} line(s) of {metrics_path} are not metrics records and are left out (line "
              f"{lines})")
    config = _run_config(run_dir)
    cfg = _tracking_config(config)
    ack = read_ack(run_dir)
    if uri:
        uri = tracking_uri(TrackingConfig(uri=uri))
        given = paths.sqlite_path(uri)
        if given is not None and not given.exists():  # wanted (a first store for runs trained offline) or a typo
            _warn(f"there was no MLflow store at tracking.uri={uri}, so sync creates one there (if you meant an "
                  "existing store, check the path)")
    uri = uri or ack.get("uri") or tracking_uri(cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    run_id = _existing_run(client, ack.get("run_id") if ack.get("uri") == uri else None) or _existing_run(
        client, (summary or {}).get("mlflow_run_id"))
    created = run_id is None
    if created:
        run_id = _synced_run(client, uri, cfg, config, run_dir, records)
    status = (summary or {}).get("status")
    died = status not in MLFLOW_STATUS and ended is True  # nothing holds its run.lock: its process is gone
    if died:
        status = "KILLED"
    if (not created and ack.get("run_id") == run_id and ack.get("acked_records") == len(records)
            and status in MLFLOW_STATUS and ack.get("terminal_status") == status):
        return f"{run_dir} is already in sync with run {run_id} in {uri}"
    sent = _send_missing(client, run_id, records, _history(client, run_id))
    finals = [r for r in records if "final" in r]
    if summary is not None and status in MLFLOW_STATUS:
        final = finals[-1] if finals else {**final_record(summary, status), "time": summary_path.stat().st_mtime}
        for fn, *args in _end_calls(client, run_id, run_dir, summary, final, cfg.log_checkpoint):
            sent += fn(*args) or 0  # _push_final says how many points it sent
        ending = f"status {status}"
    elif died:
        ending = _end_dead_run(client, run_id, run_dir, records)
    elif ended is False:
        ending = "its process is still running, so the run is left RUNNING"
    else:
        ending = "no summary.json, so the run is left RUNNING"
    write_ack(run_dir, uri, run_id, acked_records=len(records), terminal_status=status, required=True)
    what = f"run {run_id} created" if created else f"run {run_id}"
    return f"synced {run_dir} to {what} in {uri}: {sent} new point(s), {ending}"


def _end_dead_run(client: MlflowClient, run_id: str, run_dir: Path, records: list[dict]) -> str:
    """Ends KILLED the MLflow run of a process that died without recording its end, unless someone (a
    sweep driver, for its trial) ended it already; says which."""
    _log_curves(client, run_id, run_dir, {})
    ended_as = _retry(client.get_run, run_id).info.status
    if ended_as != "RUNNING":
        return f"its process ended without recording its end, and MLflow has the run {ended_as} already"
    end_ms = _ms(records[-1]["time"]) if records else _now_ms()  # its last sign of life
    reason = died_without_end(run_dir)
    _set_status(client, run_id, "KILLED", reason, end_ms)
    return f"status KILLED: {reason}"


def died_without_end(run_dir: Path) -> str:
    """What `sync` records for a run whose process ended without recording its end."""
    how = (f"`python -m frontier.train resume={run_dir}` continues it from its last resume.pt"
           if (run_dir / "resume.pt").is_file() else "it wrote no resume.pt, so it cannot be resumed")
    return f"its process ended without recording its end (kill -9, a crash or a lost machine); {how}"


def _not_allowed(run_dir: Path, reason: str) -> ConfigError:
    return ConfigError(f"RUN_DIR={run_dir} is not allowed: {reason}")


def _load_run_file(run_dir: Path, path: Path, load: Callable, language: str):
    """`load(path)`; a file of the run that cannot be read or parsed is one sentence naming it (exit 2):
    the user's to mend, never taken for a store that did not answer."""
    try:
        return load(path)
    except OSError as err:
        raise _not_allowed(run_dir, f"{path} cannot be read ({err.strerror or err})") from None
    except Exception as err:  # text that does not parse
        raise _not_allowed(run_dir, f"{path} is not {language} ({error_line(err)})") from None


def _run_config(run_dir: Path) -> dict:
    """The run's config: Hydra's copy, else the one saved in final.pt or resume.pt; {} without any."""
    hydra_config = run_dir / ".hydra" / "config.yaml"
    if hydra_config.exists():
        loaded = _load_run_file(run_dir, hydra_config, OmegaConf.load, "YAML")
        if not isinstance(loaded, DictConfig):
            raise _not_allowed(run_dir, f"{hydra_config} is not a mapping of config keys (it holds a list)")
        try:
            return OmegaConf.to_container(loaded, resolve=True)
        except Exception:  # an interpolation that needs Hydra's runtime: keep it as written
            return OmegaConf.to_container(loaded)
    for name in ("final.pt", "resume.pt"):
        if (run_dir / name).is_file():
            from frontier.checkpoint import read_checkpoint

            config = read_checkpoint(run_dir / name, "sync", keys=("config",))["config"]
            if not isinstance(config, dict):
                raise _not_allowed(run_dir, f"{run_dir / name} holds no config mapping")
            return config
    return {}


def _tracking_config(config: dict) -> TrackingConfig:
    saved = config.get("tracking") or {}
    known = {f.name for f in dataclasses.fields(TrackingConfig)}
    return TrackingConfig(**{k: v for k, v in saved.items() if k in known})


def _existing_run(client: MlflowClient, run_id: str | None) -> str | None:
    run = _active_run(client, run_id)
    return run.info.run_id if run is not None else None


def _active_run(client: MlflowClient, run_id: str | None) -> Run | None:
    """The run of that id, unless it does not exist or was deleted."""
    if not run_id:
        return None
    try:
        run = _retry(client.get_run, run_id)
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    return run if run.info.lifecycle_stage == "active" else None


def _synced_run(client: MlflowClient, uri: str, cfg, config: dict, run_dir: Path, records: list[dict]) -> str:
    """The MLflow run of a run directory that names none in the store, recorded in tracking.json at once.

    A RUNNING run tagged with this directory is taken up again: one that a sync (or a launch) killed
    before it wrote tracking.json left behind. Otherwise a new run is made; a signal before it is recorded
    deletes it again, so that an interrupted sync leaves no run RUNNING for good and the next one no twin.
    """
    tags = {"run_dir": str(run_dir.resolve())}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        loaded = _load_run_file(run_dir, overrides, OmegaConf.load, "YAML")
        tags["hydra.overrides"] = " ".join(str(o) for o in (loaded if isinstance(loaded, ListConfig) else []))
    parent = _active_run(client, cfg.parent_run_id)
    if parent is not None:
        tags[MLFLOW_PARENT_RUN_ID] = parent.info.run_id
        experiment_id = parent.info.experiment_id
    else:
        experiment_id = _experiment_id(client, uri, cfg.experiment)
    left = _retry(_running_with_tags, client, experiment_id, {"run_dir": tags["run_dir"]})
    run_id = left[0] if left else None
    try:
        if run_id is None:
            start_ms = _ms(records[0]["time"]) if records else None
            run_id = _retry(client.create_run, experiment_id, start_time=start_ms, run_name=cfg.run_name,
                            tags=_clip_tags(tags)).info.run_id
        if config:
            _log_params(client, run_id, flatten(config))
            _retry(client.log_text, run_id, OmegaConf.to_yaml(OmegaConf.create(config)), "config.yaml")
        write_ack(run_dir, uri, run_id, acked_records=0, terminal_status=None, required=True)  # the next sync finds it
    except BaseException:
        if not left:
            _delete_unrecorded(client, experiment_id, run_id, tags["run_dir"])
        raise
    return run_id


def _delete_unrecorded(client: MlflowClient, experiment_id: str, run_id: str | None, run_dir: str) -> None:
    """Deletes the run a sync made but never recorded; a signal inside create_run leaves no id, so the
    run is then found by its tag. Where the store fails too, the next sync takes the run up again."""
    with contextlib.suppress(Exception):
        for found in _made_by_broken_start(client, run_id, experiment_id, run_dir):
            client.delete_run(found)


USAGE = "python -m frontier.tracking sync RUN_DIR [tracking.uri=URI]"
HELP = f"""usage: {USAGE}

Sends to the MLflow store what it has not acknowledged of the run in RUN_DIR (from its metrics.jsonl,
summary.json and config), creating the MLflow run if it never existed; no point is sent twice. A run
whose process ended without recording its end (kill -9) is ended KILLED; a live one is left RUNNING.
tracking.uri: the store, if not the one the run was configured with."""


@command
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print_help_if_asked(args, HELP)
    try:
        if not args or args[0] != "sync":
            raise ConfigError(f"{args[0] if args else 'no command'} is not allowed: the command is `{USAGE}`")
        if len(args) < 2:
            raise ConfigError(f"sync needs the run directory: `{USAGE}`")
        uri = None
        for item in args[2:]:
            key, _, value = item.partition("=")
            if key != "tracking.uri" or not value:
                raise ConfigError(f"{item} is not allowed: sync takes a run directory and tracking.uri=URI only")
            uri = value
        print(sync(Path(args[1]), uri))
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the store failed part way: what was sent stays, the next sync sends the rest
        if refused_path(err, args[1:], NAME_ERRORS) is not None:
            raise  # a path the OS refuses by its shape: frontier.cli.command says it, exit code 2
        print(f"error: sync of {args[1]} stopped ({store_error_line(err)}); run it again when the store answers",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
