"""Where Frontier's files are: resolved in one place, the same wherever a command is launched.

- home: `paths.home`, else FRONTIER_HOME, else the root of a source checkout (where pyproject.toml
  and conf/ sit beside frontier/), else ~/.frontier. The MLflow store (mlruns/), the caches
  (.cache/) and run outputs (outputs/, multirun/) live under it.
- data: `paths.data`, else FRONTIER_DATA, else <checkout>/../shared/data, else <home>/data: the text
  shards (data.path) and the CORE bundle (eval.core_bundle) default to folders in it.
- configs: a checkout's conf/ and sweeps/, else the copies shipped inside the installed package.
  The sweeper plugin the configs name is found wherever a command runs (see conf_dir).

The config group `paths` (conf/paths/default.yaml) shows the resolved values; `paths.home=...` or
`paths.data=...` on a command line win over the environment.
"""
from __future__ import annotations

import errno
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = PACKAGE.parent
IN_CHECKOUT = (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "conf").is_dir()

_chosen: dict[str, Path] = {}  # set from the composed config by use()


def home() -> Path:
    if "home" in _chosen:
        return _chosen["home"]
    if os.environ.get("FRONTIER_HOME"):
        return Path(os.environ["FRONTIER_HOME"]).expanduser().resolve()
    return _CHECKOUT if IN_CHECKOUT else Path.home() / ".frontier"


def data() -> Path:
    if "data" in _chosen:
        return _chosen["data"]
    if os.environ.get("FRONTIER_DATA"):
        return Path(os.environ["FRONTIER_DATA"]).expanduser().resolve()
    return (_CHECKOUT.parent / "shared" / "data") if IN_CHECKOUT else home() / "data"


def under_home(path: str | Path) -> Path:
    """A relative path is taken from home; an absolute one is kept."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else home() / path


def database_url(url: str) -> str:
    """A database URL as SQLAlchemy should open it: SQLAlchemy 2.1 reads postgresql:// as psycopg 3, so
    where only psycopg2 is installed the URL names it."""
    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URL; None for any other URL and for `:memory:`."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].partition("?")[0]
    return Path(path) if path and path != ":memory:" else None


def missing_sqlite_store(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URL when it is not a file: a command that only reads a
    store must say so rather than open it, which would create an empty store there. None otherwise."""
    path = sqlite_path(uri)
    return path if path is not None and not path.expanduser().is_file() else None


def is_sqlite_file(path: Path) -> bool:
    """A file SQLite can open as a database: empty, or starting with SQLite's header."""
    with open(path, "rb") as f:
        head = f.read(16)
    return head in (b"", b"SQLite format 3\x00")


def store_under_home(spec: str) -> str:
    """A store given as a relative file path or a relative `sqlite:///` URL is taken from home, like
    every other path Frontier resolves, so a command finds the same store wherever it runs;
    absolute paths and server URLs are kept."""
    path = sqlite_path(spec)
    if path is not None and not path.expanduser().is_absolute():
        _, sep, query = spec.partition("?")
        return f"sqlite:///{under_home(path)}{sep}{query}"
    return spec if "://" in spec else str(under_home(spec))


def conf_dir() -> Path:
    if IN_CHECKOUT and str(_CHECKOUT) not in sys.path:
        # Hydra finds plugins by listing the folders of the `hydra_plugins` namespace; a plain
        # editable install's import hook is not a folder, so outside the checkout the sweeper
        # (hydra/sweeper=frontier, in the primary config) would be missing. The root lists it.
        sys.path.append(str(_CHECKOUT))
    return _CHECKOUT / "conf" if IN_CHECKOUT else PACKAGE / "conf"


def sweeps_dir() -> Path:
    return _CHECKOUT / "sweeps" if IN_CHECKOUT else PACKAGE / "sweeps"


def use(paths_cfg) -> None:
    """Makes the composed config's `paths` the answer of home() and data() in this process."""
    for key in ("home", "data"):
        value = getattr(paths_cfg, key, None)
        if value:
            _chosen[key] = Path(value).expanduser().resolve()


def if_resumed(resume, then, otherwise):
    """`then` when `resume=` names a run directory (one holding resume.pt), else `otherwise`: conf/config.yaml
    points hydra.run.dir at the resumed run, so that a resume leaves no outputs/ folder of its own (a
    run given by its MLflow run id is found only later, in the store, and keeps the default)."""
    return then if resume is not None and (Path(str(resume)).expanduser() / "resume.pt").is_file() else otherwise


# ${frontier.home:} and ${frontier.data:} in conf/paths/default.yaml, ${frontier.if_resumed:...} in conf/config.yaml
OmegaConf.register_new_resolver("frontier.home", lambda: str(home()), replace=True)
OmegaConf.register_new_resolver("frontier.data", lambda: str(data()), replace=True)
OmegaConf.register_new_resolver("frontier.if_resumed", if_resumed, replace=True)


def unwritable(path: Path) -> tuple[Path, str] | None:
    """None when the directory `path` can be created or written to; else its nearest existing parent
    and why not. Found out by a folder made and removed again there (permission bits alone mislead root)."""
    existing = path.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return existing, os.strerror(errno.ENOTDIR)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".frontier-check-", dir=existing))
        return None
    except OSError as err:
        return existing, err.strerror or type(err).__name__
