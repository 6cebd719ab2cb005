"""Text files -> documents -> tokenizer -> memory-mapped token cache -> BOS-aligned batches.

Training and validation come from disjoint files: by the pretraining-shard convention the last
file of a directory is the validation split. A single .txt/.jsonl file is split by documents
instead (its tail, `data.val_fraction`, is held out).

A token cache stores an xxh3 checksum of each of its files in meta.json, checked every time it is
opened (a pass over the file at memory speed, well under a second per GB): a damaged cache is
rebuilt with a warning, never read.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import math
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import xxhash
from filelock import FileLock

from frontier import lifecycle
from frontier.config import DataConfig, error_line, project_path
from frontier.tokenizer import Tokenizer, train_tokenizer

TEXT_SUFFIXES = (".parquet", ".jsonl", ".json", ".txt")
FORMATS = f"{', '.join(TEXT_SUFFIXES[:-1])} or {TEXT_SUFFIXES[-1]}"
CACHE_VERSION = 2  # bump when the on-disk token format changes, so old caches are rebuilt


class DataError(ValueError):
    """Data that cannot be used as asked: missing, empty, or malformed."""


@dataclass(frozen=True)
class Split:
    """Files of one split; for a single file split by documents, the slice of documents used."""

    files: tuple[Path, ...]
    doc_slice: tuple[float, float] = (0.0, 1.0)  # fraction range of each file's documents

    def identity(self) -> list:
        """What a cache built from this split depends on: each file's real path (however data.path reaches
        it: a link, a relative path), size and modification time."""
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files] + [list(self.doc_slice)]


# ---------------------------------------------------------------------------------------------
# Finding the files


def resolve_splits(cfg: DataConfig) -> tuple[Split, Split]:
    if cfg.source == "hub":
        return _download_hub_shards(cfg)
    path = Path(cfg.path).expanduser()
    if not path.exists() and not path.is_symlink():
        raise DataError(f"data.path={cfg.path!r} does not exist (looked in {path.resolve()}); set data.path, "
                        "or FRONTIER_DATA to the folder holding text/wiki_en")
    problem = _not_data(path)
    if problem:
        raise DataError(f"data.path={cfg.path!r} is not allowed: it is {problem}; point it at a {FORMATS} file, "
                        "or a directory of them")
    if path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise DataError(f"data.path={cfg.path!r} is not allowed: {path} is not a data file; point it at a "
                            f"{FORMATS} file, or a directory of them")
        files = [path]
    else:
        try:
            entries = sorted(p for p in path.iterdir() if p.suffix in TEXT_SUFFIXES)
        except OSError as err:
            raise DataError(f"cannot read the folder {path} ({_os_error(err)})") from None
        for entry in entries:  # skipping one would silently drop a shard, or make another the validation split
            problem = _not_data(entry)
            if problem:
                raise DataError(f"data.path={cfg.path!r} is not allowed: {entry} is {problem}; fix or remove it")
        files = [p for p in entries if p.is_file()]
    if not files:
        raise DataError(f"data.path={cfg.path!r} holds no {'/'.join(TEXT_SUFFIXES)} files")
    suffixes = {f.suffix for f in files}
    if len(suffixes) > 1:
        raise DataError(f"data.path={cfg.path!r} mixes file types {sorted(suffixes)}; keep one type per directory")
    if len(files) == 1:
        if files[0].suffix == ".parquet":
            raise DataError(f"data.path={cfg.path!r} has a single parquet shard; the last shard is the "
                            "validation split, so at least two are needed")
        cut = 1.0 - cfg.val_fraction
        return Split(tuple(files), (0.0, cut)), Split(tuple(files), (cut, 1.0))
    return Split(tuple(files[:-1])), Split((files[-1],))


def _not_data(path: Path) -> str | None:
    """Why `path`, which is there, can hold no data (None for a regular file or a folder)."""
    try:
        mode = path.stat().st_mode
    except OSError as err:  # a link to nothing, or a loop of links
        return f"a symbolic link that cannot be followed ({err.strerror or err})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"{kind}, not a regular file"


def _download_hub_shards(cfg: DataConfig) -> tuple[Split, Split]:
    """Fetch shard_%05d.parquet files of a hub dataset; the last shard is validation."""
    from huggingface_hub import hf_hub_download

    target = _cache_folder(cfg, "hub", cfg.hub_repo.replace("/", "__"))

    def fetch(index: int) -> Path:
        name = f"shard_{index:05d}.parquet"
        local = target / name
        if local.is_file():
            return local
        try:
            return Path(hf_hub_download(cfg.hub_repo, name, repo_type="dataset", local_dir=target))
        except Exception as err:  # network, auth or a missing file: say which shard and why
            raise DataError(f"could not download {name} of data.hub_repo={cfg.hub_repo!r}: {err}") from err

    train = tuple(fetch(i) for i in range(cfg.train_shards))
    return Split(train), Split((fetch(cfg.hub_last_shard),))


# ---------------------------------------------------------------------------------------------
# Reading documents


def _check_utf8(path: Path) -> None:
    """Text files must be UTF-8; `datasets` would otherwise fail later without naming the file."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 24)
            pending = len(decoder.getstate()[0])  # bytes of a character split across blocks
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                in_block = max(0, err.start - pending)
                line = lines + block[:in_block].count(b"\n") + 1
                bad = err.object[err.start:err.start + 1].hex()
                raise DataError(f"cannot read {path}: it is not valid UTF-8 (byte {offset + in_block}, "
                                f"line {line}, is 0x{bad}); re-encode it as UTF-8") from None
            if not block:
                return
            offset, lines = offset + len(block), lines + block.count(b"\n")


