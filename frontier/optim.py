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


class Optimizer:
    """What Frontier asks of an optimizer (param_groups, state, step, zero_grad, state_dict), with
    torch.optim's state_dict layout. torch.optim.Optimizer's own methods import torch._dynamo when first
    called, to guard a compilation of the step that Frontier never makes: two CPU-seconds of every run's start."""

    def __init__(self, params, defaults: dict):
        self.defaults = defaults
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.param_groups = [{**defaults, **group, "params": list(group["params"])} for group in groups]
        self.state: dict[torch.Tensor, dict] = defaultdict(dict)

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    def state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(p)] for p in group["params"]]} for group in self.param_groups]
        return {"state": {index[id(p)]: dict(state) for p, state in self.state.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch.optim's: the saved groups' settings, and each parameter's state moved to its device
        (and its dtype, but for the step count)."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("the saved optimizer state has other parameter groups than this optimizer")
        params = {i: p for saved_group, group in zip(saved, self.param_groups)
                  for i, p in zip(saved_group["params"], group["params"])}
        self.state = defaultdict(dict)
        for i, state in state_dict["state"].items():
            p = params[i]
            self.state[p] = {k: v.to(p.device, v.dtype if k == "step" or not v.is_floating_point() else p.dtype)
                             if torch.is_tensor(v) else v for k, v in state.items()}
        for saved_group, group in zip(saved, self.param_groups):
            group.update({k: v for k, v in saved_group.items() if k != "params"})


class AdamW(Optimizer):
    """torch.optim.AdamW's update, step for step: its fused kernel (fused=True, on a CPU or CUDA device)
    or its foreach form, with the same state."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, fused: bool = False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            by_kind: dict[tuple, list[nn.Parameter]] = defaultdict(list)  # each call takes one device and dtype
            for p in group["params"]:
                if p.grad is not None:
                    by_kind[p.device, p.dtype].append(p)
            for params in by_kind.values():
                self._update(group, params)

    def _update(self, group: dict, params: list[nn.Parameter]) -> None:
        for p in params:
            if not self.state[p]:
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32,
                                                     device=p.device if group["fused"] else "cpu"),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        grads = [p.grad for p in params]
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
        steps = [self.state[p]["step"] for p in params]
        (beta1, beta2), lr, eps = group["betas"], group["lr"], group["eps"]
        torch._foreach_add_(steps, 1)
        if group["fused"]:
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=lr, beta1=beta1,
                                beta2=beta2, weight_decay=group["weight_decay"], eps=eps, maximize=False,
                                grad_scale=None, found_inf=None)
            return
        torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        counts = [step.item() for step in steps]
        step_sizes = [(lr / (1 - beta1 ** n)) * -1 for n in counts]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [(1 - beta2 ** n) ** 0.5 for n in counts])
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, step_sizes)


class Muon(Optimizer):
    """Nesterov momentum, then the orthogonalised update scaled by max(1, rows/cols)^0.5."""

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
        for group in self.param_groups:
            by_shape: dict[torch.Size, list[nn.Parameter]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_shape[p.shape].append(p)
            mom = group["momentum"]
            for shape, params in by_shape.items():
                updates = []
                for p in params:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                    buf.lerp_(p.grad, 1 - mom)
                    updates.append(p.grad.lerp(buf, mom))  # Nesterov: look ahead along the momentum
                ortho = self._orthogonalize_shared(torch.stack(updates), group["ns_steps"], group["coefficients"])
                scale = max(1.0, shape[-2] / shape[-1]) ** 0.5
                for p, o in zip(params, ortho):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(o.to(p.dtype), alpha=-group["lr"] * scale)


def newton_schulz_dtype(setting: str, device_kind: str) -> torch.dtype:
    """optim.ns_dtype: auto is bf16 where the device computes it natively and faster than fp32 (and
    accurately enough for Newton-Schulz), else fp32."""
    if setting == "auto":
        setting = "bf16" if bf16_native(device_kind)[0] else "fp32"
    return DTYPES[setting]


def build_optimizers(groups: dict[str, list[nn.Parameter]], cfg: OptimConfig,
                     device_kind: str, rank: int = 0, world_size: int = 1) -> list[Optimizer]:
    """One optimizer per algorithm; every param group remembers its base LR for the schedule."""
    adam = dict(betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, fused=device_kind in ("cuda", "cpu"))
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
        optimizers = [AdamW(adam_groups, **adam)]
    else:
        optimizers = [
            AdamW(adam_groups, **adam),
            Muon(groups["matrix"], lr=cfg.matrix_lr, weight_decay=cfg.weight_decay,
                 ns_steps=cfg.ns_steps, coefficients=cfg.ns_coefficients,
                 ns_dtype=newton_schulz_dtype(cfg.ns_dtype, device_kind), rank=rank, world_size=world_size),
        ]
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] *= cfg.lr_scale
            group["base_lr"] = group["lr"]
    return optimizers


def apply_schedule(optimizers: list[Optimizer], lr_multiplier: float, momentum: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * lr_multiplier
            if isinstance(opt, Muon):
                group["momentum"] = momentum
