import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, command_in_process

# a tiny model's step, one untimed and one timed, as `python -m frontier.bench ...`
TINY_BENCH = [sys.executable, "-m", "frontier.bench", "bench.models=[tiny]", "bench.warmup=1", "bench.steps=1",
              "train.batch_tokens=512", "train.device_batch_rows=2", "data.vocab_size=1024"]


@pytest.mark.slow
def test_bench_runs_a_minimal_grid_and_writes_every_row(tmp_path):
    out, record = tmp_path / "bench.json", tmp_path / "results.jsonl"
    record.write_text('{"an": "earlier row"}\n')
    result = subprocess.run(
        [*TINY_BENCH, "bench.kernels=[reference]", "bench.profile=5", f"bench.output={out}",
         f"bench.results={record}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"})  # wide enough that no column header wraps
    assert result.returncode == 0, result.stderr
    assert "training step throughput" in result.stdout and "ops, forward + backward" in result.stdout
    assert "CPU s/step" in result.stdout and "of matmul rate" in result.stdout
    (row,) = json.loads(out.read_text())
    assert {"model", "kernel", "tokens_per_second", "mfu_nominal", "mfu_measured",
            "matmul_bf16_flops", "matmul_fp32_flops"} <= row.keys()
    # CPU time per step and the CPU it ran on, so a figure from a loaded machine can still be compared
    assert row["cpu_seconds_per_step"] > 0 and row["matmul_cpu_flops"] > 0
    assert f"CPU capability {row['cpu_capability']}" in result.stdout
    assert row["model"] == "tiny" and row["kernel"] == "reference" and row["tokens_per_second"] > 0
    assert row["mfu_nominal"] is None  # a CPU has no published peak; MFU is against the measured rate
    assert 0 < row["mfu_measured"] < 1
    # bench.profile: one more step under torch.profiler, its top ops by self time
    assert "top ops of one step, tiny reference" in result.stdout
    assert len(row["profile"]) == 5
    shares = [o["share"] for o in row["profile"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
    assert any(o["op"] in ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm") for o in row["profile"])
    # bench.results: the row appended to the record, with where and with what it was measured
    earlier, kept = (json.loads(line) for line in record.read_text().splitlines())
    assert earlier == {"an": "earlier row"} and "profile" not in kept
    assert all(kept[key] == row[key] for key in ("model", "kernel", "tokens_per_second", "cpu_capability"))
    assert kept["machine"].startswith(f"CPU {row['cpu_capability']}")
    assert kept["torch"] == torch.__version__ and kept["threads"] >= 1 and len(kept["date"]) == 10
    if (ROOT / ".git").exists():  # the checkout's commit
        assert len(kept["commit"]) == 40 and isinstance(kept["dirty"], bool)
    assert kept["source"].startswith("python -m frontier.bench bench.models=[tiny]")
    assert f"appended 1 row(s) to {record}" in result.stdout


def test_a_bench_stopped_midway_keeps_the_rows_it_measured(tmp_path):
    out = tmp_path / "bench.json"
    bench = subprocess.Popen(
        [*TINY_BENCH, "bench.kernels=[reference,compiled]", "bench.ops=false", f"bench.output={out}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in bench.stdout:  # the first row is printed as soon as it is measured
            if line.startswith("tiny reference:"):
                bench.send_signal(signal.SIGTERM)  # while the compiled model compiles: a job's time limit
                break
        output = line + bench.communicate(timeout=120)[0]
    finally:
        bench.kill()
    assert bench.returncode == 130 and "Traceback" not in output, output
    (row,) = json.loads(out.read_text())
    assert row["kernel"] == "reference" and row["tokens_per_second"] > 0
    assert not list(tmp_path.glob("*.partial"))


def test_bench_rejects_an_unknown_key():
    result = command_in_process("frontier.bench", ["bench.model=tiny"])
    assert result.returncode == 2 and "Key 'model' not in 'BenchConfig'" in result.stderr


@pytest.mark.parametrize("args, sentence", [
    (["bench.models=[nope]"], "bench.models=[nope] is not allowed: nope is not a model preset; choose from base, d4"),
    (["bench.models=[]"], "bench.models=[] is not allowed: it names no model; choose from base, d4"),
    (["bench.kernels=[reference,cudnn]"], "bench.kernels=[reference,cudnn] is not allowed: cudnn is not a kernel "
                                          "preset; choose from reference, compiled"),
    (["model.depth=abc"], "model.depth=abc is not allowed: must be an integer"),
    (["foo=1"], "foo=1 is not allowed: the config has no key 'foo'"),
])
def test_bench_refuses_a_bad_command_line_in_one_sentence_before_measuring(args, sentence):
    result = command_in_process("frontier.bench", args)
    assert result.returncode == 2 and result.stdout == "", (result.stdout, result.stderr)  # nothing measured
    assert result.stderr.startswith(f"error: {sentence}") and len(result.stderr.splitlines()) == 1, result.stderr
