"""The Optuna study shared by the sweep driver (hydra_plugins/frontier_sweeper) and its trials
(frontier/trial.py): storages, the cross-process ask lock, the pruner, how a trial's run maps to
its final Optuna state, and who supervises whom.

A trial's final state has one source of truth: the trial's own process tells the study when its
run ends. A driver tells it only for a trial whose process ended without telling (killed, or
crashed before it could), and then from the same summary.json, so Optuna and the run never disagree.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import socket
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import optuna
from filelock import FileLock
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage, JournalStorage, RDBStorage
from optuna.storages._heartbeat import BaseHeartbeat
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import get_lock_file
from optuna.trial import FrozenTrial, TrialState

from frontier import paths, timing

STALE_REASON = "its process stopped sending heartbeats (killed, or its machine went away)"
DRIVER_ENV = "FRONTIER_SWEEP_DRIVER"  # "host:pid:start" of the driver that launched this trial


def study_storage(spec: str | None, study_name: str) -> str:
    """`sweep.storage` as every process opens it: by default a journal file that every process on
    this machine (or on a shared disk) can append to; a relative path is taken from home."""
    return paths.store_under_home(spec or f"mlruns/sweeps/{study_name}.journal")


def is_rdb(spec: str) -> bool:
    return "://" in spec


def safe_storage(spec: str) -> str:
    """The storage URL without its password, for logs, MLflow and error messages (where the URL
    may be malformed: then whatever stands between :// and @ is hidden)."""
    if not is_rdb(spec):
        return spec
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(spec).render_as_string(hide_password=True)
    except ArgumentError:
        return re.sub(r"://[^@/]*@", "://***@", spec)


class JournalFile(JournalFileBackend):
    """Optuna's journal file, created when opened but never by a write: a journal deleted under a
    running sweep is an error, not a new file holding only the records written after it.

    A write that fails part way (a full disk) is taken back, and a record a killed process left
    half-written is cut off before the next write: Optuna skips such a tail while it is the last line,
    but a record appended to it would make one line that is not JSON, and the whole study unreadable."""

    def append_logs(self, logs: list[dict]) -> None:
        text = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode()
        with get_lock_file(self._lock):
            fd = os.open(self._file_path, os.O_RDWR | os.O_APPEND)  # no O_CREAT
            try:
                end = _whole_records_end(fd)
                if end != os.fstat(fd).st_size:
                    os.ftruncate(fd, end)
                try:
                    written = memoryview(text)
                    while written:
                        written = written[os.write(fd, written):]
                    os.fsync(fd)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, end)
                    raise
            finally:
                os.close(fd)


def damaged_journal(spec: str) -> str | None:
    """Why the journal file `spec` cannot hold a study (None if it is one, or not there yet): a whole
    line that is not a record, in a file that is not a journal or was damaged. A half-written last
    record is not damage: the next write cuts it off."""
    path = Path(spec).expanduser()
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                return None
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "op_code" not in record:
                return f"its line {number} is not an Optuna journal record (a file that is not a journal, or one damaged)"
    return None


def _whole_records_end(fd: int, chunk: int = 1 << 16) -> int:
    """Where the journal's last whole record (its last newline) ends."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - chunk)
        block = os.pread(fd, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


class HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
    """A journal file storage with the heartbeat Optuna implements only for RDB storages: the
    process running a trial stamps it every `interval` seconds, so that a RUNNING trial whose
    process died can be told apart from one still running."""

    def __init__(self, path: str, interval: int | None = None, grace_period: int | None = None):
        super().__init__(JournalFile(path))
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


class HeartbeatRDBStorage(RDBStorage):
    """Optuna's RDB storage, where a RUNNING trial that never sent a heartbeat is stale once
    `grace_period` has passed since it was created, as in HeartbeatJournalStorage. Optuna skips such a
    trial, so a driver killed between creating a trial and launching it would leave it RUNNING for good."""

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        from optuna.storages._rdb.models import TrialHeartbeatModel as Beat
        from optuna.storages._rdb.models import TrialModel as Trial

        stale = super()._get_stale_trial_ids(study_id)
        grace = self.grace_period or 2 * self.heartbeat_interval
        session = self.scoped_session()
        try:
            silent = [trial_id for (trial_id,) in session.query(Trial.trial_id)
                      .outerjoin(Beat, Beat.trial_id == Trial.trial_id)
                      .filter(Trial.study_id == study_id, Trial.state == TrialState.RUNNING, Beat.trial_id.is_(None))]
        finally:
            session.close()
        now = time.time()
        return stale + [trial_id for trial_id in silent
                        if now - self.get_trial(trial_id).datetime_start.timestamp() > grace]


def open_storage(spec: str, heartbeat_interval: int | None = None,
                 grace_period: int | None = None, create: bool = True) -> BaseStorage:
    """An RDB URL (postgresql://..., sqlite:///...) or the path of a journal file (`create=False`: one
    that must exist, as a trial's does; a missing one is FileNotFoundError)."""
    if is_rdb(spec):
        with warnings.catch_warnings():  # heartbeat_interval is "experimental" in Optuna 5
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return HeartbeatRDBStorage(paths.database_url(spec), engine_kwargs={"pool_pre_ping": True},
                              heartbeat_interval=heartbeat_interval, grace_period=grace_period)
    path = Path(spec).expanduser().resolve()
    if not create and not path.is_file():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    return HeartbeatJournalStorage(str(path), heartbeat_interval, grace_period)


@contextlib.contextmanager
def ask_lock(spec: str, storage: BaseStorage, study_name: str):
    """Serialises "count the study's trials, then create one" (and the drivers' bookkeeping) across
    processes and machines, so that n_trials is exact however many drivers share the study.
    `storage`: what open_storage(spec) returned, not a study's `_storage` (Optuna wraps an RDB in a cache)."""
    if not is_rdb(spec):
        with FileLock(str(Path(spec).expanduser().resolve()) + ".ask.lock"):  # .lock is the journal's own
            yield
        return
    if not isinstance(storage, RDBStorage):  # a lock silently not taken would let two drivers race
        raise TypeError(f"ask_lock needs the RDBStorage of {safe_storage(spec)}, not a {type(storage).__name__}")
    dialect = storage.engine.dialect.name
    if dialect == "postgresql":
        from sqlalchemy import text

        key = {"key": zlib.crc32(study_name.encode())}
        with storage.engine.connect() as conn:
            conn.execute(text("SELECT pg_advisory_lock(:key)"), key)
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), key)
    elif dialect == "sqlite":
        with FileLock(str(storage.engine.url.database) + ".ask.lock"):
            yield
    else:  # other databases: workers on one machine are serialised by the sweeper itself
        yield


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


