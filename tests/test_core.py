import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from frontier.config import ModelConfig
from frontier.core import (
    CoreBundleError,
    Task,
    can_reuse_prefix,
    centered_accuracy,
    continuation_spans,
    core_score,
    evaluate_core,
    evaluate_task,
    fewshot_indices,
    item_correct,
    load_bundle,
    prepare_task,
    render_item,
    render_lm,
    render_mc,
    render_schema,
    score_sequences,
    score_with_prefix,
    shared_prefix,
    task_items,
    truncate_left,
)
from frontier.model import GPT

SHARED_CORE = Path(__file__).resolve().parents[2] / "shared/data/core"


# -----------------------------------------------------------------------------
# Stand-ins: a byte tokenizer and small causal models whose preferences are known

class ByteTokenizer:
    bos_id = 256
    vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


TOK = ByteTokenizer()
V = TOK.vocab_size


class BelieverLM(torch.nn.Module):
    """Puts nearly all probability on the next token of one fixed sequence, as long as the input
    has followed that sequence so far; uniform once it has left it."""

    def __init__(self, text: str):
        super().__init__()
        self.believed = [TOK.bos_id] + TOK.encode(text)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        logits = torch.zeros(B, T, V)
        for b in range(B):
            for t in range(T):
                if t >= len(self.believed) or idx[b, t].item() != self.believed[t]:
                    break
                if t + 1 < len(self.believed):
                    logits[b, t, self.believed[t + 1]] = 30.0
        return logits


class BigramLM(torch.nn.Module):
    """Next-token probabilities depend only on the current token: 0.9 on a favourite next
    character (per current character, default 'a'), the rest spread evenly."""

    def __init__(self, favourite: dict[str, str] | None = None, default: str = "a"):
        super().__init__()
        table = torch.full((V, V), math.log(0.1 / (V - 1)))
        for cur in range(V):
            nxt = ord((favourite or {}).get(chr(cur) if cur < 128 else "", default))
            table[cur, nxt] = math.log(0.9)
        self.table = table

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


