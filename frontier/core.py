"""CORE: the DCLM in-context-learning score (22 tasks), computed the way nanochat computes it.

Per task: shuffle the rows with a fixed seed (so `max_per_task` takes a reproducible subset), render
each item with few-shot examples sampled from the other items, tokenize with BOS in front, and score:
- multiple_choice / schema: the option with the lowest mean cross-entropy over its continuation wins;
- language_modeling: correct only if greedy argmax reproduces every continuation token.
Accuracy is centered on the task's random baseline and CORE is the mean over tasks.
"""
from __future__ import annotations

import csv
import functools
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import yaml

from frontier.config import ConfigError

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
REQUIRED_KEYS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}
SHUFFLE_SEED = 1337  # rows are shuffled once per task before taking the first max_per_task
FEWSHOT_SEED = 1234  # item idx draws its few-shot examples with random.Random(FEWSHOT_SEED + idx)
PAD_MULTIPLE = 64  # padded lengths are rounded up so compiled models see few distinct shapes


class CoreBundleError(ValueError):
    pass


@dataclass
class Task:
    label: str
    task_type: str
    num_fewshot: int
    continuation_delimiter: str
    random_baseline: float  # percent, as in eval_meta_data.csv
    path: Path
    rows: list[dict] | None  # None when the jsonl file is not in the bundle

    @property
    def missing(self) -> bool:
        return self.rows is None


# -----------------------------------------------------------------------------
# Loading the bundle

def _where(config_path: Path, root: yaml.Node | None, task_index: int, key: str) -> str:
    """`core.yaml:LINE` of `key` inside the task_index-th entry of icl_tasks, for error messages."""
    if isinstance(root, yaml.MappingNode):
        for k, v in root.value:
            if k.value == "icl_tasks" and isinstance(v, yaml.SequenceNode) and task_index < len(v.value):
                node = v.value[task_index]
                line = node.start_mark.line + 1
                for tk, tv in node.value if isinstance(node, yaml.MappingNode) else []:
                    if isinstance(tk, yaml.ScalarNode) and tk.value == key:
                        line = tv.start_mark.line + 1
                return f"{config_path}:{line}"
    return str(config_path)


