"""The budget clock: what is charged, what is forgiven, and the progress schedules read."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from frontier.config import BudgetConfig


class BudgetClock:
    """Charges the wall-clock time of training steps only.

    The first `excluded_steps` steps (compilation, cache warm-up) are forgiven up to
    `startup_cap_seconds`; anything beyond the cap is charged. Time outside `step()` —
    evaluation, logging, checkpoint writing — is never charged. The device is synchronised
    before each clock read so queued work is counted in the step that queued it.
    """

    def __init__(self, cfg: BudgetConfig, synchronize: Callable[[], None] = lambda: None,
                 slowest: Callable[[float], float] = lambda seconds: seconds):
        self.cfg = cfg
        self.synchronize = synchronize
        self.slowest = slowest  # across data-parallel ranks: all charge the slowest rank's time
        self.steps = 0
        self.charged = 0.0
        self.excluded = 0.0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.synchronize()
        start = time.perf_counter()
        yield
        self.synchronize()
        self.add_step(self.slowest(time.perf_counter() - start))

    def add_step(self, seconds: float) -> None:
        self.steps += 1
        if self.steps <= self.cfg.excluded_steps:
            forgiven = min(seconds, self.cfg.startup_cap_seconds - self.excluded)
            self.excluded += forgiven
            self.charged += seconds - forgiven
        else:
            self.charged += seconds

    @property
    def progress(self) -> float:
        """Fraction of the budget used: charged/seconds, or steps/max_steps when that is set."""
        if self.cfg.max_steps is not None:
            return min(self.steps / self.cfg.max_steps, 1.0)
        return min(self.charged / self.cfg.seconds, 1.0)

    @property
    def done(self) -> bool:
        if self.cfg.max_steps is not None and self.steps >= self.cfg.max_steps:
            return True
        return self.charged >= self.cfg.seconds

    @property
    def seconds_left(self) -> float:
        return max(self.cfg.seconds - self.charged, 0.0)

    def state_dict(self) -> dict:
        return {"steps": self.steps, "charged": self.charged, "excluded": self.excluded}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.charged, self.excluded = state["steps"], state["charged"], state["excluded"]
