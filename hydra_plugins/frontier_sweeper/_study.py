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
import logging
import math
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import optuna
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution

import frontier
from frontier.compose import Composer, check_run, parse_override
from frontier.config import ConfigError, SweepConfig, error_line, store_error_line
from frontier.study import Process, ask_lock, record_driver, safe_storage, settle_orphans, study_storage, trial_seed
from hydra_plugins.frontier_sweeper._confirm import (blocks_at_most, confirmation_running, extended, make_plan,
                                                     next_run, search_running, seeds_per_configuration, verdict_of)
from hydra_plugins.frontier_sweeper._fairness import FairTrials
from hydra_plugins.frontier_sweeper._frontier import (BUDGET, Family, check_fits, check_space, family,
                                                      next_after_grid)
from hydra_plugins.frontier_sweeper._ladder import ladder_space, next_climb
from hydra_plugins.frontier_sweeper._launch import LaunchedTrials, is_builtin
from hydra_plugins.frontier_sweeper._objective import Objective, counted_trials
from hydra_plugins.frontier_sweeper._parent_run import ParentRun, TrackingStartError
from hydra_plugins.frontier_sweeper._space import as_override, grid_values, parse
from hydra_plugins.frontier_sweeper._storage import EVAL_TOKENS, StudyStorage, run_config
from hydra_plugins.frontier_sweeper._workers import (Slot, SweepDirTaken, SweepDirUnwritable, WAIT, Workers,
                                                     device_slots, from_storage, signal_session, trainer_command)
from hydra_plugins.frontier_sweeper._workers import describe_exit  # noqa: F401  where the tests import it from

log = logging.getLogger(__name__)


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


def make_sampler(sweep: SweepConfig, grid, seed: int | None) -> optuna.samplers.BaseSampler:
    """`grid` gives the grid sampler its points when it is asked for (other samplers take the trial's space)."""
    startup = sweep.n_startup_trials
    if sweep.sampler == "tpe":
        # Optuna 5 changed TPE's defaults: the settings that matter are pinned here. constant_liar
        # keeps parallel workers from proposing the same point as a trial that is still running.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, n_ei_candidates=24,
                                          multivariate=True, group=False, constant_liar=True)
    if sweep.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sweep.sampler == "grid":  # trial N runs point N of one shuffled order: sweep.seed's, never per trial
        return GridSampler(grid(), seed=sweep.seed)
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


def default_trial_timeout(budget, seconds: float) -> float:
    """How long a trial of `seconds` charged may run: its charged budget, the start-up time forgiven up
    to budget.startup_cap_seconds, and an allowance for what is never charged (checkpoint and final
    evaluations, CORE): half the budget again, at least 10 minutes."""
    return seconds + budget.startup_cap_seconds + max(600.0, 0.5 * seconds)


