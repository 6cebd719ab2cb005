"""A budgeted Optuna study, run by `--multirun sweep=NAME`.

`sweep.n_jobs` worker threads each loop: ask the study for a trial (under a lock that keeps
`n_trials` exact across processes and machines), run it as `python -m frontier.train ...` in a
process of its own pinned to the worker's device, and supervise it until it ends. A new trial
starts as soon as any ends: there is no batch barrier. The trial's process reports its
checkpoints to the same storage (frontier/trial.py), where the pruner decides, sends its own
heartbeat, and tells the study how it ended; this driver ends a trial only when its process
could not (killed for silence or for running past `sweep.trial_timeout`, or crashed). Another
machine running the same command against the same storage joins the study, and its MLflow
parent run.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import optuna
from omegaconf import DictConfig, OmegaConf, open_dict
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from frontier.cli import Composer, check_run, parse_override, unwritable
from frontier.config import ConfigError, SweepConfig, error_line, store_error_line
from frontier.lifecycle import TERMINAL, earlier_records
from frontier.study import (DRIVER_ENV, Process, ask_lock, build_pruner, damaged_journal, end_trial, is_rdb,
                            live_drivers, open_storage, outcome, read_summary, record_driver, safe_storage,
                            settle_orphans, study_storage, trial_seed)
from hydra_plugins.frontier_sweeper._confirm import (BASELINE, confirmation_running, make_plan, next_run,
                                                     search_running, seeds_per_configuration)
from hydra_plugins.frontier_sweeper._launch import JobWatch, LaunchedTrials, is_builtin
from hydra_plugins.frontier_sweeper._objective import Objective, counted_trials
from hydra_plugins.frontier_sweeper._space import as_override, grid_values, parse

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """Where one worker runs its trials: the environment that pins the trial's process."""

    label: str
    env: dict[str, str]


def _visible_ids(variable: str, count: int) -> list[str]:
    """Device ids this process may use: an existing restriction, else all of them."""
    value = os.environ.get(variable, "").strip()
    if not value:
        return [str(i) for i in range(count)]
    ids = []
    for part in value.split(","):
        first, _, last = part.partition("-")  # NEURON_RT_VISIBLE_CORES also takes ranges: 0-3
        ids += [str(i) for i in range(int(first), int(last or first) + 1)] if first.isdigit() else [part]
    return ids


def device_slots(device: str, n_jobs: int, per_trial: int = 1) -> list[Slot]:
    """One slot per parallel trial: its own `per_trial` GPUs or NeuronCores (a torchrun job when more
    than one), or on CPU its share of the cores (no more threads than OMP_NUM_THREADS, where set)."""
    import torch

    from frontier.device import neuron_available

    if ":" in device:
        raise ConfigError(f"device={device!r} is not allowed in a sweep: each trial gets a device of its "
                          "own, so use device=auto, cuda or neuron (restrict them with "
                          "CUDA_VISIBLE_DEVICES or NEURON_RT_VISIBLE_CORES)")
    kind = device
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "neuron" if neuron_available() else "cpu"
    if kind == "cuda":
        variable, ids = "CUDA_VISIBLE_DEVICES", _visible_ids("CUDA_VISIBLE_DEVICES", torch.cuda.device_count())
    elif kind == "neuron":
        count_cores = getattr(torch.neuron, "device_count", None) if neuron_available() else None
        count = count_cores() if count_cores else 0  # else name them in NEURON_RT_VISIBLE_CORES
        variable, ids = "NEURON_RT_VISIBLE_CORES", _visible_ids("NEURON_RT_VISIBLE_CORES", count)
    else:
        ids = [str(i) for i in sorted(os.sched_getaffinity(0))]
        if n_jobs * per_trial > len(ids):
            raise ConfigError(f"sweep.n_jobs={n_jobs} is not allowed: this machine has {len(ids)} CPU "
                              f"cores for parallel CPU trials of sweep.devices_per_trial={per_trial} "
                              f"processes, so at most {len(ids) // per_trial}")
        threads = len(ids) // (n_jobs * per_trial)  # each process its share of the cores,
        cap = os.environ.get("OMP_NUM_THREADS", "")  # at most what the environment allows
        if cap.isdigit() and int(cap) > 0:
            threads = min(threads, int(cap))
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        return [Slot(f"cpu ({threads} threads)", env) for _ in range(n_jobs)]
    if n_jobs * per_trial > len(ids):
        raise ConfigError(f"sweep.n_jobs={n_jobs} is not allowed: this machine has {len(ids)} {kind} "
                          f"device(s) ({variable}={','.join(ids) or 'none'}), so at most "
                          f"{len(ids) // per_trial} trials of sweep.devices_per_trial={per_trial}")
    groups = [",".join(ids[i * per_trial:(i + 1) * per_trial]) for i in range(n_jobs)]
    return [Slot(f"{kind} {variable}={group}", {variable: group}) for group in groups]


class GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler calls Study.stop() when the grid is done, which works only inside
    Study.optimize; the workers stop on `n_trials` (the grid's size) and is_exhausted() instead."""

    def after_trial(self, study, trial, state, values) -> None:
        pass


class PerTrialSeed(optuna.samplers.BaseSampler):
    """A sampler made afresh for each trial, seeded from `sweep.seed` and the trial's number: two
    drivers of one study, or a re-run asking for more trials, never repeat a proposal because they
    share a seed, and a study run again from scratch proposes the same points."""

    def __init__(self, make, seed: int | None):
        self.make, self.seed = make, seed
        self.inner = make(seed)  # also checks the settings up front

    def before_trial(self, study, trial) -> None:
        self.inner = self.make(trial_seed(self.seed, trial.number))
        self.inner.before_trial(study, trial)

    def infer_relative_search_space(self, study, trial):
        return self.inner.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self.inner.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self.inner.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study, trial, state, values) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()


def make_sampler(sweep: SweepConfig, space: dict[str, BaseDistribution],
                 seed: int | None) -> optuna.samplers.BaseSampler:
    startup = sweep.n_startup_trials
    if sweep.sampler == "tpe":
        # Optuna 5 changed TPE's defaults: the settings that matter are pinned here. constant_liar
        # keeps parallel workers from proposing the same point as a trial that is still running.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, n_ei_candidates=24,
                                          multivariate=True, group=False, constant_liar=True)
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sweep.sampler == "grid":  # trial N runs point N of one shuffled order: sweep.seed's, never per trial
        return GridSampler(grid_values(space), seed=sweep.seed)
    if sweep.sampler == "cmaes":
        import importlib.util

        if importlib.util.find_spec("cmaes") is None:
            raise ConfigError("sweep.sampler='cmaes' is not available: it needs the cmaes package "
                              "(pip install cmaes); or choose tpe, random, grid or gp")
        return optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=startup,
                                            independent_sampler=optuna.samplers.RandomSampler(seed=seed),
                                            warn_independent_sampling=False)
    return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup, deterministic_objective=False,
                                     independent_sampler=optuna.samplers.RandomSampler(seed=seed),
                                     warn_independent_sampling=False)