def _load_file(path: Path, text_column: str):
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    # a local file has no hub download count: updating it was a network call per file, seconds of DNS
    # timeouts on a machine without a network
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    builder = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}[path.suffix]
    if builder != "parquet":
        _check_utf8(path)
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)
    except Exception as err:
        raise DataError(f"cannot read {path}: {type(err).__name__}: {err}") from err
    column = "text" if builder == "text" else text_column
    if column not in ds.column_names:
        raise DataError(f"{path} has no {column!r} column (columns: {', '.join(ds.column_names)}); "
                        "set data.text_column")
    return ds, column


def _is_empty_file(path: Path) -> bool:
    """A shard without rows, or a text file of nothing but whitespace: `datasets` cannot open either."""
    if path.suffix != ".parquet":
        return path.stat().st_size < 4096 and not path.read_bytes().strip()
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception as err:
        raise DataError(f"cannot read {path}: {type(err).__name__}: {err}") from err


def iter_documents(split: Split, text_column: str, chunk: int = 1024,
                   skipped: dict | None = None) -> Iterator[list[str]]:
    """Chunks of non-empty documents, in file order. Empty documents and files are counted in
    `skipped` ("documents", "files"), never silently dropped."""
    skipped = skipped if skipped is not None else {}
    lo, hi = split.doc_slice
    for path in split.files:
        try:
            if _is_empty_file(path):
                skipped.setdefault("files", []).append(str(path))
                continue
            ds, column = _load_file(path, text_column)
        except OSError as err:  # the file's error, not the caches' (which the callers report)
            raise DataError(f"cannot read {path} ({_os_error(err)})") from None
        start, stop = int(round(lo * len(ds))), int(round(hi * len(ds)))
        if stop <= start:
            skipped.setdefault("files", []).append(str(path))
        for begin in range(start, stop, chunk):
            texts = ds[begin:min(begin + chunk, stop)][column]
            kept = [t for t in texts if t]
            skipped["documents"] = skipped.get("documents", 0) + len(texts) - len(kept)
            yield kept


