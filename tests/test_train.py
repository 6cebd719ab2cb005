"""End to end on the real Wikipedia shards with the tiny model."""
import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from frontier import data as data_module
from frontier import load_for_eval
from frontier.checkpoint import load_tokenizer
from frontier.config import to_config
from frontier.data import load_corpus, load_tokenizer as data_tokenizer, resolve_splits, validation_set
from frontier.device import resolve_device
from frontier.evaluate import val_bpb
from frontier.model import GPT
from frontier.progress import RunDisplay
from frontier.trainer import train
from tests.conftest import FAST, command_in_process, compose_config, gc_probe, gc_records, run_cli

SUMMARY_KEYS = {"val_bpb", "params", "flops_per_token", "steps", "tokens_seen", "tokens_per_second", "mfu",
                "budget_seconds", "charged_seconds", "excluded_seconds", "budget_utilization", "device", "status"}


def run_validation_set(raw):
    config = to_config(raw)
    train_split, val_split = resolve_splits(config.data)
    tokenizer = data_tokenizer(config.data, train_split)
    corpus = load_corpus(val_split, tokenizer, config.data, "val")
    return tokenizer, validation_set(corpus, tokenizer, config.model.seq_len, config.eval.final_tokens)


@pytest.mark.slow
def test_a_short_tiny_run_learns_and_leaves_a_loadable_checkpoint(wiki, tmp_path):
    seconds = 10  # about a hundred steps of tiny on a 2-core CPU
    raw = compose_config([*FAST, f"budget.seconds={seconds}", "eval.every_fraction=0.25"])
    bpb = train(raw, tmp_path, RunDisplay(enabled=False))

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["status"] == "FINISHED" and summary["val_bpb"] == bpb
    assert summary["charged_seconds"] >= seconds and summary["budget_utilization"] >= 1.0
    assert summary["steps"] > 5 and summary["tokens_seen"] == summary["steps"] * 2048

    tokenizer, vset = run_validation_set(raw)
    assert summary["val_fingerprint"] == vset.fingerprint() and summary["val_documents"] == len(vset.documents)
    assert 0 < summary["val_bpb_se"] < 0.2  # the evaluation's own noise, over its documents
    device = resolve_device("cpu", summary["precision"])  # as the run measured it
    torch.manual_seed(0)
    untrained = GPT(to_config(raw).model, tokenizer.vocab_size)
    untrained_bpb = val_bpb(untrained, vset, tokenizer.token_bytes, device, batch_rows=8).val_bpb
    assert bpb < untrained_bpb - 0.5, (bpb, untrained_bpb)

    model = load_for_eval(tmp_path / "final.pt", "cpu")
    reloaded = val_bpb(model, vset, tokenizer.token_bytes, device, batch_rows=8)
    assert math.isclose(reloaded.val_bpb, bpb, rel_tol=1e-3) and math.isclose(reloaded.se, summary["val_bpb_se"], rel_tol=1e-2)
    assert load_tokenizer(tmp_path / "final.pt").fingerprint() == tokenizer.fingerprint()
    with torch.no_grad():
        logits = model(vset.rows[:1, :-1])
    assert logits.shape == (1, 256, tokenizer.vocab_size) and logits.dtype == torch.float32


@pytest.mark.slow
def test_a_second_run_reuses_the_tokenizer_and_token_caches(wiki, tmp_path, monkeypatch):
    raw = compose_config([*FAST, "budget.max_steps=2"])
    train(raw, tmp_path / "first", RunDisplay(enabled=False))
    monkeypatch.setattr(data_module, "train_tokenizer", lambda *a: pytest.fail("tokenizer retrained"))
    monkeypatch.setattr(data_module, "_build_corpus", lambda *a: pytest.fail("corpus rebuilt"))
    started = time.perf_counter()
    train(raw, tmp_path / "second", RunDisplay(enabled=False))
    summary = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert summary["status"] == "FINISHED"
    assert 0 < summary["startup_seconds"] < time.perf_counter() - started  # from this train() call, not import


def test_checkpoints_are_reported_at_budget_fractions(wiki, tmp_path, monkeypatch):
    from frontier import lifecycle

    seen = []

    class Recorder:
        def on_checkpoint(self, k, bpb, step, progress):
            seen.append((k, step, round(progress, 3)))

    monkeypatch.setattr(lifecycle, "for_run", lambda run: [Recorder()])
    raw = compose_config([*FAST, "budget.max_steps=8", "eval.every_fraction=0.25"])
    train(raw, tmp_path, RunDisplay(enabled=False))
    assert seen == [(1, 2, 0.25), (2, 4, 0.5), (3, 6, 0.75)]


