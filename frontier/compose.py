"""Each mistake of a command line in one sentence.

Hydra composes the command line, once; `check_composed` checks what it composed (frontier.cli calls it
from a Hydra callback, before Hydra writes anything): every run it describes built into its typed config
with every range check, a ConfigError naming the override at fault. Where Hydra itself refuses the
command line, its error names neither the override nor what is allowed: `explain_failure` composes again,
on that failure path only, to find them (`Composer.explain`). `one_sentence` words any other error the
command line caused, which frontier.cli prints with exit code 2.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import sys
import types
import typing
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.config_loader import ConfigLoader
from hydra.core.global_hydra import GlobalHydra
from hydra.core.object_type import ObjectType
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import (InterpolationKeyError, InterpolationResolutionError, MissingMandatoryValue,
                              OmegaConfBaseException, ValidationError)

from frontier.config import SCHEMA_NAME, Config, ConfigError, error_line, key_hint, to_config
from frontier.paths import unwritable

GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
GRID_LIMIT = 10_000  # runs in one --multirun grid: each is a budgeted training run
FRONTIER_SWEEPER = "hydra_plugins.frontier_sweeper.frontier_sweeper.FrontierSweeper"  # as its plugin registers it
NAME_ERRORS = (errno.ENAMETOOLONG, errno.ELOOP)  # a path the OS refuses by its shape, whoever touches it


def refused_path(err: BaseException, argv: list[str], errors: tuple[int, ...]) -> Optional[str]:
    """A path the OS refuses by its shape (a name too long, a symlink loop; with ENOTDIR, a file where a
    folder goes) as one sentence naming the argument that gave it, or None for any other error. These
    come from wherever the path is first touched (a check, Hydra's set-up, pathlib), never as a mistake."""
    if isinstance(err, OSError) and err.errno in errors:
        path, reason = err.filename, os.strerror(err.errno)
    elif isinstance(err, RuntimeError) and str(err).startswith("Symlink loop from") and errno.ELOOP in errors:
        path, reason = str(err).partition("from ")[2].strip("'\""), os.strerror(errno.ELOOP)  # pathlib, Python < 3.13
    else:
        return None
    path = str(path) if path is not None else ""
    for arg in reversed(argv):
        value = arg.partition("=")[2] or arg
        if path and value and (value in path or path in value):
            return f"{clipped(arg)} is not allowed: {reason}" + (f" ({clipped(path)})" if path != value else "")
    return f"{clipped(path) or 'a path'} is not allowed: {reason}"


def clipped(text: str, limit: int = 120) -> str:
    """A value as an error line shows it: a very long one by its start and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


PATH_SHAPE_ERRORS = (*NAME_ERRORS, errno.ENOTDIR)  # before the task runs, a file where a folder goes too


def logging_refused(err: BaseException) -> bool:
    """Hydra's logging set-up refused `hydra.job_logging` / `hydra.hydra_logging` (a level that is none,
    a log file that cannot be opened): Python's logging.config raised it."""
    return any(code.co_filename.endswith(os.path.join("logging", "config.py")) for code in traced(err))


def raised_in(err: BaseException, code) -> bool:
    return any(traced_code is code for traced_code in traced(err))


def traced(err: BaseException) -> Iterator[types.CodeType]:
    """The code of each frame `err` passed through, outermost first."""
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def one_sentence(err: BaseException) -> str:
    if isinstance(err, ConfigError):
        return str(err)
    refused = refused_path(err, sys.argv[1:], PATH_SHAPE_ERRORS)
    if refused is not None:
        return refused
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        return yaml_problem(err)
    if logging_refused(err):
        cause = err.__cause__ or err.__context__
        return (f"hydra.job_logging / hydra.hydra_logging is not allowed as given: {error_line(err, named=False)}"
                + (f" ({error_line(cause)})" if cause is not None else ""))
    text = error_line(err, named=False)
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and str(cause).strip():
        text = f"{text.rstrip('.')}: {error_line(cause, named=False)}"
    return text


