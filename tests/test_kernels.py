"""Kernels: the registry, the `kernel` config group, a clear stop for a backend this machine cannot
run, and every implementation that can run here against its reference, outputs and gradients.
Triton kernels run under TRITON_INTERPRET=1 where triton is installed; NKI kernels run in the NKI
CPU simulator where the Neuron SDK's nki package imports. Otherwise those tests skip, saying why."""
import importlib
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import kernels
from frontier.config import KERNEL_OPS, ConfigError, KernelConfig, ModelConfig, to_config
from frontier.model import GPT, Ops
from kernels import head_loss as chunked
from kernels import reference
from tests.conftest import FAST, command_in_process, compose_config

# Triton kernels run on the GPU where there is one, else on CPU tensors through Triton's interpreter,
# which tests/conftest.py turns on before anything imports triton.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

ROWS = (1, 127, 129, 300)  # around the 128-row tiles of the NKI kernels
HEAD_CASES = [  # rows, vocab, softcap, reduction: chunks of 64 rows leave a ragged last chunk
    (1, 37, None, "mean"),
    (127, 1000, 15.0, "mean"),
    (129, 257, 2.0, "sum"),
    (129, 100, 2.0, "mean"),  # rows narrower than a Triton block: several to a program
    (300, 1000, 3.0, "none"),
    (129, 257, 100.0, "mean"),  # a cap above EXP_SAFE_SOFTCAP: the row maximum is taken
]


def assert_matches(impl, ref, *inputs, atol=1e-5, rtol=1e-5, **kwargs):
    """Same output and same gradients for every input that requires them, under a random upstream grad."""
    expected = ref(*inputs, **kwargs)
    got = impl(*inputs, **kwargs)
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
    upstream = torch.randn_like(expected)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.testing.assert_close(torch.autograd.grad(got, leaves, upstream),
                               torch.autograd.grad(expected, leaves, upstream), atol=atol, rtol=rtol)


def head_inputs(rows, vocab, d=16, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen)
    weight = 2 * torch.randn(vocab, d, generator=gen)  # logits large enough for the cap to matter
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    targets[torch.rand(rows, generator=gen) < 0.2] = -1
    targets[0] = 3  # at least one counted row
    return x.to(device).requires_grad_(), weight.to(device).requires_grad_(), targets.to(device)


# -- registry and config ----------------------------------------------------------------------------

def test_every_op_has_a_reference_and_a_config_key():
    assert set(kernels.OPS) == set(KERNEL_OPS)
    for op in kernels.OPS:
        assert "reference" in kernels.backends(op)
        assert hasattr(KernelConfig(), op)
    assert kernels.get("rmsnorm") is reference.rms_norm
    assert kernels.get("head_loss") is chunked.head_loss


def test_lookups_name_what_exists():
    with pytest.raises(KeyError, match="unknown op 'softmax'"):
        kernels.get("softmax")
    with pytest.raises(KeyError, match="no 'nki' implementation of 'attention'; available: reference"):
        kernels.get("attention", "nki")
    assert kernels.backends("rmsnorm") == ["nki", "reference", "triton"]  # listed without importing them


def test_presets_use_their_backend_where_it_exists_and_the_reference_elsewhere():
    assert set(kernels.choose("reference").values()) == set(kernels.choose("compiled").values()) == {"reference"}
    triton = kernels.choose("triton")
    assert {op for op, b in triton.items() if b == "triton"} == {"rmsnorm", "head_loss"}
    nki = kernels.choose("nki")
    assert {op for op, b in nki.items() if b == "nki"} == {"rmsnorm", "relu2"}
    mixed = kernels.choose("triton", {"rmsnorm": "reference", "relu2": "nki", "attention": None})
    assert (mixed["rmsnorm"], mixed["relu2"], mixed["head_loss"], mixed["attention"]) == (
        "reference", "nki", "triton", "reference")
    with pytest.raises(kernels.KernelError, match="kernel.attention=nki: there is no nki implementation"):
        kernels.choose("reference", {"attention": "nki"})


def test_the_kernel_group_takes_a_preset_and_a_per_op_mix():
    config = to_config(compose_config([*FAST, "kernel=triton", "kernel.rmsnorm=reference", "kernel.relu2=nki"]))
    assert config.kernel.name == "triton"
    assert config.kernel.overrides() == {"rmsnorm": "reference", "relu2": "nki"}
    chosen = kernels.choose(config.kernel.name, config.kernel.overrides())
    assert (chosen["rmsnorm"], chosen["relu2"], chosen["head_loss"]) == ("reference", "nki", "triton")
    for preset in ("reference", "compiled", "nki"):
        assert to_config(compose_config([*FAST, f"kernel={preset}"])).kernel.name == preset
    compiled = to_config(compose_config([*FAST, "kernel=compiled", "kernel.compile_mode=max-autotune"]))
    assert compiled.kernel.compile_mode == "max-autotune"
    with pytest.raises(ConfigError, match="kernel.rmsnorm='cuda' is not allowed: choose one of reference, triton"):
        to_config(compose_config([*FAST, "kernel.rmsnorm=cuda"]))


