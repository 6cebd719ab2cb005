"""Hydra's command line with a user's mistake as one sentence: `error: KEY=VALUE is not allowed: ...`,
exit code 2, no traceback, and nothing written.

`@frontier.cli.main(config_path=..., config_name=...)` replaces `@hydra.main`; Hydra composes the config
once. The `Checks` callback the primary config names (hydra.callbacks) checks what Hydra composed, before
Hydra creates outputs/ or multirun/ or the task opens a store or reads data: every run it describes (each
point of a `--multirun` grid) is built into its typed config with every range check
(frontier.compose.check_composed). What Hydra, OmegaConf or a ConfigError raises outside the task function
is turned into one sentence; a composition Hydra refused is explained by composing again, on that failure
path only. `--cfg` shows a config that passes the schema's checks (not what running needs of this machine,
such as its data); --help and --info are passed to Hydra unchecked.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import signal
import sys
import threading
import warnings
from typing import Any, Callable, NoReturn, Optional

import hydra
import hydra.utils
import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import frontier
from frontier.compose import (NAME_ERRORS, PATH_SHAPE_ERRORS, check_arguments, check_composed, check_not_swept,
                              check_run, composer, explain_failure, logging_refused, one_sentence, parse_override,
                              raised_in, refused_path, traced)
from frontier.config import ConfigError, register_schemas
from frontier.paths import unwritable  # noqa: F401  bench takes it from here


def command(entry: Callable, startup_over: bool = True) -> Callable:
    """A command's entry point: Ctrl-C or SIGTERM ends it with one line and exit code 130 (the shell's
    for SIGINT), never a traceback: not the KeyboardInterrupt's, nor that of an error it caused (one
    that lands inside an import can leave a module half-made, which then fails in other ways).
    `startup_over`: its module's imports were its start-up (frontier.startup_over); a training
    command's start-up goes on to its first step."""

    @functools.wraps(entry)
    def run(*args, **kwargs) -> Any:
        if startup_over:
            frontier.startup_over()
        _interrupted.clear()
        previous = _take_signals()
        try:
            return entry(*args, **kwargs)
        except KeyboardInterrupt:
            _exit_interrupted(previous)
        except Exception as err:
            if _interrupted.is_set():
                _exit_interrupted(previous)
            refused = refused_path(err, sys.argv[1:], NAME_ERRORS)
            if refused is None:
                raise
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {refused}", file=sys.stderr)
            raise SystemExit(2) from None
        finally:  # unless the command chose otherwise meanwhile (the trainer ignores a late signal)
            # a command's process ignores a signal once its work is done: restored, the default handler
            # would end it silently with 143 (or -2) while Python shuts down, after it recorded success
            after = signal.SIG_IGN if frontier._started_as_a_command() else None
            for signum, handler in previous.items():
                if signal.getsignal(signum) is _on_interrupt:
                    signal.signal(signum, after or handler)

    return run


_interrupted = threading.Event()  # set by the handler `command` installs; errors after it are its doing


def print_help_if_asked(argv: list[str], usage: str) -> None:
    """-h or --help among a side command's arguments: its usage on stdout and exit 0, as argparse does."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(usage.strip())
        raise SystemExit(0)


def _exit_interrupted(taken: dict) -> NoReturn:
    """Exit 130 with one line. The command's process ignores a further signal from here on: one during
    its exit (a second Ctrl-C) had ended it by SIGINT itself, or with a traceback."""
    if frontier._started_as_a_command():
        for signum in taken:
            signal.signal(signum, signal.SIG_IGN)
    print("interrupted", file=sys.stderr)
    raise SystemExit(130) from None


def _on_interrupt(signum, frame) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


def _take_signals() -> dict:
    """SIGINT's and SIGTERM's handler becomes _on_interrupt (the previous ones are returned), each unless
    it is ignored (a background job's Ctrl-C) or owned by someone else (an application that embeds
    Frontier), or this is not the main thread, where no handler can be set."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    taken = {}
    for signum, default in frontier.STARTING_DEFAULTS.items():
        current = signal.getsignal(signum)
        if current in (default, frontier._interrupted_while_starting):
            signal.signal(signum, _on_interrupt)
            taken[signum] = current
    return taken