def pruner_settings(sweep: SweepConfig, every_fraction: float) -> dict:
    """The pruner's arguments, stored in the study so that each trial's process builds the same."""
    if sweep.pruner == "none":
        return {"name": "none"}
    if every_fraction <= 0:
        raise ConfigError(f"sweep.pruner={sweep.pruner!r} is not allowed with eval.every_fraction=0: "
                          "trials then report no checkpoints; set eval.every_fraction (e.g. 0.1) or "
                          "sweep.pruner=none")
    checkpoints = round(1 / every_fraction)  # checkpoint k = k * every_fraction of the budget
    if sweep.min_resource >= checkpoints:
        raise ConfigError(f"sweep.min_resource={sweep.min_resource} is not allowed: trials report "
                          f"checkpoints 1..{checkpoints - 1} (eval.every_fraction={every_fraction}), "
                          f"so at most {checkpoints - 1}")
    return {"name": sweep.pruner, "min_resource": sweep.min_resource, "max_resource": checkpoints,
            "reduction_factor": sweep.reduction_factor}


def trainer_command(per_trial: int = 1) -> list[str]:
    """The command that started this sweep, for its trials: `python -m frontier.train`, under
    torchrun when a trial owns several devices."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    if per_trial > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_trial}",
                *program]
    return [sys.executable, *program]


def default_trial_timeout(budget) -> float:
    """How long a trial may run: its charged budget, the start-up time forgiven up to
    budget.startup_cap_seconds, and an allowance for what is never charged (checkpoint and final
    evaluations, CORE): half the budget again, at least 10 minutes."""
    return budget.seconds + budget.startup_cap_seconds + max(600.0, 0.5 * budget.seconds)


def describe_exit(returncode: int, log_path: Path) -> str:
    """Why a trial's process ended without telling the study. A kill by this driver never gets
    here (it records its reason first), so an unexplained SIGKILL is most likely the kernel's."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (not by its driver: by hand, or by the kernel when out of host "
                                      "memory?)" if name == "SIGKILL" else "")
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {returncode}"


