"""Checkpoints: the weights, the resolved config and the tokenizer beside them."""
from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import torch
from omegaconf import OmegaConf

from frontier.config import ConfigError, ModelConfig, error_line
from frontier.model import GPT
from frontier.tokenizer import Tokenizer

FORMAT = 1


def save_final(path: Path, model: GPT, config: dict, tokenizer: Tokenizer) -> None:
    """Writes `final.pt` and a copy of the tokenizer beside it, each atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer_copy = path.parent / "tokenizer.json"
    if tokenizer.path is not None and Path(tokenizer.path).resolve() != tokenizer_copy.resolve():
        tmp = tokenizer_copy.with_suffix(".tmp")
        shutil.copyfile(tokenizer.path, tmp)
        os.replace(tmp, tokenizer_copy)
    payload = {
        "format": FORMAT,
        "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "config": config,
        "vocab_size": model.vocab_size,
        "tokenizer": "tokenizer.json",  # relative to the checkpoint's folder
        "tokenizer_fingerprint": tokenizer.fingerprint(),
    }
    tmp = path.with_suffix(".tmp")
    write_torch(payload, tmp)
    os.replace(tmp, path)


def write_torch(payload, path: Path) -> None:
    """torch.save into a file Python opened: when the disk fills up, torch's own error then carries the
    OSError (errno ENOSPC) it was raised from; writing to a path, it says only "unexpected pos"."""
    with open(path, "wb") as file:
        torch.save(payload, file)


class CheckpointError(ConfigError):
    """A checkpoint file that is missing, truncated, not a torch file, or not one of ours."""


def read_checkpoint(path: str | os.PathLike, what: str, keys: tuple[str, ...] = ("model", "config"),
                    mmap: bool = False) -> dict:
    """The payload of a `final.pt` or `resume.pt`; every way it can be unusable becomes one sentence
    naming `what` (the key the user gave, e.g. "checkpoint=" or "resume=") and the file. `mmap` maps the
    tensors instead of reading them, for a check that needs the rest only."""
    path = Path(path)

    def refuse(reason: str) -> CheckpointError:
        return CheckpointError(f"{what}{path} is not allowed: {reason}")

    if not path.exists():
        raise refuse("the file does not exist")
    if not path.is_file():
        raise refuse("it is not a file")
    try:
        # torch maps only its zip format: another file is read whole, to fail (or load) as it would anyway
        payload = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap and zipfile.is_zipfile(path))
    except Exception as err:  # EOFError, UnpicklingError, zip errors, OSError: all mean unusable
        raise refuse(f"it is truncated, damaged or not a torch checkpoint ({error_line(err)})") from None
    if not isinstance(payload, dict) or any(key not in payload for key in keys):
        held = f"keys {', '.join(map(str, list(payload)[:6])) or 'none'}" if isinstance(payload, dict) \
            else f"a {type(payload).__name__}"
        raise refuse(f"it is not a frontier checkpoint (it holds {held}; expected keys {', '.join(keys)})")
    return payload


def _read(path: str | os.PathLike) -> dict:
    payload = read_checkpoint(path, "checkpoint=", keys=("format", "model", "config", "vocab_size", "tokenizer"))
    if payload["format"] != FORMAT:
        raise CheckpointError(f"checkpoint={path} is not allowed: it has format {payload['format']!r}, "
                              f"this version reads format {FORMAT}")
    return payload


def model_config(payload: dict) -> ModelConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), payload["config"]["model"]))


def load_for_eval(checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu") -> GPT:
    """A single-device model with a pure causal forward: `model(idx) -> logits`."""
    payload = _read(checkpoint_path)
    model = GPT(model_config(payload), payload["vocab_size"])
    model.load_state_dict(payload["model"])
    return model.to(device).eval()


def load_tokenizer(checkpoint_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved beside the checkpoint, and only the one it was trained with: another one (a
    tokenizer.json copied from another run) would give every figure silently wrong."""
    payload = _read(checkpoint_path)
    path = Path(checkpoint_path).parent / payload["tokenizer"]
    if not path.is_file():
        raise FileNotFoundError(f"the tokenizer of checkpoint {checkpoint_path} is missing: expected {path}")
    try:
        tokenizer = Tokenizer.load(path)
    except Exception as err:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"checkpoint={checkpoint_path} is not allowed: its tokenizer {path} is damaged or not "
                              f"a tokenizer ({error_line(err)})") from None
    expected = payload.get("tokenizer_fingerprint")
    if expected is not None and tokenizer.fingerprint() != expected:
        raise CheckpointError(f"checkpoint={checkpoint_path} is not allowed: its tokenizer {path} is not the one the "
                              f"model was trained with (fingerprint {tokenizer.fingerprint()}, the checkpoint's "
                              f"{expected})")
    return tokenizer
