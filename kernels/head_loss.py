"""The head + cross-entropy, chunked over rows so that the fp32 logits exist one chunk at a time.

A scalar loss (reduction mean or sum) whose inputs need gradients takes the gradient while the
chunk's logits are at hand: each chunk's logits become their own gradient in place, which goes
straight into d x and d weight; backward only scales those by the incoming gradient. That is the
same three head matmuls as the unchunked head, in cache-sized pieces. A per-token loss
(reduction="none") cannot know its rows' weights before backward, so it keeps only each row's
log-sum-exp and backward recomputes each chunk's logits (one more head matmul).

Either way memory holds (chunk_rows x vocab) logits instead of (rows x vocab) twice over. The same
Function serves every backend; only the per-chunk arithmetic is swapped: torch ops here, Triton
kernels in triton_ops.py.

Matches kernels.reference.head_loss (linear -> .float() -> softcap * tanh(z / softcap) ->
cross-entropy, targets of -1 ignored), autocast included: the matmuls run in the dtype autocast
would pick for the linear.
"""
from __future__ import annotations

from typing import Callable

import torch

IGNORE = -1
# fp32 logits per chunk: 16 MiB, 512 rows of an 8k vocabulary. Each chunk adds a whole (vocab x d)
# product into d weight (in place), so far smaller chunks would make that update dominate.
CHUNK_ELEMENTS = 1 << 22


# Below this soft-cap every capped logit is within 2 * softcap of softcap, so exp(logit - softcap) >=
# exp(-80) stays a normal fp32 number and no row maximum is needed; above it the row maximum is taken.
EXP_SAFE_SOFTCAP = 40.0