class TinyCausalLM(torch.nn.Module):
    """Random but causal: each position sees the running mean of the embeddings so far."""

    def __init__(self, dim: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(V, dim)
        self.head = torch.nn.Linear(dim, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        running = x.cumsum(1) / torch.arange(1, idx.shape[1] + 1)[None, :, None]
        return self.head(torch.tanh(x + 3 * running))


def tiny_gpt(seq_len: int = 128) -> GPT:
    """A random GPT with windowed layers, value embeddings and GQA, so that prefix reuse meets every knob."""
    torch.manual_seed(0)
    cfg = ModelConfig(depth=2, d_model=32, n_head=4, n_kv_head=2, seq_len=seq_len, window_pattern="SL",
                      short_window=0.125, value_embed_layers=[0], layer_scalars=True, head_std=1.0,
                      zero_init_proj=False)
    return GPT(cfg, vocab_size=V).eval()


def make_task(task_type: str, rows: list[dict], shots: int = 0, delimiter: str = " ") -> Task:
    return Task("t", task_type, shots, delimiter, 0.0, Path("t.jsonl"), rows)


# -----------------------------------------------------------------------------
# Prompt rendering

def test_render_multiple_choice():
    item = {"query": "Q: 1+1?", "choices": ["2", "3"], "gold": 0}
    assert render_mc(item, "\nAnswer: ", []) == ["Q: 1+1?\nAnswer: 2", "Q: 1+1?\nAnswer: 3"]
    shots = [{"query": "Q: a?", "choices": ["x", "y"], "gold": 1},
             {"query": "Q: b?", "choices": ["z"], "gold": 0}]
    assert render_mc(item, " ", shots) == [
        "Q: a? y\n\nQ: b? z\n\nQ: 1+1? 2",
        "Q: a? y\n\nQ: b? z\n\nQ: 1+1? 3",
    ]


def test_render_schema():
    item = {"context_options": ["Tom thanked Ann because Tom", "Tom thanked Ann because Ann"],
            "continuation": "helped him.", "gold": 1}
    assert render_schema(item, " ", []) == ["Tom thanked Ann because Tom helped him.",
                                            "Tom thanked Ann because Ann helped him."]
    shots = [{"context_options": ["A did it", "B did it"], "continuation": "again.", "gold": 1}]
    assert render_schema(item, " ", shots) == ["B did it again.\n\nTom thanked Ann because Tom helped him.",
                                               "B did it again.\n\nTom thanked Ann because Ann helped him."]


def test_render_language_modeling():
    # contexts are trimmed; the prompt without the continuation loses the delimiter's trailing space
    item = {"context": "  The capital of France is ", "continuation": "Paris"}
    assert render_lm(item, " ", []) == ["The capital of France is", "The capital of France is Paris"]
    shots = [{"context": "2+2 =\n", "continuation": "4"}, {"context": "Sky colour:", "continuation": "blue"}]
    assert render_lm(item, "\nAnswer: ", shots) == [
        "2+2 =\nAnswer: 4\n\nSky colour:\nAnswer: blue\n\nThe capital of France is\nAnswer:",
        "2+2 =\nAnswer: 4\n\nSky colour:\nAnswer: blue\n\nThe capital of France is\nAnswer: Paris",
    ]


def test_render_item_draws_fewshot_from_other_items():
    rows = [{"context": f"c{i}", "continuation": f"x{i}"} for i in range(5)]
    task = make_task("language_modeling", rows, shots=2)
    expected_idx = random.Random(1234 + 3).sample([0, 1, 2, 4], 2)
    shots = "".join(f"c{j} x{j}\n\n" for j in expected_idx)
    assert render_item(task, rows, 3) == [f"{shots}c3", f"{shots}c3 x3"]


def test_fewshot_indices_match_plain_sample():
    # the same indices as sampling the explicit list without the item, on both sides of
    # random.sample's small/large population switch
    for n, k in [(2, 1), (5, 3), (11, 10), (30, 10), (200, 10), (1000, 3)]:
        for idx in [0, 1, n // 2, n - 1]:
            plain = random.Random(1234 + idx).sample([i for i in range(n) if i != idx], k)
            assert fewshot_indices(n, idx, k) == plain
    assert fewshot_indices(1, 0, 10) == []
    assert sorted(fewshot_indices(3, 1, 10)) == [0, 2]  # capped at the other items


def test_task_items_shuffle_then_cut():
    rows = [{"i": i} for i in range(50)]
    shuffled = list(rows)
    random.Random(1337).shuffle(shuffled)
    assert task_items(rows, None) == shuffled
    assert task_items(rows, -1) == shuffled
    assert task_items(rows, 7) == shuffled[:7]
    assert rows == [{"i": i} for i in range(50)]  # the bundle's rows are not reordered


# -----------------------------------------------------------------------------
# Token spans and truncation

def test_continuation_spans():
    # multiple choice: scoring starts where the options first differ
    tokens, starts, ends = continuation_spans("multiple_choice", [[9, 1, 2, 3], [9, 1, 2, 4, 5]])
    assert (starts, ends) == ([3, 3], [4, 5])
    # schema: the common suffix is scored (here it reaches one token into the contexts)
    tokens, starts, ends = continuation_spans("schema", [[9, 1, 7, 5, 6], [9, 2, 2, 7, 5, 6]])
    assert (starts, ends) == ([2, 3], [5, 6])
    # language modeling: only the prompt with the continuation, scored after the prompt without
    tokens, starts, ends = continuation_spans("language_modeling", [[9, 1, 2], [9, 1, 2, 3, 4]])
    assert (tokens, starts, ends) == ([[9, 1, 2, 3, 4]], [3], [5])


def test_truncate_left_keeps_the_end():
    tokens, starts, ends = truncate_left([[9, 1, 2, 3, 4, 5], [9, 1, 2]], [4, 1], [6, 3], max_seq_len=4)
    assert tokens == [[2, 3, 4, 5], [9, 1, 2]]
    assert (starts, ends) == ([2, 1], [4, 3])


def test_prepare_task_bos_and_truncation():
    rows = [{"context": "abcdefgh", "continuation": "xyz"}]
    (item,) = prepare_task(make_task("language_modeling", rows), rows, TOK, max_seq_len=64)
    assert item.tokens == [[TOK.bos_id] + TOK.encode("abcdefgh xyz")]
    assert (item.starts, item.ends) == ([9], [13])  # the delimiter space is part of the continuation
    (item,) = prepare_task(make_task("language_modeling", rows), rows, TOK, max_seq_len=6)
    assert item.tokens == [TOK.encode("gh xyz")]
    assert (item.starts, item.ends) == ([2], [6])


# -----------------------------------------------------------------------------
# Scoring with models whose preferences are known

def test_multiple_choice_follows_the_believed_text():
    rows = [{"query": "Which?", "choices": ["red", "blue", "green"], "gold": 1}]
    task = make_task("multiple_choice", rows)
    assert evaluate_task(BelieverLM("Which? blue"), TOK, task, max_seq_len=64) == (1.0, 1)
    assert evaluate_task(BelieverLM("Which? green"), TOK, task, max_seq_len=64) == (0.0, 1)


def test_multiple_choice_uses_mean_not_sum():
    # the model likes 'a': the long choice has the lower mean loss but the higher total
    rows = [{"query": "q", "choices": ["b", "aaaaaaab"], "gold": 1}]
    task = make_task("multiple_choice", rows)
    (item,) = prepare_task(task, rows, TOK, max_seq_len=64)
    mean_loss, _ = score_sequences(BigramLM(), item.tokens, item.starts, item.ends, pad_id=TOK.bos_id)
    lo, hi = -math.log(0.9), -math.log(0.1 / (V - 1))
    assert mean_loss == pytest.approx([hi, (7 * lo + hi) / 8], rel=1e-5)
    assert hi < 7 * lo + hi  # a sum would pick "b"
    assert evaluate_task(BigramLM(), TOK, task, max_seq_len=64) == (1.0, 1)


def test_schema_compares_the_contexts():
    # after 'q' the model expects a space, so the context ending in 'q' makes the shared
    # continuation " zz" more likely
    model = BigramLM({"q": " "}, default="k")
    rows = [{"context_options": ["pq", "pr"], "continuation": "zz", "gold": 0},
            {"context_options": ["pq", "pr"], "continuation": "zz", "gold": 1}]
    task = make_task("schema", rows)
    prepared = prepare_task(task, rows, TOK, max_seq_len=64)
    assert prepared[0].starts == [3, 3] and prepared[0].ends == [6, 6]  # " zz" after BOS p q|r
    assert evaluate_task(model, TOK, task, max_seq_len=64) == (0.5, 2)


def test_language_modeling_needs_every_token():
    rows = [{"context": "2+2=", "continuation": "44"}]
    task = make_task("language_modeling", rows)
    assert evaluate_task(BelieverLM("2+2= 44"), TOK, task, max_seq_len=64) == (1.0, 1)
    assert evaluate_task(BelieverLM("2+2= 44 and more"), TOK, task, max_seq_len=64) == (1.0, 1)
    assert evaluate_task(BelieverLM("2+2= 45"), TOK, task, max_seq_len=64) == (0.0, 1)  # last token wrong
    assert evaluate_task(BelieverLM("2+2=44"), TOK, task, max_seq_len=64) == (0.0, 1)  # delimiter is scored


def test_ties_go_to_the_first_option():
    item = prepare_task(make_task("multiple_choice", [{"query": "q", "choices": ["a", "b"], "gold": 0}]),
                        [{"query": "q", "choices": ["a", "b"], "gold": 0}], TOK, 64)[0]
    assert item_correct("multiple_choice", item, [1.0, 1.0], [True, True])


def reference_item(model, tokenizer, task_type: str, prompts: list[str], gold: int, max_seq_len: int) -> bool:
    """One item, scored the plain way: unbatched, full cross-entropy at every position."""
    tokens = [[tokenizer.bos_id] + tokenizer.encode(p) for p in prompts]
    tokens, starts, ends = continuation_spans(task_type, tokens)
    tokens, starts, ends = truncate_left(tokens, starts, ends, max_seq_len)
    width = max(len(t) for t in tokens)
    ids = torch.tensor([t + [tokenizer.bos_id] * (width - len(t)) for t in tokens])
    with torch.no_grad():
        logits = model(ids)
    losses = F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    losses = losses.view(len(tokens), width - 1)
    predictions = logits.argmax(-1)
    if task_type == "language_modeling":
        s, e = starts[0], ends[0]
        return bool(torch.all(predictions[0, s - 1:e - 1] == ids[0, s:e]))
    means = [losses[i, s - 1:e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
    return means.index(min(means)) == gold


def test_batched_scoring_matches_per_item_reference():
    rng = random.Random(0)
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
    mc = [{"query": f"Q{i}: " + " ".join(rng.choices(words, k=rng.randint(1, 12))),
           "choices": [" ".join(rng.choices(words, k=rng.randint(1, 4))) for _ in range(rng.randint(2, 5))],
           "gold": 0} for i in range(12)]
    for row in mc:
        row["gold"] = rng.randrange(len(row["choices"]))
    schema = [{"context_options": [" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(2)],
               "continuation": " ".join(rng.choices(words, k=3)), "gold": rng.randrange(2)} for _ in range(12)]
    lm = [{"context": " ".join(rng.choices(words, k=rng.randint(1, 10))), "continuation": rng.choice(words)}
          for _ in range(12)]
    model = TinyCausalLM()
    for task_type, rows, shots in [("multiple_choice", mc, 3), ("schema", schema, 0), ("language_modeling", lm, 2)]:
        task = make_task(task_type, rows, shots=shots)
        items = task_items(rows, None)
        for max_seq_len in (48, 512):  # with and without left truncation
            prepared = prepare_task(task, items, TOK, max_seq_len)
            tokens = [t for p in prepared for t in p.tokens]
            starts = [s for p in prepared for s in p.starts]
            ends = [e for p in prepared for e in p.ends]
            mean_loss, all_right = score_sequences(model, tokens, starts, ends, pad_id=TOK.bos_id,
                                                   batch_size=5, max_seq_len=max_seq_len)
            pos = 0
            for idx, p in enumerate(prepared):
                n = len(p.tokens)
                got = item_correct(task_type, p, mean_loss[pos:pos + n], all_right[pos:pos + n])
                want = reference_item(model, TOK, task_type, render_item(task, items, idx),
                                      p.gold, max_seq_len)
                assert got == want, (task_type, idx, max_seq_len)
                pos += n


def test_prefix_reuse_scores_like_full_sequences():
    rng = random.Random(1)
    words = ["red", "green", "blue", "cat", "dog", "sun", "moon", "tree"]
    rows = [{"query": "Q: " + " ".join(rng.choices(words, k=rng.randint(3, 8))),
             "choices": [" ".join(rng.choices(words, k=rng.randint(1, 3))) for _ in range(4)], "gold": 0}
            for _ in range(6)]
    rows.append({"query": "Q: sun", "choices": ["moon", "moon tree"], "gold": 0})  # an empty span: nan
    task = make_task("multiple_choice", rows, shots=2)
    model = tiny_gpt(seq_len=512)
    for max_seq_len in (512, 60):  # at 60 some items are truncated and keep the full path
        prepared = prepare_task(task, task_items(rows), TOK, max_seq_len)
        reused = 0
        for p in prepared:
            prefix_len = shared_prefix(p)
            if prefix_len == 0:
                continue
            reused += 1
            assert prefix_len == p.starts[0] - 1
            got_loss, got_right = score_with_prefix(model, p, prefix_len, pad_id=TOK.bos_id)
            want_loss, want_right = score_sequences(model, p.tokens, p.starts, p.ends, pad_id=TOK.bos_id)
            assert got_loss == pytest.approx(want_loss, abs=1e-4, nan_ok=True)
            assert got_right == want_right
        assert reused == len(prepared) if max_seq_len == 512 else reused < len(prepared)
        assert (evaluate_task(model, TOK, task, max_seq_len=max_seq_len)
                == evaluate_task(model, TOK, task, max_seq_len=max_seq_len, reuse_prefix=False))


def test_prefix_reuse_needs_a_shared_untruncated_prefix():
    item = prepare_task(make_task("multiple_choice", []), [{"query": "ab", "choices": ["c", "dd"], "gold": 0}],
                        TOK, 64)[0]
    assert shared_prefix(item) == 3  # BOS a b, then the space that starts each suffix
    truncated = truncate_left(item.tokens, item.starts, item.ends, max_seq_len=4)
    assert shared_prefix(type(item)(*truncated, gold=0)) == 0  # cropped differently: no common prefix
    assert shared_prefix(type(item)([[TOK.bos_id, 1], [TOK.bos_id, 2]], [1, 1], [2, 2], 0)) == 0
    # only a GPT on the reference attention computes suffixes against a cached prefix
    gpt = tiny_gpt()
    assert can_reuse_prefix(gpt) and not can_reuse_prefix(TinyCausalLM())
    gpt.ops.backends = {**gpt.ops.backends, "attention": "triton"}
    assert not can_reuse_prefix(gpt)


# -----------------------------------------------------------------------------
# Centering and the CORE mean

def test_centered_accuracy_and_core_score():
    assert centered_accuracy(0.5, 25) == pytest.approx(1 / 3)
    assert centered_accuracy(0.25, 25) == pytest.approx(0.0)
    assert centered_accuracy(1.0, 62) == pytest.approx(1.0)
    assert centered_accuracy(0.3, 0) == pytest.approx(0.3)
    assert core_score({"a": 1 / 3, "b": 0.0, "c": 0.5}) == pytest.approx(5 / 18)
    assert math.isnan(core_score({}))


# -----------------------------------------------------------------------------
# Bundles on disk

def write_bundle(root: Path, tasks: list[dict], baselines: dict[str, float], files: dict[str, str]) -> Path:
    lines = ["icl_tasks:"]
    for t in tasks:
        lines.append("-")
        for key, value in t.items():
            lines.append(f"  {key}: {value}")
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    csv_lines = ["Eval Task,Task Category,Random baseline"] + [f"{k},x,{v}" for k, v in baselines.items()]
    (root / "eval_meta_data.csv").write_text("\n".join(csv_lines) + "\n")
    for rel, text in files.items():
        path = root / "eval_data" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_evaluate_core_on_a_small_bundle_with_a_missing_task(tmp_path):
    # the model expects a space after 'x' and 'a' after everything else
    mc_rows = ['{"query": "x", "choices": ["aaa", "bbb"], "gold": 0}',
               '{"query": "x", "choices": ["bbb", "aaa"], "gold": 1}',
               '{"query": "x", "choices": ["bbb", "aaa"], "gold": 0}']
    lm_rows = ['{"context": "x", "continuation": "aaa"}', '{"context": "x", "continuation": "ab"}']
    bundle = write_bundle(
        tmp_path,
        tasks=[dict(label="mc", dataset_uri="a/mc.jsonl", num_fewshot="[0]", icl_task_type="multiple_choice"),
               dict(label="gone", dataset_uri="a/gone.jsonl", num_fewshot="[0]", icl_task_type="schema"),
               dict(label="lm", dataset_uri="b/lm.jsonl", num_fewshot="[0]", icl_task_type="language_modeling")],
        baselines={"mc": 50, "gone": 50, "lm": 0},
        files={"a/mc.jsonl": "\n".join(mc_rows) + "\n", "b/lm.jsonl": "\n".join(lm_rows) + "\n"},
    )
    tasks = load_bundle(bundle)
    assert [t.label for t in tasks] == ["mc", "gone", "lm"]
    assert [t.missing for t in tasks] == [False, True, False]
    model = BigramLM({"x": " "})
    model.train()
    result = evaluate_core(model, TOK, bundle, max_seq_len=64, batch_size=3)
    assert model.training  # mode restored
    assert result.accuracy == pytest.approx({"mc": 2 / 3, "lm": 0.5})
    assert result.centered == pytest.approx({"mc": 1 / 3, "lm": 0.5})
    assert result.n_items == {"mc": 3, "lm": 2}
    assert result.missing == ["gone"]
    assert (result.n_tasks, result.n_total) == (2, 3)
    assert result.core == pytest.approx(5 / 12)
    assert result.items_per_second > 0
    assert result.describe() == "CORE 0.4167 over 2 of 3 tasks (missing: gone)"
    # a GPT scores the same with and without computing the shared prefix once
    gpt = tiny_gpt(seq_len=64)
    reused = evaluate_core(gpt, TOK, bundle, max_seq_len=64, batch_size=3)
    full = evaluate_core(gpt, TOK, bundle, max_seq_len=64, batch_size=3, reuse_prefix=False)
    assert reused.accuracy == full.accuracy
    # max_per_task takes the first items after the fixed shuffle
    small = evaluate_core(model, TOK, bundle, max_per_task=1, max_seq_len=64)
    assert small.n_items == {"mc": 1, "lm": 1}


def test_bundle_without_core_yaml(tmp_path):
    with pytest.raises(CoreBundleError, match="core.yaml not found"):
        load_bundle(tmp_path)


def test_malformed_rows_name_file_and_line(tmp_path):
    task = dict(label="mc", dataset_uri="mc.jsonl", num_fewshot="[0]", icl_task_type="multiple_choice")
    good = '{"query": "q", "choices": ["a", "b"], "gold": 0}'
    write_bundle(tmp_path, [task], {"mc": 50}, {"mc.jsonl": f"{good}\n{{not json\n"})
    with pytest.raises(CoreBundleError, match=r"mc\.jsonl:2 is not valid JSON"):
        load_bundle(tmp_path)
    write_bundle(tmp_path, [task], {"mc": 50}, {"mc.jsonl": f'{good}\n{good}\n{{"query": "q", "gold": 0}}\n'})
    with pytest.raises(CoreBundleError, match=r"mc\.jsonl:3 lacks choices"):
        load_bundle(tmp_path)
    write_bundle(tmp_path, [task], {"mc": 50}, {"mc.jsonl": '{"query": "q", "choices": ["a"], "gold": 4}\n'})
    with pytest.raises(CoreBundleError, match=r"mc\.jsonl:1 has gold 4"):
        load_bundle(tmp_path)


def test_unknown_task_type_names_the_line(tmp_path):
    tasks = [dict(label="ok", dataset_uri="ok.jsonl", num_fewshot="[0]", icl_task_type="schema"),
             dict(label="odd", dataset_uri="odd.jsonl", num_fewshot="[0]", icl_task_type="ranking")]
    write_bundle(tmp_path, tasks, {"ok": 50, "odd": 0}, {})
    # line 1 "icl_tasks:", then 5 lines per task; icl_task_type is the 5th line of the second
    with pytest.raises(CoreBundleError, match=r"core\.yaml:11 .*unknown icl_task_type 'ranking'"):
        load_bundle(tmp_path)


def test_task_without_baseline(tmp_path):
    task = dict(label="mc", dataset_uri="mc.jsonl", num_fewshot="[0]", icl_task_type="multiple_choice")
    write_bundle(tmp_path, [task], {"other": 50}, {})
    with pytest.raises(CoreBundleError, match="no Random baseline for task 'mc'"):
        load_bundle(tmp_path)


# -----------------------------------------------------------------------------
# The real bundle

def shared_bundle() -> Path:
    if not (SHARED_CORE / "core.yaml").is_file():
        reason = f"CORE bundle not found at {SHARED_CORE}"
        print(reason)
        pytest.skip(reason)
    return SHARED_CORE


def test_real_bundle_loads_22_tasks_with_4_missing():
    tasks = load_bundle(shared_bundle())
    assert len(tasks) == 22
    assert [t.label for t in tasks if t.missing] == ["hellaswag_zeroshot", "hellaswag", "squad", "coqa"]
    by_label = {t.label: t for t in tasks}
    assert by_label["jeopardy"].continuation_delimiter == "\nAnswer: "
    assert by_label["copa"].continuation_delimiter == " "
    assert by_label["agi_eval_lsat_ar"].num_fewshot == 3
    assert by_label["bigbench_language_identification"].random_baseline == 9.1
    assert len(by_label["winograd"].rows) == 273


def test_real_bundle_end_to_end_with_a_tiny_model():
    result = evaluate_core(TinyCausalLM(), TOK, shared_bundle(), max_per_task=2, max_seq_len=256, batch_size=8)
    assert (result.n_tasks, result.n_total) == (18, 22)
    assert result.missing == ["hellaswag_zeroshot", "hellaswag", "squad", "coqa"]
    assert set(result.n_items.values()) == {2}
    assert all(0.0 <= a <= 1.0 for a in result.accuracy.values())
    assert math.isfinite(result.core)
    assert result.core == pytest.approx(sum(result.centered.values()) / 18)
    assert result.describe().startswith("CORE ") and "over 18 of 22 tasks" in result.describe()


def test_real_bundle_prefix_reuse_changes_no_accuracy():
    # at 256 bytes about half the multiple-choice items fit untruncated and reuse their prefix
    model, bundle = tiny_gpt(seq_len=256), shared_bundle()
    reused = evaluate_core(model, TOK, bundle, max_per_task=2, max_seq_len=256, batch_size=8)
    full = evaluate_core(model, TOK, bundle, max_per_task=2, max_seq_len=256, batch_size=8, reuse_prefix=False)
    assert reused.accuracy == full.accuracy
