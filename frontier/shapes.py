"""The compute-optimal shape of a frontier sweep (`sweep=frontier`).

At each budget: every shape at its best learning-rate scale, a parabola in ln(params) through those
points whose minimum is the optimal model size (with an interval that carries the seeds' noise, given
where the swept sizes bracket it), the tokens that size sees at this device's speed, and the nearest
swept shape as a command to run. With an optimum at two budgets or more: how the optimal size and
tokens grow with the budget, extrapolated to the competition's. With sweep.validate, whether the
optimum held when its shape and neighbours trained again with new seeds.
The sweep report (frontier/sweep_report.py) adds this section and its two plots to a frontier study's.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402
from scipy.stats import ttest_ind  # noqa: E402

from frontier.config import (  # noqa: E402
    FRONTIER_BUDGET as BUDGET, FRONTIER_DEPTH as DEPTH, FRONTIER_LR_SCALE as LR_SCALE,
    FRONTIER_VALIDATE_PLAN as VALIDATE_PLAN)

MIN_SHAPES = 3  # a parabola has three coefficients
RESAMPLES = 1000
COMPETITION = {"phase 1": 1800.0, "phase 2": 14400.0}  # the competition's budgets in seconds
BEATEN = 0.05  # a neighbour beats the predicted shape when Welch's one-sided test gives p below this
TITLE = "## Frontier: the best shape for this device and budget"


@dataclass(frozen=True)
class Point:
    """One shape at one budget, at its best learning-rate scale: the trial that did best."""
    depth: int
    lr_scale: float
    params: int
    val_bpb: float
    tokens_seen: int
    tokens_per_second: float
    overrides: tuple[str, ...] = ()  # the trial's own, the base of its command


@dataclass(frozen=True)
class Fit:
    """val_bpb = a x^2 + b x + c in x = ln(params), and its minimum where it lies among the shapes."""
    coefficients: tuple[float, float, float] | None = None
    optimum: float | None = None  # params at the minimum
    interval: tuple[float, float] | None = None  # of the optimum, 2.5 and 97.5 percentiles: only inside the shapes
    val_bpb: float | None = None  # predicted at the optimum
    val_bpb_interval: tuple[float, float] | None = None
    outside: float | None = None  # the share of resamples whose curve has no minimum inside the swept sizes
    interval_problem: str | None = None  # why the optimum has no interval
    problem: str | None = None  # why there is no optimum


@dataclass(frozen=True)
class BudgetFit:
    """One budget of the sweep: its trials, the shapes' best points, the fit and what follows from it."""
    seconds: float
    trials: list
    points: list[Point]
    fit: Fit
    speed: tuple[float, float] | None  # ln(tokens/s) = slope ln(params) + intercept
    tokens: float | None = None  # the optimum sees, at that speed
    nearest: Point | None = None
    command: str | None = None


def search_trials(study: optuna.Study) -> list:
    """The sweep's grid points: confirmation runs retrain chosen configurations, they are no new shape."""
    return [t for t in study.get_trials(deepcopy=False) if "confirm" not in t.user_attrs]


def at_budget(trials: list, seconds: float) -> list:
    """The trials of one budget: each budget has its own optimum."""
    return [t for t in trials if math.isclose(t.params.get(BUDGET, math.nan), seconds)]


def finished(trials: list) -> list:
    """The trials with a val_bpb: running, pruned and failed ones measured nothing to fit."""
    return [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]


def best_points(trials: list) -> list[Point]:
    """Each shape at its best lr_scale: the learning rate is tuned away, leaving val_bpb against size."""
    best = {}
    for t in finished(trials):
        depth = t.params[DEPTH]
        if depth not in best or t.value < best[depth].value:
            best[depth] = t
    return [Point(depth=d, lr_scale=t.params[LR_SCALE], params=t.user_attrs["params"], val_bpb=t.value,
                  tokens_seen=t.user_attrs["tokens_seen"], tokens_per_second=t.user_attrs["tokens_per_second"],
                  overrides=tuple(t.user_attrs.get("overrides", ())))
            for d, t in sorted(best.items())]


