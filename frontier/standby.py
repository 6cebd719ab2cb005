"""`python -m frontier.standby`: a sweep trial's process, started before its trial is known.

The sweep driver starts one per worker while that worker's trial trains, so the next trial does not
pay Python's start and the imports of torch, Hydra, Optuna and (given `--tracked`) MLflow again. It
imports them, then waits for one line on its standard input: `{"argv": [...], "log": PATH}`, the
trial's command line and its output.log. It then runs exactly what `python -m frontier.train ARGV >
PATH 2>&1` runs, in this process (a fresh one for every trial, so no state passes between trials).
End of input before that line (the sweep ended, or its driver died) ends it at once, with nothing
written.
"""
from __future__ import annotations

import json
import os
import runpy
import sys


def wait_for_trial(tracked: bool) -> dict | None:
    import frontier.train  # noqa: F401  Hydra and the command line
    import frontier.trainer  # noqa: F401  torch and the model
    if tracked:  # an untracked trial never loads MLflow (a second and more of CPU)
        import frontier.mlflow_observer  # noqa: F401
    import frontier.trial  # noqa: F401  Optuna

    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else None


def run_trial(order: dict) -> None:
    from frontier import timing

    timing.restart()  # the trial's start-up counts from here, not from this process's start
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    nothing = os.open(os.devnull, os.O_RDONLY)  # as the driver's own trial processes: no input
    os.dup2(nothing, 0)
    os.close(nothing)
    sys.argv = ["frontier.train", *order["argv"]]
    runpy.run_module("frontier.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    order = wait_for_trial("--tracked" in sys.argv[1:])
    if order is not None:
        run_trial(order)
