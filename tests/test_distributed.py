"""Data-parallel training through torchrun on CPU (gloo)."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from frontier import load_for_eval
from frontier.config import to_config
from frontier.data import load_corpus, load_tokenizer, resolve_splits, validation_set
from frontier.device import resolve_device
from frontier.evaluate import val_bpb
from tests.conftest import FAST, ROOT, compose_config, run_cli

pytestmark = pytest.mark.slow
STEPS = [*FAST, "budget.max_steps=4", "budget.excluded_steps=0", "train.log_every_fraction=0.01",
         "eval.every_fraction=0", "checkpoint.every_fraction=0"]


def torchrun(n: int, args: list[str], env: dict | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                           "-m", "frontier.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["train/loss"] for line in lines if "train/loss" in line]


def test_two_ranks_follow_the_single_process_loss_trajectory(wiki, tmp_path):
    single = run_cli([*STEPS, f"hydra.run.dir={tmp_path / 'one'}"])
    assert single.returncode == 0, single.stderr
    double = torchrun(2, [*STEPS, f"hydra.run.dir={tmp_path / 'two'}"])
    assert double.returncode == 0, double.stderr
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 4
    assert all(math.isclose(a, b, rel_tol=2e-2) for a, b in zip(one, two)), (one, two)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_seen"] == 4 * 2048

    # The consolidated checkpoint loads on one device, and one process measures the same val_bpb.
    raw = compose_config(STEPS)
    config = to_config(raw)
    train_split, val_split = resolve_splits(config.data)
    tokenizer = load_tokenizer(config.data, train_split)
    vset = validation_set(load_corpus(val_split, tokenizer, config.data, "val"), tokenizer, 256,
                          config.eval.final_tokens)
    model = load_for_eval(tmp_path / "two" / "final.pt", "cpu")
    score = val_bpb(model, vset, tokenizer.token_bytes, resolve_device("cpu", summary["precision"]), batch_rows=8)
    assert math.isclose(score.val_bpb, summary["val_bpb"], rel_tol=1e-4), (score.val_bpb, summary["val_bpb"])
    assert math.isclose(score.se, summary["val_bpb_se"], rel_tol=1e-3) and summary["val_fingerprint"] == vset.fingerprint()


def test_both_ranks_stop_at_the_same_step_under_a_time_budget(wiki, tmp_path):
    result = torchrun(2, [*FAST, "budget.seconds=4", "budget.excluded_steps=1", "eval.every_fraction=0.5",
                          f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["charged_seconds"] >= 4 and summary["steps"] >= 2


def test_a_world_size_that_does_not_divide_the_batch_is_one_clear_error(wiki, tmp_path):
    result = torchrun(3, [*FAST, f"hydra.run.dir={tmp_path}"])
    assert result.returncode != 0
    message = ("train.batch_tokens=2048 is not allowed: it gives 8 rows of model.seq_len=256 per step, which the "
               "world size 3 does not divide")
    assert result.stderr.count(message) == 1  # said once, by rank 0


def test_a_rank_that_crashes_ends_the_job_instead_of_hanging(wiki, tmp_path):
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from frontier.budget import BudgetClock\n"
        "    real = BudgetClock.add_step\n"
        "    def crash(self, *args):\n"
        "        if self.steps == 2:\n"
        "            raise RuntimeError('rank 1 lost its device')\n"
        "        return real(self, *args)\n"
        "    BudgetClock.add_step = crash\n")
    env = {"PYTHONPATH": f"{inject}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = torchrun(2, [*FAST, "budget.max_steps=50", f"hydra.run.dir={tmp_path / 'run'}"], env=env, timeout=300)
    assert result.returncode != 0
    assert "rank 1 lost its device" in result.stderr
    # rank 0 sees the peer gone in gloo ('[/path/gloo/transport/tcp/pair.cc:553] Connection closed by
    # peer', or a read error), records it and prints it in its summary table, brackets and all
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "FAILED" and summary["error"].startswith("RuntimeError: [") and "gloo" in summary["error"]
    assert "MarkupError" not in result.stderr and "run summary" in result.stderr


def test_a_sweep_trial_can_own_a_group_of_devices(wiki, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "frontier.train", "--multirun", "sweep=custom", "optim.matrix_lr=choice(0.04)",
         "sweep.sampler=grid", "sweep.pruner=none", "sweep.devices_per_trial=2", f"sweep.study_name=group-{os.getpid()}",
         f"sweep.storage={tmp_path / 'study.journal'}", *STEPS, f"hydra.sweep.dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert summary["status"] == "FINISHED" and summary["world_size"] == 2


def test_a_missing_rendezvous_variable_is_a_clear_error(wiki):
    result = run_cli([*FAST, "budget.max_steps=1"], env={"WORLD_SIZE": "2"})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "WORLD_SIZE=2 but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not set: launch with torchrun" in result.stderr


def ranks_of(launcher: int) -> list[int]:
    """The worker processes torchrun started (its children)."""
    return [int(pid) for pid in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()]


@pytest.mark.parametrize("stop", ["ctrl-c", "scheduler"])
def test_a_stopped_torchrun_job_stops_both_ranks_at_the_next_step_and_writes_resume_pt(wiki, tmp_path, stop):
    """ctrl-c: a terminal's Ctrl-C reaches torchrun, which passes it on to its ranks. scheduler: a stop sent
    to torchrun and to each rank at once, as a batch scheduler's cancel does, reaches a rank twice (the
    second passed on by torchrun), which must not abort it; here SIGTERM to the ranks and SIGINT to
    torchrun, as Python merges a signal that comes again before its handler has run. The ranks agree on
    the stop through the step's own collective, however far away the next log point is. Before, they
    agreed only at log points, and torchrun SIGKILLs its ranks once its shutdown timeout has passed: no
    resume.pt, no summary.json."""
    run_dir = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            "-m", "frontier.train", *FAST, "budget.max_steps=100000", "budget.excluded_steps=0",
                            "train.log_every_fraction=0.5", "eval.every_fraction=0", "checkpoint.every_fraction=0",
                            f"hydra.run.dir={run_dir}"], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, start_new_session=True,
                           env={**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "20"})
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().endswith("\n")):  # the first step is logged
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
            time.sleep(0.2)
        time.sleep(1)
        if stop == "ctrl-c":
            os.killpg(job.pid, signal.SIGINT)  # torchrun's process group; its ranks have sessions of their own
        else:
            for pid in ranks_of(job.pid):
                os.kill(pid, signal.SIGTERM)
            os.kill(job.pid, signal.SIGINT)
        _, stderr = job.communicate(timeout=120)
    finally:
        job.kill()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "KILLED", stderr[-3000:]
    assert summary["error"] in ("interrupted by SIGINT", "interrupted by SIGTERM"), summary["error"]
    assert (run_dir / "resume.pt").exists() and "aborting at once" not in stderr, stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records if "train/loss" in r]
    assert 1 < summary["steps"] < 50_000 and steps[-1] == summary["steps"], (steps, summary["steps"])
