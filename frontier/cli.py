"""Hydra's command line with a user's mistake as one sentence: `error: KEY=VALUE is not allowed: ...`,
exit code 2, no traceback, and nothing written.

`@frontier.cli.main(config_path=..., config_name=...)` replaces `@hydra.main`. Before Hydra runs,
and so before it creates outputs/ or multirun/ or the task opens a store or reads data, the
command line is parsed and composed as Hydra will compose it (frontier.compose), and every run it describes (each
point of a `--multirun` grid) is built into its typed config with every range check
(frontier.config.to_config). Whatever Hydra, OmegaConf or a ConfigError still raises later (the
sweeper's own checks, for one) outside the task function is turned into one sentence as well.
`--cfg` shows a config that passes the schema's checks (not what running needs of this machine, such
as its data); --help and --info are passed to Hydra unchecked.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import unittest.mock
from typing import Any, Callable, NoReturn, Optional

import hydra
import yaml
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra._internal.hydra import Hydra
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

import frontier
from frontier.compose import (NAME_ERRORS, PATH_SHAPE_ERRORS, Composed, check_command_line, logging_refused,
                              one_sentence, raised_in, refused_path)
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


def main(config_path: str, config_name: str, user_errors: Callable[[], tuple[type[Exception], ...]] = tuple,
         check: Optional[Callable[[DictConfig, list[Override]], None]] = None) -> Callable:
    """`hydra.main` whose user mistakes are one sentence and exit code 2. `user_errors()` gives the
    task's own mistake types (a --multirun job that raises one ends the command the same way; a
    function, so that they are imported only when needed); `check(cfg, overrides)`, the task's own
    side-effect-free checks of one composed run and the overrides that made it, is done before Hydra runs."""

    def decorate(task: Callable[[DictConfig], Any]) -> Callable:
        hydra_main = hydra.main(version_base="1.3", config_path=config_path, config_name=config_name)(task)

        @functools.partial(command, startup_over=False)  # over at the run's first step, or the sweep's start
        @functools.wraps(task)
        def entry(cfg_passthrough: Optional[DictConfig] = None) -> Any:
            if cfg_passthrough is not None:  # called as a function, as hydra.main allows
                return task(cfg_passthrough)
            register_schemas()  # the `frontier_schema` the primary config builds on
            try:
                composed = check_command_line(task, config_path, config_name, sys.argv[1:], check)
                with hydra_raises(), composed_once(composed):
                    return hydra_main()
            except Exception as err:
                if not is_mistake(err, task, user_errors) or _interrupted.is_set():
                    raise  # a mistake made by Ctrl-C (a module it left half-imported) is `command`'s to say
                if os.environ.get("RANK", "0") == "0":  # under torchrun, one rank says it
                    print(f"error: {one_sentence(err)}", file=sys.stderr)
                raise SystemExit(2) from None

        return entry

    return decorate


@contextlib.contextmanager
def hydra_raises():
    """Hydra prints its own errors (several lines, exit code 1) unless HYDRA_FULL_ERROR is set; then
    it raises them, and `main` says them in one sentence."""
    before = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


@contextlib.contextmanager
def composed_once(composed: Optional[Composed]):
    """Hydra composes the whole config twice before its task runs: to read its hydra.mode, then to run
    it. The check composed the same config already (a tenth of a CPU-second each time), so Hydra is
    given its mode, and then the config itself for its first composition of the same command line."""
    if composed is None:
        yield
        return
    unused = [composed]
    load_configuration = ConfigLoaderImpl.load_configuration

    def load_once(loader, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        given = unused.pop() if unused else None  # Hydra's first composition only: later ones differ
        if given is not None and from_shell and validate_sweep_overrides:
            cfg = composed_again(given, config_name, overrides, run_mode)
            if cfg is not None:
                return cfg
        return load_configuration(loader, config_name, overrides, run_mode, from_shell, validate_sweep_overrides)

    mode = composed.cfg.hydra.mode
    with unittest.mock.patch.object(Hydra, "get_mode", lambda self, config_name, overrides: mode), \
            unittest.mock.patch.object(ConfigLoaderImpl, "load_configuration", load_once):
        yield


def composed_again(composed: Composed, config_name: str, overrides: list[str],
                   run_mode: RunMode) -> Optional[DictConfig]:
    """The config Hydra composes from these arguments, where it is `composed`'s: the same command line, or
    that line and the hydra.mode=MODE that Hydra adds to it when the config sets no mode; else None."""
    lines = list(overrides)
    added = lines[len(composed.lines):]
    if ((config_name, run_mode, lines[:len(composed.lines)]) != (composed.config_name, composed.mode, composed.lines)
            or added not in ([], [f"hydra.mode={run_mode.name}"])):
        return None
    cfg = composed.cfg
    if added:  # as Hydra applies a hydra override: the value set, the line recorded
        cfg.hydra.mode = run_mode
        cfg.hydra.overrides.hydra.append(added[0])
    return cfg


def is_mistake(err: Exception, task: Callable, user_errors: Callable[[], tuple]) -> bool:
    if isinstance(err, ConfigError):
        return True
    if isinstance(err, (HydraException, OmegaConfBaseException, yaml.YAMLError)) or logging_refused(err) \
            or refused_path(err, [], PATH_SHAPE_ERRORS) is not None:
        return not raised_in(err, task.__code__)  # from the task's own code it is a bug, not the command line's
    return isinstance(err, user_errors())
