"""Hooks that follow a run without the training loop knowing who listens.

An observer may implement any of:
  on_start(summary)                         after setup, with the run's static facts
  on_log(metrics, step)                     at the metrics cadence
  on_checkpoint(k, val_bpb, step, progress) at the k-th budget fraction; may raise StopRun
  on_end(summary, status, error)            once, whatever happened
"""
from __future__ import annotations


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


def for_run(run) -> list:
    """The observers a run's config asks for: MLflow tracking, and the sweeper's trial."""
    found = []
    if run.config.tracking.enabled:
        from frontier.tracking import MlflowObserver

        found.append(MlflowObserver.for_run(run))
    if run.config.trial.number is not None:
        from frontier.trial import TrialReporter

        found.append(TrialReporter.for_run(run))
    return found
