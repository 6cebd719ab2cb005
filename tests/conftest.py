"""Shared helpers: compose configs with Hydra's compose API and shrink them for the CPU."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import runpy
import shutil
import signal
import subprocess
import sys
import traceback
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

# Without a GPU, Triton's kernels run on CPU tensors through its interpreter, which has to be on before
# triton is first imported; anything may import it (torch.compile does), so it is set before all else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Each pytest-xdist worker's processes get their share of the cores: two workers whose runs each
# took every core made OpenMP's threads spin against each other, and two tiny runs side by side
# took 2.5x as long (read at startup by torch here and by every subprocess, sweep trials included).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)

# The commands under test get a Ctrl-C as they would at a terminal, however the suite was started: a
# shell starts a background job (`pytest &`, nohup) with SIGINT ignored, which its processes inherit.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from frontier.config import register_schemas  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SHARED = ROOT.parent / "shared"


def linked_data(shared: Path, folder: Path) -> Path:
    """`shared` (the data folder) again in `folder`, through links, with only the first and the last
    (validation) shard of text/wiki_en: the token cache a clone builds for the suite tokenizes a quarter
    of the text, and the tests, which train on a few thousand tokens, see the same layout."""
    def link(path: Path, target: Path) -> None:
        if path.is_symlink() and path.readlink() == target:  # made by an earlier run, or another worker
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        made = path.with_name(f".{path.name}.{os.getpid()}")
        made.unlink(missing_ok=True)
        made.symlink_to(target)
        os.replace(made, path)  # at once, over a link to where the data was before the checkout moved

    for entry in shared.iterdir():
        if entry.name != "text":
            link(folder / entry.name, entry)
    for entry in (shared / "text").iterdir():
        if entry.name != "wiki_en":
            link(folder / "text" / entry.name, entry)
    shards = sorted((shared / "text" / "wiki_en").glob("*.parquet"))
    for shard in (shards[0], shards[-1]):
        link(folder / "text" / "wiki_en" / shard.name, shard)
    return folder


# Every command the tests start reads its data from there: FRONTIER_DATA is the default of data.path
# (and eval.core_bundle) in each process they start, and FAST names it.
DATA = ROOT / ".cache" / "test-data"
if (SHARED / "data" / "text" / "wiki_en").is_dir():
    os.environ["FRONTIER_DATA"] = str(linked_data(SHARED / "data", DATA))
WIKI = DATA / "text" / "wiki_en"

# The suite's one tokenizer and token cache, the checkout's: pinned in every test run's data settings,
# so that a test which moves FRONTIER_HOME reads it rather than tokenize the shards again.
DATA_CACHE = f"data.cache_dir={ROOT / '.cache'}"

# A tiny model on the real Wikipedia shards: small vocab so the tokenizer trains in seconds, and
# steps of 8 rows (a quarter of tiny's batch), the CPU-seconds of a test run being mostly its steps.
# The budget is pinned: the default is sized to the machine (phase1 on an accelerator, smoke on a CPU).
FAST = [
    "model=tiny",
    "train.batch_tokens=2048",
    "budget=phase1",
    f"data.path={WIKI}",
    DATA_CACHE,
    "data.vocab_size=1024",
    "data.tokenizer_train_chars=2000000",
    "eval.checkpoint_tokens=4096",
    "eval.final_tokens=16384",
    "tracking.enabled=false",
]

# A sweep's trials at their smallest: a few steps, checkpoints at quarters, CORE on two items a task.
SWEEP_TINY = [
    "model=tiny", "data.vocab_size=1024", "data.tokenizer_train_chars=2000000", "precision=fp32",
    "budget.seconds=60", "budget.max_steps=4", "budget.excluded_steps=0",
    "train.batch_tokens=2048", "eval.checkpoint_tokens=2048", "eval.final_tokens=4096",
    "eval.every_fraction=0.25", "eval.core_max_per_task=2", "tracking.enabled=false",
]

# The multi-machine Optuna storage of the test machines (trust auth); tests skip, saying why, without it.
POSTGRES = "postgresql://postgres@127.0.0.1:5432/test"


def postgres_or_skip():
    from frontier.study import open_storage

    try:
        return open_storage(POSTGRES)
    except Exception as err:
        pytest.skip(f"no PostgreSQL server at {POSTGRES} ({type(err).__name__})")


@pytest.fixture(params=["journal", "postgresql"])
def shared_study(request, tmp_path):
    """(storage, study name) on each storage that drivers on several machines can share: a journal
    file, and PostgreSQL (skipped, saying why, where no server answers; the study is deleted after)."""
    import optuna

    name = f"test-{uuid.uuid4().hex[:8]}"
    if request.param == "journal":
        yield str(tmp_path / "study.journal"), name
        return
    storage = postgres_or_skip()
    yield POSTGRES, name
    with contextlib.suppress(KeyError):  # a test that failed before its study was made
        optuna.delete_study(study_name=name, storage=storage)


register_schemas()


def compose_config(overrides: list[str] = ()):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def run_cli(args: list[str], timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m frontier.train ARGS` from the project root, as a user would type it."""
    return subprocess.run([sys.executable, "-m", "frontier.train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def command_in_process(module: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` from the project root, run in this process as Python runs it (runpy, sys.argv),
    without a new interpreter's start and imports (most of the CPU of a command that refuses its input):
    its exit code, standard output and standard error, as subprocess.run gives them."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    out, err = io.StringIO(), io.StringIO()
    argv, cwd, environ = sys.argv, os.getcwd(), dict(os.environ)
    composing, run_config = GlobalHydra.instance().is_initialized(), HydraConfig.instance().cfg
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    os.chdir(ROOT)
    os.environ.update(env or {})
    sys.argv = [module, *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            # runpy's note that the module was imported before (by an earlier command here): a process starts afresh
            warnings.filterwarnings("ignore", r".* found in sys.modules after import of package", RuntimeWarning)
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as exit_:  # as the interpreter turns it into an exit code
                code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
                if isinstance(exit_.code, str):
                    print(exit_.code, file=sys.stderr)
            except Exception:  # a traceback and exit code 1, as from a process of its own
                traceback.print_exc()
                code = 1
    finally:
        sys.argv = argv
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        # what a command refused inside Hydra leaves set in this process: Hydra's state, its logging configuration
        if not composing:
            GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = run_config
        root.handlers[:], root.level = handlers, level
    return subprocess.CompletedProcess([sys.executable, "-m", module, *args], code, out.getvalue(), err.getvalue())


# Python's collector in each process started with gc_probe's environment: as its start-up imports
# frontier.data (the command line's checks import it), where the probe also leaves garbage in a cycle;
# the most objects frozen at any collection; and at its exit (after the command's own exit handlers),
# with whether that garbage was collected and what is still frozen, in PID.json beside this file
GC_PROBE = """
import atexit, gc, json, os, sys, weakref
seen = {"frozen": 0}
class Cycle:
    pass
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "frontier.data" and "startup" not in seen:
            seen["startup"] = gc.isenabled()
            garbage = Cycle()
            garbage.itself = garbage
            seen["garbage"] = weakref.ref(garbage)
        return None
sys.meta_path.insert(0, Probe())
gc.callbacks.append(lambda phase, info: seen.update(frozen=max(seen["frozen"], gc.get_freeze_count())))
def record():
    garbage = seen.pop("garbage", None)
    with open(os.path.join(os.path.dirname(__file__), f"{os.getpid()}.json"), "w") as out:
        json.dump({"argv": sys.argv, **seen, "exit": gc.isenabled(), "frozen_at_exit": gc.get_freeze_count(),
                   "garbage_collected": garbage is not None and garbage() is None}, out)
atexit.register(record)
"""


def gc_probe(folder: Path) -> dict:
    """The environment under which each Python process records its collector's state in `folder`."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(GC_PROBE)
    return {"PYTHONPATH": str(folder)}


def gc_records(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in folder.glob("*.json")]


def spread(rows: list[tuple], ids: list[str], every: int) -> list:
    """A table's rows as parameters: the whole suite checks each, the fast tier (-m "not slow") every
    `every`-th, a spread across the table."""
    return [pytest.param(*row, id=name, marks=() if i % every == 0 else pytest.mark.slow)
            for i, (row, name) in enumerate(zip(rows, ids))]


@pytest.fixture(scope="session")
def wiki():
    if not WIKI.is_dir():
        pytest.skip(f"shared data not found at {WIKI}")
    return WIKI


@pytest.fixture(scope="session")
def template_db(tmp_path_factory) -> Path:
    """An empty MLflow store with its schema: creating one takes seconds, copying it does not."""
    from frontier import tracking

    path = tmp_path_factory.mktemp("template") / "mlflow.db"
    tracking.ensure_store(f"sqlite:///{path}")
    return path


def store_in(folder: Path, template_db: Path) -> str:
    """A fresh SQLite store in `folder`, copied from the template; its URI."""
    shutil.copy(template_db, folder / "mlflow.db")
    return f"sqlite:///{folder / 'mlflow.db'}"


@pytest.fixture
def mlflow_store(tmp_path, template_db) -> str:
    """The URI of an empty MLflow store at tmp_path/mlflow.db, for tests whose subject is not its creation."""
    return store_in(tmp_path, template_db)


@pytest.fixture
def small_disk(tmp_path, request):
    """A 4 MiB tmpfs of its own (another size by indirect parametrisation), so that the store's disk can
    really fill up (needs root to mount)."""
    folder = tmp_path / "disk"
    folder.mkdir()
    size = getattr(request, "param", "4m")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip() or 'mount failed'})")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:  # until ENOSPC: the disk is full
        while True:
            f.write(b"\0" * 4096)
    return filler
