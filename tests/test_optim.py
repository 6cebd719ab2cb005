import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from frontier import optim as optim_module
from frontier.config import ConfigError, ModelConfig, OptimConfig
from frontier.model import GPT
from frontier.optim import Muon, apply_schedule, build_optimizers, orthogonalize


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
    assert isinstance(adam, torch.optim.AdamW)
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


def tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(depth=2, d_model=32, n_head=2, seq_len=8, layer_scalars=True), vocab_size=50)


def train_steps(model, optimizers, steps, start=0, schedule=None):
    """Steps `start` ... `steps - 1` on batches fixed by their step number."""
    for step in range(start, steps):
        idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(step))
        if schedule is not None:
            apply_schedule(optimizers, *schedule(step))
        model(idx, idx.roll(-1, 1)).backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_a_run_s_optimizers_are_torch_s(name):
    """Whatever takes a torch optimizer (LR schedulers, ZeroRedundancyOptimizer, FSDP's optimizer state
    dict, step hooks) takes each of a run's."""
    optimizers = build_optimizers(tiny_model().param_groups(), OptimConfig(name=name), "cpu")
    assert [type(opt) for opt in optimizers] == ([torch.optim.AdamW, Muon] if name == "muon" else [torch.optim.AdamW])
    assert all(isinstance(opt, torch.optim.Optimizer) for opt in optimizers)


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_lambda_lr_sets_each_optimizer_s_rate_as_its_lambda_says(kind):
    """Every group keeps its configured rate as `initial_lr`, which LambdaLR scales (and keeps); a step
    takes the rate the scheduler set: at a lambda of 0 the weights stay as they are."""
    model = tiny_model()
    optimizers = build_optimizers(model.param_groups(), OptimConfig(lr_scale=0.5), "cpu")
    (opt,) = [opt for opt in optimizers if type(opt).__name__ == kind]
    configured = [group["lr"] for group in opt.param_groups]
    factors = [1.0, 0.25, 0.0]
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: factors[step])
    for step, factor in enumerate(factors):
        assert [group["lr"] for group in opt.param_groups] == [rate * factor for rate in configured]
        assert [group["initial_lr"] for group in opt.param_groups] == configured
        before = [p.detach().clone() for group in opt.param_groups for p in group["params"]]
        train_steps(model, [opt], step + 1, start=step)
        after = [p.detach() for group in opt.param_groups for p in group["params"]]
        moved = sum(not torch.equal(a, b) for a, b in zip(before, after))
        assert moved == (0 if factor == 0 else len(before)), (step, moved, len(before))
        if step + 1 < len(factors):
            scheduler.step()


@pytest.mark.parametrize("name", ["muon", "adamw"])
def test_optimizer_state_saved_and_loaded_continues_the_run_bit_for_bit(name):
    """state_dict() written to a file and read into freshly built optimizers (as resume.pt is), then the
    rest of the run: the same weights, bit for bit, as the run that never stopped; the schedule (rates
    and Muon's momentum) changes every step, so the rates the groups carry must be the right ones."""
    cfg = OptimConfig(name=name, ns_dtype="fp32")

    def schedule(step):
        return 1.0 - 0.1 * step, 0.85 + 0.02 * step

    whole = tiny_model()
    train_steps(whole, build_optimizers(whole.param_groups(), cfg, "cpu"), 6, schedule=schedule)

    first = tiny_model()
    optimizers = build_optimizers(first.param_groups(), cfg, "cpu")
    train_steps(first, optimizers, 3, schedule=schedule)
    file = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizers": [opt.state_dict() for opt in optimizers]}, file)
    file.seek(0)
    saved = torch.load(file, weights_only=False)

    resumed = tiny_model()  # the same start, then the saved weights over it
    resumed.load_state_dict(saved["model"])
    optimizers = build_optimizers(resumed.param_groups(), cfg, "cpu")
    for opt, state in zip(optimizers, saved["optimizers"], strict=True):
        opt.load_state_dict(state)
    assert all(len(opt.state) == sum(len(g["params"]) for g in opt.param_groups) for opt in optimizers)
    train_steps(resumed, optimizers, 6, start=3, schedule=schedule)
    for (key, a), b in zip(whole.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), key


def test_muon_step_takes_a_closure_as_torch_s_optimizers_do():
    torch.manual_seed(0)
    start, target = torch.randn(16, 24), torch.randn(16, 24)
    by_hand, by_closure = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ((by_hand - target) ** 2).sum().backward()
    Muon([by_hand], lr=0.02, ns_dtype=torch.float32).step()

    def closure():
        loss = ((by_closure - target) ** 2).sum()
        loss.backward()
        return loss

    loss = Muon([by_closure], lr=0.02, ns_dtype=torch.float32).step(closure)
    assert loss.item() == ((start - target) ** 2).sum().item()
    assert torch.equal(by_hand, by_closure) and not torch.equal(by_hand, start)


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
