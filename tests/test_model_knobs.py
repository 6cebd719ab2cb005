"""The model group's knobs: each changes the model as described, keeps it causal, trains, and
fails on bad input naming the key."""
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

from frontier.checkpoint import load_for_eval, save_final
from frontier.config import ConfigError, ModelConfig, OptimConfig, to_config
from frontier.model import GPT, layer_windows
from frontier.model_card import main as model_card
from frontier.optim import build_optimizers
from kernels.reference import cached_attention, causal_attention
from tests.conftest import compose_config

V = 97
SMALL = dict(depth=2, d_model=64, n_head=2, seq_len=32)
# Every knob away from its default at once, on a CPU-sized model.
EVERYTHING = dict(depth=4, d_model=64, n_head=4, n_kv_head=2, head_dim=24, seq_len=32, rope_base=500.0,
                  window_pattern="SL", short_window=0.25, activation="swiglu", mlp_ratio=2.0,
                  value_embed_layers=[0, -1], layer_scalars=True, tie_embeddings=True, softcap=30.0,
                  mtp_heads=2, mtp_weights=[0.5, 0.25], zero_init_proj=False)


def model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**SMALL, **overrides}), vocab_size=V)


def preset(name: str) -> tuple[GPT, ModelConfig]:
    cfg = to_config(compose_config([f"model={name}", "tracking.enabled=false"])).model
    with torch.device("meta"):
        return GPT(cfg, vocab_size=8192), cfg


def same_weights_as(m: GPT, plain: GPT) -> set[str]:
    """Copies the baseline's weights into `m`; returns the names of m's own extra parameters."""
    missing, unexpected = m.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected
    return set(missing)


def tokens(rows: int = 2, seq: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (rows, seq), generator=torch.Generator().manual_seed(seed))


# -- attention ------------------------------------------------------------------------------------

def test_kv_heads_and_head_dim_size_the_projections():
    m = model(n_head=4, n_kv_head=1, head_dim=48)
    attn = m.blocks[0].attn
    assert attn.c_q.weight.shape == (4 * 48, 64) and attn.c_proj.weight.shape == (64, 4 * 48)
    assert attn.c_k.weight.shape == attn.c_v.weight.shape == (48, 64)
    assert m.cos.shape == (32, 24)
    per_layer = 2 * 64 * 192 + 2 * 64 * 48 + 2 * 64 * 256
    assert m.num_params()["non_embedding"] == 2 * per_layer + V * 64
    assert m(tokens()).shape == (2, 32, V)


def test_grouped_attention_shares_each_kv_head_across_its_query_group():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    expected = causal_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1))
    assert torch.allclose(causal_attention(q, k, v), expected, atol=1e-6)
    # query heads 0, 1 read KV head 0; heads 2, 3 read KV head 1
    assert torch.allclose(causal_attention(q[:, :2], k[:, :1], v[:, :1]), expected[:, :2], atol=1e-6)


def test_sliding_window_matches_an_explicit_banded_softmax():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 12, 8) for _ in range(3))
    W = 3
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    t, s = torch.arange(12)[:, None], torch.arange(12)[None, :]
    scores = scores.masked_fill(~((s <= t) & (s > t - W)), float("-inf"))
    assert torch.allclose(causal_attention(q, k, v, window=W), scores.softmax(-1) @ v, atol=1e-5)
    assert torch.allclose(causal_attention(q, k, v, window=12), causal_attention(q, k, v), atol=1e-6)


def test_cached_attention_aligns_queries_with_the_end_of_the_keys():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8)
    for window in (None, 3):
        full = causal_attention(q, k, v, window=window)
        assert torch.allclose(cached_attention(q, k, v, window=window), full, atol=1e-5)
        # the last 5 queries against all 12 keys: SDPA's top-left is_causal would be wrong here
        assert torch.allclose(cached_attention(q[:, :, 7:], k, v, window=window), full[:, :, 7:], atol=1e-5)


def test_window_pattern_tiles_over_depth_and_the_last_layer_is_full():
    cfg = ModelConfig(**{**SMALL, "depth": 6, "window_pattern": "SSSL", "short_window": 0.25})
    assert layer_windows(cfg) == [8, 8, 8, None, 8, None]
    assert layer_windows(ModelConfig(**{**SMALL, "depth": 3, "window_pattern": "S"})) == [16, 16, None]
    assert layer_windows(ModelConfig(**SMALL)) == [None, None]
    m = GPT(cfg, V)
    assert [b.attn.window for b in m.blocks] == layer_windows(cfg)