class Sweep(StudyStorage, ParentRun, Workers, FairTrials):
    def __init__(self, config: DictConfig, arguments: list[str], config_loader, launcher=None) -> None:
        self.config, self.arguments = config, arguments
        self.sweep: SweepConfig = OmegaConf.to_object(config.sweep)  # range checks of every key
        self.space, self.fixed, self.written = parse(self.sweep.params, arguments)
        self.family = self.grid_axes(config)
        if not self.space:  # every trial would be the same run
            raise ConfigError(f"sweep={self.sweep.name} is not allowed without a search space: give one in the "
                              "preset's params or on the command line, e.g. "
                              "'optim.matrix_lr=tag(log, interval(0.01, 0.1))' or model=base,wide")
        swept = sorted(set(self.space) & {f"eval.{key}" for key in EVAL_TOKENS})
        if swept:
            raise ConfigError(f"{swept[0]} is not allowed in the search space: a study compares its trials on "
                              f"one validation set; give it one value ({swept[0]}=N)")
        first_rung, self.climbs = ladder_space(self.space, self.sweep.ladder)  # proposals train at the first rung
        self.fixed += first_rung
        self.objective = Objective(self.sweep, config.eval.core, config.eval.core_bundle, self.fixed)
        self.fixed += self.objective.trial_overrides(self.fixed)
        # a Hydra launcher other than the basic one runs each trial as its job (_launch.py)
        self.launched = None if is_builtin(launcher) else LaunchedTrials(launcher, self.sweep.devices_per_trial)
        self.study_name = self.sweep.study_name or self.sweep.name
        self.storage_spec = study_storage(self.sweep.storage, self.study_name)
        self.pruner = pruner_settings(self.sweep, config.eval.every_fraction)
        self.sampler = PerTrialSeed(lambda seed: make_sampler(self.sweep, self.grid, seed), self.sweep.seed)
        self.n_trials = self.sweep.n_trials
        if self.sweep.sampler == "grid":  # each point once
            size = math.prod(len(v) for v in self.grid().values())
            self.n_trials = min(self.n_trials or size, size)
        if self.n_trials is None and self.sweep.timeout is None:
            raise ConfigError("sweep.n_trials=null is not allowed without sweep.timeout: set either of them")
        self.confirm_seeds = seeds_per_configuration(self.sweep.confirm, self.n_trials)
        several_budgets = len(self.sweep.budgets or []) > 1
        if (self.objective.name == "pareto" or several_budgets) and self.confirm_seeds:
            if self.sweep.confirm:
                why = ("a front has no single winner to confirm" if not several_budgets else
                       "the best of several sweep.budgets do not compare with one baseline")
                raise ConfigError(f"sweep.confirm={self.sweep.confirm} is not allowed with "
                                  f"{'sweep.objective=pareto' if not several_budgets else 'several sweep.budgets'}: "
                                  f"{why}; add sweep.confirm=0")
            self.confirm_seeds = 0
        self.confirm_blocks = blocks_at_most(self.sweep.confirm_max, self.confirm_seeds)
        self.check_composes(config_loader)
        if self.launched is not None and not self.launched.local:  # the scheduler gives each job its devices
            self.slots = [Slot(f"{self.launched.name} job", {}) for _ in range(self.sweep.n_jobs)]
        else:
            self.slots = device_slots(config.device, self.sweep.n_jobs, self.sweep.devices_per_trial)  # imports torch
        # the baseline: the command's configuration with the preset's plain values, no search-space point
        self.baseline = config_loader.load_sweep_config(self.config, self.fixed + ["trial.number=0"])
        # evaluation is sized on the costliest trial (the largest shape at the shortest budget)
        self.sizing_config = self.baseline if self.family is None else config_loader.load_sweep_config(
            self.config, self.fixed + self.trial_overrides(self.family.costliest()) + ["trial.number=0"])
        if self.family is not None:
            check_fits(self.family, run_config(self.sizing_config))
        longest = max(self.sweep.budgets or self.sweep.ladder or [config.budget.seconds])
        self.trial_timeout = self.sweep.trial_timeout or default_trial_timeout(config.budget, longest)
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
        self.unclosed: dict[str, str] = {}  # MLflow runs of FAIL trials still to be closed, and why they failed

    def grid_axes(self, config: DictConfig) -> Family | None:
        """Adds sweep.budgets and a frontier's shapes and learning-rate scales to the search space."""
        check_space(self.space, self.sweep.frontier, self.sweep.budgets)
        if self.sweep.frontier is None:
            if self.sweep.budgets is not None:
                self.space[BUDGET] = CategoricalDistribution(sorted(self.sweep.budgets))
            return None
        from frontier.device import device_kind

        found = family(self.sweep.frontier, self.sweep.budgets, config.model, config.budget.seconds,
                       device_kind(config.device))
        self.space.update(found.space())
        return found

    def grid(self) -> dict[str, list]:
        """The grid sampler's points: the search space's, a frontier's own axes without the steps beyond."""
        return {**grid_values(self.space), **(self.family.grid() if self.family else {})}

    def trial_overrides(self, params: dict) -> list[str]:
        """A trial's search-space point as overrides, with the width and heads of a frontier's shape."""
        return [as_override(k, v) for k, v in params.items()] + (self.family.derived(params) if self.family else [])

    def check_composes(self, config_loader) -> None:
        """Every trial's overrides must compose (keys exist, types fit) and pass the checks a single run
        gets up front (range checks, data.path, ...) before any trial starts: the lowest point, then
        each choice and each upper end in turn. Every value is checked before what running needs of this
        machine (the command's own run first), which imports torch and opens the store: a mistake in the
        search is answered in a second."""
        from frontier.train import check, user_errors  # the train command line's own checks of one run

        # frontier.compose's Composer explains a failed override from the config before it
        composer = Composer(config_loader, self.config.hydra.job.config_name)
        first = {key: _low(dist) for key, dist in self.space.items()}
        batches = [first] + [{**first, key: value} for key, dist in self.space.items() for value in _ends(dist)]
        trials = []
        for params in batches:
            overrides = self.fixed + self.trial_overrides(params)
            try:
                trial_config = config_loader.load_sweep_config(self.config, overrides + ["trial.number=0"])
            except Exception as err:
                raise ConfigError(self.why_not_composed(composer, config_loader, params, err)) from None
            trials.append((overrides, [parse_override(line) for line in overrides], trial_config))

        def check_trials(checks, errors) -> None:
            for overrides, parsed, trial_config in trials:
                try:  # e.g. a range reaching a depth of 0, a choice of data.path that does not exist
                    check_run(composer, trial_config, parsed, checks)
                except errors as err:
                    raise ConfigError(f"{err}, in a trial of this search ({' '.join(overrides)})") from None

        check_trials(None, ConfigError)  # their values (user_errors() would import torch to name the others)
        try:
            check_run(composer, self.config, [parse_override(line) for line in self.arguments], check)
        except user_errors() as err:
            raise ConfigError(str(err)) from None
        check_trials(check, user_errors())

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

    @contextlib.contextmanager
    def locked(self):
        """This process's lock, then the study's lock across processes and machines."""
        with self.lock, ask_lock(self.storage_spec, self.storage, self.study_name):
            yield

    def next_trial(self) -> optuna.Trial | None:
        with self.locked():
            settled = settle_orphans(self.study, skip={t._trial_id for t in self.processes.values()})
            for trial in settled:
                reason = trial.user_attrs.get("fail_reason") or f"value {trial.value}"
                log.warning(f"trial {trial.number} {trial.state.name}: its process is gone ({reason})")
            self.close_trial_runs(settled)
            self.judge_speeds()
            if not self.stopping.is_set():
                self.stop_reason = self.limit_reached()
                if self.stop_reason:
                    self.stopping.set()
            if self.stopping.is_set():
                return None
            with warnings.catch_warnings():  # "heartbeat is supposed to be used with optimize()"
                warnings.simplefilter("ignore")
                climb = self.climb()
                if climb is not None and climb is not WAIT:  # a climb before a new proposal, as in ASHA
                    return self.enqueued(*climb)
                if self.search_ended(self.study):  # contended trials run again before anything that ranks
                    if climb is WAIT:  # a running trial may still climb
                        return WAIT
                    found = self.next_rerun() or self.next_frontier_trial()
                    return found if found is not None else self.next_confirmation()
                return self.study.ask(self.space)

    def limit_reached(self) -> str:
        # failures first: they make the exit code 1, and the error line gives this reason
        if self.failures > self.sweep.max_failures:
            return f"{self.failures} trials failed (sweep.max_failures={self.sweep.max_failures})"
        ended = self.search_ended(self.study)
        if (ended and not self.confirm_seeds and self.after_grid() is None and not self.reruns_due()
                and self.climb() is None):
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

    def after_grid(self):
        """A frontier's next trial after its grid (_frontier.py), as (params, user attributes), WAIT or None."""
        if self.family is None:
            return None
        return next_after_grid(self.family, self.study, self.sweep.validate, self.baseline.seed)

    def climb(self):
        """A ladder's next climb or baseline (_ladder.py) as (params, user attributes); WAIT while none is
        due but a running trial may still make one; None when there is no ladder or it has no more."""
        if self.sweep.ladder is None:
            return None
        found = next_climb(self.study.get_trials(deepcopy=False), list(self.sweep.ladder), self.sweep.promote,
                           self.study.user_attrs.get("contended", {}))
        return found if found is not None else WAIT if search_running(self.study) else None

    def enqueued(self, params: dict, attrs: dict) -> optuna.Trial:
        """A trial of the given point, tagged with `attrs` (a trial added beside the sampler's proposals)."""
        self.study.enqueue_trial(params, user_attrs=attrs)
        space = {**self.space, **self.climbs}
        return self.study.ask({key: space[key] for key in params})

    def next_frontier_trial(self) -> optuna.Trial | None | object:
        found = self.after_grid()
        if found is None or found is WAIT:
            return found
        return self.enqueued(*found)

    def next_confirmation(self) -> optuna.Trial | None | object:
        """The next confirmation run (_confirm.py) as a trial; WAIT while a running trial may still change
        what is to be confirmed or run the last ones; once the plan's blocks have all run, one more block
        while the verdict is unresolved and the plan may grow, else None (the sweep stops)."""
        if search_running(self.study):
            return WAIT
        ended = self.search_ended(self.study)
        plan = self.confirm_plan()
        if plan is None:
            self.stop_reason = f"{ended}; none finished, so none is confirmed"
            self.stopping.set()
            return None
        found = next_run(self.study, plan)
        if found is None:
            if confirmation_running(self.study):
                return WAIT
            verdict = verdict_of(self.study, plan)
            more = extended(plan, verdict)
            if more is None:
                self.stop_reason = (f"{ended}; confirmed in {len(plan['seeds'])} blocks: "
                                    f"{verdict.outcome if verdict else 'no runs to compare'}")
                self.stopping.set()
                return None
            self.study.set_user_attr("confirm_plan", more)  # every driver of the study now runs the new block
            log.info(f"after {len(plan['seeds'])} blocks, unresolved: {verdict.best.label} is "
                     f"{verdict.best.difference:+.4f} from the defaults ({verdict.interval_text(verdict.best)}); "
                     f"adding block {len(more['seeds'])} (seed {more['seeds'][-1]}) of at most {more['max_blocks']}")
            plan, found = more, next_run(self.study, more)
        config, seed = found
        return self.enqueued(config["params"], {"confirm": config["label"], "confirm_seed": seed})

    def confirm_plan(self) -> dict | None:
        """The study's plan, made by the first driver to get here; a later command's sweep.confirm_max
        and sweep.equivalence replace the plan's (so a run again with a larger confirm_max confirms on)."""
        plan = self.study.user_attrs.get("confirm_plan")
        if plan is None:
            plan = make_plan(self.study, self.sweep.confirm_top, self.confirm_seeds, self.confirm_blocks,
                             self.baseline.seed, self.sweep.seed, self.sweep.equivalence,
                             self.sweep.ladder and (len(self.sweep.ladder) - 1, self.sweep.ladder[-1]))
            if plan is not None:
                self.study.set_user_attr("confirm_plan", plan)
                log.info(f"confirming {', '.join(c['label'] for c in plan['configs'])} in blocks of one run each, "
                         f"seeds {', '.join(map(str, plan['seeds']))}, up to {plan['max_blocks']} blocks")
            return plan
        first = plan.get("first_blocks", len(plan["seeds"]))  # a plan written before blocks: the seeds it had
        settings = {"first_blocks": first, "max_blocks": max(self.confirm_blocks, first),
                    "equivalence": self.sweep.equivalence}
        if any(plan.get(key) != value for key, value in settings.items()):
            plan = {**plan, **settings}
            self.study.set_user_attr("confirm_plan", plan)
        return plan

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
            frontier.startup_over()
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
        confirmed = report.get("confirmation")
        if report.get("best") and not confirmed:  # a confirmation's verdict is the answer (below)
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
        for seconds, fit in ((report.get("frontier") or {}).get("budgets") or {}).items():
            if fit["problem"]:
                log.info(f"frontier at {seconds:g} s: {fit['problem']}; see {out}")
                continue
            metrics[f"frontier_optimum_params_{seconds:g}s"] = fit["optimum_params"]
            metrics[f"frontier_val_bpb_{seconds:g}s"] = fit["val_bpb"]
            interval = "{:,.0f} ... {:,.0f}".format(*fit["interval"]) if fit["interval"] else fit["interval_problem"]
            log.info(f"frontier at {seconds:g} s: the optimum is {fit['optimum_params']:,.0f} parameters "
                     f"({interval}), predicted val_bpb {fit['val_bpb']:.4f}; the nearest shape: "
                     f"{fit['command']}")
        verdict = (confirmed or {}).get("verdict")
        if verdict is not None:
            metrics.update(verdict.metrics)
        self.ended.set()
        self.heartbeat.join()  # a beat in flight must not land after the record that this driver ended
        self.end_tracking(status, metrics, report["files"], verdict.tags if verdict else {})
        if verdict is not None:  # the sweep's answer, its last line
            log.info(f"verdict: {verdict.text}" + (f": {confirmed['command']}" if confirmed["command"] else ""))
        return report

    def redo(self, out: Path | None = None) -> str:
        """The command that rebuilds this sweep's report (and ends its parent run, if still RUNNING)."""
        return (f"python -m frontier.sweep_report study={self.study_name} "
                f"storage={safe_storage(self.storage_spec)}" + (f" out={out}" if out else ""))


def _on_signals(handler) -> None:
    """Ctrl-C and SIGTERM (preemption, time limits) alike; Python takes signals in the main thread only.
    One the driver was started ignoring (SIGINT in a background job) stays ignored."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, handler)


def _low(dist: BaseDistribution):
    return dist.choices[0] if isinstance(dist, optuna.distributions.CategoricalDistribution) else dist.low


def _ends(dist: BaseDistribution) -> list:
    """The values a check tries beside the lowest: every choice, or the upper end."""
    return list(dist.choices) if isinstance(dist, optuna.distributions.CategoricalDistribution) else [dist.high]


def run_sweep(config: DictConfig, arguments: list[str], config_loader, launcher=None) -> dict:
    return Sweep(config, arguments, config_loader, launcher).run()