def yaml_problem(err: yaml.MarkedYAMLError) -> str:
    """A config file that is not YAML, by its path, line and column (PyYAML's text spans several lines)."""
    mark = err.problem_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    context = err.context
    if context and err.context_mark is not None and err.context_mark.line != mark.line:
        context += f" from line {err.context_mark.line + 1}, column {err.context_mark.column + 1}"
    return f"{mark.name} is not valid YAML: {where}: {err.problem}" + (f" ({context})" if context else "")


def check_arguments(argv: list[str]):
    """The parsed arguments, with what Hydra's parser and its flags refuse in several lines (or not at all)
    refused in one sentence: found from the arguments alone, nothing composed."""
    args = parse_args(argv)
    commands = [name for name, given in (("--run", args.run), ("--multirun", args.multirun), ("--cfg", args.cfg),
                                         ("--info", args.info), ("--shell-completion", args.shell_completion)) if given]
    if len(commands) > 1:
        raise ConfigError(f"{' and '.join(commands)} are not allowed together: give one of them")
    if args.resolve and not (args.cfg or args.help):
        raise ConfigError("--resolve is not allowed alone: it goes with --cfg or --help")
    if args.experimental_rerun is not None and not Path(args.experimental_rerun).is_file():
        raise ConfigError(f"--experimental-rerun={args.experimental_rerun} is not allowed: it is not a file (give "
                          "the config.pickle of an earlier run's .hydra folder)")
    if args.shell_completion and not any(arg.partition("=")[0] in ("install", "uninstall", "query")
                                         for arg in args.overrides):
        raise ConfigError("--shell-completion is not allowed alone: add install=SHELL, uninstall=SHELL or "
                          "query=SHELL (e.g. install=bash)")
    if args.config_dir is not None and not Path(args.config_dir).is_dir():
        raise ConfigError(f"--config-dir={args.config_dir} is not allowed: it is not a directory")
    return args


def parse_args(argv: list[str]):
    parser = get_args_parser()  # the parser hydra.main reads its command line with

    def refuse(message: str) -> None:
        what, _, rest = message.partition(": ")
        if what == "unrecognized arguments":
            raise ConfigError(f"{rest} is not allowed: not an option of this command; options go before the "
                              "overrides (see --help)")
        raise ConfigError(f"{message} (see --help)")

    parser.error = refuse  # argparse would print its usage and a second line
    return parser.parse_args(argv)


def parse_override(arg: str) -> Override:
    try:
        override = OverridesParser.create().parse_override(arg)
        if override.key_or_group:
            return override
    except HydraException:
        pass
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise ConfigError(f"{clipped(arg)} is not allowed: {error_line(err, named=False)}") from None
    if "=" not in arg and not arg.startswith("~"):
        raise ConfigError(f"{arg!r} is not allowed: an override is KEY=VALUE (e.g. {arg}=...), "
                          f"+KEY=VALUE or ~KEY; grammar: {GRAMMAR}")
    raise ConfigError(f"{arg!r} is not allowed: it is not an override Hydra can read; write KEY=VALUE with "
                      "a number, a word, a quoted string, a [list] or a sweep such as a,b (values with "
                      f"spaces, = or brackets in quotes); grammar: {GRAMMAR}")


def explain_failure(err: Exception, config_dir: str, config_name: str, args) -> Optional[str]:
    """Why Hydra could not compose this command line, in one sentence naming the override at fault; None
    where the command line composes (the error came from elsewhere). Hydra's own error names neither the
    override nor what is allowed: the command line is composed again to find them, on this failure path only."""
    try:
        overrides = [parse_override(arg) for arg in args.overrides]  # a line Hydra cannot read, by its own words
        if isinstance(err, UserWarning):  # Hydra's warning of a search path that is not there, made an error
            check_search_path(str(err), overrides)
        multirun = args.multirun or any(arg.replace(" ", "") == "hydra.mode=MULTIRUN" for arg in args.overrides)
        if not multirun:
            check_not_swept(overrides)
        with composer(config_dir, config_name, args.overrides, args.config_dir) as app:
            if config_name not in app.primary_configs():  # Hydra's message names neither the option nor the choices
                choices = app.primary_configs()
                if args.config_path is not None and not choices:
                    raise ConfigError(f"--config-path={args.config_path} is not allowed: no config is there (it "
                                      "takes a folder of YAML configs; a relative path is read from the frontier "
                                      "package)")
                raise ConfigError(f"--config-name={config_name} is not allowed: there is no such primary config; "
                                  f"choose one of {', '.join(choices)}")
            mode = RunMode.MULTIRUN if multirun else RunMode.RUN
            culprit = app.culprit(overrides, lambda lines: app.load(lines, mode))
    except ConfigError as mistake:
        return str(mistake)
    except Exception:  # the command line does not compose as hydra.main set it up: Hydra's own words then
        return None
    return culprit[1] if culprit is not None else None


