"""The nanochat-style GPT: parameter-free RMSNorm, rotary, QK-norm, ReLU² MLP, no biases,
untied head with a soft-capped fp32 logit, zero-initialised output projections."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from frontier.config import ModelConfig


class Ops:
    """The kernels one model is built from (see kernels/)."""

    def __init__(self, backend: str = "reference"):
        self.rmsnorm = kernels.get("rmsnorm", backend)
        self.relu2 = kernels.get("relu2", backend)
        self.rotary = kernels.get("rotary", backend)
        self.attention = kernels.get("attention", backend)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.c_q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.c_k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.c_v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (lin(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for lin in (self.c_q, self.c_k, self.c_v))
        q, k = self.ops.rotary(q, cos, sin), self.ops.rotary(k, cos, sin)
        q, k = self.ops.rmsnorm(q), self.ops.rmsnorm(k)  # QK-norm keeps attention logits bounded
        y = self.ops.attention(q, k, v)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        hidden = int(cfg.mlp_ratio * cfg.d_model)
        self.c_fc = nn.Linear(cfg.d_model, hidden, bias=False)
        self.c_proj = nn.Linear(hidden, cfg.d_model, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.ops.relu2(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops):
        super().__init__()
        self.attn = Attention(cfg, ops)
        self.mlp = MLP(cfg, ops)
        self.norm = ops.rmsnorm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x), cos, sin)
        return x + self.mlp(self.norm(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, vocab_size: int, ops: Ops | None = None):
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size
        self.ops = ops or Ops()
        self.wte = nn.Embedding(vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, self.ops) for _ in range(config.depth))
        self.lm_head = nn.Linear(config.d_model, vocab_size, bias=False)
        cos, sin = self._rotary_tables(config.seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.reset_parameters()

    def _rotary_tables(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.d_model // self.config.n_head
        inv_freq = self.config.rope_base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
        return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.normal_(self.wte.weight, std=cfg.embed_std)
        nn.init.normal_(self.lm_head.weight, std=cfg.head_std)
        bound = math.sqrt(3.0 / cfg.d_model)  # uniform with std 1/sqrt(d_model)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -bound, bound)
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                if cfg.zero_init_proj:
                    nn.init.zeros_(lin.weight)
                else:
                    nn.init.uniform_(lin.weight, -bound, bound)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                reduction: str = "mean") -> torch.Tensor:
        """Logits (B, T, V) in fp32, or with `targets` the cross-entropy (targets of -1 ignored)."""
        T = idx.size(1)
        if T > self.cos.size(0):
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.cos.size(0)}")
        x = self.ops.rmsnorm(self.wte(idx))
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        logits = self.lm_head(self.ops.rmsnorm(x)).float()
        if self.config.softcap is not None:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=-1, reduction=reduction)
        return loss if reduction != "none" else loss.view_as(targets)

    # -- size and cost --------------------------------------------------------------------------

    def num_params(self) -> dict[str, int]:
        embedding = self.wte.weight.numel()
        total = sum(p.numel() for p in self.parameters())
        return {"total": total, "embedding": embedding, "non_embedding": total - embedding}

    def flops_per_token(self) -> int:
        """6 x matrix parameters (head included, embedding lookup excluded) + attention scores."""
        cfg = self.config
        matmul = self.num_params()["non_embedding"]
        return 6 * matmul + 12 * cfg.depth * cfg.d_model * cfg.seq_len

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Block matrices (Muon's), the embedding and the head (AdamW's)."""
        return {
            "matrix": [p for p in self.blocks.parameters() if p.ndim == 2],
            "embedding": [self.wte.weight],
            "unembedding": [self.lm_head.weight],
        }
