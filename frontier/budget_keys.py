"""The checks of a sweep's budget keys: `sweep.budgets` (frontier/shapes.py), `sweep.ladder` and
`sweep.promote` (frontier/ladder.py). frontier/config.py's SweepConfig calls them with its `_require`;
frontier/config_reference.py reads their allowed ranges from here as from config.py.
"""
from __future__ import annotations


def check(sweep, _require) -> None:
    """A SweepConfig's budget keys, each refused through `_require` (frontier/config.py's)."""
    if sweep.budgets is not None:
        _require(len(sweep.budgets) >= 1 and all(b > 0 for b in sweep.budgets)
                 and len(set(sweep.budgets)) == len(sweep.budgets), "sweep.budgets", list(sweep.budgets),
                 "distinct positive seconds, e.g. [60, 240], or null for budget.seconds")
        _require(len(sweep.budgets) == 1 or sweep.pruner == "none", "sweep.pruner", sweep.pruner,
                 f"none with several sweep.budgets={list(sweep.budgets)}: a pruner compares trials at equal "
                 "fractions of their budgets, which are not equal wall-clock across budgets")
    _require(0 < sweep.promote < 1, "sweep.promote", sweep.promote,
             "the share of a rung's finished configurations that climbs, between 0 and 1 (e.g. 0.333)")
    if sweep.ladder is None:
        return
    rungs = list(sweep.ladder)
    _require(len(rungs) >= 2 and all(r > 0 for r in rungs) and all(a < b for a, b in zip(rungs, rungs[1:])),
             "sweep.ladder", rungs, "at least two increasing positive budgets in seconds, e.g. [30, 120, 480], "
             "or null for no ladder")
    _require(sweep.budgets is None, "sweep.budgets", list(sweep.budgets or []),
             f"null with sweep.ladder={rungs}: the ladder sets each trial's budget")
    _require(sweep.frontier is None, "sweep.ladder", rungs,
             "null in a frontier sweep, whose shapes each train every budget of sweep.budgets")
    _require(sweep.pruner == "none", "sweep.pruner", sweep.pruner,
             f"none with sweep.ladder={rungs}: a pruner compares trials at equal fractions of their budgets, "
             "which mixes the ladder's rungs")