def check_not_swept(overrides: list[Override]) -> None:
    for override in overrides:
        if override.is_sweep_override() and not override.is_hydra_override():
            raise ConfigError(f"{override.input_line} is not allowed: a comma list or sweep function sweeps over "
                              "values, which needs --multirun (quote a value that holds a comma: key='a,b'; a list "
                              "is key=[a,b])")


def run_config(config_dir: str, overrides: list[str], config_name: str = "config") -> Config:
    """One run's typed config as Hydra's compose API composes it, for a command that takes the trainer's
    overrides (frontier.bench, frontier.model_card): a mistake is a ConfigError naming the override."""
    parsed = [parse_override(line) for line in overrides]
    check_not_swept(parsed)
    with composer(config_dir, config_name, overrides) as app:
        cfg = app.composed(parsed, lambda lines: app.load(lines, RunMode.RUN))
        return check_run(app, cfg, parsed, None)


def check_composed(cfg: DictConfig, loader: ConfigLoader,
                   check: Optional[Callable[[DictConfig, list[Override]], None]]) -> None:
    """The config Hydra composed for a run or a multirun, checked before Hydra writes anything: every run it
    describes (each point of a --multirun grid) built into its typed config with every range check, and the
    task's own `check(cfg, overrides)` of what running needs; its run or sweep directory can be created."""
    hydra_lines, task_lines = (OmegaConf.to_container(cfg.hydra.overrides[kind], resolve=False)  # as Hydra reads them
                               for kind in ("hydra", "task"))
    app = Composer(loader, cfg.hydra.job.config_name, searchpath(hydra_lines))
    overrides = [parse_override(line) for line in task_lines]
    if cfg.hydra.mode == RunMode.RUN:
        check_run(app, cfg, overrides, check)
        check_writable(cfg, "hydra.run.dir")
        check_run_dir_free(cfg, "hydra.run.dir")  # Hydra would write its .hydra record over that run's
        for key in ("hydra.job.name", "hydra.output_subdir"):  # Hydra resolves them after it made the run dir
            selected(cfg, key)
        return
    for override in overrides:  # Hydra would drop these silently: the defaults would run
        if override.is_sweep_override() and (override.key_or_group == "sweep"
                                             or override.key_or_group.startswith("sweep.")):
            raise ConfigError(f"{override.input_line} is not allowed: a sweep's own settings cannot be "
                              "swept (one preset and one value of each sweep.* key per sweep); sweep over "
                              "the trials' keys instead, e.g. model=base,wide or "
                              "'optim.matrix_lr=interval(0.01,0.1)'")
    check_writable(cfg, "hydra.sweep.dir")
    for key in ("hydra.sweep.subdir", "hydra.job.name", "hydra.output_subdir"):
        selected(cfg, key)
    if cfg.get("sweep") is not None:  # an Optuna search: a run's checks on its fixed overrides' values;
        sweeper = cfg.hydra.sweeper.get("_target_", "")
        if sweeper != FRONTIER_SWEEPER:  # another sweeper would run the base config, the search dropped
            chosen = next((line for line in hydra_lines if line.startswith("hydra/sweeper=")), sweeper)
            raise ConfigError(f"{chosen} is not allowed with sweep={cfg.sweep.name}: only the frontier "
                              "sweeper (hydra/sweeper=frontier, the default) runs a sweep preset's search; "
                              "another would train the base config and drop the search space")
        # the sweeper checks the search's settings and space, then what running needs (`check`, which
        # imports torch and opens the store), then every trial's values
        check_run(app, cfg, overrides, None)
        return
    # Hydra's grid: every point must be a valid run, composed as its launcher will compose it, its values
    # checked first, before the checks that import torch
    points = [(point, app.composed(point, lambda lines: loader.load_sweep_config(cfg, lines)))
              for point in grid(cfg, overrides)]
    for point, point_cfg in points:
        check_run(app, point_cfg, point, None)
    for point, point_cfg in points:
        check_run(app, point_cfg, point, check)


