"""The MLflow store: which one a run uses, whether it answers, and the calls the rest of Frontier makes to it.

The store is `sqlite:///<project root>/mlruns/mlflow.db` unless `tracking.uri` (or MLflow's own
MLFLOW_TRACKING_URI) names another one; a SQLite store keeps its artifacts in an `artifacts/`
folder next to the database file. A call the store does not answer is retried; one it refuses
(REFUSED_ERRORS) is not.

The sweeper uses `ensure_store`, `start_parent_run`, `end_parent_run`, `close_runs` and `tag_run`; each trial
becomes a child run by setting `tracking.parent_run_id` (and `tracking.run_name`).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import requests
import sqlalchemy.exc
from filelock import FileLock
from hydra.core.hydra_config import HydraConfig
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException

from frontier import paths
from frontier.config import PROJECT_ROOT, ConfigError, error_line, project_path, store_error_line
from frontier.paths import unwritable


# MLflow's limits: param and tag value lengths, params/tags per log_batch call, metrics per call.
MAX_PARAM_CHARS = 6000
MAX_TAG_CHARS = 8000
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

PROBE_SECONDS = 5.0  # how long the start-up check waits for an HTTP tracking server
LOCKED_RETRIES = 12  # "database is locked" retries, with backoff, about 30 s in all
# Errors with which a store refuses a call (retrying cannot help), as opposed to not answering it.
REFUSED_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
                  "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "ENDPOINT_NOT_FOUND"}

# MLflow's HTTP client would retry one call for minutes (7 tries, 120-s timeout): our calls fail fast
# instead, and the logging thread paces its own retries. A user's own settings win.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
# A SQL store's OperationalError (a full disk, a lost database) is logged by MLflow with its traceback
# and then raised as an MlflowException, which the callers here report in one line.
logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)

MLFLOW_STATUS = {
    "FINISHED": "FINISHED",
    "COMPILED": "FINISHED",
    "FAILED": "FAILED",
    "KILLED": "KILLED",
    "PRUNED": "KILLED",
}
RUN_KIND_TAG = "run_kind"  # "sweep" on a sweep's parent run; the leaderboard leaves those out


def tracking_uri(tracking_cfg) -> str:
    """`tracking.uri`, else MLFLOW_TRACKING_URI, else the project's SQLite store.

    A relative SQLite path is taken from home (paths.store_under_home), wherever the command runs; a
    postgresql:// URL names the driver that is installed (paths.database_url).
    """
    uri = tracking_cfg.uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
    if not uri:
        return f"sqlite:///{project_path('mlruns') / 'mlflow.db'}"
    return paths.store_under_home(uri) if uri.startswith("sqlite:///") else paths.database_url(uri)


def probe_store(tracking_cfg) -> None:
    """The tracking store must answer before anything is written: an HTTP server or a database server
    is asked once (MLflow's own client would retry each for minutes) and any other URI but SQLite is
    opened (a SQLite file is created when the run starts: check_store_folder)."""
    uri = tracking_uri(tracking_cfg)
    if _is_http(uri):
        _probe(uri)
    elif _is_database(uri):
        _probe_database(uri)
    elif not uri.startswith("sqlite:"):
        try:
            MlflowClient(uri)  # an unknown scheme or a retired store fails here, at once
        except Exception as err:
            raise ConfigError(f"tracking.uri={uri} could not be opened ({error_line(err)})") from None


def check_store_folder(tracking_cfg) -> None:
    """A SQLite store must be a database, or one that can be created where it is named, found out before anything is
    written (the database itself is made when the run or sweep starts, after Hydra has written its
    run or sweep directory and a sweep its study)."""
    uri = tracking_uri(tracking_cfg)
    db = paths.sqlite_path(uri)
    if db is None:
        return
    db = db.expanduser()
    if db.is_dir():
        raise ConfigError(f"tracking.uri={uri} is not allowed: {db} is a directory; name the database "
                          "file, e.g. sqlite:///mlruns/mlflow.db")
    with contextlib.suppress(OSError):  # one that cannot be read is told when it is opened
        if db.is_file() and not paths.is_sqlite_file(db):  # MLflow would fail only once Hydra has written
            raise ConfigError(f"tracking.uri={uri} is not allowed: {db} is a file that is not a SQLite "
                              "database; name the MLflow store, or a file that does not exist yet")
    found = unwritable(db.parent)
    if found:
        raise ConfigError(f"tracking.uri={uri} is not allowed: its database cannot be created "
                          f"({found[1]}); {found[0]} is not a writable directory")


def ensure_store(uri: str) -> None:
    """Make the store usable before any run writes to it.

    SQLite: create the schema once under a file lock, so that parallel workers starting on a fresh
    database do not race on schema creation. HTTP: check that the server answers. Raises
    ConfigError with a one-line reason when the store cannot be used.
    """
    if _is_http(uri):
        _probe(uri)
        return
    if _is_database(uri):
        _probe_database(uri)
    try:
        with _store_lock(uri):
            _create_sqlite_whole(uri)
            _retry(MlflowClient(uri).search_experiments, max_results=1)
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)})") from None


def _create_sqlite_whole(uri: str) -> None:
    """A new SQLite store is made whole or not at all: MLflow builds its schema in a dozen migrations,
    and one cut off by a signal or kill -9 left a database that no later command could open. So the
    schema is built in a file beside it, which then takes the store's name in one rename. (MLflow keeps
    an idle engine for the file's first name; it holds no lock.)"""
    db = paths.sqlite_path(uri)
    if db is None:
        return
    db = db.expanduser()
    if db.exists() and db.stat().st_size > 0:
        return
    partial = db.with_name(f".{db.name}.{os.getpid()}.partial")
    _, sep, query = uri.partition("?")
    try:
        MlflowClient(f"sqlite:///{partial}{sep}{query}").search_experiments(max_results=1)
        os.replace(partial, db)
    finally:
        for leftover in (partial, Path(f"{partial}-journal")):
            leftover.unlink(missing_ok=True)


def start_parent_run(tracking_cfg, name: str, params: dict, tags: dict, run_id: str | None = None,
                     opened: dict | None = None) -> str:
    """A sweep's parent run; trials nest under it through `tracking.parent_run_id`. `run_id`: the
    study's parent run, which every driver of the study continues (reopened when it had ended).
    `opened["run_id"]` names the run as soon as it is RUNNING in the store, also when a signal or an
    error breaks the start off (inside `create_run` too: the run is then found by `tags`, which
    should name this caller alone), so that the caller can end it instead of leaving it RUNNING."""
    opened = {} if opened is None else opened
    uri = tracking_uri(tracking_cfg)
    ensure_store(uri)
    client = MlflowClient(uri)
    if run_id:
        try:
            existing = _retry(client.get_run, run_id)
        except MlflowException as err:  # deleted, or another store: start a new one
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise  # a store that failed to answer: a second parent run would split the sweep
            existing = None
        if existing is not None and existing.info.lifecycle_stage == "active":
            opened["run_id"] = run_id
            if existing.info.status != "RUNNING":
                _retry(client.update_run, run_id, status="RUNNING")
            return run_id
    experiment_id = _experiment_id(client, uri, tracking_cfg.experiment)
    all_tags = {RUN_KIND_TAG: "sweep", **_source_tags(), **{k: str(v) for k, v in tags.items()}}
    try:
        run = _retry(client.create_run, experiment_id, run_name=name, tags=_clip_tags(all_tags))
    except BaseException:
        with contextlib.suppress(Exception):  # the store is what failed: nothing to find then
            found = _running_with_tags(client, experiment_id, tags)
            if len(found) == 1:
                opened["run_id"] = found[0]
        raise
    opened["run_id"] = run.info.run_id
    _log_params(client, run.info.run_id, flatten(params))
    return run.info.run_id


def orphaned_parent_run(tracking_cfg, tags: dict, creators: set[str]) -> str | None:
    """The one RUNNING run carrying `tags` whose `sweep.driver` tag names a driver in `creators`: a parent
    run that a driver killed inside its creation (kill -9) made but never recorded in its study."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    experiment = _retry(client.get_experiment_by_name, tracking_cfg.experiment)
    if experiment is None:
        return None
    found = [run_id for run_id in _running_with_tags(client, experiment.experiment_id, tags)
             if _retry(client.get_run, run_id).data.tags.get("sweep.driver") in creators]
    return found[0] if len(found) == 1 else None


def _running_with_tags(client: MlflowClient, experiment_id: str, tags: dict) -> list[str]:
    """The RUNNING runs of an experiment that carry every one of `tags`."""
    if not tags or any("'" in str(value) or "`" in key for key, value in tags.items()):
        return []  # nothing to tell the run by, or not expressible in MLflow's filter syntax
    conditions = [f"tags.`{key}` = '{value}'" for key, value in tags.items()]
    found = client.search_runs([experiment_id], max_results=10,
                               filter_string=" and ".join([*conditions, "attributes.status = 'RUNNING'"]))
    return [run.info.run_id for run in found]


def end_parent_run(tracking_cfg, run_id: str, status: str, metrics: dict,
                   artifacts: Iterable[Path] = (), tags: dict | None = None) -> None:
    """Final metrics, tags and files of a sweep, then its status (a trainer status or an MLflow one): the
    status is set even where the metrics or files were not taken (their error is raised after)."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    now = _now_ms()
    try:
        _log_metrics(client, run_id, [Metric(k, float(v), now, 0) for k, v in metrics.items() if _is_number(v)])
        for key, value in (tags or {}).items():
            _retry(client.set_tag, run_id, key, value)
        for path in artifacts:
            _retry(client.log_artifact, run_id, str(path))
    finally:
        _retry(client.set_tag, run_id, "status", status)
        _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))


