"""Sweep results as data: benchmarks/sweeps.jsonl, and the sections of README.md and docs/sweeps.md made from it.

`python -m frontier.sweep_report study=NAME results=benchmarks/sweeps.jsonl` appends one JSON line for a
finished sweep (`record`): its study and preset, the command, the commit and whether the tree differed
from it, the machine it ran on (frontier.bench_results.machine: for a CPU its class and the trials'
threads), the date, the trials' wall time and training share, the trial counts, and its answer: a
confirmed sweep's verdict (frontier/verdict.py) with each configuration's runs, a frontier sweep's fit per
budget (frontier/shapes.py). `python -m frontier.sweep_results` rewrites every block between a
`<!-- sweep: PRESET -->` line and a `<!-- sweep: end -->` line from the latest row of that preset on each
machine class, and the one before it where the two disagree. `--check` changes nothing and exits 1 when
a block is out of date (tests/test_docs.py runs it).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from frontier import bench_results
from frontier.verdict import BEATS, EQUIVALENT, KEEP_DEFAULTS, UNRESOLVED

RESULTS = Path("benchmarks/sweeps.jsonl")
PAGES = (Path("README.md"), Path("docs/sweeps.md"))
START = re.compile(r"^<!-- sweep: ([\w-]+) -->$", re.M)  # a marker is a line of its own: prose may name one
END = "<!-- sweep: end -->"
END_LINE = re.compile(rf"^{END}$", re.M)
HEADLINES = {BEATS: "Use {best}: it beats the defaults.", KEEP_DEFAULTS: "Keep the defaults.",
             EQUIVALENT: "No difference that matters: keep the defaults.", UNRESOLVED: "Unresolved."}


# -----------------------------------------------------------------------------
# Recording a sweep


def where_it_ran(trials: list) -> dict:
    """The machine of the sweep's trials (this one: record on the machine that ran the sweep), with the
    threads a CPU trial had rather than this process's."""
    from frontier.device import resolve_device

    label = next((t.user_attrs["device"] for t in trials if "device" in t.user_attrs), "cpu")
    found = bench_results.machine(resolve_device(label.split()[0], "fp32"))  # "cpu (2 threads)", "cuda CUDA_..."
    threads = re.search(r"\((\d+) threads?\)", label)
    return {**found, "threads": int(threads[1])} if threads else found


def verdict_record(confirmed: dict) -> dict | None:
    """A confirmed sweep's answer: the verdict and every configuration's runs."""
    verdict = confirmed["verdict"]
    configurations = [{"label": r["label"], "params": r["params"], "values": r["values"], "tokens_seen": r["tokens"]}
                      for r in confirmed["rows"]]
    if verdict is None:
        return {"outcome": None, "configurations": configurations}
    best = verdict.best
    return {"outcome": verdict.outcome, "text": verdict.text, "best": best.label, "difference": best.difference,
            "interval": [best.low, best.high], "noise": verdict.noise, "margin": verdict.margin,
            "command": confirmed["command"], "configurations": configurations}


def frontier_record(found: dict) -> dict:
    """A frontier sweep's answer: each budget's optimum, its interval or why it has none, its command."""
    budgets = [{"seconds": seconds, "optimum_params": b["optimum_params"], "interval": b["interval"],
                "interval_problem": b["interval_problem"], "val_bpb": b["val_bpb"],
                "val_bpb_interval": b["val_bpb_interval"], "command": b["command"], "problem": b["problem"]}
               for seconds, b in sorted(found["budgets"].items())]
    return {"budgets": budgets, "validation_held": found["validation_held"]}


