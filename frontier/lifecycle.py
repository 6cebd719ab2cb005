"""One owner of a run's life: its state, its sinks, the signals that stop it, and its terminal writes.

A run is RUNNING until it ends FINISHED, FAILED, KILLED, PRUNED or COMPILED. Whatever ends it,
`Lifecycle.end` writes summary.json and then calls every sink's `on_end`, each write guarded so
that one that fails (a full disk, a dead tracking server) never skips another.

Signals are deferred: while the training loop runs, SIGTERM or SIGINT only sets a flag, and the
loop stops at the next step boundary, where the model, optimizers, loader, clock and RNG all
belong to the same step and resume.pt can be written. A second signal within ABORT_WINDOW
seconds aborts at once (without writing resume.pt), except in a data-parallel rank, which a launcher
can signal twice for one stop, and except an echo of the first within ECHO_WINDOW. `request_stop` sets the same flag from any
thread (e.g. a sweep trial whose driver is gone).

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
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from frontier.config import ConfigError, error_line, raised_from
from frontier.observers import MetricsFile, notify

ABORT_WINDOW = 5.0  # seconds: a second signal this soon after the first aborts at once
# seconds: a signal this soon after the first is the same stop delivered twice (GNU timeout and batch
# schedulers signal the process and then its whole process group), not a user asking to abort
ECHO_WINDOW = 0.25
LOCK_FILE = "run.lock"
# what a run leaves in its directory, which a new run there would write over or add its own records to
RUN_RECORDS = ("summary.json", "metrics.jsonl", "resume.pt", "final.pt")
NOT_STARTED = "not started: "  # the error of a launch that ended before its first step
TERMINAL = ("FINISHED", "FAILED", "KILLED", "PRUNED", "COMPILED")


class Killed(KeyboardInterrupt):
    """The run stopped because of a signal or `request_stop`; it is recorded KILLED."""


class RunWriteError(Exception):
    """A file of the run (resume.pt, summary.json) could not be written: one sentence naming it."""


# -----------------------------------------------------------------------------
# Deferred stops: a flag set by signals or any thread, read by the loop between steps

_lock = threading.Lock()
_stop_reason: str | None = None
_first_signal_at = -math.inf
_deferring = False  # True while the training loop runs: signals wait for the step boundary
_ending = False  # True while the terminal records are written: signals can no longer stop anything
_handling = False  # True while _on_signal is installed (inside signals_handled)


def request_stop(reason: str) -> None:
    """Ends the run KILLED with `reason` (thread-safe): the training loop at its next step boundary;
    set-up or the final evaluation at once, as a signal would (there is no step to finish)."""
    global _stop_reason
    with _lock:
        first = _stop_reason is None
        if first:
            _stop_reason = reason
    if (first and _handling and not _deferring and not _ending
            and threading.current_thread() is not threading.main_thread()):
        os.kill(os.getpid(), signal.SIGTERM)  # only the main thread can be interrupted: through its handler


def stop_requested() -> str | None:
    return _stop_reason


def _reset() -> None:
    global _stop_reason, _first_signal_at, _deferring, _ending
    with _lock:
        _stop_reason, _first_signal_at, _deferring, _ending = None, -math.inf, False, False


def _on_signal(signum, frame) -> None:
    global _first_signal_at, _stop_reason
    name = signal.Signals(signum).name
    now = time.monotonic()
    if _ending:  # the records of the run's end are being written: let them finish
        with _lock:
            _stop_reason = _stop_reason or f"interrupted by {name}"
        print(f"{name}: the run is already ending; its records are being written", file=sys.stderr, flush=True)
        return
    if now - _first_signal_at < ECHO_WINDOW:
        return
    if not _deferring:  # setting up or finishing: nothing to save at a step boundary
        reason = _stop_reason = _stop_reason or f"interrupted by {name}"  # kept for raise_if_stopped
        _first_signal_at = now
        print(f"{reason}: stopping now (no training step to finish)", file=sys.stderr, flush=True)
        raise KeyboardInterrupt(reason)
    if _data_parallel():  # the launcher passes one stop on to every rank: a rank can get it twice at once
        if _first_signal_at == -math.inf:
            _first_signal_at = now
            request_stop(f"interrupted by {name}")
            print(f"{name}: stopping after this step", file=sys.stderr, flush=True)
        return
    if now - _first_signal_at < ABORT_WINDOW:
        print(f"second signal ({name}): aborting at once; resume.pt keeps the last saved checkpoint",
              file=sys.stderr, flush=True)
        raise KeyboardInterrupt(f"aborted by a second signal ({name})")
    _first_signal_at = now
    request_stop(f"interrupted by {name}")
    print(f"{name}: stopping after this step (send it again within {ABORT_WINDOW:g} s to abort at once)",
          file=sys.stderr, flush=True)


def _data_parallel() -> bool:
    """A rank of a torchrun job (as frontier.distributed.init_world reads it). A Ctrl-C reaches torchrun
    and its ranks, and torchrun passes it on again; it kills the ranks itself after its shutdown timeout."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def raise_if_stopped() -> None:
    """Raises again a stop that came outside the training loop. Python only prints a KeyboardInterrupt
    raised inside a weakref callback or a __del__ and goes on, which a signal during set-up can land
    in: set-up's long steps (each chunk of a cache build) and the loop's start call this."""
    reason = _stop_reason
    if reason is not None and _handling and not _deferring and not _ending:
        raise KeyboardInterrupt(reason)


