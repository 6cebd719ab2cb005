"""Data parallelism through torchrun and torch.distributed: the process group and its collectives.

`torchrun --nproc_per_node=N -m frontier.train ...` sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; without them the run is a single process and every collective is a no-op.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from frontier.config import ConfigError

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "neuron": "neuron"}
RENDEZVOUS = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where collective buffers live (nccl needs them on the GPU)

    @property
    def active(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def max(self, *values: float) -> list[float]:
        """Each figure's largest value across ranks (the slowest rank's step time), in one collective."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def mean(self, value: float) -> float:
        if not self.active:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.size

    def any(self, flag: bool) -> bool:
        """One decision for all ranks (e.g. rank 0 was told to stop)."""
        if not self.active:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def average_gradients(self, model: torch.nn.Module) -> None:
        """All-reduce every gradient in one flat buffer, then divide by the world size."""
        if not self.active:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def close(self, together: bool = False) -> None:
        """Leaves the group; `together` (a run all ranks ended at one agreed point) waits for the others
        first: a rank that tore its connections down while a peer was still writing (rank 0's checkpoint)
        could abort in gloo's teardown (SIGABRT at exit). Any other end leaves at once: a barrier there
        could meet a peer's pending collective and hang."""
        if self.active and dist.is_initialized():
            if together:
                try:
                    dist.barrier()
                except Exception:  # a peer already gone: nothing left to wait for
                    pass
            dist.destroy_process_group()


def init_world(device_kind: str) -> World:
    """Joins the process group torchrun describes, with the backend of the device."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    missing = [name for name in RENDEZVOUS if name not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE={size} but {', '.join(missing)} not set: launch with torchrun "
                          "(e.g. torchrun --nproc_per_node=2 -m frontier.train ...)")
    backend = BACKENDS[device_kind]
    if not dist.is_backend_available(backend) and device_kind != "neuron":
        raise ConfigError(f"the {backend!r} process-group backend for device={device_kind} is not available "
                          f"in torch {torch.__version__}")
    local_rank = int(os.environ["LOCAL_RANK"])
    # One device per rank: the GPU or (logical) NeuronCore of this local rank.
    device = f"{device_kind}:{local_rank}" if device_kind in ("cuda", "neuron") else device_kind
    world = World(int(os.environ["RANK"]), size, local_rank, device)
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend, rank=world.rank, world_size=size, timeout=datetime.timedelta(minutes=10))
    return world
