#!/usr/bin/env bash
# The CUDA path measured in one go: every figure is printed and written as JSON to
# $OUT/gpu_check.json (OUT defaults to ./gpu_check_out). Sized for 9 minutes on one H200.
#
#   bash scripts/gpu_check.sh            measure on a CUDA machine; dry-run on one without CUDA
#   bash scripts/gpu_check.sh --prepare  on the workstation, before borrowing a GPU machine: copies
#                                        the data and a trained tokenizer to .gpu_data/ and the wheels
#                                        the GPU image lacks (hydra, omegaconf, datasets, ...) to .whl/,
#                                        both git-ignored; carry both to the GPU machine.
#
# Parts:
#   gpu_tests  pytest -m "gpu or slow" tests/test_gpu.py tests/test_compiled_parity.py: Triton kernels
#              against their references (forward and backward), the chunked head loss, SDPA's flash path
#              for full-causal layers, bf16 autocast, fused AdamW, and 10 training steps of kernel=compiled
#              and kernel=triton against kernel=reference on the GPU (losses and one step's gradients)
#   bench      python -m frontier.bench at seq 1024 over models [base] x kernels [reference, triton,
#              compiled] (compiled last: it compiles for 1-2.5 minutes); MFU against the H200's 989 TFLOP/s
#              dense bf16; each row is kept as it is measured
#   train      a budgeted (45 s) model=base kernel=compiled run, periodic evaluation and resume.pt off:
#              val_bpb, budget_utilization, startup_seconds, step_time_fraction, peak GPU memory
#   torchrun   the same under torchrun --standalone --nproc_per_node=1 (nccl), shorter
# Without CUDA every part is skipped, saying it needs a GPU, after checking what a CPU can: the gpu
# tests are collected and skip, the bench CLI runs one tiny CPU step, and the training overrides
# compose and pass the config checks. Exit status 0 unless a part that ran (or a CPU check) failed.
#
# Environment knobs: OUT, PYTHON (python3), DATA (a directory of parquet shards), TOKENIZER (a
# tokenizer.json; else one is trained), PARTS (gpu_tests bench train torchrun: the parts to run),
# BENCH_MODELS (base), BENCH_KERNELS (reference,triton,compiled), BATCH_TOKENS (262144), DEVICE_ROWS (64),
# TRAIN_SECONDS (45), TORCHRUN_SECONDS (10), GPU_CHECK_SECONDS (540: the whole script's allowance; each
# part gets at most what is left), GPU_CHECK_WORK (run directories and caches; /tmp/gpu_check_work).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-./gpu_check_out}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
PARTS=" ${PARTS:-gpu_tests bench train torchrun} "
BENCH_MODELS=${BENCH_MODELS:-base}
BENCH_KERNELS=${BENCH_KERNELS:-reference,triton,compiled}
BATCH_TOKENS=${BATCH_TOKENS:-262144}
DEVICE_ROWS=${DEVICE_ROWS:-64}
TRAIN_SECONDS=${TRAIN_SECONDS:-45}
TORCHRUN_SECONDS=${TORCHRUN_SECONDS:-10}
ALLOWANCE=${GPU_CHECK_SECONDS:-540}  # inside the device tool's 600-s limit per command
H200_PEAK=989e12  # dense bf16 FLOP/s, the figure MFU is quoted against
WHEELS=(hydra-core omegaconf antlr4-python3-runtime datasets dill multiprocess)

first_dir() { for d in "$@"; do [[ -d $d ]] && { echo "$d"; return; }; done; echo "$1"; }
DATA=${DATA:-$(first_dir .gpu_data/wiki_en shared/data/text/wiki_en ../shared/data/text/wiki_en)}
TOKENIZER=${TOKENIZER:-$([[ -f .gpu_data/tokenizer.json ]] && echo .gpu_data/tokenizer.json)}