def trial_seed(seed: int | None, number: int) -> int | None:
    """The sampler's seed for trial `number`: distinct for every trial of a study, whichever driver
    asks for it, and the same each time the same study is run from scratch."""
    return None if seed is None else zlib.crc32(f"{seed}:{number}".encode())


# -- a trial's end ------------------------------------------------------------------------------


# where a trial's wall time went (frontier/timing.py): the sweep report accounts the sweep's from them
TIME_KEYS = ("wall_seconds", "training_share", *(f"time_{part}_seconds" for part in timing.PARTS))


def outcome(summary: dict, reason: str, objective: dict | None = None,
            val_fingerprint: str | None = None) -> tuple[TrialState, float | list | None, dict]:
    """A trial's Optuna state, value and user attributes from its run's summary (summary.json);
    `reason` says why it failed where the summary does not (no summary, a process killed).
    `objective`, the study's user attribute, says which value(s) a finished run gives (a list of
    two for sweep.objective=pareto; see hydra_plugins/frontier_sweeper/_objective.py).
    `val_fingerprint`, the study's, is the validation set its trials are scored on: a run scored on
    another fails, unranked (its val_bpb does not compare)."""
    from hydra_plugins.frontier_sweeper._objective import trial_values

    status = summary.get("status")
    values, why = trial_values(objective, summary)
    if values is not None and val_fingerprint and summary.get("val_fingerprint") != val_fingerprint:
        values, why = None, (f"scored on another validation set (val_fingerprint {summary.get('val_fingerprint')}, "
                             f"the study's is {val_fingerprint}: another model.seq_len, tokenizer, data or "
                             "eval.final_tokens), so its val_bpb does not compare with the study's trials")
    attrs = {"status": status}
    attrs.update({key: summary[key] for key in ("charged_seconds", "steps", "tokens_seen", "val_tokens", "params",
                                                "tokens_per_second", "val_fingerprint", "val_documents",
                                                *TIME_KEYS)
                  if key in summary})
    attrs.update({key: summary[key] for key in ("val_bpb", "val_bpb_se", "core")
                  if isinstance(summary.get(key), (int, float)) and math.isfinite(summary[key])})
    if status == "FINISHED" and values is not None:
        return TrialState.COMPLETE, values[0] if len(values) == 1 else values, attrs
    if status == "FINISHED":
        reason = why
    if status == "PRUNED":
        return TrialState.PRUNED, None, {**attrs, "prune_reason": summary.get("error") or "pruned"}
    return TrialState.FAIL, None, {**attrs, "fail_reason": summary.get("error") or reason}


def end_trial(study: optuna.Study, trial_id: int, state: TrialState, value: float | None,
              attrs: dict) -> bool:
    """Records a trial's end: its attributes, then its state. False when it had already ended (the
    first to tell wins, and a finished trial takes no more attributes)."""
    storage = study._storage
    try:
        for key, attr in attrs.items():
            storage.set_trial_user_attr(trial_id, key, attr)
        if state == TrialState.PRUNED:  # as Study.tell: a pruned trial's value is its last report
            last = storage.get_trial(trial_id).last_step
            value = storage.get_trial(trial_id).intermediate_values[last] if last is not None else None
        values = None if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
        return storage.set_trial_state_values(trial_id, state, values)
    except UpdateFinishedTrialError:
        return False


