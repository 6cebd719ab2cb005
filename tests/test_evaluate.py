import math

import torch

from frontier.device import resolve_device
from frontier.evaluate import val_bpb


class FixedLoss(torch.nn.Module):
    """Loss of target position t is t + 1 nats, whatever the tokens."""

    def forward(self, idx, targets, reduction="none"):
        return torch.arange(1, idx.size(1) + 1, dtype=torch.float32).expand(idx.size(0), -1)


def test_val_bpb_by_hand_with_a_special_token():
    bos, a, b = 0, 1, 2
    token_bytes = torch.tensor([0, 2, 3])  # BOS has no bytes
    rows = torch.tensor([[bos, a, b, bos]])  # targets: a (1 nat, 2 bytes), b (2 nats, 3 bytes), BOS (3 nats, 0)
    bpb, tokens = val_bpb(FixedLoss(), rows, token_bytes, resolve_device("cpu", "fp32"), batch_rows=1)
    assert tokens == 3
    assert math.isclose(bpb, (1 + 2) / (math.log(2) * (2 + 3)))


def test_val_bpb_is_independent_of_the_batch_size():
    token_bytes = torch.tensor([0, 1, 2, 3, 4])
    rows = torch.randint(0, 5, (5, 9), generator=torch.Generator().manual_seed(0))
    device = resolve_device("cpu", "fp32")
    one, _ = val_bpb(FixedLoss(), rows, token_bytes, device, batch_rows=1)
    many, _ = val_bpb(FixedLoss(), rows, token_bytes, device, batch_rows=4)
    assert math.isclose(one, many)