prepare() {
  set -e
  mkdir -p .gpu_data .whl
  [[ -d .gpu_data/wiki_en ]] || cp -r ../shared/data/text/wiki_en .gpu_data/wiki_en
  "$PY" - <<'EOF'
import shutil
from frontier.config import DataConfig
from frontier.data import load_tokenizer, resolve_splits
cfg = DataConfig(path=".gpu_data/wiki_en")  # the default vocabulary (8192) of data=local
tokenizer = load_tokenizer(cfg, resolve_splits(cfg)[0])
shutil.copyfile(tokenizer.path, ".gpu_data/tokenizer.json")
print("tokenizer:", tokenizer.vocab_size, "tokens -> .gpu_data/tokenizer.json")
EOF
  for name in "${WHEELS[@]}"; do  # the versions installed here, as wheels for the GPU image's Python 3.12
    version=$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "$name==$version" ||
      "$PY" -m pip wheel -q --no-deps -w .whl "$name==$version"  # a source-only package: build it
  done
  ls .gpu_data .whl
  echo "ready: on the GPU machine run 'bash scripts/gpu_check.sh' carrying .gpu_data and .whl"
}
[[ ${1:-} == --prepare ]] && { prepare; exit; }

rm -rf "$OUT" "$WORK/status"
mkdir -p "$OUT" "$WORK/status"
LOG=$OUT/gpu_check.log
START=$SECONDS
say() { echo "$*" | tee -a "$LOG"; }

# The GPU image lacks some pure-Python dependencies: install the carried wheels if they are needed.
if ! "$PY" -c "import hydra, omegaconf, datasets" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
      .whl/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
