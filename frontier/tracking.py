"""`python -m frontier.tracking sync RUN_DIR [tracking.uri=URI]`: what the MLflow store lacks of a run.

`sync` creates the MLflow run if it never existed and sends what the store has not acknowledged; a
(key, step) the run already holds is never sent twice. The store is frontier.store, the sink that
follows a live run frontier.mlflow_observer; their names are importable from here as well.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from mlflow import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import DictConfig, ListConfig, OmegaConf

from frontier import paths
from frontier.cli import command, print_help_if_asked
from frontier.compose import NAME_ERRORS, refused_path
from frontier.config import ConfigError, TrackingConfig, error_line, store_error_line
from frontier.lifecycle import claimed
from frontier.mlflow_observer import (ACK_FILE, _active_run, _end_calls, _history, _log_curves, _made_by_broken_start,
                                      _send_missing, _set_status, read_ack, write_ack)
from frontier.observers import final_record, read_records
from frontier.stopping import TERMINAL
from frontier.store import (MLFLOW_STATUS, _clip_tags, _experiment_id, _log_params, _ms, _now_ms, _retry,
                            _running_with_tags, _warn, ensure_store, flatten, tracking_uri)
# the store's and the sink's names that the commands and the tests take from frontier.tracking
from frontier.mlflow_observer import MlflowObserver  # noqa: F401
from frontier.store import RUN_KIND_TAG, close_runs, end_parent_run, probe_store, start_parent_run  # noqa: F401


def sync(run_dir: Path, uri: str | None = None) -> str:
    """Pushes to MLflow what it lacks of a run directory, and returns one line saying what was done.

    Creates the MLflow run if it never existed (params from the run's config), sends the points of
    metrics.jsonl it does not hold (a (key, step) it has is never sent again), the final summary,
    summary.json, curves.png, the status tags and the terminal status. A run whose process died
    without recording its end (no summary.json, and nothing holds its run.lock) ends KILLED, saying so.
    Running it again sends nothing.
    """
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR={run_dir} is not allowed: no such directory")
    # one sync of a run directory at a time (a second waits, then finds the run the first made), and
    # run.lock held while syncing: no resume= can reopen the run meanwhile
    with _one_sync_at_a_time(run_dir), claimed(run_dir) as ended:
        return _sync(run_dir, uri, ended)


@contextlib.contextmanager
def _one_sync_at_a_time(run_dir: Path) -> Iterator[None]:
    """An exclusive lock on the run directory itself, so that syncing writes no file of its own there."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _sync(run_dir: Path, uri: str | None, ended: bool | None) -> str:
    metrics_path, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    if not metrics_path.is_file() and not summary_path.is_file():
        raise ConfigError(f"RUN_DIR={run_dir} is not allowed: it is not a run directory (it has neither "
                          f"metrics.jsonl nor summary.json)")
    summary = None
    if summary_path.exists():  # a folder or an unreadable file in its place is not "no summary": its run ended
        summary = _load_run_file(run_dir, summary_path, lambda path: json.loads(path.read_text()), "JSON")
        if not isinstance(summary, dict):
            raise _not_allowed(run_dir, f"{summary_path} is not a JSON object (it holds {json.dumps(summary)[:40]})")
        if summary.get("status") not in TERMINAL:  # sync would end the run with a status it never had
            raise _not_allowed(run_dir, f"{summary_path} has status {summary.get('status')!r}, not one of "
                                        f"{', '.join(TERMINAL)}")
    ack_path = run_dir / ACK_FILE
    if ack_path.exists() and not ack_path.is_file():  # sync could not record the run it makes: a twin each time
        raise _not_allowed(run_dir, f"{ack_path} is not a file; sync records there which MLflow run holds the "
                                    "directory (move it away)")
    unreadable: list[int] = []
    records = _load_run_file(run_dir, metrics_path, lambda path: read_records(path, unreadable), "text")
    if unreadable:  # a line cut short by kill -9, or a damaged file: what it held cannot be sent
        lines = ", ".join(map(str, unreadable[:5])) + (", ..." if len(unreadable) > 5 else "")
        _warn(f"{len(unreadable)} line(s) of {metrics_path} are not metrics records and are left out (line "
              f"{lines})")
    config = _run_config(run_dir)
    cfg = _tracking_config(config)
    ack = read_ack(run_dir)
    if uri:
        uri = tracking_uri(TrackingConfig(uri=uri))
        given = paths.sqlite_path(uri)
        if given is not None and not given.exists():  # wanted (a first store for runs trained offline) or a typo
            _warn(f"there was no MLflow store at tracking.uri={uri}, so sync creates one there (if you meant an "
                  "existing store, check the path)")
    uri = uri or ack.get("uri") or tracking_uri(cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    run_id = _existing_run(client, ack.get("run_id") if ack.get("uri") == uri else None) or _existing_run(
        client, (summary or {}).get("mlflow_run_id"))
    created = run_id is None
    if created:
        run_id = _synced_run(client, uri, cfg, config, run_dir, records)
    status = (summary or {}).get("status")
    died = status not in MLFLOW_STATUS and ended is True  # nothing holds its run.lock: its process is gone
    if died:
        status = "KILLED"
    if (not created and ack.get("run_id") == run_id and ack.get("acked_records") == len(records)
            and status in MLFLOW_STATUS and ack.get("terminal_status") == status):
        return f"{run_dir} is already in sync with run {run_id} in {uri}"
    sent = _send_missing(client, run_id, records, _history(client, run_id))
    finals = [r for r in records if "final" in r]
    if summary is not None and status in MLFLOW_STATUS:
        final = finals[-1] if finals else {**final_record(summary, status), "time": summary_path.stat().st_mtime}
        for fn, *args in _end_calls(client, run_id, run_dir, summary, final, cfg.log_checkpoint):
            sent += fn(*args) or 0  # _push_final says how many points it sent
        ending = f"status {status}"
    elif died:
        ending = _end_dead_run(client, run_id, run_dir, records)
    elif ended is False:
        ending = "its process is still running, so the run is left RUNNING"
    else:
        ending = "no summary.json, so the run is left RUNNING"
    write_ack(run_dir, uri, run_id, acked_records=len(records), terminal_status=status, required=True)
    what = f"run {run_id} created" if created else f"run {run_id}"
    return f"synced {run_dir} to {what} in {uri}: {sent} new point(s), {ending}"


def _end_dead_run(client: MlflowClient, run_id: str, run_dir: Path, records: list[dict]) -> str:
    """Ends KILLED the MLflow run of a process that died without recording its end, unless someone (a
    sweep driver, for its trial) ended it already; says which."""
    _log_curves(client, run_id, run_dir, {})
    ended_as = _retry(client.get_run, run_id).info.status
    if ended_as != "RUNNING":
        return f"its process ended without recording its end, and MLflow has the run {ended_as} already"
    end_ms = _ms(records[-1]["time"]) if records else _now_ms()  # its last sign of life
    reason = died_without_end(run_dir)
    _set_status(client, run_id, "KILLED", reason, end_ms)
    return f"status KILLED: {reason}"


def died_without_end(run_dir: Path) -> str:
    """What `sync` records for a run whose process ended without recording its end."""
    how = (f"`python -m frontier.train resume={run_dir}` continues it from its last resume.pt"
           if (run_dir / "resume.pt").is_file() else "it wrote no resume.pt, so it cannot be resumed")
    return f"its process ended without recording its end (kill -9, a crash or a lost machine); {how}"


def _not_allowed(run_dir: Path, reason: str) -> ConfigError:
    return ConfigError(f"RUN_DIR={run_dir} is not allowed: {reason}")


def _load_run_file(run_dir: Path, path: Path, load: Callable, language: str):
    """`load(path)`; a file of the run that cannot be read or parsed is one sentence naming it (exit 2):
    the user's to mend, never taken for a store that did not answer."""
    try:
        return load(path)
    except OSError as err:
        raise _not_allowed(run_dir, f"{path} cannot be read ({err.strerror or err})") from None
    except Exception as err:  # text that does not parse
        raise _not_allowed(run_dir, f"{path} is not {language} ({error_line(err)})") from None


def _run_config(run_dir: Path) -> dict:
    """The run's config: Hydra's copy, else the one saved in final.pt or resume.pt; {} without any."""
    hydra_config = run_dir / ".hydra" / "config.yaml"
    if hydra_config.exists():
        loaded = _load_run_file(run_dir, hydra_config, OmegaConf.load, "YAML")
        if not isinstance(loaded, DictConfig):
            raise _not_allowed(run_dir, f"{hydra_config} is not a mapping of config keys (it holds a list)")
        try:
            return OmegaConf.to_container(loaded, resolve=True)
        except Exception:  # an interpolation that needs Hydra's runtime: keep it as written
            return OmegaConf.to_container(loaded)
    for name in ("final.pt", "resume.pt"):
        if (run_dir / name).is_file():
            from frontier.checkpoint import read_checkpoint

            config = read_checkpoint(run_dir / name, "sync", keys=("config",))["config"]
            if not isinstance(config, dict):
                raise _not_allowed(run_dir, f"{run_dir / name} holds no config mapping")
            return config
    return {}


def _tracking_config(config: dict) -> TrackingConfig:
    saved = config.get("tracking") or {}
    known = {f.name for f in dataclasses.fields(TrackingConfig)}
    return TrackingConfig(**{k: v for k, v in saved.items() if k in known})


def _existing_run(client: MlflowClient, run_id: str | None) -> str | None:
    run = _active_run(client, run_id)
    return run.info.run_id if run is not None else None


def _synced_run(client: MlflowClient, uri: str, cfg, config: dict, run_dir: Path, records: list[dict]) -> str:
    """The MLflow run of a run directory that names none in the store, recorded in tracking.json at once.

    A RUNNING run tagged with this directory is taken up again: one that a sync (or a launch) killed
    before it wrote tracking.json left behind. Otherwise a new run is made; a signal before it is recorded
    deletes it again, so that an interrupted sync leaves no run RUNNING for good and the next one no twin.
    """
    tags = {"run_dir": str(run_dir.resolve())}
    overrides = run_dir / ".hydra" / "overrides.yaml"
    if overrides.exists():
        loaded = _load_run_file(run_dir, overrides, OmegaConf.load, "YAML")
        tags["hydra.overrides"] = " ".join(str(o) for o in (loaded if isinstance(loaded, ListConfig) else []))
    parent = _active_run(client, cfg.parent_run_id)
    if parent is not None:
        tags[MLFLOW_PARENT_RUN_ID] = parent.info.run_id
        experiment_id = parent.info.experiment_id
    else:
        experiment_id = _experiment_id(client, uri, cfg.experiment)
    left = _retry(_running_with_tags, client, experiment_id, {"run_dir": tags["run_dir"]})
    run_id = left[0] if left else None
    try:
        if run_id is None:
            start_ms = _ms(records[0]["time"]) if records else None
            run_id = _retry(client.create_run, experiment_id, start_time=start_ms, run_name=cfg.run_name,
                            tags=_clip_tags(tags)).info.run_id
        if config:
            _log_params(client, run_id, flatten(config))
            _retry(client.log_text, run_id, OmegaConf.to_yaml(OmegaConf.create(config)), "config.yaml")
        write_ack(run_dir, uri, run_id, acked_records=0, terminal_status=None, required=True)  # the next sync finds it
    except BaseException:
        if not left:
            _delete_unrecorded(client, experiment_id, run_id, tags["run_dir"])
        raise
    return run_id


def _delete_unrecorded(client: MlflowClient, experiment_id: str, run_id: str | None, run_dir: str) -> None:
    """Deletes the run a sync made but never recorded; a signal inside create_run leaves no id, so the
    run is then found by its tag. Where the store fails too, the next sync takes the run up again."""
    with contextlib.suppress(Exception):
        for found in _made_by_broken_start(client, run_id, experiment_id, run_dir):
            client.delete_run(found)


USAGE = "python -m frontier.tracking sync RUN_DIR [tracking.uri=URI]"
HELP = f"""usage: {USAGE}

Sends to the MLflow store what it has not acknowledged of the run in RUN_DIR (from its metrics.jsonl,
summary.json and config), creating the MLflow run if it never existed; no point is sent twice. A run
whose process ended without recording its end (kill -9) is ended KILLED; a live one is left RUNNING.
tracking.uri: the store, if not the one the run was configured with."""


@command
def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print_help_if_asked(args, HELP)
    try:
        if not args or args[0] != "sync":
            raise ConfigError(f"{args[0] if args else 'no command'} is not allowed: the command is `{USAGE}`")
        if len(args) < 2:
            raise ConfigError(f"sync needs the run directory: `{USAGE}`")
        uri = None
        for item in args[2:]:
            key, _, value = item.partition("=")
            if key != "tracking.uri" or not value:
                raise ConfigError(f"{item} is not allowed: sync takes a run directory and tracking.uri=URI only")
            uri = value
        print(sync(Path(args[1]), uri))
        return 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the store failed part way: what was sent stays, the next sync sends the rest
        if refused_path(err, args[1:], NAME_ERRORS) is not None:
            raise  # a path the OS refuses by its shape: frontier.cli.command says it, exit code 2
        print(f"error: sync of {args[1]} stopped ({store_error_line(err)}); run it again when the store answers",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
