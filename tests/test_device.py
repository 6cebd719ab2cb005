import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from frontier import device as device_module
from frontier.config import ConfigError
from frontier.device import bf16_native, matmul_rate, mfu_note, peak_figures, resolve_device


@pytest.fixture
def peak_cache(tmp_path, monkeypatch):
    """A private rate cache, so no test reads or writes the machine's real one."""
    cache = tmp_path / "peak_flops.json"
    monkeypatch.setattr(device_module, "PEAK_CACHE", cache)
    return cache


@pytest.fixture
def cpu_with_bf16(monkeypatch, peak_cache):
    """A CPU with AVX512_BF16 whose bf16 matmuls outrun its fp32 ones."""
    monkeypatch.setattr(device_module, "cpu_bf16_features", lambda: ["AVX512_BF16"])
    fake_rates(peak_cache, CPU, bf16=60e9, fp32=30e9)


@pytest.fixture
def cpu_without_bf16(monkeypatch):
    monkeypatch.setattr(device_module, "cpu_bf16_features", lambda: [])


CPU = device_module.Device(torch.device("cpu"), "cpu", "cpu", "fp32")


def fake_rates(cache, device, bf16: float, fp32: float) -> None:
    """Cached rates as a measurement would leave them (bf16 and fp32 in FLOP/s)."""
    entries = {device_module.rate_key(device, precision): {"flops": flops, "measured": "2026-01-02 03:04 UTC",
                                                           "load_avg_1min": 0.5, "seconds": 3.0}
               for precision, flops in (("bf16", bf16), ("fp32", fp32))}
    cache.write_text(json.dumps(entries))