def test_ops_stop_on_a_backend_this_machine_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("NKI_SIMULATOR", raising=False)
    with pytest.raises(ConfigError, match=r"the triton kernels \(rmsnorm, head_loss\) cannot run here: "
                                          r"(the triton package is not installed \(pip install triton|"
                                          r"Triton kernels need a CUDA GPU)"):
        Ops(KernelConfig(name="triton"), "cpu")
    with pytest.raises(ConfigError, match=r"the nki kernels \(rmsnorm\) cannot run here: "
                                          r"(the Neuron SDK's nki package is not installed: .*pip install neuronx-cc|"
                                          r"NKI kernels need a Trainium device)"):
        Ops(KernelConfig(rmsnorm="nki"), "cpu")
    with pytest.raises(ConfigError, match="there is no nki implementation of attention"):
        Ops(KernelConfig(attention="nki"), "cpu")
    ops = Ops(KernelConfig(name="compiled"), "cpu")
    assert ops.rmsnorm is reference.rms_norm and ops.head_loss is chunked.head_loss
    assert Ops("reference").attention is reference.causal_attention


@pytest.mark.parametrize("args, backend", [(["kernel=triton"], "triton"), (["kernel.rmsnorm=nki"], "nki")])
def test_cli_stops_before_reading_data(args, backend, tmp_path):
    # a shard that is not parquet: had the data been read first, that would be the error
    (tmp_path / "shard_00000.parquet").write_text("not parquet")
    (tmp_path / "shard_00001.parquet").write_text("not parquet")
    overrides = [a for a in FAST if not a.startswith("data.path=")] + [f"data.path={tmp_path}", *args,
                                                                         f"hydra.run.dir={tmp_path / 'run'}"]
    result = command_in_process("frontier.train", overrides, env={"TRITON_INTERPRET": "0", "NKI_SIMULATOR": "0"})
    assert result.returncode == 2, result.stderr
    assert f"error: the {backend} kernels" in result.stderr and "cannot run here" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # found before Hydra made the run directory


