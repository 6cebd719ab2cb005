"""`python -m frontier.eval checkpoint=PATH | run_id=ID [key=value ...]`: CORE (and optionally
val_bpb) of a finished run, logged to its MLflow run as `core`, `core_tasks` and `core/<task>`.

Keys: checkpoint (a run's final.pt) or run_id (an MLflow run, whose checkpoint is found and to which
the figures go); device=auto|cpu|cuda|cuda:N|neuron; precision=auto|bf16|fp32; core=true;
val_bpb=false; val_documents=N (val_bpb on the first N documents of the validation split's spread
order instead of the run's eval.final_tokens: printed, not logged, as the run's own val_bpb is that of
its set); eval.KEY and tracking.KEY as in training (e.g. eval.core_max_per_task=50).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from frontier.cli import command, print_help_if_asked
from frontier.config import (ConfigError, DataConfig, EvalConfig, TrackingConfig, check_device, error_line,
                             key_hint)


@dataclass
class EvalCommand:
    checkpoint: Optional[str] = None  # a final.pt
    run_id: Optional[str] = None  # an MLflow run whose checkpoint to evaluate and log to
    device: str = "auto"
    precision: str = "auto"  # bf16 where the device computes it natively, else fp32
    core: bool = True
    val_bpb: bool = False
    val_documents: Optional[int] = None  # val_bpb over this many documents spread across the split
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


def parse(argv: list[str]) -> EvalCommand:
    names = [f.name for f in fields(EvalCommand)]
    for arg in argv:
        key, equals, _ = arg.partition("=")
        if not equals:
            raise ConfigError(f"{arg!r} is not allowed: arguments are key=value, such as checkpoint=PATH or run_id=ID")
        top = key.split(".")[0]
        if top not in names:
            raise ConfigError(f"{arg} is not allowed: {key_hint('frontier.eval', top, names)}")
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(EvalCommand), OmegaConf.from_dotlist(argv))
        command: EvalCommand = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:  # a nested key or a value of the wrong type: name the argument
        arg = next((a for a in argv if a.partition("=")[0] == getattr(err, "full_key", None)), None)
        text = error_line(err, named=False)
        raise ConfigError(f"{arg} is not allowed: {text}" if arg else text) from None
    if (command.checkpoint is None) == (command.run_id is None):
        raise ConfigError("give exactly one of checkpoint=PATH or run_id=ID")
    if command.val_documents is not None and command.val_documents < 1:
        raise ConfigError(f"val_documents={command.val_documents} is not allowed: give a positive number of documents")
    check_device(command.device)
    return command


def find_checkpoint(command: EvalCommand) -> tuple[Path, Optional[str]]:
    """The checkpoint to evaluate and the MLflow run to log to (if any)."""
    if command.checkpoint is not None:
        path = Path(command.checkpoint)
        summary = path.parent / "summary.json"
        try:
            record = json.loads(summary.read_text()) if summary.is_file() else {}
        except (OSError, ValueError) as err:
            raise ConfigError(f"checkpoint={path} is not allowed: its {summary} cannot be read as JSON ({err})") from None
        if not isinstance(record, dict):  # it names the MLflow run the figures go to: no guessing
            raise ConfigError(f"checkpoint={path} is not allowed: its {summary} is not a run's summary (a JSON "
                              f"{type(record).__name__}, not an object)")
        return path, record.get("mlflow_run_id")
    from frontier.store import checkpoint_of_run

    return checkpoint_of_run(command.tracking, command.run_id), command.run_id


def main(argv: list[str]) -> dict:
    from frontier.checkpoint import load_for_eval, load_tokenizer, read_checkpoint
    from frontier.device import resolve_device
    from frontier.core import check_bundle, core_metrics

    command = parse(argv)
    given = {arg.partition("=")[0] for arg in argv}
    if command.core:  # a damaged bundle is found before the checkpoint is loaded
        check_bundle(str(command.eval.core_bundle))
    path, run_id = find_checkpoint(command)
    saved = read_checkpoint(path, "checkpoint=")["config"]  # the run's config, read once
    as_the_run(command, saved, given)
    device = resolve_device(command.device, command.precision)  # after: a bad checkpoint is its one line
    model = load_for_eval(path, device.torch_device)
    tokenizer = load_tokenizer(path)
    metrics: dict = {}
    if command.core:
        metrics.update(core_metrics(model, tokenizer, command.eval, device, model.config.seq_len))
    if command.val_bpb or command.val_documents:
        metrics.update(validation_bpb(saved, model, tokenizer, device, command.eval, command.val_documents))
    for key, value in metrics.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    logged = {k: v for k, v in metrics.items() if not (command.val_documents and k.startswith("val_"))}
    if run_id is not None and command.tracking.enabled and logged:
        log_to_run(command, path, run_id, logged)
    return metrics


RUN_SETTINGS = ("final_tokens", "core_max_per_task")  # what the run's own figures were scored over


def as_the_run(command: EvalCommand, saved: dict, given: set[str]) -> None:
    """eval.final_tokens, eval.core_max_per_task and a precision the run named, when not given, are the
    run's own (`saved`: its config): its val_bpb and CORE are scored again over the same tokens and items
    in the same arithmetic, not over this command's defaults (auto picked bf16 for an fp32 run on a CPU
    with native bf16, and its val_bpb, logged as the run's latest, moved in the fifth digit)."""
    run_eval = saved.get("eval") or {}
    for key in RUN_SETTINGS:
        if f"eval.{key}" not in given and key in run_eval:
            setattr(command.eval, key, run_eval[key])
    if "precision" not in given and saved.get("precision") in ("bf16", "fp32"):
        command.precision = saved["precision"]


