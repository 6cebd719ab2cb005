"""The nanochat-style GPT and its design space.

With every knob at its default (frontier.config.ModelConfig) this is the baseline: parameter-free
RMSNorm, rotary, QK-norm, ReLU² MLP, no biases, untied head with a soft-capped fp32 logit,
zero-initialised output projections. The knobs add grouped-query attention, a free head size,
sliding windows, other activations, value embeddings, per-layer residual/x0 scalars, a tied head,
training-only multi-token prediction heads and the init scales.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from frontier.config import ConfigError, KernelConfig, ModelConfig
from kernels.reference import cached_attention

VE_GATE_CHANNELS = 32  # the value-embedding gate reads this many leading channels of the block input
X0_SCALAR_INIT = 0.1  # a little of the embedding is mixed back in before every block from the start
RESID_SCALAR_LR_SCALE = 0.01  # residual scalars learn 100x slower than x0 scalars (nanochat's LR ratio)


class Ops:
    """The kernels one model is built from (see kernels/): one attribute per op in kernels.OPS.

    `kernel` is a KernelConfig or a preset name. Given the device kind (cpu | cuda | neuron), a
    backend this machine cannot run is a ConfigError saying what is missing, raised before any
    kernel is imported."""

    def __init__(self, kernel: KernelConfig | str = "reference", device: str | None = None):
        preset, overrides = (kernel, {}) if isinstance(kernel, str) else (kernel.name, kernel.overrides())
        try:
            self.backends = kernels.choose(preset, overrides)
            for backend in sorted(set(self.backends.values())):
                reason = None if device is None else kernels.unavailable(backend, device)
                if reason is not None:
                    ops = ", ".join(op for op, b in self.backends.items() if b == backend)
                    raise ConfigError(f"the {backend} kernels ({ops}) cannot run here: {reason}")
        except kernels.KernelError as err:
            raise ConfigError(str(err)) from None
        for op, backend in self.backends.items():
            setattr(self, op, kernels.get(op, backend))


# -- what the config implies, shared by the modules, the cost model and the model card ------------

def kv_heads(cfg: ModelConfig) -> int:
    return cfg.n_kv_head or cfg.n_head


def head_size(cfg: ModelConfig) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_head


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Each layer's attention window in tokens (None = full causal): `window_pattern` tiled over
    the depth, with the last layer always full so the head sees the whole context."""
    short = int(cfg.short_window * cfg.seq_len)
    pattern = cfg.window_pattern
    windows = [short if pattern[i % len(pattern)] == "S" else None for i in range(cfg.depth)]
    windows[-1] = None
    return windows


def value_embed_layers(cfg: ModelConfig) -> list[int]:
    return sorted(i % cfg.depth for i in cfg.value_embed_layers)  # negative indices count from the end


