"""CORE for a finished run: after training (`eval.core=true`) and from the command line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from frontier.progress import RunDisplay
from frontier.trainer import train
from tests.conftest import FAST, ROOT, SHARED, command_in_process, compose_config, run_cli, spread

# one worker builds this module's fixtures once (a trained run): pytest-xdist --dist loadgroup
pytestmark = pytest.mark.xdist_group("test_eval_cli")

BUNDLE = SHARED / "data" / "core"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, wiki):
    if not (BUNDLE / "core.yaml").is_file():
        pytest.skip(f"CORE bundle not found at {BUNDLE}")
    run_dir = tmp_path_factory.mktemp("run")
    raw = compose_config([*FAST, "budget.max_steps=3", "eval.core=true", f"eval.core_bundle={BUNDLE}",
                          "eval.core_max_per_task=2", "precision=fp32"])
    train(raw, run_dir, RunDisplay(enabled=False))
    return run_dir


@pytest.mark.slow
def test_training_with_core_records_it_over_the_tasks_present(trained):
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["core_tasks"] == 18 and summary["core_tasks_total"] == 22
    assert -1.0 <= summary["core"] <= 1.0
    assert "core/arc_easy" in summary and "core/hellaswag" not in summary


@pytest.mark.slow
def test_eval_command_prints_core_and_val_bpb_of_a_checkpoint(trained):
    """Without eval.final_tokens, eval.core_max_per_task and precision it scores over the run's own settings
    (auto had picked bf16 for this fp32 run on a CPU with native bf16)."""
    result = subprocess.run(
        [sys.executable, "-m", "frontier.eval", f"checkpoint={trained / 'final.pt'}", "device=cpu",
         f"eval.core_bundle={BUNDLE}", "val_bpb=true", "tracking.enabled=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "over 18 of 22 tasks (missing: hellaswag_zeroshot, hellaswag, squad, coqa)" in result.stderr
    assert "items/s" in result.stderr and "precision fp32: precision=fp32" in result.stderr
    summary = json.loads((trained / "summary.json").read_text())
    printed = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert printed["core_tasks"] == "18" and printed["val_tokens"] == str(summary["val_tokens"])
    assert abs(float(printed["val_bpb"]) - summary["val_bpb"]) < 1e-3
    assert abs(float(printed["core"]) - summary["core"]) < 1e-3  # same items, same model


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one of checkpoint=PATH or run_id=ID"),
    (["checkpoint=/no/such/final.pt"], "checkpoint=/no/such/final.pt is not allowed: the file does not exist"),
    (["checkpoint=x.pt", "colour=red"], "colour=red is not allowed: frontier.eval has no key 'colour'"),
    (["checkpoint=x.pt", "device=tpu"], "device='tpu' is not allowed: choose one of auto, cpu, cuda, cuda:N, neuron"),
    (["checkpoint=README.md"], "checkpoint=README.md is not allowed: it is truncated, damaged or not a torch"),
    (["checkpoint=x.pt", "val_documents=0"], "val_documents=0 is not allowed: give a positive number of documents"),
])
def test_eval_command_bad_input(args, message):
    """One line: a bad checkpoint is found before the device is set up (which says its precision)."""
    result = command_in_process("frontier.eval", args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr


def test_a_bundle_without_core_yaml_fails_before_training(tmp_path):
    result = command_in_process("frontier.train", [*FAST, "eval.core=true", f"eval.core_bundle={tmp_path}",
                                                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert f"eval.core_bundle='{tmp_path}' has no core.yaml" in result.stderr
    assert not (tmp_path / "run").exists()  # found before Hydra made the run directory


def small_bundle(root: Path, task: dict | None = None, baseline: str = "50", rows: bytes | None = None,
                 labels: tuple[str, ...] = ("mc",)) -> Path:
    """A one-task CORE bundle (or several tasks on the same file), with one thing damaged at a time."""
    root.mkdir(parents=True, exist_ok=True)
    entries = []
    for label in labels:
        entry = {"label": label, "dataset_uri": "mc.jsonl", "num_fewshot": "[1]",
                 "icl_task_type": "multiple_choice", **(task or {})}
        entries.append("-\n" + "".join(f"  {k}: {v}\n" for k, v in entry.items()))
    (root / "core.yaml").write_text("icl_tasks:\n" + "".join(entries))
    (root / "eval_meta_data.csv").write_text("Eval Task,Random baseline\n" +
                                             "".join(f"{label},{baseline}\n" for label in labels))
    good = b'{"query": "q", "choices": ["a", "b"], "gold": 0}\n'
    (root / "eval_data").mkdir(exist_ok=True)
    (root / "eval_data" / "mc.jsonl").write_bytes(rows if rows is not None else good * 3)
    return root


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A real final.pt of a one-layer model, with its tokenizer beside it: made in a second, no data read."""
    from dataclasses import asdict

    from frontier.checkpoint import save_final
    from frontier.config import ModelConfig
    from frontier.model import GPT
    from frontier.tokenizer import train_tokenizer

    run_dir = tmp_path_factory.mktemp("tiny")
    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, 300)
    tokenizer.save(run_dir / "tokenizer.json")
    config = ModelConfig(depth=1, d_model=32, n_head=2, n_kv_head=2, seq_len=64)
    save_final(run_dir / "final.pt", GPT(config, tokenizer.vocab_size), {"model": asdict(config)}, tokenizer)
    return run_dir / "final.pt"