def test_a_step_that_crosses_two_marks_reports_each_with_one_evaluation(wiki, tmp_path, monkeypatch):
    from frontier import lifecycle

    seen = []

    class Recorder:
        def on_checkpoint(self, k, bpb, step, progress):
            seen.append((k, step, round(progress, 3), bpb))

    monkeypatch.setattr(lifecycle, "for_run", lambda run: [Recorder()])
    raw = compose_config([*FAST, "budget.max_steps=3", "eval.every_fraction=0.2"])
    train(raw, tmp_path, RunDisplay(enabled=False))
    # marks 0.2 | 0.4 and 0.6 | (0.8 falls in the last step, which the final evaluation covers)
    assert [s[:3] for s in seen] == [(1, 1, 0.333), (2, 2, 0.667), (3, 2, 0.667)]
    assert seen[1][3] == seen[2][3]


def test_compile_only_runs_the_excluded_steps_and_ends_compiled(wiki, tmp_path):
    raw = compose_config([*FAST, "compile_only=true", "budget.excluded_steps=2"])
    assert math.isnan(train(raw, tmp_path, RunDisplay(enabled=False)))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "COMPILED" and summary["steps"] == 2 and summary["val_bpb"] is None
    assert not (tmp_path / "final.pt").exists()


def test_each_rank_must_get_whole_micro_batches():
    from frontier.config import ConfigError
    from frontier.trainer import check_micro_batches

    config = to_config(compose_config(["model=tiny", "train.batch_tokens=12288", "train.device_batch_rows=16"]))
    check_micro_batches(config, 1)  # 48 rows: three micro-batches of 16
    with pytest.raises(ConfigError, match=r"train.device_batch_rows=16 is not allowed: each of the 2 rank\(s\) gets "
                                          r"24 rows per step \(train.batch_tokens=12288 / model.seq_len=256 / 2\)"):
        check_micro_batches(config, 2)  # 24 rows each: 16 + 8 would mis-scale the gradient
    check_micro_batches(to_config(compose_config(["model=tiny", "train.batch_tokens=4096",
                                                  "train.device_batch_rows=16"])), 2)  # 8 rows: one micro-batch


@pytest.mark.slow
def test_user_mistakes_at_launch_are_one_sentence_and_touch_no_store(tmp_path):
    store = tmp_path / "mlflow.db"
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "resume.pt").write_bytes(b"PK\x03\x04 half a zip file")
    (tmp_path / "a_file").write_text("not a database")
    tracked = [*FAST, "tracking.enabled=true", f"tracking.uri=sqlite:///{store}"]
    foreign = f"resume={tmp_path / 'foreign'}"
    cases = [
        (["resume=/nonexistent/run"], "resume=/nonexistent/run is not allowed: /nonexistent/run does not exist"),
        ([f"resume={'0' * 32}", f"tracking.uri=sqlite:///{store}", f"hydra.run.dir={tmp_path / 'new'}"], f"resume={'0' * 32} is not allowed: there is no "
                                                                    f"MLflow store at tracking.uri=sqlite:///{store}"),
        ([f"resume={'0' * 32}", f"tracking.uri=sqlite:///{tmp_path / 'a_file'}", f"hydra.run.dir={tmp_path / 'new'}"],
         f"resume={'0' * 32} is not allowed: it is not found in tracking.uri=sqlite:///{tmp_path / 'a_file'} "
         "(sqlite3.DatabaseError: file is not a database)"),
        ([*FAST, "tracking.enabled=true", "tracking.uri=mysql://u@127.0.0.1:5999/db", f"hydra.run.dir={tmp_path / 'new'}"],
         "tracking.uri=mysql://u@127.0.0.1:5999/db could not be opened (ModuleNotFoundError: No module named 'MySQLdb'); "
         "install the database's driver"),
        ([foreign, f"tracking.uri=sqlite:///{store}"], f"resume={tmp_path / 'foreign' / 'resume.pt'} is not allowed: "
                                                       "it is truncated, damaged or not a torch checkpoint"),
        ([foreign, "model.depth=8"], "model.depth=8 is not allowed with resume=: a resumed run continues with the "
                                     "config it was launched with"),
        ([*tracked, foreign], "model=tiny is not allowed with resume="),
        ([*tracked, "train.batch_tokens=8192", "train.device_batch_rows=12"],
         "train.device_batch_rows=12 is not allowed"),
        ([*tracked, f"hydra.run.dir={tmp_path / 'a_file' / 'run'}"],
         f"hydra.run.dir={tmp_path / 'a_file' / 'run'} is not allowed: it cannot be created (Not a directory"),
    ]
    for args, message in cases:
        result = command_in_process("frontier.train", args)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert lines[-1].startswith(f"error: {message}"), (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert not store.exists(), args  # refused before any tracking store was opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "foreign"]
    assert [p.name for p in (tmp_path / "foreign").iterdir()] == ["resume.pt"]  # no .hydra record of a resume


@pytest.mark.slow
def test_the_command_line_runs_and_writes_into_the_hydra_run_dir(wiki, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*FAST, "budget.max_steps=3", f"hydra.run.dir={run_dir}"], env=gc_probe(tmp_path / "probe"))
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["steps"] == 3
    assert (run_dir / "final.pt").is_file() and (run_dir / ".hydra" / "config.yaml").is_file()
    # Python's collector is off while the command starts, and back from the first step, with start-up's
    # garbage collected and what it built frozen out of the collector's walks (frontier.startup_over);
    # handed back at exit for the shutdown to free (still frozen, triton's bindings printed leak reports)
    (collector,) = gc_records(tmp_path / "probe")
    assert collector["startup"] is False and collector["exit"] is True and collector["frozen"] > 100_000
    assert collector["garbage_collected"] is True and collector["frozen_at_exit"] == 0
    assert "leaked" not in result.stderr, result.stderr[-3000:]


