"""One owner of a run's life: its state, its sinks, its run directory and its terminal writes.

A run is RUNNING until it ends FINISHED, FAILED, KILLED, PRUNED or COMPILED. Whatever ends it,
`Lifecycle.end` writes summary.json and then calls every sink's `on_end`, each write guarded so
that one that fails (a full disk, a dead tracking server) never skips another. The signals that stop
a run are deferred to a step boundary (frontier.stopping).

A run directory has one owner at a time: the process training in it holds an exclusive lock on its
run.lock, which the kernel drops however the process ends (kill -9 too). A second process that would
write into it is refused, and `python -m frontier.tracking sync` tells a run whose process died
before it could record its end from one still training.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from frontier.config import ConfigError
from frontier.observers import MetricsFile, notify
# the run's stops and writes, named here too: the trainer and the loader ask the run's owner for them
from frontier.files import RunWriteError, atomic_write, writing, write_json  # noqa: F401
from frontier.stopping import (NOT_STARTED, TERMINAL, Killed, _reset, closing, deferred_signals,  # noqa: F401
                               not_started, raise_if_stopped, recording_end, request_stop, signals_handled,
                               stop_requested)

LOCK_FILE = "run.lock"
# what a run leaves in its directory, which a new run there would write over or add its own records to
RUN_RECORDS = ("summary.json", "metrics.jsonl", "resume.pt", "final.pt")


# -----------------------------------------------------------------------------
# The run directory's owner: an flock, which the kernel releases when its process dies, however it dies


class Unlockable(Exception):
    """The run directory's filesystem takes no flock (some network mounts)."""