DAMAGED_BUNDLES = [  # (bundle arguments, what the sentence names)
    (dict(task={"num_fewshot": "[]"}), "core.yaml:5 gives task 'mc' num_fewshot []; it must be a whole number"),
    (dict(task={"num_fewshot": "[-2]"}), "core.yaml:5 gives task 'mc' num_fewshot [-2]"),
    (dict(task={"dataset_uri": "5"}), "core.yaml:4 gives task 'mc' dataset_uri 5; it must be a string"),
    (dict(task={"dataset_uri": "/etc/hostname"}), "core.yaml:4 gives task 'mc' the data file '/etc/hostname', outside"),
    (dict(task={"dataset_uri": "../core.yaml"}), "core.yaml:4 gives task 'mc' the data file '../core.yaml', outside"),
    (dict(baseline="100"), "eval_meta_data.csv:2 gives task 'mc' the Random baseline 100; it must be a percentage"),
    (dict(baseline="nan"), "eval_meta_data.csv:2 gives task 'mc' the Random baseline nan"),
    (dict(labels=("mc", "mc")), "core.yaml:8 repeats the task label 'mc'"),
    (dict(rows=b'{"query": "q", "choices": ["a", "b"], "gold": 0}\n{"query": "\xff"}\n'),
     "mc.jsonl:2 is not valid UTF-8"),
]


@pytest.mark.parametrize("damage, names", spread(DAMAGED_BUNDLES, [n.split(" ", 1)[1][:40] for _, n in DAMAGED_BUNDLES],
                                                 every=3))
