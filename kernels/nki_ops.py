"""NKI kernels for Trainium: RMSNorm and the ReLU² activation, forward and backward, registered as
torch ops (`frontier_nki::*`) with their backward through torch.library.register_autograd.

Written against the `nki` package of the Neuron SDK (2.29+): `nki.isa` instructions with explicit
`dst` tiles, `nisa.dma_copy` between HBM and SBUF. Rows map to the 128 SBUF partitions: full tiles
of 128 rows, then one ragged tile of the rest (its own, smaller, static shape), and a whole row
lies along the free axis. On CPU tensors the kernels run in the NKI simulator (`nki.simulate`),
which is how they are tested without Trainium; NKI_SIMULATOR=1 lets a CPU run choose them.
"""
from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
import numpy as np
import torch

P = 128  # SBUF partitions: rows per tile


def _row_tiles(rows: int) -> tuple[int, int]:
    """(full 128-row tiles, rows left over for the ragged last tile)."""
    return rows // P, rows % P


# -- RMSNorm --------------------------------------------------------------------------------------

def _rms_norm_fwd_tile(x, y, rstd, start, rows, eps):
    d = x.shape[1]
    xt = nl.ndarray((rows, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[start:start + rows, 0:d])
    zero = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=zero, value=0.0)
    eps_t = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=eps_t, value=eps)
    # sum of squares along the row, accumulated in fp32 by the scalar engine
    squares = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    sumsq = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation_reduce(dst=squares, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=sumsq,
                           bias=zero, scale=1.0)
    # r = rsqrt(sumsq / d + eps)
    r = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=r, op=nl.rsqrt, data=sumsq, bias=eps_t, scale=1.0 / d)
    yt = nl.ndarray((rows, d), dtype=y.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=yt, data=xt, op0=nl.multiply, operand0=r)
    nisa.dma_copy(dst=y[start:start + rows, 0:d], src=yt)
    nisa.dma_copy(dst=rstd[start:start + rows, 0:1], src=r)


@nki.jit
def rms_norm_fwd_kernel(x, eps):
    """x (N, d) -> y = x * r and r = (mean(x^2) + eps)^-1/2 as (N, 1) fp32 for the backward."""
    n, d = x.shape
    y = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    full, tail = _row_tiles(n)
    for i in nl.static_range(full):
        _rms_norm_fwd_tile(x, y, rstd, i * P, P, eps)
    if tail > 0:
        _rms_norm_fwd_tile(x, y, rstd, full * P, tail, eps)
    return y, rstd


def _rms_norm_bwd_tile(dy, x, rstd, dx, start, rows):
    d = x.shape[1]
    xt = nl.ndarray((rows, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[start:start + rows, 0:d])
    gt = nl.ndarray((rows, d), dtype=dy.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gt, src=dy[start:start + rows, 0:d])
    r = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=r, src=rstd[start:start + rows, 0:1])
    # c = r^3 * mean(dy * x) per row
    prod = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=gt, data2=xt, op=nl.multiply)
    dot = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=dot, op=nl.add, data=prod, axis=1)
    r2 = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r2, data1=r, data2=r, op=nl.multiply)
    r3 = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=r3, data1=r2, data2=r, op=nl.multiply)
    c = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=c, data1=dot, data2=r3, op=nl.multiply)
    c_mean = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=c_mean, data=c, op0=nl.multiply, operand0=1.0 / d)
    # dx = dy * r - x * c
    xc = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xc, data=xt, op0=nl.multiply, operand0=c_mean)
    dxt = nl.ndarray((rows, d), dtype=dx.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=dxt, data=gt, op0=nl.multiply, operand0=r, op1=nl.subtract, operand1=xc)
    nisa.dma_copy(dst=dx[start:start + rows, 0:d], src=dxt)


@nki.jit
def rms_norm_bwd_kernel(dy, x, rstd):
    """dx = r * dy - x * r^3 * mean(dy * x), rows as in the forward."""
    n, d = x.shape
    dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    full, tail = _row_tiles(n)
    for i in nl.static_range(full):
        _rms_norm_bwd_tile(dy, x, rstd, dx, i * P, P)
    if tail > 0:
        _rms_norm_bwd_tile(dy, x, rstd, dx, full * P, tail)
    return dx


