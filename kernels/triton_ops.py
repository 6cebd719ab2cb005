"""Triton kernels for CUDA: RMSNorm and the cross-entropy half of the chunked head loss, forward and
backward. Under TRITON_INTERPRET=1 (set before this module is imported) they run on CPU tensors,
which is how the tests check them against the references without a GPU.

The head loss keeps the head matmuls in cuBLAS (kernels/head_loss.py chunks them); the kernels
here replace the torch ops between them: a program walks its row of logits once for soft-cap,
log-sum-exp and the target's logit, and once more to overwrite them with their gradient. Rows shorter
than a block (RMSNorm's always, a small vocabulary's logits) are packed several to a program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.head_loss import make_head_loss

MAX_BLOCK = 4096  # elements one program holds at a time: RMSNorm rows are packed up to it, wider
# cross-entropy rows walked in blocks of it


@triton.jit
def _rms_norm_fwd(x_ptr, y_ptr, rstd_ptr, rows, stride, D, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows a program: a model's rows are short (64-1024 columns), too few for a program each
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < D)[None, :]
    offsets = row[:, None] * stride + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    tl.store(y_ptr + offsets, (x * rstd[:, None]).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row < rows)


@triton.jit
def _rms_norm_bwd(dy_ptr, x_ptr, rstd_ptr, dx_ptr, rows, stride, D, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # y = x * r with r = (mean(x^2) + eps)^-1/2, so dx = r * dy - x * r^3 * mean(dy * x)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < D)[None, :]
    offsets = row[:, None] * stride + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)[:, None]
    dot = tl.sum(dy * x, axis=1)[:, None] / D
    dx = rstd * dy - x * (rstd * rstd * rstd * dot)
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _packed(rows: int, block: int) -> tuple[int, tuple[int]]:
    """Rows per program (whole rows, up to about MAX_BLOCK elements a program) and the launch grid."""
    per_program = max(1, MAX_BLOCK // block)
    return per_program, (triton.cdiv(rows, per_program),)


def _rms_norm_block(D: int) -> int:
    block = triton.next_power_of_2(D)
    if block > 65536:
        raise ValueError(f"triton rms_norm holds a whole row in one block; {D} columns is too many")
    return block


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x2 = x.reshape(-1, x.size(-1)).contiguous()
        rows, D = x2.shape
        block = _rms_norm_block(D)
        per_program, grid = _packed(rows, block)
        y = torch.empty_like(x2)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            # eps as F.rms_norm picks it when given none: the input dtype's machine epsilon
            _rms_norm_fwd[grid](x2, y, rstd, rows, x2.stride(0), D, torch.finfo(x.dtype).eps,
                                ROWS=per_program, BLOCK=block)
        ctx.save_for_backward(x2, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, rstd = ctx.saved_tensors
        rows, D = x2.shape
        dy2 = dy.reshape(rows, D).contiguous()
        dx = torch.empty_like(x2)
        if rows:
            block = _rms_norm_block(D)
            per_program, grid = _packed(rows, block)
            _rms_norm_bwd[grid](dy2, x2, rstd, dx, rows, x2.stride(0), D, ROWS=per_program, BLOCK=block)
        return dx.view(dy.shape)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.rms_norm in Triton, whole rows to a program."""
    return _RMSNorm.apply(x)


@triton.jit
def _tanh(u):
    return 2 * tl.sigmoid(2 * u) - 1


@triton.jit
def _cross_entropy(z_ptr, targets_ptr, loss_ptr, lse_ptr, scale_ptr, rows, stride, V, softcap,
                   HAS_CAP: tl.constexpr, LOSS: tl.constexpr, GRAD: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK: tl.constexpr):
    # ROWS rows of raw logits z a program (one, unless a row is narrower than a block). LOSS: each
    # row's loss and log-sum-exp (online, in blocks: a running max m and the sum s of exp(logit - m)).
    # GRAD: overwrite the rows with d loss / d z = (softmax - onehot) * scale, through the cap (LOSS
    # off: lse comes from lse_ptr).
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = row < rows
    z_rows = z_ptr + row[:, None] * stride
    target = tl.load(targets_ptr + row, mask=live, other=-1)
    if LOSS:
        m = tl.full((ROWS,), float("-inf"), tl.float32)
        s = tl.zeros((ROWS,), tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            in_row = (cols < V)[None, :]
            z = tl.load(z_rows + cols[None, :], mask=live[:, None] & in_row, other=0.0).to(tl.float32)
            if HAS_CAP:
                z = softcap * _tanh(z / softcap)
            z = tl.where(in_row, z, float("-inf"))  # dead rows read zeros: finite, and never stored
            m_new = tl.maximum(m, tl.max(z, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
        lse = m + tl.log(s)
        valid = target >= 0  # -1 = ignored
        picked = tl.load(z_ptr + row * stride + tl.where(valid, target, 0), mask=live, other=0.0).to(tl.float32)
        if HAS_CAP:
            picked = softcap * _tanh(picked / softcap)
        tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0), mask=live)
        tl.store(lse_ptr + row, lse, mask=live)
    else:
        lse = tl.load(lse_ptr + row, mask=live, other=0.0)
    if GRAD:
        scale = tl.load(scale_ptr + row, mask=live, other=0.0)[:, None]  # 0 for ignored rows
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = live[:, None] & (cols < V)[None, :]
            z = tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
            if HAS_CAP:
                t = _tanh(z / softcap)
                grad = (tl.exp(softcap * t - lse[:, None]) - onehot) * scale * (1 - t * t)
            else:
                grad = (tl.exp(z - lse[:, None]) - onehot) * scale
            tl.store(z_rows + cols[None, :], grad, mask=mask)


def _launch_cross_entropy(z, targets, lse, scale, softcap, loss=None):
    rows, V = z.shape
    block = min(MAX_BLOCK, triton.next_power_of_2(V))
    per_program, grid = _packed(rows, block)
    _cross_entropy[grid](
        z, targets, loss if loss is not None else lse, lse, scale if scale is not None else lse, rows,
        z.stride(0), V, softcap or 1.0, HAS_CAP=softcap is not None, LOSS=loss is not None,
        GRAD=scale is not None, ROWS=per_program, BLOCK=block)


def _row_loss(z: torch.Tensor, targets: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    loss = torch.empty(z.size(0), dtype=torch.float32, device=z.device)
    lse = torch.empty_like(loss)
    _launch_cross_entropy(z, targets, lse, None, softcap, loss)
    return loss, lse


def _row_grad(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor,
              softcap: float | None) -> torch.Tensor:
    _launch_cross_entropy(z, targets, lse.contiguous(), scale.contiguous(), softcap)
    return z


def _row_loss_grad(z: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, softcap: float | None,
                   work: None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    del work  # the kernel makes the gradient in z itself (work_buffer=False below)
    loss = torch.empty(z.size(0), dtype=torch.float32, device=z.device)
    lse = torch.empty_like(loss)
    _launch_cross_entropy(z, targets, lse, scale.contiguous(), softcap, loss)
    return loss, lse, z


# the chunked head + cross-entropy of kernels/head_loss.py with these kernels between its matmuls
head_loss = make_head_loss(_row_loss, _row_grad, _row_loss_grad, work_buffer=False)