def _read_baselines(path: Path) -> dict[str, tuple[float, int]]:
    """Each task's Random baseline (percent) and the line that gives it."""
    if not path.is_file():
        raise CoreBundleError(f"{path} not found; a CORE bundle needs it for the random baselines.")
    baselines = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or []):
                raise CoreBundleError(f"{path}:1 lacks the columns 'Eval Task' and 'Random baseline'.")
            for lineno, row in enumerate(reader, start=2):
                try:
                    baselines[row["Eval Task"]] = (float(row["Random baseline"]), lineno)
                except (TypeError, ValueError):
                    raise CoreBundleError(f"{path}:{lineno} has a Random baseline that is not a number: "
                                          f"{row['Random baseline']!r}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CoreBundleError(f"{path} cannot be read ({e}).") from None
    return baselines


def _check_row(row: object, task_type: str, path: Path, lineno: int) -> None:
    if not isinstance(row, dict):
        raise CoreBundleError(f"{path}:{lineno} is not a JSON object.")
    missing = [k for k in REQUIRED_KEYS[task_type] if k not in row]
    if missing:
        raise CoreBundleError(f"{path}:{lineno} lacks {', '.join(missing)} (a {task_type} row needs "
                              f"{', '.join(REQUIRED_KEYS[task_type])}).")
    if task_type in ("multiple_choice", "schema"):
        options = row["choices"] if task_type == "multiple_choice" else row["context_options"]
        gold = row["gold"]
        if not isinstance(options, list) or not options:
            raise CoreBundleError(f"{path}:{lineno} has no options to choose from.")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(options):
            raise CoreBundleError(f"{path}:{lineno} has gold {gold!r}, not an index into its "
                                  f"{len(options)} options.")


def _read_rows(path: Path, task_type: str) -> list[dict]:
    rows = []
    try:
        with open(path, "rb") as f:  # decoded line by line, so that bytes that are not UTF-8 get their line
            for lineno, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CoreBundleError(f"{path}:{lineno} is not valid UTF-8 ({e.reason}).") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CoreBundleError(f"{path}:{lineno} is not valid JSON ({e.msg}).") from None
                _check_row(row, task_type, path, lineno)
                rows.append(row)
    except OSError as e:
        raise CoreBundleError(f"{path} cannot be read ({e.strerror or e}).") from None
    if not rows:
        raise CoreBundleError(f"{path} has no rows.")
    return rows


def load_bundle(path: str | Path) -> list[Task]:
    """Every task of core.yaml, in order; a task whose jsonl is absent is kept with rows=None."""
    bundle = Path(path)
    config_path = bundle / "core.yaml"
    if not config_path.is_file():
        raise CoreBundleError(f"{config_path} not found; {bundle} is not a CORE eval bundle.")
    try:
        text = config_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CoreBundleError(f"{config_path} cannot be read ({e}).") from None
    try:
        config = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise CoreBundleError(f"{config_path} is not valid YAML: {e}.") from None
    if not isinstance(config, dict) or not isinstance(config.get("icl_tasks"), list):
        raise CoreBundleError(f"{config_path} has no icl_tasks list.")
    baselines = _read_baselines(bundle / "eval_meta_data.csv")

    tasks: list[Task] = []
    rows_by_file: dict[tuple[Path, str], list[dict]] = {}  # hellaswag and hellaswag_zeroshot share a file
    for i, entry in enumerate(config["icl_tasks"]):
        where = _where(config_path, root, i, "label")
        if not isinstance(entry, dict):
            raise CoreBundleError(f"{where} is an icl_tasks entry that is not a mapping.")
        missing = [k for k in ("label", "dataset_uri", "num_fewshot", "icl_task_type") if k not in entry]
        if missing:
            raise CoreBundleError(f"{where} is an icl_tasks entry without {', '.join(missing)}.")
        label, task_type = str(entry["label"]), entry["icl_task_type"]
        if any(task.label == label for task in tasks):  # metrics are named by label: one would hide the other
            raise CoreBundleError(f"{where} repeats the task label {label!r}; each task needs its own.")
        if task_type not in TASK_TYPES:
            where = _where(config_path, root, i, "icl_task_type")
            raise CoreBundleError(f"{where} gives task {label!r} the unknown icl_task_type "
                                  f"{task_type!r} (expected one of {', '.join(TASK_TYPES)}).")
        shots = entry["num_fewshot"]  # a list in the bundle; CORE uses the first
        num_fewshot = shots[0] if isinstance(shots, list) and shots else shots
        if not isinstance(num_fewshot, int) or isinstance(num_fewshot, bool) or num_fewshot < 0:
            where = _where(config_path, root, i, "num_fewshot")
            raise CoreBundleError(f"{where} gives task {label!r} num_fewshot {shots!r}; it must be a whole number "
                                  "of examples, 0 or more (or a list whose first item is one).")
        uri, delimiter = entry["dataset_uri"], entry.get("continuation_delimiter", " ")
        for key, value in (("dataset_uri", uri), ("continuation_delimiter", delimiter)):
            if not isinstance(value, str):
                raise CoreBundleError(f"{_where(config_path, root, i, key)} gives task {label!r} {key} {value!r}; "
                                      "it must be a string.")
        if label not in baselines:
            raise CoreBundleError(f"{bundle / 'eval_meta_data.csv'} has no Random baseline for task {label!r}.")
        baseline, line = baselines[label]
        if not 0 <= baseline < 100:  # centered accuracy divides by 1 - baseline/100; nan would make CORE nan
            raise CoreBundleError(f"{bundle / 'eval_meta_data.csv'}:{line} gives task {label!r} the Random baseline "
                                  f"{baseline:g}; it must be a percentage from 0 up to, not including, 100.")
        data_path = bundle / "eval_data" / uri
        if not data_path.resolve().is_relative_to((bundle / "eval_data").resolve()):  # an absolute or ../ path
            raise CoreBundleError(f"{_where(config_path, root, i, 'dataset_uri')} gives task {label!r} the data "
                                  f"file {uri!r}, outside the bundle's eval_data/; name a file inside it.")
        if data_path.exists() and not data_path.is_file():  # not a missing task: a mistake in the bundle
            raise CoreBundleError(f"{_where(config_path, root, i, 'dataset_uri')} gives task {label!r} the data "
                                  f"file {data_path}, which is not a file.")
        rows = None
        if data_path.is_file():
            key = (data_path, task_type)
            if key not in rows_by_file:
                rows_by_file[key] = _read_rows(data_path, task_type)
            rows = rows_by_file[key]
        tasks.append(Task(label, task_type, num_fewshot, delimiter, baseline, data_path, rows))
    if not tasks:  # CORE over no task is no number
        raise CoreBundleError(f"{config_path} lists no task in icl_tasks.")
    return tasks


@functools.lru_cache(maxsize=8)  # each point of a --multirun grid checks the same bundle
def check_bundle(path: str) -> None:
    """`eval.core_bundle` as a command line's mistake: a bundle that cannot be loaded is one sentence naming the
    key, found before a run trains (after its budget it would fail a trained run) or a checkpoint is loaded."""
    if not (Path(path) / "core.yaml").is_file():
        raise ConfigError(f"eval.core_bundle={path!r} has no core.yaml; point it at a CORE eval bundle (the offline "
                          "copy is ../shared/data/core)")
    try:
        load_bundle(path)
    except CoreBundleError as err:
        raise ConfigError(f"eval.core_bundle={path!r} is not allowed: {err}") from None


# -----------------------------------------------------------------------------
# Item subset, few-shot sampling and prompt rendering

def task_items(rows: list[dict], max_per_task: int | None = None) -> list[dict]:
    """The rows shuffled with a fixed seed, then cut to max_per_task (None or <= 0: all)."""
    items = list(rows)
    random.Random(SHUFFLE_SEED).shuffle(items)
    if max_per_task is not None and max_per_task > 0:
        items = items[:max_per_task]
    return items


def fewshot_indices(n: int, idx: int, num_fewshot: int) -> list[int]:
    """Same draw as rng.sample([i for i in range(n) if i != idx], k), without building that list.

    random.sample picks positions from len(population) alone, so sampling range(n - 1) and skipping
    over idx gives identical indices in O(k) per item. k is capped at n - 1 so tiny subsets still
    run (a plain sample of more than the population would raise).
    """
    k = min(num_fewshot, n - 1)
    if k <= 0:
        return []
    rng = random.Random(FEWSHOT_SEED + idx)
    return [j if j < idx else j + 1 for j in rng.sample(range(n - 1), k)]


def render_mc(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """One prompt per choice; the context (few-shot + query) is shared, the choice differs."""
    shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_schema(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """One prompt per context option; the continuation is shared."""
    shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n"
                    for ex in fewshot)
    return [f"{shots}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]


def render_lm(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """[prompt without the continuation, prompt with it]; contexts are trimmed (some rows carry
    trailing whitespace), and the prompt without is stripped so that its tokens are a clean prefix."""
    shots = "".join(f"{str(ex['context']).strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    prompt = f"{shots}{str(item['context']).strip()}{delimiter}"
    return [prompt.strip(), f"{prompt}{item['continuation']}"]


RENDER = {"multiple_choice": render_mc, "schema": render_schema, "language_modeling": render_lm}


def render_item(task: Task, items: list[dict], idx: int) -> list[str]:
    """The prompts of item idx of the (shuffled, cut) items, few-shot examples drawn from the others."""
    fewshot = [items[j] for j in fewshot_indices(len(items), idx, task.num_fewshot)]
    return RENDER[task.task_type](items[idx], task.continuation_delimiter, fewshot)


# -----------------------------------------------------------------------------
# Token sequences and continuation spans

def common_length(seqs: list[list[int]], from_end: bool = False) -> int:
    """Length of the prefix (or suffix) shared by all sequences."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        pos = -1 - i if from_end else i
        if any(s[pos] != seqs[0][pos] for s in seqs):
            return i
    return n


def continuation_spans(task_type: str, tokens: list[list[int]]) -> tuple[list[list[int]], list[int], list[int]]:
    """From BOS-prefixed tokens of an item's prompts, the sequences to score and [start, end) of
    the tokens scored in each.

    multiple_choice: the options share the context, so scoring starts where they first differ.
    schema: the options share the continuation, so scoring covers the common suffix.
    language_modeling: tokens are [without, with]; only `with` is scored, from the end of `without`.
    """
    if task_type == "multiple_choice":
        start = common_length(tokens)
        return tokens, [start] * len(tokens), [len(t) for t in tokens]
    if task_type == "schema":
        suffix = common_length(tokens, from_end=True)
        return tokens, [len(t) - suffix for t in tokens], [len(t) for t in tokens]
    if task_type == "language_modeling":
        without, with_ = tokens
        # `without` is a prefix of `with` for any tokenizer that attaches spaces to the following
        # word; if one does not, score from where the two first differ
        start = len(without) if with_[:len(without)] == without else common_length(tokens)
        return [with_], [start], [len(with_)]
    raise ValueError(f"unknown task type {task_type!r}")


def truncate_left(tokens: list[list[int]], starts: list[int], ends: list[int],
                  max_seq_len: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Keep the last max_seq_len tokens of each sequence (the end holds what is scored)."""
    out_tokens, out_starts, out_ends = [], [], []
    for t, s, e in zip(tokens, starts, ends):
        crop = max(0, len(t) - max_seq_len)
        out_tokens.append(t[crop:])
        # a scored token needs one token before it to be predicted from
        out_starts.append(max(s - crop, 1))
        out_ends.append(max(e - crop, 1))
    return out_tokens, out_starts, out_ends


@dataclass
class PreparedItem:
    tokens: list[list[int]]  # one sequence per option (one for language_modeling)
    starts: list[int]  # first scored position in each sequence
    ends: list[int]  # one past the last scored position
    gold: int  # index of the right option; 0 for language_modeling


def prepare_task(task: Task, items: list[dict], tokenizer, max_seq_len: int) -> list[PreparedItem]:
    """Render, tokenize (one batched call for the whole task) and locate the scored spans."""
    prompts = [render_item(task, items, idx) for idx in range(len(items))]
    flat = [p for item_prompts in prompts for p in item_prompts]
    encoded = tokenizer.encode_batch(flat)
    prepared, pos = [], 0
    for idx, item_prompts in enumerate(prompts):
        tokens = [[tokenizer.bos_id] + list(ids) for ids in encoded[pos:pos + len(item_prompts)]]
        pos += len(item_prompts)
        tokens, starts, ends = continuation_spans(task.task_type, tokens)
        tokens, starts, ends = truncate_left(tokens, starts, ends, max_seq_len)
        prepared.append(PreparedItem(tokens, starts, ends, int(items[idx].get("gold", 0))))
    return prepared


# -----------------------------------------------------------------------------
# Scoring

@torch.no_grad()
def score_sequences(model: torch.nn.Module, tokens: list[list[int]], starts: list[int], ends: list[int],
                    *, pad_id: int, device: str | torch.device = "cpu",
                    batch_size: int = 16, max_seq_len: int | None = None) -> tuple[list[float], list[bool]]:
    """Mean cross-entropy over tokens[start:end] of each sequence, and whether greedy argmax got
    every one of them right. Sequences are sorted by length and right-padded into batches: the
    model is causal, so padding after a sequence cannot change its logits."""
    mean_loss = [math.nan] * len(tokens)
    all_right = [True] * len(tokens)
    order = sorted(range(len(tokens)), key=lambda i: len(tokens[i]), reverse=True)
    for b in range(0, len(order), batch_size):
        rows = order[b:b + batch_size]
        longest = max(len(tokens[i]) for i in rows)
        width = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
        if max_seq_len is not None:
            width = max(min(width, max_seq_len), longest)
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)  # full batch: one shape per width
        row_of, pos_of = [], []
        for r, i in enumerate(rows):
            ids[r, :len(tokens[i])] = torch.tensor(tokens[i], dtype=torch.long)
            # logits at position p predict the token at p + 1
            positions = range(starts[i] - 1, ends[i] - 1)
            row_of.extend([r] * len(positions))
            pos_of.extend(positions)
        ids = ids.to(device)
        logits = model(ids)
        row_t = torch.tensor(row_of, dtype=torch.long, device=device)
        pos_t = torch.tensor(pos_of, dtype=torch.long, device=device)
        picked = logits[row_t, pos_t].float()  # only the scored positions, not [B, T, V]
        targets = ids[row_t, pos_t + 1]
        losses = F.cross_entropy(picked, targets, reduction="none")
        wrong = (picked.argmax(dim=-1) != targets).float()
        counts = torch.zeros(batch_size, device=device).index_add_(0, row_t, torch.ones_like(losses))
        loss_sum = torch.zeros(batch_size, device=device).index_add_(0, row_t, losses)
        wrong_sum = torch.zeros(batch_size, device=device).index_add_(0, row_t, wrong)
        means = (loss_sum / counts).tolist()  # 0/0 = nan for an empty span, like a mean of nothing
        wrongs = wrong_sum.tolist()
        for r, i in enumerate(rows):
            mean_loss[i] = means[r]
            all_right[i] = wrongs[r] == 0
    return mean_loss, all_right


def shared_prefix(item: PreparedItem) -> int:
    """How many leading tokens every option of the item shares before the first scored token's
    predictor (which starts each option's suffix): 0 when the options cannot share a prefix, as
    when left truncation cropped them differently or the options differ right after BOS."""
    start = item.starts[0]
    length = start - 1
    if length < 1 or any(s != start for s in item.starts):
        return 0
    first = item.tokens[0][:length]
    return length if all(t[:length] == first for t in item.tokens[1:]) else 0


def can_reuse_prefix(model: torch.nn.Module) -> bool:
    """Only the model's own attention computes a suffix against a cached prefix, so another
    attention backend (or a stand-in model) scores full sequences."""
    ops = getattr(model, "ops", None)
    return hasattr(model, "forward_with_prefix") and getattr(ops, "backends", {}).get("attention") == "reference"


@torch.no_grad()
def score_with_prefix(model: torch.nn.Module, item: PreparedItem, prefix_len: int, *, pad_id: int,
                      device: str | torch.device = "cpu") -> tuple[list[float], list[bool]]:
    """score_sequences for one item's options, with their shared prefix computed once and every
    option's suffix in one batch. A suffix starts with the last context token, whose logit
    predicts the first scored token, so suffix logit j predicts suffix token j + 1."""
    suffixes = [t[prefix_len:] for t in item.tokens]
    width = max(len(t) for t in suffixes)
    ids = torch.full((len(suffixes), width), pad_id, dtype=torch.long)
    for r, t in enumerate(suffixes):
        ids[r, :len(t)] = torch.tensor(t, dtype=torch.long)
    prefix = torch.tensor([item.tokens[0][:prefix_len]], dtype=torch.long, device=device)
    ids = ids.to(device)
    logits = model.forward_with_prefix(prefix, ids).float()
    mean_loss, all_right = [], []
    for r, (s, e) in enumerate(zip(item.starts, item.ends)):
        picked, targets = logits[r, :e - s], ids[r, 1:e - s + 1]
        mean_loss.append(F.cross_entropy(picked, targets).item() if e > s else math.nan)
        all_right.append(bool(torch.all(picked.argmax(dim=-1) == targets)))
    return mean_loss, all_right


def item_correct(task_type: str, item: PreparedItem, mean_loss: list[float], all_right: list[bool]) -> bool:
    """mean_loss / all_right are this item's values, one per sequence."""
    if task_type == "language_modeling":
        return all_right[0]
    # lowest mean loss wins; ties go to the first option
    return mean_loss.index(min(mean_loss)) == item.gold


def evaluate_task(model: torch.nn.Module, tokenizer, task: Task, *, max_per_task: int | None = None,
                  device: str | torch.device = "cpu", max_seq_len: int, batch_size: int = 16,
                  reuse_prefix: bool = True) -> tuple[float, int]:
    """(accuracy, number of items) of one task that is present in the bundle. With reuse_prefix,
    a multiple-choice item's shared context is computed once for all its options (where the
    model supports it); the other items are scored as full sequences in batches."""
    items = task_items(task.rows, max_per_task)
    prepared = prepare_task(task, items, tokenizer, max_seq_len)
    reuse = reuse_prefix and task.task_type == "multiple_choice" and can_reuse_prefix(model)
    prefix_lens = [shared_prefix(p) if reuse else 0 for p in prepared]
    # every other item is scored as full sequences, batched across items
    full = [p for p, n in zip(prepared, prefix_lens) if n == 0]
    tokens = [t for p in full for t in p.tokens]
    starts = [s for p in full for s in p.starts]
    ends = [e for p in full for e in p.ends]
    mean_loss, all_right = score_sequences(model, tokens, starts, ends, pad_id=tokenizer.bos_id,
                                           device=device, batch_size=batch_size, max_seq_len=max_seq_len)
    correct, pos = 0, 0
    for p, prefix_len in zip(prepared, prefix_lens):
        if prefix_len:
            losses, rights = score_with_prefix(model, p, prefix_len, pad_id=tokenizer.bos_id, device=device)
        else:
            n = len(p.tokens)
            losses, rights = mean_loss[pos:pos + n], all_right[pos:pos + n]
            pos += n
        correct += item_correct(task.task_type, p, losses, rights)
    return correct / len(prepared), len(prepared)


# -----------------------------------------------------------------------------
# CORE

def centered_accuracy(accuracy: float, baseline_percent: float) -> float:
    """0 at chance, 1 at perfect."""
    b = 0.01 * baseline_percent
    return (accuracy - b) / (1.0 - b)


def core_score(centered_by_task: dict[str, float]) -> float:
    """Mean centered accuracy over the tasks given; nan when there are none."""
    if not centered_by_task:
        return math.nan
    return sum(centered_by_task.values()) / len(centered_by_task)


@dataclass
class CoreResult:
    accuracy: dict[str, float]  # per evaluated task, in core.yaml order
    centered: dict[str, float]
    n_items: dict[str, int]
    missing: list[str]  # labels whose jsonl is not in the bundle; never part of `core`
    core: float
    n_tasks: int
    n_total: int
    items_per_second: float
    seconds: float = 0.0
    random_baseline: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        text = f"CORE {self.core:.4f} over {self.n_tasks} of {self.n_total} tasks"
        if self.missing:
            text += f" (missing: {', '.join(self.missing)})"
        return text

    def metrics(self) -> dict[str, float]:
        """Flat metrics for summaries and MLflow: `core`, `core_tasks`, and `core/<task>` (centered)."""
        flat = {"core": self.core, "core_tasks": self.n_tasks, "core_tasks_total": self.n_total,
                "core_items_per_second": self.items_per_second}
        flat.update({f"core/{label}": value for label, value in self.centered.items()})
        return flat


def evaluate_core(model: torch.nn.Module, tokenizer, bundle_dir: str | Path, *, max_per_task: int | None = None,
                  device: str | torch.device = "cpu", max_seq_len: int, batch_size: int = 16,
                  log: Callable[[str], None] | None = None, reuse_prefix: bool = True) -> CoreResult:
    """CORE over the tasks present in the bundle. The model runs in eval mode under no_grad (its
    mode is restored after); wrap the call in autocast for reduced-precision inference.
    batch_size is the number of sequences (options) per forward; reuse_prefix: see evaluate_task."""
    tasks = load_bundle(bundle_dir)
    was_training = model.training
    model.eval()
    accuracy, centered, n_items, baselines, missing = {}, {}, {}, {}, []
    start = time.perf_counter()
    try:
        for task in tasks:
            if task.missing:
                missing.append(task.label)
                if log:
                    log(f"CORE {task.label}: missing ({task.path} not in the bundle)")
                continue
            t0 = time.perf_counter()
            acc, n = evaluate_task(model, tokenizer, task, max_per_task=max_per_task, device=device,
                                   max_seq_len=max_seq_len, batch_size=batch_size, reuse_prefix=reuse_prefix)
            accuracy[task.label] = acc
            centered[task.label] = centered_accuracy(acc, task.random_baseline)
            n_items[task.label] = n
            baselines[task.label] = task.random_baseline
            if log:
                log(f"CORE {task.label} ({task.num_fewshot}-shot {task.task_type}): accuracy {acc:.4f} "
                    f"centered {centered[task.label]:.4f} over {n} items in {time.perf_counter() - t0:.1f}s")
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    total_items = sum(n_items.values())
    return CoreResult(accuracy=accuracy, centered=centered, n_items=n_items, missing=missing,
                      core=core_score(centered), n_tasks=len(centered), n_total=len(tasks),
                      items_per_second=total_items / seconds if seconds > 0 else math.nan,
                      seconds=seconds, random_baseline=baselines)


def core_metrics(model: torch.nn.Module, tokenizer, eval_cfg, device, seq_len: int, log=print) -> dict:
    """CORE of a trained model (never charged to the budget) as flat metrics; `device` is a
    frontier.device.Device, `eval_cfg` an EvalConfig."""
    import sys

    with device.autocast():
        result = evaluate_core(model, tokenizer, eval_cfg.core_bundle, max_per_task=eval_cfg.core_max_per_task,
                               device=device.torch_device, max_seq_len=seq_len, batch_size=eval_cfg.batch_rows * 2,
                               log=log)
    print(f"{result.describe()} ({result.items_per_second:,.1f} items/s)", file=sys.stderr)
    return result.metrics()