def searchpath(lines: list[str]) -> list[str]:
    """The overrides among `lines` that change where Hydra finds configs."""
    return [line for line in lines if line.lstrip("+").partition("=")[0] == "hydra.searchpath"]


class Composer:
    """Hydra's composition through its config loader, to name the override at fault where it fails."""

    def __init__(self, loader: ConfigLoader, config_name: str, lines: list[str] = ()):
        self.loader, self.config_name, self.lines = loader, config_name, list(lines)

    def load(self, lines: list[str], mode: RunMode) -> DictConfig:
        return self.loader.load_configuration(config_name=self.config_name, overrides=self.lines + list(lines),
                                              run_mode=mode, from_shell=True)

    def composed(self, overrides: list[Override], compose: Callable[[list[str]], DictConfig]) -> DictConfig:
        """`compose`'s config of these overrides; where it fails, a ConfigError naming the override at fault."""
        try:
            return compose([o.input_line for o in overrides])
        except Exception:
            pass
        culprit = self.culprit(overrides, compose)
        if culprit is None:
            raise ConfigError(f"{' '.join(o.input_line for o in overrides)} is not allowed: these overrides do not "
                              "compose together")
        raise ConfigError(culprit[1])

    def culprit(self, overrides: list[Override],
                compose: Callable[[list[str]], DictConfig]) -> Optional[tuple[Override, str]]:
        """The first override `compose` cannot add to those before it, and why in words; None if each
        composes. Hydra applies the config-group choices before the values, whatever their order: so does
        the search, or a value under a group chosen later (sweep.n_trials=3 sweep=lr) would be blamed."""
        overrides = sorted(overrides, key=lambda o: (o.key_or_group != "hydra.searchpath",  # where groups are found
                                                     o.is_delete() or not self.is_group(o.key_or_group)))
        with warnings.catch_warnings():  # Hydra's warnings of what it composes: the one sentence says what matters
            warnings.simplefilter("ignore")
            try:
                compose([o.input_line for o in overrides])
            except Exception as err:
                error = err
            else:
                return None
            before = compose([])  # the config of overrides[:works]
            # A later override cannot mend a composition an earlier one broke: bisect for the first that
            # breaks it, in a few compositions (a third of a second each), not one per override.
            works, breaks = 0, len(overrides)
            while breaks - works > 1:
                middle = (works + breaks) // 2
                try:
                    config = compose([o.input_line for o in overrides[:middle]])
                except Exception as err:
                    breaks, error = middle, err
                else:
                    works, before = middle, config
        return overrides[works], self.explain(overrides[works], error, before)

    def primary_configs(self) -> list[str]:
        """The config names --config-name can take (Hydra's placeholder and the bare schema left out)."""
        names = self.loader.get_group_options("", results_filter=ObjectType.CONFIG, overrides=self.lines)
        return [name for name in names if not name.startswith("_") and name != SCHEMA_NAME]

    def options(self, group: str) -> list[str]:
        return self._options(group, ObjectType.CONFIG) if self.is_group(group) else []

    def is_group(self, key: str) -> bool:
        parent, _, name = key.rpartition("/")
        return bool(name) and name in self._options(parent, ObjectType.GROUP)

    def _options(self, group: str, kind: ObjectType) -> list[str]:
        return self.loader.get_group_options(group, results_filter=kind, config_name=self.config_name,
                                             overrides=self.lines)

    def explain(self, override: Override, err: Exception, before: DictConfig) -> str:
        """Why `override` does not compose onto `before`, in words."""
        line, key = override.input_line, override.key_or_group
        missing = re.match(r"In '([^']+)': Could not load '([^']+)'", str(err))
        if isinstance(err, MissingConfigException) and missing and missing[1] != self.config_name:
            # the chosen preset's own defaults list names it (the primary's is where the override's choice goes)
            where, entry = missing.groups()
            group, _, name = entry.rpartition("/")
            return (f"{line} is not allowed: in its config {where}, the defaults entry {name} is not there"
                    + (f"; {group} has {', '.join(self.options(group))}" if self.is_group(group) else ""))
        if isinstance(err, MissingConfigException) and self.is_group(key):
            return f"{line} is not allowed: {key} has no such option; choose one of {', '.join(self.options(key))}"
        if override.is_delete() and self.is_group(key):
            return f"{line} is not allowed: {key} is required; choose one of {', '.join(self.options(key))}"
        if override.is_add() and self.is_group(key):
            return f"{line} is not allowed: {key} is chosen already; write {line.lstrip('+')} without +"
        problem = key_problem(before, key, self.options)
        if problem is not None:
            return f"{line} is not allowed: {problem}"
        if override.is_add():
            return f"{line} is not allowed: {key} exists already; set it without +: {line.lstrip('+')}"
        if override.is_delete():
            return f"{line} is not allowed: {key} is part of the schema and cannot be deleted; set it instead"
        cause = err.__cause__ if err.__cause__ is not None else err
        if isinstance(cause, ValidationError):
            expected = allowed_type(before, key)
            if expected:
                return f"{line} is not allowed: must be {expected}"
        # a config file the override chose (a user's preset) holds the bad key or value: Hydra says which
        # on later lines of its message, which one sentence would drop
        inside = re.match(r"In '([^']+)': \w+ raised while composing config:\n(.*?)\n\s*full_key: (\S+)", str(err),
                          re.S)
        if inside:
            where, problem, full_key = inside.groups()
            value = re.match(r"Value '(.*)' of type", problem)
            expected = allowed_type(before, full_key)
            if value and expected:
                problem = f"{full_key}={value.group(1)} must be {expected}"
            else:  # the schema first: the group's node is still null in `before` (sweep: null)
                problem = (schema_key_problem(before, full_key) or key_problem(before, full_key, self.options)
                           or f"{full_key}: {problem.strip()}")
            return f"{line} is not allowed: in its config {where}, {problem}"
        return f"{line} is not allowed: {one_sentence(err)}"


