import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from frontier import optim as optim_module
from frontier.config import ConfigError, ModelConfig, OptimConfig
from frontier.model import GPT
from frontier.optim import AdamW, Muon, apply_schedule, build_optimizers, orthogonalize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("coefficients", ["classic", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 128), (128, 48), (100, 300)])
def test_orthogonalised_update_has_singular_values_near_one(coefficients, shape, dtype):
    torch.manual_seed(0)
    G = torch.randn(*shape)  # rectangular Gaussian: well-conditioned, like a gradient
    X = orthogonalize(G, steps=5, coefficients=coefficients, dtype=dtype)
    assert X.dtype == dtype
    s = torch.linalg.svdvals(X.float())
    # The quintic iteration aims for a band around 1, not exactly 1.
    assert s.min() > 0.5 and s.max() < 1.3, s


class DtypesSeen(TorchDispatchMode):
    """Records the dtype of every tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def muon_of(ns_dtype: str, monkeypatch, native: bool) -> Muon:
    monkeypatch.setattr(optim_module, "bf16_native", lambda kind: (native, "as the test says"))
    model = GPT(ModelConfig(depth=1, d_model=32, n_head=2, seq_len=8), vocab_size=50)
    return build_optimizers(model.param_groups(), OptimConfig(ns_dtype=ns_dtype), "cpu")[1]


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_newton_schulz_dtype_follows_native_bf16(monkeypatch, native, expected):
    assert muon_of("auto", monkeypatch, native).ns_dtype == expected
    assert muon_of("fp32", monkeypatch, True).ns_dtype == torch.float32  # explicit settings win
    assert muon_of("bf16", monkeypatch, False).ns_dtype == torch.bfloat16


def test_an_fp32_muon_step_never_touches_bf16():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(16, 24))
    opt = Muon([W], lr=0.02, ns_dtype=torch.float32)
    (W ** 2).sum().backward()
    with DtypesSeen() as seen:
        opt.step()
    assert seen.dtypes == {torch.float32}


def test_an_unknown_newton_schulz_dtype_is_refused():
    with pytest.raises(ConfigError, match="optim.ns_dtype='fp16' is not allowed: choose one of auto, bf16, fp32"):
        OptimConfig(ns_dtype="fp16")


def test_same_shape_matrices_are_orthogonalised_as_a_batch():
    torch.manual_seed(0)
    stack = torch.randn(3, 16, 24)
    batched = orthogonalize(stack)
    for i in range(3):
        assert torch.allclose(batched[i].float(), orthogonalize(stack[i]).float(), atol=1e-2)


def test_muon_preset_splits_groups_and_schedule_scales_every_lr():
    model = GPT(ModelConfig(depth=2, d_model=32, n_head=2, seq_len=8), vocab_size=50)
    optimizers = build_optimizers(model.param_groups(), OptimConfig(), "cpu")
    adam, muon = optimizers
    assert isinstance(muon, Muon) and len(muon.param_groups[0]["params"]) == 2 * 6
    assert [g["lr"] for g in adam.param_groups] == [0.6, 0.004]
    apply_schedule(optimizers, 0.5, momentum=0.9)
    assert [g["lr"] for g in adam.param_groups] == [0.3, 0.002]
    assert muon.param_groups[0]["lr"] == 0.02 and muon.param_groups[0]["momentum"] == 0.9


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_lr_scale_multiplies_every_groups_rate_and_the_schedule_keeps_it(name):
    model = GPT(ModelConfig(depth=2, d_model=32, n_head=2, seq_len=8, layer_scalars=True), vocab_size=50)
    plain = build_optimizers(model.param_groups(), OptimConfig(name=name), "cpu")
    scaled = build_optimizers(model.param_groups(), OptimConfig(name=name, lr_scale=0.25), "cpu")
    apply_schedule(scaled, 0.5, momentum=0.9)
    rates = [g["lr"] for opt in plain for g in opt.param_groups]
    assert [g["lr"] for opt in scaled for g in opt.param_groups] == pytest.approx([r * 0.125 for r in rates])
    with pytest.raises(ConfigError, match="optim.lr_scale"):
        OptimConfig(lr_scale=0)


def test_adamw_preset_uses_adamw_for_everything():
    model = GPT(ModelConfig(depth=1, d_model=32, n_head=2, seq_len=8), vocab_size=50)
    (adam,) = build_optimizers(model.param_groups(), OptimConfig(name="adamw", matrix_lr=0.003), "cpu")
    assert isinstance(adam, AdamW)
    assert sum(len(g["params"]) for g in adam.param_groups) == len(list(model.parameters()))


def test_adamw_is_fused_on_a_cpu_and_steps_like_the_unfused_one():
    """Fused AdamW makes one pass per tensor where the for-loop makes several (d4: 30 -> 9 ms a step)."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(depth=2, d_model=32, n_head=2, seq_len=8, layer_scalars=True), vocab_size=50)
    twin = GPT(ModelConfig(depth=2, d_model=32, n_head=2, seq_len=8, layer_scalars=True), vocab_size=50)
    twin.load_state_dict(model.state_dict())
    fused = build_optimizers(model.param_groups(), OptimConfig(name="adamw"), "cpu")
    plain = build_optimizers(twin.param_groups(), OptimConfig(name="adamw"), "neuron")  # XLA has no fused AdamW
    assert fused[0].defaults["fused"] and not plain[0].defaults["fused"]
    idx = torch.randint(0, 50, (2, 8))
    for _ in range(3):
        for m, opts in ((model, fused), (twin, plain)):
            for opt in opts:
                opt.zero_grad()
            m(idx, idx.roll(-1, 1)).backward()
            for opt in opts:
                opt.step()
    for (key, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=key)


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_steps_exactly_as_torch_s_and_resumes_from_its_state(fused):
    """The same update as torch.optim.AdamW, bit for bit (its fused kernel, or its foreach form), over
    two param groups; its state_dict loads into a fresh optimizer that then goes on identically."""
    torch.manual_seed(0)
    shapes = [(8, 16), (16,), (4, 4)]
    start = [torch.randn(*shape) for shape in shapes]
    grads = [[torch.randn(*shape) for shape in shapes] for _ in range(4)]

    def groups(params):
        return [dict(params=params[:2], lr=0.01, weight_decay=0.1), dict(params=params[2:], lr=0.003, weight_decay=0.0)]

    def run(make, steps, params=None, state=None):
        params = params or [torch.nn.Parameter(t.clone()) for t in start]
        opt = make(groups(params))
        if state is not None:
            opt.load_state_dict(state)
        for step in steps:
            for p, g in zip(params, grads[step]):
                p.grad = g.clone()
            opt.step()
        return params, opt

    adam = dict(betas=(0.9, 0.95), eps=1e-10, fused=fused)
    theirs, _ = run(lambda g: torch.optim.AdamW(g, foreach=not fused, **adam), range(4))
    ours, _ = run(lambda g: AdamW(g, **adam), range(4))
    half, opt = run(lambda g: AdamW(g, **adam), range(2))
    resumed, _ = run(lambda g: AdamW(g, **adam), range(2, 4), [torch.nn.Parameter(p.detach().clone()) for p in half],
                     opt.state_dict())
    for a, b, c in zip(theirs, ours, resumed):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_a_run_s_optimizers_do_not_import_torch_dynamo():
    """torch.optim.Optimizer imports torch._dynamo (two CPU-seconds) on its first call; Frontier's own do not."""
    code = ("import sys, torch\n"
            "from frontier.config import ModelConfig, OptimConfig\n"
            "from frontier.model import GPT\n"
            "from frontier.optim import build_optimizers\n"
            "model = GPT(ModelConfig(depth=1, d_model=32, n_head=2, seq_len=8), vocab_size=50)\n"
            "for name in ('muon', 'adamw'):\n"
            "    optimizers = build_optimizers(model.param_groups(), OptimConfig(name=name), 'cpu')\n"
            "    idx = torch.randint(0, 50, (2, 8))\n"
            "    model(idx, idx.roll(-1, 1)).backward()\n"
            "    for opt in optimizers:\n"
            "        opt.step()\n"
            "        opt.load_state_dict(opt.state_dict())\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "[]"


def test_muon_step_lowers_a_loss():
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(16, 16))
    target = torch.randn(16, 16)
    opt = Muon([W], lr=0.02)
    start = ((W - target) ** 2).sum().item()
    for _ in range(20):
        opt.zero_grad()
        ((W - target) ** 2).sum().backward()
        opt.step()
    assert ((W - target) ** 2).sum().item() < start
