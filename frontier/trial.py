"""The trial's side of a sweep: the sink that ties one training run to its Optuna trial.

The sweep driver (hydra_plugins/frontier_sweeper) creates a trial, then runs
`python -m frontier.train ... trial.study=S trial.storage=URL trial.number=N` in a process of its
own, with FRONTIER_SWEEP_DRIVER naming itself. In that process TrialReporter
  - reports val_bpb at each budget checkpoint k, and ends the run when the study's pruner says so;
  - sends the trial's heartbeat and watches its driver: when the driver is gone, nobody supervises
    the trial, so it stops at once;
  - tells the study how the run ended (COMPLETE with val_bpb, PRUNED, or FAIL with why).
"""
from __future__ import annotations

import contextlib
import math
import os
import threading

import optuna
from optuna.exceptions import UpdateFinishedTrialError

from frontier.config import ConfigError
from frontier.observers import StopRun
from frontier.stopping import request_stop
from frontier.study import (DRIVER_ENV, Process, build_pruner, driver_alive, end_trial,
                            open_storage, outcome, safe_storage, study_storage)

WATCH_SECONDS = 1.0  # how often the trial looks for its driver on this machine
STATE_SECONDS = 10.0  # how often it reads its own state in the study, for a driver that ended it


def open_trial(cfg) -> tuple[optuna.Study, int]:
    """The study and trial id that `trial.storage`, `trial.study` and `trial.number` name; one sentence
    naming the key when one is not there."""
    spec = study_storage(cfg.storage, cfg.study)
    try:
        storage = open_storage(spec, create=False)  # the driver made it
    except FileNotFoundError:
        raise ConfigError(f"trial.storage={safe_storage(spec)} does not exist: a trial joins the study "
                          f"its sweep driver created") from None
    # the sampler never runs here (the driver sampled the parameters); the pruner must be the
    # study's, which the driver records in the study's user attributes
    try:
        study = optuna.load_study(study_name=cfg.study, storage=storage, sampler=optuna.samplers.RandomSampler())
    except KeyError:
        raise ConfigError(f"trial.study={cfg.study!r} is not a study in {safe_storage(spec)}") from None
    study.pruner = build_pruner(**study.user_attrs.get("pruner", {"name": "none"}))
    try:
        return study, storage.get_trial_id_from_study_id_trial_number(study._study_id, cfg.number)
    except KeyError:
        raise ConfigError(f"trial.number={cfg.number} is not a trial of study {cfg.study!r}") from None


def check_resumable(cfg, run_dir) -> None:
    """`resume=` of a trial's run directory continues that trial only while the study has it RUNNING:
    one that ended (its driver stopped it) takes no more reports, and the resumed run was stopped
    again as soon as it started, every time, with exit code 130."""
    study, trial_id = open_trial(cfg)
    trial = study._storage.get_trial(trial_id)
    if trial.state.is_finished():
        why = trial.user_attrs.get("fail_reason") or trial.user_attrs.get("prune_reason")
        again = " ".join(trial.user_attrs.get("overrides", []))
        raise ConfigError(f"resume={run_dir} is not allowed: it is trial {cfg.number} of study {cfg.study!r}, "
                          f"which has ended {trial.state.name}{f' ({why})' if why else ''} and takes no more "
                          f"reports; run its sweep again for new trials, or train these settings as a run of "
                          f"their own: python -m frontier.train {again}")


