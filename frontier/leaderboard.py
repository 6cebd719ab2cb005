"""`python -m frontier.leaderboard [experiment=frontier] [top=20] [phase=1|2] [budget=NAME] [tracking.uri=URI]`

The finished runs of an experiment, best first, with tokens/s, budget and the config keys in which
each run differs from the best one: the quick terminal view next to the MLflow UI.

phase=1 ranks by val_bpb (lower is better). phase=2 ranks by 0.5*norm(val_bpb) + 0.5*norm(core),
each min-max normalised over all ranked runs so that 1 is the best value among them (the lowest
val_bpb, the highest CORE); runs without a `core` metric are left out, with a note. `top` only
shortens the printout, it does not change the normalisation.

A configuration trained with several seeds (a sweep's confirmation runs, or runs a user repeated with
`seed=N`) is listed again below the table, once, with the mean +- standard deviation of its val_bpb;
then each sweep of the experiment whose confirmation reached a verdict (frontier/verdict.py), with it.

A run scored on another validation set than the best run (its `val_fingerprint` tag differs: another
model.seq_len, tokenizer, data or eval.final_tokens) says so in its differences: its val_bpb does not
compare with the best's. Seed groups are made of runs scored on one validation set.
"""
from __future__ import annotations

import math
import statistics
import sys
from types import SimpleNamespace

from mlflow import MlflowClient

from frontier.cli import command, print_help_if_asked
from frontier.config import ConfigError, TrackingConfig, error_line, key_hint
from frontier.paths import missing_sqlite_store
from frontier.tracking import RUN_KIND_TAG, probe_store, tracking_uri

# Bookkeeping, not knobs: always differs between runs and says nothing about the result.
IGNORED_PREFIXES = ("tracking.", "trial.")
USAGE = __doc__.splitlines()[0]


def phase2_scores(rows: list[dict]) -> list[float]:
    """0.5*norm(val_bpb) + 0.5*norm(core) per row, min-max over the rows, 1 = best of them."""
    bpb = _normalise([row["val_bpb"] for row in rows], higher_is_better=False)
    core = _normalise([row["core"] for row in rows], higher_is_better=True)
    return [0.5 * b + 0.5 * c for b, c in zip(bpb, core)]


def _normalise(values: list[float], higher_is_better: bool) -> list[float]:
    lo, hi = min(values), max(values)
    if hi == lo:  # all equal: all share the best value
        return [1.0] * len(values)
    return [(v - lo) / (hi - lo) if higher_is_better else (hi - v) / (hi - lo) for v in values]


def load_rows(client: MlflowClient, experiment_id: str) -> list[dict]:
    """One row per finished training run with a finite val_bpb (sweep parents left out)."""
    rows, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string="attributes.status = 'FINISHED'",
                                  max_results=1000, page_token=token)
        for run in page:
            metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
            bpb = metrics.get("val_bpb")
            if tags.get(RUN_KIND_TAG) == "sweep" or bpb is None or not math.isfinite(bpb):
                continue
            rows.append({
                "run_id": run.info.run_id,
                "name": run.info.run_name or run.info.run_id[:8],
                "val_bpb": bpb,
                "core": metrics.get("core"),
                "tokens_per_second": metrics.get("tokens_per_second"),
                "budget": params.get("budget.name", tags.get("budget", "?")),
                "val_fingerprint": tags.get("val_fingerprint"),
                "params": params,
            })
        token = page.token
        if not token:
            return rows


def rank(rows: list[dict], phase: int) -> tuple[list[dict], str | None]:
    """Rows best first, and a note about rows left out (phase 2 needs CORE)."""
    if phase == 1:
        return sorted(rows, key=lambda row: row["val_bpb"]), None
    scored = [row for row in rows if row["core"] is not None and math.isfinite(row["core"])]
    left_out = len(rows) - len(scored)
    note = f"note: {left_out} run(s) without a core metric left out of the phase-2 ranking" if left_out else None
    if not scored:
        return [], note
    for row, score in zip(scored, phase2_scores(scored)):
        row["score"] = score
    return sorted(scored, key=lambda row: (-row["score"], row["val_bpb"])), note


def differences(params: dict, best: dict) -> list[str]:
    keys = sorted(set(params) | set(best))
    return [f"{k}={params.get(k, '-')}" for k in keys
            if not k.startswith(IGNORED_PREFIXES) and params.get(k) != best.get(k)]


def other_validation_set(row: dict, best: dict) -> list[str]:
    """The flag of a row scored on another validation set than the best row."""
    if row.get("val_fingerprint") == best.get("val_fingerprint"):
        return []
    return [f"val_fingerprint={row.get('val_fingerprint') or '-'} (another validation set)"]