def close_runs(tracking_cfg, run_ids: Iterable[str], status: str,
               errors: dict[str, str] | None = None) -> dict[str, str]:
    """Ends the runs still RUNNING among `run_ids` (trials whose process died) with `status`, and the
    `error` tag `errors` gives each (why it died). Every run is tried; returns why, for each run that
    could not be closed."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    failed = {}
    for run_id in run_ids:
        try:
            if _retry(client.get_run, run_id).info.status == "RUNNING":
                if (errors or {}).get(run_id):
                    _retry(client.set_tag, run_id, "error", errors[run_id][:MAX_TAG_CHARS])
                _retry(client.set_tag, run_id, "status", status)
                _retry(client.set_terminated, run_id, MLFLOW_STATUS.get(status, status))
        except Exception as err:  # the store is down, or the run was deleted: the others still close
            failed[run_id] = store_error_line(err)
    return failed


def tag_run(tracking_cfg, run_id: str, tags: dict[str, str]) -> None:
    """Tags on a run, running or ended (a sweep's judgement of a trial after its end)."""
    client = MlflowClient(tracking_uri(tracking_cfg))
    for key, value in tags.items():
        _retry(client.set_tag, run_id, key, value)


def _transient(err: Exception) -> bool:
    """A store that does not answer (worth retrying), as opposed to one that refuses the call."""
    if isinstance(err, MlflowException):
        return err.error_code not in REFUSED_ERRORS
    return isinstance(err, (requests.RequestException, OSError, sqlalchemy.exc.OperationalError))


def flatten(tree: Any, prefix: str = "") -> dict[str, str]:
    """{"model": {"depth": 10}} -> {"model.depth": "10"}; lists stay whole, as one value."""
    if isinstance(tree, dict):
        flat: dict[str, str] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: str(tree)[:MAX_PARAM_CHARS]}


