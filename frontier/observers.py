"""Hooks that follow a run without the training loop knowing who listens.

An observer may implement any of:
  on_start(summary)                         after setup, with the run's static facts
  on_log(metrics, step)                     at the metrics cadence
  on_checkpoint(k, val_bpb, step, progress) at the k-th budget fraction; may raise StopRun
  on_end(summary, status, error)            once, whatever happened
"""
from __future__ import annotations

import json
import time


class StopRun(Exception):
    """Raised by an observer to end the run early with a status (for example PRUNED)."""

    def __init__(self, status: str, reason: str, value: float):
        super().__init__(reason)
        self.status = status
        self.value = value


def notify(observers: list, event: str, *args) -> None:
    for observer in observers:
        handler = getattr(observer, event, None)
        if handler is not None:
            handler(*args)


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


def for_run(run) -> list:
    """The observers a run's config asks for: the metrics file, MLflow tracking, the sweeper's trial."""
    found = [MetricsFile(run.run_dir / "metrics.jsonl")]
    if run.config.tracking.enabled:
        from frontier.tracking import MlflowObserver

        found.append(MlflowObserver.for_run(run))
    if run.config.trial.number is not None:
        from frontier.trial import TrialReporter

        found.append(TrialReporter.for_run(run))
    return found
