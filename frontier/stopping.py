"""Deferred stops: a flag that signals or any thread set, which the training loop reads between steps.

While the training loop runs, SIGTERM or SIGINT only sets the flag, and the loop stops at the next
step boundary, where the model, optimizers, loader, clock and RNG all belong to the same step and
resume.pt can be written. A second signal within ABORT_WINDOW seconds aborts at once (without writing
resume.pt), except in a data-parallel rank, which a launcher can signal twice for one stop, and except
an echo of the first within ECHO_WINDOW. `request_stop` sets the same flag from any thread (e.g. a
sweep trial whose driver is gone). Below the sinks, which ask for stops; frontier.lifecycle owns the run.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from typing import Iterator

from frontier.config import error_line

ABORT_WINDOW = 5.0  # seconds: a second signal this soon after the first aborts at once
# seconds: a signal this soon after the first is the same stop delivered twice (GNU timeout and batch
# schedulers signal the process and then its whole process group), not a user asking to abort
ECHO_WINDOW = 0.25
NOT_STARTED = "not started: "  # the error of a launch that ended before its first step
TERMINAL = ("FINISHED", "FAILED", "KILLED", "PRUNED", "COMPILED")


class Killed(KeyboardInterrupt):
    """The run stopped because of a signal or `request_stop`; it is recorded KILLED."""


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
    it started): a signal inside waits for them, as after `closing`, so that a second Ctrl-C cannot cut
    them short and leave the MLflow run RUNNING. The stop it asks for stays asked (see raise_if_stopped)."""
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


def not_started(err: BaseException) -> tuple[str, str]:
    """The status and error of a launch that a signal or a failure stopped before its first step."""
    return "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED", f"{NOT_STARTED}{error_line(err)}"
