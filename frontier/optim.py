"""Muon for the block matrices, AdamW for embedding and head (or AdamW for everything)."""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from frontier.config import OptimConfig
from frontier.device import DTYPES, bf16_native

CLASSIC = ((3.4445, -4.7750, 2.0315),)
POLAR_EXPRESS = (
    (8.1566, -22.4833, 15.8788),
    (4.0429, -2.8089, 0.5000),
    (3.8917, -2.7725, 0.5061),
    (3.2858, -2.3681, 0.4645),
    (2.3465, -1.7098, 0.4232),
)
COEFFICIENTS = {"classic": CLASSIC, "polar_express": POLAR_EXPRESS}
SCALAR_ADAM_EPS = 1e-7  # see build_optimizers: above the rounding noise of the scalars' first gradient


def orthogonalize(G: torch.Tensor, steps: int = 5, coefficients: str = "polar_express",
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Push the singular values of G (..., m, n) towards 1 with a Newton-Schulz iteration in `dtype`.

    Works on a stack of same-shape matrices at once. Each step uses its own (a, b, c); past the
    end of the table the last one repeats (the classic iteration has a single triple).
    """
    table = COEFFICIENTS[coefficients]
    X = G.to(dtype).reshape(-1, *G.shape[-2:])  # one stack of matrices, as baddbmm takes; no copy if it is one
    tall = X.size(-2) > X.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)  # spectral norm <= Frobenius norm < 1
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)]
        A = X @ X.mT
        # b*A + c*A@A, then a*X + B@X: each scale folded into the matmul, no separate pass over the matrices
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return (X.mT if tall else X).reshape(G.shape)


class Muon(torch.optim.Optimizer):
    """Nesterov momentum, then the orthogonalised update scaled by max(1, rows/cols)^0.5. A torch.optim
    optimizer like any other: its state_dict, hooks and learning-rate schedulers are torch's."""

    def __init__(self, params, lr: float, momentum: float = 0.95, weight_decay: float = 0.0,
                 ns_steps: int = 5, coefficients: str = "polar_express", ns_dtype: torch.dtype = torch.bfloat16,
                 rank: int = 0, world_size: int = 1):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, ns_steps=ns_steps,
                        coefficients=coefficients)
        super().__init__(params, defaults)
        self.ns_dtype, self.rank, self.world_size = ns_dtype, rank, world_size

    def _orthogonalize_shared(self, updates: torch.Tensor, steps: int, coefficients: str) -> torch.Tensor:
        """Each rank orthogonalises every world_size-th matrix; a sum gathers them all."""
        if self.world_size == 1:
            return orthogonalize(updates, steps, coefficients, self.ns_dtype)
        out = torch.zeros_like(updates, dtype=torch.float32)
        mine = list(range(self.rank, updates.size(0), self.world_size))
        if mine:
            out[mine] = orthogonalize(updates[mine], steps, coefficients, self.ns_dtype).float()
        torch.distributed.all_reduce(out)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            by_shape: dict[torch.Size, list[nn.Parameter]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            mom = group["momentum"]
            for shape, params in by_shape.items():
                updates = []
                for p in params:
                    state = self.state[p]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(p.grad)
                    buf = state["momentum_buffer"]
                    buf.lerp_(p.grad, 1 - mom)
                    updates.append(p.grad.lerp(buf, mom))  # Nesterov: look ahead along the momentum
                ortho = self._orthogonalize_shared(torch.stack(updates), group["ns_steps"], group["coefficients"])
                scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
                for p, o in zip(params, ortho):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(o.to(p.dtype), alpha=-group["lr"] * scale)
        return loss


def newton_schulz_dtype(setting: str, device_kind: str) -> torch.dtype:
    """optim.ns_dtype: auto is bf16 where the device computes it natively and faster than fp32 (and
    accurately enough for Newton-Schulz), else fp32."""
    if setting == "auto":
        setting = "bf16" if bf16_native(device_kind)[0] else "fp32"
    return DTYPES[setting]


def build_optimizers(groups: dict[str, list[nn.Parameter]], cfg: OptimConfig,
                     device_kind: str, rank: int = 0, world_size: int = 1) -> list[torch.optim.Optimizer]:
    """One optimizer per algorithm, stepped together; every param group keeps its base LR as `initial_lr`,
    which the schedule scales, as torch's LR schedulers do."""
    # fused: one pass per tensor where torch has the kernel; elsewhere (None) torch picks its foreach form
    fused = True if device_kind in ("cuda", "cpu") else None
    adam = dict(betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, fused=fused)
    adam_groups = [
        dict(params=groups["embedding"], lr=cfg.embedding_lr, weight_decay=0.0),
        dict(params=groups["unembedding"], lr=cfg.unembedding_lr, weight_decay=0.0),
    ]
    if groups.get("scalar"):  # only models with per-layer scalars have them
        # While every block's output projection is still zero (the first step) the scalars' exact
        # gradient is 0 (RMSNorm ignores the stream's scale) and the computed one is rounding noise
        # (~1e-10), which eps=1e-10 turned into a full-size step of random sign: a different run
        # per kernel. Real gradients, from the second step on, are orders of magnitude larger.
        adam_groups.append(dict(params=groups["scalar"], lr=cfg.scalar_lr, weight_decay=0.0,
                                eps=max(cfg.adam_eps, SCALAR_ADAM_EPS)))
    if cfg.name == "adamw":
        adam_groups.append(dict(params=groups["matrix"], lr=cfg.matrix_lr, weight_decay=cfg.weight_decay))
        optimizers = [torch.optim.AdamW(adam_groups, **adam)]
    else:
        optimizers = [
            torch.optim.AdamW(adam_groups, **adam),
            Muon(groups["matrix"], lr=cfg.matrix_lr, weight_decay=cfg.weight_decay,
                 ns_steps=cfg.ns_steps, coefficients=cfg.ns_coefficients,
                 ns_dtype=newton_schulz_dtype(cfg.ns_dtype, device_kind), rank=rank, world_size=world_size),
        ]
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] *= cfg.lr_scale
            group["initial_lr"] = group["lr"]
    return optimizers


def apply_schedule(optimizers: list[torch.optim.Optimizer], lr_multiplier: float, momentum: float) -> None:
    """The schedule at this point of the budget: set by hand, since it follows charged time, not steps
    (torch's LambdaLR would set the same lr, initial_lr x its lambda, from a step count)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_multiplier
            if isinstance(opt, Muon):
                group["momentum"] = momentum