# -- ReLU² ----------------------------------------------------------------------------------------

def _relu2_fwd_tile(x, y, start, rows):
    d = x.shape[1]
    xt = nl.ndarray((rows, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[start:start + rows, 0:d])
    h = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.relu, data=xt)
    yt = nl.ndarray((rows, d), dtype=y.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=yt, data1=h, data2=h, op=nl.multiply)
    nisa.dma_copy(dst=y[start:start + rows, 0:d], src=yt)


@nki.jit
def relu2_fwd_kernel(x):
    n, d = x.shape
    y = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    full, tail = _row_tiles(n)
    for i in nl.static_range(full):
        _relu2_fwd_tile(x, y, i * P, P)
    if tail > 0:
        _relu2_fwd_tile(x, y, full * P, tail)
    return y


def _relu2_bwd_tile(dy, x, dx, start, rows):
    d = x.shape[1]
    xt = nl.ndarray((rows, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[start:start + rows, 0:d])
    gt = nl.ndarray((rows, d), dtype=dy.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=gt, src=dy[start:start + rows, 0:d])
    h = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.relu, data=xt)
    # dx = (relu(x) * 2) * dy
    dxt = nl.ndarray((rows, d), dtype=dx.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=dxt, data=h, op0=nl.multiply, operand0=2.0, op1=nl.multiply, operand1=gt)
    nisa.dma_copy(dst=dx[start:start + rows, 0:d], src=dxt)


@nki.jit
def relu2_bwd_kernel(dy, x):
    n, d = x.shape
    dx = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.shared_hbm)
    full, tail = _row_tiles(n)
    for i in nl.static_range(full):
        _relu2_bwd_tile(dy, x, dx, i * P, P)
    if tail > 0:
        _relu2_bwd_tile(dy, x, dx, full * P, tail)
    return dx


# -- torch ops --------------------------------------------------------------------------------------

def _launch(kernel, *args):
    """Run a kernel on the tensors' device: Trainium, or the NKI simulator for CPU tensors."""
    if args[0].device.type != "cpu":
        return kernel(*args)
    arrays = [a.detach().numpy() if isinstance(a, torch.Tensor) else a for a in args]
    out = nki.simulate(kernel)(*arrays)
    if isinstance(out, tuple):
        return tuple(torch.from_numpy(np.array(o)) for o in out)
    return torch.from_numpy(np.array(out))


@torch.library.custom_op("frontier_nki::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _launch(rms_norm_fwd_kernel, x.contiguous(), eps)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, eps):
    return torch.empty_like(x), x.new_empty((x.size(0), 1), dtype=torch.float32)


@torch.library.custom_op("frontier_nki::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return _launch(rms_norm_bwd_kernel, dy.contiguous(), x.contiguous(), rstd.contiguous())


@rms_norm_bwd.register_fake
def _(dy, x, rstd):
    return torch.empty_like(x)


def _rms_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, rstd = ctx.saved_tensors
    return rms_norm_bwd(dy, x, rstd), None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


@torch.library.custom_op("frontier_nki::relu2_fwd", mutates_args=())
def relu2_fwd(x: torch.Tensor) -> torch.Tensor:
    return _launch(relu2_fwd_kernel, x.contiguous())


@relu2_fwd.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("frontier_nki::relu2_bwd", mutates_args=())
def relu2_bwd(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _launch(relu2_bwd_kernel, dy.contiguous(), x.contiguous())


@relu2_bwd.register_fake
def _(dy, x):
    return torch.empty_like(x)


def _relu2_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _relu2_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return relu2_bwd(dy, x)


relu2_fwd.register_autograd(_relu2_backward, setup_context=_relu2_setup)


# -- the registry's entries: any leading shape, rows flattened onto the partitions ---------------

def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """kernels.reference.rms_norm (eps = the dtype's machine epsilon, as F.rms_norm picks it)."""
    y, _ = rms_norm_fwd(x.reshape(-1, x.size(-1)), torch.finfo(x.dtype).eps)
    return y.view(x.shape)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return relu2_fwd(x.reshape(-1, x.size(-1))).view(x.shape)