class TrialReporter:
    def __init__(self, run, study: optuna.Study, trial: optuna.Trial, driver: Process | None,
                 heartbeat_interval: int | None, grace_period: float):
        self.run = run
        self.study = study
        self.trial = trial
        self.driver = driver
        self.heartbeat_interval = heartbeat_interval
        self.grace_period = grace_period
        self.checkpoint_fractions: dict[str, float] = {}
        self.prunable = len(study.directions) == 1 and trial.user_attrs.get("confirm") is None  # confirmations run whole
        self.stop_reason: str | None = None
        self.ended = threading.Event()
        self.record_mlflow_run(run.summary)
        threading.Thread(target=self.watch, name="trial-watch", daemon=True).start()

    @classmethod
    def for_run(cls, run) -> "TrialReporter":
        cfg = run.config.trial
        study, trial_id = open_trial(cfg)
        # the driver is named at launch: after set-up, the parent may already be someone else
        driver = Process.parse(os.environ.get(DRIVER_ENV))
        return cls(run, study, optuna.trial.Trial(study, trial_id), driver, cfg.heartbeat_interval,
                   cfg.grace_period)

    # -- supervision ------------------------------------------------------------------------------

    def watch(self) -> None:
        """The trial's heartbeat, and a stop as soon as its driver is gone or a driver has ended it
        in the study (also in a run without periodic evaluations, whose reports would find it)."""
        since_beat = since_state = math.inf
        while not self.ended.is_set():
            if self.heartbeat_interval and since_beat >= self.heartbeat_interval:
                with contextlib.suppress(Exception):  # a storage hiccup: the next beat may pass
                    self.study._storage.record_heartbeat(self.trial._trial_id)
                since_beat = 0.0
            if self.driver is not None and self.stop_reason is None and not self.driver_alive():
                self.stop(f"its sweep driver (pid {self.driver.pid} on {self.driver.host}) has exited")
            if since_state >= STATE_SECONDS:
                with contextlib.suppress(Exception):  # the storage is unreachable: the driver's check decides
                    self.stop_if_ended()
                since_state = 0.0
            self.ended.wait(WATCH_SECONDS)
            since_beat += WATCH_SECONDS
            since_state += WATCH_SECONDS

    def driver_alive(self) -> bool:
        try:
            return driver_alive(self.study, self.driver, self.grace_period)
        except Exception:  # the storage is unreachable: the heartbeat decides, not this
            return True

    def stop_if_ended(self) -> None:
        """Stopped from outside, as when its driver is gone: KILLED, resume.pt, exit 130 (a StopRun
        would end it FAILED yet exit 0)."""
        ended = self.study._storage.get_trial(self.trial._trial_id)
        if ended.state.is_finished() and self.stop_reason is None and not self.ended.is_set():
            self.stop(f"trial {self.trial.number} was ended {ended.state.name} in the study "
                      f"({ended.user_attrs.get('fail_reason', 'by another process')})")

    def stop(self, reason: str) -> None:
        self.stop_reason = reason
        request_stop(reason)

    # -- the sink hooks ---------------------------------------------------------------------------

    def record_mlflow_run(self, summary: dict) -> None:
        """So that whoever closes this trial's run later finds it."""
        run_id = summary.get("mlflow_run_id")
        if run_id and self.trial.user_attrs.get("mlflow_run_id") != run_id:
            with contextlib.suppress(UpdateFinishedTrialError):
                self.trial.set_user_attr("mlflow_run_id", run_id)

    def on_start(self, summary: dict) -> None:
        self.record_mlflow_run(summary)

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        if not math.isfinite(val_bpb):
            return  # the trainer's divergence check ends the run
        self.checkpoint_fractions[str(k)] = round(progress, 4)  # where checkpoint k was measured
        try:
            if len(self.study.directions) == 1:  # a pareto study takes no reports: it cannot prune
                self.trial.report(val_bpb, k)
            self.trial.set_user_attr("checkpoint_fractions", self.checkpoint_fractions)
            self.trial.set_user_attr("budget_fraction", round(progress, 4))
        except UpdateFinishedTrialError:  # ended by a driver meanwhile (silent, too slow, interrupted)
            self.stop_if_ended()
            return
        if self.prunable and self.trial.should_prune():
            raise StopRun("PRUNED", f"pruned at checkpoint {k} ({progress:.0%} of the budget, "
                                    f"val_bpb {val_bpb:.4f})", value=val_bpb)

    def on_end(self, summary: dict, status: str, error: str | None) -> None:
        """Tells the study how the run ended; a trial its driver already ended stays as it is."""
        self.ended.set()
        summary = {**summary, "status": status}
        if self.stop_reason is not None and status == "KILLED":
            summary["error"] = self.stop_reason
        elif error and not summary.get("error"):
            summary["error"] = error
        state, value, attrs = outcome(summary, f"ended {status} without a reason",
                                      self.study.user_attrs.get("objective"), self.study.user_attrs.get("val_fingerprint"))
        progress = summary.get("progress", getattr(getattr(self.run, "clock", None), "progress", None))
        if progress is not None:
            attrs["budget_fraction"] = round(progress, 4)
        end_trial(self.study, self.trial._trial_id, state, value, attrs)