# ---------------------------------------------------------------------------------------------
# Tokenizer and token cache


class BuildProgress:
    """What a cache build is doing, so a first run is never silent: a line when it starts and when it
    ends, and a live count of documents (and characters or tokens) on a terminal in between."""

    def __init__(self, what: str, unit: str):
        from rich.console import Console
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.what, self.unit, self.documents, self.amount = what, unit, 0, 0
        console = Console(stderr=True)
        self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                            console=console, transient=True, disable=not console.is_terminal)
        self.task = self.bar.add_task(what)

    def __enter__(self) -> "BuildProgress":
        print(f"{self.what} (once: the result is cached) ...", file=sys.stderr, flush=True)
        self.bar.start()
        return self

    def advance(self, documents: int, amount: int) -> None:
        lifecycle.raise_if_stopped()  # a Ctrl-C that Python swallowed stops the build within a chunk
        self.documents += documents
        self.amount += amount
        self.bar.update(self.task, description=f"{self.what}: {self.documents:,} documents, "
                                               f"{self.amount:,} {self.unit}")

    def __exit__(self, *exc) -> None:
        self.bar.stop()
        if exc[0] is None:
            print(f"{self.what}: done, {self.documents:,} documents, {self.amount:,} {self.unit}",
                  file=sys.stderr, flush=True)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _os_error(err: OSError) -> str:
    return f"{type(err).__name__}: {err.strerror or err}"


def _cache_error(cfg: DataConfig, err: OSError) -> DataError:
    return DataError(f"data.cache_dir={cfg.cache_dir!r} is not allowed: cannot write the data caches there "
                     f"({_os_error(err)})")


def _cache_folder(cfg: DataConfig, *parts: str) -> Path:
    """A folder under data.cache_dir, created now so that an unwritable cache is reported before any work."""
    folder = project_path(cfg.cache_dir).joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise _cache_error(cfg, err) from None
    return folder


_CHECKED_FILES = ("tokens.bin", "offsets.npy")


def _checksum(path: Path) -> str:
    """xxh3 of a file, read in blocks: about 10 GB/s, so checking a cache on every load costs little
    next to building it."""
    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(1 << 26):
            digest.update(block)
    return digest.hexdigest()


def given_tokenizer(cfg: DataConfig) -> Tokenizer:
    """The tokenizer.json `data.tokenizer_path` names; one that is missing or unreadable is a DataError
    naming the key (the train command checks it before it writes anything)."""
    path = Path(cfg.tokenizer_path).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer_path={cfg.tokenizer_path!r} is not allowed: {path.resolve()} is not a "
                        "file; name a tokenizer.json saved by the tokenizers library, or leave it unset to train one")
    try:
        return Tokenizer.load(path)
    except Exception as err:
        raise DataError(f"data.tokenizer_path={cfg.tokenizer_path!r} is not allowed: {path} is not a tokenizer.json "
                        f"the tokenizers library can read ({error_line(err)})") from None


def load_tokenizer(cfg: DataConfig, train: Split) -> Tokenizer:
    """`data.tokenizer_path`, or a BPE trained on the training split and cached by its inputs."""
    if cfg.tokenizer_path:
        return given_tokenizer(cfg)
    key = _digest([CACHE_VERSION, train.identity(), cfg.vocab_size, cfg.tokenizer_train_chars, cfg.text_column])
    path = _cache_folder(cfg, "tokenizers", key) / "tokenizer.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            try:
                return Tokenizer.load(path)
            except Exception:  # unreadable (damaged by hand, or from another version): train anew
                path.unlink()

        def texts(progress: BuildProgress) -> Iterator[str]:
            for docs in iter_documents(train, cfg.text_column):
                for doc in docs:
                    yield doc
                    progress.advance(1, len(doc))
                    if progress.amount >= cfg.tokenizer_train_chars:
                        return

        with BuildProgress(f"training a {cfg.vocab_size:,}-token BPE tokenizer", "characters") as progress:
            tokenizer = train_tokenizer(texts(progress), cfg.vocab_size)
        try:
            tokenizer.save(path)
        except OSError as err:  # e.g. the disk filled up
            raise _cache_error(cfg, err) from None
        return tokenizer


