import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from frontier import data as data_module
from frontier.config import DataConfig
from frontier.data import (DataError, PackedLoader, load_corpus, load_tokenizer, resolve_splits, spread_order,
                           validation_set)
from tests.conftest import FAST, ROOT, run_cli


def words_of(shard, docs, words=40):
    rng = np.random.default_rng(shard)
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [" ".join(rng.choice(vocab, size=rng.integers(3, words))) + f" doc{shard}.{i}" for i in range(docs)]


def write_text_shards(folder, suffix, shards=3, docs=40, empty=()):
    """`shards` .txt or .jsonl files; those whose index is in `empty` hold nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        texts = [] if s in empty else words_of(s, docs)
        body = "\n\n".join(texts) if suffix == ".txt" else "".join(json.dumps({"text": t}) + "\n" for t in texts)
        (folder / f"shard_{s:05d}{suffix}").write_text(body)
    return folder


def write_shards(folder, docs_per_shard, shards=3, words=40):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    vocab = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for s in range(shards):
        docs = [" ".join(rng.choice(vocab, size=rng.integers(3, words))) + f" doc{s}.{i}"
                for i in range(docs_per_shard)]
        pq.write_table(pa.table({"text": docs}), folder / f"shard_{s:05d}.parquet")
    return folder


def config(tmp_path, path, **kw):
    return DataConfig(path=str(path), vocab_size=300, tokenizer_train_chars=100_000,
                      cache_dir=str(tmp_path / "cache"), **kw)


def corpus_of(tmp_path, folder):
    cfg = config(tmp_path, folder)
    train, val = resolve_splits(cfg)
    tokenizer = load_tokenizer(cfg, train)
    return cfg, train, val, tokenizer, load_corpus(train, tokenizer, cfg, "train")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".txt"])
def test_reading_local_files_never_reaches_for_the_network(tmp_path, monkeypatch, suffix):
    """`datasets` sent a request per file it opened (the hub's download count): seconds of DNS timeouts
    per cache build on a machine without a network."""
    import socket
    import threading

    asked, reader = [], threading.get_ident()  # only this thread's lookups: not another library's thread

    def no_network(host, *args, **kwargs):
        if threading.get_ident() == reader:
            asked.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    folder = write_shards(tmp_path / "s", 5) if suffix == ".parquet" else write_text_shards(tmp_path / "s", suffix)
    train, val = resolve_splits(config(tmp_path, folder))
    assert sum(len(docs) for split in (train, val) for docs in data_module.iter_documents(split, "text")) > 0
    assert asked == []


def test_last_shard_is_validation_and_never_trained_on(tmp_path):
    folder = write_shards(tmp_path / "shards", 50)
    train, val = resolve_splits(config(tmp_path, folder))
    assert [f.name for f in train.files] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert [f.name for f in val.files] == ["shard_00002.parquet"]


def test_loader_is_deterministic_and_every_row_starts_with_bos(tmp_path):
    cfg, train, val, tokenizer, corpus = corpus_of(tmp_path, write_shards(tmp_path / "s", 200))
    first = PackedLoader(corpus, seq_len=32, rows=8, seed=7)
    second = PackedLoader(corpus, seq_len=32, rows=8, seed=7)
    other = PackedLoader(corpus, seq_len=32, rows=8, seed=8)
    a = np.concatenate([first.next_rows() for _ in range(5)])
    b = np.concatenate([second.next_rows() for _ in range(5)])
    assert np.array_equal(a, b)
    assert not np.array_equal(a, np.concatenate([other.next_rows() for _ in range(5)]))
    assert a.shape == (40, 33) and np.all(a[:, 0] == tokenizer.bos_id)


def test_loader_state_resumes_the_same_rows(tmp_path):
    *_, corpus = corpus_of(tmp_path, write_shards(tmp_path / "s", 100))
    loader = PackedLoader(corpus, seq_len=16, rows=4, seed=1)
    loader.next_rows()
    state = loader.state_dict()
    expected = [loader.next_rows() for _ in range(30)]  # crosses an epoch boundary
    resumed = PackedLoader(corpus, seq_len=16, rows=4, seed=1)
    resumed.load_state_dict(state)
    assert all(np.array_equal(e, resumed.next_rows()) for e in expected)


def val_corpus_of(tmp_path, docs=60, words=40):
    cfg, train, val, tokenizer, _ = corpus_of(tmp_path, write_shards(tmp_path / "s", docs, words=words))
    return tokenizer, load_corpus(val, tokenizer, cfg, "val")


def test_validation_rows_come_from_the_held_out_shard_without_repeats(tmp_path):
    tokenizer, val_corpus = val_corpus_of(tmp_path)
    vset = validation_set(val_corpus, tokenizer, seq_len=16, max_tokens=10**9)
    text = tokenizer.decode([t for t in vset.rows.flatten().tolist() if t != tokenizer.bos_id])
    assert "doc2." in text and "doc0." not in text and "doc1." not in text
    assert vset.rows.numel() <= val_corpus.num_tokens + vset.rows.size(1)  # at most the last row is padded


def scored_tokens(vset, doc: int) -> list[int]:
    """The tokens of `doc` among the targets of the set, in order."""
    targets = vset.rows[:, 1:].numpy()
    return targets[vset.documents[vset.target_docs.numpy()] == doc].tolist()


def test_a_validation_set_larger_than_the_split_scores_every_document_once_whole_or_cropped(tmp_path):
    """Every target belongs to one document; each document's targets are its own tokens from its start, once:
    whole, or cropped where its row ends (its tail is not scored)."""
    tokenizer, corpus = val_corpus_of(tmp_path, docs=80)
    vset = validation_set(corpus, tokenizer, seq_len=24, max_tokens=10**9)
    assert vset.documents.tolist() == list(range(corpus.num_documents))  # the whole split, each document once
    owners = vset.documents[vset.target_docs.numpy()]
    whole = 0
    for doc in range(corpus.num_documents):
        real = [t for t in scored_tokens(vset, doc) if t != tokenizer.bos_id]
        own = corpus.document(doc).tolist()
        assert real == own[1:len(real) + 1]  # its opening, in order, once
        if len(real) == len(own) - 1:
            whole += 1
        else:  # cropped: it is the last document of the one row that holds it
            rows = np.nonzero((owners == doc).any(axis=1))[0]
            assert len(rows) == 1 and owners[rows[0], -1] == doc
    assert 0 < whole < corpus.num_documents  # both cases were checked
    assert (vset.rows[:, 0] == tokenizer.bos_id).all()


def test_validation_documents_are_spread_across_the_whole_split(tmp_path):
    tokenizer, corpus = val_corpus_of(tmp_path, docs=400, words=8)
    n = corpus.num_documents
    for tokens in (256, 1024, 4096):
        docs = validation_set(corpus, tokenizer, seq_len=16, max_tokens=tokens).documents
        assert docs.min() < n / 4 and docs.max() >= 3 * n / 4, (tokens, docs)
        quarters = np.bincount(docs * 4 // n, minlength=4)
        assert quarters.max() <= 2 * quarters.min() + 2, quarters  # even, not merely touching both ends
    order = spread_order(1000)
    assert sorted(order.tolist()) == list(range(1000))
    assert np.diff(np.sort(order[:50])).max() <= 3 * 1000 / 50  # any prefix: gaps of about n / prefix


def test_the_checkpoint_set_is_the_final_sets_first_rows_and_a_subset_of_its_documents(tmp_path):
    tokenizer, corpus = val_corpus_of(tmp_path, docs=400, words=8)
    final = validation_set(corpus, tokenizer, seq_len=16, max_tokens=2048)
    checkpoint = final.head(256)
    assert checkpoint.rows.size(0) == 16 and torch.equal(checkpoint.rows, final.rows[:16])
    assert set(checkpoint.documents) < set(final.documents)
    assert torch.equal(validation_set(corpus, tokenizer, seq_len=16, max_tokens=256).rows, checkpoint.rows)
    n = corpus.num_documents
    assert checkpoint.documents.min() < n / 4 and checkpoint.documents.max() >= 3 * n / 4  # spread as well


def test_the_validation_set_and_its_fingerprint_are_the_same_in_another_process(tmp_path):
    tokenizer, corpus = val_corpus_of(tmp_path)
    vset = validation_set(corpus, tokenizer, seq_len=16, max_tokens=512)
    code = ("import sys; from tests.test_data import val_corpus_of; from frontier.data import validation_set; "
            "from pathlib import Path; t, c = val_corpus_of(Path(sys.argv[1])); "
            "v = validation_set(c, t, seq_len=16, max_tokens=512); print(v.fingerprint(), v.rows.sum().item())")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [vset.fingerprint(), str(vset.rows.sum().item())]


def test_the_fingerprint_changes_with_seq_len_tokenizer_and_selection_and_nothing_else(tmp_path):
    tokenizer, corpus = val_corpus_of(tmp_path)
    fingerprint = validation_set(corpus, tokenizer, seq_len=16, max_tokens=512).fingerprint()
    assert validation_set(corpus, tokenizer, seq_len=16, max_tokens=512).fingerprint() == fingerprint
    assert validation_set(corpus, tokenizer, seq_len=16, max_tokens=500).fingerprint() == fingerprint  # same rows
    others = [validation_set(corpus, tokenizer, seq_len=32, max_tokens=512),
              validation_set(corpus, tokenizer, seq_len=16, max_tokens=1024),
              validation_set(corpus, tokenizer, seq_len=16, max_tokens=512, seed=1),
              validation_set(corpus, tokenizer, seq_len=16, max_tokens=512, documents=10)]
    cfg = config(tmp_path, tmp_path / "s")
    cfg.vocab_size = 320  # another tokenizer of the same data
    other_tokenizer = load_tokenizer(cfg, resolve_splits(cfg)[0])
    others.append(validation_set(load_corpus(resolve_splits(cfg)[1], other_tokenizer, cfg, "val"), other_tokenizer,
                                 seq_len=16, max_tokens=512))
    prints = [vset.fingerprint() for vset in others]
    assert fingerprint not in prints and len(set(prints)) == len(prints)


def test_a_number_of_documents_scores_exactly_those(tmp_path):
    tokenizer, corpus = val_corpus_of(tmp_path, docs=200, words=8)
    vset = validation_set(corpus, tokenizer, seq_len=16, max_tokens=corpus.num_tokens, documents=30)
    assert vset.documents.tolist() == sorted(spread_order(corpus.num_documents)[:30].tolist())


def test_second_load_reuses_the_caches(tmp_path, monkeypatch):
    folder = write_shards(tmp_path / "s", 50)
    corpus_of(tmp_path, folder)
    monkeypatch.setattr(data_module, "train_tokenizer", lambda *a: pytest.fail("tokenizer retrained"))
    monkeypatch.setattr(data_module, "_build_corpus", lambda *a: pytest.fail("corpus rebuilt"))
    *_, corpus = corpus_of(tmp_path, folder)
    assert corpus.num_documents == 100


def test_the_same_files_reached_by_a_link_or_a_relative_path_reuse_the_caches(tmp_path, monkeypatch):
    folder = write_shards(tmp_path / "s", 50)
    corpus_of(tmp_path, folder)
    (tmp_path / "link").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(data_module, "train_tokenizer", lambda *a: pytest.fail("tokenizer retrained"))
    monkeypatch.setattr(data_module, "_build_corpus", lambda *a: pytest.fail("corpus rebuilt"))
    for spelling in (tmp_path / "link", Path("s"), Path("link")):
        *_, corpus = corpus_of(tmp_path, spelling)
        assert corpus.num_documents == 100
    assert len(list((tmp_path / "cache" / "tokens").glob("train-*/"))) == 1


def test_a_text_file_is_split_by_documents(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text("\n\n".join(f"Paragraph number {i} of the book." for i in range(100)))
    cfg = config(tmp_path, path, val_fraction=0.2)
    train, val = resolve_splits(cfg)
    tokenizer = load_tokenizer(cfg, train)
    assert load_corpus(train, tokenizer, cfg, "train").num_documents == 80
    assert load_corpus(val, tokenizer, cfg, "val").num_documents == 20


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "holds no"),
    (lambda d: write_shards(d, 5, shards=1), "single parquet shard"),
])
def test_unusable_paths_are_clear_errors(tmp_path, setup, message):
    folder = tmp_path / "data"
    setup(folder)
    with pytest.raises(DataError, match=message):
        resolve_splits(config(tmp_path, folder))


def test_a_shard_without_a_text_column_names_the_file(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for s in range(2):
        pq.write_table(pa.table({"body": ["some words here"] * 5}), folder / f"shard_{s:05d}.parquet")
    cfg = config(tmp_path, folder)
    train, _ = resolve_splits(cfg)
    with pytest.raises(DataError, match=r"shard_00000.parquet has no 'text' column \(columns: body\)"):
        load_tokenizer(cfg, train)


def test_hub_data_downloads_the_train_shards_and_the_last_as_validation(tmp_path, monkeypatch):
    import shutil

    import huggingface_hub

    served = write_shards(tmp_path / "hub", 10, shards=3)
    asked = []

    def fake_download(repo_id, filename, repo_type, local_dir):  # the hub, without a network
        asked.append((repo_id, filename, repo_type))
        source = served / ("shard_00002.parquet" if filename == "shard_06542.parquet" else filename)
        target = Path(local_dir) / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, target)
        return str(target)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    cfg = DataConfig(name="climbmix", source="hub", hub_repo="karpathy/climbmix-400b-shuffle",
                     hub_last_shard=6542, train_shards=2, cache_dir=str(tmp_path / "cache"))
    train, val = resolve_splits(cfg)
    assert [name for _, name, _ in asked] == ["shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"]
    assert {repo for repo, _, kind in asked} == {"karpathy/climbmix-400b-shuffle"} and asked[0][2] == "dataset"
    assert [f.name for f in val.files] == ["shard_06542.parquet"] and len(train.files) == 2
    asked.clear()
    resolve_splits(cfg)  # already on disk: nothing is fetched again
    assert asked == []


def test_a_failed_download_names_the_shard_and_the_repo(tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    cfg = DataConfig(name="fineweb_edu", source="hub", hub_repo="karpathy/fineweb-edu-100b-shuffle",
                     hub_last_shard=1822, train_shards=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match="could not download shard_00000.parquet of "
                                        "data.hub_repo='karpathy/fineweb-edu-100b-shuffle': network unreachable"):
        resolve_splits(cfg)


# ---------------------------------------------------------------------------------------------
# Faults in the data and its caches


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_an_empty_text_shard_is_skipped_and_counted_like_an_empty_parquet(tmp_path, suffix):
    folder = write_text_shards(tmp_path / "s", suffix, shards=4, empty=(1,))
    (folder / f"shard_00002{suffix}").write_text("\n\n  \n")  # only whitespace: empty as well
    cfg = config(tmp_path, folder)
    train, val = resolve_splits(cfg)
    corpus = load_corpus(train, load_tokenizer(cfg, train), cfg, "train")
    assert corpus.num_documents == 40
    assert corpus.meta["empty_files"] == [str(folder / f"shard_0000{i}{suffix}") for i in (1, 2)]


def test_invalid_utf8_names_the_file_the_byte_and_the_line(tmp_path):
    folder = write_text_shards(tmp_path / "s", ".jsonl")
    bad = folder / "shard_00001.jsonl"
    good = bad.read_bytes()
    bad.write_bytes(good + b'{"text": "caf\xe9"}\n')  # Latin-1, not UTF-8
    cfg = config(tmp_path, folder)
    train, _ = resolve_splits(cfg)
    message = f"cannot read {bad}: it is not valid UTF-8 \\(byte {len(good) + 13}, line 41, is 0xe9\\); re-encode"
    with pytest.raises(DataError, match=message):
        load_tokenizer(cfg, train)


def test_a_damaged_token_cache_of_the_same_size_is_rebuilt_with_a_warning(tmp_path, capsys):
    cfg, train, _, tokenizer, corpus = corpus_of(tmp_path, write_shards(tmp_path / "s", 50))
    expected = np.array(corpus.tokens)
    for name in ("tokens.bin", "offsets.npy"):
        damaged = corpus.directory / name
        before = damaged.stat()
        data = bytearray(damaged.read_bytes())
        data[-20:-10] = b"\xff" * 10
        damaged.write_bytes(bytes(data))
        os.utime(damaged, ns=(before.st_atime_ns, before.st_mtime_ns))  # same size, same time
        rebuilt = load_corpus(train, tokenizer, cfg, "train")
        assert f"token cache {corpus.directory} is damaged: {name} does not match its checksum; rebuilding it" \
            in capsys.readouterr().err
        assert np.array_equal(np.array(rebuilt.tokens), expected)


@pytest.mark.parametrize("damaged", ["null", "[]", '{"version": 2, "checksums": []}'])
def test_a_meta_json_that_is_json_but_no_cache_record_is_rebuilt_with_a_warning(tmp_path, capsys, damaged):
    # It was read: an AttributeError or TypeError traceback instead of a rebuild.
    cfg, train, _, tokenizer, corpus = corpus_of(tmp_path, write_shards(tmp_path / "s", 50))
    expected = np.array(corpus.tokens)
    (corpus.directory / "meta.json").write_text(damaged)
    rebuilt = load_corpus(train, tokenizer, cfg, "train")
    assert f"token cache {corpus.directory} is damaged: its meta.json is not a cache's record; rebuilding it" \
        in capsys.readouterr().err
    assert np.array_equal(np.array(rebuilt.tokens), expected)


def test_an_unwritable_cache_dir_is_one_sentence_naming_it(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    cfg = DataConfig(path=str(write_shards(tmp_path / "s", 5)), vocab_size=300, cache_dir=str(blocker))
    train, _ = resolve_splits(cfg)
    with pytest.raises(DataError, match=f"data.cache_dir='{blocker}' is not allowed: cannot write the data "
                                        "caches there \\(NotADirectoryError"):
        load_tokenizer(cfg, train)


def cli(tmp_path, data_path, *extra):
    return run_cli([*FAST, f"data.path={data_path}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300",
                    "precision=fp32", "budget.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}", *extra], timeout=300)


def last_line(result):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    return result.stderr.strip().splitlines()[-1]


def test_cli_invalid_utf8_is_one_sentence_naming_the_file(tmp_path):
    folder = write_text_shards(tmp_path / "s", ".jsonl")
    with open(folder / "shard_00000.jsonl", "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    assert last_line(cli(tmp_path, folder)).startswith(
        f"error: cannot read {folder / 'shard_00000.jsonl'}: it is not valid UTF-8")


def test_cli_a_cache_build_that_fails_leaves_no_half_written_cache(tmp_path):
    # The validation shard is read only when its cache is built, into a temporary folder that was left behind.
    folder = write_text_shards(tmp_path / "s", ".jsonl")
    with open(folder / "shard_00002.jsonl", "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    assert last_line(cli(tmp_path, folder)).startswith(
        f"error: cannot read {folder / 'shard_00002.jsonl'}: it is not valid UTF-8")
    left = sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir())
    assert [name for name in left if name.startswith("val-")] == [name for name in left if name.endswith(".lock")
                                                                  and name.startswith("val-")], left


# A test-only sitecustomize.py: Ctrl-C during the 2nd chunk of a token-cache build, landing (as a real one
# can, about one time in three there) inside a __del__, where Python prints the KeyboardInterrupt and goes on.
CTRL_C_IN_A_DEL = """
import importlib.abc, importlib.util, os, signal, sys

class Swallowing:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # the handler runs here
            pass

def hook(module):
    encode_batch, calls = module.Tokenizer.encode_batch, []
    def hooked(self, texts):
        calls.append(1)
        if len(calls) == 2:
            Swallowing()
        return encode_batch(self, texts)
    module.Tokenizer.encode_batch = hooked

class AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "frontier.tokenizer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (run(module), hook(module))
        return spec

sys.meta_path.insert(0, AfterImport())
"""


def test_cli_ctrl_c_that_python_swallows_in_a_cache_build_still_stops_the_run(tmp_path):
    # It went on: the run trained its whole budget, FINISHED, exit code 0.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(CTRL_C_IN_A_DEL)
    folder = write_text_shards(tmp_path / "s", ".txt", shards=4)
    done = run_cli([*FAST, f"data.path={folder}", f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=300",
                    "precision=fp32", "budget.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"], timeout=300,
                   env={"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(ROOT)])})
    # the interrupt was swallowed where it landed, and Python's "Exception ignored in" traceback is not shown
    assert "interrupted by SIGINT: stopping now" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["error"]) == ("KILLED", "interrupted by SIGINT")
    assert not any(p.name.startswith("train-") and not p.name.endswith(".lock")  # neither a cache nor a .tmp
                   for p in (tmp_path / "cache" / "tokens").iterdir())


@pytest.mark.parametrize("name", ["table.csv", "README"])
def test_cli_a_plain_file_as_data_path_names_it_and_the_formats(tmp_path, name):
    path = tmp_path / name
    path.write_text("a,b\n1,2\n")
    assert last_line(cli(tmp_path, path)) == (
        f"error: data.path='{path}' is not allowed: {path} is not a data file; point it at a .parquet, .jsonl, "
        ".json or .txt file, or a directory of them")


def fifo(path):
    os.mkfifo(path)
    return path


def looped(path):
    os.symlink(path.with_name("other"), path)
    os.symlink(path, path.with_name("other"))
    return path


@pytest.mark.parametrize("make, problem", [
    (fifo, "a FIFO, not a regular file"),
    (looped, "a symbolic link that cannot be followed (Too many levels of symbolic links)"),
])
def test_cli_a_data_path_that_is_no_file_nor_folder_is_one_sentence(tmp_path, make, problem):
    path = make(tmp_path / "data.txt")
    assert last_line(cli(tmp_path, path)) == (
        f"error: data.path='{path}' is not allowed: it is {problem}; point it at a .parquet, .jsonl, .json or "
        ".txt file, or a directory of them")


def test_cli_a_shard_whose_link_leads_nowhere_is_named_never_skipped(tmp_path):
    # Skipped, the last training shard silently became the validation split.
    folder = write_shards(tmp_path / "s", 5)
    last = folder / "shard_00002.parquet"
    last.unlink()
    last.symlink_to(tmp_path / "gone.parquet")
    assert last_line(cli(tmp_path, folder)) == (
        f"error: data.path='{folder}' is not allowed: {last} is a symbolic link that cannot be followed "
        "(No such file or directory); fix or remove it")


def test_cli_an_unwritable_cache_dir_is_one_sentence(tmp_path):
    folder = write_text_shards(tmp_path / "s", ".txt")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = last_line(cli(tmp_path, folder, f"data.cache_dir={blocker}"))
    assert line.startswith(f"error: data.cache_dir={blocker} is not allowed: it cannot be created (Not a directory)")


@pytest.mark.slow
def test_cli_skips_an_empty_shard_and_rebuilds_a_damaged_cache(tmp_path):
    folder = write_text_shards(tmp_path / "s", ".txt", shards=4, empty=(1,))
    first = cli(tmp_path, folder)
    assert first.returncode == 0, first.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data_empty_files"] == [str(folder / "shard_00001.txt")]
    [cache] = (tmp_path / "cache" / "tokens").glob("train-*[!k]")  # not the .lock file
    tokens = cache / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[100:120] = b"\xff" * 20  # token ids past the vocabulary: reading them would crash the model
    tokens.write_bytes(bytes(data))
    second = cli(tmp_path, folder, f"hydra.run.dir={tmp_path / 'again'}")
    assert second.returncode == 0, second.stderr
    assert f"warning: token cache {cache} is damaged: tokens.bin does not match its checksum" in second.stderr
    again = json.loads((tmp_path / "again" / "summary.json").read_text())
    assert again["data_train_tokens"] == summary["data_train_tokens"] and again["val_bpb"] == summary["val_bpb"]
