"""The CUDA path on a real GPU (`pytest -m gpu`, run by scripts/gpu_check.sh): Triton kernels against
their references forward and backward, the chunked head loss, SDPA's flash path for full-causal
layers, bf16 autocast and fused AdamW. Without CUDA each test skips saying so; the last test runs the
check script's CPU dry-run, which must say what it skipped and exit 0."""
import json
import os
import subprocess
from functools import partial

import pytest
import torch

from frontier.config import ModelConfig, OptimConfig
from frontier.model import GPT, Ops
from kernels import head_loss as chunked
from kernels import reference
from tests.conftest import ROOT
from tests.test_kernels import assert_matches

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")

# base's shapes: d_model 640, 5 heads of 128, seq 1024, vocab 8192
BASE = dict(depth=2, d_model=640, n_head=5, seq_len=1024)
VOCAB = 8192


def head_inputs(rows, vocab, d, dtype=torch.float32):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, d, device="cuda", generator=gen, dtype=dtype)
    weight = torch.randn(vocab, d, device="cuda", generator=gen, dtype=dtype) / d ** 0.5 * 4
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    targets[::7] = -1  # ignored rows
    return x.requires_grad_(), weight.requires_grad_(), targets


@pytest.fixture(scope="module")
def triton_ops():
    import importlib

    return importlib.import_module("kernels.triton_ops")  # compiles for the GPU, not the interpreter


@pytest.mark.parametrize("shape, dtype, tol", [
    ((300, 100), torch.float32, 1e-5),
    ((8, 1024, 640), torch.float32, 1e-5),
    ((8, 1024, 640), torch.bfloat16, 2e-2),
])
@pytest.mark.gpu
@needs_cuda
def test_triton_rms_norm_on_cuda_matches_the_reference(triton_ops, shape, dtype, tol):
    x = torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_()
    assert_matches(triton_ops.rms_norm, reference.rms_norm, x, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows, vocab, softcap, reduction", [
    (129, 257, 2.0, "sum"),
    (300, 1000, None, "none"),
    (8 * 1024, VOCAB, 15.0, "mean"),  # one micro-batch of base
])
@pytest.mark.gpu
@needs_cuda
def test_triton_head_loss_on_cuda_matches_the_definition(triton_ops, rows, vocab, softcap, reduction):
    x, weight, targets = head_inputs(rows, vocab, 640)
    assert_matches(triton_ops.head_loss, reference.head_loss, x, weight, targets, atol=2e-4, rtol=2e-4,
                   softcap=softcap, reduction=reduction)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.gpu
@needs_cuda
def test_chunked_head_loss_on_cuda_under_bf16_autocast(triton_ops, backend):
    impl = chunked.head_loss if backend == "reference" else triton_ops.head_loss
    x, weight, targets = head_inputs(8 * 1024, VOCAB, 640)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = partial(impl, chunk_rows=512)(x, weight, targets, softcap=15.0)
        expected = reference.head_loss(x, weight, targets, softcap=15.0)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    for g, e in zip(torch.autograd.grad(got, (x, weight)), torch.autograd.grad(expected, (x, weight))):
        assert g.dtype == e.dtype == torch.float32
        assert (g - e).abs().max() <= 2e-2 * e.abs().max()  # bf16 matmuls, summed in another order


@pytest.mark.gpu
@needs_cuda
def test_sdpa_takes_the_flash_path_for_full_causal_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(4, 5, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        expected = reference.causal_attention(q, k, v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # raises if flash cannot serve these inputs
        got = reference.causal_attention(q, k, v)
        got.sum().backward()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_a_full_causal_model_trains_on_the_flash_path_under_bf16_autocast():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = GPT(ModelConfig(**BASE, window_pattern="L"), VOCAB, Ops("reference", "cuda")).cuda()
    idx = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    targets = torch.randint(0, VOCAB, (4, 1024), device="cuda")
    with torch.no_grad():
        fp32 = model(idx, targets)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(idx, targets)  # every layer is full causal: flash must serve them all
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - fp32.item()) < 2e-2 * fp32.item()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.gpu
@needs_cuda
def test_adamw_is_fused_on_cuda_and_steps_like_the_unfused_one():
    from frontier.optim import build_optimizers

    torch.manual_seed(0)
    model = GPT(ModelConfig(**BASE), VOCAB, Ops("reference", "cuda")).cuda()
    twin = GPT(ModelConfig(**BASE), VOCAB, Ops("reference", "cuda")).cuda()
    twin.load_state_dict(model.state_dict())
    [fused] = build_optimizers(model.param_groups(), OptimConfig(name="adamw"), "cuda")
    [plain] = build_optimizers(twin.param_groups(), OptimConfig(name="adamw"), "neuron")  # the same, unfused
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    idx = torch.randint(0, VOCAB, (2, 1024), device="cuda")
    model(idx, idx.roll(-1, 1)).backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        b.grad = a.grad.clone()  # the same gradients: only the optimizers differ
    fused.step()
    plain.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_the_gpu_check_dry_runs_on_a_machine_without_cuda(tmp_path):
    if CUDA:
        pytest.skip("this machine has CUDA: the check would measure, not dry-run")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work")}
    result = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "dry run: no CUDA GPU here" in result.stdout
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["dry_run"] is True
    parts = report["parts"]
    assert set(parts) == {"gpu_tests", "bench", "train", "torchrun"}
    for name, part in parts.items():
        assert part["status"] == "skipped" and "needs a CUDA GPU" in part["reason"], (name, part)
        assert part["checked"]["ok"], (name, part["checked"])  # what a CPU can check of it passed
    assert f"{parts['gpu_tests']['checked']['skipped']} skipped" in result.stdout


@pytest.mark.gpu
@needs_cuda
def test_a_gpu_run_records_the_nominal_peak_and_the_matmul_rate_measured_beside_it(tmp_path, monkeypatch):
    from frontier import device as device_module
    from frontier.device import peak_figures, resolve_device

    monkeypatch.setattr(device_module, "PEAK_CACHE", tmp_path / "peak_flops.json")
    gpu = resolve_device("cuda", "bf16")
    figures = peak_figures(gpu)
    if gpu.nominal_peak_flops() is None:
        pytest.skip(f"no nominal peak is published here for {gpu.name}")
    assert figures["peak_flops"] == gpu.nominal_peak_flops()
    # a dense bf16 matmul reaches a large share of the nominal peak, and never far above it
    assert 0.2 * figures["peak_flops"] < figures["measured_matmul_flops"] < 1.2 * figures["peak_flops"], figures
