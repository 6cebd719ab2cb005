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

import json
import sys
import time
import weakref


class StopRun(Exception):
    """Raised by an observer to end the run early with a status (for example PRUNED)."""

    def __init__(self, status: str, reason: str, value: float):
        super().__init__(reason)
        self.status = status
        self.value = value


def notify(sinks: list, event: str, *args) -> None:
    """Calls `event` on every sink; one that raises is reported once (a warning) and the others still
    hear it. StopRun from on_checkpoint is honoured: raised after every sink has heard."""
    stop = None
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
    if stop is not None:
        raise stop


_warned: weakref.WeakSet = weakref.WeakSet()  # sinks already reported


def _warn_once(sink, event: str, err: BaseException) -> None:
    if sink in _warned:
        return
    _warned.add(sink)
    line = (str(err).splitlines() or [""])[0]
    print(f"warning: {type(sink).__name__}.{event} failed ({type(err).__name__}: {line}); the run goes on "
          "without it where it can", file=sys.stderr, flush=True)


class MetricsFile:
    """metrics.jsonl in the run directory: every logged point, whatever happens to the tracker."""

    def __init__(self, path):
        self.path = path

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_log(self, metrics: dict, step: int) -> None:
        self._write({"step": step, "time": time.time(), **metrics})

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        self._write({"step": step, "time": time.time(), "checkpoint": k, "val_bpb": val_bpb, "progress": progress})
