"""A budget ladder (`sweep.ladder`): does the ranking of short runs predict the ranking of long ones?

Each configuration the sampler proposes trains at the ladder's first budget; the best `sweep.promote`
share of a rung's finished configurations trains again at the next budget (a schedule keyed to its budget
is no longer run continued: hydra_plugins/frontier_sweeper/_ladder.py decides what climbs), and the
baseline trains at every rung. This module is the sweep report's section (its keys' checks are in
frontier/budget_keys.py): val_bpb per configuration across rungs, the Spearman correlation of consecutive rungs with a bootstrap interval, the
best value of each searched key per rung and, with three rungs or more, a fit of log(best learning rate)
against log(budget) extrapolated to the competition's budgets.
"""
from __future__ import annotations

import math
import random
from pathlib import Path

from frontier.config import FRONTIER_BUDGET as BUDGET

RUNG, PROMOTED_FROM, BASELINE = "rung", "promoted_from", "ladder_baseline"  # a climbing trial's user attributes
LADDER_ATTRS = (RUNG, PROMOTED_FROM, BASELINE)
RESAMPLES = 1000
COMPETITION = {"phase 1": 1800.0, "phase 2": 14400.0}  # the competition's budgets in seconds
TITLE = "## Budget ladder: do short runs rank like long ones?"


def rung_of(trial) -> int:
    return trial.user_attrs.get(RUNG, 0)


def configuration(params: dict) -> tuple:
    """A configuration whatever its rung: its parameters without the budget the ladder gives it."""
    return tuple(sorted((key, value) for key, value in params.items() if key != BUDGET))


# -- the report ------------------------------------------------------------------------------------------

def table(trials: list, rungs: int, contended=()) -> dict[tuple, dict]:
    """Per configuration: its label ("baseline" or its first trial) and its best val_bpb at each rung it
    finished (finished search trials only: not confirmation runs, nor a contended trial, whose re-run counts)."""
    rows: dict[tuple, dict] = {}
    for trial in sorted(trials, key=lambda t: t.number):
        if (trial.user_attrs.get("confirm") is not None or trial.value is None or rung_of(trial) >= rungs
                or str(trial.number) in contended):
            continue
        key = configuration(trial.params)
        row = rows.setdefault(key, {"label": "baseline" if trial.user_attrs.get(BASELINE) else f"trial {trial.number}",
                                    "params": dict(key), "values": {}})
        rung = rung_of(trial)
        row["values"][rung] = min(row["values"].get(rung, math.inf), trial.value)
    return rows


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation; nan when either side has no spread (or fewer than two pairs)."""
    rx, ry = ranks(x), ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def bootstrap_interval(x: list[float], y: list[float], resamples: int = RESAMPLES,
                       seed: int = 0) -> tuple[float, float] | None:
    """The 2.5 and 97.5 percentiles of Spearman over resampled configurations (pairs drawn with
    replacement; a resample with no spread on a side is dropped); None below three pairs."""
    if len(x) < 3:
        return None
    rng = random.Random(seed)
    found = []
    for _ in range(resamples):
        picks = [rng.randrange(len(x)) for _ in x]
        value = spearman([x[i] for i in picks], [y[i] for i in picks])
        if not math.isnan(value):
            found.append(value)
    if not found:
        return None
    found.sort()
    return found[int(0.025 * (len(found) - 1))], found[int(math.ceil(0.975 * (len(found) - 1)))]


def agreements(rows: dict[tuple, dict], rungs: list[float]) -> list[dict]:
    """For each pair of consecutive rungs: the configurations finished at both, Spearman and its interval."""
    found = []
    for rung in range(len(rungs) - 1):
        both = [row["values"] for row in rows.values() if rung in row["values"] and rung + 1 in row["values"]]
        x, y = [v[rung] for v in both], [v[rung + 1] for v in both]
        found.append({"from": rungs[rung], "to": rungs[rung + 1], "n": len(both),
                      "spearman": spearman(x, y) if len(both) >= 2 else math.nan,
                      "interval": bootstrap_interval(x, y)})
    return found


def best_per_rung(rows: dict[tuple, dict], rungs: list[float]) -> list[dict | None]:
    """Each rung's best configuration (lowest val_bpb; ties: the first trial), or None where none finished."""
    best = []
    for rung in range(len(rungs)):
        at = [row for row in rows.values() if rung in row["values"]]
        best.append(min(at, key=lambda row: row["values"][rung]) if at else None)
    return best


def lr_fit(rungs: list[float], best: list[dict | None], key: str) -> dict | None:
    """log(best `key`) against log(budget), least squares, with its value at the competition's budgets
    (extrapolated); None below three rungs with a best configuration that sets `key`."""
    points = [(math.log(seconds), math.log(row["params"][key])) for seconds, row in zip(rungs, best)
              if row is not None and isinstance(row["params"].get(key), (int, float)) and row["params"][key] > 0]
    if len(points) < 3:
        return None
    mx, my = sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    return {"key": key, "exponent": slope,
            "at": {name: math.exp(my + slope * (math.log(seconds) - mx)) for name, seconds in COMPETITION.items()}}


def time_per_rung(trials: list, rungs: list[float]) -> list[dict]:
    """Each rung's share of the ladder's trial wall time, and the share of that time spent training."""
    walls = [0.0] * len(rungs)
    charged = [0.0] * len(rungs)
    for trial in trials:
        if trial.user_attrs.get("confirm") is None and rung_of(trial) < len(rungs):
            walls[rung_of(trial)] += trial.user_attrs.get("wall_seconds", 0.0)
            charged[rung_of(trial)] += trial.user_attrs.get("time_charged_seconds", 0.0)
    total = sum(walls)
    return [{"seconds": seconds, "wall": wall, "wall_share": wall / total if total else 0.0,
             "training_share": spent / wall if wall else 0.0} for seconds, wall, spent in zip(rungs, walls, charged)]


