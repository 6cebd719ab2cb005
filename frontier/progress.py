"""What a person sees: a live bar over the budget, checkpoint lines, and a final table."""
from __future__ import annotations

import math

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text


class RunDisplay:
    def __init__(self, enabled: bool = True, console: Console | None = None, quiet: bool = False):
        self.console = console or Console(stderr=True, quiet=quiet)  # quiet: ranks other than 0
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]budget"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
            TextColumn("{task.fields[status]}"), console=self.console, transient=False,
            disable=not enabled,
        )
        self.task = self.progress.add_task("budget", total=1.0, status="starting")

    def __enter__(self) -> "RunDisplay":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def update(self, progress: float, metrics: dict, seconds_left: float) -> None:
        rate = f"{metrics['tokens_per_second']:,.0f} tok/s | " if "tokens_per_second" in metrics else ""
        status = f"loss {metrics['train/loss']:.4f} | {rate}{seconds_left:,.0f} s left"
        self.progress.update(self.task, completed=progress, status=status)

    def note(self, line: str) -> None:
        self.console.print(line, markup=False)  # a path or an error may hold [brackets], which are not markup

    def table(self, summary: dict) -> None:
        table = Table(title="run summary", show_header=False)
        for key in ("status", "val_bpb", "params", "flops_per_token", "steps", "tokens_seen",
                    "tokens_per_second", "mfu", "charged_seconds", "excluded_seconds",
                    "budget_utilization", "wall_seconds", "training_share", "device", "error"):
            if key in summary and summary[key] is not None:
                table.add_row(key, Text(_fmt(summary[key])))  # plain text: gloo's errors start '[/path/pair.cc:553]'
        self.console.print(table)


def _fmt(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:,.4f}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
