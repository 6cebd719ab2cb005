import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from frontier.data import ValidationSet
from frontier.device import resolve_device
from frontier.evaluate import ratio_se, val_bpb
from tests.conftest import ROOT


class FixedLoss(torch.nn.Module):
    """Loss of target position t is t + 1 nats, whatever the tokens."""

    def forward(self, idx, targets, reduction="none"):
        return torch.arange(1, idx.size(1) + 1, dtype=torch.float32).expand(idx.size(0), -1)


class TokenLoss(torch.nn.Module):
    """Loss of a target is its token id / 3 nats: different documents score differently."""

    def forward(self, idx, targets, reduction="none"):
        return targets.float() / 3


def one_document_per_row(rows: torch.Tensor, split_documents: int = 0) -> ValidationSet:
    targets = np.repeat(np.arange(len(rows)), rows.size(1) - 1).reshape(len(rows), -1)
    return ValidationSet.of(rows.numpy(), targets, split_documents, "t")


def test_val_bpb_by_hand_with_a_special_token():
    bos, a, b = 0, 1, 2
    token_bytes = torch.tensor([0, 2, 3])  # BOS has no bytes
    rows = torch.tensor([[bos, a, b, bos]])  # targets: a (1 nat, 2 bytes), b (2 nats, 3 bytes), BOS (3 nats, 0)
    score = val_bpb(FixedLoss(), one_document_per_row(rows), token_bytes, resolve_device("cpu", "fp32"), batch_rows=1)
    assert score.tokens == 3 and score.documents == 1 and score.se is None  # one document: no spread to measure
    assert math.isclose(score.val_bpb, (1 + 2) / (math.log(2) * (2 + 3)))


def test_val_bpb_is_independent_of_the_batch_size():
    token_bytes = torch.tensor([0, 1, 2, 3, 4])
    rows = torch.randint(0, 5, (5, 9), generator=torch.Generator().manual_seed(0))
    device = resolve_device("cpu", "fp32")
    one = val_bpb(FixedLoss(), one_document_per_row(rows), token_bytes, device, batch_rows=1)
    many = val_bpb(FixedLoss(), one_document_per_row(rows), token_bytes, device, batch_rows=4)
    assert math.isclose(one.val_bpb, many.val_bpb) and math.isclose(one.se, many.se)


def random_set(seed: int = 0, rows: int = 12, width: int = 9) -> tuple[ValidationSet, torch.Tensor, np.ndarray]:
    """Rows of random tokens, each row holding two or three documents (one may run into the next row)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, size=(rows, width + 1))
    # document ids, in row order, some spanning rows
    owners = (np.cumsum(rng.random((rows, width)) < 0.3) + 100).reshape(rows, width)
    return ValidationSet.of(tokens, owners, 1000, "t"), torch.tensor([0, 2, 1, 4, 3, 1]), owners


def test_val_bpb_is_the_previous_definition_and_its_sums_count_every_target_once():
    """The per-document sums add up to the sums over all targets that val_bpb always was (Σ nats / ln 2 Σ bytes)."""
    vset, token_bytes, owners = random_set()
    score = val_bpb(TokenLoss(), vset, token_bytes, resolve_device("cpu", "fp32"), batch_rows=5)
    y = vset.rows[:, 1:]
    counted = token_bytes[y]
    nats = (y.double() / 3 * (counted > 0)).sum().item()
    assert math.isclose(score.val_bpb, nats / (math.log(2) * counted.sum().item()), rel_tol=1e-6)
    assert score.tokens == y.numel()
    per_doc_bytes = {d: counted[torch.from_numpy(owners == d)].sum().item() for d in np.unique(owners)}
    assert score.documents == sum(b > 0 for b in per_doc_bytes.values())


def test_the_standard_error_is_the_ratio_estimators_over_documents():
    vset, token_bytes, owners = random_set(seed=3, rows=40)
    score = val_bpb(TokenLoss(), vset, token_bytes, resolve_device("cpu", "fp32"), batch_rows=7)
    y = vset.rows[:, 1:]
    counted = token_bytes[y].double()
    nats_of, bytes_of = [], []
    for d in np.unique(owners):  # directly: each document's sums, then the linearised variance of the ratio
        mask = torch.from_numpy(owners == d)
        if counted[mask].sum() > 0:
            nats_of.append((y[mask].double() / 3 * (counted[mask] > 0)).sum().item())
            bytes_of.append(counted[mask].sum().item())
    n, ratio = len(nats_of), sum(nats_of) / sum(bytes_of)
    variance = n / (n - 1) * sum((a - ratio * b) ** 2 for a, b in zip(nats_of, bytes_of)) * (1 - n / 1000)
    assert math.isclose(score.se, math.sqrt(variance) / sum(bytes_of) / math.log(2), rel_tol=1e-6)


def test_the_standard_error_matches_the_spread_of_the_ratio_over_repeated_samples():
    """Monte Carlo: draw documents from a synthetic split many times; the standard deviation of Σ nats / Σ bytes
    over the draws is what the formula estimates from one draw, with and without the population correction."""
    rng = np.random.default_rng(0)
    population = 4000
    sizes = rng.lognormal(6, 1, population)  # bytes per document, heavy-tailed as text is
    rates = rng.normal(0.8, 0.15, population) + 0.1 * np.log(sizes) / 6  # nats per byte, varying by document
    nats = sizes * rates
    for n, corrected in ((100, False), (1000, True)):
        ratios, ses = [], []
        for _ in range(1500):
            pick = rng.choice(population, n, replace=False)
            ratios.append(nats[pick].sum() / sizes[pick].sum())
            ses.append(ratio_se(nats[pick], sizes[pick], population if corrected else None))
        assert math.isclose(np.std(ratios), np.mean(ses), rel_tol=0.1), (n, np.std(ratios), np.mean(ses))
    assert ratio_se(nats, sizes, population) == 0.0  # the whole split: its own val_bpb, no sampling error
    assert ratio_se(nats[:1], sizes[:1]) is None


DISTRIBUTED = """
import sys, torch, torch.distributed as dist
from tests.test_evaluate import TokenLoss, random_set
from frontier.device import resolve_device
from frontier.evaluate import val_bpb
dist.init_process_group("gloo", rank=int(sys.argv[1]), world_size=2, init_method="tcp://127.0.0.1:" + sys.argv[2])
vset, token_bytes, _ = random_set(seed=5, rows=13)
score = val_bpb(TokenLoss(), vset, token_bytes, resolve_device("cpu", "fp32"), batch_rows=2)
print(score.val_bpb, score.se, score.tokens, score.documents)
dist.destroy_process_group()
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_give_the_single_process_score_and_error():
    """Each rank scores every other row, documents spanning the ranks' rows: the all-reduced per-document sums
    are one process's."""
    vset, token_bytes, _ = random_set(seed=5, rows=13)
    alone = val_bpb(TokenLoss(), vset, token_bytes, resolve_device("cpu", "fp32"), batch_rows=2)
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", DISTRIBUTED, str(rank), port], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    for out, _ in outputs:
        bpb, se, tokens, documents = out.split()
        assert math.isclose(float(bpb), alone.val_bpb, rel_tol=1e-12) and math.isclose(float(se), alone.se, rel_tol=1e-9)
        assert (int(tokens), int(documents)) == (alone.tokens, alone.documents)