def record(study, report: dict, path: Path, argv: list[str]) -> dict:
    """Append the finished sweep's row (from its report, frontier.sweep_report.write_report) to `path`."""
    trials = study.get_trials(deepcopy=False)
    search = [t for t in trials if "confirm" not in t.user_attrs]
    preset = study.user_attrs.get("sweep", {}).get("name", study.study_name)
    account = report["time"] or {}
    confirmed = report["confirmation"]
    row = {"study": study.study_name, "preset": preset,
           "command": " ".join(["python -m frontier.train --multirun", f"sweep={preset}",
                                *study.user_attrs.get("overrides", [])]),
           **where_it_ran(trials),
           "wall_seconds": account.get("span"), "training_share": account.get("training_share"),
           "trials": len(search), "pruned": report["counts"].get("PRUNED", 0),
           "failed": report["counts"].get("FAIL", 0), "contended": len(study.user_attrs.get("contended", {})),
           "confirmation_runs": len(trials) - len(search),
           "verdict": verdict_record(confirmed) if confirmed else None,
           "frontier": frontier_record(report["frontier"]) if report["frontier"] else None,
           "best": None if confirmed or not report["best"] else
           {"trial": report["best"]["number"], "value": report["best"]["value"],
            "command": " ".join(["python -m frontier.train", *report["best"]["overrides"]])},
           "source": " ".join(["python -m frontier.sweep_report", *argv])}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:  # one whole line: a file other sweeps append to stays readable
        out.write(json.dumps(row) + "\n")
    return row


# -----------------------------------------------------------------------------
# The pages' sections


def latest(records: list[dict], preset: str) -> dict[str, list[dict]]:
    """Per machine class, the preset's rows newest first (by date, then by place in the file)."""
    rows = sorted(((r["date"], order, r) for order, r in enumerate(records) if r["preset"] == preset),
                  key=lambda x: x[:2], reverse=True)
    found: dict[str, list[dict]] = {}
    for _, _, r in rows:
        found.setdefault(r["machine"], []).append(r)
    return dict(sorted(found.items(), key=lambda kv: (not kv[0].startswith("CPU"), kv[0])))


def outcome(row: dict):
    """What a row answers, to compare two runs: the verdict, else each budget's nearest shape."""
    if row.get("verdict"):
        return row["verdict"]["outcome"]
    if row.get("frontier"):
        return tuple(b["command"] for b in row["frontier"]["budgets"])
    return None


def where_line(row: dict) -> str:
    cpu = row["machine"].startswith("CPU") and row.get("threads")  # a GPU row's threads are the recorder's
    threads = f", {row['threads']} thread{'s' * (row['threads'] != 1)}" if cpu else ""
    commit = f"`{(row.get('commit') or 'no commit')[:7]}`" + (" with local changes" if row.get("dirty") else "")
    minutes = f" in {row['wall_seconds'] / 60:.1f} minutes" if row.get("wall_seconds") else ""
    share = f", {row['training_share']:.0%} of it charged training" if row.get("training_share") is not None else ""
    counts = (f"{row['trials']} trials ({row['pruned']} pruned, {row['failed']} failed, {row['contended']} "
              f"contended) and {row['confirmation_runs']} confirmation runs")
    return (f"Measured on {row['machine']}{threads}, commit {commit}, {row['date']}: `{row['command']}`, "
            f"{counts}{minutes}{share}.")


def _number(value, fmt: str = ".4f") -> str:
    return "–" if value is None else format(value, fmt)


def verdict_lines(verdict: dict, where: str) -> list[str]:
    """The verdict as the result, where it was measured, and each configuration's runs."""
    if verdict["outcome"] is None:
        return ["**No verdict**: the confirmation had too few finished runs to compare.", "", where, ""]
    headline = HEADLINES[verdict["outcome"]].format(best=verdict["best"])
    lines = [f"**Result: {headline}** The verdict: {verdict['text']}.", "", where, "",
             "| configuration | val_bpb, each seed | overrides |", "|---|---|---|"]
    for c in verdict["configurations"]:
        overrides = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in c["params"].items())
        lines.append(f"| {c['label']} | {', '.join(f'{v:.4f}' for v in c['values'])} | "
                     f"{f'`{overrides}`' if overrides else '(the defaults)'} |")
    return lines + ["", f"The seeds' noise (pooled standard deviation): {verdict['noise']:.4f}."
                    + (f" The command it recommends: `{verdict['command']}`." if verdict.get("command") else ""), ""]


