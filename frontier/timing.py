"""Where a run's wall-clock time goes, from its process's start to its end record.

  startup     process start (or, in a sweep's standby process, the moment it got its trial) to the
              first training step: imports, checks, data, model, the sinks' start
  excluded    forgiven steps (compilation, warm-up; budget.excluded_steps)
  charged     the budget's charged steps
  evaluation  periodic and final val_bpb, CORE
  checkpoint  writing resume.pt and final.pt
  idle        the rest: logging, the sinks, the run's end

The parts add up to `wall`; `training_share` is charged / wall, the share a user pays for training.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

PARTS = ("startup", "excluded", "charged", "evaluation", "checkpoint", "idle")


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc, to 10 ms), or None where that is unknown."""
    try:
        started = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])  # field 22, clock ticks
        uptime = float(open("/proc/uptime").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started / os.sysconf("SC_CLK_TCK"), 0.0)


_age = process_age()
_started = time.time() - (_age if _age is not None else 0.0)  # else: this module's import


def started() -> float:
    """When the work of this process began (time.time())."""
    return _started


def restart() -> None:
    """The process's work begins now: a standby process that waited for its trial counts from here."""
    global _started
    _started = time.time()


class TimeAccount:
    """Seconds spent in each part of a run, for this process's launch."""

    def __init__(self) -> None:
        self.seconds = {"startup": 0.0, "evaluation": 0.0, "checkpoint": 0.0}

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[part] += time.perf_counter() - begin

    def mark_startup(self) -> None:
        """The first training step begins now."""
        self.seconds["startup"] = time.time() - started()

    def summary(self, excluded: float, charged: float) -> dict:
        """`time_<part>_seconds` for each part, `wall_seconds` and `training_share`."""
        wall = time.time() - started()
        parts = {**self.seconds, "excluded": excluded, "charged": charged}
        parts["idle"] = max(wall - sum(parts.values()), 0.0)
        record = {f"time_{part}_seconds": parts[part] for part in PARTS}
        record.update(wall_seconds=wall, training_share=charged / wall if wall > 0 else 0.0)
        return record
