"""`python -m frontier.val_spread RUN_DIR ... [documents=800] [device=auto] [precision=auto] [batch_rows=8]`

How much of the spread between seeds is the validation set's. Finished runs (folders holding final.pt
and summary.json; a folder of them, such as a sweep's, is searched) are grouped by configuration (their
config but for `seed` and bookkeeping). For each configuration it prints the mean and standard deviation
across seeds of val_bpb on each run's own set (its summary.json) and on the first `documents` of the
validation split's spread order, then whether the configurations rank in the same order on both.
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from frontier.cli import command, print_help_if_asked
from frontier.config import ConfigError, EvalConfig, check_device, key_hint

USAGE = __doc__.splitlines()[0]
KEYS = ("documents", "device", "precision", "batch_rows")


@dataclass
class Args:
    runs: list[Path]
    documents: int = 800
    device: str = "auto"
    precision: str = "auto"
    batch_rows: int = 8


def parse(argv: list[str]) -> Args:
    args = Args(runs=[])
    for arg in argv:
        key, equals, value = arg.partition("=")
        if not equals:
            path = Path(arg)
            if not path.is_dir():
                raise ConfigError(f"{arg} is not allowed: it is not a folder (give run folders, or a folder of them)")
            args.runs.append(path)
        elif key in ("documents", "batch_rows"):
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{arg} is not allowed: {key} must be a positive integer")
            setattr(args, key, int(value))
        elif key in ("device", "precision"):
            setattr(args, key, value)
        else:
            raise ConfigError(f"{arg} is not allowed: {key_hint('frontier.val_spread', key, list(KEYS))}")
    if not args.runs:
        raise ConfigError("give at least one run folder, or a folder of them (a sweep's)")
    check_device(args.device)
    return args


def read_summary(run: Path) -> dict:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):  # none, or damaged: not a finished run
        return {}


def finished_runs(folders: list[Path]) -> list[Path]:
    """The run folders under `folders` whose run finished and left final.pt."""
    found = []
    for folder in folders:
        for final in sorted([folder / "final.pt"] if (folder / "final.pt").is_file() else folder.rglob("final.pt")):
            if read_summary(final.parent).get("status") == "FINISHED":
                found.append(final.parent)
    return found


def configuration(saved: dict) -> tuple:
    """What a run computes but for its seed: the key its seeds are grouped by."""
    from frontier.leaderboard import IGNORED_PREFIXES
    from frontier.store import flatten

    return tuple(sorted((k, v) for k, v in flatten(saved).items()
                        if k != "seed" and not k.startswith((*IGNORED_PREFIXES, "eval.", "resume"))))


def measure(args: Args) -> list[dict]:
    """Per configuration: its runs' val_bpb on their own sets and on the spread documents."""
    from frontier.checkpoint import load_for_eval, load_tokenizer, read_checkpoint
    from frontier.device import resolve_device
    from frontier.eval import validation_bpb

    runs = finished_runs(args.runs)
    if not runs:
        raise ConfigError(f"no finished run (final.pt beside a FINISHED summary.json) under "
                          f"{', '.join(map(str, args.runs))}")
    device = resolve_device(args.device, args.precision)
    groups: dict[tuple, dict] = {}
    for run in runs:
        saved = read_checkpoint(run / "final.pt", "checkpoint=")["config"]
        model = load_for_eval(run / "final.pt", device.torch_device)
        spread = validation_bpb(saved, model, load_tokenizer(run / "final.pt"), device,
                                EvalConfig(batch_rows=args.batch_rows), args.documents)
        group = groups.setdefault(configuration(saved), {"runs": [], "own": [], "spread": [], "params": saved})
        group["runs"].append(run)
        group["own"].append(read_summary(run)["val_bpb"])
        group["spread"].append(spread["val_bpb"])
        print(f"{run}: val_bpb {group['own'][-1]:.4f} on its set, {spread['val_bpb']:.4f} +- "
              f"{spread['val_bpb_se'] or 0:.4f} on {spread['val_documents']} spread documents", file=sys.stderr)
    return list(groups.values())


def report(groups: list[dict], documents: int) -> str:
    from frontier.leaderboard import differences
    from frontier.store import flatten

    def sd(values: list[float]) -> str:
        return f"{statistics.stdev(values):.4f}" if len(values) > 1 else "-"

    first = flatten(groups[0]["params"])
    lines = [f"val_bpb per configuration: mean (sd across seeds) on each run's own set | on {documents} spread "
             "documents"]
    for group in groups:
        changed = [d for d in differences(flatten(group["params"]), first) if not d.startswith("seed=")]
        lines.append(f"{statistics.fmean(group['own']):.4f} ({sd(group['own'])}) | "
                     f"{statistics.fmean(group['spread']):.4f} ({sd(group['spread'])})  {len(group['runs'])} seed(s)  "
                     + (" ".join(changed) or "(the first configuration)"))
    own = sorted(range(len(groups)), key=lambda i: statistics.fmean(groups[i]["own"]))
    spread = sorted(range(len(groups)), key=lambda i: statistics.fmean(groups[i]["spread"]))
    several = [g for g in groups if len(g["runs"]) > 1]
    if several:
        lines.append(f"mean sd across seeds: {statistics.fmean(statistics.stdev(g['own']) for g in several):.4f} "
                     f"on the runs' own sets, {statistics.fmean(statistics.stdev(g['spread']) for g in several):.4f} "
                     f"on {documents} spread documents")
    lines.append("order of the configurations: " + ("the same on both" if own == spread else "differs"))
    return "\n".join(lines)


@command
def main(argv: list[str] | None = None) -> int:
    from frontier.data import DataError

    argv = sys.argv[1:] if argv is None else argv
    print_help_if_asked(argv, __doc__)
    try:
        args = parse(argv)
        print(report(measure(args), args.documents))
    except (ConfigError, DataError) as err:
        print(f"error: {err} (usage: {USAGE.strip('`')})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