def frontier_lines(frontier: dict) -> list[str]:
    lines = ["| budget | optimum params (95% interval) | predicted val_bpb | nearest shape's command |",
             "|---|---|---|---|"]
    for b in frontier["budgets"]:
        if b["optimum_params"] is None:
            lines.append(f"| {b['seconds']:g} s | no optimum: {b['problem']} | – | – |")
            continue
        interval = (f"{b['interval'][0] / 1e6:.2f}M–{b['interval'][1] / 1e6:.2f}M" if b["interval"]
                    else b["interval_problem"] or "no interval")
        predicted = _number(b["val_bpb"]) + (f" ({b['val_bpb_interval'][0]:.4f}–{b['val_bpb_interval'][1]:.4f})"
                                             if b["val_bpb_interval"] else "")
        lines.append(f"| {b['seconds']:g} s | {b['optimum_params'] / 1e6:.2f}M ({interval}) | {predicted} | "
                     f"`{b['command']}` |")
    held = frontier.get("validation_held")
    return lines + [""] + ([f"Validated with new seeds: the optimum {'held' if held else 'did not hold'}.", ""]
                           if held is not None else [])


def row_lines(row: dict) -> list[str]:
    where = where_line(row)
    if row.get("verdict"):
        return verdict_lines(row["verdict"], where)
    if row.get("frontier"):
        return [where, ""] + frontier_lines(row["frontier"])
    if row.get("best"):
        best = row["best"]
        return [f"**Result**: no confirmation; the best trial, {best['trial']}, scored {best['value']:.4f} on one "
                f"seed: `{best['command']}`.", "", where, ""]
    return ["**Result**: no trial finished.", "", where, ""]


def section(records: list[dict], preset: str) -> str:
    """The block for one preset: each machine class's latest row, and the one before where they disagree."""
    machines = latest(records, preset)
    if not machines:
        return "\n".join([f"Not measured at this version yet: no `sweep={preset}` has been recorded in `{RESULTS}`.",
                          "These commands measure it and record the result:", "", "```bash",
                          f"python -m frontier.train --multirun sweep={preset}",
                          f"python -m frontier.sweep_report study={preset} results={RESULTS}",
                          "python -m frontier.sweep_results   # rewrites this section", "```"])
    lines = []
    for rows in machines.values():
        lines += row_lines(rows[0])
        if len(rows) > 1 and outcome(rows[0]) != outcome(rows[1]):
            lines += [f"**The two latest runs on {rows[0]['machine']} disagree.** The run before:", ""]
            lines += row_lines(rows[1])
        elif len(rows) > 1:
            lines += [f"The run before on this machine class ({rows[1]['date']}, commit "
                      f"`{(rows[1].get('commit') or 'no commit')[:7]}`) gave the same answer.", ""]
    return "\n".join(lines).rstrip("\n")


def with_sections(text: str, records: list[dict], where: Path) -> str:
    """`text` with every block between a `<!-- sweep: PRESET -->` line and the next `<!-- sweep: end -->` line
    rewritten."""
    parts, rest = [], text
    while (found := START.search(rest)) is not None:
        body = rest[found.end():]
        end = END_LINE.search(body)
        if end is None or START.search(body, 0, end.start()):
            raise SystemExit(f"error: {where}: {found[0]} needs a {END} line before the next section")
        parts += [rest[:found.end()], "\n", section(records, found[1]), "\n", END]
        rest = body[end.end():]
    return "".join(parts) + rest


def main(argv: list[str]) -> int:
    root = Path(next((a for a in argv if not a.startswith("-")), "."))
    results = root / RESULTS
    records = bench_results.load(results) if results.is_file() else []
    return bench_results.rewrite(root, PAGES, lambda text, page: with_sections(text, records, page),
                                 "--check" in argv, "frontier.sweep_results")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