class Sweep:
    def __init__(self, config: DictConfig, arguments: list[str], config_loader, launcher=None) -> None:
        self.config = config
        self.sweep: SweepConfig = OmegaConf.to_object(config.sweep)  # range checks of every key
        self.space, self.fixed, self.written = parse(self.sweep.params, arguments)
        if not self.space:  # every trial would be the same run
            raise ConfigError(f"sweep={self.sweep.name} is not allowed without a search space: give one in the "
                              "preset's params or on the command line, e.g. "
                              "'optim.matrix_lr=tag(log, interval(0.01, 0.1))' or model=base,wide")
        swept = sorted(set(self.space) & {f"eval.{key}" for key in EVAL_TOKENS})
        if swept:
            raise ConfigError(f"{swept[0]} is not allowed in the search space: a study compares its trials on "
                              f"one validation set; give it one value ({swept[0]}=N)")
        self.objective = Objective(self.sweep, config.eval.core, config.eval.core_bundle, self.fixed)
        self.fixed += self.objective.trial_overrides(self.fixed)
        # a Hydra launcher other than the basic one runs each trial as its job (_launch.py)
        self.launched = None if is_builtin(launcher) else LaunchedTrials(launcher, self.sweep.devices_per_trial)
        self.study_name = self.sweep.study_name or self.sweep.name
        self.storage_spec = study_storage(self.sweep.storage, self.study_name)
        if self.launched is not None and not self.launched.local:  # the scheduler gives each job its devices
            self.slots = [Slot(f"{self.launched.name} job", {}) for _ in range(self.sweep.n_jobs)]
        else:
            self.slots = device_slots(config.device, self.sweep.n_jobs, self.sweep.devices_per_trial)
        self.pruner = pruner_settings(self.sweep, config.eval.every_fraction)
        self.sampler = PerTrialSeed(lambda seed: make_sampler(self.sweep, self.space, seed), self.sweep.seed)
        self.n_trials = self.sweep.n_trials
        if self.sweep.sampler == "grid":  # each point once
            size = math.prod(len(v) for v in grid_values(self.space).values())
            self.n_trials = min(self.n_trials or size, size)
        if self.n_trials is None and self.sweep.timeout is None:
            raise ConfigError("sweep.n_trials=null is not allowed without sweep.timeout: set either of them")
        self.confirm_seeds = seeds_per_configuration(self.sweep.confirm, self.n_trials)
        if self.objective.name == "pareto" and self.confirm_seeds:
            if self.sweep.confirm:
                raise ConfigError(f"sweep.confirm={self.sweep.confirm} is not allowed with sweep.objective=pareto: "
                                  "a front has no single winner to confirm; add sweep.confirm=0")
            self.confirm_seeds = 0
        self.check_composes(config_loader)
        # the baseline: the command's configuration with the preset's plain values, no search-space point
        self.baseline = config_loader.load_sweep_config(self.config, self.fixed + ["trial.number=0"])
        self.trial_timeout = self.sweep.trial_timeout or default_trial_timeout(config.budget)
        self.sweep_dir = Path(config.hydra.sweep.dir).resolve()
        self.driver = Process.this()
        self.claimed = False  # this driver made the sweep folder's .study
        self.study = self.open_study()
        self.command = trainer_command(self.sweep.devices_per_trial)
        self.lock = threading.Lock()  # one ask or tell at a time in this process
        self.stopping = threading.Event()
        self.ended = threading.Event()  # this driver is done: its heartbeat stops
        self.stop_reason = ""
        self.errors: list[BaseException] = []
        self.failures = 0
        self.busy_seconds = 0.0
        self.processes: dict[subprocess.Popen, optuna.Trial] = {}
        self.standby: dict[int, subprocess.Popen] = {}  # per slot: the process its next trial runs in
        self.killed: dict[subprocess.Popen, str] = {}  # trials this driver stopped, and why
        self.start = time.monotonic()
        self.parent_run_id = None
        self.heartbeat = threading.Thread(target=self.driver_heartbeat, name="driver-heartbeat", daemon=True)
        self.kill_deadline = math.inf  # when trials still running after an interrupt are killed
        self.closing = threading.Lock()
        self.unclosed: set[str] = set()  # MLflow runs of FAIL trials still to be closed

    def check_composes(self, config_loader) -> None:
        """Every trial's overrides must compose (keys exist, types fit) and pass the checks a single run
        gets up front (range checks, data.path, ...) before any trial starts: the lowest point, then
        each choice and each upper end in turn."""
        from frontier.train import check, user_errors  # the train command line's own checks of one run

        # frontier.cli's Composer explains a failed override from the config before it: it needs only the loader
        composer = Composer(SimpleNamespace(config_loader=config_loader), self.config.hydra.job.config_name)
        first = {key: _low(dist) for key, dist in self.space.items()}
        batches = [first] + [{**first, key: value} for key, dist in self.space.items() for value in _ends(dist)]
        for params in batches:
            overrides = self.fixed + [as_override(k, v) for k, v in params.items()]
            try:
                trial_config = config_loader.load_sweep_config(self.config, overrides + ["trial.number=0"])
            except Exception as err:
                raise ConfigError(self.why_not_composed(composer, config_loader, params, err)) from None
            try:  # e.g. a range reaching a depth of 0, a choice of data.path that does not exist
                check_run(composer, trial_config, [parse_override(line) for line in overrides], check)
            except user_errors() as err:
                raise ConfigError(f"{err}, in a trial of this search ({' '.join(overrides)})") from None

    def why_not_composed(self, composer: Composer, config_loader, params: dict, err: Exception) -> str:
        """The space's first value that does not compose, worded as the command line words it for a single
        run (`model.depth=abc is not allowed: must be an integer`), and where the search space has it."""
        fixed = self.fixed + ["trial.number=0"]  # these passed the command line's checks
        space = [parse_override(as_override(k, v)) for k, v in params.items()]
        try:
            culprit = composer.culprit(space, lambda lines: config_loader.load_sweep_config(self.config,
                                                                                           fixed + lines))
        except Exception:  # the fixed overrides alone do not compose here
            culprit = None
        if culprit is None:
            lines = fixed + [o.input_line for o in space]
            return f"the trial overrides {' '.join(lines)} do not compose: {error_line(err, named=False)}"
        override, why = culprit
        return f"{why} (from the search space {self.written[override.key_or_group]})"

    def open_study(self) -> optuna.Study:
        journal = None if is_rdb(self.storage_spec) else Path(self.storage_spec).expanduser()
        damaged = None if journal is None else damaged_journal(self.storage_spec)
        if damaged:  # Optuna would append to it, then fail on reading it back
            raise ConfigError(f"sweep.storage={self.storage_spec!r} is not allowed: {damaged}; give another file")
        try:
            # kept for ask_lock: the study wraps an RDBStorage in Optuna's cache, which has no engine
            self.storage = open_storage(self.storage_spec, self.sweep.heartbeat_interval, self.sweep.grace_period)
            self.storage.get_all_studies()
        except Exception as err:
            raise ConfigError(f"sweep.storage={safe_storage(self.storage_spec)!r} is not reachable "
                              f"({error_line(err)}): give a reachable "
                              "RDB URL (postgresql://user@host:5432/db) or a journal file path") from None
        if journal is not None:  # the journal's lock files are made beside it, even to read it
            found = unwritable(journal.resolve().parent)
            if found:
                raise ConfigError(f"sweep.storage={self.storage_spec!r} is not allowed: a journal's lock files "
                                  f"are made beside it, and {found[0]} is not a writable directory ({found[1]})")
        # under the study's lock, and this driver recorded in it: a second driver starting at the same
        # moment with other overrides is refused, not let in to overwrite them
        new_journal = journal is not None and journal.stat().st_size == 0
        try:
            with ask_lock(self.storage_spec, self.storage, self.study_name):
                study = self.load_or_create_study()
                record_driver(study, self.driver)
        except BaseException as err:  # what this driver made for a sweep refused before it ran is taken back
            with contextlib.suppress(OSError):  # gone meanwhile: the error that brought us here is the one to tell
                if new_journal and journal.stat().st_size == 0:
                    journal.unlink()
            if self.claimed:
                (self.sweep_dir / STUDY_MARKER).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.sweep_dir.rmdir()  # if it made it
            if isinstance(err, OSError):  # a full disk: a journal write that failed was taken back (JournalFile)
                raise ConfigError(f"sweep.storage={self.storage_spec!r} cannot be written ({error_line(err)}); "
                                  "free space there or give another storage") from None
            raise
        return study

    def load_or_create_study(self) -> optuna.Study:
        held = self.trial_folders()  # before the trials are counted: a folder is made after its trial
        if self.study_name in {s.study_name for s in self.storage.get_all_studies()}:
            # checked before anything is written: a refused command leaves the study as it was
            study = optuna.load_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                      pruner=build_pruner(**self.pruner))
            self.objective.check_study(study)
            if study.trials or live_drivers(study, self.sweep.grace_period):
                self.check_same_sweep(study)
            self.check_sweep_dir(held, len(study.get_trials(deepcopy=False)))
            self.claim_sweep_dir()
        else:  # load_if_exists: on a database ask_lock cannot lock, another driver may create it meanwhile
            self.check_sweep_dir(held, 0)
            self.claim_sweep_dir()
            study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                        pruner=build_pruner(**self.pruner), directions=self.objective.directions,
                                        load_if_exists=True)
            self.objective.check_study(study)
        study.set_user_attr("sweep", {"name": self.sweep.name, "params": dict(self.sweep.params),
                                      "space": self.shared()["the search space"],
                                      "sampler": self.sweep.sampler, "seed": self.sweep.seed})
        self.check_confirmable(study)
        self.eval_tokens = self.study_eval_tokens(study)
        study.set_user_attr("eval_tokens", self.eval_tokens)
        study.set_user_attr("pruner", self.pruner)
        study.set_user_attr("objective", self.objective.describe())
        study.set_user_attr("overrides", self.fixed)
        study.set_user_attr("every_fraction", self.config.eval.every_fraction)
        study.set_user_attr("budget_seconds", self.config.budget.seconds)
        study.set_user_attr("grace_period", self.sweep.grace_period)  # sweep_report: when a silent driver is gone
        study.set_user_attr("sweep_dir", str(self.sweep_dir))
        return study

    def check_confirmable(self, study: optuna.Study) -> None:
        """A command that would only confirm (its search ended) needs a finished search trial to confirm."""
        if not self.confirm_seeds or "confirm_plan" in study.user_attrs or not self.search_ended(study):
            return
        if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
            raise ConfigError(f"sweep.confirm={self.confirm_seeds} is not allowed for sweep.study_name="
                              f"{self.study_name!r}: its search has ended with no finished trial, so there is "
                              "no winner to confirm; raise sweep.n_trials to search on, or add sweep.confirm=0")

    def study_eval_tokens(self, study: optuna.Study) -> dict:
        """eval.final_tokens and eval.checkpoint_tokens of every trial: the study's own once a driver set
        them (a study compares its trials on one validation set), else the command's, else sized here
        once for the command's configuration on a trial's device and threads (frontier.sizing)."""
        given = {key: self.baseline.eval[key] for key in EVAL_TOKENS if self.baseline.eval[key] is not None}
        recorded = study.user_attrs.get("eval_tokens")
        if recorded:
            for key, value in given.items():
                if recorded.get(key) != value:
                    raise ConfigError(f"eval.{key}={value} is not allowed for sweep.study_name={self.study_name!r}: "
                                      f"its trials are evaluated with eval.{key}={recorded.get(key)}, and a study "
                                      "compares its trials on one validation set; drop the override or choose "
                                      "another sweep.study_name")
            return recorded
        if len(given) == len(EVAL_TOKENS):
            return {**given, "how": "given"}
        final, checkpoint, why = self.sized_eval_tokens()
        final = given.get("final_tokens", final)
        return {"final_tokens": final, "checkpoint_tokens": given.get("checkpoint_tokens", min(checkpoint, final)),
                "how": why}

    def sized_eval_tokens(self) -> tuple[int, int, str]:
        import torch

        from frontier.config import to_config
        from frontier.device import resolve_device
        from frontier.model import Ops
        from frontier.trainer import eval_sizing

        raw = self.baseline.copy()
        with open_dict(raw):
            del raw["hydra"]  # the run's keys only
        config = to_config(raw)
        device = resolve_device(config.device, config.precision, config.neuron_logical_cores)
        threads = torch.get_num_threads()
        slot_threads = self.slots[0].env.get("OMP_NUM_THREADS")  # a CPU trial's share of the cores
        try:
            if slot_threads:
                torch.set_num_threads(int(slot_threads))
            return eval_sizing(config, device, Ops(config.kernel, device.kind))
        finally:
            torch.set_num_threads(threads)

    def eval_overrides(self) -> list[str]:
        """What each trial adds for its evaluation, where the command's overrides do not say it."""
        given = {override.split("=", 1)[0].lstrip("+~") for override in self.fixed}
        return [f"eval.{key}={self.eval_tokens[key]}" for key in EVAL_TOKENS if f"eval.{key}" not in given]

    def trial_folders(self) -> list[int]:
        """The numbers of the folders in hydra.sweep.dir where a trial left its records."""
        if not self.sweep_dir.is_dir():
            return []
        return sorted(int(path.name) for path in self.sweep_dir.iterdir()
                      if path.name.isdigit() and path.is_dir() and earlier_records(path))

    def unrecorded_parent_run(self, store, cfg) -> str | None:
        """The parent run a driver of this study that is gone made without recording it in the study."""
        recorded = {key.removeprefix("driver:") for key in
                    self.study._storage.get_study_system_attrs(self.study._study_id) if key.startswith("driver:")}
        gone = recorded - {str(driver) for driver in live_drivers(self.study, self.sweep.grace_period)}
        if not gone:
            return None
        try:
            return store.orphaned_parent_run(cfg, {"sweep.study": self.study_name, store.RUN_KIND_TAG: "sweep"},
                                                gone)
        except Exception:  # the store failed: start_parent_run meets it too, and says so
            return None

    def check_sweep_dir(self, held: list[int], trials: int) -> None:
        """Trial N writes SWEEP_DIR/N: a folder there with records and a number this study has not
        reached belongs to another study's sweep, whose outputs this one would write over."""
        theirs = [number for number in held if number >= trials]
        if theirs:
            shown = ", ".join(str(self.trial_dir(n)) for n in theirs[:3]) + (", ..." if len(theirs) > 3 else "")
            raise ConfigError(f"hydra.sweep.dir={self.sweep_dir} is not allowed: another sweep's trials left their "
                              f"outputs there ({shown}), which the trials of study {self.study_name!r} would write "
                              "over; give this sweep a directory of its own")

    def claim_sweep_dir(self) -> None:
        """SWEEP_DIR/.study names the study whose trials it holds, made by a link, which fails where one
        exists: of two studies' sweeps started into one folder at once, both passed check_sweep_dir, and
        the first wrote over the other's trial folders."""
        marker, mine = self.sweep_dir / STUDY_MARKER, f"{self.study_name}\n"
        try:
            self.sweep_dir.mkdir(parents=True, exist_ok=True)
            made = self.sweep_dir / f"{STUDY_MARKER}.{os.getpid()}"
            made.write_text(mine)
            try:
                os.link(made, marker)
                self.claimed = True
            except FileExistsError:
                pass
            finally:
                made.unlink()
            theirs = marker.read_text()
        except OSError as err:
            raise ConfigError(f"hydra.sweep.dir={self.sweep_dir} is not allowed: it cannot be written "
                              f"({error_line(err)})") from None
        if theirs != mine:
            raise ConfigError(f"hydra.sweep.dir={self.sweep_dir} is not allowed: it holds the trials of study "
                              f"{theirs.strip()!r}, which the trials of study {self.study_name!r} would write over; "
                              "give this sweep a directory of its own")

    def shared(self) -> dict:
        """What every driver of one study must agree on: another search space, sampler, seed or pruner
        would change the trials the first driver still runs (its pruner, repeated grid points)."""
        return {"the overrides": _comparable(self.fixed),
                "the search space": {key: str(dist) for key, dist in self.space.items()},
                "sweep.sampler": self.sweep.sampler, "sweep.seed": self.sweep.seed, "sweep.pruner": self.pruner}

    def check_same_sweep(self, study: optuna.Study) -> None:
        """A driver joining a study whose trials ran, or run, must run the same sweep (what the study
        did not record is not compared)."""
        attrs = study.user_attrs
        ran = attrs.get("sweep", {})
        theirs = {"the overrides": _comparable(attrs["overrides"]) if "overrides" in attrs else _UNSET,
                  "the search space": ran.get("space", _UNSET), "sweep.sampler": ran.get("sampler", _UNSET),
                  "sweep.seed": ran.get("seed", _UNSET), "sweep.pruner": attrs.get("pruner", _UNSET)}
        for what, mine in self.shared().items():
            if theirs[what] is not _UNSET and theirs[what] != mine:
                raise ConfigError(f"sweep.study_name={self.study_name!r} is not allowed: that study's trials run "
                                  f"with {what} {theirs[what]}, this command has {mine}; choose another "
                                  "sweep.study_name")

    # -- MLflow: one parent run per study, which every driver continues; trials nest under it ------

    def start_tracking(self) -> None:
        if not self.config.tracking.enabled:
            return
        from frontier import store  # MLflow is imported only by a sweep that tracks

        cfg = OmegaConf.to_object(self.config.tracking)
        try:
            store.ensure_store(store.tracking_uri(cfg))  # once, before parallel trials race to create it
        except ConfigError as err:  # checked with the command line, but it failed since
            raise TrackingStartError(str(err)) from None
        params = {"study": self.study_name, "storage": safe_storage(self.storage_spec),
                  "sampler": self.sweep.sampler, "seed": self.sweep.seed, "pruner": self.sweep.pruner,
                  "n_trials": self.n_trials, "n_jobs": self.sweep.n_jobs, "timeout": self.sweep.timeout,
                  "overrides": " ".join(self.fixed)}
        params.update({f"space.{key}": str(dist) for key, dist in self.space.items()})
        # sweep.driver names this driver's run, should a signal inside create_run leave it without its id
        tags = {"sweep.study": self.study_name, "sweep.preset": self.sweep.name, "sweep.driver": str(self.driver)}
        uri = store.tracking_uri(cfg)
        with self.locked():  # two drivers starting together must not create two parent runs
            attrs = self.study.user_attrs
            existing = attrs.get("mlflow_run_id") if attrs.get("mlflow_tracking_uri") == uri else None
            if existing is None:  # one its driver made but never recorded (killed as it made it) is continued
                existing = self.unrecorded_parent_run(store, cfg)
            opened = {}
            try:
                store.start_parent_run(cfg, f"sweep-{self.study_name}", params, tags, run_id=existing,
                                          opened=opened)
            except Exception as err:  # the store failed half-way: the sweep stops, its end still recorded
                raise TrackingStartError(f"tracking.uri={uri} could not start the sweep's MLflow run "
                                         f"({store_error_line(err)})") from err
            finally:  # also when a signal broke the start off: the sweep's end then ends the run KILLED,
                # and the study's next driver reopens it (a run left unnamed here would stay RUNNING for good)
                self.parent_run_id = opened.get("run_id")
                if self.parent_run_id is not None:
                    self.study.set_user_attr("mlflow_run_id", self.parent_run_id)
                    self.study.set_user_attr("mlflow_tracking_uri", uri)
                    # an earlier driver's status is not this one's: killed before it sets its own,
                    # the run is ended KILLED by sweep_report
                    self.study.set_user_attr("mlflow_run_status", None)

    def end_tracking(self, status: str, metrics: dict, artifacts: list) -> None:
        """The last driver of the study to stop ends its parent run; earlier ones leave it running."""
        self.close_trial_runs([])  # the runs the store could not close before
        try:
            with self.locked():
                record_driver(self.study, self.driver, ended=True)
                others = [d for d in live_drivers(self.study, self.sweep.grace_period) if d != self.driver]
                if self.parent_run_id is not None and not others:  # sweep_report ends the run so if MLflow fails now
                    self.study.set_user_attr("mlflow_run_status", status)
        except Exception as err:  # the study's storage went away: its other drivers cannot be known
            log.warning(f"could not record this driver's end in the study ({store_error_line(err)})"
                        + (f"; its MLflow run is ended {status} here (a later driver of the study reopens it)"
                           if self.parent_run_id is not None else ""))
            others = []  # ended here rather than left RUNNING with nobody to end it
        if self.parent_run_id is None:
            return
        if others:
            log.info(f"the study's MLflow run goes on: {len(others)} other driver(s) still run trials")
            return
        from frontier import store

        try:
            store.end_parent_run(OmegaConf.to_object(self.config.tracking), self.parent_run_id, status,
                                    metrics, artifacts)
        except Exception as err:
            log.warning(f"could not end the sweep's MLflow run {self.parent_run_id} ({error_line(err)}); "
                        f"once the tracking store answers, {self.redo()} attaches the report and ends it "
                        f"{status}")

    def close_trial_runs(self, trials: list[FrozenTrial]) -> None:
        """MLflow runs of FAIL trials whose process died before it could end them: KILLED. A run the
        store could not close (it was down) is tried again with the next ones and at the sweep's end."""
        if not self.config.tracking.enabled:
            return
        from frontier import store

        with self.closing:
            self.unclosed.update(t.user_attrs["mlflow_run_id"] for t in trials
                                 if t.state == TrialState.FAIL and t.user_attrs.get("mlflow_run_id"))
            if not self.unclosed:
                return
            failed = store.close_runs(OmegaConf.to_object(self.config.tracking), sorted(self.unclosed), "KILLED")
            for run_id, error in failed.items():
                log.warning(f"could not close the MLflow run {run_id} yet (tried again later): {error}")
            self.unclosed = set(failed)

    @contextlib.contextmanager
    def locked(self):
        """This process's lock, then the study's lock across processes and machines."""
        with self.lock, ask_lock(self.storage_spec, self.storage, self.study_name):
            yield

    # -- the workers ----------------------------------------------------------------------------

    def next_trial(self) -> optuna.Trial | None:
        with self.locked():
            settled = settle_orphans(self.study, skip={t._trial_id for t in self.processes.values()})
            for trial in settled:
                reason = trial.user_attrs.get("fail_reason") or f"value {trial.value}"
                log.warning(f"trial {trial.number} {trial.state.name}: its process is gone ({reason})")
            self.close_trial_runs(settled)
            if not self.stopping.is_set():
                self.stop_reason = self.limit_reached()
                if self.stop_reason:
                    self.stopping.set()
            if self.stopping.is_set():
                return None
            with warnings.catch_warnings():  # "heartbeat is supposed to be used with optimize()"
                warnings.simplefilter("ignore")
                if self.search_ended(self.study):
                    return self.next_confirmation()
                return self.study.ask(self.space)

    def limit_reached(self) -> str:
        # failures first: they make the exit code 1, and the error line gives this reason
        if self.failures > self.sweep.max_failures:
            return f"{self.failures} trials failed (sweep.max_failures={self.sweep.max_failures})"
        ended = self.search_ended(self.study)
        if ended and not self.confirm_seeds:
            return ended
        if self.sweep.timeout is not None and time.monotonic() - self.start >= self.sweep.timeout:
            return f"sweep.timeout={self.sweep.timeout:g} s has passed"
        return ""

    def search_ended(self, study: optuna.Study) -> str:
        """Why the search asks for no more trials (n_trials reached, the grid run), or ""."""
        count = counted_trials(study, self.sweep.count_failed)
        if self.n_trials is not None and count >= self.n_trials:
            return f"the study has {count} trials (sweep.n_trials={self.n_trials})"
        if self.sweep.sampler == "grid" and self.sampler.inner.is_exhausted(study):
            return "every point of the grid has been run"
        return ""

    def next_confirmation(self) -> optuna.Trial | None | object:
        """The next confirmation run (_confirm.py) as a trial; WAIT while a running trial may still change
        what is to be confirmed or run the last ones; None (the sweep stops) once all are done."""
        if search_running(self.study):
            return WAIT
        ended = self.search_ended(self.study)
        plan = self.study.user_attrs.get("confirm_plan")
        if plan is None:
            plan = make_plan(self.study, self.sweep.confirm_top, self.confirm_seeds, self.baseline.seed)
            if plan is None:
                self.stop_reason = f"{ended}; none finished, so none is confirmed"
                self.stopping.set()
                return None
            self.study.set_user_attr("confirm_plan", plan)
            log.info(f"confirming {', '.join(c['label'] for c in plan['configs'])} with seeds "
                     f"{', '.join(map(str, plan['seeds']))}")
        found = next_run(self.study, plan)
        if found is None:
            if confirmation_running(self.study):
                return WAIT
            self.stop_reason = (f"{ended}; the best {len(plan['configs']) - 1} and the {BASELINE} are confirmed with "
                                f"{len(plan['seeds'])} seeds each")
            self.stopping.set()
            return None
        config, seed = found
        self.study.enqueue_trial(config["params"], user_attrs={"confirm": config["label"], "confirm_seed": seed})
        return self.study.ask({key: self.space[key] for key in config["params"]})

    def worker(self, slot: Slot, done: threading.Event) -> None:
        try:
            while not self.stopping.is_set():
                trial = self.next_trial()
                if trial is None:
                    return
                if trial is WAIT:  # confirmation waits for the running trials
                    self.stopping.wait(2.0)
                    continue
                self.run_trial(trial, slot)
        except BaseException as err:  # e.g. the storage went away: stop the sweep, say why in main
            if isinstance(err, (OSError, SweepDirTaken, SweepDirUnwritable)) or from_storage(err):  # not a bug
                log.error(f"worker on {slot.label} stopped: {store_error_line(err)}")
            else:  # a bug: its traceback helps
                log.exception(f"worker on {slot.label} stopped")
            self.errors.append(err)
            self.stopping.set()
        finally:
            done.set()

    def trial_dir(self, number: int) -> Path:
        """Where trial `number` runs: <hydra.sweep.dir>/N."""
        return self.sweep_dir / str(number)

    def run_trial(self, trial: optuna.Trial, slot: Slot) -> None:
        run_dir = self.trial_dir(trial.number)
        with self.starting(trial):
            run_dir.mkdir(parents=True, exist_ok=True)
            found = earlier_records(run_dir)
            if found:  # a sweep of another study writes here since this one started: neither overwritten nor read
                raise SweepDirTaken(f"{run_dir} holds another run's records ({', '.join(found)}), so trial "
                                    f"{trial.number} did not start there; give each sweep a hydra.sweep.dir of "
                                    "its own")
            params = [as_override(key, value) for key, value in trial.params.items()]
            overrides = self.fixed + self.eval_overrides() + params
            confirm = trial.user_attrs.get("confirm")
            name = " ".join([f"trial-{trial.number}", *(f"{key}={_short(value)}" for key, value in trial.params.items())])
            if confirm is not None:  # the same configuration with a seed of its own
                seed = trial.user_attrs["confirm_seed"]
                overrides = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "seed"] + [f"seed={seed}"]
                name = f"trial-{trial.number} confirm {confirm} seed={seed}"
            extra = [as_override("trial.study", self.study_name), as_override("trial.storage", self.storage_spec),
                     f"trial.number={trial.number}", f"trial.heartbeat_interval={self.sweep.heartbeat_interval}",
                     f"trial.grace_period={self.sweep.grace_period}", as_override("hydra.run.dir", str(run_dir)),
                     *search_path_override(self.config)]
            if self.parent_run_id is not None:
                extra += [f"tracking.parent_run_id={self.parent_run_id}", as_override("tracking.run_name", name)]
            for key, value in {"overrides": overrides, "run_dir": str(run_dir), "host": socket.gethostname(),
                               "device": slot.label, "driver": str(self.driver)}.items():
                trial.set_user_attr(key, value)
            log.info(f"trial {trial.number} started on {slot.label}: {' '.join(params)}"
                     + (f" (confirmation: {confirm}, seed={seed})" if confirm is not None else ""))
            started = time.monotonic()
            self.study._storage.record_heartbeat(trial._trial_id)  # its silence counts from the launch
            if self.launched is not None:
                (run_dir / "output.log").write_text("")
        if self.launched is not None:  # a job of the Hydra launcher runs the trial (_launch.py)
            watch = JobWatch(self.study, trial, self.trial_timeout, self.sweep.grace_period,
                             self.sweep.heartbeat_interval)
            returncode, reason = self.launched.run(overrides + extra, trial.number, run_dir,
                                                   {**slot.env, DRIVER_ENV: str(self.driver)}, watch)
            self.finish_trial(trial, returncode, run_dir, time.monotonic() - started, reason)
            return
        with self.starting(trial):
            process = self.launch(slot, overrides + extra, run_dir / "output.log")
        self.processes[process] = trial
        try:
            trial.set_user_attr("process", str(Process.this(process.pid)))
            returncode = self.supervise(trial, process, started)
            self.finish_trial(trial, returncode, run_dir, time.monotonic() - started, self.killed.get(process))
        finally:
            if process.poll() is None:  # the storage went away meanwhile: no trial goes on unsupervised
                with contextlib.suppress(Exception):  # the error that got here is the one to report
                    self.stop_trial(trial, process, "its driver stopped on an error", signal.SIGTERM)
                try:  # SIGTERM: the trial writes resume.pt and ends its MLflow run KILLED
                    process.wait(timeout=self.sweep.grace_period)
                except subprocess.TimeoutExpired:
                    signal_session(process, signal.SIGKILL)
                    process.wait()
            self.processes.pop(process, None)

    def launch(self, slot: Slot, argv: list[str], log_path: Path) -> subprocess.Popen:
        """The trial's process: the slot's standby process (frontier/standby.py: Python started and the
        libraries imported while the slot's last trial trained) given the trial's command line, else a
        new `python -m frontier.train`. Then the slot's next standby process starts, if a trial may follow."""
        log_path.write_text("")  # the trial's output, whichever process writes it
        process = self.standby.pop(id(slot), None)
        if process is not None:
            try:
                process.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
                process.stdin.close()
            except OSError:  # it died waiting (killed by hand, out of memory): a new process runs the trial
                log.warning(f"the standby process {process.pid} on {slot.label} is gone; starting the trial anew")
                signal_session(process, signal.SIGKILL)
                process.wait()
                process = None
        if process is None:
            with open(log_path, "a") as out:
                process = self.start_process(slot, self.command + argv, stdout=out)
        if self.sweep.devices_per_trial == 1 and self.more_trials():  # torchrun starts its own processes
            number = next(i for i, other in enumerate(self.slots) if other is slot)
            with contextlib.suppress(OSError), open(self.sweep_dir / f".standby-{number}.log", "w") as out:
                self.standby[id(slot)] = self.start_process(slot, [sys.executable, "-m", "frontier.standby"], stdout=out,
                                                            stdin=subprocess.PIPE, text=True)
        return process

    def more_trials(self) -> bool:
        """Whether a trial may follow the ones started: a standby process would wait in vain otherwise."""
        if self.stopping.is_set():
            return False
        if not self.search_ended(self.study):
            return True
        plan = self.study.user_attrs.get("confirm_plan")
        return bool(self.confirm_seeds) and (plan is None or next_run(self.study, plan) is not None)

    def start_process(self, slot: Slot, command: list[str], **how) -> subprocess.Popen:
        """A session of its own: Ctrl-C reaches the driver only, which stops each trial once; the trial
        learns its driver from the environment, and stops when the driver is gone."""
        return subprocess.Popen(command, stderr=subprocess.STDOUT, env={**os.environ, **slot.env, DRIVER_ENV: str(self.driver)},
                                start_new_session=True, **how)

    def end_standby(self) -> None:
        """Standby processes no trial will use: end of input ends them."""
        for process in list(self.standby.values()):
            with contextlib.suppress(OSError):
                process.stdin.close()
        for process in self.standby.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                signal_session(process, signal.SIGKILL)
                process.wait()
        self.standby.clear()

    @contextlib.contextmanager
    def starting(self, trial: optuna.Trial) -> Iterator[None]:
        """A trial that could not be started (its folder taken or not writable, a full disk, no memory to
        fork) ends FAIL saying why, where it had stayed RUNNING until another driver took it for dead."""
        try:
            yield
        except Exception as err:
            reason = str(err) if isinstance(err, SweepDirTaken) else f"it could not be started: {store_error_line(err)}"
            with contextlib.suppress(Exception):  # a storage that failed is the error the worker reports
                end_trial(self.study, trial._trial_id, TrialState.FAIL, None, {"fail_reason": reason})
            raise

    def supervise(self, trial: optuna.Trial, process: subprocess.Popen, started: float) -> int:
        """Waits for the trial's process; kills it, and records the trial FAIL with why, when it runs
        past sweep.trial_timeout or sends no heartbeat for sweep.grace_period."""
        storage, study_id = self.study._storage, self.study._study_id
        next_check = 0.0
        while True:
            try:
                return process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            if process in self.killed:  # stopped by the main thread (interrupted): wait for it to end
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.trial_timeout:
                self.stop_trial(trial, process, f"killed by its driver: it ran past sweep.trial_timeout="
                                                f"{self.trial_timeout:g} s", signal.SIGKILL)
            elif elapsed >= next_check:  # a storage query: at the heartbeat cadence, not every second
                next_check = elapsed + min(self.sweep.heartbeat_interval, 5)
                if trial._trial_id in storage._get_stale_trial_ids(study_id):
                    self.stop_trial(trial, process, f"killed by its driver: it sent no heartbeat for "
                                                    f"sweep.grace_period={self.sweep.grace_period} s", signal.SIGKILL)

    def stop_trial(self, trial: optuna.Trial, process: subprocess.Popen, reason: str, sig: int) -> None:
        """Records the trial FAIL with `reason` first (a killed process cannot), then signals it:
        SIGTERM lets it write resume.pt and close its MLflow run; SIGKILL ends a hung one. A trial whose
        summary.json records its end already (its sinks are being told, MLflow's can take seconds) is
        not failed: it tells the study itself, or finish_trial does from that summary, value and all."""
        self.killed[process] = reason
        try:
            if read_summary(self.trial_dir(trial.number)).get("status") not in TERMINAL:
                end_trial(self.study, trial._trial_id, TrialState.FAIL, None, {"fail_reason": reason})
        finally:  # stopped even when the storage cannot record it
            signal_session(process, sig)

    def finish_trial(self, trial: optuna.Trial, returncode: int, run_dir: Path, seconds: float,
                     killed: str | None) -> None:
        """The trial's process told the study how it ended; where it could not, its summary.json
        (if it got that far) or its exit status does."""
        storage = self.study._storage
        frozen = storage.get_trial(trial._trial_id)
        if frozen.state == TrialState.RUNNING:
            reason = killed or describe_exit(returncode, run_dir / "output.log")
            state, value, attrs = outcome(read_summary(run_dir), reason, self.study.user_attrs.get("objective"))
            end_trial(self.study, trial._trial_id, state, value, attrs)
            frozen = storage.get_trial(trial._trial_id)
        with self.lock:
            self.busy_seconds += seconds
            if frozen.state == TrialState.FAIL:
                self.failures += 1
        self.close_trial_runs([frozen])
        if frozen.state == TrialState.FAIL and disk_full(run_dir):  # every next trial would fail the same way
            raise SweepDirUnwritable(f"the disk of its folder {self.sweep_dir} is full (trial {trial.number} failed: "
                                     f"{frozen.user_attrs.get('fail_reason', '')})")
        message = {TrialState.COMPLETE: ", ".join(f"{name} {value:.4f}" for name, value in
                                                zip(self.objective.value_names, frozen.values or ())),
                   TrialState.PRUNED: frozen.user_attrs.get("prune_reason", "pruned")}.get(
            frozen.state, frozen.user_attrs.get("fail_reason", ""))
        log.info(f"trial {trial.number} {frozen.state.name} after {seconds:.0f} s: {message}")

    # -- the whole sweep ------------------------------------------------------------------------

    def run(self) -> dict:
        self.heartbeat.start()
        _on_signals(self.interrupt)
        # an Event per worker, not Thread.join: a join interrupted by Ctrl-C can leave is_alive() wrong
        workers: list[tuple[threading.Thread, threading.Event]] = []
        try:
            try:
                self.sweep_dir.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(self.config, self.sweep_dir / "multirun.yaml")
                self.start_tracking()
            except OSError as err:  # a full disk: no trial could write its records there either
                self.errors.append(SweepDirUnwritable(f"its folder {self.sweep_dir} cannot be written "
                                                      f"({error_line(err)})"))
                self.stop_reason = "its folder cannot be written"
                self.stopping.set()
            except TrackingStartError as err:  # no trial starts; the report, the driver's end and the
                self.errors.append(err)  # parent run (FAILED, if it was created) are still recorded
                self.stop_reason = "its MLflow run could not be started"
                self.stopping.set()
            log.info(f"sweep {self.study_name!r}: {self.sweep.sampler} sampler, {self.sweep.pruner} pruner, "
                     f"n_trials={self.n_trials}, {len(self.slots)} at once, storage "
                     f"{safe_storage(self.storage_spec)}, trial outputs in {self.sweep_dir}")
            self.start = time.monotonic()
            for i, slot in enumerate(self.slots):
                done = threading.Event()
                workers.append((threading.Thread(target=self.worker, args=(slot, done), name=f"worker-{i}",
                                                 daemon=True), done))
                workers[-1][0].start()
            for _, done in workers:
                while not done.wait(timeout=0.5):  # short waits keep Ctrl-C responsive
                    pass
            status = "FINISHED"
        except KeyboardInterrupt:  # at any moment of the above
            status = self.stop_workers(workers)
        _on_signals(self.hasten)  # the sweep is being recorded: a signal changes nothing now
        self.end_standby()
        wall = time.monotonic() - self.start
        utilization = self.busy_seconds / (wall * len(self.slots)) if wall > 0 else 0.0
        log.info(f"sweep stopped: {self.stop_reason or 'a worker failed'}; device utilisation "
                 f"{utilization:.0%} ({self.busy_seconds:.0f} busy of {wall * len(self.slots):.0f} "
                 "device-seconds)")
        too_many = self.failures > self.sweep.max_failures
        result = self.report("FAILED" if self.errors or (too_many and status == "FINISHED") else status, utilization)
        if status == "KILLED":
            raise SystemExit(130)  # the trials and the report are recorded: no traceback needed
        if self.errors:  # recorded as far as the storage allowed: one line says why
            print(f"error: {self.describe_error(self.errors[0])}", file=sys.stderr)
            raise SystemExit(1)
        if too_many:  # the trials' own logs say why: one line here
            print(f"error: the sweep stopped early: {self.stop_reason}; see each trial's output.log under "
                  f"{self.sweep_dir}", file=sys.stderr)
            raise SystemExit(1)
        return result

    def describe_error(self, err: BaseException) -> str:
        if isinstance(err, TrackingStartError):
            return f"the sweep stopped before its first trial: {err}"
        if isinstance(err, (SweepDirTaken, SweepDirUnwritable)):
            return f"the sweep stopped: {err}"
        where = f"its storage {safe_storage(self.storage_spec)} failed" if from_storage(err) else "a worker failed"
        return (f"the sweep stopped: {where} ({store_error_line(err)}); each trial's summary.json and "
                f"output.log are under {self.sweep_dir}")

    def stop_workers(self, workers: list[tuple[threading.Thread, threading.Event]]) -> str:
        """Ctrl-C or SIGTERM: every trial stopped and recorded, then KILLED."""
        self.stop_reason = "interrupted"
        self.stopping.set()
        if self.launched is not None:
            self.launched.terminate()
        # then a trial that ignores SIGTERM is killed (at once after a second signal)
        self.kill_deadline = min(self.kill_deadline, time.monotonic() + self.sweep.grace_period)
        # a worker interrupted before its thread started has nothing to wait for
        while not all(done.is_set() or thread.ident is None for thread, done in workers):
            for process, trial in list(self.processes.items()):  # each trial ends KILLED, recorded FAIL
                if process not in self.killed:
                    self.stop_trial(trial, process, "stopped by its driver (interrupted)", signal.SIGTERM)
                elif time.monotonic() > self.kill_deadline:
                    signal_session(process, signal.SIGKILL)
            time.sleep(0.2)
        return "KILLED"

    def interrupt(self, signum, frame) -> None:
        """The first Ctrl-C or SIGTERM stops the sweep (stop_workers); the trials, the report and the
        MLflow run are recorded whatever signals follow."""
        _on_signals(self.hasten)
        raise KeyboardInterrupt

    def hasten(self, signum, frame) -> None:
        """A later Ctrl-C or SIGTERM: trials still running are killed at once, not after grace_period."""
        self.kill_deadline = 0.0

    def driver_heartbeat(self) -> None:
        """This driver's heartbeat in the study: trials and drivers on other machines see it is alive."""
        while not self.ended.wait(self.sweep.heartbeat_interval):
            try:
                record_driver(self.study, self.driver)
            except Exception as err:  # the workers meet the same storage error and stop the sweep
                log.warning(f"driver heartbeat: {store_error_line(err)}")

    def report(self, status: str, utilization: float) -> dict:
        """The sweep's end: the report, this driver's end in the study, the MLflow parent run. Each step
        is tried whatever became of the one before (a warning says how to redo it), so the exit code
        stays the sweep's."""
        from frontier.sweep_report import write_report

        out = self.sweep_dir / "report"
        report = {"best": None, "front": [], "counts": {}, "files": []}
        try:
            report = write_report(self.study, out)
        except Exception as err:
            log.warning(f"could not write the report ({store_error_line(err)}); write it with "
                        f"{self.redo(out)}")
        if report.get("best"):
            best = report["best"]
            log.info(f"best: trial {best['number']}, {best['text']}: "
                     f"python -m frontier.train {' '.join(best['overrides'])}")
        if report["front"]:
            log.info(f"pareto front (val_bpb, core): trials {report['front']}; see {out}")
        counts = report["counts"]
        best = report.get("best") or {}
        metrics = {"best_val_bpb": best.get("val_bpb") or math.nan, "best_value": best.get("value", math.nan),
                   "pareto_front_size": len(report["front"]),
                   "device_utilization": utilization,
                   **{f"trials_{state.lower()}": n for state, n in counts.items()}}
        if report.get("time"):
            metrics["training_share"] = report["time"]["training_share"]
            log.info(f"training share {report['time']['training_share']:.0%} of the sweep's trial time; see {out}")
        confirmed = report.get("confirmation") or {}
        if confirmed.get("winner"):
            winner, base = confirmed["winner"], confirmed["baseline"]
            metrics.update(confirmed_winner_mean=winner["mean"], confirmed_winner_sd=winner["sd"],
                           baseline_mean=base["mean"], baseline_sd=base["sd"], noise_floor=confirmed["noise"],
                           winner_beats_baseline=float(confirmed["beats"]))
            verdict = "beats the baseline beyond the noise" if confirmed["beats"] else "does not beat the baseline beyond the noise"
            log.info(f"confirmed: the {winner['label']} configuration ({winner['mean']:.4f} +- {winner['sd']:.4f}) "
                     f"{verdict} ({base['mean']:.4f} +- {base['sd']:.4f})")
        self.ended.set()
        self.heartbeat.join()  # a beat in flight must not land after the record that this driver ended
        self.end_tracking(status, metrics, report["files"])
        return report

    def redo(self, out: Path | None = None) -> str:
        """The command that rebuilds this sweep's report (and ends its parent run, if still RUNNING)."""
        return (f"python -m frontier.sweep_report study={self.study_name} "
                f"storage={safe_storage(self.storage_spec)}" + (f" out={out}" if out else ""))


