"""`python -m frontier.sweep_report study=NAME [storage=URL_OR_FILE] [out=DIR] [results=FILE]`: what a sweep found.

Writes report.md (the best trial and the command that reproduces it, or once the best configurations
were confirmed against the baseline with new seeds the verdict (frontier/verdict.py) and the command it
recommends; the top-10 table, parameter importances, the confirmation runs, where the sweep's time
went, the trials another program slowed (ranked on their re-runs), why trials failed) and plots: the
optimisation history, val_bpb against the
fraction of the budget for every trial (each checkpoint where it was measured), the parameter
importances, the confirmed configurations and each one's interval against the baseline (confirm.png), and for
`sweep.objective=pareto` the front of val_bpb against CORE (pareto.png); for `sweep=frontier` the
compute-optimal shape (frontier/shapes.py: frontier.png, speed.png). They are logged as
artifacts of the sweep's parent MLflow run. The sweeper writes the same report into
<sweep dir>/report when it finishes. `results=FILE` (benchmarks/sweeps.jsonl) also appends the
finished sweep's result to FILE with where it ran (frontier/sweep_results.py).
"""
from __future__ import annotations

import statistics
import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from frontier import ladder, paths, shapes  # noqa: E402
from frontier.cli import command, print_help_if_asked  # noqa: E402
from frontier.compose import check_writable_path  # noqa: E402
from frontier.config import ConfigError, error_line  # noqa: E402
from frontier.timing import PARTS as TIME_PARTS  # noqa: E402
from frontier.study import (all_drivers_ended, damaged_journal, is_rdb, open_storage, safe_storage,  # noqa: E402
                            study_storage)
from frontier.verdict import BEATS, EQUIVALENT, KEEP_DEFAULTS  # noqa: E402
from hydra_plugins.frontier_sweeper._confirm import BASELINE, confirmed_runs, verdict_of  # noqa: E402

COLORS = {"COMPLETE": "tab:blue", "PRUNED": "tab:orange", "FAIL": "tab:red", "RUNNING": "tab:gray"}
USAGE = "usage: python -m frontier.sweep_report study=NAME [storage=URL_OR_FILE] [out=DIR] [results=FILE]"


def objective_name(study: optuna.Study) -> str:
    return study.user_attrs.get("objective", {}).get("name", "val_bpb")


def is_pareto(study: optuna.Study) -> bool:
    return len(study.directions) > 1


# PED-ANOVA compares where each parameter's values lie in the top TARGET_QUANTILE of the complete
# trials with where they lie in all of them; Optuna's documentation asks for at least 5 trials in that
# top set for a stable answer. Below that, with the top 10% one or two trials, every parameter's
# divergence comes out alike (5 trials of 3 parameters read 0.333 each): figures without information.
TARGET_QUANTILE = 0.1
TOP_TRIALS = 5
MIN_IMPORTANCE_TRIALS = round(TOP_TRIALS / TARGET_QUANTILE)


