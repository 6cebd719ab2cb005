"""The budget clock: what is charged, what is forgiven, and the progress schedules read."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from frontier.config import BudgetConfig


class BudgetClock:
    """Charges the wall-clock time of training steps only.

    Each process launch (the first one, and every `resume=`) forgives its own first
    `excluded_steps` steps (compilation, cache warm-up) up to `startup_cap_seconds`; anything beyond
    the cap is charged. Time outside `step()` — evaluation, logging, checkpoint writing — is never
    charged. The device is synchronised before each clock read so queued work is counted in the
    step that queued it.

    Throughput counts charged tokens over charged time: a step whose time is only partly charged
    (the cap ran out during it) counts the same fraction of its tokens. The process's CPU time in
    charged steps is kept beside it (`charged_cpu`): on a CPU, MFU is taken per CPU-second, which a
    busy neighbour does not change.
    """

    def __init__(self, cfg: BudgetConfig, synchronize: Callable[[], None] = lambda: None,
                 slowest: Callable[[float], float] = lambda seconds: seconds):
        self.cfg = cfg
        self.synchronize = synchronize
        self.slowest = slowest  # across data-parallel ranks: all charge the slowest rank's time
        self.steps = 0
        self.charged = 0.0
        self.charged_tokens = 0.0
        self.charged_cpu = 0.0  # CPU seconds of this process's threads in charged steps
        self.earlier_launches: list[float] = []  # excluded seconds of each earlier launch
        self.launch_steps = 0  # steps taken by this process launch
        self.launch_charged = 0.0
        self.launch_excluded = 0.0

    @contextlib.contextmanager
    def step(self, tokens: int = 0) -> Iterator[None]:
        self.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        yield
        self.synchronize()
        self.add_step(self.slowest(time.perf_counter() - start), tokens, time.process_time() - cpu)

    def add_step(self, seconds: float, tokens: int = 0, cpu_seconds: float = 0.0) -> None:
        self.steps += 1
        self.launch_steps += 1
        forgiven = 0.0
        if self.launch_steps <= self.cfg.excluded_steps:
            forgiven = max(min(seconds, self.cfg.startup_cap_seconds - self.launch_excluded), 0.0)
            self.launch_excluded += forgiven
        self.charged += seconds - forgiven
        self.launch_charged += seconds - forgiven
        if seconds > 0:
            self.charged_tokens += tokens * (seconds - forgiven) / seconds
            self.charged_cpu += cpu_seconds * (seconds - forgiven) / seconds

    @property
    def excluded(self) -> float:
        return sum(self.excluded_per_launch)

    @property
    def excluded_per_launch(self) -> list[float]:
        return [*self.earlier_launches, self.launch_excluded]

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
        return {"steps": self.steps, "charged": self.charged, "charged_tokens": self.charged_tokens,
                "charged_cpu": self.charged_cpu, "excluded_per_launch": self.excluded_per_launch}

    def load_state_dict(self, state: dict) -> None:
        """Continues a saved clock in a new launch, which gets its own forgiven start-up steps."""
        self.steps, self.charged = state["steps"], state["charged"]
        self.charged_tokens = state["charged_tokens"]
        self.charged_cpu = state.get("charged_cpu", 0.0)  # absent from a resume.pt of an earlier version
        self.earlier_launches = list(state["excluded_per_launch"])
        self.launch_steps, self.launch_charged, self.launch_excluded = 0, 0.0, 0.0
