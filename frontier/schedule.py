"""Learning-rate and Muon-momentum schedules as functions of budget progress p in [0, 1].

Progress is charged seconds / budget seconds, so a fast and a slow configuration both reach
the end of their decay exactly when their budget runs out.
"""
from __future__ import annotations

import math

from frontier.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, progress: float) -> float:
    p = min(max(progress, 0.0), 1.0)
    if cfg.warmup_fraction > 0 and p < cfg.warmup_fraction:
        return p / cfg.warmup_fraction
    if cfg.name == "constant":
        return 1.0
    final = cfg.final_lr_fraction
    if cfg.name == "cosine":
        span = 1.0 - cfg.warmup_fraction
        t = (p - cfg.warmup_fraction) / span if span > 0 else 1.0
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * t))
    # wsd: stable at 1, then a linear warmdown to `final` over the last warmdown_fraction
    decay_start = 1.0 - cfg.warmdown_fraction
    if p <= decay_start or cfg.warmdown_fraction == 0:
        return 1.0
    return final + (1.0 - final) * (1.0 - p) / cfg.warmdown_fraction


def muon_momentum(cfg: ScheduleConfig, progress: float) -> float:
    if cfg.momentum_warmup_fraction == 0:
        return cfg.momentum_end
    t = min(max(progress, 0.0) / cfg.momentum_warmup_fraction, 1.0)
    return cfg.momentum_start + (cfg.momentum_end - cfg.momentum_start) * t