def test_logical_core_setting_reaches_the_neuron_runtime(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    resolve_device("cpu", "fp32", neuron_logical_cores=2)
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"


def test_auto_falls_back_to_the_cpu_here():
    device = resolve_device("auto", "fp32")
    assert device.kind == "cpu" and device.autocast_dtype is None


@pytest.mark.parametrize("name, missing", [("cuda", "no CUDA GPU"), ("neuron", "no Trainium device")])
def test_an_absent_accelerator_is_a_clear_error(name, missing):
    with pytest.raises(ConfigError, match=f"device='{name}' is not available: .*{missing}"):
        resolve_device(name, "bf16")


def test_an_unknown_precision_is_a_clear_error():
    with pytest.raises(ConfigError, match="precision='fp8' is not allowed: choose one of auto, bf16, fp32"):
        resolve_device("cpu", "fp8")


def test_auto_precision_is_bf16_on_a_cpu_with_native_bf16(cpu_with_bf16, capsys):
    why = "cpu has AVX512_BF16, its bf16 matmuls run at 60.0 GFLOP/s against 30.0 in fp32"
    assert bf16_native("cpu") == (True, why)
    device = resolve_device("cpu", "auto")
    assert device.precision == "bf16" and device.autocast_dtype == torch.bfloat16
    assert device.precision_reason == f"auto: {why}"
    assert capsys.readouterr().err == f"precision bf16: auto: {why}\n"


def test_auto_precision_is_fp32_where_the_bf16_instructions_run_slower_than_fp32(
        monkeypatch, peak_cache, capsys):
    monkeypatch.setattr(device_module, "cpu_bf16_features", lambda: ["AVX512_BF16"])
    fake_rates(peak_cache, CPU, bf16=71e9, fp32=134e9)
    device = resolve_device("cpu", "auto")
    why = "cpu has AVX512_BF16, but its bf16 matmuls run at only 71.0 GFLOP/s against 134.0 in fp32"
    assert device.precision == "fp32" and device.precision_reason == f"auto: {why}"
    capsys.readouterr()
    assert resolve_device("cpu", "bf16").precision == "bf16"  # asked for, it runs, with the cost said
    assert capsys.readouterr().err.splitlines()[1] == (
        "warning: precision=bf16 on this cpu: its matmuls run 1.9x slower than fp32 here (71.0 vs 134.0 "
        "GFLOP/s); precision=auto or precision=fp32 is faster here")


def test_the_bf16_and_fp32_rates_are_measured_once_for_auto(monkeypatch, peak_cache):
    monkeypatch.setattr(device_module, "cpu_bf16_features", lambda: ["AMX"])
    measured = []

    def measure(device, size=None, dtype=None, seconds=0):
        measured.append(dtype)
        return 400e9 if dtype == torch.bfloat16 else 100e9

    monkeypatch.setattr(device_module, "measure_matmul_flops", measure)
    for _ in range(2):
        assert resolve_device("cpu", "auto").precision == "bf16"
    assert measured == [torch.bfloat16] * 2 + [torch.float32] * 2  # each measured and re-checked, once


def test_auto_precision_is_fp32_on_a_cpu_without_native_bf16(cpu_without_bf16, capsys):
    native, reason = bf16_native("cpu")
    assert not native and reason.startswith("cpu has neither AVX512_BF16 nor AMX")
    device = resolve_device("cpu", "auto")
    assert device.precision == "fp32" and device.autocast_dtype is None
    assert device.precision_reason == f"auto: {reason}"
    assert capsys.readouterr().err == f"precision fp32: auto: {reason}\n"


def test_explicit_bf16_without_native_bf16_runs_and_warns_of_the_measured_slowdown(
        cpu_without_bf16, peak_cache, capsys):
    fake_rates(peak_cache, resolve_device("cpu", "fp32"), bf16=0.3e9, fp32=24e9)
    capsys.readouterr()
    device = resolve_device("cpu", "bf16")
    assert device.precision == "bf16"
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("precision bf16: precision=bf16 (cpu has neither")
    assert lines[1] == ("warning: precision=bf16 on this cpu: its matmuls run 80.0x slower than "
                        "fp32 here (0.3 vs 24.0 GFLOP/s); precision=auto or precision=fp32 is faster here")
    assert len(lines) == 2


def test_explicit_fp32_is_kept_on_a_cpu_with_native_bf16(cpu_with_bf16, capsys):
    device = resolve_device("cpu", "fp32")
    assert device.precision == "fp32" and device.precision_reason == "precision=fp32"


def test_the_peak_is_measured_once_and_cached_with_its_date_and_load(peak_cache, monkeypatch):
    device = resolve_device("cpu", "fp32")
    measured = []

    def measure(device, size=None, dtype=None, seconds=0):
        measured.append(dtype)
        return 5e10

    monkeypatch.setattr(device_module, "measure_matmul_flops", measure)
    flops, source = device.peak_flops()
    assert flops == 5e10 and measured == [torch.float32] * 2  # measured, and re-checked
    entry = json.loads(peak_cache.read_text())[device_module.rate_key(device, "fp32")]
    assert entry["flops"] == 5e10 and entry["load_avg_1min"] >= 0 and entry["seconds"] >= 2
    assert source == (f"measured {entry['measured']}, load average {entry['load_avg_1min']}, one thread per "
                      f"CPU-second x {torch.get_num_threads()} threads")
    assert device.peak_flops() == (flops, source) and len(measured) == 2  # from the cache
    matmul_rate(device, "fp32", refresh=True)  # what frontier.bench does
    assert len(measured) == 4
    assert not list(peak_cache.parent.glob("*.tmp*"))  # written atomically


def test_mfu_is_against_a_nominal_peak_where_one_is_published_with_the_measured_rate_beside_it(peak_cache):
    cpu = device_module.Device(torch.device("cpu"), "cpu", "cpu", "bf16")
    fake_rates(peak_cache, cpu, bf16=60e9, fp32=30e9)
    assert peak_figures(cpu) == {"peak_flops": 60e9, "peak_flops_source": device_module.describe_measurement(
        json.loads(peak_cache.read_text())[device_module.rate_key(cpu, "bf16")])}  # a CPU has only its measurement
    named = device_module.Device(torch.device("cpu"), "cpu", "NVIDIA H200", "bf16")  # as a GPU's name reads
    fake_rates(peak_cache, named, bf16=700e12, fp32=400e12)
    figures = peak_figures(named)
    assert figures["peak_flops"] == device_module.NOMINAL_PEAK_FLOPS["H200"]
    assert figures["peak_flops_source"] == "nominal bf16 peak of NVIDIA H200"
    assert figures["measured_matmul_flops"] == 700e12 and "measured 2026-01-02" in figures["measured_matmul_source"]


def test_a_damaged_cache_is_measured_again(peak_cache, monkeypatch):
    peak_cache.write_text("{not json")
    monkeypatch.setattr(device_module, "measure_matmul_flops", lambda *a, **k: 7e9)
    assert resolve_device("cpu", "fp32").peak_flops()[0] == 7e9


def test_a_rate_that_a_recheck_disputes_is_measured_again_and_never_cached_unsettled(peak_cache, monkeypatch, capsys):
    device = resolve_device("cpu", "fp32")
    rates = iter([100e9, 50e9, 100e9, 95e9])  # a busy moment in the first re-check; the second try agrees
    monkeypatch.setattr(device_module, "measure_matmul_flops", lambda *a, **k: next(rates))
    assert device.peak_flops()[0] == 100e9
    assert device_module.rate_key(device, "fp32") in json.loads(peak_cache.read_text())

    peak_cache.unlink()
    rates = iter([100e9, 50e9] * device_module.MEASURE_TRIES)  # never settles: used, not cached
    monkeypatch.setattr(device_module, "measure_matmul_flops", lambda *a, **k: next(rates))
    assert device.peak_flops()[0] == 100e9 and not peak_cache.exists()
    assert "did not settle" in capsys.readouterr().err


def test_the_cached_rate_is_per_thread_count(peak_cache, monkeypatch):
    device = resolve_device("cpu", "fp32")
    measured = []
    monkeypatch.setattr(device_module, "measure_matmul_flops",
                        lambda *a, **k: measured.append(torch.get_num_threads()) or 1e10)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            device.peak_flops()
    finally:
        torch.set_num_threads(threads)
    assert measured == [1, 1, 2, 2]  # another thread count is measured anew; the first is found again


BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def busy_neighbours(seconds: float, per_cpu: int = 1) -> list[subprocess.Popen]:
    """`per_cpu` CPU-bound processes on every core this thread may use, for `seconds`."""
    return [subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=seconds)])
            for _ in range(per_cpu * len(os.sched_getaffinity(0)))]


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