def run_dir_of(tracking_cfg, run_id: str, key: str) -> Path:
    """The directory a run wrote to (its `run_dir` tag); `key` is the argument that gave the run id."""
    uri = tracking_uri(tracking_cfg)
    if paths.missing_sqlite_store(uri):
        raise ConfigError(f"{key}={run_id} is not allowed: there is no MLflow store at tracking.uri={uri} (name the "
                          "store the run went to)")
    probe_store(tracking_cfg)  # a server that does not answer: one line now, not minutes of retries
    try:
        run = _retry(MlflowClient(uri).get_run, run_id)  # a file that is not a store fails as it is opened
    except Exception as err:
        raise ConfigError(f"{key}={run_id} is not allowed: it is not found in tracking.uri={uri} "
                          f"({store_error_line(err)})") from None
    run_dir = run.data.tags.get("run_dir")
    if not run_dir:
        raise ConfigError(f"{key}={run_id} is not allowed: that MLflow run has no run_dir tag; pass its "
                          "directory instead")
    return Path(run_dir)


def checkpoint_of_run(tracking_cfg, run_id: str) -> Path:
    """A run's final.pt: in its run directory, else its logged `checkpoint/` artifact."""
    local = run_dir_of(tracking_cfg, run_id, "run_id") / "final.pt"
    if local.is_file():
        return local
    client = MlflowClient(tracking_uri(tracking_cfg))
    try:
        folder = _retry(client.download_artifacts, run_id, "checkpoint")
    except Exception as err:
        raise FileNotFoundError(f"MLflow run {run_id!r} has neither {local} nor a logged checkpoint "
                                f"(train with tracking.log_checkpoint=true) ({store_error_line(err)})") from None
    return Path(folder) / "final.pt"


