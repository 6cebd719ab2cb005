"""val_bpb: the competition's score, summed in nats and bytes so any tokenizer compares fairly."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from frontier.device import Device


@torch.no_grad()
def val_bpb(model: torch.nn.Module, rows: torch.Tensor, token_bytes: torch.Tensor, device: Device,
            batch_rows: int) -> tuple[float, int]:
    """Bits per byte over `rows` (N, T+1); returns (val_bpb, target tokens evaluated).

    Targets whose token has no bytes (BOS and other special tokens) add neither nats nor bytes.
    Under torch.distributed each rank evaluates every world_size-th row and the sums are all-reduced.
    """
    if dist.is_available() and dist.is_initialized():
        rows = rows[dist.get_rank()::dist.get_world_size()]
    was_training = model.training
    model.eval()
    token_bytes = token_bytes.to(device.torch_device)
    nats = torch.zeros((), dtype=torch.float64, device=device.torch_device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device.torch_device)
    for start in range(0, rows.size(0), batch_rows):
        batch = rows[start:start + batch_rows].to(device.torch_device, dtype=torch.long)
        x, y = batch[:, :-1], batch[:, 1:]
        with device.autocast():
            loss = model(x, y, reduction="none")
        counted = token_bytes[y]
        nats += (loss.double() * (counted > 0)).sum()
        nbytes += counted.sum()
    tokens = torch.tensor(rows.size(0) * (rows.size(1) - 1), dtype=torch.float64, device=nats.device)
    totals = torch.stack([nats, nbytes.double(), tokens])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    return totals[0].item() / (math.log(2) * totals[1].item()), int(totals[2].item())
