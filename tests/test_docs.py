"""The manual: it builds with no broken link, and its generated pages match what generates them."""
import re
import shutil
import subprocess
import sys
import typing
from dataclasses import fields, is_dataclass

from frontier import bench_results, config, sweep_results
from frontier.config_reference import render
from tests.conftest import ROOT


def mkdocs_build(config_file, site):
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config_file), "-d",
                           str(site)], cwd=config_file.parent, capture_output=True, text=True, timeout=300)


def test_the_manual_builds_strictly(tmp_path):
    done = mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    with open(tmp_path / "docs" / "index.md", "a") as page:
        page.write("\n[gone](training.md#no-such-section)\n")
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "no-such-section" in done.stderr, done.stderr


def test_the_config_reference_is_current():
    assert (ROOT / "docs" / "reference.md").read_text() == render(), (
        "docs/reference.md is out of date: python -m frontier.config_reference > docs/reference.md")


def test_the_config_reference_says_what_every_key_does():
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w.]+)` \|(.*)\|$", render(), re.M)}
    for name, annotation in typing.get_type_hints(config.Config).items():
        schema = next((t for t in (annotation, *typing.get_args(annotation)) if is_dataclass(t)), None)
        keys = [f"{name}.{f.name}" for f in fields(schema)] if schema else [name]
        for key in keys:
            assert key in rows, key
            assert rows[key].rsplit("|", 1)[-1].strip(), f"{key} has no description"
    assert "must be between 0 and 1" in rows["schedule.warmdown_fraction"]  # a range from a _fraction check
    assert "choose one of muon, adamw" in rows["optim.name"]  # from a _choice check


def test_the_benchmark_tables_are_current(capsys):
    assert bench_results.main([str(ROOT), "--check"]) == 0, capsys.readouterr().err


def test_the_sweep_sections_are_current(capsys):
    assert sweep_results.main([str(ROOT), "--check"]) == 0, capsys.readouterr().err


def test_the_benchmarks_page_shows_the_latest_row_of_each_configuration_per_machine_class():
    def row(machine, kernel, date, tokens):
        return {"machine": machine, "model": "d4", "kernel": kernel, "precision": "fp32", "threads": 1,
                "batch_tokens": 8192, "tokens_per_second": tokens, "torch": "2.13.0", "date": date, "commit": "a" * 40}

    records = [row("CPU AVX2 AMD EPYC", "reference", "2026-12-04", 100.0),
               row("CPU AVX2 AMD EPYC", "reference", "2026-12-01", 50.0),  # older, though later in the file
               row("CPU AVX2 AMD EPYC", "compiled", "2026-12-04", 120.0),
               row("NVIDIA H200", "reference", "2026-12-02", 1e6),
               row("NVIDIA H200", "reference", "2026-12-02", 2e6)]  # same day: the later line wins
    assert [(r["machine"], r["kernel"], r["tokens_per_second"]) for r in bench_results.latest(records)] == [
        ("CPU AVX2 AMD EPYC", "reference", 100.0), ("CPU AVX2 AMD EPYC", "compiled", 120.0),
        ("NVIDIA H200", "reference", 2e6)]
    summary = bench_results.summary_table(records).splitlines()
    assert len(summary) == 4 and "| compiled | 120 |" in summary[2] and "2,000,000" in summary[3]
    page = "before\n<!-- results: page -->\nold\n<!-- results: end -->\nafter\n"
    table = bench_results.page_table(records)
    assert bench_results.with_table(page, "page", table, ROOT) == (
        f"before\n<!-- results: page -->\n{table}\n<!-- results: end -->\nafter\n")


def test_the_results_record_is_well_formed():
    records = bench_results.load(ROOT / bench_results.RESULTS)
    needed = {"machine", "model", "kernel", "precision", "tokens_per_second", "torch", "date", "commit", "source"}
    assert records and all(needed <= record.keys() for record in records)


def test_readme_is_short_and_its_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target