class TokenCorpus:
    """Documents as one uint16 token stream (each document starts with BOS) plus offsets."""

    def __init__(self, directory: Path, tokenizer_fingerprint: str):
        meta = json.loads((directory / "meta.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("checksums"), dict):  # valid JSON, but damaged
            raise DataError(f"token cache {directory} is damaged: its meta.json is not a cache's record")
        if meta.get("version") != CACHE_VERSION or meta.get("tokenizer") != tokenizer_fingerprint:
            raise DataError(f"token cache {directory} was built by another version or tokenizer")
        for name in _CHECKED_FILES:
            if _checksum(directory / name) != meta["checksums"][name]:
                raise DataError(f"token cache {directory} is damaged: {name} does not match its checksum")
        self.directory = directory
        self.meta = meta
        self.tokens = np.memmap(directory / "tokens.bin", dtype=np.uint16, mode="r")
        self.offsets = np.load(directory / "offsets.npy")
        if len(self.tokens) != meta["tokens"] or len(self.offsets) != meta["documents"] + 1:
            raise DataError(f"token cache {directory} is inconsistent with its meta.json")

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index]:self.offsets[index + 1]]


def load_corpus(split: Split, tokenizer: Tokenizer, cfg: DataConfig, name: str) -> TokenCorpus:
    """The tokenized split, from the cache when its inputs are unchanged; built once under a lock."""
    key = _digest([CACHE_VERSION, split.identity(), tokenizer.fingerprint(), cfg.text_column])
    directory = _cache_folder(cfg, "tokens") / f"{name}-{key}"
    with FileLock(str(directory) + ".lock"):
        if (directory / "meta.json").is_file():
            try:
                return TokenCorpus(directory, tokenizer.fingerprint())
            except (DataError, ValueError, KeyError, OSError) as err:  # never used; rebuilt below
                print(f"warning: {err}; rebuilding it", file=sys.stderr, flush=True)
        try:
            with BuildProgress(f"tokenizing the {name} split into {directory.parent}", "tokens") as progress:
                _build_corpus(split, tokenizer, cfg.text_column, directory, progress)
        except OSError as err:  # e.g. the disk filled up
            raise _cache_error(cfg, err) from None
        return TokenCorpus(directory, tokenizer.fingerprint())


def _build_corpus(split: Split, tokenizer: Tokenizer, text_column: str, directory: Path,
                  progress: BuildProgress) -> None:
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_corpus(split, tokenizer, text_column, directory, tmp, progress)
    except BaseException:  # a bad file, a full disk, Ctrl-C: no half-written cache is left behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_corpus(split: Split, tokenizer: Tokenizer, text_column: str, directory: Path, tmp: Path,
                  progress: BuildProgress) -> None:
    offsets, total, docs, skipped = [0], 0, 0, {}
    with open(tmp / "tokens.bin", "wb") as out:
        for texts in iter_documents(split, text_column, skipped=skipped):
            before = total
            for ids in tokenizer.encode_batch(texts):
                row = np.asarray([tokenizer.bos_id, *ids], dtype=np.uint16)
                out.write(row.tobytes())
                total += len(row)
                offsets.append(total)
                docs += 1
            progress.advance(len(texts), total - before)
    if docs == 0:
        raise DataError(f"no non-empty documents in {', '.join(map(str, split.files))}")
    np.save(tmp / "offsets.npy", np.asarray(offsets, dtype=np.int64))
    meta = {"version": CACHE_VERSION, "tokens": total, "documents": docs,
            "checksums": {name: _checksum(tmp / name) for name in _CHECKED_FILES},
            "files": [str(f) for f in split.files], "doc_slice": list(split.doc_slice),
            "tokenizer": tokenizer.fingerprint(), "skipped_empty_documents": skipped.get("documents", 0),
            "empty_files": skipped.get("files", [])}
    # meta.json is written last: its presence marks a complete cache, and the rename is atomic.
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