def read_summary(run_dir: str | Path | None) -> dict:
    path = Path(run_dir) / "summary.json" if run_dir else None
    try:
        return json.loads(path.read_text()) if path else {}
    except (OSError, ValueError):
        return {}


# -- who supervises whom -------------------------------------------------------------------------


def process_start(pid: int) -> str | None:
    """When process `pid` started (ticks since boot, so a reused pid is told apart); "" where
    /proc is missing and only its existence can be checked; None when it is gone (or a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    return None if fields[0] in ("Z", "X") else fields[19]  # field 3 is the state, field 22 starttime


@dataclass(frozen=True)
class Process:
    """A process on a machine, told apart from a later one reusing its pid."""

    host: str
    pid: int
    start: str

    @classmethod
    def this(cls, pid: int | None = None) -> "Process":
        pid = pid or os.getpid()
        return cls(socket.gethostname(), pid, process_start(pid) or "")

    @classmethod
    def parse(cls, text: str | None) -> "Process | None":
        if not text:
            return None
        host, pid, start = text.rsplit(":", 2)
        return cls(host, int(pid), start)

    def __str__(self) -> str:
        return f"{self.host}:{self.pid}:{self.start}"

    def alive(self) -> bool | None:
        """Whether it still runs; None when it runs on another machine (ask its heartbeat)."""
        if self.host != socket.gethostname():
            return None
        start = process_start(self.pid)
        return start is not None and (start == self.start or not self.start)


def driver_key(driver: Process) -> str:
    return f"driver:{driver}"


def record_driver(study: optuna.Study, driver: Process, ended: bool = False) -> None:
    """A driver's heartbeat in the study, for trials and drivers on other machines."""
    study._storage.set_study_system_attr(study._study_id, driver_key(driver),
                                         {"heartbeat": time.time(), "ended": ended})


def driver_alive(study: optuna.Study, driver: Process, grace_period: float) -> bool:
    alive = driver.alive()
    if alive is not None:
        return alive
    record = study._storage.get_study_system_attrs(study._study_id).get(driver_key(driver), {})
    return not record.get("ended", True) and time.time() - record.get("heartbeat", 0) < grace_period


def live_drivers(study: optuna.Study, grace_period: float) -> list[Process]:
    """The drivers of the study that have not ended and still run (or, elsewhere, still beat)."""
    found = []
    for key, record in study._storage.get_study_system_attrs(study._study_id).items():
        if not key.startswith("driver:") or record.get("ended"):
            continue
        driver = Process.parse(key[len("driver:"):])
        alive = driver.alive()
        if alive or (alive is None and time.time() - record.get("heartbeat", 0) < grace_period):
            found.append(driver)
    return found


def all_drivers_ended(study: optuna.Study) -> bool:
    """Every driver that ran the study has ended: it recorded its end, or it is gone without one (a
    kill -9: on this machine its pid has exited, elsewhere it has not beaten for the study's
    `grace_period`)."""
    return not live_drivers(study, study.user_attrs.get("grace_period", 120))


def settle_orphans(study: optuna.Study, skip: set[int] = frozenset()) -> list[FrozenTrial]:
    """Ends every RUNNING trial whose process is gone without telling the study: on this machine
    its pid has exited (or its driver's, before the trial's process was recorded), elsewhere its
    heartbeat stopped. A trial whose run finished (summary.json) keeps its result; any other is FAIL
    with why. `skip`: trial ids the caller itself supervises.
    Returns the trials ended here."""
    storage = study._storage
    stale = set()
    if isinstance(storage, BaseHeartbeat) and storage.get_heartbeat_interval() is not None:
        stale = set(storage._get_stale_trial_ids(study._study_id))
    settled = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        process = Process.parse(trial.user_attrs.get("process"))
        gone = process is not None and process.alive() is False
        # a driver gone between starting a trial and recording its process: a process of its own
        # would have seen its driver gone and stopped (a launcher's job elsewhere waits for its heartbeat)
        driver = Process.parse(trial.user_attrs.get("driver"))
        unstarted = (process is None and not trial.user_attrs.get("launched") and driver is not None
                     and driver.alive() is False)
        if trial._trial_id in skip or (not gone and not unstarted and trial._trial_id not in stale):
            continue
        reason = ("its process exited without a result" if gone else
                  "its driver exited as it started the trial" if unstarted else STALE_REASON)
        state, value, attrs = outcome(read_summary(trial.user_attrs.get("run_dir")), reason,
                                      study.user_attrs.get("objective"), study.user_attrs.get("val_fingerprint"))
        if end_trial(study, trial._trial_id, state, value, attrs):
            settled.append(storage.get_trial(trial._trial_id))
    return settled
