"""Search spaces in Hydra's sweep syntax, as hydra-optuna-sweeper's `params:` reads them.

  choice(a, b, c)              -> categorical (also the command line's a,b,c)
  range(lo, hi, step)          -> integers (or floats) lo, lo+step, ... below hi, as Python's range
  interval(lo, hi)             -> uniform float (int(interval(...)) for integers)
  tag(log, interval(lo, hi))   -> log-uniform
  a plain value                -> passed unchanged to every trial
"""
from __future__ import annotations

import warnings
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Glob, Override, Transformer
from hydra.errors import HydraException
from optuna.distributions import (BaseDistribution, CategoricalDistribution, FloatDistribution,
                                  IntDistribution)

from frontier.config import ConfigError, error_line

ALLOWED = "use choice(...), range(...), interval(...) or tag(log, interval(...))"


def distribution(override: Override) -> BaseDistribution:
    value = override.value()
    if isinstance(value, Glob):  # glob(*) lists config group options; a search space names them
        raise ValueError("glob(...) is not a search space: name the options with choice(...)")
    unknown = sorted(set(value.tags) - {"log"})
    if unknown:  # a misspelt log would otherwise sample the interval uniformly
        raise ValueError(f"unknown tag {', '.join(map(repr, unknown))}; the one tag is log, on an interval")
    if value.tags and not override.is_interval_sweep():
        raise ValueError("tag(log, ...) applies to an interval only")
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        with warnings.catch_warnings():
            # List choices (e.g. model.value_embed_layers) are JSON, which every Optuna storage keeps.
            warnings.filterwarnings("ignore", message="Choices for a categorical distribution")
            return CategoricalDistribution(list(override.sweep_iterator()))
    if override.is_range_sweep():
        values = list(override.sweep_iterator())
        if not values:
            raise ValueError("the range holds no values")
        # Optuna's step must be positive: a descending range is the same values counted up from its last
        last = values[0] + value.step * (len(values) - 1)  # not values[-1]: float steps accumulate errors
        if all(isinstance(v, int) for v in values):
            return IntDistribution(min(values[0], last), max(values[0], last), step=abs(value.step))
        low, high = sorted((values[0], round(last, 12)))
        return FloatDistribution(low, high, step=abs(value.step))
    if override.is_interval_sweep():
        if value.start >= value.end:  # Optuna would sample the one value of interval(5, 5) without a word
            raise ValueError(f"an interval from {value.start} to {value.end} holds "
                             f"{'one value' if value.start == value.end else 'no values'} (int(...) truncates "
                             "its bounds): give a plain value, or a low bound below the high one")
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(value.start, value.end, log=log)
    raise ValueError(f"{type(value).__name__} is not supported")


def parse(params: dict[str, str], arguments: list[str]) -> tuple[dict[str, BaseDistribution], list[str],
                                                                dict[str, str]]:
    """The search space, the overrides every trial gets, and each space key as the user wrote it (for
    errors). `params` come from the preset; `arguments` are the command line's: its sweeps
    (model=base,wide) join the space, its plain values are passed on, and `sweep=...` / `sweep.*`
    only configure the sweeper."""
    parser = OverridesParser.create()
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}  # key -> the override as written
    written: dict[str, str] = {}  # space key -> where and how it was written
    # (what to call it in an error, the override line)
    lines = [(f"sweep.params.{key}={expr!r}", f"{key}={expr}") for key, expr in params.items()]
    lines += [(repr(arg), arg) for arg in arguments]
    for name, line in lines:
        try:
            override = parser.parse_override(line)
        except HydraException as err:
            raise ConfigError(f"{name} is not a valid search-space expression "
                              f"({error_line(err, named=False)}): {ALLOWED}") from None
        key = override.get_key_element()
        if override.key_or_group == "sweep" or override.key_or_group.startswith("sweep."):
            continue
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            try:
                space[key] = distribution(override)
            except (ValueError, HydraException) as err:
                raise ConfigError(f"{name} is not a valid search space ({err}): {ALLOWED}") from None
            written[key] = name
        else:
            fixed[key] = line
    return space, list(fixed.values()), {key: written[key] for key in space}


def as_override(key: str, value: Any) -> str:
    return f"{key}={Transformer.str(value)}"


def grid_values(space: dict[str, BaseDistribution]) -> dict[str, list]:
    """The grid sampler's search space: every value of each discrete parameter."""
    grid = {}
    for key, dist in space.items():
        if isinstance(dist, CategoricalDistribution):
            grid[key] = list(dist.choices)
        elif isinstance(dist, (IntDistribution, FloatDistribution)) and dist.step is not None and not dist.log:
            count = round((dist.high - dist.low) / dist.step) + 1
            grid[key] = [dist.low + i * dist.step if isinstance(dist, IntDistribution)
                         else round(dist.low + i * dist.step, 12) for i in range(count)]
        else:
            raise ConfigError(f"sweep.params.{key}={dist} is not allowed with sweep.sampler='grid': "
                              "give it choice(...) or range(...) values")
    return grid
