"""Byte-level BPE trained with `tokenizers`, plus the per-token byte lengths that val_bpb needs."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS = "<|bos|>"


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-printable-character table used by the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    def __init__(self, hf: HFTokenizer, path: Path | None = None):
        self.hf = hf
        self.path = path
        bos = hf.token_to_id(BOS)
        if bos is None:
            raise ValueError(f"tokenizer {path} has no {BOS} token; train one with frontier or add it")
        self.bos_id: int = bos
        self.vocab_size: int = hf.get_vocab_size()
        self.token_bytes = self._token_bytes()

    def _token_bytes(self) -> torch.Tensor:
        """UTF-8 byte length of each token; 0 for special tokens, so they never count in val_bpb."""
        decoder = _byte_decoder()
        special = {t.content for t in self.hf.get_added_tokens_decoder().values() if t.special}
        lengths = torch.zeros(self.vocab_size, dtype=torch.int64)
        for token, idx in self.hf.get_vocab().items():
            if token not in special:
                lengths[idx] = sum(1 for ch in token if ch in decoder)
        return lengths

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.hf.to_str().encode()).hexdigest()[:16]

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        return cls(HFTokenizer.from_file(str(path)), path)

    def save(self, path: str | os.PathLike) -> None:
        """Atomic: a crash mid-write never leaves a half-written tokenizer under `path`."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.hf.save(str(tmp))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.path = path


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE with all 256 bytes in the base vocabulary; `vocab_size` includes BOS."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf)