def _try_lock(run_dir: Path, create: bool) -> int | None:
    """An open descriptor holding RUN_DIR/run.lock exclusively; None while another process holds it.
    Raises OSError when the lock file cannot be opened (FileNotFoundError: it is not there and `create`
    is false), Unlockable when its filesystem cannot lock it."""
    flags = os.O_RDWR | os.O_CREAT if create else os.O_RDONLY  # flock needs no write access: sync reads
    fd = os.open(Path(run_dir) / LOCK_FILE, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as err:
        os.close(fd)
        raise Unlockable(err.strerror or str(err)) from None
    return fd


def in_use(run_dir: Path, key: str) -> ConfigError:
    lock = Path(run_dir) / LOCK_FILE
    return ConfigError(f"{key}={run_dir} is not allowed: another process is running the run there (it holds "
                       f"{lock}); wait for it to end, or stop it first")


def earlier_records(run_dir: Path) -> list[str]:
    """The records a run left in RUN_DIR (of RUN_RECORDS); none for a launch that stopped before it
    started (its summary.json alone, `not started: ...`), which a corrected command may take over."""
    found = [name for name in RUN_RECORDS if (Path(run_dir) / name).exists()]
    if found == ["summary.json"]:
        try:
            error = json.loads((Path(run_dir) / "summary.json").read_text()).get("error")
        except (OSError, ValueError, AttributeError):
            return found
        if isinstance(error, str) and error.startswith(NOT_STARTED):
            return []
    return found


def check_no_earlier_run(run_dir: Path, key: str) -> None:
    """Refuses a new run in a directory where another run left its records: the new one would write
    over its summary.json and final.pt, and add its own points to its metrics.jsonl."""
    found = earlier_records(run_dir)
    if found:
        raise ConfigError(f"{key}={run_dir} is not allowed: an earlier run left its records there "
                          f"({', '.join(found)}), which a new run would write over; give the new run a "
                          f"directory of its own (resume={run_dir} continues a stopped run)")


def own(run_dir: Path, key: str, new: bool = False) -> int | None:
    """Takes RUN_DIR/run.lock for this process until `disown`; a ConfigError naming `key` while another
    process holds it (a run still training there) or, for a `new` run, where an earlier run left its
    records. Where the filesystem cannot lock, the run goes on unguarded, with a warning (None)."""
    lock = Path(run_dir) / LOCK_FILE
    try:
        fd = _try_lock(run_dir, create=True)
    except Unlockable as err:
        print(f"warning: {lock} cannot be locked on this filesystem ({err}): a second process is not kept out "
              "of this run directory, and `frontier.tracking sync` cannot tell whether the run is alive",
              file=sys.stderr, flush=True)
        fd = None
    except OSError as err:
        raise ConfigError(f"{key}={run_dir} is not allowed: {lock} cannot be written ({err.strerror or err})") from None
    else:
        if fd is None:
            raise in_use(run_dir, key)
    if new:
        try:
            check_no_earlier_run(run_dir, key)
        except ConfigError:
            disown(fd)
            raise
    return fd


def disown(fd: int | None) -> None:
    """Releases run.lock: unlocked first, for a child process that may share the descriptor."""
    if fd is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        with contextlib.suppress(OSError):
            os.close(fd)


def check_not_running(run_dir: Path, key: str) -> None:
    """Refuses (as `own` would) a run directory whose run is still training, taking nothing."""
    with claimed(run_dir) as free:
        if free is False:
            raise in_use(run_dir, key)


@contextlib.contextmanager
def claimed(run_dir: Path) -> Iterator[bool | None]:
    """Holds RUN_DIR/run.lock while inside, when it can: yields True (no process is running the run, and
    none can start there meanwhile), False (a process is) or None (no run.lock: the run never got that
    far, an older version ran it, or its filesystem cannot lock)."""
    try:
        fd = _try_lock(run_dir, create=False)
    except (OSError, Unlockable):
        yield None
        return
    try:
        yield fd is not None
    finally:
        disown(fd)


# -----------------------------------------------------------------------------
# Sinks and terminal writes


@dataclass
class RunInfo:
    """What a sink may read when it is built, before any data is loaded (the protocol: frontier/observers.py)."""

    config: object  # frontier.config.Config
    raw: object  # the DictConfig
    run_dir: Path
    summary: dict = field(default_factory=dict)


def for_run(run) -> list:
    """The sinks a run's config asks for, metrics file first: every point is on disk before it is sent.

    A sink that cannot be built (its store is unreachable, a signal) refuses the launch; the stores
    opened before it (the MLflow run) hear it end FAILED or KILLED, so none is left RUNNING."""
    found = [MetricsFile.for_run(run)]  # drops what a killed launch logged after its resume point
    try:
        if run.config.tracking.enabled:
            from frontier.mlflow_observer import MlflowObserver

            found.append(MlflowObserver.for_run(run))
        if run.config.trial.number is not None:
            from frontier.trial import TrialReporter

            found.append(TrialReporter.for_run(run))
        if "resume_step" in run.summary:
            # Running again: the summary.json of the launch that stopped no longer describes the run, and
            # `sync` would end it by that file (a live run KILLED, a kill -9 named as that launch's SIGTERM).
            with contextlib.suppress(OSError):  # a directory that cannot be written fails the run's own writes
                (run.run_dir / "summary.json").unlink(missing_ok=True)
    except BaseException as err:
        status, error = not_started(err)
        with recording_end():
            notify(found[1:], "on_end", {**run.summary, "status": status}, status, error)
        raise
    return found




def record_not_started(run_dir: Path, summary: dict, err: BaseException) -> None:
    """summary.json of a new run that ended before its sinks were all built (a signal, a store that
    failed): the run directory says how it ended, as for every other end. Best effort: the error
    that stopped it is what the caller reports."""
    status, error = not_started(err)
    with recording_end(), contextlib.suppress(RunWriteError):
        write_json(Path(run_dir) / "summary.json", {**summary, "status": status, "error": error})


def record_stopped_in_prepare(run_dir: Path, err: BaseException) -> None:
    """summary.json of a new run that a signal stopped before it owned its directory (`prepare`),
    written as `record_not_started` does, only where no process runs a run and none has recorded one
    there, and by rank 0 alone."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        fd = _try_lock(run_dir, create=True)
    except (OSError, Unlockable):  # no directory yet, or one that cannot be written or locked
        return
    try:
        if fd is not None and not (Path(run_dir) / "summary.json").exists():
            record_not_started(run_dir, {}, err)
    finally:
        disown(fd)


class Lifecycle:
    """A run's state and its sinks (on rank 0 only; other ranks have none and write nothing)."""

    def __init__(self, info: RunInfo, is_main: bool = True):
        self.info = info
        self.is_main = is_main
        self.status = "RUNNING"
        self.sinks = for_run(info) if is_main else []  # an unreachable store fails here, in seconds

    def notify(self, event: str, *args) -> None:
        notify(self.sinks, event, *args)

    def end(self, status: str, error: str | None) -> None:
        """The one terminal write: summary.json, then every sink's on_end, each guarded.
        Raises RunWriteError afterwards when summary.json could not be written."""
        assert status in TERMINAL, status
        closing()
        self.status = status
        summary = self.info.summary
        summary["status"] = status
        summary["error"] = error
        clean_numbers(summary)
        failed = None
        if self.is_main:
            try:
                write_json(self.info.run_dir / "summary.json", summary)
            except RunWriteError as err:
                failed = err
            notify(self.sinks, "on_end", summary, status, error)
        if failed is not None:  # the run's own failure (a resume.pt the full disk refused) comes first
            raise RunWriteError(f"{error} (and {failed})") if status == "FAILED" and error else failed


def clean_numbers(summary: dict) -> None:
    """NaN and infinities are not JSON: they become null."""
    for key, value in summary.items():
        if isinstance(value, float) and not math.isfinite(value):
            summary[key] = None

