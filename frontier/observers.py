"""Sinks that follow a run without the training loop knowing who listens.

frontier.lifecycle builds them (`for_run`) before any data is loaded, metrics file first. A sink
may implement any of:
  on_start(summary)                         after setup, with the run's static facts
  on_log(metrics, step)                     at the metrics cadence
  on_checkpoint(k, val_bpb, step, progress) once for each budget mark k crossed (k * eval.every_fraction
                                            <= progress), at the step that crossed it; may raise StopRun
  on_end(summary, status, error)            once, whatever happened; summary["val_bpb"] is None (never
                                            NaN) when there is none
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import weakref
from pathlib import Path

from frontier.config import ConfigError
from frontier.files import atomic_write


class StopRun(Exception):
    """Raised by an observer to end the run early with a status (for example PRUNED)."""

    def __init__(self, status: str, reason: str, value: float):
        super().__init__(reason)
        self.status = status
        self.value = value


def notify(sinks: list, event: str, *args) -> None:
    """Calls `event` on every sink; one that raises is reported once (a warning) and the others still
    hear it. StopRun from on_checkpoint is honoured: raised after every sink has heard."""
    global _event_time
    stop, _event_time = None, time.time()
    try:
        for sink in sinks:
            handler = getattr(sink, event, None)
            if handler is None:
                continue
            try:
                handler(*args)
            except StopRun as err:
                if event == "on_checkpoint":
                    stop = stop or err
                else:
                    _warn_once(sink, event, err)
            except Exception as err:
                _warn_once(sink, event, err)
    finally:
        _event_time = None
    if stop is not None:
        raise stop


_event_time: float | None = None  # while `notify` runs: when its event happened


def event_time() -> float:
    """When the event the sinks are hearing happened: one time for all of them, so that a point MLflow
    gets live and the same point `sync` pushes from metrics.jsonl are one point (a store keeps a point
    sent twice with the same key, step, value and timestamp once). Outside `notify`: now."""
    return time.time() if _event_time is None else _event_time


_warned: weakref.WeakSet = weakref.WeakSet()  # sinks already reported


def _warn_once(sink, event: str, err: BaseException) -> None:
    if sink in _warned:
        return
    _warned.add(sink)
    line = (str(err).splitlines() or [""])[0]
    print(f"warning: {type(sink).__name__}.{event} failed ({type(err).__name__}: {line}); the run goes on "
          "without it where it can", file=sys.stderr, flush=True)


class MetricsFile:
    """metrics.jsonl in the run directory: every point, on disk before any other sink sees it.

    One JSON record a line: {"step", "time", <metrics>} at the metrics cadence; {"step", "time",
    "checkpoint": k, "val_bpb", "progress"} at each budget checkpoint; and at the end one
    {"step", "time", "final": true, "status", <every number of the summary>}. This file is what
    `python -m frontier.tracking sync RUN_DIR` pushes to MLflow when the store missed something.

    On `resume=` the records the stopped process wrote after its resume point (and its final
    record) are dropped first, in one atomic rewrite, so that every step is in the file once.
    """

    def __init__(self, path, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None and self.path.exists():
            self._keep_until(resume_step)

    @classmethod
    def for_run(cls, run) -> "MetricsFile":
        return cls(run.run_dir / "metrics.jsonl", run.summary.get("resume_step"))

    def on_log(self, metrics: dict, step: int) -> None:
        self._write({"step": step, "time": event_time(), **metrics})

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        self._write({"step": step, "time": event_time(), "checkpoint": k, "val_bpb": val_bpb, "progress": progress})

    def on_end(self, summary: dict, status: str, error: str | None) -> None:
        self._write(final_record(summary, status))

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _keep_until(self, step: int) -> None:
        try:
            kept = [r for r in read_records(self.path) if r["step"] <= step and "final" not in r]
        except OSError as err:  # a folder in its place, a failing disk: the resume is refused, nothing written
            raise ConfigError(f"resume={self.path.parent} is not allowed: {self.path} cannot be read "
                              f"({err.strerror or err})") from None
        # A full disk is one line naming metrics.jsonl (RunWriteError), and leaves no .tmp
        atomic_write(self.path, lambda tmp: tmp.write_text("".join(json.dumps(r) + "\n" for r in kept)))


RECORD_FIELDS = ("step", "time", "checkpoint", "final", "status")  # a record's bookkeeping, not metrics


def read_records(path, unreadable: list[int] | None = None) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a killed process (or made unreadable on a
    failing disk: bytes that are not UTF-8, or edited: no integer step or no finite time) is left out,
    its number appended to `unreadable`."""
    records = []
    with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int) \
                    and not isinstance(record["step"], bool) and is_finite_number(record.get("time")):
                records.append(record)
            elif unreadable is not None and line.strip():
                unreadable.append(number)
    return records


def final_record(summary: dict, status: str) -> dict:
    """The last record of a run: its status and every finite number of its summary, at its last step."""
    numbers = {k: v for k, v in summary.items() if k not in RECORD_FIELDS and is_finite_number(v)}
    return {"step": summary.get("steps") or 0, "time": event_time(), "final": True, "status": status, **numbers}


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