def seed_groups(rows: list[dict]) -> list[dict]:
    """Runs that differ only in `seed` (and bookkeeping) and were scored on one validation set, grouped
    where there are at least two seeds: each group's runs, mean and standard deviation of val_bpb, best
    mean first."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        config = tuple(sorted((k, v) for k, v in row["params"].items() if not k.startswith(IGNORED_PREFIXES)
                              and k != "seed")) + (row.get("val_fingerprint"),)
        groups.setdefault(config, []).append(row)
    found = []
    for members in groups.values():
        if len({row["params"].get("seed") for row in members}) >= 2:
            values = [row["val_bpb"] for row in members]
            found.append({"rows": members, "mean": statistics.fmean(values), "sd": statistics.stdev(values),
                          "params": members[0]["params"]})
    return sorted(found, key=lambda group: group["mean"])


def seed_table(groups: list[dict]) -> str:
    best = groups[0]["params"]
    lines = ["configurations trained with several seeds (val_bpb mean +- sd, best mean first):"]
    for i, group in enumerate(groups, 1):
        changed = [d for d in differences(group["params"], best) if not d.startswith("seed=")]
        lines.append(f"{i}  {group['mean']:.4f} +- {group['sd']:.4f}  {len(group['rows'])} seeds  "
                     + (" ".join(changed) or ("(best)" if i == 1 else "(same config)")))
    return "\n".join(lines)


def sweep_verdicts(client: MlflowClient, experiment_id: str) -> list[str]:
    """`sweep-NAME  outcome  text` of each sweep parent run with a confirmation verdict, newest first."""
    runs = client.search_runs([experiment_id], filter_string=f"tags.{RUN_KIND_TAG} = 'sweep'",
                              order_by=["attributes.start_time DESC"], max_results=1000)
    return [f"{run.info.run_name}  {run.data.tags['verdict']}  {run.data.tags.get('verdict_text', '')}"
            for run in runs if "verdict" in run.data.tags]


def table(rows: list[dict], phase: int) -> str:
    header = ["#", "run"] + (["score", "core"] if phase == 2 else []) + ["val_bpb", "tokens/s", "budget",
                                                                      "differs from the best"]
    lines = [header]
    best = rows[0]["params"]
    for i, row in enumerate(rows, 1):
        tps = row["tokens_per_second"]
        differs = differences(row["params"], best) + other_validation_set(row, rows[0])
        cells = [str(i), row["name"]]
        if phase == 2:
            cells += [f"{row['score']:.3f}", f"{row['core']:.4f}"]
        cells += [f"{row['val_bpb']:.4f}", f"{tps:,.0f}" if tps is not None else "-", row["budget"],
                  " ".join(differs) or ("(best)" if i == 1 else "(same config)")]
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(header) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1]
                     for line in lines)


def parse_args(argv: list[str]) -> SimpleNamespace:
    args = SimpleNamespace(experiment=TrackingConfig.experiment, top=20, phase=1, budget=None, uri=None)
    keys = ["experiment", "top", "phase", "budget", "tracking.uri", "tracking.experiment"]
    for arg in argv:  # each mistake is the `KEY=VALUE is not allowed: ...` sentence every command gives
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"{arg!r} is not allowed: arguments are key=value, such as experiment=NAME or top=20")
        if key in ("experiment", "tracking.experiment"):
            args.experiment = value
        elif key == "tracking.uri":
            args.uri = value or None
        elif key == "budget":
            args.budget = value or None
        elif key in ("top", "phase"):
            if not value.isdigit() or (key == "phase" and value not in ("1", "2")) or int(value) < 1:
                raise ValueError(f"{arg} is not allowed: {key} must be "
                                 f"{'1 or 2' if key == 'phase' else 'a positive integer'}")
            setattr(args, key, int(value))
        else:
            raise ValueError(f"{arg} is not allowed: {key_hint('frontier.leaderboard', key, keys)}")
    return args


@command
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print_help_if_asked(argv, __doc__)
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err} (usage: {USAGE.strip('`')})", file=sys.stderr)
        return 2
    uri = tracking_uri(SimpleNamespace(uri=args.uri))
    if missing_sqlite_store(uri):  # do not create an empty store just to read it
        print(f"error: tracking.uri={uri} is not allowed: there is no MLflow store there yet (train a run "
              "first, or name the store the runs went to)", file=sys.stderr)
        return 2
    try:
        probe_store(SimpleNamespace(uri=uri))
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(args.experiment)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the store answered with an error: say which, in one line
        print(f"error: tracking.uri={uri} could not be read ({error_line(err)})", file=sys.stderr)
        return 2
    if experiment is None:
        print(f"error: experiment={args.experiment!r} is not allowed: no experiment of that name in {uri}",
              file=sys.stderr)
        return 2
    rows = load_rows(client, experiment.experiment_id)
    if args.budget is not None:
        budgets = sorted({row["budget"] for row in rows})
        if rows and args.budget not in budgets:  # a typo would print an empty table
            print(f"error: budget={args.budget} is not allowed: no finished run of experiment {args.experiment!r} "
                  f"has that budget; theirs: {', '.join(budgets)}", file=sys.stderr)
            return 2
        rows = [row for row in rows if row["budget"] == args.budget]
    rows, note = rank(rows, args.phase)
    what = "val_bpb" if args.phase == 1 else "the phase-2 score (0.5 norm val_bpb + 0.5 norm core)"
    print(f"{args.experiment}: {len(rows)} finished run(s) ranked by {what}"
          + (f", budget {args.budget}" if args.budget else "") + f" ({uri})")
    if note:
        print(note)
    if rows:
        print(table(rows[:args.top], args.phase))
    groups = seed_groups(rows) if args.phase == 1 else []
    if groups:
        print(seed_table(groups[:args.top]))
    verdicts = sweep_verdicts(client, experiment.experiment_id)
    if verdicts:
        print("sweeps' verdicts (the best configuration each found, confirmed against the defaults):")
        print("\n".join(verdicts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
