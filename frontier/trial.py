"""The Optuna side shared by the sweeper and the trials it starts.

The sweeper (hydra_plugins/frontier_sweeper) creates a trial, then runs
`python -m frontier.train ... trial.study=S trial.storage=URL trial.number=N` in a process of its
own. In that process TrialReporter reports val_bpb at each budget checkpoint k to the trial,
through the study's storage, and ends the run when the study's pruner says so.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import time
import warnings
import zlib
from pathlib import Path

import optuna
from filelock import FileLock
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from frontier.config import project_path
from frontier.observers import StopRun

STALE_REASON = "its process stopped sending heartbeats (killed, or its machine went away)"


def default_storage(study_name: str) -> str:
    """A journal file that every process on this machine (or on a shared disk) can append to."""
    return str(project_path(f"mlruns/sweeps/{study_name}.journal"))


def is_rdb(spec: str) -> bool:
    return "://" in spec


def _sqlalchemy_url(url: str) -> str:
    # SQLAlchemy 2.1 reads postgresql:// as psycopg 3; use psycopg2 where only that is installed
    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
    """A journal file storage with the heartbeat Optuna implements only for RDB storages: the
    process running a trial stamps it every `interval` seconds, so that a RUNNING trial whose
    process died can be told apart from one still running."""

    def __init__(self, path: str, interval: int | None = None, grace_period: int | None = None):
        super().__init__(JournalFileBackend(path))
        self._interval = interval
        self._grace_period = grace_period or (2 * interval if interval else None)

    def record_heartbeat(self, trial_id: int) -> None:
        with contextlib.suppress(UpdateFinishedTrialError):  # already ended by another process
            self.set_trial_system_attr(trial_id, "heartbeat", time.time())

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        if self._interval is None:
            return []
        now = time.time()
        stale = []
        for trial in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
            last = trial.system_attrs.get("heartbeat", trial.datetime_start.timestamp())
            if now - last > self._grace_period:
                stale.append(trial._trial_id)
        return stale

    def get_heartbeat_interval(self) -> int | None:
        return self._interval

    def get_heartbeat_stale_trial_callback(self):
        return None


def open_storage(spec: str, heartbeat_interval: int | None = None,
                 grace_period: int | None = None) -> BaseStorage:
    """An RDB URL (postgresql://..., sqlite:///...) or the path of a journal file."""
    if is_rdb(spec):
        with warnings.catch_warnings():  # heartbeat_interval is "experimental" in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(_sqlalchemy_url(spec), engine_kwargs={"pool_pre_ping": True},
                              heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    path = Path(spec).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return HeartbeatJournalStorage(str(path), heartbeat_interval, grace_period)


@contextlib.contextmanager
def ask_lock(spec: str, storage: BaseStorage, study_name: str):
    """Serialises "count the study's trials, then create one" across processes and machines, so
    that n_trials is exact however many workers share the study."""
    if not is_rdb(spec):
        with FileLock(str(Path(spec).expanduser().resolve()) + ".ask.lock"):  # .lock is the journal's own
            yield
    elif isinstance(storage, RDBStorage) and storage.engine.dialect.name == "postgresql":
        from sqlalchemy import text

        key = {"key": zlib.crc32(study_name.encode())}
        with storage.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), key)
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), key)
    elif isinstance(storage, RDBStorage) and storage.engine.dialect.name == "sqlite":
        with FileLock(str(storage.engine.url.database) + ".ask.lock"):
            yield
    else:  # other databases: workers on one machine are serialised by the sweeper itself
        yield


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """Marks FAIL, with its reason, every RUNNING trial whose heartbeat stopped; returns their numbers.

    Optuna's own fail_stale_trials cannot record a reason: a finished trial takes no attributes."""
    storage = study._storage
    if not isinstance(storage, BaseHeartbeat) or storage.get_heartbeat_interval() is None:
        return []
    failed = []
    for trial_id in storage._get_stale_trial_ids(storage.get_study_id_from_name(study.study_name)):
        with contextlib.suppress(UpdateFinishedTrialError):  # it ended meanwhile
            storage.set_trial_user_attr(trial_id, "fail_reason", STALE_REASON)
            if storage.set_trial_state_values(trial_id, TrialState.FAIL):
                failed.append(storage.get_trial_number_from_id(trial_id))
    return failed


def build_pruner(name: str, min_resource: int = 1, max_resource: int = 10,
                 reduction_factor: int = 3) -> optuna.pruners.BasePruner:
    """Resources are checkpoints: step k is the k-th `eval.every_fraction` of the budget, equal
    wall-clock time for every trial, so trials are compared at equal cost."""
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=min_resource, max_resource=max_resource,
                                              reduction_factor=reduction_factor, bootstrap_count=0)
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=min_resource,
                                                      reduction_factor=reduction_factor,
                                                      min_early_stopping_rate=0, bootstrap_count=0)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=min_resource - 1,
                                           interval_steps=1, n_min_trials=1)
    return optuna.pruners.NopPruner()


class TrialReporter:
    """Observer of a trial's run: reports each checkpoint to its Optuna trial and stops the run
    (StopRun PRUNED) when the pruner says so."""

    def __init__(self, run, study: optuna.Study, trial: optuna.Trial):
        self.run = run
        self.study = study
        self.trial = trial
        self.sweeper_pid = os.getppid()

    @classmethod
    def for_run(cls, run) -> "TrialReporter":
        cfg = run.config.trial
        storage = open_storage(cfg.storage or default_storage(cfg.study))
        # the sampler never runs here (the sweeper sampled the parameters); the pruner must be the
        # study's, which the sweeper records in the study's user attributes
        study = optuna.load_study(study_name=cfg.study, storage=storage,
                                  sampler=optuna.samplers.RandomSampler())
        study.pruner = build_pruner(**study.user_attrs.get("pruner", {"name": "none"}))
        study_id = storage.get_study_id_from_name(cfg.study)
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, cfg.number)
        return cls(run, study, optuna.trial.Trial(study, trial_id))

    def on_checkpoint(self, k: int, val_bpb: float, step: int, progress: float) -> None:
        if os.getppid() != self.sweeper_pid:  # the sweeper died: nobody would record the result
            raise StopRun("KILLED", "the sweeper that started this trial has exited", value=val_bpb)
        if not math.isfinite(val_bpb):
            return  # the trainer's divergence check ends the run
        try:
            self.trial.report(val_bpb, k)
            self.trial.set_user_attr("budget_fraction", round(progress, 4))
        except UpdateFinishedTrialError:  # marked FAIL meanwhile (e.g. missed heartbeats)
            raise StopRun("FAILED", f"trial {self.trial.number} is no longer running in the study",
                          value=val_bpb) from None
        if self.trial.should_prune():
            raise StopRun("PRUNED", f"pruned at checkpoint {k} ({progress:.0%} of the budget, "
                                    f"val_bpb {val_bpb:.4f})", value=val_bpb)

    def on_end(self, summary: dict, status: str, error: str | None) -> None:
        with contextlib.suppress(UpdateFinishedTrialError):
            self.trial.set_user_attr("budget_fraction", round(self.run.clock.progress, 4))
