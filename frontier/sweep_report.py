"""`python -m frontier.sweep_report study=NAME [storage=URL_OR_FILE] [out=DIR]`: what a sweep found.

Writes report.md (the best trial and the command that reproduces it, the top-10 table, parameter
importances, why trials failed) and three plots: the optimisation history, val_bpb against the
fraction of the budget for every trial (from the checkpoints each reported), and the parameter
importances. They are logged as artifacts of the sweep's parent MLflow run. The sweeper writes
the same report into <sweep dir>/report when it finishes.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from frontier.trial import default_storage, is_rdb, open_storage  # noqa: E402

COLORS = {"COMPLETE": "tab:blue", "PRUNED": "tab:orange", "FAIL": "tab:red", "RUNNING": "tab:gray"}
USAGE = "usage: python -m frontier.sweep_report study=NAME [storage=URL_OR_FILE] [out=DIR]"


def param_importances(study: optuna.Study) -> dict[str, float]:
    """PED-ANOVA (Optuna's default, pinned): needs a few complete trials that differ."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.importance.get_param_importances(
                study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def plot_history(study: optuna.Study, path: Path) -> None:
    with warnings.catch_warnings():  # the matplotlib backend is "experimental"
        warnings.simplefilter("ignore")
        ax = optuna.visualization.matplotlib.plot_optimization_history(study, target_name="val_bpb")
    ax.figure.set_size_inches(8, 5)
    ax.figure.tight_layout()
    ax.figure.savefig(path, dpi=120)
    plt.close(ax.figure)


def plot_curves(study: optuna.Study, path: Path) -> None:
    """val_bpb at each checkpoint k, placed at k * eval.every_fraction of the budget: every trial
    is compared at the same charged time, which is what the pruner saw."""
    every = study.user_attrs.get("every_fraction") or 1.0
    seconds = study.user_attrs.get("budget_seconds")
    fig, ax = plt.subplots(figsize=(8, 5))
    for trial in study.get_trials(deepcopy=False):
        points = sorted((k * every, v) for k, v in trial.intermediate_values.items())
        if trial.state == TrialState.COMPLETE:
            points.append((1.0, trial.value))
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


def plot_importances(importances: dict[str, float], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 1 + 0.5 * len(importances)))
    names = list(importances)[::-1]
    ax.barh(names, [importances[n] for n in names])
    ax.set_xlabel("importance for val_bpb (PED-ANOVA)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def write_report(study: optuna.Study, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    trials = study.get_trials(deepcopy=False)
    counts = {state.name: sum(t.state == state for t in trials) for state in TrialState}
    counts = {name: n for name, n in counts.items() if n}
    complete = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: t.value)
    best = None
    if complete:
        t = complete[0]
        best = {"number": t.number, "value": t.value, "params": t.params,
                "overrides": t.user_attrs.get("overrides", [])}
    importances = param_importances(study) if len(complete) >= 2 else {}

    lines = [f"# Sweep `{study.study_name}`", "",
             f"{len(trials)} trials: " + ", ".join(f"{n} {name.lower()}" for name, n in counts.items()), ""]
    if best:
        lines += [f"**Best**: trial {best['number']}, val_bpb **{best['value']:.4f}**", "", "```",
                  "python -m frontier.train " + " ".join(best["overrides"]), "```", ""]
    params = sorted({key for t in trials for key in t.params})
    lines += ["## Top 10", "", "| rank | trial | val_bpb | charged s | " + " | ".join(params) + " |",
              "|" + "---|" * (4 + len(params))]
    for rank, t in enumerate(complete[:10], 1):
        cells = [str(rank), str(t.number), f"{t.value:.4f}", _fmt(t.user_attrs.get("charged_seconds", ""))]
        lines.append("| " + " | ".join(cells + [_fmt(t.params.get(p, "")) for p in params]) + " |")
    lines.append("")
    if importances:
        lines += ["## Parameter importances", "", "| parameter | importance |", "|---|---|"]
        lines += [f"| {name} | {value:.3f} |" for name, value in importances.items()] + [""]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    if pruned:
        lines += ["## Pruned", ""] + [f"- trial {t.number}: {t.user_attrs.get('prune_reason', 'pruned')}"
                                      for t in pruned] + [""]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    if failed:
        lines += ["## Failed", ""] + [f"- trial {t.number}: {t.user_attrs.get('fail_reason', 'unknown')}"
                                      for t in failed] + [""]
    text = "\n".join(lines)

    files = [out_dir / "report.md"]
    files[0].write_text(text)
    if complete:
        plot_history(study, out_dir / "history.png")
        files.append(out_dir / "history.png")
    if any(t.intermediate_values or t.state == TrialState.COMPLETE for t in trials):
        plot_curves(study, out_dir / "val_bpb_vs_budget.png")
        files.append(out_dir / "val_bpb_vs_budget.png")
    if importances:
        plot_importances(importances, out_dir / "importances.png")
        files.append(out_dir / "importances.png")
    return {"best": best, "counts": counts, "importances": importances, "files": files, "text": text}


def log_to_parent_run(study: optuna.Study, out_dir: Path) -> str | None:
    """Attach the report to the MLflow run of the sweep that last ran this study."""
    run_id, uri = study.user_attrs.get("mlflow_run_id"), study.user_attrs.get("mlflow_tracking_uri")
    if not run_id or not uri:
        return None
    import mlflow

    mlflow.MlflowClient(tracking_uri=uri).log_artifacts(run_id, str(out_dir), artifact_path="report")
    return run_id


def main(argv: list[str]) -> int:
    args = dict(arg.split("=", 1) for arg in argv if "=" in arg)
    if "study" not in args or set(args) - {"study", "storage", "out"} or len(args) != len(argv):
        print(USAGE, file=sys.stderr)
        return 2
    name = args["study"]
    storage = args.get("storage") or default_storage(name)
    if not is_rdb(storage) and not Path(storage).expanduser().exists():
        print(f"error: storage={storage!r} does not exist: pass the sweep's sweep.storage", file=sys.stderr)
        return 2
    opened = open_storage(storage)
    try:
        study = optuna.load_study(study_name=name, storage=opened)
    except KeyError:
        names = ", ".join(optuna.get_all_study_names(opened)) or "none"
        print(f"error: study={name!r} is not in {storage} (studies there: {names})", file=sys.stderr)
        return 2
    out = Path(args.get("out") or Path(study.user_attrs.get("sweep_dir", ".")) / "report")
    report = write_report(study, out)
    print(report["text"])
    print(f"files: {', '.join(str(f) for f in report['files'])}")
    try:
        run_id = log_to_parent_run(study, out)
        if run_id:
            print(f"logged to MLflow run {run_id}")
    except Exception as err:  # the report stands without MLflow
        print(f"warning: could not log to the sweep's MLflow run: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