def check_search_path(warning: str, overrides: list[Override]) -> None:
    """Hydra only warns (twice) of a hydra.searchpath entry that is not there, and then reports the
    presets it should have held as missing."""
    missing = re.match(r"provider=hydra\.searchpath in (\S+), path=(.*) is not available", warning)
    if missing:
        where, path = missing.groups()
        given = next((o.input_line for o in reversed(overrides) if o.key_or_group == "hydra.searchpath"),
                     f"hydra.searchpath (in the {where} config)")
        raise ConfigError(f"{given} is not allowed: {path} is not there (an entry is a folder, file:///ABS/PATH, "
                          "or a package, pkg://NAME)")


@contextlib.contextmanager
def composer(config_dir: str, config_name: str, overrides: list[str],
             extra_dir: Optional[str] = None) -> Iterator[Composer]:
    """Hydra initialized through its compose API as hydra.main initializes it for a command line:
    `config_dir` holds the primary config (--config-path), `extra_dir` is --config-dir."""
    lines = searchpath(overrides)
    if extra_dir is not None:  # hydra.main searches it after the primary config's folder, as a searchpath entry
        dirs = [os.path.abspath(config_dir), os.path.abspath(extra_dir)]
        if not os.path.isfile(os.path.join(dirs[0], f"{config_name}.yaml")):  # the primary config is its own
            dirs.reverse()
        given = [o.value() for o in map(parse_override, lines) if isinstance(o.value(), list)]
        lines = [f"hydra.searchpath=[{','.join([f'file://{dirs[1]}', *(given[-1] if given else [])])}]"]
        config_dir = dirs[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with initialize_config_dir(config_dir=os.path.abspath(config_dir), version_base="1.3"):
            yield Composer(GlobalHydra.instance().config_loader(), config_name, lines)


def task_part(cfg: DictConfig) -> DictConfig:
    """What the task function receives: the config without its hydra node."""
    task_cfg = cfg.copy()
    with open_dict(task_cfg):
        task_cfg.pop("hydra", None)
    return task_cfg


def check_run(app: Composer, cfg: DictConfig, overrides: list[Override],
              check: Optional[Callable[[DictConfig, list[Override]], None]]) -> Config:
    """One run's config built into typed objects, with every range check."""
    task_cfg = task_part(cfg)
    try:
        config = to_config(task_cfg)
        if check is not None:
            check(task_cfg, overrides)
        return config
    except OmegaConfBaseException as err:  # a deleted required key, an interpolation that fails
        raise ConfigError(explain_value(app, err, overrides, cfg)) from None


def explain_value(app: Composer, err: OmegaConfBaseException, overrides: list[Override], cfg: DictConfig) -> str:
    key = re.sub(r"\[.*", "", getattr(err, "full_key", None) or "")
    mine = [o for o in overrides if o.key_or_group == key]
    line = mine[-1].input_line if mine else key
    if isinstance(err, MissingMandatoryValue):
        options = app.options(key)
        return (f"{line} is not allowed: {key} is required" +
                (f"; choose one of {', '.join(options)}" if options else f"; set {key}=VALUE"))
    expected = allowed_type(cfg, key) if isinstance(err, ValidationError) else None
    reason = f"must be {expected}" if expected else error_line(err, named=False)
    return f"{line} is not allowed: {reason}"


def key_problem(cfg: DictConfig, key: str, options: Callable[[str], list[str]]) -> Optional[str]:
    """What is wrong with the key path itself (a missing key, a parent that is null or a value)."""
    node: Any = cfg
    walked: list[str] = []
    for part in key.split("."):
        where = ".".join(walked)
        if node is None:
            choices = options(where)
            return (f"{where} is null here" +
                    (f"; choose one first with {where}=NAME ({', '.join(choices)})" if choices else ""))
        if not isinstance(node, DictConfig):
            return f"{where} is a single value, not a group of keys"
        if part not in node:
            return key_hint(where, part, [str(k) for k in node.keys()])
        child = node._get_node(part)
        node = None if child is None or child._is_none() else child if isinstance(child, DictConfig) else "value"
        walked.append(part)
    return None


def schema_key_problem(cfg: DictConfig, key: str) -> Optional[str]:
    """A key the typed schema has no place for (the nearest one, or all), None where it has or does not say."""
    return _schema_at(cfg, key)[1]


def _schema_at(cfg: DictConfig, key: str) -> tuple[Any, Optional[str]]:
    """The schema's type hint at `key` (None where the schema does not say), and for a key it has no
    place for, the words naming the nearest keys it has."""
    hint: Any = OmegaConf.get_type(cfg)
    walked: list[str] = []
    for part in key.split("."):
        hint = _without_none(hint)
        if not is_dataclass(hint):
            return None, None
        names = [f.name for f in fields(hint)]
        if part not in names:
            return None, key_hint(".".join(walked), part, names)
        hint = typing.get_type_hints(hint)[part]
        walked.append(part)
    return hint, None


WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
PLURAL = {int: "integers", float: "numbers", bool: "booleans", str: "strings"}


def allowed_type(cfg: DictConfig, key: str) -> Optional[str]:
    """What the schema allows at `key`, in words (None where it does not say)."""
    hint = _schema_at(cfg, key)[0]
    return _words(hint) if hint is not None else None


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _words(hint: Any) -> Optional[str]:
    inner = _without_none(hint)
    if inner is not hint:
        words = _words(inner)
        return f"{words} or null" if words else None
    if hint in WORDS:
        return WORDS[hint]
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (list, typing.List) and args and args[0] in PLURAL:
        return f"a list of {PLURAL[args[0]]} in brackets, e.g. [1, 2]"
    if origin in (dict, typing.Dict):
        return "a mapping such as {key: value}"
    if is_dataclass(hint):
        return f"a group of keys ({', '.join(f.name for f in fields(hint))})"
    return None


def grid(master: DictConfig, overrides: list[Override]) -> list[list[Override]]:
    """Every point of Hydra's basic sweep, as that sweeper expands it."""
    params = master.hydra.sweeper.get("params") or {}
    extra = [parse_override(f"{key}={value}") for key, value in params.items()]
    task_overrides = extra + [o for o in overrides if not o.is_hydra_override()]
    for override in task_overrides:
        if override.is_sweep_override() and not override.is_discrete_sweep():
            raise ConfigError(f"{override.input_line} is not allowed: a --multirun grid takes lists of values "
                              "(a,b or range(...)); interval() needs an Optuna search (sweep=NAME)")
    sizes = {o.input_line: sum(1 for _ in o.sweep_string_iterator()) for o in task_overrides if o.is_sweep_override()}
    runs = math.prod(sizes.values())
    if runs > GRID_LIMIT:  # a mistyped range(), not a plan: expanding it alone would hang
        widest = max(sizes, key=sizes.get)
        raise ConfigError(f"{widest} is not allowed: the --multirun grid would launch {runs:,} "
                          f"runs, more than {GRID_LIMIT:,}; narrow it, or search the space with an Optuna sweep "
                          "(sweep=NAME, sweep.n_trials=N)")
    batches = BasicSweeper.split_arguments(task_overrides, None)
    return [[parse_override(line) for line in point] for batch in batches for point in batch]


def check_writable(cfg: DictConfig, key: str) -> None:
    """Hydra creates this directory first thing: one that cannot be created is a mistake found now."""
    path = selected_path(cfg, key)
    if path == Path(""):  # Hydra would write into the working directory, among whatever is there
        raise ConfigError(f"{key}='' is not allowed: set it to a directory for Hydra's outputs")
    if path is not None:
        check_writable_path(key, path)


def check_run_dir_free(cfg: DictConfig, key: str) -> None:
    """Refused before Hydra writes there: a run directory in which another process is still training,
    and for a new run (not `resume=`) one where an earlier run left its records."""
    from frontier.lifecycle import check_no_earlier_run, check_not_running

    path = selected_path(cfg, key)
    if path is not None and path.is_dir():
        check_not_running(path, key)
        if cfg.get("resume") is None:
            check_no_earlier_run(path, key)


def selected_path(cfg: DictConfig, key: str) -> Optional[Path]:
    value = selected(cfg, key)
    return None if value is None else Path(str(value))


def selected(cfg: DictConfig, key: str) -> Any:
    """KEY's value; None where it is not set or depends on what is known only when the job starts
    (`${hydra:runtime.cwd}`). A reference to a key or an environment variable that does not exist, on
    which the job would stop too, is a ConfigError naming KEY."""
    try:
        return OmegaConf.select(cfg, key)
    except InterpolationResolutionError as err:
        # OmegaConf keeps a resolver's own error as text only: oc.env's is "KeyError raised while ..."
        if not (isinstance(err, InterpolationKeyError) or str(err).startswith("KeyError raised")):
            return None
        parent, _, leaf = key.rpartition(".")
        raw = OmegaConf.select(cfg, parent)._get_node(leaf)._value()
        raise ConfigError(f"{key}={raw} is not allowed: {error_line(err, named=False)}") from None
    except Exception:
        return None


def check_writable_path(key: str, path: Path) -> None:
    """A directory that can be created (or written to), found out leaving nothing behind."""
    found = unwritable(path)
    if found:
        existing, reason = found
        raise ConfigError(f"{key}={path} is not allowed: it cannot be created ({reason}); {existing} "
                          "is not a writable directory")