def param_importances(study: optuna.Study) -> dict[str, float]:
    """PED-ANOVA (Optuna's default, pinned): needs complete trials that differ. A pareto study's
    importances are for val_bpb."""
    from optuna import importance  # scikit-learn comes with it: only a study with enough trials pays for that

    target = (lambda t: t.values[0]) if is_pareto(study) else None
    evaluator = importance.PedAnovaImportanceEvaluator(target_quantile=TARGET_QUANTILE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importance.get_param_importances(study, evaluator=evaluator, target=target)
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def plot_history(study: optuna.Study, path: Path) -> None:
    with warnings.catch_warnings():  # the matplotlib backend is "experimental"
        warnings.simplefilter("ignore")
        ax = optuna.visualization.matplotlib.plot_optimization_history(study, target_name=objective_name(study))
    ax.figure.set_size_inches(8, 5)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


def curve(trial, every: float) -> list[tuple[float, float]]:
    """A trial's (budget fraction, val_bpb) points: each checkpoint k where it was measured (the
    trial's `checkpoint_fractions`), else at k * eval.every_fraction; then its final val_bpb."""
    measured = trial.user_attrs.get("checkpoint_fractions") or {}
    points = sorted((measured.get(str(k), k * every), v) for k, v in trial.intermediate_values.items())
    final = trial.user_attrs.get("val_bpb", trial.value if len(trial.values or ()) == 1 else None)
    if trial.state == TrialState.COMPLETE and final is not None:
        points.append((1.0, final))
    return points


def plot_curves(study: optuna.Study, path: Path) -> None:
    """val_bpb at each checkpoint, placed at the fraction of the budget where it was measured: the
    pruner compares checkpoint k of every trial, and this shows how equal those moments were."""
    every = study.user_attrs.get("every_fraction") or 1.0
    seconds = study.user_attrs.get("budget_seconds")
    fig, ax = plt.subplots(figsize=(8, 5))
    for trial in study.get_trials(deepcopy=False):
        points = curve(trial, every)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker=".", lw=1, alpha=0.8, color=COLORS.get(trial.state.name, "black"))
    for state, color in COLORS.items():
        ax.plot([], [], color=color, label=state.lower())
    budget = f" of {seconds:g} s" if seconds else ""
    ax.set_xlabel(f"fraction of the budget{budget} (charged time)")
    ax.set_ylabel("val_bpb (checkpoints: a subset; end: the full split)")
    ax.set_title(f"{study.study_name}: every trial")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_pareto(study: optuna.Study, complete: list, front: list, path: Path) -> None:
    """val_bpb (lower is better) against CORE (higher is better): every complete trial, and the
    front of those no other trial beats on both."""
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.scatter([t.values[0] for t in complete], [t.values[1] for t in complete], color="tab:gray",
               label="complete trials")
    line = sorted((t.values[0], t.values[1]) for t in front)
    ax.plot(*zip(*line), marker="o", color="tab:red", label="pareto front")
    for t in front:
        ax.annotate(str(t.number), (t.values[0], t.values[1]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("val_bpb (lower is better)")
    ax.set_ylabel("CORE (higher is better)")
    ax.set_title(f"{study.study_name}: {len(front)} trial(s) on the front of {len(complete)}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_importances(importances: dict[str, float], path: Path, target: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 1 + 0.5 * len(importances)))
    names = list(importances)[::-1]
    ax.barh(names, [importances[n] for n in names])
    ax.set_xlabel(f"importance for {target} (PED-ANOVA)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def metrics_of(trial) -> tuple:
    """A complete trial's (val_bpb, core): its values in a pareto study, else the user attributes
    its end recorded (core only where CORE ran)."""
    if len(trial.values or ()) == 2:
        return trial.values[0], trial.values[1]
    return trial.user_attrs.get("val_bpb", trial.value), trial.user_attrs.get("core")


def describe_best(trial, objective: str) -> str:
    bpb, core = metrics_of(trial)
    if objective == "composite":
        return f"composite {trial.value:.4f} (val_bpb {_fmt(bpb)}, core {_fmt(core)})"
    return f"val_bpb {trial.value:.4f}"


def leaderboard_scores(trials: list) -> dict[int, float]:
    """The leaderboard's phase-2 score of each trial with both metrics, min-max over these trials."""
    from frontier.leaderboard import phase2_scores

    rows = [{"number": t.number, "val_bpb": metrics_of(t)[0], "core": metrics_of(t)[1]} for t in trials]
    rows = [r for r in rows if isinstance(r["val_bpb"], float) and isinstance(r["core"], float)]
    return {r["number"]: score for r, score in zip(rows, phase2_scores(rows))} if rows else {}


def confirmation(study: optuna.Study) -> dict | None:
    """The confirmation runs (sweep.confirm) by configuration: each run's val_bpb and tokens seen, their
    mean and standard deviation; the verdict (frontier/verdict.py) and the command it recommends."""
    plan = study.user_attrs.get("confirm_plan")
    if not plan:
        return None
    runs = confirmed_runs(study, plan)
    rows = []
    for config in plan["configs"]:
        values = [t.value for t in runs[config["label"]]]
        rows.append({"label": config["label"], "values": values, "n": len(values), "params": config["params"],
                     "tokens": [t.user_attrs.get("tokens_seen") for t in runs[config["label"]]],
                     "mean": statistics.fmean(values) if values else None,
                     "sd": statistics.stdev(values) if len(values) > 1 else None})
    verdict = verdict_of(study, plan)
    chosen = None if verdict is None else {BEATS: verdict.best.label, KEEP_DEFAULTS: BASELINE,
                                           EQUIVALENT: BASELINE}.get(verdict.outcome)
    command = None
    if chosen is not None:
        config = next(c for c in plan["configs"] if c["label"] == chosen)
        command = "python -m frontier.train " + " ".join(configuration_overrides(study, config, runs[chosen]))
    return {"rows": rows, "seeds": plan["seeds"], "max_blocks": plan.get("max_blocks", len(plan["seeds"])),
            "baseline": rows[0], "verdict": verdict, "command": command}


def configuration_overrides(study: optuna.Study, config: dict, runs: list) -> list[str]:
    """The overrides that train a confirmed configuration: its search trial's; the baseline's, those of
    its confirmation runs without their seed (the command's own, where none finished)."""
    if config["label"] != BASELINE:
        number = config.get("number", int(config["label"].removeprefix("trial ")))
        return study.get_trials(deepcopy=False)[number].user_attrs.get("overrides", [])
    overrides = runs[0].user_attrs.get("overrides", []) if runs else study.user_attrs.get("overrides", [])
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "seed"]


def verdict_lines(found: dict) -> list[str]:
    """The report's headline once a confirmation exists: the verdict, and the command it recommends."""
    verdict = found["verdict"]
    if verdict is None:
        return ["**Confirmation**: not enough finished runs yet to compare the best configurations with the "
                "defaults.", ""]
    return [f"**Verdict**: {verdict.text}", ""] + (["```", found["command"], "```", ""] if found["command"] else [])


def confirmation_lines(found: dict) -> list[str]:
    verdict = found["verdict"]
    lines = ["## Confirmed with new seeds", "",
             f"The best configurations and the baseline (the command's own configuration), each trained again at the "
             f"same budget in blocks of one run each, seeds {', '.join(map(str, found['seeds']))} "
             f"(at most {found['max_blocks']} blocks):", "",
             "| configuration | runs | mean | sd | difference (interval) | val_bpb (tokens seen), by block | overrides |",
             "|---|---|---|---|---|---|---|"]
    compared = {c.label: c for c in verdict.comparisons} if verdict else {}
    for r in found["rows"]:
        overrides = " ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items()) or "(none)"
        c = compared.get(r["label"])
        difference = f"{c.difference:+.4f} ({c.low:+.4f} ... {c.high:+.4f})" if c else ""
        seen = ", ".join(f"{v:.4f} ({t / 1e6:.2f}M)" if t else f"{v:.4f}" for v, t in zip(r["values"], r["tokens"]))
        mean, sd = (f"{r[key]:.4f}" if r[key] is not None else "" for key in ("mean", "sd"))
        lines.append(f"| {r['label']} | {r['n']} | {mean} | {sd} | {difference} | {seen} | "
                     f"{overrides} |")
    lines.append("")
    if verdict is not None:
        lines += [f"Difference = mean - the baseline's (negative is better); the seeds' pooled standard deviation "
                  f"is {verdict.noise:.4f}; intervals at level 1 - {verdict.alpha:g} / ({len(verdict.comparisons)} "
                  f"contenders x {verdict.looks} looks); sweep.equivalence={verdict.margin:g}. The verdict, "
                  f"`{verdict.outcome}`, heads this report.", ""]
    return lines


def plot_confirmation(found: dict, path: Path) -> None:
    """Each configuration's runs and mean; each contender's interval of the difference, drawn from the
    baseline's mean, against the band of no difference that matters (sweep.equivalence)."""
    fig, ax = plt.subplots(figsize=(8, 5))
    base, verdict = found["baseline"], found["verdict"]
    compared = {c.label: c for c in verdict.comparisons} if verdict else {}
    if verdict is not None and verdict.margin > 0:
        ax.axhspan(base["mean"] - verdict.margin, base["mean"] + verdict.margin, color="tab:gray", alpha=0.2,
                   label=f"baseline mean +- sweep.equivalence ({verdict.margin:g})")
    if verdict is not None:  # an interval wholly below this line beats the defaults, wholly above loses
        ax.axhline(base["mean"], color="black", lw=0.8, ls="--", label="baseline mean: no difference")
    for x, r in enumerate(found["rows"]):
        ax.scatter([x] * r["n"], r["values"], color="tab:blue", alpha=0.6)
        if r["mean"] is not None:
            ax.plot([x + 0.15], [r["mean"]], "o", color="black")
        c = compared.get(r["label"])
        if c is not None:
            ax.errorbar([x + 0.15], [base["mean"] + c.difference], capsize=5, color="tab:red", fmt="none",
                        yerr=[[-(c.low - c.difference)], [c.high - c.difference]])
    ax.errorbar([], [], yerr=[], color="tab:red", fmt="none", label="interval of the difference (from the baseline)")
    ax.set_xticks(range(len(found["rows"])), [r["label"] for r in found["rows"]])
    ax.set_xlim(-0.5, len(found["rows"]) - 0.5)
    ax.set_ylabel("val_bpb (blue: each seed; black: mean)")
    ax.set_title(verdict.outcome.replace("_", " ") if verdict else "confirmed with new seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_account(trials: list) -> dict | None:
    """Where the sweep's time went: its span (first trial's start to last trial's end) times the trials
    it ran at once, split into what its trials' own accounts say (frontier/timing.py) and the time
    between their processes (starting and ending them, the sweep's own work)."""
    ended = [t for t in trials if t.datetime_start and t.datetime_complete]
    if not ended:
        return None
    span = (max(t.datetime_complete for t in ended) - min(t.datetime_start for t in ended)).total_seconds()
    events = sorted([(t.datetime_start, 1) for t in ended] + [(t.datetime_complete, -1) for t in ended])
    running = concurrent = 0
    for _, change in events:
        running += change
        concurrent = max(concurrent, running)
    paid = span * concurrent
    parts = {part: sum(t.user_attrs.get(f"time_{part}_seconds", 0.0) for t in ended) for part in TIME_PARTS}
    parts["between"] = max(paid - sum(parts.values()), 0.0)
    return {"span": span, "slots": concurrent, "paid": paid, "parts": parts,
            "training_share": parts["charged"] / paid if paid > 0 else 0.0, "next_step": next_step_seconds(ended)}


def next_step_seconds(trials: list) -> list[float]:
    """For each trial that started after another ended: seconds from that trial's end (the latest one
    before it started) to its own first training step."""
    gaps = []
    for t in trials:
        before = [o.datetime_complete for o in trials if o.datetime_complete <= t.datetime_start]
        if before and "time_startup_seconds" in t.user_attrs:
            gaps.append((t.datetime_start - max(before)).total_seconds() + t.user_attrs["time_startup_seconds"])
    return gaps


def contended_lines(slowed: dict[str, dict], trials: list) -> list[str]:
    """The trials another program slowed (tokens/s below sweep.min_relative_speed of their shape's median),
    left out of the ranking above, and the re-run each was ranked on instead."""
    reruns = {t.user_attrs["rerun_of"]: t for t in trials if t.user_attrs.get("rerun_of") is not None}
    lines = ["## Contended", "", "Trials that trained slower than their peers (the other trials of their shape on "
             "their kind of device), most likely because another program used the device: not ranked; each "
             "ran again with the same parameters.", "",
             "| trial | tokens/s | of the median | peers | device | re-run |", "|---|---|---|---|---|---|"]
    for number, found in sorted(slowed.items(), key=lambda item: int(item[0])):
        again = reruns.get(int(number))
        outcome = (f"trial {again.number}: {again.state.name.lower()}"
                   + (f", {again.value:.4f}" if again.state == TrialState.COMPLETE and len(again.values) == 1 else "")
                   if again is not None else "none (it is not re-run again, or the sweep stopped first)")
        lines.append(f"| {number} | {found['speed']:,.0f} | {found['speed'] / found['median']:.0%} of "
                     f"{found['median']:,.0f} | {found['peers']} | {found['device_kind']} | {outcome} |")
    return lines + [""]


def time_lines(account: dict, trials: list, slowed: dict[str, dict]) -> list[str]:
    paid = account["paid"] or 1.0
    lines = ["## Where the time went", "",
             f"**Training share {account['training_share']:.0%}**: {account['parts']['charged']:.0f} charged seconds of "
             f"{account['paid']:.0f} ({account['span']:.0f} s x {account['slots']} trial(s) at once).", "",
             "| " + " | ".join(TIME_PARTS + ("between trials",)) + " |", "|" + "---|" * (len(TIME_PARTS) + 1),
             "| " + " | ".join(f"{account['parts'][p] / paid:.0%}" for p in (*TIME_PARTS, "between")) + " |", ""]
    if account["next_step"]:
        gaps = sorted(account["next_step"])
        lines += [f"A trial's first training step came {statistics.median(gaps):.1f} s after the previous trial's end "
                  f"(median; at most {gaps[-1]:.1f} s).", ""]
    lines += ["Per trial (seconds; share = charged / wall):", "",
              "| trial | state | wall | startup | charged | evaluation | share |", "|---|---|---|---|---|---|---|"]
    for t in trials:
        a = t.user_attrs
        if "wall_seconds" in a:
            state = t.state.name.lower() + (" (contended)" if str(t.number) in slowed else "")
            lines.append(f"| {t.number} | {state} | {a['wall_seconds']:.1f} | "
                         f"{a.get('time_startup_seconds', 0):.1f} | {a.get('time_charged_seconds', 0):.1f} | "
                         f"{a.get('time_evaluation_seconds', 0):.1f} | {a.get('training_share', 0):.0%} |")
    return lines + [""]


def write_report(study: optuna.Study, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    objective = objective_name(study)
    every = study.get_trials(deepcopy=False)
    trials = [t for t in every if t.user_attrs.get("confirm") is None]  # the search's own trials
    counts = {state.name: sum(t.state == state for t in trials) for state in TrialState}
    counts = {name: n for name, n in counts.items() if n}
    slowed = study.user_attrs.get("contended", {})  # trials another program slowed: ranked on their re-runs
    complete = [t for t in trials if t.state == TrialState.COMPLETE and str(t.number) not in slowed]
    best, front = None, []
    if is_pareto(study):
        front = sorted((t for t in study.best_trials if str(t.number) not in slowed), key=lambda t: t.values[0])
        complete.sort(key=lambda t: t.values[0])
    else:
        complete.sort(key=lambda t: t.value)
    if complete and not front:
        t = complete[0]
        bpb, core = metrics_of(t)
        best = {"number": t.number, "value": t.value, "val_bpb": bpb, "core": core, "params": t.params,
                "overrides": t.user_attrs.get("overrides", []), "text": describe_best(t, objective)}
    importances = param_importances(study) if len(complete) >= MIN_IMPORTANCE_TRIALS else {}
    scores = leaderboard_scores(complete) if objective != "val_bpb" else {}

    confirmed = confirmation(study)
    account = time_account(every)
    lines = [f"# Sweep `{study.study_name}`", "",
             f"{len(trials)} trials: " + ", ".join(f"{n} {name.lower()}" for name, n in counts.items())
             + (f"; {len(every) - len(trials)} confirmation runs" if len(every) > len(trials) else ""), ""]
    evaluated = {t.user_attrs.get("val_fingerprint") for t in complete if t.user_attrs.get("val_fingerprint")}
    if len(evaluated) > 1:
        lines += [f"**Warning**: these trials were evaluated on different validation sets (val_fingerprint "
                  f"{', '.join(sorted(evaluated))}): their val_bpb do not compare.", ""]
    tokens = study.user_attrs.get("eval_tokens")
    if tokens:
        fingerprint = study.user_attrs.get("val_fingerprint")
        lines += [f"Every trial is evaluated on eval.final_tokens={tokens['final_tokens']} "
                  f"(eval.checkpoint_tokens={tokens['checkpoint_tokens']} at each checkpoint)"
                  + (f", the validation set {fingerprint}" if fingerprint else "") + ".", ""]
    if objective == "composite":
        anchors = study.user_attrs.get("objective", {})
        lines += [f"Objective: composite = 1 - (0.5 norm(val_bpb) + 0.5 norm(core)), minimised; norm is 0 "
                  f"at the worst anchor and 1 at the best (val_bpb {anchors.get('val_bpb_anchors')}, core "
                  f"{anchors.get('core_anchors')}). `phase-2` is the leaderboard's score, min-max over these "
                  "trials (1 = best).", ""]
    elif objective == "pareto":
        lines += ["Objective: pareto, val_bpb (lower is better) and CORE (higher is better); the front is "
                  "the trials no other trial beats on both.", ""]
    if confirmed:  # the verdict is the sweep's answer; "best" of one seed each is not
        lines += verdict_lines(confirmed)
    elif best:
        lines += [f"**Best**: trial {best['number']}, {best['text'].replace(' ', ' **', 1)}**", "", "```",
                  "python -m frontier.train " + " ".join(best["overrides"]), "```", ""]
    params = sorted({key for t in trials for key in t.params})
    columns = {"val_bpb": ["val_bpb"], "composite": ["composite", "val_bpb", "core", "phase-2"],
               "pareto": ["val_bpb", "core", "phase-2"]}[objective]
    ranked = front if front else complete[:10]
    lines += ["## Pareto front" if front else "## Top 10", "",
              "| rank | trial | " + " | ".join(columns) + " | charged s | " + " | ".join(params) + " |",
              "|" + "---|" * (3 + len(columns) + len(params))]
    for rank, t in enumerate(ranked, 1):
        bpb, core = metrics_of(t)
        cell = {"composite": t.value if not front else None, "val_bpb": bpb, "core": core,
                "phase-2": scores.get(t.number)}
        rerun_of = t.user_attrs.get("rerun_of")
        cells = [str(rank), f"{t.number}" + (f" (re-run of {rerun_of})" if rerun_of is not None else "")]
        cells += [_fmt(cell[c]) for c in columns]
        cells.append(_fmt(t.user_attrs.get("charged_seconds", "")))
        lines.append("| " + " | ".join(cells + [_fmt(t.params.get(p, "")) for p in params]) + " |")
    lines.append("")
    if front:
        lines += ["Commands of the front:", "", "```"]
        lines += [f"python -m frontier.train {' '.join(t.user_attrs.get('overrides', []))}  # trial {t.number}"
                  for t in front] + ["```", ""]
    target = "val_bpb" if objective == "pareto" else objective
    if importances:
        lines += [f"## Parameter importances ({target})", "", "| parameter | importance |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in importances.items()] + [""]
    elif len(complete) < MIN_IMPORTANCE_TRIALS and params:
        lines += [f"## Parameter importances ({target})", "",
                  f"Importances need {MIN_IMPORTANCE_TRIALS} complete trials; this study has {len(complete)}.", ""]
    if confirmed:
        lines += confirmation_lines(confirmed)
    lines += ladder.report_lines(study)  # a budget ladder's rungs; nothing for any other study
    lines += shapes.report_lines(study)  # a frontier sweep's fit; nothing for any other study
    if account:
        lines += time_lines(account, every, slowed)
    if slowed:
        lines += contended_lines(slowed, every)
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        lines += ["## Pruned", ""] + [f"- trial {t.number}: {t.user_attrs.get('prune_reason', 'pruned')}"
                                      for t in pruned] + [""]
    failed = [t for t in every if t.state == TrialState.FAIL]
    if failed:
        lines += ["## Failed", ""] + [f"- trial {t.number}: {t.user_attrs.get('fail_reason', 'unknown')}"
                                      for t in failed] + [""]
    text = "\n".join(lines)

    files = [out_dir / "report.md"]
    files[0].write_text(text)
    if complete and not front:
        plot_history(study, out_dir / "history.png")
        files.append(out_dir / "history.png")
    if front:
        plot_pareto(study, complete, front, out_dir / "pareto.png")
        files.append(out_dir / "pareto.png")
    if any(t.intermediate_values or t.state == TrialState.COMPLETE for t in trials):
        plot_curves(study, out_dir / "val_bpb_vs_budget.png")
        files.append(out_dir / "val_bpb_vs_budget.png")
    if importances:
        plot_importances(importances, out_dir / "importances.png", "val_bpb" if objective == "pareto" else objective)
        files.append(out_dir / "importances.png")
    if confirmed and any(r["n"] for r in confirmed["rows"]):
        plot_confirmation(confirmed, out_dir / "confirm.png")
        files.append(out_dir / "confirm.png")
    files += ladder.plot(study, out_dir)
    files += shapes.plot(study, out_dir)
    return {"best": best, "front": [t.number for t in front], "counts": counts, "importances": importances,
            "files": files, "text": text, "confirmation": confirmed, "time": account, "frontier": shapes.summary(study)}


def log_to_parent_run(study: optuna.Study, out_dir: Path, verdict=None) -> str | None:
    """Attach the report (and the verdict's metrics and tags) to the MLflow run of the sweep that last
    ran this study, and end that run
    when the sweep's last driver could not: with the status it meant (the store was down then), or
    KILLED when it meant none (it was killed, kill -9, before it could end the run)."""
    run_id, uri = study.user_attrs.get("mlflow_run_id"), study.user_attrs.get("mlflow_tracking_uri")
    if not run_id or not uri:
        return None
    from mlflow import MlflowClient

    from frontier.store import MLFLOW_STATUS  # and its settings: a store that is down fails fast

    client = MlflowClient(tracking_uri=uri)
    client.log_artifacts(run_id, str(out_dir), artifact_path="report")
    if verdict is not None:  # the same answer as the report's, also where confirmation went on since
        for key, value in verdict.tags.items():
            client.set_tag(run_id, key, value)
        for key, value in verdict.metrics.items():
            client.log_metric(run_id, key, value)
    status = study.user_attrs.get("mlflow_run_status") or "KILLED"
    if all_drivers_ended(study) and client.get_run(run_id).info.status == "RUNNING":
        client.set_tag(run_id, "status", status)
        client.set_terminated(run_id, MLFLOW_STATUS.get(status, status))
        print(f"ended the sweep's MLflow run {run_id} {status}")
    return run_id


def main(argv: list[str]) -> int:
    print_help_if_asked(argv, __doc__)
    args = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    if "study" not in args or set(args) - {"study", "storage", "out", "results"} or len(args) != len(argv):
        print(f"error: {' '.join(argv) or 'no arguments'} is not allowed: {USAGE}", file=sys.stderr)
        return 2
    name = args["study"]
    if not name:
        print("error: study= is not allowed: give the sweep's study name (its sweep.study)", file=sys.stderr)
        return 2
    storage = study_storage(args.get("storage"), name)
    database = storage if not is_rdb(storage) else paths.sqlite_path(storage)  # files a report must not create
    if database is not None and not Path(database).expanduser().exists():
        print(f"error: storage={storage!r} is not allowed: it does not exist; pass the sweep's sweep.storage",
              file=sys.stderr)
        return 2
    damaged = None if is_rdb(storage) else damaged_journal(storage)
    if damaged:
        print(f"error: storage={storage!r} is not allowed: {damaged}", file=sys.stderr)
        return 2
    try:
        opened = open_storage(storage)
        study = optuna.load_study(study_name=name, storage=opened)
    except KeyError:
        names = ", ".join(optuna.get_all_study_names(opened)) or "none"
        print(f"error: study={name!r} is not allowed: it is not in {storage} (studies there: {names})",
              file=sys.stderr)
        return 2
    except Exception as err:  # an unreachable or unreadable storage
        print(f"error: storage={safe_storage(storage)!r} is not reachable ({error_line(err)})", file=sys.stderr)
        return 2
    out = Path(args.get("out") or Path(study.user_attrs.get("sweep_dir", ".")) / "report")
    try:
        check_writable_path("out", out)
        if args.get("results"):
            check_writable_path("results", Path(args["results"]).parent)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    report = write_report(study, out)
    print(report["text"])
    print(f"files: {', '.join(str(f) for f in report['files'])}")
    if args.get("results"):
        from frontier.sweep_results import record

        try:
            row = record(study, report, Path(args["results"]), argv)
        except ConfigError as err:  # a device the trials ran on that this machine lacks: not where it ran
            print(f"error: results={args['results']} is not allowed here: {err}", file=sys.stderr)
            return 2
        print(f"recorded in {args['results']}: {row['machine']}, commit {(row['commit'] or 'none')[:7]}")
    try:
        run_id = log_to_parent_run(study, out, (report["confirmation"] or {}).get("verdict"))
        if run_id:
            print(f"logged to MLflow run {run_id}")
    except Exception as err:  # the report stands without MLflow
        print(f"warning: could not log to the sweep's MLflow run: {err}", file=sys.stderr)
    return 0


@command
def cli() -> None:
    """`python -m frontier.sweep_report` and the `frontier-sweep-report` command."""
    raise SystemExit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
