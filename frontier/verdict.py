"""Whether a sweep's best configuration is better than the defaults: the verdict of its confirmation.

After the search, the best configurations (the contenders) and the baseline (the defaults) train again
with new seeds (hydra_plugins/frontier_sweeper/_confirm.py). Each contender's difference from the
baseline, its mean val_bpb minus the baseline's (negative is better), gets a t interval:

- the seeds' noise is pooled over every configuration (they all train the same way at the same budget,
  only the seed differs), with degrees of freedom runs - configurations: at 3 seeds a configuration
  that gives the strict level below the power that Welch's 2 to 4 degrees of freedom lack;
- picking the best of m contenders and looking after each of the K blocks the plan allows
  (sweep.confirm ... sweep.confirm_max) are both paid for by Bonferroni: each interval is at level
  1 - alpha / (m K). It spends alpha / K at each look, so stopping at the first look that decides keeps
  the chance of any wrong call at most alpha.

The outcome, in this order:

- `equivalent`: the best contender's interval lies inside (-margin, +margin): no difference that
  matters, even where it is significant (a gain smaller than sweep.equivalence is not worth a change);
- `beats`: the best contender's interval lies wholly below 0;
- `keep_defaults`: every contender's interval lies wholly above 0;
- `unresolved`: anything else, with the seeds a configuration that would settle it at the measured noise.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

ALPHA = 0.05
BEATS, KEEP_DEFAULTS, EQUIVALENT, UNRESOLVED = "beats", "keep_defaults", "equivalent", "unresolved"
MOST_SEEDS = 100_000  # beyond this many seeds a configuration, "no number of seeds" is the honest answer


@dataclass(frozen=True)
class Comparison:
    """One contender against the baseline: difference = its mean - the baseline's, and its interval."""

    label: str
    n: int
    mean: float
    difference: float
    low: float
    high: float


@dataclass
class Verdict:
    outcome: str
    best: Comparison  # the contender with the lowest mean val_bpb
    comparisons: list[Comparison]  # every contender, best first
    baseline_mean: float
    noise: float  # the seeds' pooled standard deviation
    margin: float
    first_blocks: int
    max_blocks: int
    alpha: float
    sizes: list[int]  # the runs of each configuration, the baseline's first

    @property
    def looks(self) -> int:
        return self.max_blocks - self.first_blocks + 1

    @cached_property
    def seeds_needed(self) -> int | None:
        """Seeds a configuration that would settle an unresolved verdict if the noise and the difference
        stay as measured (with the looks a plan that long allows); None when no number would."""
        if self.outcome != UNRESOLVED:
            return None
        d, arms = abs(self.best.difference), len(self.sizes)

        def settles(n: int) -> bool:
            looks = max(n, self.max_blocks) - self.first_blocks + 1
            half = half_width(self.noise, n, n, arms * (n - 1), self.alpha / (len(self.comparisons) * looks))
            return half < d or d + half < self.margin

        low, high = max(self.sizes), max(self.sizes) + 1
        while not settles(high):  # the interval narrows as seeds are added: double, then bisect
            if high > MOST_SEEDS:
                return None
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if settles(middle) else (middle, high)
        return high

    @property
    def text(self) -> str:
        """The verdict in one line: the report's headline, the sweep's last log line, MLflow's tag."""
        best, interval = self.best, self.interval_text(self.best)
        size = f"{abs(best.difference):.4f}"
        apart = ("level with the defaults" if float(size) == 0 else
                 f"{size} {'better' if best.difference < 0 else 'worse'} than the defaults")
        if self.outcome == BEATS:
            return f"use {best.label}: it beats the defaults, {size} better ({interval})"
        if self.outcome == KEEP_DEFAULTS:
            return (f"keep the defaults: every configuration the search found is worse; the best, {best.label}, is "
                    f"{size} worse ({interval})")
        if self.outcome == EQUIVALENT:
            return (f"no difference that matters, keep the defaults: the best, {best.label}, is {apart}, within "
                    f"sweep.equivalence={self.margin:g} ({interval})")
        seeds = self.seeds_needed
        how = ("no number of seeds would settle it" if seeds is None else
               f"about {seeds} seeds a configuration would settle it at the measured noise ({self.noise:.4f}): "
               f"run the same sweep command with sweep.confirm_max={seeds}")
        return f"unresolved: the best, {best.label}, is {apart} ({interval}); {how}"

    @property
    def metrics(self) -> dict[str, float]:
        """What the sweep's MLflow parent run records of it, beside the tags."""
        return {"confirmed_difference": self.best.difference, "confirmed_low": self.best.low,
                "confirmed_high": self.best.high, "confirmed_winner_mean": self.best.mean,
                "baseline_mean": self.baseline_mean, "confirm_noise": self.noise}

    @property
    def tags(self) -> dict[str, str]:
        return {"verdict": self.outcome, "verdict_text": self.text}

    def interval_text(self, comparison: Comparison) -> str:
        contenders, looks = len(self.comparisons), self.looks
        return (f"{1 - self.alpha:.0%} interval {comparison.low:+.4f} ... {comparison.high:+.4f}, Bonferroni over "
                f"{contenders} contender{'s' * (contenders != 1)} and {looks} look{'s' * (looks != 1)}")


def half_width(noise: float, n_a: int, n_b: int, df: int, level: float) -> float:
    """Half the two-sided (1 - level) t interval of a difference of two means of n_a and n_b runs."""
    return t_quantile(1 - level / 2, df) * noise * math.sqrt(1 / n_a + 1 / n_b)


@lru_cache(maxsize=4096)
def t_quantile(q: float, df: int) -> float:
    from scipy import stats  # seconds to import: paid by a verdict, not by every sweep driver's start

    return float(stats.t.ppf(q, df))


def judge(baseline: Sequence[float], contenders: Mapping[str, Sequence[float]], margin: float,
          first_blocks: int, max_blocks: int, alpha: float = ALPHA) -> Verdict | None:
    """The verdict on each contender's val_bpb runs against the baseline's, for a plan of `first_blocks`
    blocks growing to at most `max_blocks`; None while the runs cannot measure a difference (no run of
    the baseline or of any contender, or no configuration with two)."""
    baseline = list(baseline)
    ran = {label: list(values) for label, values in contenders.items() if len(values)}
    arms = [baseline, *ran.values()]
    df = sum(len(values) for values in arms) - len(arms)
    if not baseline or not ran or df < 1:
        return None
    noise = math.sqrt(sum((v - statistics.fmean(values)) ** 2 for values in arms for v in values) / df)
    level = alpha / (len(ran) * (max_blocks - first_blocks + 1))
    base = statistics.fmean(baseline)
    comparisons = []
    for label, values in ran.items():
        difference = statistics.fmean(values) - base
        half = half_width(noise, len(values), len(baseline), df, level)
        comparisons.append(Comparison(label, len(values), statistics.fmean(values), difference,
                                      difference - half, difference + half))
    comparisons.sort(key=lambda c: c.mean)
    best = comparisons[0]
    if -margin < best.low and best.high < margin:
        outcome = EQUIVALENT
    elif best.high < 0:
        outcome = BEATS
    elif all(c.low > 0 for c in comparisons):
        outcome = KEEP_DEFAULTS
    else:
        outcome = UNRESOLVED
    return Verdict(outcome, best, comparisons, base, noise, margin, first_blocks, max_blocks, alpha,
                   [len(values) for values in arms])