# -- modules --------------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, window: int | None, value_embed: bool):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, kv_heads(cfg), head_size(cfg)
        self.window = window
        self.qk_norm = cfg.qk_norm
        self.c_q = nn.Linear(cfg.d_model, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(cfg.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=False)
        # one gate per KV head, computed from the input: how much of the token's value embedding to add
        self.ve_gate = (nn.Linear(min(VE_GATE_CHANNELS, cfg.d_model), self.n_kv_head, bias=False)
                        if value_embed else None)
        self.ops = ops

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            ve: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated, normalised queries (B, H, T, D) and keys and values (B, H_kv, T, D)."""
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate.in_features]))  # 1 at init
            v = v + (gate.unsqueeze(-1) * ve.view(B, T, self.n_kv_head, self.head_dim)).to(v.dtype)
        v = v.transpose(1, 2)
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        if self.qk_norm:
            q, k = self.ops.rmsnorm(q), self.ops.rmsnorm(k)  # keeps attention logits bounded
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, ve)
        if self.window is None:
            y = self.ops.attention(q, k, v)  # full causal: the fast is_causal path
        else:
            y = self.ops.attention(q, k, v, window=self.window)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))

    def forward_after(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ve: torch.Tensor | None,
                      past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
        """Attention for positions that follow the cached (k, v) of `past` (batch 1 or B, None when
        they start the sequence), and the cache extended by them. Queries offset from their keys
        take the reference op, whose explicit mask aligns them with the keys' end."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin, ve)
        if past is None:
            y = self.ops.attention(q, k, v, window=self.window)
        else:
            k = torch.cat((past[0].expand(B, -1, -1, -1), k), dim=2)
            v = torch.cat((past[1].expand(B, -1, -1, -1), v), dim=2)
            y = cached_attention(q, k, v, window=self.window)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        self.activation, self.slope = cfg.activation, cfg.activation_slope
        self.c_fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.c_gate = nn.Linear(cfg.d_model, hidden, bias=False) if cfg.activation == "swiglu" else None
        self.c_proj = nn.Linear(hidden, cfg.d_model, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        if self.activation == "swiglu":
            h = self.ops.swiglu(self.c_gate(x), h)
        elif self.activation == "leaky_relu2":
            h = self.ops.leaky_relu2(h, self.slope)
        elif self.activation == "gelu":
            h = self.ops.gelu(h)
        else:
            h = self.ops.relu2(h)
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, layer: int):
        super().__init__()
        self.attn = Attention(cfg, ops, layer_windows(cfg)[layer], layer in value_embed_layers(cfg))
        self.mlp = MLP(cfg, ops)
        self.norm = ops.rmsnorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ve: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm(x), cos, sin, ve)
        return x + self.mlp(self.norm(x))

    def forward_after(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ve: torch.Tensor | None,
                      past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
        y, kv = self.attn.forward_after(self.norm(x), cos, sin, ve, past)
        x = x + y
        return x + self.mlp(self.norm(x)), kv


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int, ops: Ops | None = None):
        super().__init__()
        cfg = self.config = config
        self.vocab_size = vocab_size
        self.ops = ops or Ops()
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        # value embeddings: a second token table per listed layer, sized like that layer's v
        self.value_embeds = nn.ModuleDict({
            str(i): nn.Embedding(vocab_size, kv_heads(cfg) * head_size(cfg)) for i in value_embed_layers(cfg)
        })
        self.blocks = nn.ModuleList(Block(cfg, self.ops, i) for i in range(cfg.depth))
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # multi-token prediction: head k adapts the final state with one residual matrix and reuses
        # lm_head to predict token t+1+k; only the training loss reads them
        self.mtp = nn.ModuleList(nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(cfg.mtp_heads))
        if cfg.layer_scalars:
            # before block i: x = (1 + 0.01 r_i) x + x0_i * embedding. r is stored pre-scaled so that
            # one AdamW learning rate moves the residual scalars 100x slower than the x0 scalars.
            self.resid_scalars = nn.Parameter(torch.zeros(cfg.depth))
            self.x0_scalars = nn.Parameter(torch.zeros(cfg.depth))
        cos, sin = self._rotary_tables(cfg.seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    def _rotary_tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = head_size(self.config)
        inv_freq = self.config.rope_base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.normal_(self.wte.weight, std=cfg.embed_std)
        # a tied matrix takes the head's scale: the embedding side is RMS-normalised anyway
        nn.init.normal_(self.lm_head.weight, std=cfg.head_std)
        bound = math.sqrt(3.0 / cfg.d_model)  # uniform with std 1/sqrt(d_model)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc, block.mlp.c_gate):
                if lin is not None:
                    nn.init.uniform_(lin.weight, -bound, bound)
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                if cfg.zero_init_proj:
                    nn.init.zeros_(lin.weight)
                else:
                    nn.init.uniform_(lin.weight, -bound, bound)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)
        for table in self.value_embeds.values():
            nn.init.uniform_(table.weight, -bound, bound)
        for adapter in self.mtp:
            nn.init.zeros_(adapter.weight)  # every extra head starts as the next-token head
        if cfg.layer_scalars:
            self.resid_scalars.zero_()
            self.x0_scalars.fill_(X0_SCALAR_INIT)

    # -- forward --------------------------------------------------------------------------------

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """The residual stream after the last block, (B, T, d_model)."""
        T = idx.size(1)
        if T > self.cos.size(0):
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.cos.size(0)}")
        cos, sin = self.cos[:T], self.sin[:T]
        x = x0 = self.ops.rmsnorm(self.wte(idx))
        for i, block in enumerate(self.blocks):
            if self.config.layer_scalars:
                x = (1 + RESID_SCALAR_LR_SCALE * self.resid_scalars[i]) * x + self.x0_scalars[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, cos, sin, ve)
        return x

    def trunk_after(self, idx: torch.Tensor, past: list[tuple] | None = None) -> tuple[torch.Tensor, list[tuple]]:
        """trunk() for tokens that continue the sequence whose per-layer keys and values `past`
        holds (None: they start it), and the per-layer cache extended by them."""
        P = 0 if past is None else past[0][0].size(2)
        T = idx.size(1)
        if P + T > self.cos.size(0):
            raise ValueError(f"sequence of {P + T} tokens is longer than model.seq_len={self.cos.size(0)}")
        cos, sin = self.cos[P:P + T], self.sin[P:P + T]  # rotary positions continue after the cache
        x = x0 = self.ops.rmsnorm(self.wte(idx))
        cache = []
        for i, block in enumerate(self.blocks):
            if self.config.layer_scalars:
                x = (1 + RESID_SCALAR_LR_SCALE * self.resid_scalars[i]) * x + self.x0_scalars[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x, kv = block.forward_after(x, cos, sin, ve, None if past is None else past[i])
            cache.append(kv)
        return x, cache

    def forward_with_prefix(self, prefix_idx: torch.Tensor, suffix_idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, S, V) of suffix_idx (B, S) following prefix_idx (1 or B, P), equal to
        model(cat(prefix, suffix))[:, P:] but computing a shared prefix once for every row."""
        _, past = self.trunk_after(prefix_idx)
        x, _ = self.trunk_after(suffix_idx, past)
        return self.unembed(x)

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ops.rmsnorm(x)).float()
        if self.config.softcap is not None:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        return logits

    def mtp_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Logits of the extra heads from the trunk's output: entry k-1 predicts token t+1+k."""
        return [self.unembed(x + adapter(self.ops.rmsnorm(x))) for adapter in self.mtp]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """Logits (B, T, V) in fp32 for token t+1, or with `targets` the cross-entropy (targets of
        -1 ignored). In training mode the loss adds each extra head's weighted loss."""
        x = self.trunk(idx)
        if targets is None:
            return self.unembed(x)
        loss = self.head_loss(x, targets, reduction)
        if self.training and self.config.mtp_heads:
            T = targets.size(1)
            for k, (adapter, weight) in enumerate(zip(self.mtp, self.config.mtp_weights), 1):
                if k < T:  # targets are next tokens, so head k's targets are them shifted k further
                    shifted = F.pad(targets[:, k:], (0, k), value=-1)
                    loss = loss + weight * self.head_loss(x + adapter(self.ops.rmsnorm(x)), shifted, reduction)
        return loss

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy of unembed(x) against targets (-1 ignored), without holding every logit at once."""
        return self.ops.head_loss(self.ops.rmsnorm(x), self.lm_head.weight, targets, self.config.softcap, reduction)

    # -- size and cost --------------------------------------------------------------------------

    def num_params(self) -> dict[str, int]:
        """Embedding = the lookup tables (token and value embeddings); a tied head counts once, there."""
        total = sum(p.numel() for p in self.parameters())
        embedding = self.wte.weight.numel() + sum(t.weight.numel() for t in self.value_embeds.values())
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding}

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 x the matmul weights each token passes through (block matrices,
        the head even when tied, the extra heads and their passes through the head) + 12 x query
        heads x head size x attended keys per layer (seq_len, or the window on S layers)."""
        cfg = self.config
        matmul = sum(p.numel() for p in self.blocks.parameters() if p.ndim == 2)
        matmul += self.lm_head.weight.numel() * (1 + cfg.mtp_heads)
        matmul += sum(p.numel() for p in self.mtp.parameters())
        attention = sum(12 * cfg.n_head * head_size(cfg) * min(w or cfg.seq_len, cfg.seq_len)
                        for w in layer_windows(cfg))
        return 6 * matmul + attention

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """matrix: the 2-D block matrices and extra-head adapters (Muon); embedding: token and value
        embeddings; unembedding: the head, tied or not (its LR suits the logits); scalar: the
        per-layer scalars, present only with layer_scalars (AdamW)."""
        groups = {
            "matrix": [p for p in self.blocks.parameters() if p.ndim == 2] + list(self.mtp.parameters()),
            "embedding": ([] if self.config.tie_embeddings else [self.wte.weight])
                         + [t.weight for t in self.value_embeds.values()],
            "unembedding": [self.lm_head.weight],
        }
        if self.config.layer_scalars:
            groups["scalar"] = [self.resid_scalars, self.x0_scalars]
        return groups


def build(config, vocab_size: int, device, ops: Ops | None = None) -> tuple[GPT, nn.Module]:
    """The configured model on its device, and the module a training step calls: compiled with
    kernel=compiled (backend "neuron" on Trainium, inductor elsewhere), else the model itself."""
    model = GPT(config.model, vocab_size, ops or Ops(config.kernel, device.kind)).to(device.torch_device)
    if config.kernel.name != "compiled":
        return model, model
    backend = "neuron" if device.kind == "neuron" else "inductor"
    return model, torch.compile(model, backend=backend, mode=config.kernel.compile_mode, dynamic=False)