def summary(study) -> dict | None:
    """The section's numbers, for the report and its callers; None for a study without a ladder."""
    described = study.user_attrs.get("ladder")
    if not described:
        return None
    rungs = described["rungs"]
    trials = study.get_trials(deepcopy=False)
    rows = table(trials, len(rungs), study.user_attrs.get("contended", {}))
    best = best_per_rung(rows, rungs)
    keys = sorted({key for row in rows.values() for key, _ in row["params"].items()})
    fits = [found for key in keys if key.endswith("lr") and (found := lr_fit(rungs, best, key))]
    return {"rungs": rungs, "promote": described["promote"], "rows": rows, "agreements": agreements(rows, rungs),
            "best": best, "keys": keys, "fits": fits, "time": time_per_rung(trials, rungs)}


def _cell(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def report_lines(study) -> list[str]:
    """The report's ladder section; none for a study without a ladder."""
    found = summary(study)
    if found is None:
        return []
    rungs = found["rungs"]
    heads = [f"{seconds:g} s" for seconds in rungs]
    lines = [TITLE, "", f"Rungs {', '.join(heads)}; the best {found['promote']:.0%} of a rung's finished "
             "configurations train again at the next budget (from scratch: a schedule is keyed to its budget), "
             "and the baseline trains at every rung. val_bpb per configuration:", "",
             "| configuration | " + " | ".join(heads) + " | " + " | ".join(found["keys"]) + " |",
             "|" + "---|" * (1 + len(rungs) + len(found["keys"]))]
    # the configurations that climbed highest first, each rung's best first
    rows = sorted(found["rows"].values(), key=lambda r: (-max(r["values"]), r["values"][max(r["values"])]))
    for row in rows:
        lines.append(f"| {row['label']} | " + " | ".join(_cell(row["values"].get(i)) for i in range(len(rungs)))
                     + " | " + " | ".join(_cell(row["params"].get(key)) for key in found["keys"]) + " |")
    lines += ["", f"Does a rung's ranking predict the next one's? Spearman's rank correlation over the "
              f"configurations finished at both, with the 2.5-97.5 percentiles over {RESAMPLES} resamples of "
              "those configurations (1: the same order, 0: unrelated, -1: reversed):", "",
              "| from | to | configurations | Spearman | 95% interval |", "|---|---|---|---|---|"]
    for pair in found["agreements"]:
        interval = "{:+.2f} ... {:+.2f}".format(*pair["interval"]) if pair["interval"] else "needs 3 configurations"
        value = "" if math.isnan(pair["spearman"]) else f"{pair['spearman']:+.2f}"
        lines.append(f"| {pair['from']:g} s | {pair['to']:g} s | {pair['n']} | {value} | {interval} |")
    lines += ["", "The best configuration at each rung:", "",
              "| rung | val_bpb | configuration | " + " | ".join(found["keys"]) + " |",
              "|" + "---|" * (3 + len(found["keys"]))]
    for seconds, row in zip(rungs, found["best"]):
        if row is not None:
            value = row["values"][rungs.index(seconds)]
            lines.append(f"| {seconds:g} s | {value:.4f} | {row['label']} | "
                         + " | ".join(_cell(row["params"].get(key)) for key in found["keys"]) + " |")
    for fit in found["fits"]:
        lines += ["", f"{fit['key']}: the best value grows as budget^{fit['exponent']:+.2f} (a least-squares line "
                  f"in log-log through the {len(rungs)} rungs); **extrapolated**, beyond the rungs measured: "
                  + ", ".join(f"{value:.4g} at {name} ({COMPETITION[name]:g} s)" for name, value in fit["at"].items())]
    lines += ["", "Each rung's share of the ladder's trial time, and of that the share spent training:", "",
              "| rung | wall s | share of the ladder | training share |", "|---|---|---|---|"]
    lines += [f"| {t['seconds']:g} s | {t['wall']:.0f} | {t['wall_share']:.0%} | {t['training_share']:.0%} |"
              for t in found["time"]]
    confirmed = ("the confirmation below (its verdict above)" if study.user_attrs.get("confirm_plan")
                 else "not confirmed (sweep.confirm=0, or the top rung had no finished configuration)")
    return lines + ["", f"The top rung's winner against the baseline: {confirmed}.", ""]


def plot(study, out_dir: Path) -> list[Path]:
    """ladder.png: val_bpb per configuration across the rungs; none for a study without a ladder."""
    found = summary(study)
    if found is None or not found["rows"]:
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for row in found["rows"].values():
        rungs = sorted(row["values"])
        baseline = row["label"] == "baseline"
        ax.plot([found["rungs"][i] for i in rungs], [row["values"][i] for i in rungs], "o-",
                color="black" if baseline else None, lw=2 if baseline else 1, alpha=1 if baseline else 0.6,
                label="baseline" if baseline else None)
    ax.set_xscale("log")
    ax.set_xticks(found["rungs"], [f"{seconds:g} s" for seconds in found["rungs"]])
    ax.minorticks_off()
    ax.set_xlabel("budget (charged seconds)")
    ax.set_ylabel("val_bpb")
    ax.set_title("val_bpb per configuration across the ladder's rungs")
    ax.legend()
    path = out_dir / "ladder.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [path]