def log_metrics_to_run(uri: str, run_id: str, metrics: dict) -> None:
    """Adds metrics to an existing run (finished or not) in the store at `uri`, e.g. CORE computed later:
    each at the last step its key already has there, so that it becomes the run's latest value (MLflow
    shows the point of the highest step: at step 0, a CORE of the training's last step would hide it)."""
    missing = paths.missing_sqlite_store(uri)
    if missing:
        raise FileNotFoundError(f"there is no MLflow store at {missing}")
    client = MlflowClient(uri)
    now = _now_ms()
    logged = _retry(client.get_run, run_id).data.metrics

    def last_step(key: str) -> int:
        return max((m.step for m in _retry(client.get_metric_history, run_id, key)), default=0) if key in logged else 0

    _log_metrics(client, run_id, [Metric(k, float(v), now, last_step(k)) for k, v in metrics.items()
                                  if _is_number(v) and math.isfinite(v)])


def _experiment_id(client: MlflowClient, uri: str, name: str) -> str:
    with _store_lock(uri):  # two fresh workers must not both create the experiment
        found = _retry(client.get_experiment_by_name, name)
        if found is None:
            try:
                return _retry(client.create_experiment, name, artifact_location=_artifact_location(uri, name),
                              tags={CHARTS_VIEW_TAG: charts_view(), EXPERIMENT_KIND_TAG: MODEL_TRAINING})
            except MlflowException as err:  # a server store: another worker created it first
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                found = _retry(client.get_experiment_by_name, name)
        if found.lifecycle_stage == "deleted":
            raise ConfigError(f"tracking.experiment={name!r} is deleted in {uri}; restore it with "
                              f"`mlflow experiments restore` or choose another name")
        if EXPERIMENT_KIND_TAG not in found.tags:  # made before Frontier said its kind; a kind a user chose stays
            _retry(client.set_experiment_tag, found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
        return found.experiment_id


# The experiment's kind in MLflow's terms, model training: MLflow 3 UIs that read it open the experiment on
# its runs rather than on GenAI tracing onboarding (3.18's sidebar switch decides instead: docs/tracking.md).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


# The experiment's saved view "Frontier charts": MLflow's UI lists it under Views in the run list and opens
# it from `#/experiments/<id>/runs?viewStateShareKey=frontier-charts&compareRunsMode=CHART`.
CHARTS_VIEW_TAG = "mlflow.sharedViewState.frontier-charts"
CHARTS_VIEW_METRICS = ("val_bpb", "train/loss", "tokens_per_second")  # each against charged_seconds


def charts_view() -> str:
    """The saved view's tag value: the charts a budgeted run is judged by, first, each against the
    charged seconds (runs of different batch sizes or speeds line up in time, not in steps); MLflow adds
    a chart for every other metric after them."""
    section = "frontier"
    charts = [{"uuid": f"frontier-{i}", "type": "LINE", "metricSectionId": section, "isGenerated": False,
               "deleted": False, "runsCountToCompare": 10, "metricKey": key, "selectedMetricKeys": [key],
               "xAxisKey": "metric", "selectedXAxisMetricKey": "charged_seconds", "useGlobalXaxisKey": False,
               "xAxisScaleType": "linear", "scaleType": "linear", "lineSmoothness": 0, "useGlobalLineSmoothing": False,
               "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False}
              for i, key in enumerate(CHARTS_VIEW_METRICS)]
    state = {"compareRunCharts": charts, "isAccordionReordered": True, "hideEmptyCharts": True,
             "compareRunSections": [{"uuid": section, "name": "Frontier: against charged seconds", "display": True,
                                     "isReordered": True, "deleted": False, "isGenerated": False}]}
    now = int(time.time() * 1000)
    return json.dumps({"name": "Frontier charts", "createdAt": now, "updatedAt": now, "state": json.dumps(state)})


def _artifact_location(uri: str, experiment: str) -> str | None:
    """Next to a SQLite database; the server's choice for a server; the project's mlruns/ otherwise.

    (MLflow's own default for a database store is ./mlartifacts in whatever the working directory is.)
    """
    if _is_http(uri) or uri.startswith("databricks"):
        return None
    folder = re.sub(r"[^\w.-]", "_", experiment)
    db = paths.sqlite_path(uri)
    root = db.parent if db is not None else project_path("mlruns")
    return (root / "artifacts" / folder).as_uri()


def _source_tags() -> dict[str, str]:
    tags = {}
    if HydraConfig.initialized():
        tags["hydra.overrides"] = " ".join(HydraConfig.get().overrides.task)
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no") or ""
        tags["git.commit"] = commit.strip()
        tags["mlflow.source.git.commit"] = commit.strip()  # the UI shows this one on the run page
        tags["git.dirty"] = "true" if status.strip() else "false"
    return tags


def _git(*args: str) -> str | None:
    """Git's output in the project root, or None without git or outside a repository."""
    try:
        done = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _log_params(client: MlflowClient, run_id: str, params: dict[str, str]) -> None:
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), PARAMS_PER_BATCH):
        _log_batch(client, run_id, params=items[i:i + PARAMS_PER_BATCH])


