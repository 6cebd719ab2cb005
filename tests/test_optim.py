import pytest
import torch

from frontier.config import OptimConfig
from frontier.model import GPT
from frontier.config import ModelConfig
from frontier.optim import Muon, apply_schedule, build_optimizers, orthogonalize


@pytest.mark.parametrize("coefficients", ["classic", "polar_express"])
@pytest.mark.parametrize("shape", [(48, 128), (128, 48), (100, 300)])
def test_orthogonalised_update_has_singular_values_near_one(coefficients, shape):
    torch.manual_seed(0)
    G = torch.randn(*shape)  # rectangular Gaussian: well-conditioned, like a gradient
    s = torch.linalg.svdvals(orthogonalize(G, steps=5, coefficients=coefficients).float())
    # The quintic iteration aims for a band around 1, not exactly 1 (bf16 arithmetic too).
    assert s.min() > 0.5 and s.max() < 1.3, s


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


def test_adamw_preset_uses_adamw_for_everything():
    model = GPT(ModelConfig(depth=1, d_model=32, n_head=2, seq_len=8), vocab_size=50)
    (adam,) = build_optimizers(model.param_groups(), OptimConfig(name="adamw", matrix_lr=0.003), "cpu")
    assert isinstance(adam, torch.optim.AdamW)
    assert sum(len(g["params"]) for g in adam.param_groups) == len(list(model.parameters()))


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