def main(config_path: str, config_name: str, user_errors: Callable[[], tuple[type[Exception], ...]] = tuple) -> Callable:
    """`hydra.main` whose user mistakes are one sentence and exit code 2. `user_errors()` gives the
    task's own mistake types (a --multirun job that raises one ends the command the same way, as does a
    check of the `Checks` callback; a function, so that they are imported only when needed)."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable:
        hydra_main = hydra.main(version_base="1.3", config_path=config_path, config_name=config_name)(task)

        @functools.partial(command, startup_over=False)  # over at the run's first step, or the sweep's start
        @functools.wraps(task)
        def entry(cfg_passthrough: Optional[DictConfig] = None) -> Any:
            if cfg_passthrough is not None:  # called as a function, as hydra.main allows
                return task(cfg_passthrough)
            register_schemas()  # the `frontier_schema` the primary config builds on
            args = None
            try:
                args = check_arguments(sys.argv[1:])
                if args.cfg:
                    check_shown(primary_dir(task, config_path, args), args.config_name or config_name, args)
                with hydra_raises():
                    return hydra_main()
            except (Exception, Refused) as raised:
                err = raised.error if isinstance(raised, Refused) else raised
                if not is_mistake(err, task, user_errors) or _interrupted.is_set():
                    raise err  # a mistake made by Ctrl-C (a module it left half-imported) is `command`'s to say
                why = None
                if args is not None and composing_error(err):
                    why = explain_failure(err, primary_dir(task, config_path, args), args.config_name or config_name,
                                          args)
                if os.environ.get("RANK", "0") == "0":  # under torchrun, one rank says it
                    print(f"error: {why or one_sentence(err)}", file=sys.stderr)
                raise SystemExit(2) from None

        return entry

    return decorate


def primary_dir(task: Callable, config_path: str, args) -> str:
    """The primary config's folder: --config-path, or the task's; a relative one beside the task's module."""
    path = args.config_path if args.config_path is not None else config_path
    return os.path.join(os.path.dirname(inspect.getfile(task)), path)


def check_shown(config_dir: str, config_name: str, args) -> None:
    """--cfg prints the config Hydra composes, and Hydra has no hook between the two: the config it shows is
    composed here first and checked against the schema (not what running needs of this machine, its data)."""
    overrides = [parse_override(arg) for arg in args.overrides]
    check_not_swept(overrides)  # --cfg shows one run's config
    with composer(config_dir, config_name, args.overrides, args.config_dir) as app:
        cfg = app.composed(overrides, lambda lines: app.load(lines, RunMode.RUN))
        check_run(app, cfg, overrides, None)
    if args.package not in (None, "_global_"):
        top = args.package.partition(".")[0]  # --cfg hydra shows the hydra node alone, job all but it
        shown = {"hydra": top == "hydra", "job": top != "hydra"}.get(args.cfg, True)
        try:
            found = OmegaConf.select(cfg, args.package) is not None
        except OmegaConfBaseException:  # there, but its value does not resolve: Hydra's to say
            found = True
        if not shown or not found:
            raise ConfigError(f"--package={args.package} is not allowed: the {args.cfg} config has no such key")


class Checks(Callback):
    """Named by the primary config (hydra.callbacks): Hydra calls it with the config it composed, before it
    writes anything (the run or sweep directory, its .hydra record), and it checks that config, once.
    `check`: the task's own checks of one run, `check(cfg, overrides)`, by their import path."""

    def __init__(self, check: Optional[str] = None):
        self.check = hydra.utils.get_method(check) if check else None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config)

    def _check(self, config: DictConfig) -> None:
        try:
            check_composed(config, GlobalHydra.instance().config_loader(), self.check)
        except Exception as err:  # Hydra makes a callback's Exception a warning, and goes on
            raise Refused(err) from err


class Refused(BaseException):
    """A `Checks` error on its way to `main` through Hydra, which lets a BaseException through."""

    def __init__(self, error: Exception):
        super().__init__(error)
        self.error = error


@contextlib.contextmanager
def hydra_raises():
    """Hydra prints its own errors (several lines, exit code 1) unless HYDRA_FULL_ERROR is set; then
    it raises them, and `main` says them in one sentence. Its warning of a hydra.searchpath entry that is
    not there (it then reports the presets that entry should have held as missing) is raised as an error."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", SEARCH_PATH_MISSING, UserWarning)
            yield
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


SEARCH_PATH_MISSING = r"provider=hydra\.searchpath in .* is not available"


def composing_error(err: Exception) -> bool:
    """An error Hydra raised as it composed a config (OmegaConf asserts on some overrides): explained by
    composing again."""
    return isinstance(err, (HydraException, OmegaConfBaseException, yaml.YAMLError, UserWarning)) \
        or any(code.co_name == "load_configuration" for code in traced(err))


def is_mistake(err: Exception, task: Callable, user_errors: Callable[[], tuple]) -> bool:
    if isinstance(err, ConfigError):
        return True
    if composing_error(err) or logging_refused(err) \
            or refused_path(err, [], PATH_SHAPE_ERRORS) is not None:
        return not raised_in(err, task.__code__)  # from the task's own code it is a bug, not the command line's
    return isinstance(err, user_errors())