def closing() -> None:
    """The run's end is being recorded: from here on a signal waits for those writes (see _on_signal)."""
    global _ending
    _ending = True


@contextlib.contextmanager
def recording_end() -> Iterator[None]:
    """Around the records of a launch that ends before `Lifecycle.end` can (one stopped or refused while
    it started): a signal inside waits for them, as after `closing`, where a second Ctrl-C had cut them
    short and left the MLflow run RUNNING. The stop it asks for stays asked (see raise_if_stopped)."""
    global _ending
    before, _ending = _ending, True
    try:
        yield
    finally:
        _ending = before


@contextlib.contextmanager
def signals_handled() -> Iterator[None]:
    """SIGTERM and SIGINT go through `_on_signal` for the duration of one train() call, each unless it
    is ignored: a shell starts a background job (`cmd &` in a script) with SIGINT ignored, so that a
    Ctrl-C meant for the foreground does not reach it, and it stays so for the whole run."""
    _reset()
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may install handlers; request_stop still works
        return
    global _handling
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    previous_hook, sys.unraisablehook = sys.unraisablehook, _unraisable_unless_stopped(sys.unraisablehook)
    _handling = True
    try:
        yield
    finally:
        _handling = False
        sys.unraisablehook = previous_hook
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _unraisable_unless_stopped(hook):
    """Python prints a traceback for a KeyboardInterrupt that `_on_signal` raised inside a weakref
    callback or a __del__, and goes on; that stop is not lost (raise_if_stopped raises it again), so
    it is not printed either."""
    def unraisable(info) -> None:
        if not (isinstance(info.exc_value, KeyboardInterrupt) and _stop_reason is not None):
            hook(info)

    return unraisable


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Inside: a signal only sets the stop flag (the training loop)."""
    global _deferring
    raise_if_stopped()  # a stop during set-up whose KeyboardInterrupt was swallowed trains no step
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


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
            from frontier.tracking import MlflowObserver

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


def not_started(err: BaseException) -> tuple[str, str]:
    """The status and error of a launch that a signal or a failure stopped before its first step."""
    return "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"{NOT_STARTED}{error_line(err)}"


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


def write_json(path: Path, content: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(content, indent=2, default=str, allow_nan=False)))


def atomic_write(path: Path, write) -> None:
    """`write(tmp)` then rename over `path`; on failure no .tmp is left and one sentence names the file."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)


@contextlib.contextmanager
def writing(path: Path, *temporaries: Path) -> Iterator[None]:
    """A failed write (full disk, unwritable folder) becomes RunWriteError naming `path`; whatever
    stops the write (a second signal too), the half-written `temporaries` are removed."""
    try:
        yield
    except BaseException as err:
        for tmp in temporaries:
            with contextlib.suppress(OSError):
                tmp.unlink()
        if not isinstance(err, (OSError, RuntimeError)):  # torch.save reports a failed write as a RuntimeError
            raise
        stop = interrupted_by(err)
        if stop is not None:  # a signal inside torch.save's write to the file: a stop, not a failed write
            raise stop
        raise RunWriteError(f"cannot write {path}: {write_failure(err)}") from None


def interrupted_by(err: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt an error was raised while handling: torch.save writing to a Python file turns
    one raised inside the file's write() into "[enforce fail ...] unexpected pos", which had ended a
    stopped run FAILED ("cannot write final.pt") rather than KILLED."""
    return next((cause for cause in raised_from(err) if isinstance(cause, KeyboardInterrupt)), None)


def write_failure(err: BaseException) -> str:
    """The OS's reason ("No space left on device") where the error or one it was raised from has one."""
    code = next((cause.errno for cause in raised_from(err) if isinstance(cause, OSError) and cause.errno), None)
    return os.strerror(code) if code else error_line(err, named=False)
