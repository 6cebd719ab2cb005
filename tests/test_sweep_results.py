"""A finished sweep's result as data (frontier/sweep_results.py): the row `sweep_report results=` appends,
and the pages' sections generated from the rows."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import optuna
import pytest
from optuna.trial import create_trial

from frontier import sweep_results
from frontier.study import open_storage
from frontier.sweep_report import write_report
from frontier.verdict import BEATS, KEEP_DEFAULTS, UNRESOLVED
from hydra_plugins.frontier_sweeper._confirm import BASELINE
from tests.conftest import ROOT
from tests.test_shapes import DEPTHS, LR_SCALES, frontier_study, grid_trial
from tests.test_verdict import SPACE, confirm, noisy, planned

MEANS = {KEEP_DEFAULTS: {BASELINE: 1.98, "trial 0": 2.02, "trial 1": 2.03},
         UNRESOLVED: {BASELINE: 1.98, "trial 0": 1.98, "trial 1": 1.981},
         BEATS: {BASELINE: 1.98, "trial 0": 1.94, "trial 1": 1.96}}
SD = {KEEP_DEFAULTS: 0.003, UNRESOLVED: 0.01, BEATS: 0.003}


def confirmed_study(outcome: str, storage=None) -> optuna.Study:
    """A showcase study whose search ran on 3 CPU threads and whose confirmation reached `outcome`."""
    study = optuna.create_study(study_name="showcase", storage=storage)
    study.set_user_attr("sweep", {"name": "showcase"})
    study.set_user_attr("overrides", ["model=tiny"])
    means = MEANS[outcome]
    for i, value in enumerate([means["trial 0"], means["trial 1"]]):
        lr = 0.01 * (i + 1)
        study.add_trial(create_trial(value=value, params={"optim.matrix_lr": lr}, distributions=SPACE,
                                     user_attrs={"overrides": ["model=tiny", f"optim.matrix_lr={lr}"],
                                                 "device": "cpu (3 threads)"}))
    confirm(study, planned(study, 3, 4), noisy(means, SD[outcome]))
    return study


def recorded(study: optuna.Study, tmp_path) -> dict:
    return sweep_results.record(study, write_report(study, tmp_path / study.study_name), tmp_path / "sweeps.jsonl",
                                ["study=showcase"])


# -- recording: through the command ------------------------------------------------------------------------


def sweep_report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontier.sweep_report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_the_report_command_appends_the_sweeps_verdict_and_where_it_ran(tmp_path):
    journal = tmp_path / "study.journal"
    confirmed_study(KEEP_DEFAULTS, open_storage(str(journal)))
    results = tmp_path / "benchmarks" / "sweeps.jsonl"
    args = ["study=showcase", f"storage={journal}", f"out={tmp_path / 'report'}", f"results={results}"]
    for _ in range(2):
        done = sweep_report(*args)
        assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 2 and rows[0].keys() == rows[1].keys()  # appended, never rewritten
    row = rows[-1]
    assert row["study"] == row["preset"] == "showcase"
    assert row["command"] == "python -m frontier.train --multirun sweep=showcase model=tiny"
    assert row["machine"].startswith("CPU ") and row["threads"] == 3  # the trials' threads, not this process's
    assert len(row["commit"]) == 40 and isinstance(row["dirty"], bool) and row["date"]
    assert (row["trials"], row["pruned"], row["failed"], row["contended"], row["confirmation_runs"]) == (2, 0, 0, 0, 9)
    assert row["training_share"] is not None and row["wall_seconds"] is not None
    verdict = row["verdict"]
    assert verdict["outcome"] == KEEP_DEFAULTS and verdict["text"].startswith("keep the defaults")
    assert verdict["difference"] > 0 and 0 < verdict["interval"][0] < verdict["interval"][1]
    assert verdict["noise"] > 0 and verdict["command"] == "python -m frontier.train model=tiny"
    assert [c["label"] for c in verdict["configurations"]] == [BASELINE, "trial 0", "trial 1"]
    assert verdict["configurations"][1]["params"] == {"optim.matrix_lr": 0.01}
    assert all(len(c["values"]) == 3 and c["tokens_seen"] == [1_250_000] * 3 for c in verdict["configurations"])
    assert row["frontier"] is None and row["best"] is None
    assert row["source"] == "python -m frontier.sweep_report " + " ".join(args)
    assert f"recorded in {results}" in done.stdout


def test_a_results_file_that_cannot_be_written_is_one_sentence(tmp_path):
    journal = tmp_path / "study.journal"
    confirmed_study(KEEP_DEFAULTS, open_storage(str(journal)))
    (tmp_path / "a-file").write_text("")
    done = sweep_report("study=showcase", f"storage={journal}", f"out={tmp_path / 'report'}",
                        f"results={tmp_path / 'a-file' / 'sweeps.jsonl'}")
    assert done.returncode == 2 and done.stderr.startswith("error: results=") and len(done.stderr.splitlines()) == 1
    assert not (tmp_path / "report").exists()


# -- the pages' sections ------------------------------------------------------------------------------------


def test_with_no_row_the_section_says_it_is_not_measured_and_how_to_measure_it():
    text = sweep_results.section([], "showcase")
    assert text.startswith("Not measured at this version yet")
    assert "python -m frontier.train --multirun sweep=showcase\n" in text
    assert "python -m frontier.sweep_report study=showcase results=benchmarks/sweeps.jsonl\n" in text
    assert "Result" not in text


def test_keep_defaults_is_printed_as_the_result_with_commit_machine_and_date(tmp_path):
    row = recorded(confirmed_study(KEEP_DEFAULTS), tmp_path)
    text = sweep_results.section([row], "showcase")
    assert "**Result: Keep the defaults.** The verdict: keep the defaults: every configuration" in text
    assert f"Measured on {row['machine']}, 3 threads, commit `{row['commit'][:7]}" in text and row["date"] in text
    assert "| baseline | 1.98" in text and "(the defaults) |" in text and "| trial 0 | 2.02" in text
    assert "The command it recommends: `python -m frontier.train model=tiny`" in text
    assert sweep_results.section([row], "frontier").startswith("Not measured")  # another preset's row


def test_an_unresolved_verdict_is_printed_with_how_to_settle_it(tmp_path):
    text = sweep_results.section([recorded(confirmed_study(UNRESOLVED), tmp_path)], "showcase")
    assert "**Result: Unresolved.** The verdict: unresolved: the best, trial 0" in text
    assert "sweep.confirm_max=" in text and "The command it recommends" not in text


def test_a_winner_is_printed_with_its_command(tmp_path):
    text = sweep_results.section([recorded(confirmed_study(BEATS), tmp_path)], "showcase")
    assert "**Result: Use trial 0: it beats the defaults.**" in text
    assert "`optim.matrix_lr=0.01` |" in text
    assert "The command it recommends: `python -m frontier.train model=tiny optim.matrix_lr=0.01`" in text


def test_two_latest_runs_that_disagree_are_both_shown_and_said_to_disagree(tmp_path):
    first = {**recorded(confirmed_study(BEATS), tmp_path), "date": "2026-12-01"}
    second = {**recorded(confirmed_study(KEEP_DEFAULTS), tmp_path), "date": "2026-12-02"}
    older = {**first, "date": "2026-11-01"}  # the third latest: not shown
    text = sweep_results.section([second, older, first], "showcase")
    assert "disagree" in text and text.index("Keep the defaults.") < text.index("disagree") < text.index("Use trial 0")
    assert text.index("2026-12-02") < text.index("disagree") < text.index("2026-12-01") and "2026-11-01" not in text
    assert text.count("Measured on") == 2
    again = {**second, "date": "2026-12-03"}
    agreeing = sweep_results.section([first, second, again], "showcase")
    assert "disagree" not in agreeing and agreeing.count("Measured on") == 1
    assert "The run before on this machine class (2026-12-02" in agreeing and "gave the same answer" in agreeing
    elsewhere = {**first, "machine": "NVIDIA H200"}  # another machine class: its own result
    both = sweep_results.section([second, elsewhere], "showcase")
    assert "disagree" not in both and both.index("Keep the defaults.") < both.index("NVIDIA H200")
    assert "Measured on NVIDIA H200, commit" in both


def test_a_frontier_row_gives_each_budgets_optimum_interval_and_command(tmp_path):
    grid = [grid_trial(d, s, t) for t in (60.0, 240.0) for d in DEPTHS for s in LR_SCALES]
    study = frontier_study(grid)
    study.set_user_attr("sweep", {"name": "frontier"})
    report = write_report(study, tmp_path / "report")
    row = sweep_results.record(study, report, tmp_path / "sweeps.jsonl", ["study=shapes"])
    assert row["verdict"] is None and [b["seconds"] for b in row["frontier"]["budgets"]] == [60.0, 240.0]
    text = sweep_results.section([row], "frontier")
    for budget in row["frontier"]["budgets"]:
        low, high = budget["interval"]
        assert (f"| {budget['seconds']:g} s | {budget['optimum_params'] / 1e6:.2f}M ({low / 1e6:.2f}M–"
                f"{high / 1e6:.2f}M) | {budget['val_bpb']:.4f}") in text
        assert f"`{budget['command']}` |" in text
    unbracketed = {**row["frontier"]["budgets"][0], "interval": None, "interval_problem": "not bracketed: extend"}
    text = sweep_results.section([{**row, "frontier": {"budgets": [unbracketed], "validation_held": None}}], "frontier")
    assert "M (not bracketed: extend) |" in text


# -- the pages, through the command ---------------------------------------------------------------------------


def generate(root, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontier.sweep_results", str(root), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_check_fails_when_a_section_is_out_of_date_and_the_command_brings_it_up_to_date(tmp_path):
    for page in sweep_results.PAGES:
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    assert generate(tmp_path, "--check").returncode == 0  # no rows: the pages say so already
    row = recorded(confirmed_study(KEEP_DEFAULTS), tmp_path)
    (tmp_path / sweep_results.RESULTS).parent.mkdir(parents=True)
    (tmp_path / sweep_results.RESULTS).write_text(json.dumps(row) + "\n")
    stale = generate(tmp_path, "--check")
    assert stale.returncode == 1 and "out of date: README.md, docs/sweeps.md" in stale.stderr
    assert "Keep the defaults" not in (tmp_path / "README.md").read_text()  # --check changes nothing
    assert generate(tmp_path).returncode == 0 and generate(tmp_path, "--check").returncode == 0
    for page in sweep_results.PAGES:
        showcase = (tmp_path / page).read_text().split("<!-- sweep: showcase -->")[1].split("<!-- sweep: end -->")[0]
        assert "**Result: Keep the defaults.**" in showcase


def test_only_a_marker_on_a_line_of_its_own_opens_a_section_and_one_without_its_end_is_refused():
    prose = "a `<!-- sweep: PRESET -->` line and a `<!-- sweep: end -->` line\n"
    assert sweep_results.with_sections(prose, [], ROOT / "README.md") == prose
    with pytest.raises(SystemExit, match="needs a <!-- sweep: end --> line"):
        sweep_results.with_sections("<!-- sweep: showcase -->\nold\n<!-- sweep: frontier -->\n<!-- sweep: end -->",
                                    [], ROOT / "README.md")
