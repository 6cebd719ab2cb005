"""Benchmark figures as data: benchmarks/results.jsonl, and the tables made from it.

`python -m frontier.bench ... bench.results=benchmarks/results.jsonl` appends one JSON line per
measured row, with the machine it ran on (its class, CPU capability or GPU name, threads), the torch
version, the date and the commit. `python -m frontier.bench_results` rewrites the tables between the
`<!-- results: ... -->` markers of docs/benchmarks.md and README.md from that file: the latest row of
each configuration on each machine class. `--check` changes nothing and exits 1 when a table is out
of date (tests/test_docs.py runs it). How a figure moved is in the file's git history.
"""
from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path("benchmarks/results.jsonl")
PAGES = {Path("docs/benchmarks.md"): "page", Path("README.md"): "summary"}  # file -> the table it holds
END = "<!-- results: end -->"

# What makes two rows the same configuration: the latest of each is shown.
CONFIGURATION = ("machine", "model", "kernel", "precision", "threads", "batch_tokens")


def cpu_family() -> str:
    """The CPU's maker and line ("AMD EPYC", "Intel Xeon"), else its model name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = re.search(r"^model name\s*:\s*(.+)$", text, re.M)[1]
    except (OSError, TypeError):
        name = platform.processor() or platform.machine()
    for line in ("EPYC", "Ryzen", "Xeon", "Core"):
        if line in name:
            return ("AMD " if line in ("EPYC", "Ryzen") else "Intel ") + line
    return re.sub(r"\((R|TM)\)", "", name).strip()


def machine(device) -> dict:
    """Where a row was measured: its machine class and what it is made of."""
    import torch

    from frontier.device import cpu_bf16_features

    found = {"threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), **commit()}
    if device.kind == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        amx = "+AMX" if capability.startswith("AVX512") and "AMX" in cpu_bf16_features() else ""
        return {"machine": f"CPU {capability}{amx} {cpu_family()}", "cpu_capability": capability,
                "cpu_features": cpu_bf16_features(), **found}
    return {"machine": device.name, "gpu": device.name, **found}


def commit() -> dict:
    """The checkout's commit, and whether its tracked files differ from it; nothing outside a checkout."""
    from frontier import paths

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=paths.PACKAGE.parent, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD") if paths.IN_CHECKOUT else None
    if not head:
        return {"commit": None}
    return {"commit": head, "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def append(path: Path, rows: list[dict], where: dict, argv: list[str]) -> None:
    """One line per row, each written whole: a file other benchmarks append to stays readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    source = " ".join(["python -m frontier.bench", *argv])
    with path.open("a") as out:
        for row in rows:
            record = {**{k: v for k, v in row.items() if k != "profile"}, **where, "source": source}
            out.write(json.dumps(record) + "\n")
            out.flush()


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(records: list[dict]) -> list[dict]:
    """The latest row of each configuration (by date, then by place in the file), by machine class."""
    newest: dict[tuple, tuple[str, int, dict]] = {}
    for order, record in enumerate(records):
        key = tuple(record.get(k) for k in CONFIGURATION)
        if key not in newest or (record["date"], order) >= newest[key][:2]:
            newest[key] = (record["date"], order, record)
    kernels = ("reference", "compiled", "triton", "nki")
    return sorted((r for _, _, r in newest.values()),
                  key=lambda r: (not r["machine"].startswith("CPU"), r["machine"], r["model"], r["precision"],
                                 kernels.index(r["kernel"]) if r["kernel"] in kernels else len(kernels)))


def _number(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _percent(value) -> str:
    return "–" if value is None else f"{value:.1%}"


def page_table(records: list[dict]) -> str:
    lines = ["| machine class | model | kernel | dtype | threads | tokens/s | CPU s/step | vs reference | "
             "MFU | of matmul rate | torch | measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in latest(records):
        speedup = r.get("speedup_vs_reference")
        lines.append(
            f"| {r['machine']} | {r['model']} | {r['kernel']} | {r['precision']} | {_number(r['threads'], 'd')} | "
            f"{_number(r.get('tokens_per_second'), ',.0f')} | {_number(r.get('cpu_seconds_per_step'), '.2f')} | "
            f"{_number(speedup, '.2f') + '×' if speedup else '–'} | {_percent(r.get('mfu_nominal'))} | "
            f"{_percent(r.get('mfu_measured'))} | {r['torch']} | {r['date']}, "
            f"{(r.get('commit') or 'no commit')[:7]} |")
    return "\n".join(lines)


def summary_table(records: list[dict]) -> str:
    """README's table: per machine class and model, the fastest kernel's latest row."""
    best: dict[tuple, dict] = {}
    for r in latest(records):
        key = (r["machine"], r["model"])
        if key not in best or (r.get("tokens_per_second") or 0) > (best[key].get("tokens_per_second") or 0):
            best[key] = r
    lines = ["| machine class | model | fastest kernel | tokens/s | vs reference | MFU, or share of the matmul rate |",
             "|---|---|---|---|---|---|"]
    for r in best.values():
        speedup = r.get("speedup_vs_reference")
        if r.get("mfu_nominal") is not None:
            share = f"MFU {_percent(r['mfu_nominal'])}"
        elif r.get("mfu_measured") is not None:
            share = f"{_percent(r['mfu_measured'])} of the matmul rate"
        else:
            share = "–"
        threads = r.get("threads")
        setting = r["precision"] + (f", {threads} thread{'s' if threads != 1 else ''}" if threads else "")
        lines.append(f"| {r['machine']} | `{r['model']}` ({setting}) | {r['kernel']} | "
                     f"{_number(r.get('tokens_per_second'), ',.0f')} | "
                     f"{_number(speedup, '.2f') + '×' if speedup else '–'} | {share} |")
    return "\n".join(lines)


def with_table(text: str, name: str, table: str, where: Path) -> str:
    """`text` with the block between `<!-- results: NAME -->` and `<!-- results: end -->` replaced."""
    start = f"<!-- results: {name} -->"
    if text.count(start) != 1 or END not in text.split(start, 1)[1]:
        raise SystemExit(f"error: {where} needs one {start} line followed by a {END} line")
    before, rest = text.split(start, 1)
    after = rest.split(END, 1)[1]
    return f"{before}{start}\n{table}\n{END}{after}"


def rewrite(root: Path, pages, render, check: bool, command: str) -> int:
    """Each page through `render(text, page)`, written back; with `check` nothing is written, and a page
    that would change is named on stderr with exit code 1."""
    stale = []
    for page in pages:
        text = (root / page).read_text()
        new = render(text, page)
        if new != text:
            stale.append(str(page))
            if not check:
                (root / page).write_text(new)
    if check and stale:
        print(f"out of date: {', '.join(stale)}; run python -m {command}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    root = Path(next((a for a in argv if not a.startswith("-")), "."))
    records = load(root / RESULTS)
    tables = {"page": page_table(records), "summary": summary_table(records)}
    return rewrite(root, PAGES, lambda text, page: with_table(text, PAGES[page], tables[PAGES[page]], page),
                   "--check" in argv, "frontier.bench_results")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