# ---------------------------------------------------------------------------------------------
# Batches


class PackedLoader:
    """Best-fit packing of whole documents into rows of seq_len + 1 tokens, each starting at BOS.

    From a buffer of documents, each row takes the longest document that still fits; when none
    fits, the shortest is cropped to fill the row (its tail is never used). Documents come in a
    seeded shuffle per epoch, endlessly, or once each in `order`: the row where they run out is
    filled with BOS, whose targets count no bytes. Deterministic for a seed; `state_dict` holds the
    position so that a resumed run sees the same rows.
    """

    def __init__(self, corpus: TokenCorpus, seq_len: int, rows: int, seed: int = 0,
                 order: np.ndarray | None = None, buffer_size: int = 256):
        self.corpus = corpus
        self.row_len = seq_len + 1
        self.rows = rows
        self.seed = seed
        self.given_order = order
        self.lengths = corpus.doc_lengths()
        self.epoch, self.cursor = 0, 0
        self.order = self._order(0)
        size = min(buffer_size, len(self.order))
        self.buffer = np.array([self._next_doc() for _ in range(size)], dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        if self.given_order is not None:
            return self.given_order
        return np.random.default_rng([self.seed, epoch]).permutation(self.corpus.num_documents)

    def _next_doc(self) -> int | None:
        if self.cursor == len(self.order):
            if self.given_order is not None:
                return None  # each document of a given order once
            self.epoch += 1
            self.order = self._order(self.epoch)
            self.cursor = 0
        doc = int(self.order[self.cursor])
        self.cursor += 1
        return doc

    def next_rows(self, sources: np.ndarray | None = None) -> np.ndarray:
        """The next rows; `sources`, of the same shape, receives the document index of every token."""
        out = np.empty((self.rows, self.row_len), dtype=np.int64)
        for r in range(self.rows):
            pos = 0
            while pos < self.row_len and len(self.buffer):
                remaining = self.row_len - pos
                lengths = self.lengths[self.buffer]
                fits = np.where(lengths <= remaining, lengths, -1)
                slot = int(fits.argmax())
                if fits[slot] < 0:  # nothing fits whole: crop the shortest document
                    slot = int(lengths.argmin())
                take = min(int(lengths[slot]), remaining)
                doc = int(self.buffer[slot])
                out[r, pos:pos + take] = self.corpus.document(doc)[:take]
                if sources is not None:
                    sources[r, pos:pos + take] = doc
                pos += take
                doc = self._next_doc()
                if doc is None:
                    self.buffer = np.delete(self.buffer, slot)
                else:
                    self.buffer[slot] = doc
            if pos < self.row_len:  # a given order ran out
                out[r, pos:] = self.corpus.tokens[0]  # BOS: every document starts with it
                if sources is not None:
                    sources[r, pos:] = sources[r, pos - 1] if pos else -1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "buffer": self.buffer.tolist(), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = state["seed"]
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self.order = self._order(self.epoch)
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# The validation set

VALIDATION_SEED = 0  # the one selection every run scores on; another seed is another validation set
GOLDEN = (math.sqrt(5) - 1) / 2


def spread_order(documents: int, seed: int = VALIDATION_SEED) -> np.ndarray:
    """Every document index of a split, ordered so that each prefix is spread evenly over the split.

    Document i's key is frac(i * golden ratio + offset), the offset drawn from `seed`; sorted by key,
    the first n documents are those whose key is below some t, and by Slater's three-gap theorem
    their indices lie about 1/t apart, with at most three distinct gap sizes, over the whole split.
    So any number of documents is an even, stratified spread (a random prefix clusters, and can miss
    a quarter of the split when it is small), and a shorter prefix is a subset of a longer one."""
    offset = np.random.default_rng(seed).random()
    keys = np.mod(np.arange(documents, dtype=np.float64) * GOLDEN + offset, 1.0)
    return np.argsort(keys, kind="stable")


@dataclass(frozen=True)
class ValidationSet:
    """Rows to score and, for each target, the document it belongs to."""

    rows: torch.Tensor  # (N, seq_len + 1), each row starting at BOS
    target_docs: torch.Tensor  # (N, seq_len): for target rows[:, 1:], its position in `documents`
    documents: np.ndarray  # the split's indices of the documents scored, sorted
    split_documents: int  # documents in the whole split: the population the set is drawn from
    tokenizer: str  # the fingerprint of the tokenizer that made the rows

    @classmethod
    def of(cls, rows: np.ndarray, targets: np.ndarray, split_documents: int, tokenizer: str) -> "ValidationSet":
        """From rows and the split's index of the document of each of their targets (rows[:, 1:])."""
        documents, slots = np.unique(targets, return_inverse=True)
        slots = slots.reshape(len(rows), -1).astype(np.int32)  # half the memory of int64 for a full-size set
        return cls(torch.from_numpy(rows), torch.from_numpy(slots), documents, split_documents, tokenizer)

    def head(self, tokens: int) -> "ValidationSet":
        """The first rows holding `tokens` targets (at least one row): the same selection's first documents."""
        rows = max(1, -(-tokens // (self.rows.size(1) - 1)))
        targets = self.documents[self.target_docs[:rows].numpy()]
        return ValidationSet.of(self.rows[:rows].numpy(), targets, self.split_documents, self.tokenizer)

    def fingerprint(self) -> str:
        """What a val_bpb was scored on: the token ids, the document each target belongs to, the tokenizer.
        Equal for two runs exactly when they scored the same tokens of the same text the same way."""
        digest = xxhash.xxh3_64()
        digest.update(f"{tuple(self.rows.shape)} {self.tokenizer}".encode())
        for array in (self.rows.numpy(), self.documents[self.target_docs.numpy()]):
            digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
        return digest.hexdigest()


def validation_set(corpus: TokenCorpus, tokenizer: Tokenizer, seq_len: int, max_tokens: int,
                   documents: int | None = None, seed: int = VALIDATION_SEED) -> ValidationSet:
    """The fixed validation set: documents taken in `spread_order` (evenly across the whole split; the
    first `documents` of it when given), each once, into BOS-led rows of seq_len + 1 tokens until they
    hold `max_tokens` targets or the documents are used up.

    A document goes whole into the room its row has left, or is cropped to that room (its tail is not
    scored, so no byte is scored twice), and the next starts where it ends. Packed in this order, not
    best-fit as training rows are: best-fit would pick the longest documents of a read-ahead buffer
    first, so a small set (the checkpoint set) would be neither a prefix of the order nor spread, and
    would favour long documents. So the first rows of a set are the set of fewer tokens."""
    if corpus.num_tokens < seq_len + 1:
        raise DataError(f"the validation split has {corpus.num_tokens} tokens, fewer than one row of "
                        f"model.seq_len + 1 = {seq_len + 1}")
    want = max(1, -(-max_tokens // seq_len))
    order = spread_order(corpus.num_documents, seed)[:documents]
    loader = PackedLoader(corpus, seq_len, rows=1, order=order, buffer_size=1)
    rows, sources = [], []
    while len(rows) < want and len(loader.buffer):
        source = np.empty((1, seq_len + 1), dtype=np.int64)
        rows.append(loader.next_rows(source)[0])
        sources.append(source[0])
    return ValidationSet.of(np.stack(rows), np.stack(sources)[:, 1:], corpus.num_documents, tokenizer.fingerprint())