def test_an_mfu_above_one_is_kept_with_a_note_and_a_warning(capsys):
    from frontier.budget import BudgetClock
    from frontier.config import BudgetConfig
    from frontier.trainer import summarize

    clock = BudgetClock(BudgetConfig(seconds=10, excluded_steps=1, startup_cap_seconds=5))
    clock.add_step(3.0, tokens=1000)  # forgiven: its tokens do not count
    clock.add_step(1.0, tokens=1000)
    summary = {"flops_per_token": 1e6, "peak_flops": 2e8, "peak_flops_source": "measured 2026-11-30"}
    run = SimpleNamespace(config=SimpleNamespace(budget=clock.cfg), clock=clock, summary=summary, tokens_seen=2000)
    summarize(run, None)
    assert summary["tokens_per_second"] == 1000.0 and summary["mfu"] == 5.0
    assert "measured 2026-11-30" in summary["mfu_note"] and summary["excluded_seconds_per_launch"] == [3.0]
    assert capsys.readouterr().err.startswith("warning: mfu 5.00 is above 1")


@pytest.mark.slow
def test_an_unreachable_tracking_store_is_found_before_any_data_is_read(wiki, tmp_path):
    result = command_in_process("frontier.train", [*FAST, "tracking.enabled=true", "tracking.required=true",
                                                   "tracking.uri=http://127.0.0.1:9", f"data.cache_dir={tmp_path / 'cache'}",
                                                   f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: tracking.uri=http://127.0.0.1:9")
    assert not (tmp_path / "cache").exists()  # no tokenizer trained, no token cache built


def test_a_run_is_named_by_its_model_and_what_its_command_changed():
    from frontier.train import run_name

    assert run_name("d4", ["model=d4", "optim.matrix_lr=0.02", "seed=7"]) == "d4 optim.matrix_lr=0.02 seed=7"
    assert run_name("tiny", []) == "tiny"  # the sized defaults
    # where a run is written or tracked is not what it is
    assert run_name("tiny", ["+optim=adamw", "tracking.uri=sqlite:///x.db", "hydra.run.dir=/tmp/r",
                             "paths.home=/h", "data.path=/d", "data.cache_dir=/c"]) == "tiny optim=adamw"
    long = run_name("tiny", [f"optim.matrix_lr=0.0{i}" for i in range(100)])
    assert len(long) == 250 and long.endswith("…")  # what MLflow's SQL stores keep


def test_on_a_cpu_mfu_is_taken_per_cpu_second():
    from frontier.budget import BudgetClock
    from frontier.config import BudgetConfig
    from frontier.trainer import summarize

    clock = BudgetClock(BudgetConfig(seconds=10, excluded_steps=0, startup_cap_seconds=5))
    clock.add_step(2.0, tokens=1000, cpu_seconds=2.0)  # 2 s of wall, but only 1 s on each of 2 threads: a busy neighbour
    summary = {"flops_per_token": 1e6, "peak_flops": 2e9, "threads": 2, "mfu_basis": "cpu time"}
    run = SimpleNamespace(config=SimpleNamespace(budget=clock.cfg), clock=clock, summary=summary, tokens_seen=1000)
    summarize(run, None)
    assert summary["tokens_per_second"] == 500.0 and summary["tokens_per_cpu_second"] == 500.0
    assert summary["mfu"] == 0.5  # 500 tokens per CPU-second x 2 threads x 1 MFLOP against 2 GFLOP/s