@contextlib.contextmanager
def on_one_cpu():
    """This thread, and the processes it starts meanwhile, on one CPU: a neighbour started there takes
    turns with the measurement on that CPU, as on a busy machine, instead of loading a hyperthread
    sibling at some moments and not at others (which the suite's other worker does too)."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)


def test_a_cpu_peak_measured_beside_a_busy_neighbour_matches_one_measured_alone():
    device = resolve_device("cpu", "fp32")
    with on_one_cpu():
        alone = device_module.measure_matmul_flops(device, size=512, seconds=1.0)
        neighbours = busy_neighbours(30)
        try:
            busy = device_module.measure_matmul_flops(device, size=512, seconds=1.0)
        finally:
            stop(neighbours)
    assert abs(busy - alone) <= device_module.RECHECK_TOLERANCE * max(busy, alone), (alone, busy)


def train_on_one_cpu(args: list[str], neighbours_per_cpu: int = 0) -> None:
    """`python -m frontier.train ARGS` with one thread on one CPU, and `neighbours_per_cpu` busy processes
    taking turns with it there while it trains: from its first checkpoint line (the first step done) to
    its summary, so that they do not lengthen its start-up and exit, which no figure measures."""
    from tests.conftest import ROOT

    # One thread: OpenMP threads spinning against the neighbours would bill CPU time.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with on_one_cpu():
        run = subprocess.Popen([sys.executable, "-m", "frontier.train", *args], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        neighbours, output = [], []
        try:
            for line in run.stdout:
                output.append(line)
                if neighbours_per_cpu and not neighbours and line.startswith("checkpoint"):
                    neighbours = busy_neighbours(600, per_cpu=neighbours_per_cpu)
                elif "run summary" in line:
                    stop(neighbours)
            run.wait(timeout=600)
        finally:
            stop([run, *neighbours])
    assert run.returncode == 0, "".join(output)[-2000:]


@pytest.mark.slow
def test_mfu_of_a_run_does_not_move_with_a_busy_neighbour(wiki, tmp_path):
    """On a CPU, MFU is per CPU-second: neighbours on the run's CPU slow its wall clock, not it."""
    from tests.conftest import FAST

    runs = {}
    for name, neighbours in (("alone", 0), ("busy", 4)):
        # Steps 3 to 8 are measured: all of them beside the neighbours, which start after step 1.
        train_on_one_cpu([*FAST, "precision=fp32", "budget.max_steps=8", "budget.excluded_steps=2",
                          "eval.checkpoint_tokens=1024", "eval.final_tokens=2048", f"hydra.run.dir={tmp_path / name}"],
                         neighbours_per_cpu=neighbours)
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    alone, busy = runs["alone"], runs["busy"]
    assert alone["mfu_basis"] == "cpu time" and alone["tokens_per_cpu_second"] > 0
    figures = [(r["mfu"], r["tokens_per_second"], r["tokens_per_cpu_second"]) for r in runs.values()]
    # Four neighbours leave the run a fifth of its CPU, so its wall-clock rate falls by more than half
    # even where the suite's other workers shared that CPU with the run alone. Taking turns costs some
    # CPU-time efficiency (caches refilled after each switch), and those workers load the CPU's
    # hyperthread sibling at some moments and not at others: MFU moves, but by far less than the
    # wall-clock rate (which an MFU per second would follow).
    wall_moved = 1 - busy["tokens_per_second"] / alone["tokens_per_second"]
    mfu_moved = abs(1 - busy["mfu"] / alone["mfu"])
    assert mfu_moved <= 0.5 * wall_moved, figures


