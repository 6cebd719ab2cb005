"""val_bpb: the competition's score, summed in nats and bytes so any tokenizer compares fairly, and its
standard error over the documents of the validation set."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from frontier.data import ValidationSet
from frontier.device import Device


@dataclass(frozen=True)
class Score:
    val_bpb: float
    se: float | None  # standard error of val_bpb as an estimate of the whole split's; None under 2 documents
    tokens: int  # target tokens evaluated
    documents: int  # documents with at least one byte scored


@torch.no_grad()
def val_bpb(model: torch.nn.Module, vset: ValidationSet, token_bytes: torch.Tensor, device: Device,
            batch_rows: int) -> Score:
    """Bits per byte over the rows of `vset`: Σ nats / (ln 2 · Σ bytes), and its standard error.

    Targets whose token has no bytes (BOS and other special tokens) add neither nats nor bytes. The sums
    are kept per document (every target belongs to one), which gives the standard error. Under
    torch.distributed each rank evaluates every world_size-th row and the per-document sums are
    all-reduced: each target is on one rank, so the sums are those of one process.
    """
    documents, rows, target_slots = len(vset.documents), vset.rows, vset.target_docs
    if dist.is_available() and dist.is_initialized():
        rows, target_slots = (t[dist.get_rank()::dist.get_world_size()] for t in (rows, target_slots))
    was_training = model.training
    model.eval()
    token_bytes = token_bytes.to(device.torch_device)
    nats, nbytes = (torch.zeros(documents, dtype=torch.float64, device=device.torch_device) for _ in range(2))
    for start in range(0, rows.size(0), batch_rows):
        batch = rows[start:start + batch_rows].to(device.torch_device, dtype=torch.long)
        slots = target_slots[start:start + batch_rows].flatten().to(device.torch_device)
        x, y = batch[:, :-1], batch[:, 1:]
        with device.autocast():
            loss = model(x, y, reduction="none")
        counted = token_bytes[y]
        nats.index_add_(0, slots, (loss.double() * (counted > 0)).flatten())
        nbytes.index_add_(0, slots, counted.double().flatten())
    tokens = torch.tensor([rows.size(0) * (rows.size(1) - 1)], dtype=torch.float64, device=nats.device)
    sums = torch.cat([nats, nbytes, tokens])  # one all_reduce
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sums)
    model.train(was_training)
    sums = sums.cpu().numpy()
    nats, nbytes = sums[:documents], sums[documents:-1]
    scored = nbytes > 0
    bpb = float(nats.sum()) / (math.log(2) * float(nbytes.sum()))
    se = ratio_se(nats[scored], nbytes[scored], vset.split_documents)
    return Score(bpb, None if se is None else se / math.log(2), int(sums[-1]), int(scored.sum()))


def ratio_se(numerators: np.ndarray, denominators: np.ndarray, population: int | None = None) -> float | None:
    """Standard error of the ratio estimator Σy/Σx over n sampled units (documents), by linearisation:
    sqrt(n/(n-1) · Σ(y - R·x)²) / Σx, times the finite-population correction sqrt(1 - n/N) for n of a
    population of N units drawn without replacement (0 when the set is the whole population). None for
    fewer than 2 units, whose spread cannot be estimated."""
    n = len(numerators)
    if n < 2:
        return None
    ratio = numerators.sum() / denominators.sum()
    residuals = numerators - ratio * denominators
    fpc = 1.0 - n / population if population else 1.0
    return float(math.sqrt(max(fpc, 0.0) * n / (n - 1) * float(np.square(residuals).sum())) / denominators.sum())