def test_a_sliding_window_layer_never_sees_past_its_window():
    m = model(depth=2, window_pattern="S", short_window=0.25, zero_init_proj=False)  # layer 0: 8 tokens
    attn = m.blocks[0].attn
    x = torch.randn(1, 32, 64)
    out = attn(x, m.cos, m.sin)
    t = 20
    far, near = x.clone(), x.clone()
    far[:, t - 8] += 1.0  # just outside the window of query t
    near[:, t - 7] += 1.0  # the oldest token inside it
    assert torch.allclose(attn(far, m.cos, m.sin)[:, t], out[:, t], atol=1e-6)
    assert not torch.allclose(attn(near, m.cos, m.sin)[:, t], out[:, t], atol=1e-6)


def test_qk_norm_and_rope_base_change_the_function():
    idx = tokens()
    base = model(zero_init_proj=False)(idx)
    assert not torch.allclose(model(zero_init_proj=False, qk_norm=False)(idx), base)
    other = model(zero_init_proj=False, rope_base=100.0)
    assert not torch.allclose(other.cos, model().cos) and not torch.allclose(other(idx), base)


# -- MLP ------------------------------------------------------------------------------------------

def test_activations_and_mlp_ratio_shape_the_mlp():
    assert model(mlp_ratio=3.0).blocks[0].mlp.c_fc.weight.shape == (192, 64)
    swiglu = model(activation="swiglu", mlp_ratio=2.0).blocks[0].mlp
    assert swiglu.c_gate.weight.shape == swiglu.c_fc.weight.shape == (128, 64)
    assert model(activation="swiglu").num_params()["total"] - model().num_params()["total"] == 2 * 64 * 256
    idx = tokens()
    relu2 = model(zero_init_proj=False)(idx)
    # leaky ReLU² with slope 0 is ReLU²; any other slope or activation is a different function
    assert torch.allclose(model(zero_init_proj=False, activation="leaky_relu2", activation_slope=0.0)(idx), relu2)
    for overrides in (dict(activation="leaky_relu2"), dict(activation="gelu")):
        assert not torch.allclose(model(zero_init_proj=False, **overrides)(idx), relu2)


# -- residual stream ------------------------------------------------------------------------------

def test_value_embeddings_add_a_gated_table_on_the_listed_layers():
    m = model(depth=4, n_head=4, n_kv_head=2, value_embed_layers=[1, -1], zero_init_proj=False)
    assert sorted(m.value_embeds) == ["1", "3"]
    assert m.value_embeds["1"].weight.shape == (V, 2 * 16)  # sized like v: KV heads x head size
    gated = [b.attn.ve_gate for b in m.blocks]
    assert gated[0] is None and gated[2] is None and gated[1].weight.shape == (2, 32)
    assert torch.count_nonzero(gated[1].weight) == 0  # gate = 2 sigmoid(0) = 1 at init
    assert m.num_params()["embedding"] == V * 64 + 2 * V * 32
    plain = model(depth=4, n_head=4, n_kv_head=2, zero_init_proj=False)
    assert same_weights_as(m, plain) == {"value_embeds.1.weight", "value_embeds.3.weight",
                                         "blocks.1.attn.ve_gate.weight", "blocks.3.attn.ve_gate.weight"}
    idx = tokens()
    assert not torch.allclose(m(idx), plain(idx))
    with torch.no_grad():
        for table in m.value_embeds.values():
            table.weight.zero_()
    assert torch.allclose(m(idx), plain(idx), atol=1e-5)  # the tables are the only change


def test_layer_scalars_mix_the_residual_and_the_embedding():
    m = model(layer_scalars=True, zero_init_proj=False)
    assert m.resid_scalars.shape == m.x0_scalars.shape == (2,)
    assert torch.all(m.resid_scalars == 0) and torch.allclose(m.x0_scalars, torch.full((2,), 0.1))
    plain = model(zero_init_proj=False)
    assert same_weights_as(m, plain) == {"resid_scalars", "x0_scalars"}
    idx = tokens()
    assert not torch.allclose(m(idx), plain(idx))
    with torch.no_grad():
        m.x0_scalars.zero_()  # residual scale 1, no embedding skip: the baseline
    assert torch.allclose(m(idx), plain(idx), atol=1e-5)


