"""Eager PyTorch versions of every op: the definition the other backends are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without learnable parameters."""
    return F.rms_norm(x, (x.size(-1),))


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding; x is (B, H, T, D), cos/sin are (T, D/2)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention over (B, H, T, D) tensors."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