def _log_metrics(client: MlflowClient, run_id: str, metrics: list[Metric]) -> None:
    for i in range(0, len(metrics), METRICS_PER_BATCH):
        _log_batch(client, run_id, metrics=metrics[i:i + METRICS_PER_BATCH])


def _log_batch(client: MlflowClient, run_id: str, **entities) -> None:
    _retry(client.log_batch, run_id, **entities)


def _retry(fn: Callable, *args, **kwargs):
    """Calls fn, retrying with backoff while SQLite reports another process holding the lock."""
    for attempt in range(LOCKED_RETRIES + 1):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            if "database is locked" not in str(err) or attempt == LOCKED_RETRIES:
                raise
            time.sleep(min(0.05 * 2 ** attempt, 5.0) * random.uniform(0.5, 1.5))


def _store_lock(uri: str):
    path = paths.sqlite_path(uri)
    if path is None:
        return contextlib.nullcontext()
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{path}.lock")


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _is_database(uri: str) -> bool:
    return uri.partition("://")[0].partition("+")[0] in ("postgresql", "mysql", "mssql")


def _probe(uri: str) -> None:
    """Any HTTP answer means the server is there; MLflow's own client would retry for minutes."""
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=PROBE_SECONDS)
    except requests.exceptions.SSLError:
        return  # something answers; TLS settings are MLflow's business (MLFLOW_TRACKING_INSECURE_TLS, ...)
    except requests.RequestException as err:
        raise ConfigError(f"tracking.uri={uri} is unreachable ({type(err).__name__}); start the server "
                          "or correct the URI") from None


def _probe_database(uri: str) -> None:
    """One connection to a database store: MLflow's SQL store retries its first one for two minutes."""
    timeout = {"connect_timeout": int(PROBE_SECONDS)} if not uri.startswith("mssql") else {}
    try:  # a database driver that is not installed fails here (ModuleNotFoundError)
        engine = sqlalchemy.create_engine(uri, poolclass=sqlalchemy.pool.NullPool, connect_args=timeout)
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)}); install the "
                          "database's driver or correct the URI") from None
    try:
        with engine.connect():
            pass
    except Exception as err:
        raise ConfigError(f"tracking.uri={uri} could not be opened ({store_error_line(err)}); start the "
                          "database server or correct the URI") from None
    finally:
        engine.dispose()


def _clip_tags(tags: dict[str, str]) -> dict[str, str]:
    return {k: v[:MAX_TAG_CHARS] for k, v in tags.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _ms(seconds: float) -> int:
    """MLflow's timestamp of a time in seconds: the live observer and `sync` turn a record's time into
    the same one."""
    return int(seconds * 1000)


def _now_ms() -> int:
    return _ms(time.time())


def _warn(message: str) -> None:
    print(f"warning: tracking: {message}", file=sys.stderr, flush=True)