# -- head -----------------------------------------------------------------------------------------

def test_softcap_null_leaves_logits_uncapped():
    idx = tokens()
    assert model(head_std=10.0)(idx).abs().max() <= 15.0
    assert model(head_std=10.0, softcap=None)(idx).abs().max() > 15.0


def test_tied_embeddings_share_one_matrix():
    m = model(tie_embeddings=True)
    assert m.lm_head.weight is m.wte.weight
    assert m.num_params()["total"] == model().num_params()["total"] - V * 64
    assert m.flops_per_token() == model().flops_per_token()  # the head matmul still runs
    assert m.wte.weight.std() < 0.01  # the head's scale


def test_multi_token_heads_train_on_shifted_targets_and_leave_logits_alone():
    m, plain = model(mtp_heads=2, mtp_weights=[0.5, 0.25]), model()
    assert same_weights_as(m, plain) == {"mtp.0.weight", "mtp.1.weight"}
    idx, targets = tokens(), tokens(seed=2)
    assert len(m.mtp) == 2 and m.mtp[0].weight.shape == (64, 64)
    assert torch.equal(m(idx), plain(idx))  # t+1 logits: the extra heads are not in the forward
    m.eval()
    assert torch.allclose(m(idx, targets), plain(idx, targets))  # evaluation loss is t+1 only
    m.train()
    with torch.no_grad():  # make the heads differ from the next-token head
        for adapter in m.mtp:
            adapter.weight.normal_(std=0.1)
    x = m.trunk(idx)
    by_hand = F.cross_entropy(m.unembed(x).flatten(0, 1), targets.flatten())
    for k, (logits, w) in enumerate(zip(m.mtp_logits(x), [0.5, 0.25]), 1):
        by_hand = by_hand + w * F.cross_entropy(logits[:, :-k].flatten(0, 1), targets[:, k:].flatten())
    assert torch.allclose(m(idx, targets), by_hand, atol=1e-5)
    assert m.flops_per_token() - plain.flops_per_token() == 6 * 2 * (64 * 64 + V * 64)


def test_init_scales():
    m = model(embed_std=0.5, head_std=0.02, zero_init_proj=False)
    assert 0.45 < m.wte.weight.std() < 0.55 and 0.015 < m.lm_head.weight.std() < 0.025
    assert all(torch.count_nonzero(b.attn.c_proj.weight) > 0 for b in m.blocks)


# -- presets: parameter counts and FLOPs by hand --------------------------------------------------

def test_wide_mqa_preset_counted_by_hand():
    m, cfg = preset("wide_mqa")
    assert (cfg.depth, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.value_embed_layers) == (8, 768, 3, 1, [1, 3, 5, 7])
    d, hd, vocab = 768, 256, 8192
    per_layer = 2 * d * d + 2 * d * hd + 2 * d * 4 * d  # q, proj; one KV head's k, v; MLP
    gates = 4 * 32  # one KV head reading 32 channels, on 4 layers
    embedding = vocab * d + 4 * vocab * hd
    assert m.num_params() == {"total": 8 * per_layer + gates + embedding + vocab * d + 2 * 8,
                              "embedding": embedding,
                              "non_embedding": 8 * per_layer + gates + vocab * d + 2 * 8}
    assert m.flops_per_token() == 6 * (8 * per_layer + gates + vocab * d) + 8 * 12 * 3 * hd * 1024


def test_deep_swa_preset_counted_by_hand():
    m, cfg = preset("deep_swa")
    assert (cfg.depth, cfg.d_model, cfg.n_head, cfg.window_pattern) == (16, 512, 4, "SSSL")
    d, vocab = 512, 8192
    blocks = 16 * (4 * d * d + 2 * d * 4 * d)
    assert m.num_params() == {"total": blocks + 2 * vocab * d + 2 * 16, "embedding": vocab * d,
                              "non_embedding": blocks + vocab * d + 2 * 16}
    attention = 12 * 4 * 128 * (12 * 512 + 4 * 1024)  # 12 short layers of 512 keys, 4 full
    assert m.flops_per_token() == 6 * (blocks + vocab * d) + attention


