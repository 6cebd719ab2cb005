import torch

from frontier.config import ModelConfig
from frontier.model import GPT
from tests.conftest import compose_config
from frontier.config import to_config


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(**{"depth": 2, "d_model": 64, "n_head": 2, "seq_len": 32, **overrides})
    return GPT(cfg, vocab_size=97)


def test_changing_a_later_token_never_changes_earlier_logits():
    model = tiny_model(zero_init_proj=False)
    idx = torch.randint(0, 97, (2, 32))
    logits = model(idx)
    for t in (0, 10, 30):
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 97
        other = model(changed)
        assert torch.allclose(logits[:, : t + 1], other[:, : t + 1], atol=1e-6)
        assert not torch.allclose(logits[:, t + 1], other[:, t + 1])


def test_base_preset_has_the_baseline_parameter_count():
    config = to_config(compose_config(["model=base", "tracking.enabled=false"]))
    with torch.device("meta"):
        model = GPT(config.model, vocab_size=8192)
    total = model.num_params()["total"]
    assert abs(total - 59.6e6) / 59.6e6 < 0.01
    assert model.num_params()["embedding"] == 8192 * 640


def test_wide_and_deep_spend_the_baselines_non_embedding_budget():
    def blocks(preset):
        config = to_config(compose_config([f"model={preset}", "tracking.enabled=false"]))
        with torch.device("meta"):
            model = GPT(config.model, vocab_size=8192)
        return sum(p.numel() for p in model.blocks.parameters()), config.model

    base, base_cfg = blocks("base")
    for preset, relation in (("wide", "fewer"), ("deep", "more")):
        count, cfg = blocks(preset)
        assert abs(count - base) / base <= 0.10
        assert (cfg.depth < base_cfg.depth) if relation == "fewer" else (cfg.depth > base_cfg.depth)


def test_tiny_preset_is_cpu_sized():
    config = to_config(compose_config(["model=tiny", "tracking.enabled=false"]))
    model = GPT(config.model, vocab_size=8192)
    assert 1e6 <= model.num_params()["total"] <= 3e6
    assert config.model.seq_len == 256


def test_output_projections_start_at_zero_and_the_head_small():
    model = tiny_model()
    for block in model.blocks:
        assert torch.count_nonzero(block.attn.c_proj.weight) == 0
        assert torch.count_nonzero(block.mlp.c_proj.weight) == 0
    assert model.lm_head.weight.std() < 0.01
    assert 0.8 < model.wte.weight.std() < 1.2


def test_logits_are_soft_capped_and_loss_ignores_minus_one():
    model = tiny_model(head_std=10.0)
    idx = torch.randint(0, 97, (1, 16))
    assert model(idx).abs().max() <= 15.0
    targets = idx.clone()
    targets[0, 5:] = -1
    per_token = model(idx, targets, reduction="none")
    assert per_token.shape == (1, 16) and torch.all(per_token[0, 5:] == 0)
    assert torch.isclose(model(idx, targets), per_token[0, :5].mean())


def test_flops_per_token_follows_the_formula():
    model = tiny_model()
    matrices = model.num_params()["non_embedding"]
    assert model.flops_per_token() == 6 * matrices + 12 * 2 * 64 * 32