def test_eval_refuses_a_damaged_core_bundle_in_one_sentence(tiny_checkpoint, tmp_path, damage, names):
    # each of these was a traceback after scoring (a baseline of 100), a CORE of nan, or a task silently left out
    bundle = small_bundle(tmp_path / "bundle", **damage)
    result = command_in_process("frontier.eval", [f"checkpoint={tiny_checkpoint}", "device=cpu",
                                                  f"eval.core_bundle={bundle}", "tracking.enabled=false"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert lines[-1].startswith(f"error: eval.core_bundle='{bundle}' is not allowed: {bundle}"), result.stderr
    assert names in lines[-1] and "Traceback" not in result.stderr, result.stderr
    assert "core:" not in result.stdout  # found before any figure is computed


def test_the_small_bundle_itself_scores(tiny_checkpoint, tmp_path):
    result = subprocess.run([sys.executable, "-m", "frontier.eval", f"checkpoint={tiny_checkpoint}", "device=cpu",
                             f"eval.core_bundle={small_bundle(tmp_path)}", "tracking.enabled=false"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "core_tasks: 1" in result.stdout, result.stderr


def test_a_damaged_bundle_fails_before_training(tmp_path):
    # found after the whole budget, it failed the trained run and its summary lost the final val_bpb
    bundle = small_bundle(tmp_path / "bundle", rows=b'{"query": "q", "choices": ["a"], "gold": 0}\n{oops\n')
    result = run_cli([*FAST, "budget.max_steps=2", "eval.core=true", f"eval.core_bundle={bundle}",
                      f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: eval.core_bundle='{bundle}' is not allowed: {bundle / 'eval_data' / 'mc.jsonl'}:2 is not valid "
        "JSON (Expecting property name enclosed in double quotes).")
    assert not (tmp_path / "run").exists()  # found before Hydra made the run directory


def another_runs_tokenizer(folder: Path) -> None:
    from frontier.tokenizer import train_tokenizer

    train_tokenizer(["a different corpus, a different vocabulary"] * 20, 280).save(folder / "tokenizer.json")


SIDE_FILE_DAMAGE = [  # (file beside final.pt, how it is damaged, what the sentence says)
    ("tokenizer.json", lambda folder: (folder / "tokenizer.json").write_text('{"model": {'),
     "its tokenizer {folder}/tokenizer.json is damaged or not a tokenizer"),
    ("tokenizer.json", another_runs_tokenizer,
     "its tokenizer {folder}/tokenizer.json is not the one the model was trained with"),
    ("summary.json", lambda folder: (folder / "summary.json").write_text("[1, 2]"),
     "its {folder}/summary.json is not a run's summary (a JSON list, not an object)"),
]


@pytest.mark.parametrize("file, damage, says", SIDE_FILE_DAMAGE, ids=["damaged tokenizer", "foreign tokenizer",
                                                                      "summary not an object"])
def test_eval_refuses_a_damaged_or_foreign_file_beside_the_checkpoint(tiny_checkpoint, tmp_path, file, damage, says):
    # a damaged one was a traceback; another run's tokenizer scored CORE silently wrong, and logged it
    import shutil

    for name in ("final.pt", "tokenizer.json"):
        shutil.copy(tiny_checkpoint.parent / name, tmp_path / name)
    damage(tmp_path)
    result = command_in_process("frontier.eval", [f"checkpoint={tmp_path / 'final.pt'}", "device=cpu",
                                                  f"eval.core_bundle={small_bundle(tmp_path / 'bundle')}"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith(f"error: checkpoint={tmp_path / 'final.pt'} is not allowed: "
                                f"{says.format(folder=tmp_path)}"), result.stderr
    assert "core:" not in result.stdout


def test_a_checkpoint_whose_tokenizer_is_missing_is_a_clear_error(tiny_checkpoint, tmp_path):
    import shutil

    shutil.copy(tiny_checkpoint, tmp_path / "final.pt")
    result = command_in_process("frontier.eval", [f"checkpoint={tmp_path / 'final.pt'}", "device=cpu",
                                                  "tracking.enabled=false"])
    assert result.returncode == 2
    assert f"the tokenizer of checkpoint {tmp_path / 'final.pt'} is missing" in result.stderr


@pytest.mark.slow
def test_eval_by_run_id_logs_core_to_that_mlflow_run(wiki, tmp_path, mlflow_store):
    from mlflow import MlflowClient

    uri = mlflow_store
    raw = compose_config([*FAST, "budget.max_steps=2", "tracking.enabled=true", f"tracking.uri={uri}",
                          "eval.core=true", f"eval.core_bundle={BUNDLE}", "eval.core_max_per_task=2"])
    train(raw, tmp_path / "run", RunDisplay(enabled=False))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    run_id = summary["mlflow_run_id"]
    result = subprocess.run(
        [sys.executable, "-m", "frontier.eval", f"run_id={run_id}", f"tracking.uri={uri}", "device=cpu",
         f"eval.core_bundle={BUNDLE}", "eval.core_max_per_task=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert f"logged to MLflow run {run_id}" in result.stdout
    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    assert metrics["core_tasks"] == 18 and "core" in metrics and "core/arc_easy" in metrics
    # The later figure is the run's value, not hidden behind the one the training logged at its last step
    printed = {line.split(": ")[0]: float(line.split(": ")[1]) for line in result.stdout.splitlines()
               if line.startswith(("core: ", "core/arc_easy: "))}
    assert printed["core"] != pytest.approx(summary["core"], abs=1e-4), "pick settings whose CORE differs"
    assert metrics["core"] == pytest.approx(printed["core"], abs=1e-4)  # printed to 4 places
    assert metrics["core/arc_easy"] == pytest.approx(printed["core/arc_easy"], abs=1e-4)
    metrics_before = len(MlflowClient(uri).get_metric_history(run_id, "core"))

    def evaluate(*args):
        return subprocess.run([sys.executable, "-m", "frontier.eval", f"checkpoint={tmp_path / 'run' / 'final.pt'}",
                               "device=cpu", f"eval.core_bundle={BUNDLE}", "eval.core_max_per_task=1", *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    # By checkpoint, with no tracking.uri: into the store the run recorded, not the default one
    result = evaluate()
    assert result.returncode == 0 and f"logged to MLflow run {run_id}" in result.stdout, result.stderr
    assert len(MlflowClient(uri).get_metric_history(run_id, "core")) == metrics_before + 1
    # A store that does not hold the run: the figures are printed, then one line says they were not logged
    other = f"sqlite:///{tmp_path / 'other.db'}"
    result = evaluate(f"tracking.uri={other}")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "core_tasks: 18" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: not logged to MLflow run {run_id} in {other} (FileNotFoundError: there is no MLflow store at "
        f"{tmp_path / 'other.db'}); the figures above are the result")
    assert not (tmp_path / "other.db").exists()  # a mistyped store is not made just to fail


@pytest.fixture(scope="module")
def seed_runs(tmp_path_factory, wiki):
    """Two configurations trained with two seeds each, a few steps."""
    root = tmp_path_factory.mktemp("seeds")
    for scale in ("1.0", "0.5"):
        for seed in (1, 2):
            raw = compose_config([*FAST, "budget.max_steps=3", "eval.every_fraction=0", "eval.final_tokens=2048",
                                  "eval.checkpoint_tokens=256", "precision=fp32", f"optim.lr_scale={scale}",
                                  f"seed={seed}"])
            train(raw, root / f"lr{scale}-seed{seed}", RunDisplay(enabled=False))
    return root


def spread_figures(run_dir: Path, documents: int) -> dict:
    from frontier.checkpoint import load_for_eval, load_tokenizer, read_checkpoint
    from frontier.config import EvalConfig
    from frontier.device import resolve_device
    from frontier.eval import validation_bpb

    final = run_dir / "final.pt"
    return validation_bpb(read_checkpoint(final, "checkpoint=")["config"], load_for_eval(final, "cpu"),
                          load_tokenizer(final), resolve_device("cpu", "fp32"), EvalConfig(), documents)


@pytest.mark.slow
def test_eval_scores_a_checkpoint_on_a_number_of_spread_documents(seed_runs):
    run = seed_runs / "lr1.0-seed1"
    result = command_in_process("frontier.eval", [f"checkpoint={run / 'final.pt'}", "core=false", "val_documents=30",
                                                  "device=cpu", "precision=fp32", "tracking.enabled=false"])
    assert result.returncode == 0, result.stderr
    printed = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    expected = spread_figures(run, 30)
    assert printed["val_documents"] == "30" and printed["val_fingerprint"] == expected["val_fingerprint"]
    assert float(printed["val_bpb"]) == pytest.approx(expected["val_bpb"], abs=1e-4)
    summary = json.loads((run / "summary.json").read_text())
    assert expected["val_fingerprint"] != summary["val_fingerprint"]  # another set than the run's own


@pytest.mark.slow
def test_val_spread_compares_the_seed_spread_on_the_runs_sets_and_on_spread_documents(seed_runs):
    result = subprocess.run([sys.executable, "-m", "frontier.val_spread", str(seed_runs), "documents=30", "device=cpu",
                             "precision=fp32"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    groups = [line for line in lines if "2 seed(s)" in line]
    # found in folder order: lr0.5 first, then lr1.0, which differs from it in optim.lr_scale
    assert len(groups) == 2 and "(the first configuration)" in groups[0] and "optim.lr_scale=1.0" in groups[1]
    runs = {run.name: json.loads((run / "summary.json").read_text())["val_bpb"] for run in seed_runs.iterdir()}
    spread = {name: spread_figures(seed_runs / name, 30)["val_bpb"] for name in runs}
    own_mean = (runs["lr1.0-seed1"] + runs["lr1.0-seed2"]) / 2
    spread_mean = (spread["lr1.0-seed1"] + spread["lr1.0-seed2"]) / 2
    assert groups[1].startswith(f"{own_mean:.4f} (") and f"| {spread_mean:.4f} (" in groups[1]
    same = (runs["lr1.0-seed1"] + runs["lr1.0-seed2"] < runs["lr0.5-seed1"] + runs["lr0.5-seed2"]) == \
        (spread["lr1.0-seed1"] + spread["lr1.0-seed2"] < spread["lr0.5-seed1"] + spread["lr0.5-seed2"])
    assert lines[-1] == "order of the configurations: " + ("the same on both" if same else "differs")
    assert any(line.startswith("mean sd across seeds: ") for line in lines)


@pytest.mark.parametrize("args, message", [
    ([], "give at least one run folder"),
    (["/no/such/folder"], "/no/such/folder is not allowed: it is not a folder"),
    (["README.md", "documents=0"], "README.md is not allowed"),
    ([".", "documents=0"], "documents=0 is not allowed: documents must be a positive integer"),
    ([".", "colour=red"], "colour=red is not allowed: frontier.val_spread has no key 'colour'"),
    (["docs"], "no finished run (final.pt beside a FINISHED summary.json) under docs"),
])
def test_val_spread_bad_input(args, message):
    result = command_in_process("frontier.val_spread", args)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {message}"), result.stderr