def test_d4_preset_is_the_depth_4_shape_counted_by_hand():
    m, cfg = preset("d4")
    assert (cfg.depth, cfg.d_model, cfg.n_head, cfg.seq_len, cfg.value_embed_layers, cfg.layer_scalars) == \
        (4, 256, 4, 256, [1, 3], True)
    raw = compose_config(["model=d4"])
    assert (raw.train.batch_tokens, raw.eval.final_tokens) == (8192, None)  # evaluation sized by the run
    d, vocab = 256, 8192
    blocks = 4 * (4 * d * d + 2 * d * 4 * d) + 2 * 4 * 32  # and two value-embedding gates (4 heads x 32)
    assert m.flops_per_token() == 6 * (blocks + vocab * d) + 4 * 12 * 4 * 64 * 256


def test_knobs_at_their_defaults_are_the_baseline():
    cfg = to_config(compose_config(["model=base", "tracking.enabled=false"])).model
    assert (cfg.n_kv_head, cfg.head_dim, cfg.qk_norm, cfg.window_pattern, cfg.activation) == (None, None, True, "L", "relu2")
    assert (cfg.value_embed_layers, cfg.layer_scalars, cfg.tie_embeddings, cfg.mtp_heads) == ([], False, False, 0)
    m, _ = preset("base")
    assert m.num_params()["total"] == 59_637_760 and m.flops_per_token() == 6 * 54_394_880 + 12 * 10 * 640 * 1024


# -- causality, optimizer routing, training, checkpoints ------------------------------------------

def test_every_knob_together_stays_causal_in_every_head():
    m = model(**EVERYTHING)
    idx = tokens()
    x = m.trunk(idx)
    before = [m.unembed(x), *m.mtp_logits(x)]
    for t in (0, 9, 30):  # 9 and 30: beyond the 8-token window of the short layers
        changed = idx.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % V
        y = m.trunk(changed)
        after = [m.unembed(y), *m.mtp_logits(y)]
        for a, b in zip(before, after):
            assert torch.allclose(a[:, : t + 1], b[:, : t + 1], atol=1e-5)
            assert not torch.allclose(a[:, t + 1], b[:, t + 1])


@pytest.mark.parametrize("overrides", [dict(zero_init_proj=False), EVERYTHING], ids=["baseline", "everything"])
def test_forward_with_prefix_equals_the_full_forward_tail(overrides):
    # head_std=1: logits large enough for the tolerance to matter; the 20-token prefix is longer
    # than the 8-token window of the short layers, so the suffix's band must count prefix positions
    m = model(**{**overrides, "head_std": 1.0}).eval()
    prefix, suffix = tokens(rows=1, seq=20, seed=2), tokens(rows=3, seq=12, seed=3)
    with torch.no_grad():
        full = m(torch.cat((prefix.expand(3, -1), suffix), dim=1))[:, 20:]
        assert torch.allclose(m.forward_with_prefix(prefix, suffix), full, atol=1e-4)
        assert torch.allclose(m.forward_with_prefix(prefix.expand(3, -1), suffix), full, atol=1e-4)
        with pytest.raises(ValueError, match="longer than model.seq_len"):
            m.forward_with_prefix(prefix, tokens(rows=3, seq=13))


def test_param_groups_route_every_parameter_once():
    m = model(**EVERYTHING)
    groups = m.param_groups()
    ids = [id(p) for params in groups.values() for p in params]
    assert len(ids) == len(set(ids)) == len(list(m.parameters()))
    assert all(p.ndim == 2 for p in groups["matrix"])
    assert groups["unembedding"] == [m.wte.weight]  # tied: the head's group
    assert len(groups["embedding"]) == 2 and groups["scalar"] == [m.resid_scalars, m.x0_scalars]
    adam, _ = build_optimizers(groups, OptimConfig(), "cpu")
    assert [g["lr"] for g in adam.param_groups] == [0.6, 0.004, 0.5]
    (everything,) = build_optimizers(groups, OptimConfig(name="adamw"), "cpu")
    assert sum(len(g["params"]) for g in everything.param_groups) == len(list(m.parameters()))


