"""Eager PyTorch versions of every op: the definition the other backends are tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without learnable parameters."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling():
        return _RMSNorm.apply(x)
    return F.rms_norm(x, (x.size(-1),))


class _RMSNorm(torch.autograd.Function):
    """F.rms_norm (eps = the dtype's epsilon) in two passes each way on a CPU, where ATen composes it
    of a dozen: the sums of squares and of g * y are reductions that allocate nothing. Within
    rounding of F.rms_norm (a few ulps: the sums are taken in another order)."""

    @staticmethod
    def forward(ctx, x):
        square_mean = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.size(-1))
        rstd = square_mean.add_(torch.finfo(x.dtype).eps).rsqrt_()
        y = x * rstd
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        # dx = rstd * (g - y * mean(g * y)): y = x * rstd is scale-free along the last dimension
        y, rstd = ctx.saved_tensors
        mean_gy = torch.linalg.vecdot(grad, y).unsqueeze(-1).div_(-y.size(-1))
        return torch.addcmul(grad, y, mean_gy).mul_(rstd)


def relu2(x: torch.Tensor) -> torch.Tensor:
    # inductor fuses the plain definition into one pass each way; without a backward it is as good
    if torch.compiler.is_compiling() or not (x.requires_grad and torch.is_grad_enabled()):
        return F.relu(x).square()
    return _ReLU2.apply(x)


class _ReLU2(torch.autograd.Function):
    """relu(x)^2 with its backward as one in-place pass over a tensor saved by the forward.

    Eager autograd would allocate three activation-sized tensors in the backward (2r, 2r*g and
    the relu mask's result); on a CPU each fresh one is page-faulted in, as slow as the arithmetic.
    The result is bit-identical: the factor 2 is exact and r is zero wherever relu cuts.
    """

    @staticmethod
    def forward(ctx, x):
        r = F.relu(x)
        out = r.square()
        ctx.save_for_backward(r.mul_(2))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (twice_r,) = ctx.saved_tensors
        return twice_r.mul_(grad)  # the saved tensor is this backward's alone


def leaky_relu2(x: torch.Tensor, slope: float = 0.5) -> torch.Tensor:
    """Squared leaky ReLU: negative inputs keep a (squared) signal instead of a dead zero."""
    return F.leaky_relu(x, slope).square()


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, from two separate projections of the same input."""
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding; x is (B, H, T, D), cos/sin are (T, D/2)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if x.device.type == "cpu" and not torch.compiler.is_compiling():  # inductor fuses the plain definition
        return _Rotary.apply(x, cos, sin)
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class _Rotary(torch.autograd.Function):
    """On a CPU, the rotation written straight into one output each way, where autograd's eager version
    allocates a tensor per product and sum and a cat: its backward is the inverse rotation."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin)
    torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin, value=-1)
    return out


def sliding_window_mask(T: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T) boolean mask, True = attend: query t sees keys s with t - window < s <= t."""
    pos = torch.arange(T, device=device)
    offset = pos[:, None] - pos[None, :]
    return (offset >= 0) & (offset < window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
    """Causal softmax attention. q is (B, H, T, D); k and v are (B, H_kv, T, D) with H_kv dividing H
    (grouped-query attention: query head h reads key/value head h // (H / H_kv)).

    window=None attends to every earlier token; window=W to the last W tokens, the query's own
    included. A window of at least T is full causal attention and takes the `is_causal` path.
    """
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    T = q.size(2)
    if window is None or window >= T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sliding_window_mask(T, window, q.device))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     window: int | None = None) -> torch.Tensor:
    """causal_attention for queries that are the last Tq of the Tk keys' positions (the earlier
    keys come from a cache). SDPA's is_causal aligns the mask top-left, so a query block shorter
    than the keys needs this explicit bottom-right mask: query i sits at position Tk - Tq + i."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    Tq, Tk = q.size(2), k.size(2)
    offset = torch.arange(Tk - Tq, Tk, device=q.device)[:, None] - torch.arange(Tk, device=q.device)[None, :]
    mask = offset >= 0
    if window is not None:
        mask &= offset < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
              reduction: str = "mean") -> torch.Tensor:
    """Unembedding + soft-capped fp32 logits + cross-entropy (targets of -1 ignored), all logits at
    once: the definition. x is (..., d), weight (V, d), targets x's leading shape; reduction="none"
    returns targets' shape. The registry's `reference` backend is the chunked form in head_loss.py."""
    logits = F.linear(x, weight).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                           reduction=reduction)
    return loss if reduction != "none" else loss.view_as(targets)
