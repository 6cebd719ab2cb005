"""The MLflow sink: every run lands in the store, complete, whatever happens to the run. A run records:

- params: the flattened resolved config, every key;
- tags: Hydra overrides as typed, git commit and dirty flag (the diff as `git_diff.patch`), device
  name and count, torch version, host, budget name, the validation set's `val_fingerprint`, and the
  trainer's own `status`;
- metrics: whatever the trainer logs at its cadence, val_bpb at each budget checkpoint, and every
  numeric entry of the final summary (val_bpb, val_bpb_se, tokens_per_second, mfu, budget_utilization, ...);
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
by `python -m frontier.tracking sync RUN_DIR`.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from matplotlib.figure import Figure
from mlflow import MlflowClient
from mlflow.entities import Metric, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf

from frontier.config import ConfigError, store_error_line
from frontier.observers import RECORD_FIELDS, event_time, final_record, is_finite_number, read_records
from frontier.stopping import NOT_STARTED, not_started, recording_end
from frontier.store import (MLFLOW_STATUS, _clip_tags, _experiment_id, _git, _log_batch, _log_metrics, _log_params,
                            _ms, _now_ms, _retry, _running_with_tags, _source_tags, _transient, _warn, ensure_store,
                            flatten, tracking_uri)


IN_FLIGHT_SECONDS = 1.0  # after flush_seconds, how long on_end waits for the call in flight to land
MAX_BACKOFF_SECONDS = 8.0  # the logging thread's longest pause between tries while the store is down
ACK_FILE = "tracking.json"


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
            "mfu_basis": summary.get("mfu_basis"),  # cpu time or wall clock: what mfu is taken per
            "precision": summary.get("precision"),
            "val_fingerprint": summary.get("val_fingerprint"),  # runs' val_bpb compare only when it is equal
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
    status, _ = not_started(err)  # the error names the store's own failure (store_error_line)
    run_dir = str(Path(run.run_dir).resolve())
    # the store is what failed (or a signal): the run's own files hold what there is
    with recording_end(), contextlib.suppress(Exception):
        for run_id in _made_by_broken_start(client, opened.get("run_id"), opened.get("experiment_id"), run_dir):
            _set_status(client, run_id, status, f"{NOT_STARTED}{store_error_line(err)}", _now_ms())
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