def chunk_rows_for(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def capped_(z: torch.Tensor, softcap: float) -> torch.Tensor:
    """tanh(z / softcap), in place, as 2 sigmoid(2z / softcap) - 1: the same function within two
    ulps of 1, and three times faster on a CPU, where ATen's tanh costs more than the chunk's matmul."""
    return z.mul_(2 / softcap).sigmoid_().mul_(2).sub_(1)


def torch_row_loss(z: torch.Tensor, targets: torch.Tensor,
                   softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp of one chunk's raw fp32 logits z (n, V); ignored rows lose 0.
    Overwrites z."""
    logits = capped_(z, softcap).mul_(softcap) if softcap is not None else z
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(targets != IGNORE, lse - picked, torch.zeros_like(lse)), lse


def torch_row_grad(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
                   softcap: float | None) -> torch.Tensor:
    """d loss / d z for one chunk: (softmax - onehot(target)) * scale per row, through the soft-cap.
    `scale` is each row's weight in the loss, 0 for ignored rows. Overwrites z."""
    if softcap is not None:
        t = capped_(z, softcap)
        grad = (t * softcap).sub_(lse.unsqueeze(1)).exp_()
    else:
        t, grad = None, z.sub_(lse.unsqueeze(1)).exp_()
    return _finish_grad(grad, t, targets, scale)


def torch_row_loss_grad(z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, softcap: float | None,
                        work: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_row_loss and torch_row_grad in one pass over the chunk. Overwrites z; the gradient is
    made in `work` (a buffer of z's shape) or, without one, in a new tensor.

    The chunk is memory-bound, so this makes as few passes over it as it can: one buffer of
    exponentials becomes the gradient in place, normalised in the same pass that scales it. With a
    soft-cap it works on s = sigmoid(2z / softcap), where the capped logit is softcap * (2s - 1) and
    its derivative 1 - tanh^2 = 4s(1 - s)."""
    index = targets.clamp(min=0).unsqueeze(1)
    if softcap is not None:
        s = z.mul_(2 / softcap).sigmoid_()
        # exp(logit - top) = exp(2 softcap (s - s_top)); top is the cap itself where that cannot underflow
        if softcap <= EXP_SAFE_SOFTCAP:
            s_top, top = 1.0, softcap
        else:
            s_top = s.amax(dim=-1, keepdim=True)
            top = softcap * (2 * s_top.squeeze(1) - 1)
        probs = torch.sub(s, s_top, out=work).mul_(2 * softcap).exp_()
        picked = (2 * s.gather(1, index).squeeze(1) - 1) * softcap
        scale = 4 * scale  # the cap's derivative, 4s(1 - s), with its 4 taken here
    else:
        top = z.amax(dim=-1)
        probs = torch.sub(z, top.unsqueeze(1), out=work).exp_()
        picked = z.gather(1, index).squeeze(1)
    total = probs.sum(dim=-1)
    lse = total.log() + top
    loss = torch.where(targets != IGNORE, lse - picked, torch.zeros_like(lse))
    grad = probs.mul_((scale / total).unsqueeze(1))  # softmax * scale
    grad.scatter_add_(1, index, -scale.unsqueeze(1))  # - onehot * scale (an ignored row has scale 0)
    if softcap is not None:
        grad.mul_(s.addcmul_(s, s, value=-1))  # through the cap: * s(1 - s)
    return loss, lse, grad


def fusable_row_loss_grad(z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                          softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_row_loss_grad in plain ops for torch.compile, which fuses them into two passes over the
    chunk (the cap and its exponentials with their row sums, then the gradient, written into z) where
    eager PyTorch makes a dozen. Capped logits lie within +-softcap, so exp(logit - softcap) cannot
    overflow and no row maximum is needed (below EXP_SAFE_SOFTCAP). Returns (loss, lse); the gradient is
    left in z."""
    if softcap is not None:
        t = 2 * torch.sigmoid(z * (2 / softcap)) - 1  # tanh(z / softcap), as capped_ computes it
        logits = t * softcap
        top = torch.full_like(z[:, :1], softcap) if softcap <= EXP_SAFE_SOFTCAP else logits.amax(dim=-1, keepdim=True)
    else:
        t, logits, top = None, z, z.amax(dim=-1, keepdim=True)
    probs = torch.exp(logits - top)
    total = probs.sum(dim=-1, keepdim=True)
    lse = top + total.log()
    index = targets.clamp(min=0).unsqueeze(1)
    loss = torch.where(targets != IGNORE, (lse - logits.gather(1, index)).squeeze(1), 0.0)
    onehot = torch.arange(z.size(1), device=z.device) == index
    grad = (probs / total - onehot.to(z.dtype)) * scale.unsqueeze(1)  # an ignored row has scale 0
    if t is not None:
        grad = grad * (1 - t * t)  # through the cap
    z.copy_(grad)
    return loss, lse.squeeze(1)


_fused_row_loss_grad = None


def compiled_row_loss_grad(z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, softcap: float | None,
                           work: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch_row_loss_grad through inductor (fusable_row_loss_grad), compiled on first use."""
    global _fused_row_loss_grad
    if _fused_row_loss_grad is None:
        _fused_row_loss_grad = torch.compile(fusable_row_loss_grad, dynamic=False)
    loss, lse = _fused_row_loss_grad(z, targets, scale, softcap)
    return loss, lse, z


def _finish_grad(probs: torch.Tensor, t: torch.Tensor | None, targets: torch.Tensor,
                 scale: torch.Tensor) -> torch.Tensor:
    # softmax - onehot; an ignored row (target -1) subtracts at column 0 and is then zeroed by scale
    grad = probs.scatter_add_(1, targets.clamp(min=0).unsqueeze(1), -torch.ones_like(scale).unsqueeze(1))
    grad.mul_(scale.unsqueeze(1))
    if t is not None:
        grad.mul_(t.square_().neg_().add_(1))  # d(softcap * tanh(z / softcap)) / dz = 1 - tanh^2
    return grad


def _accumulate(dw: torch.Tensor | None, g: torch.Tensor, xc: torch.Tensor) -> torch.Tensor:
    """dw += g^T xc in fp32, in place: a fresh (vocab x d) sum per chunk would cost more than the matmul."""
    if dw is None:
        return (g.t() @ xc).float()
    if g.dtype == torch.float32:
        return dw.addmm_(g.t(), xc)
    return dw.add_(g.t() @ xc)


def _logits(xc: torch.Tensor, w: torch.Tensor, buffer: torch.Tensor | None) -> torch.Tensor:
    """xc @ w.T as fp32, written into `buffer` where there is one (see _chunk_buffer)."""
    if buffer is None:
        return torch.mm(xc, w.t()).float()
    if w.dtype == torch.float32:
        return torch.mm(xc, w.t(), out=buffer)
    return buffer.copy_(torch.mm(xc, w.t()))


def _chunk_buffer(x: torch.Tensor, weight: torch.Tensor, chunk_rows: int) -> torch.Tensor | None:
    """One fp32 chunk of logits, reused by every chunk of a call: on a CPU a fresh chunk-sized tensor
    costs as much in page faults as the arithmetic on it. None under torch.compile (on a GPU: on a
    CPU the head loss stays eager), which plans its own buffers."""
    if torch.compiler.is_compiling():
        return None
    return torch.empty(min(chunk_rows, x.size(0)), weight.size(0), dtype=torch.float32, device=x.device)


def _first(buffer: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if buffer is None else buffer[:rows]


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


def _row_scale(targets: torch.Tensor, reduction: str, grad: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's weight in the loss (times the incoming gradient, if given); 0 for ignored rows."""
    valid = targets != IGNORE
    scale = valid.float()
    if reduction == "mean":
        scale = scale / valid.sum()
    if grad is not None:
        scale = scale * grad.float()
    return scale


def make_head_loss(row_loss: Callable, row_grad: Callable, row_loss_grad: Callable,
                   work_buffer: bool = True) -> Callable:
    """A chunked head_loss op from per-chunk functions with the signatures of torch_row_loss,
    torch_row_grad and torch_row_loss_grad; `work_buffer`: row_loss_grad makes its gradient in the
    `work` chunk it is given (False: it returns it in z, and no such chunk is allocated)."""

    class HeadLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, targets, softcap, reduction, chunk_rows, grads_now):
            dtype = _matmul_dtype(x, weight)  # read here: autocast is not active in backward
            w = weight.to(dtype)
            scale = _row_scale(targets, reduction) if grads_now else None
            losses, lses, dxs, dw = [], [], [], None
            logits = _chunk_buffer(x, weight, chunk_rows)
            work = torch.empty_like(logits) if work_buffer and grads_now and logits is not None else None
            with torch.autocast(x.device.type, enabled=False):
                for start in range(0, x.size(0), chunk_rows):
                    rows = slice(start, start + chunk_rows)
                    xc = x[rows].to(dtype)
                    n = xc.size(0)
                    z = _logits(xc, w, _first(logits, n))
                    if not grads_now:
                        loss, lse = row_loss(z, targets[rows], softcap)
                        lses.append(lse)
                    else:
                        loss, _, g = row_loss_grad(z, targets[rows], scale[rows], softcap, _first(work, n))
                        g = g.to(dtype)
                        dxs.append((g @ w).to(x.dtype))
                        dw = _accumulate(dw, g, xc)
                    losses.append(loss)
            losses = torch.cat(losses)
            ctx.softcap, ctx.reduction, ctx.chunk_rows, ctx.dtype = softcap, reduction, chunk_rows, dtype
            ctx.grads_now = grads_now
            if grads_now:
                ctx.save_for_backward(torch.cat(dxs), dw.to(weight.dtype))
            else:
                ctx.save_for_backward(x, weight, targets, torch.cat(lses))
            if reduction == "none":
                return losses
            total = losses.sum()
            return total if reduction == "sum" else total / (targets != IGNORE).sum()

        @staticmethod
        def backward(ctx, grad):
            if ctx.grads_now:
                dx, dw = ctx.saved_tensors
                return dx * grad.to(dx.dtype), dw * grad.to(dw.dtype), None, None, None, None, None
            x, weight, targets, lse = ctx.saved_tensors
            scale = _row_scale(targets, ctx.reduction, grad)
            w = weight.to(ctx.dtype)
            dxs, dw = [], None
            logits = _chunk_buffer(x, weight, ctx.chunk_rows)
            with torch.autocast(x.device.type, enabled=False):
                for start in range(0, x.size(0), ctx.chunk_rows):
                    rows = slice(start, start + ctx.chunk_rows)
                    xc = x[rows].to(ctx.dtype)
                    z = _logits(xc, w, _first(logits, xc.size(0)))
                    g = row_grad(z, targets[rows], lse[rows], scale[rows], ctx.softcap)
                    g = g.to(ctx.dtype)
                    if ctx.needs_input_grad[0]:
                        dxs.append((g @ w).to(x.dtype))
                    if ctx.needs_input_grad[1]:
                        dw = _accumulate(dw, g, xc)
            dx = torch.cat(dxs) if dxs else None
            return dx, None if dw is None else dw.to(weight.dtype), None, None, None, None, None

    def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
                  reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction={reduction!r}: choose mean, sum or none")
        grads_now = (reduction != "none" and torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad))
        loss = HeadLoss.apply(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), softcap, reduction,
                              chunk_rows or chunk_rows_for(weight.size(0)), grads_now)
        return loss.view_as(targets) if reduction == "none" else loss

    return head_loss


_chunked = make_head_loss(torch_row_loss, torch_row_grad, torch_row_loss_grad)
# torch.compiler.disable, made on its first call: importing torch._dynamo here would cost every command
# that loads the model (a command-line check too) a second
_chunked_in_compiled = torch._disable_dynamo(make_head_loss(torch_row_loss, torch_row_grad, compiled_row_loss_grad,
                                                            work_buffer=False))


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
              reduction: str = "mean", chunk_rows: int | None = None) -> torch.Tensor:
    """The chunked head loss. On a CPU inside torch.compile the chunk loop stays eager (a graph
    break) with its two reused buffers, which beat inductor's fresh chunk tensors, and only each
    chunk's loss-and-gradient arithmetic is compiled (one fused kernel for a dozen eager passes)."""
    if x.device.type == "cpu" and torch.compiler.is_compiling():
        return _chunked_in_compiled(x, weight, targets, softcap, reduction, chunk_rows)
    return _chunked(x, weight, targets, softcap, reduction, chunk_rows)