STUDY_MARKER = ".study"  # in a sweep's folder: the study whose trials it holds
WAIT = object()  # next_trial: none to start now, but one may follow
EVAL_TOKENS = ("final_tokens", "checkpoint_tokens")  # eval.* keys that choose a study's validation set


class SweepDirTaken(Exception):
    """A trial's folder holds another run's records, written there after the sweep's start was checked."""


class SweepDirUnwritable(Exception):
    """The sweep's folder cannot be written (a full disk)."""


FULL_DISK_BYTES = 1 << 20  # less free than this where a trial failed: its records could not be written


def disk_full(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < FULL_DISK_BYTES
    except OSError:
        return False


class TrackingStartError(Exception):
    """The tracking store failed as the sweep opened its MLflow parent run, after the command line's
    check found it usable."""


def signal_session(process: subprocess.Popen, sig: int) -> None:
    """`sig` to a trial's whole session (torchrun's ranks too), if it is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)


STORAGE_MODULES = ("optuna.storages", "sqlalchemy", "psycopg", "filelock")


def from_storage(err: BaseException) -> bool:
    """Whether `err` was raised inside the study's storage (Optuna's storages, the database driver, the
    journal's file locks), not by this driver's own code."""
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").startswith(STORAGE_MODULES):
            return True
        tb = tb.tb_next
    return False


def search_path_override(config: DictConfig) -> list[str]:
    """Trials find the same user presets as the driver: its hydra.searchpath and --config-dir."""
    found = list(config.hydra.searchpath)
    found += [f"{source.schema}://{source.path}" for source in config.hydra.runtime.config_sources
              if source.provider == "command-line"]
    return ["hydra.searchpath=[" + ",".join(repr(entry) for entry in found) + "]"] if found else []


def _on_signals(handler) -> None:
    """Ctrl-C and SIGTERM (preemption, time limits) alike; Python takes signals in the main thread only.
    One the driver was started ignoring (SIGINT in a background job) stays ignored."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, handler)


_UNSET = object()  # a study attribute never recorded


def _short(value) -> str:
    """A parameter as a run's name shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _low(dist: BaseDistribution):
    return dist.choices[0] if isinstance(dist, optuna.distributions.CategoricalDistribution) else dist.low


def _ends(dist: BaseDistribution) -> list:
    """The values a check tries beside the lowest: every choice, or the upper end."""
    return list(dist.choices) if isinstance(dist, optuna.distributions.CategoricalDistribution) else [dist.high]


def _comparable(overrides: list[str]) -> list[str]:
    """The overrides that change what a trial computes (not where it is tracked or written)."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("tracking.", "hydra.")))


def run_sweep(config: DictConfig, arguments: list[str], config_loader, launcher=None) -> dict:
    return Sweep(config, arguments, config_loader, launcher).run()
