"""Defaults sized to the machine: the competition's model and budget on an accelerator, and a model
and budget that a CPU finishes in minutes elsewhere, so the first command works anywhere.

conf/config.yaml picks `model` and `budget` through `${frontier.sized:GROUP,ACCELERATOR_OPTION,CPU_OPTION}`;
an explicit `model=...` or `budget=...` always wins.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from omegaconf import OmegaConf

chosen: dict[str, str] = {}  # group -> the option picked for this machine, for the start-up line


# Device files without which no CUDA GPU (/dev/nvidia*, /dev/dxg under WSL) or Trainium (/dev/neuron*) can be
# seen on Linux: where none exists, torch (2 s to import) is not needed to know there is no accelerator.
ACCELERATOR_DEVICE_FILES = ("nvidia*", "dxg", "neuron*")


def accelerator() -> str | None:
    """The accelerator `device=auto` would pick, or None on a CPU-only machine."""
    if sys.platform == "linux" and not any(any(Path("/dev").glob(pattern)) for pattern in ACCELERATOR_DEVICE_FILES):
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if hasattr(torch, "neuron") and torch.neuron.is_available():
        return "neuron"
    return None


def sized(group: str, on_accelerator: str, on_cpu: str) -> str:
    chosen[group] = on_accelerator if accelerator() else on_cpu
    return chosen[group]


def describe() -> str | None:
    """One line saying what was sized for this machine, or None when the command line chose."""
    if not chosen:
        return None
    picks = " ".join(f"{group}={option}" for group, option in chosen.items())
    where = accelerator() or "a CPU-only machine (no CUDA or Neuron device)"
    return f"{picks}: sized for {where}; choose others with model=... budget=..."


OmegaConf.register_new_resolver("frontier.sized", sized, replace=True)


# -- evaluation sized to the work ------------------------------------------------------------------

FULL_EVAL_TOKENS = 20_971_520  # the competition's public eval set (40 x 2^19 tokens)
EVAL_SHARE = 0.10  # the final evaluation: about this share of the budget's training time
CHECKPOINT_SHARE = 0.10  # all periodic evaluations together: about this share of the loop
# Evaluation's assumed share of the device's peak rate: measured on 2-core CPUs, forward passes of
# tiny and d4 ran at 0.1-0.3 of the matmul rate, so sizing on the low end keeps within the shares.
EVAL_EFFICIENCY = 0.1
MIN_FINAL_ROWS, MIN_CHECKPOINT_ROWS = 16, 4


def _pow2_floor(tokens: float, floor: int) -> int:
    """The largest power of two <= tokens, at least `floor`: nearby estimates (a peak measured again)
    give the same validation set."""
    return max(floor, 1 << max(int(tokens), 1).bit_length() - 1)


def eval_tokens(budget_seconds: float, every_fraction: float, peak_flops: float, flops_per_token: float,
                seq_len: int) -> tuple[int, int, str]:
    """(final_tokens, checkpoint_tokens, why) for a run whose eval.* token counts are not given: the
    final evaluation costs about EVAL_SHARE of the budget and the periodic ones together about
    CHECKPOINT_SHARE, at the forward-pass rate (a third of a training step's FLOPs per token) this
    device's peak gives at EVAL_EFFICIENCY. Powers of two, so the validation set is the same rows for
    every run of this budget on this machine and model.

    The set's documents are spread over the whole split (frontier.data.validation_set), and each run
    records val_bpb_se, its standard error over them: it falls with the square root of the documents
    scored. Where the budget allows (an accelerator's: up to FULL_EVAL_TOKENS, thousands of documents)
    it is small; a CPU-sized set's (about a hundred documents) is larger than the spread between seeds,
    which is why runs compare only on one set (val_fingerprint). The rule stays a share of the budget,
    not a target error: the error is known only once the set is scored."""
    rate = EVAL_EFFICIENCY * peak_flops / (flops_per_token / 3)
    final = min(_pow2_floor(EVAL_SHARE * budget_seconds * rate, MIN_FINAL_ROWS * seq_len), FULL_EVAL_TOKENS)
    evaluations = max(math.ceil(1 / every_fraction) - 1, 1) if every_fraction > 0 else 1
    checkpoint = _pow2_floor(CHECKPOINT_SHARE * budget_seconds * rate / evaluations, MIN_CHECKPOINT_ROWS * seq_len)
    checkpoint = min(checkpoint, final)
    why = (f"sized to ~{EVAL_SHARE:.0%} of the {budget_seconds:g} s budget at an estimated {rate:,.0f} eval "
           f"tokens/s ({EVAL_EFFICIENCY:g} x the {peak_flops / 1e9:,.1f} GFLOP/s peak); the full split: "
           f"eval.final_tokens={FULL_EVAL_TOKENS}")
    return final, checkpoint, why