# -- relu2: the reference's in-place backward ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu2_with_its_in_place_backward_is_bit_identical_to_autograd(dtype):
    torch.manual_seed(0)
    x = torch.randn(4, 33, 96, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    out = reference.relu2(x)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "_ReLU2Backward"
    (mine,) = torch.autograd.grad(out, x, grad)
    plain = torch.nn.functional.relu(x).square()
    (expected,) = torch.autograd.grad(plain, x, grad)
    assert torch.equal(out, plain) and torch.equal(mine, expected)
    with torch.no_grad():  # no backward to prepare: the plain definition
        assert torch.equal(reference.relu2(x), plain)
    out = reference.relu2(x)
    out.backward(grad, retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(grad)  # its saved tensor was spent: a second backward is refused, not wrong


# -- rmsnorm and rotary: the reference's own backwards on a CPU ------------------------------------------

@pytest.mark.parametrize("shape", [(4, 33, 96), (2, 3, 17, 64)])
def test_rms_norm_with_its_own_backward_matches_f_rms_norm(shape):
    torch.manual_seed(0)
    x = torch.randn(*shape)
    x[0, 0] = 0  # a zero row: only eps keeps it finite
    x.requires_grad_()
    assert type(reference.rms_norm(x).grad_fn).__name__ == "_RMSNormBackward"
    assert_matches(reference.rms_norm, lambda t: F.rms_norm(t, (t.size(-1),)), x, atol=1e-6, rtol=1e-5)
    wide = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(reference._RMSNorm.apply, (wide,))


def test_rotary_with_its_own_backward_matches_the_plain_definition():
    torch.manual_seed(0)
    x = torch.randn(2, 17, 3, 64).transpose(1, 2).requires_grad_()  # (B, H, T, D) as a view, like the model's q
    angles = torch.outer(torch.arange(17.0), 10000 ** -(torch.arange(0, 64, 2) / 64))
    cos, sin = angles.cos(), angles.sin()

    def plain(x, cos, sin):
        x1, x2 = x[..., :32], x[..., 32:]
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)

    assert type(reference.apply_rotary(x, cos, sin).grad_fn).__name__ == "_RotaryBackward"
    assert_matches(reference.apply_rotary, plain, x, cos, sin, atol=1e-6, rtol=1e-5)
    wide = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(reference._Rotary.apply, (wide, cos[:5, :4].double(), sin[:5, :4].double()))


# -- head_loss: the chunked reference path ----------------------------------------------------------

@pytest.mark.parametrize("rows, vocab, softcap, reduction", HEAD_CASES)
def test_chunked_head_loss_matches_the_definition(rows, vocab, softcap, reduction):
    x, weight, targets = head_inputs(rows, vocab)
    assert_matches(partial(chunked.head_loss, chunk_rows=64), reference.head_loss, x, weight, targets, softcap=softcap, reduction=reduction)


def test_chunked_head_loss_without_weight_grads_or_any_grads():
    x, weight, targets = head_inputs(200, 300)
    weight.requires_grad_(False)
    impl = partial(chunked.head_loss, chunk_rows=64)
    assert_matches(impl, reference.head_loss, x, weight, targets, softcap=15.0)
    with torch.no_grad():
        torch.testing.assert_close(impl(x, weight, targets, softcap=15.0, reduction="none"),
                                   reference.head_loss(x, weight, targets, softcap=15.0, reduction="none"))


def test_the_soft_cap_in_sigmoid_form_is_tanh_to_within_two_ulps_of_one():
    z = torch.cat([torch.linspace(-200, 200, 40001), torch.tensor([0.0, 1e-30, -1e-30, 1e-6, 3.0e38, -3.0e38])])
    softcap = 15.0
    got = chunked.capped_(z.clone(), softcap)
    expected = torch.tanh(z.double() / softcap)
    assert not got.isnan().any()
    assert (got.double() - expected).abs().max() <= 2 ** -22  # two ulps of 1.0
    assert got.abs().max() <= 1.0  # the logits stay inside the cap


@pytest.mark.parametrize("softcap", [None, 3.0, 15.0])
def test_the_compiled_chunk_arithmetic_matches_the_eager_one(softcap):
    torch.manual_seed(0)
    z = torch.randn(64, 300) * 8
    targets = torch.randint(0, 300, (64,))
    targets[[3, 40]] = chunked.IGNORE
    scale = (targets != chunked.IGNORE).float() / 62
    expected = chunked.torch_row_loss_grad(z.clone(), targets, scale, softcap, None)
    got = chunked.compiled_row_loss_grad(z.clone(), targets, scale, softcap, None)
    for g, e in zip(got, expected):  # loss, log-sum-exp and the gradient
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert got[0][3] == 0 and got[2][40].abs().max() == 0  # ignored rows neither lose nor learn


@pytest.mark.parametrize("softcap", [15.0, 100.0])
def test_a_row_far_below_a_large_cap_keeps_a_finite_loss_and_gradient(softcap):
    """exp(logit - softcap) underflows to 0 for a whole row whose capped logits all lie ~90 below the cap:
    above EXP_SAFE_SOFTCAP the row maximum is taken instead, eager and compiled."""
    torch.manual_seed(0)
    z = torch.randn(8, 300) - 2 * softcap  # capped: about -0.96 softcap, 1.96 softcap below the cap
    targets = torch.randint(0, 300, (8,))
    scale = torch.full((8,), 1 / 8)
    logits = (softcap * torch.tanh(z.double() / softcap)).requires_grad_()
    loss = F.cross_entropy(logits, targets, reduction="none")
    (grad,) = torch.autograd.grad(loss.sum() / 8, logits)
    expected = grad * (1 - torch.tanh(z.double() / softcap) ** 2)
    for row_loss_grad in (chunked.torch_row_loss_grad, chunked.compiled_row_loss_grad):
        got_loss, _, got_grad = row_loss_grad(z.clone(), targets, scale, softcap, None)
        torch.testing.assert_close(got_loss.double(), loss.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_grad.double(), expected, rtol=1e-4, atol=1e-7)


def test_on_a_cpu_the_chunked_head_loss_stays_eager_inside_torch_compile(monkeypatch):
    monkeypatch.setattr(chunked, "_fused_row_loss_grad", None)
    x, weight, targets = head_inputs(200, 300)
    model = torch.nn.Linear(16, 16)

    def step(x, weight, targets):
        return chunked.head_loss(torch.relu(model(x)), weight, targets, softcap=15.0, chunk_rows=64)

    torch._dynamo.reset()
    got = torch.compile(step, backend="inductor", fullgraph=False)(x, weight, targets)
    assert type(got.grad_fn).__name__ == "HeadLossBackward"  # its own autograd node, not inductor's
    assert chunked._fused_row_loss_grad is not None  # and each chunk's arithmetic went through inductor
    expected = reference.head_loss(torch.relu(model(x)), weight, targets, softcap=15.0)
    torch.testing.assert_close(got, expected)
    for g, e in zip(torch.autograd.grad(got, (x, weight)), torch.autograd.grad(expected, (x, weight))):
        torch.testing.assert_close(g, e)


def test_chunked_head_loss_under_bf16_autocast_matches_the_definition():
    x, weight, targets = head_inputs(200, 500, d=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = chunked.head_loss(x, weight, targets, softcap=15.0, chunk_rows=64)
        expected = reference.head_loss(x, weight, targets, softcap=15.0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for g, e in zip(torch.autograd.grad(got, (x, weight)), torch.autograd.grad(expected, (x, weight))):
        assert g.dtype == e.dtype == torch.float32
        assert (g - e).abs().max() <= 1e-2 * e.abs().max()  # bf16 matmuls, summed in another order


@pytest.mark.parametrize("knobs", [
    {},
    {"softcap": None},
    {"tie_embeddings": True, "mtp_heads": 2, "mtp_weights": [0.5, 0.25]},
])
def test_the_training_loss_is_the_logits_path_loss(knobs):
    torch.manual_seed(0)
    cfg = ModelConfig(depth=2, d_model=64, n_head=2, seq_len=32, zero_init_proj=False, head_std=0.05, **knobs)
    model = GPT(cfg, vocab_size=97)
    idx = torch.randint(0, 97, (2, 32))
    targets = torch.randint(0, 97, (2, 32))
    targets[0, :5] = -1
    params = [p for p in model.parameters() if p.requires_grad]

    loss = model(idx, targets)  # the head_loss op
    x = model.trunk(idx)  # the logits path, as before head_loss
    expected = F.cross_entropy(model.unembed(x).flatten(0, 1), targets.flatten(), ignore_index=-1)
    for k, (logits, weight) in enumerate(zip(model.mtp_logits(x), cfg.mtp_weights), 1):
        shifted = F.pad(targets[:, k:], (0, k), value=-1)
        expected = expected + weight * F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), ignore_index=-1)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, params, allow_unused=True),
                               torch.autograd.grad(expected, params, allow_unused=True), atol=1e-6, rtol=1e-5)

    model.eval()
    with torch.no_grad():  # evaluation's per-token losses
        per_token = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="none")
        torch.testing.assert_close(model(idx, targets, reduction="none"), per_token.view_as(targets))