def test_the_matmul_measurement_runs_for_the_time_given():
    device = resolve_device("cpu", "fp32")
    assert device_module.measure_matmul_flops(device, size=64, seconds=0.05) > 0
    assert device_module.measure_matmul_flops(device, seconds=0.05) > 0  # picks its own size


def test_an_mfu_above_one_always_carries_a_note():
    assert mfu_note(0.45) is None and mfu_note(None) is None
    note = mfu_note(3.7, "measured 2026-01-02 03:04 UTC, load average 24.0")
    assert note.startswith("mfu 3.70 > 1: the peak it is taken against (measured 2026-01-02 03:04 UTC, "
                           "load average 24.0) looks too low")
    assert "python -m frontier.bench" in note


def test_the_cached_matmul_rate_is_per_cpu_capability():
    # ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 CPU run torch's AVX2 kernels: another rate, another entry
    code = ("from frontier.device import rate_key, resolve_device; "
            "print(rate_key(resolve_device('cpu', 'fp32'), 'fp32'))")
    keys = {cap: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={**os.environ, "ATEN_CPU_CAPABILITY": cap}, timeout=120).stdout
            for cap in ("avx2", "default")}
    assert "| AVX2 |" in keys["avx2"] and "| DEFAULT |" in keys["default"]


KEPT_MEMORY = """
import ctypes, sys, torch
from frontier.device import resolve_device

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
if not hasattr(libc, "mallinfo2"):
    print("no mallinfo2")
    sys.exit(0)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "cpu":
    resolve_device("cpu", "fp32")
x = torch.ones(4096, 4096)  # 64 MiB, above glibc's largest mmap threshold
print(libc.mallinfo2().hblkhd >= x.nbytes)
"""


@pytest.mark.parametrize("device, mmapped", [("none", "True"), ("cpu", "False")])
def test_a_cpu_run_keeps_freed_memory_in_the_heap(device, mmapped):
    """glibc would mmap a 64 MiB tensor and unmap it on free, so that every step faults its pages in
    again; a CPU device makes malloc serve it from the heap it keeps."""
    done = subprocess.run([sys.executable, "-c", KEPT_MEMORY, device], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no mallinfo2":
        pytest.skip("the C library is not glibc >= 2.33 (no mallinfo2 to read its mmapped bytes)")
    assert done.stdout.strip() == mmapped


def test_a_machine_without_accelerator_device_files_is_sized_without_importing_torch(tmp_path):
    """torch takes seconds to import: a mistake on the command line of a CPU-only machine is found sooner."""
    from frontier import sizing

    if sys.platform != "linux" or any(any(Path("/dev").glob(p)) for p in sizing.ACCELERATOR_DEVICE_FILES):
        pytest.skip("this machine has accelerator device files, so torch is asked")
    code = "import sys; from frontier import sizing; print(sizing.accelerator(), 'torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.stdout.split() == ["None", "False"], shown.stdout + shown.stderr


def test_where_accelerator_device_files_exist_torch_decides(monkeypatch):
    from frontier import sizing

    monkeypatch.setattr(sizing, "ACCELERATOR_DEVICE_FILES", ("null",))  # /dev/null: a device file is there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert sizing.accelerator() == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sizing.accelerator() in (None, "neuron")