def vertex(coefficients) -> tuple[float, float]:
    """The parabola's turning point (x, y): its minimum where it opens upward."""
    a, b, c = coefficients
    return -b / (2 * a), c - b * b / (4 * a)


def vertex_problem(coefficients, lowest: float, highest: float) -> str | None:
    """Why the parabola gives no optimum among the swept sizes: one outside them would be a guess."""
    a, b, _ = coefficients
    if a > 0 and lowest <= vertex(coefficients)[0] <= highest:
        return None
    if a > 0:
        deeper = vertex(coefficients)[0] > highest
        why = f"the optimum lies beyond the {'largest' if deeper else 'smallest'} shape"
    else:
        deeper = np.polyval(coefficients, highest) < np.polyval(coefficients, lowest)
        why = (f"val_bpb does not curve upward in ln(params), so the fit has no minimum; it is lowest at the "
               f"{'largest' if deeper else 'smallest'} shape")
    return f"{why}: extend sweep.frontier.depths to {'deeper' if deeper else 'shallower'} shapes"


def resampled_vertices(x: np.ndarray, y: np.ndarray, resamples: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A parametric bootstrap of the parabola's minimum (x, y) that carries the seeds' noise: each resample
    adds Gaussian noise to the fitted curve at the shapes and refits. The noise level is the fit's own
    residual one, itself drawn for each resample (RSS / chi2 with n - 3 degrees of freedom) because a few
    shapes measure it loosely. A resample whose curve opens downward has no minimum: it is kept, its
    optimum beyond the end where its curve is lower (x = +-inf) and its val_bpb -inf, so the percentiles
    count it. y may hold many sweeps (..., n): every sweep's resamples at once, (..., resamples)."""
    design = np.stack([x * x, x, np.ones_like(x)], axis=1)
    solve = np.linalg.pinv(design)  # (3, n): least squares as a matrix
    coefficients = y @ solve.T
    rss = ((y - coefficients @ design.T) ** 2).sum(axis=-1)
    sizes = y.shape[:-1] + (resamples,)
    sigma = np.sqrt(rss[..., None] / rng.chisquare(len(x) - MIN_SHAPES, sizes))
    drawn = coefficients[..., None, :] + sigma[..., None] * (rng.standard_normal(sizes + (len(x),)) @ solve.T)
    a, b, c = drawn[..., 0], drawn[..., 1], drawn[..., 2]
    lower_at_largest = a * x.max() ** 2 + b * x.max() < a * x.min() ** 2 + b * x.min()
    with np.errstate(divide="ignore", invalid="ignore"):
        best_x = np.where(a > 0, -b / (2 * a), np.where(lower_at_largest, np.inf, -np.inf))
        best_y = np.where(a > 0, c - b * b / (4 * a), -np.inf)
    return best_x, best_y


def percentiles(values: np.ndarray) -> np.ndarray:
    """The 2.5 and 97.5 percentiles over the last axis, each a resample's own value (+-inf included)."""
    return np.quantile(values, [0.025, 0.975], axis=-1, method="inverted_cdf")


def unbracketed(low: float, high: float, points: list[Point]) -> str | None:
    """Why an interval of ln(params) that leaves the swept sizes is no interval to give, and which way to extend."""
    smallest, largest = min(points, key=lambda p: p.params), max(points, key=lambda p: p.params)
    below, above = bool(low < math.log(smallest.params)), bool(high > math.log(largest.params))
    if not (below or above):
        return None
    reaches = ([f"below the smallest shape (depth {smallest.depth}, {count(smallest.params)} params)"] * below
               + [f"above the largest shape (depth {largest.depth}, {count(largest.params)} params)"] * above)
    toward = ([f"smaller shapes (sweep.frontier.depths below {smallest.depth})"] * below
              + [f"larger shapes (sweep.frontier.depths above {largest.depth})"] * above)
    return (f"not bracketed: the 95% interval reaches {' and '.join(reaches)}; extend the family toward "
            f"{' and '.join(toward)}")


def fit(points: list[Point], resamples: int = RESAMPLES, seed: int = 0) -> Fit:
    """The parabola through the shapes' best points: its minimum is the optimal size for the budget."""
    if len(points) < MIN_SHAPES:
        return Fit(problem=f"the fit needs {MIN_SHAPES} shapes, {len(points)} finished")
    x, y = np.log([p.params for p in points]), np.array([p.val_bpb for p in points], dtype=float)
    coefficients = tuple(float(c) for c in np.polyfit(x, y, 2))
    problem = vertex_problem(coefficients, x.min(), x.max())
    if problem:
        return Fit(coefficients, problem=problem)
    best_x, best_y = vertex(coefficients)
    found = Fit(coefficients, math.exp(best_x), val_bpb=best_y)
    if len(points) == MIN_SHAPES:
        return replace(found, interval_problem=f"no interval: with {MIN_SHAPES} shapes the parabola runs through "
                                               "each and leaves no residual to measure the noise by; sweep 4 or more")
    xs, ys = resampled_vertices(x, y, resamples, np.random.default_rng(seed))
    outside = float(np.mean(~((x.min() <= xs) & (xs <= x.max()))))
    (low, high), (low_y, high_y) = percentiles(xs), percentiles(ys)
    why = unbracketed(low, high, points)
    if why:
        return replace(found, outside=outside, interval_problem=why)
    return replace(found, interval=(math.exp(low), math.exp(high)), outside=outside,
                   val_bpb_interval=(float(low_y), float(high_y)) if math.isfinite(low_y) else None)


def speed_curve(trials: list) -> tuple[float, float] | None:
    """ln(tokens/s) against ln(params), a line over a budget's trials: turns an optimal size into the tokens it sees."""
    done = finished(trials)
    params = np.log([t.user_attrs["params"] for t in done])
    if len(set(params.tolist())) < 2:
        return None
    slope, intercept = np.polyfit(params, np.log([t.user_attrs["tokens_per_second"] for t in done]), 1)
    return float(slope), float(intercept)


def tokens_at(speed: tuple[float, float], params: float, seconds: float) -> float:
    """The tokens a model of that size trains on in the budget, at this device's fitted speed."""
    slope, intercept = speed
    return math.exp(intercept + slope * math.log(params)) * seconds


def nearest(points: list[Point], params: float) -> Point:
    """The swept shape closest to the optimum in ln(params): one known to train, at its tuned scale."""
    return min(points, key=lambda p: abs(math.log(p.params / params)))


def key_of(override: str) -> str:
    """An override's key, whether given as key=, +key= or ++key=, so the command sets each key once."""
    return override.split("=", 1)[0].lstrip("+~")


def overrides_for(point: Point, shape: dict, seconds: float) -> list[str]:
    """The trial's overrides with shape, lr_scale and budget set: its other settings stay as the sweep gave them."""
    chosen = {**shape, LR_SCALE: point.lr_scale, BUDGET: seconds}
    return [o for o in point.overrides if key_of(o) not in chosen] + [f"{k}={v}" for k, v in chosen.items()]


def power_law(budgets: list[float], values: list[float]) -> tuple[float, float]:
    """value = prefactor * budget^exponent, least squares in log-log: how an optimum grows with the budget."""
    exponent, log_prefactor = np.polyfit(np.log(budgets), np.log(values), 1)
    return float(exponent), math.exp(log_prefactor)


def analyse_budget(frontier: dict, trials: list, seconds: float) -> BudgetFit:
    """One budget's fit and, where it has an optimum, the tokens it sees and the nearest shape's command."""
    points = best_points(trials)
    found, speed = fit(points), speed_curve(trials)
    if found.optimum is None:
        return BudgetFit(seconds, trials, points, found, speed)
    closest = nearest(points, found.optimum)
    shape = frontier["shapes"].get(str(closest.depth), {DEPTH: closest.depth})
    command = "python -m frontier.train " + " ".join(overrides_for(closest, shape, seconds))
    tokens = tokens_at(speed, found.optimum, seconds) if speed else None
    return BudgetFit(seconds, trials, points, found, speed, tokens, closest, command)


def analyse(study: optuna.Study) -> list[BudgetFit]:
    """Every budget of the `frontier` user attribute, in its order, finished or not."""
    frontier = study.user_attrs["frontier"]
    trials = search_trials(study)
    return [analyse_budget(frontier, at_budget(trials, float(s)), float(s)) for s in frontier["budgets"]]


def scaling(fits: list[BudgetFit]) -> dict | None:
    """N_opt ∝ T^a and D_opt ∝ T^b over the budgets with an optimum, and both at the competition's budgets."""
    found = [f for f in fits if f.fit.optimum is not None and f.tokens is not None]
    if len(found) < 2:
        return None
    budgets = [f.seconds for f in found]
    a, params_at_1s = power_law(budgets, [f.fit.optimum for f in found])
    b, tokens_at_1s = power_law(budgets, [f.tokens for f in found])
    return {"budgets": budgets, "params_exponent": a, "tokens_exponent": b,
            "extrapolated": {name: {"seconds": s, "params": params_at_1s * s ** a, "tokens": tokens_at_1s * s ** b}
                             for name, s in COMPETITION.items()}}


def validation(study: optuna.Study) -> dict | None:
    """sweep.validate's runs (hydra_plugins/frontier_sweeper/_frontier.py) by shape, and whether the optimum
    held: whether a neighbour's mean val_bpb is lower than the predicted shape's beyond the seeds' noise,
    by Welch's t-test (one-sided, unequal variances; p < BEATEN). None where no validation was planned."""
    plan = study.user_attrs.get(VALIDATE_PLAN)
    if not plan:
        return None
    values: dict[str, list[float]] = {c["label"]: [] for c in plan["configs"]}
    for t in finished(study.get_trials(deepcopy=False)):
        if t.user_attrs.get("confirm") in values:
            values[t.user_attrs["confirm"]].append(t.value)
    rows = [{"label": c["label"], "depth": c["params"][DEPTH], "lr_scale": c["params"][LR_SCALE],
             "values": values[c["label"]], "p": None} for c in plan["configs"]]
    result = {"seconds": plan["seconds"], "seeds": plan["seeds"], "problem": plan["problem"], "rows": rows,
              "predicted": next((r for r in rows if r["label"] == plan["predicted"]), None), "beaten_by": [],
              "held": None}
    predicted = result["predicted"]
    if predicted is None or len(predicted["values"]) < 2:
        return result
    neighbours = [r for r in rows if r is not predicted and len(r["values"]) >= 2]
    for r in neighbours:
        r["p"] = float(ttest_ind(r["values"], predicted["values"], equal_var=False, alternative="less").pvalue)
    result["beaten_by"] = [r for r in neighbours if r["p"] < BEATEN]  # nan (no spread at all) never beats
    if len(neighbours) == len(rows) - 1:  # every comparison made
        result["held"] = not result["beaten_by"]
    return result


def summary(study: optuna.Study) -> dict | None:
    """The report's numbers (per budget the optimum, interval and command; the scaling) for callers to log."""
    if not study.user_attrs.get("frontier"):
        return None
    fits = analyse(study)
    budgets = {f.seconds: {"optimum_params": f.fit.optimum, "interval": f.fit.interval, "val_bpb": f.fit.val_bpb,
                           "val_bpb_interval": f.fit.val_bpb_interval, "tokens": f.tokens, "command": f.command,
                           "outside": f.fit.outside, "interval_problem": f.fit.interval_problem,
                           "problem": f.fit.problem} for f in fits}
    checked = validation(study)
    held = None if checked is None else checked["held"]
    return {"budgets": budgets, "scaling": scaling(fits), "validation_held": held}


# -----------------------------------------------------------------------------
# The report's section


def count(n: float) -> str:
    """1234567 -> 1.23M: sizes and token counts to read, not to count."""
    if not math.isfinite(n):
        return "inf"
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= size:
            return f"{n / size:.3g}{suffix}"
    return f"{n:.3g}"


def missing_line(frontier: dict, budget: BudgetFit) -> str | None:
    """What a budget still lacks, so an unfinished sweep reads as unfinished rather than as a result."""
    depths, scales = frontier["depths"], frontier["lr_scales"]
    done = [p.depth for p in budget.points]
    states = Counter(t.state.name.lower() for t in budget.trials if t.state != TrialState.COMPLETE)
    started = {(t.params.get(DEPTH), t.params.get(LR_SCALE)) for t in budget.trials}
    unstarted = sum((d, s) not in started for d in depths for s in scales)
    if len(done) == len(depths) and not states and not unstarted:
        return None
    parts = [f"{len(done)} of {len(depths)} shapes finished"
             + (f" (depths {', '.join(map(str, done))})" if done else "")]
    if states:
        parts.append(", ".join(f"{n} trial(s) {state}" for state, n in sorted(states.items())))
    if unstarted:
        parts.append(f"{unstarted} of {len(depths) * len(scales)} grid points (depth x lr_scale) not started")
    if len(done) < MIN_SHAPES:
        parts.append(f"the fit needs {MIN_SHAPES}")
    return f"budget {budget.seconds:g} s: " + "; ".join(parts)


def shape_table(frontier: dict, budget: BudgetFit) -> list[str]:
    """The points the fit runs through, so a reader can check it against the measurements."""
    lines = ["| depth | d_model | n_head | params | best lr_scale | val_bpb | tokens seen | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for p in budget.points:
        shape = frontier["shapes"].get(str(p.depth), {})
        lines.append(f"| {p.depth} | {shape.get('model.d_model', '')} | {shape.get('model.n_head', '')} | "
                     f"{count(p.params)} | {p.lr_scale:g} | {p.val_bpb:.4f} | {count(p.tokens_seen)} | "
                     f"{p.tokens_per_second:,.0f} |")
    return lines + [""]


def optimum_lines(budget: BudgetFit) -> list[str]:
    """The optimum with its uncertainty, its tokens and a command for the nearest shape; or why there is none."""
    found = budget.fit
    if found.optimum is None:
        return [f"**No optimum**: {found.problem}.", ""]
    if found.interval:
        uncertainty = f" (95% interval {count(found.interval[0])}-{count(found.interval[1])})"
    else:
        uncertainty = f" ({found.interval_problem})"
    lines = [f"**Optimum: {count(found.optimum)} params**{uncertainty}, predicted val_bpb {found.val_bpb:.4f}"
             + (f" ({found.val_bpb_interval[0]:.4f}-{found.val_bpb_interval[1]:.4f})"
                if found.val_bpb_interval else "") + "."]
    if found.outside is not None:
        lines[0] += (f" In {found.outside:.0%} of {RESAMPLES} resamples the curve has no minimum inside the swept "
                     "range.")
    if budget.tokens is not None:
        lines[0] += (f" At this device's speed (tokens/s ∝ params^{budget.speed[0]:.2f}) it sees "
                     f"{count(budget.tokens)} tokens in {budget.seconds:g} s, "
                     f"{budget.tokens / found.optimum:.2g} per parameter.")
    shape = budget.nearest
    lines += ["", f"The nearest shape swept is depth {shape.depth} ({count(shape.params)} params), best at "
              f"optim.lr_scale={shape.lr_scale}:", "", "```", budget.command, "```", ""]
    return lines


def bracket_line(budget: BudgetFit) -> str | None:
    """A warning for the shapes whose best scale is still an end of the scales they trained (the bracket,
    and the step beyond it a sweep adds): their rates are not tuned, and the fit compares them at rates
    that may be off."""
    tried: dict[int, set[float]] = {}
    for t in finished(budget.trials):
        tried.setdefault(t.params[DEPTH], set()).add(t.params[LR_SCALE])
    notes = []
    for end, which, way in ((max, "largest", "a larger"), (min, "smallest", "a smaller")):
        depths = [p.depth for p in budget.points if len(tried[p.depth]) > 1 and p.lr_scale == end(tried[p.depth])]
        if depths:
            notes.append(f"depth {', '.join(map(str, depths))} did best at the {which} optim.lr_scale trained: the "
                         f"best rate may lie beyond it; add {way} scale to sweep.frontier.lr_scales")
    return f"**Note**: {'; '.join(notes)}." if notes else None


def budget_lines(frontier: dict, budget: BudgetFit) -> list[str]:
    """One budget's subsection: what is missing first, so a partial table is not read as the result."""
    lines = [f"### Budget {budget.seconds:g} s", ""]
    missing = missing_line(frontier, budget)
    if missing:
        lines += [f"**Unfinished** {missing}.", ""]
    if budget.points:
        lines += shape_table(frontier, budget)
    bracket = bracket_line(budget)
    if bracket:
        lines += [bracket, ""]
    if budget.fit.coefficients is None and missing:  # the line above already says the fit needs more shapes
        return lines
    return lines + optimum_lines(budget)


def validation_lines(checked: dict) -> list[str]:
    """The validated shapes' runs and the verdict: the prediction tested on runs the fit did not see."""
    lines = [f"### Validation at {checked['seconds']:g} s", ""]
    if checked["predicted"] is None:
        return lines + [f"sweep.validate trained nothing: the fit at {checked['seconds']:g} s has no optimum "
                        f"({checked['problem']}).", ""]
    seeds = ", ".join(map(str, checked["seeds"]))
    lines += [f"The shape nearest the predicted optimum and its neighbours, each at its best scale, trained again "
              f"with seeds {seeds}:", "",
              "| depth | lr_scale | runs | mean val_bpb | sd | values | Welch p (lower than predicted) |",
              "|---|---|---|---|---|---|---|"]
    for r in checked["rows"]:
        v = r["values"]
        mean = f"{statistics.fmean(v):.4f}" if v else ""
        sd = f"{statistics.stdev(v):.4f}" if len(v) > 1 else ""
        p = "(predicted)" if r is checked["predicted"] else ("" if r["p"] is None else f"{r['p']:.3g}")
        lines.append(f"| {r['depth']} | {r['lr_scale']:g} | {len(v)} | {mean} | {sd} | "
                     f"{', '.join(f'{x:.4f}' for x in v)} | {p} |")
    predicted = checked["predicted"]["depth"]
    test = f"Welch's t-test, one-sided, p < {BEATEN:g}"
    if checked["beaten_by"]:
        better = ", ".join(f"depth {r['depth']} (p = {r['p']:.3g})" for r in checked["beaten_by"])
        verdict = (f"**The optimum did not hold**: {better} has a lower mean val_bpb than depth {predicted} beyond "
                   f"the seeds' noise ({test}); the optimum lies toward it.")
    elif checked["held"]:
        verdict = (f"**The optimum held**: no neighbour's mean val_bpb is lower than depth {predicted}'s beyond the "
                   f"seeds' noise ({test}).")
    else:
        verdict = ("**Unfinished**: the comparison needs 2 finished runs of each shape; the verdict waits for "
                   "them.")
    return lines + ["", verdict, ""]


def scaling_lines(law: dict, device: str) -> list[str]:
    """The power laws and their extrapolation, labelled as such: no sweep measured those budgets."""
    swept = ", ".join(f"{s:g}" for s in law["budgets"])
    lines = ["### Across budgets", "",
             f"Over the budgets {swept} s: N_opt ∝ T^{law['params_exponent']:.2f} and "
             f"D_opt ∝ T^{law['tokens_exponent']:.2f} (least squares in log-log).", "",
             f"**Extrapolated** to the competition's budgets on this device ({device}), beyond the longest budget "
             f"swept ({max(law['budgets']):g} s): an extrapolation, not a measurement; a sweep at that budget "
             "tests it.", "",
             "| budget | params (extrapolated) | tokens (extrapolated) |", "|---|---|---|"]
    lines += [f"| {name} ({e['seconds']:g} s) | {count(e['params'])} | {count(e['tokens'])} |"
              for name, e in law["extrapolated"].items()]
    return lines + [""]


def report_lines(study: optuna.Study) -> list[str]:
    """The report's frontier section (per budget, then across budgets); none for a study that is no frontier sweep."""
    frontier = study.user_attrs.get("frontier")
    if not frontier:
        return []
    fits = analyse(study)
    lines = [TITLE, "",
             f"Shapes along model.depth {', '.join(map(str, frontier['depths']))} (d_model = depth x "
             f"{frontier['aspect_ratio']} rounded up to a multiple of {frontier['head_dim']}, n_head = d_model / "
             f"{frontier['head_dim']}), each at optim.lr_scale {', '.join(f'{s:g}' for s in frontier['lr_scales'])}, "
             f"on {frontier['device']}. At each budget a parabola in ln(params) through each shape's best val_bpb "
             f"gives the optimal size; its 95% interval is the 2.5-97.5 percentiles over {RESAMPLES} resamples "
             "of a parametric bootstrap that adds the fit's residual noise (the seeds' noise, its level drawn "
             "afresh for each resample) to the curve at each shape and refits, given only where it lies "
             "inside the swept sizes.", ""]
    for budget in fits:
        lines += budget_lines(frontier, budget)
    checked = validation(study)
    if checked:
        lines += validation_lines(checked)
    law = scaling(fits)
    if law:
        lines += scaling_lines(law, frontier["device"])
    elif len(fits) > 1:
        lines += [f"Across budgets: the scaling needs an optimum at two budgets or more "
                  f"({sum(f.fit.optimum is not None for f in fits)} so far).", ""]
    return lines


# -----------------------------------------------------------------------------
# The plots


def error_bar(value: float, interval: tuple[float, float] | None) -> list[list[float]]:
    """matplotlib's (below, above) lengths; a percentile interval need not hold the point estimate."""
    low, high = interval or (value, value)
    return [[max(value - low, 0.0)], [max(high - value, 0.0)]]


def plot_frontier(fits: list[BudgetFit], title: str, path: Path) -> None:
    """val_bpb against params per budget: every trial faint, each shape's best, the fit, its minimum and interval."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, budget in enumerate(fits):
        color = f"C{i}"
        done = finished(budget.trials)
        ax.scatter([t.user_attrs["params"] for t in done], [t.value for t in done], color=color, alpha=0.2, s=12)
        ax.plot([p.params for p in budget.points], [p.val_bpb for p in budget.points], "o", color=color,
                label=f"{budget.seconds:g} s: best lr_scale per shape")
        found = budget.fit
        if found.coefficients:
            x = np.linspace(*np.log([budget.points[0].params, budget.points[-1].params]), 100)
            ax.plot(np.exp(x), np.polyval(found.coefficients, x), color=color, lw=1)
        if found.interval:
            ax.errorbar([found.optimum], [found.val_bpb], xerr=error_bar(found.optimum, found.interval),
                        yerr=error_bar(found.val_bpb, found.val_bpb_interval), fmt="*", ms=14, color=color,
                        capsize=4, label=f"{budget.seconds:g} s: optimum, 95% interval")
        elif found.optimum is not None:  # an interval the swept sizes do not bracket is not drawn
            ax.plot([found.optimum], [found.val_bpb], "*", ms=14, color=color,
                    label=f"{budget.seconds:g} s: optimum (interval not bracketed)")
    ax.set_xscale("log")
    ax.set_xlabel("params")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(f"{title}: val_bpb by model size (faint: every finished trial)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speed(fits: list[BudgetFit], title: str, path: Path) -> None:
    """tokens/s against params, log-log: this device's own speed curve, which sets an optimum's tokens."""
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, budget in enumerate(fits):
        done = finished(budget.trials)
        if not done:
            continue
        params = [t.user_attrs["params"] for t in done]
        ax.scatter(params, [t.user_attrs["tokens_per_second"] for t in done], color=f"C{i}", alpha=0.6, s=15,
                   label=f"{budget.seconds:g} s")
        if budget.speed:
            slope, intercept = budget.speed
            x = np.linspace(*np.log([min(params), max(params)]), 50)
            ax.plot(np.exp(x), np.exp(intercept + slope * x), color=f"C{i}", lw=1,
                    label=f"{budget.seconds:g} s: tokens/s ∝ params^{slope:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("params")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{title}: this device's speed by model size")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(study: optuna.Study, out_dir: Path) -> list[Path]:
    """frontier.png and speed.png, once a trial has finished; none for a study that is not a frontier sweep."""
    if not study.user_attrs.get("frontier"):
        return []
    fits = analyse(study)
    if not any(budget.points for budget in fits):
        return []
    paths = [out_dir / "frontier.png", out_dir / "speed.png"]
    plot_frontier(fits, study.study_name, paths[0])
    plot_speed(fits, study.study_name, paths[1])
    return paths