class NotLogged(Exception):
    """The figures were computed and printed, but the run's MLflow store did not take them."""


def log_to_run(command: EvalCommand, path: Path, run_id: str, metrics: dict) -> None:
    """Into the store the run was tracked in: `tracking.uri` when given, else the one its run directory
    recorded (tracking.json beside the checkpoint), else the default store."""
    from frontier.mlflow_observer import read_ack
    from frontier.store import log_metrics_to_run, tracking_uri

    given = command.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI")
    recorded = None if given or command.run_id else read_ack(path.parent).get("uri")
    uri = recorded or tracking_uri(command.tracking)
    try:
        log_metrics_to_run(uri, run_id, metrics)
    except Exception as err:  # a store that is down, or that does not hold the run
        raise NotLogged(f"not logged to MLflow run {run_id} in {uri} ({error_line(err)}); the figures above "
                        "are the result") from None
    print(f"logged to MLflow run {run_id}")


def validation_bpb(saved: dict, model, tokenizer, device, eval_cfg: EvalConfig, documents: int | None = None) -> dict:
    """val_bpb, its standard error and the fingerprint of the rows, on the validation split the
    checkpoint's run (`saved`: its config) trained against: over eval.final_tokens, or over the first
    `documents` of the split's spread order."""
    from frontier.data import load_corpus, resolve_splits, validation_set
    from frontier.evaluate import val_bpb

    data_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), saved["data"]))
    _, val_split = resolve_splits(data_cfg)
    corpus = load_corpus(val_split, tokenizer, data_cfg, "val")
    tokens = corpus.num_tokens if documents else eval_cfg.final_tokens
    vset = validation_set(corpus, tokenizer, model.config.seq_len, tokens, documents)
    score = val_bpb(model, vset, tokenizer.token_bytes, device, eval_cfg.batch_rows)
    return {"val_bpb": score.val_bpb, "val_bpb_se": score.se, "val_tokens": score.tokens,
            "val_documents": score.documents, "val_fingerprint": vset.fingerprint()}


@command
def cli() -> None:
    """`python -m frontier.eval` and the `frontier-eval` command."""
    from frontier.core import CoreBundleError
    from frontier.data import DataError

    print_help_if_asked(sys.argv[1:], __doc__)
    try:
        main(sys.argv[1:])
    except (ConfigError, CoreBundleError, DataError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except NotLogged as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    cli()