@pytest.mark.parametrize("overrides", [
    {},
    EVERYTHING,
    dict(n_head=4, n_kv_head=1, head_dim=32, window_pattern="SSL", activation="leaky_relu2",
         value_embed_layers=[1], mtp_heads=1, mtp_weights=[0.3]),
    dict(activation="gelu", layer_scalars=True, qk_norm=False, softcap=None),
], ids=["baseline", "everything", "mqa", "gelu"])
def test_trains_with_a_finite_falling_loss(overrides):
    m = model(**overrides)
    optimizers = build_optimizers(m.param_groups(), OptimConfig(), "cpu")
    batch = tokens(rows=4, seq=33, seed=3)
    losses = []
    for _ in range(12):
        loss = m(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
        m.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses


class _Tokenizer:
    path = None

    def fingerprint(self) -> str:
        return "test"


def test_load_for_eval_predicts_the_next_token_only(tmp_path):
    m = model(**EVERYTHING)
    save_final(tmp_path / "final.pt", m, {"model": asdict(m.config)}, _Tokenizer())
    loaded = load_for_eval(tmp_path / "final.pt", "cpu")
    idx, targets = tokens(), tokens(seed=2)
    m.eval()
    with torch.no_grad():
        assert loaded(idx).shape == (2, 32, V)
        assert torch.allclose(loaded(idx), m(idx), atol=1e-6)
        next_token = F.cross_entropy(m(idx).flatten(0, 1), targets.flatten())
        assert torch.allclose(loaded(idx, targets), next_token, atol=1e-6)
    assert not loaded.training


# -- bad input ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(n_head=4, n_kv_head=3), "model.n_kv_head=3 is not allowed: must divide model.n_head=4"),
    (dict(n_head=4, n_kv_head=8), "model.n_kv_head=8 is not allowed"),
    (dict(d_model=64, n_head=3), "model.d_model=64 is not allowed: must be divisible by model.n_head=3"),
    (dict(head_dim=15), "model.head_dim=15 is not allowed: must be a positive even number"),
    (dict(short_window=1.5), "model.short_window=1.5 is not allowed"),
    (dict(short_window=0.0), "model.short_window=0.0 is not allowed"),
    (dict(window_pattern="SXL"), "model.window_pattern='SXL' is not allowed: use the letters S"),
    (dict(value_embed_layers=[2]), "model.value_embed_layers=[2] is not allowed: distinct layer indices in 0 ... 1"),
    (dict(value_embed_layers=[1, -1]), "model.value_embed_layers=[1, -1] is not allowed"),
    (dict(mtp_heads=2, mtp_weights=[1.0]), "model.mtp_weights=[1.0] is not allowed: one weight >= 0 per extra head"),
    (dict(activation="tanh"), "model.activation='tanh' is not allowed: choose one of relu2, leaky_relu2"),
])
def test_bad_knobs_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as err:
        ModelConfig(**{**SMALL, **overrides})
    assert message in str(err.value)


def test_bad_knobs_fail_at_composition_and_in_the_model_card(capsys):
    with pytest.raises(ConfigError, match="model.n_kv_head=2 is not allowed"):
        to_config(compose_config(["model=base", "model.n_kv_head=2"]))
    with pytest.raises(SystemExit) as exit_:
        model_card(["model=tiny", "model.window_pattern=SLX"])
    assert exit_.value.code == 2
    assert "error: model.window_pattern='SLX' is not allowed" in capsys.readouterr().err


def test_model_card_prints_sizes_cost_and_budget_tokens(capsys):
    model_card(["model=tiny", "model.seq_len=64", "data.vocab_size=512", "train.batch_tokens=1024",
                "precision=fp32", "model.window_pattern=SL", "model.n_kv_head=1"])
    out = capsys.readouterr().out
    m = GPT(ModelConfig(depth=4, d_model=128, n_head=2, seq_len=64, window_pattern="SL", n_kv_head=1), 512)
    assert f"{m.num_params()['total']:,}" in out and f"{m.flops_per_token():,}" in out
    assert "measured: 1 forward+backward of 1 x 64 tokens" in out and "tokens / budget" in out
    model_card(["model=tiny", "--nominal", "--mfu", "0.5"])
    assert "x assumed MFU 50%" in capsys.readouterr().out