# -- Triton, under the interpreter ------------------------------------------------------------------

@pytest.fixture(scope="module")
def triton_ops():
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton): its kernels are not checked here")
    if TRITON_DEVICE == "cpu" and not TRITON_INTERPRETED:
        pytest.skip("TRITON_INTERPRET is not 1 here: without a GPU, Triton's kernels need its interpreter")
    return importlib.import_module("kernels.triton_ops")


@pytest.mark.parametrize("shape", [(rows, 100) for rows in ROWS] + [(2, 150, 48)])
def test_triton_rms_norm_matches_the_reference(triton_ops, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(TRITON_DEVICE).requires_grad_()
    assert_matches(triton_ops.rms_norm, reference.rms_norm, x)


@pytest.mark.parametrize("rows, vocab, softcap, reduction", HEAD_CASES)
def test_triton_head_loss_matches_the_definition(triton_ops, monkeypatch, rows, vocab, softcap, reduction):
    monkeypatch.setattr(triton_ops, "MAX_BLOCK", 512)  # two column blocks per row, the last ragged
    x, weight, targets = head_inputs(rows, vocab, device=TRITON_DEVICE)
    assert_matches(partial(triton_ops.head_loss, chunk_rows=64), reference.head_loss, x, weight, targets, softcap=softcap, reduction=reduction)


# -- NKI, in the CPU simulator ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def nki_ops():
    missing = kernels.unavailable("nki", "neuron")  # on a neuron device only the package can be missing
    if missing:
        pytest.skip(f"NKI kernels not checked: {missing}")
    return importlib.import_module("kernels.nki_ops")


@pytest.mark.parametrize("shape", [(rows, 96) for rows in ROWS] + [(2, 150, 48)])
@pytest.mark.parametrize("op, ref", [("rms_norm", reference.rms_norm), ("relu2", reference.relu2)])
def test_nki_kernels_match_the_reference_in_the_simulator(nki_ops, op, ref, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()
    assert_matches(getattr(nki_ops, op), ref, x, atol=1e-4, rtol=1e-4)