missing=$("$PY" -c "
import importlib.util
names = ['torch', 'hydra', 'omegaconf', 'datasets', 'tokenizers', 'xxhash', 'filelock', 'rich', 'pytest']
print(' '.join(n for n in names if importlib.util.find_spec(n) is None))")
[[ -n $missing ]] && say "missing Python packages: $missing (run 'bash scripts/gpu_check.sh --prepare' here and carry .whl)"

CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
if [[ $CUDA == 1 ]]; then
  say "measuring on $("$PY" -c "import sys, torch, triton; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| triton', triton.__version__, '| python', sys.version.split()[0])"), allowance ${ALLOWANCE}s"
  nvidia-smi 2>&1 | head -15 >>"$LOG"
else
  say "dry run: no CUDA GPU here, so every part that needs one is skipped after a CPU check"
fi

status() {  # status NAME STATUS [key=json-value ...]: the part's outcome, for the report
  local name=$1 st=$2; shift 2
  "$PY" - "$WORK/status/$name.json" "$st" "$@" <<'EOF'
import json, sys
path, st, *pairs = sys.argv[1:]
record = {"status": st}
for pair in pairs:
    key, value = pair.split("=", 1)
    record[key] = json.loads(value)
json.dump(record, open(path, "w"))
EOF
}

run_part() {  # run_part NAME CAP COMMAND...: within what is left of the allowance, logged, timed
  local name=$1 cap=$2; shift 2
  [[ $PARTS == *" $name "* ]] || return 0  # not asked for this time: no status, so not in the report
  local left=$((ALLOWANCE - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  if ((limit < 20)); then
    say "== $name: skipped, the ${ALLOWANCE}-s allowance is spent"
    status "$name" skipped "reason=\"the ${ALLOWANCE}-s allowance was spent before it\""
    return
  fi
  say "== $name (at most ${limit}s): $*"
  local t0=$SECONDS mem_pid=""
  if command -v nvidia-smi >/dev/null; then  # peak memory as the driver sees it, sampled twice a second
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 >"$WORK/$name.mem" 2>/dev/null &
    mem_pid=$!
  fi
  PYTHONUNBUFFERED=1 timeout --kill-after=30 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [[ -n $mem_pid ]] && kill "$mem_pid" 2>/dev/null
  local peak
  peak=$(sort -n "$WORK/$name.mem" 2>/dev/null | tail -1)
  local st=ok
  ((rc == 124 || rc == 137)) && st=timed_out
  ((rc != 0 && rc != 124 && rc != 137)) && st=failed
  status "$name" "$st" "rc=$rc" "seconds=$((SECONDS - t0))" "limit_seconds=$limit" "peak_gpu_memory_mib=${peak:-null}"
  say "== $name: $st (exit $rc) in $((SECONDS - t0))s"
}

dry_part() {  # dry_part NAME WHAT COMMAND...: skipped for want of a GPU, after a CPU check of it
  local name=$1 what=$2; shift 2
  say "== $name: needs a CUDA GPU, skipped; checking here: $what"
  local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout 240 "$@" >>"$LOG" 2>&1
  local rc=$?
  local ok=false
  ((rc == 0)) && ok=true
  status "$name" skipped "reason=\"needs a CUDA GPU (torch.cuda.is_available() is False here)\"" \
      "checked={\"what\": \"$what\", \"ok\": $ok, \"rc\": $rc, \"seconds\": $((SECONDS - t0))}"
  say "   check: $([[ $ok == true ]] && echo ok || echo "FAILED (exit $rc; see $LOG)")"
}

TRAIN_ARGS=(model=base kernel=compiled device=cuda precision=bf16 "data.path=$DATA" "data.cache_dir=$WORK/cache"
            "train.batch_tokens=$BATCH_TOKENS" "train.device_batch_rows=$DEVICE_ROWS" eval.every_fraction=0
            checkpoint.every_fraction=0 tracking.enabled=false)
[[ -n $TOKENIZER ]] && TRAIN_ARGS+=("data.tokenizer_path=$(realpath "$TOKENIZER")")
BENCH_GRID=("bench.models=[$BENCH_MODELS]" "bench.kernels=[$BENCH_KERNELS]")
TESTS=("$PY" -m pytest -p no:cacheprovider -q -rs -m "gpu or slow" tests/test_gpu.py tests/test_compiled_parity.py
       "--junitxml=$OUT/gpu_tests.xml")
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 -m frontier.train)
# a run's overrides, composed and checked as `python -m frontier.train` would, without running it
COMPOSES='import sys
from hydra import compose, initialize_config_dir
from frontier.config import PROJECT_ROOT, register_schemas, to_config
register_schemas()
with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
    print(to_config(compose(config_name="config", overrides=sys.argv[1:])))
'

if [[ $CUDA == 1 ]]; then
  [[ -d $DATA ]] || say "no data at $DATA: set DATA, or run 'bash scripts/gpu_check.sh --prepare' here and carry .gpu_data"
  run_part gpu_tests 120 "${TESTS[@]}"
  run_part bench 260 "$PY" -m frontier.bench "${BENCH_GRID[@]}" "bench.output=$OUT/bench.json" device=cuda \
      precision=bf16 "train.batch_tokens=$BATCH_TOKENS" "train.device_batch_rows=$DEVICE_ROWS" "data.path=$DATA" \
      tracking.enabled=false
  rm -rf "$WORK/train_run" "$WORK/torchrun_run"
  # beyond the budget: start-up and tokenizing (12-16 s on an H200), compiling (144 s with a cold compile
  # cache, 46-58 s after the bench has compiled base), the final evaluation
  run_part train $((TRAIN_SECONDS + 240)) "$PY" -m frontier.train "${TRAIN_ARGS[@]}" \
      "budget.seconds=$TRAIN_SECONDS" "hydra.run.dir=$WORK/train_run"
  run_part torchrun $((TORCHRUN_SECONDS + 120)) "${TORCHRUN[@]}" "${TRAIN_ARGS[@]}" \
      "budget.seconds=$TORCHRUN_SECONDS" "hydra.run.dir=$WORK/torchrun_run"
else
  # the last -m wins: not the parity runs; -n 0: skipping takes no pytest-xdist workers (a Python each)
  dry_part gpu_tests "pytest -m gpu collects the CUDA tests and each skips" "${TESTS[@]}" -m gpu -n 0
  dry_part bench "the bench CLI runs one step of model=tiny on the CPU" "$PY" -m frontier.bench \
      "bench.models=[tiny]" "bench.kernels=[reference]" bench.warmup=0 bench.steps=1 bench.ops=false \
      train.batch_tokens=512 train.device_batch_rows=2 \
      "bench.output=$WORK/bench_smoke.json" device=cpu precision=fp32 tracking.enabled=false
  dry_part train "the run's overrides compose and pass the config checks" \
      "$PY" -c "$COMPOSES" "${TRAIN_ARGS[@]}" "budget.seconds=$TRAIN_SECONDS"
  dry_part torchrun "torchrun is there and the run's overrides compose and pass the config checks" bash -c \
      "$(printf '%q ' "$PY" -m torch.distributed.run --help) >/dev/null && $(printf '%q ' "$PY" -c "$COMPOSES" \
      "${TRAIN_ARGS[@]}" "budget.seconds=$TORCHRUN_SECONDS")"
fi

# Collect every figure into one JSON file and print them.
for run in train torchrun; do
  [[ -f $WORK/${run}_run/summary.json ]] && cp "$WORK/${run}_run/summary.json" "$OUT/${run}_summary.json"
done
"$PY" - "$OUT" "$WORK" "$CUDA" "$H200_PEAK" "$BATCH_TOKENS" "$DEVICE_ROWS" "$((SECONDS - START))" <<'EOF' | tee -a "$LOG"
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, work, cuda, peak, batch_tokens, device_rows, seconds = sys.argv[1:]
out, work, peak = Path(out), Path(work), float(peak)
ORDER = ("gpu_tests", "bench", "train", "torchrun")
parts = {name: json.loads((work / "status" / f"{name}.json").read_text()) for name in ORDER
         if (work / "status" / f"{name}.json").is_file()}

def read(path):
    return json.loads(path.read_text()) if path.is_file() else None

junit = out / "gpu_tests.xml"
if junit.is_file():
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    target = parts["gpu_tests"].setdefault("checked", {}) if cuda != "1" else parts["gpu_tests"]
    target.update(counts, failed_tests=failed)

bench = read(out / "bench.json")
if bench is not None:
    rows = bench["rows"] if isinstance(bench, dict) else bench
    for row in rows:
        row["mfu_h200"] = row["tokens_per_second"] * row["flops_per_token"] / peak
    parts["bench"]["rows"] = rows

KEYS = ("status", "error", "val_bpb", "budget_utilization", "startup_seconds", "step_time_fraction",
        "excluded_seconds", "charged_seconds", "steps", "tokens_per_second", "mfu", "mfu_note", "precision",
        "peak_flops_source", "flops_per_token")
for run in ("train", "torchrun"):
    summary = read(out / f"{run}_summary.json")
    if summary is not None:
        figures = {k: summary.get(k) for k in KEYS}
        figures.update({k: v for k, v in summary.items() if "memory" in k})  # whatever the trainer records
        if summary.get("tokens_per_second") and summary.get("flops_per_token"):
            figures["mfu_h200"] = summary["tokens_per_second"] * summary["flops_per_token"] / peak
        parts[run]["summary"] = figures

targets = {}
rows = parts.get("bench", {}).get("rows", [])
base = [r for r in rows if r["model"] == "base"]
if base:
    best = max(base, key=lambda r: r["tokens_per_second"])
    targets["base_best_kernel_mfu_ge_40pct"] = {"kernel": best["kernel"], "mfu_h200": best["mfu_h200"],
                                                "met": best["mfu_h200"] >= 0.40}
train = parts.get("train", {}).get("summary")
if train and train.get("step_time_fraction") is not None:
    targets["step_time_fraction_ge_98pct"] = {"value": train["step_time_fraction"],
                                              "met": train["step_time_fraction"] >= 0.98}

report = {"dry_run": cuda != "1", "batch_tokens": int(batch_tokens), "device_batch_rows": int(device_rows),
          "mfu_peak_flops": peak, "seconds": int(seconds), "parts": parts, "targets": targets}
(out / "gpu_check.json").write_text(json.dumps(report, indent=2))

print("\n== figures")
for name, part in parts.items():
    line = f"{name}: {part['status']}"
    if "reason" in part:
        line += f" ({part['reason']})"
    if "checked" in part:
        c = part["checked"]
        line += f"; CPU check {'ok' if c['ok'] else 'FAILED'}: {c['what']}"
        if "skipped" in c:
            line += f" ({c['skipped']} skipped)"
    if "passed" in part:
        line += f": {part['passed']} passed, {part['failures'] + part['errors']} failed, {part['skipped']} skipped"
    if part.get("peak_gpu_memory_mib") is not None:
        line += f", peak GPU memory {part['peak_gpu_memory_mib']} MiB"
    print(line)
    for r in part.get("rows", []):
        print(f"  {r['model']:>9} {r['kernel']:>9}: {r['tokens_per_second']:>12,.0f} tok/s  "
              f"step {r['step_seconds']:.3f}s  MFU {r['mfu_h200']:.1%} of 989 TFLOP/s")
    for key, value in (part.get("summary") or {}).items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
for key, t in targets.items():
    print(f"target {key}: {'met' if t['met'] else 'NOT met'} ({t})")
print(f"wrote {out / 'gpu_check.json'} in {seconds}s")
failed = [n for n, p in parts.items() if p["status"] in ("failed", "timed_out") or not p.get("checked", {"ok": True})["ok"]]
sys.exit(1 if failed else 0)
EOF
