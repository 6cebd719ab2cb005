"""Trials dispatched through a Hydra launcher (`hydra/launcher=submitit_slurm`, `submitit_local`,
`ray`, ...) instead of the built-in per-device workers (`hydra/launcher=basic`, the default).

Each of the `sweep.n_jobs` workers still asks the study for one trial at a time and tells it how
the trial ended; only the run itself happens in the launcher's job: the same task function
(`frontier.train`'s main, in the job's process) with the same overrides, in the same run directory
`<hydra.sweep.dir>/<trial number>`. The trial reports its checkpoints to the study's storage from
wherever it runs, so pruning works as with the built-in workers as long as that storage is
reachable from the job (PostgreSQL, or a journal file on a shared disk).

Devices: a scheduler (SLURM, Ray) gives each job its own; a local launcher (submitit_local) would
give every job the same CUDA_VISIBLE_DEVICES, so each worker pins its trials to its own device(s)
through `hydra.job.env_set`, which Hydra applies in the job before the task function starts.

submitit jobs are submitted one per trial with a handle kept, and supervised as the built-in
workers supervise their processes: while a job waits in the scheduler's queue the driver keeps its
trial's heartbeat (a queued trial is not a dead one); once it runs, a job past `sweep.trial_timeout`
or silent for `sweep.grace_period` is cancelled and its trial recorded FAIL with why, and Ctrl-C /
SIGTERM of the sweep cancels the jobs still running (scancel on SLURM). Other launchers go through
`Launcher.launch`, which returns when the job has ended: the driver keeps their trial's heartbeat
until then, and cannot enforce `sweep.trial_timeout` or cancel them.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from optuna.trial import TrialState

from frontier.config import ConfigError, error_line
from frontier.study import end_trial
from hydra_plugins.frontier_sweeper._space import as_override

log = logging.getLogger(__name__)

LOCAL_LAUNCHERS = ("LocalLauncher", "JoblibLauncher")  # jobs on this machine: pin their devices
QUEUED = ("PENDING", "REQUEUED", "CONFIGURING", "UNKNOWN")  # submitted, not running yet
CANCEL_WAIT = 15  # seconds a cancelled job may take to end before its worker moves on


def is_builtin(launcher) -> bool:
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    return launcher is None or type(launcher) is BasicLauncher


class LaunchedTrials:
    """Runs one trial at a time per calling worker thread through `launcher`."""

    def __init__(self, launcher, devices_per_trial: int):
        self.launcher = launcher
        self.name = type(launcher).__name__
        self.local = self.name in LOCAL_LAUNCHERS
        if devices_per_trial > 1:
            raise ConfigError(f"sweep.devices_per_trial={devices_per_trial} is not allowed with a Hydra "
                              f"launcher ({self.name}): a launched trial is one process; run several "
                              "devices per trial with the built-in workers (hydra/launcher=basic)")
        self.submitit = hasattr(launcher, "_EXECUTOR")  # hydra-submitit-launcher's Local/SlurmLauncher
        if self.submitit:
            try:  # here, not at each trial: e.g. submitit_slurm on a machine without SLURM
                submitit_executor(launcher)
            except Exception as err:
                raise ConfigError(f"hydra/launcher=submitit_{launcher._EXECUTOR} is not usable here "
                                  f"({error_line(err, named=False)}): run the sweep on a machine of "
                                  "the cluster, or use hydra/launcher=basic") from None
        self.lock = threading.Lock()
        self.cancelled = False

    def run(self, overrides: list[str], number: int, run_dir: Path, env: dict[str, str],
            watch: "JobWatch") -> tuple[int, str | None]:
        """Runs the trial with `env` set in its job. Returns 0 when its task function returned, else
        1 (the reason is the last line of run_dir/output.log, which holds the job's stdout and
        stderr), and why the driver stopped it, if it did."""
        overrides = list(overrides) + [f"hydra.sweep.dir={run_dir.parent}", f"hydra.sweep.subdir={run_dir.name}"]
        # Hydra sets these in the job before the task function starts (a local job's devices, the driver)
        overrides += [as_override(f"++hydra.job.env_set.{key}", value) for key, value in env.items()]
        output = run_dir / "output.log"
        try:
            result = self._submitit(overrides, number, output, watch) if self.submitit else \
                self._blocking(overrides, number, watch)
        except Exception as err:  # the job died (killed, cancelled, node lost) or could not be submitted
            _append(output, f"error: {self.name} job ended without a result: {error_line(err)}")
            return 1, watch.reason or ("stopped by its driver (interrupted)" if self.cancelled else None)
        if result.status == JobStatus.COMPLETED:
            return 0, watch.reason
        error = result._return_value
        _append(output, f"error: {type(error).__name__}: {error}")
        return 1, watch.reason

    def _blocking(self, overrides: list[str], number: int, watch: "JobWatch") -> JobReturn:
        """A launcher whose launch() returns when its job has ended (Ray, joblib) cannot say whether the
        job waits in a queue, nor stop it: the driver beats for the trial until it returns, or its own
        workers would take the queued trial for a dead one after grace_period."""
        returned = threading.Event()

        def beat() -> None:
            while not returned.wait(watch.interval):
                with contextlib.suppress(Exception):  # a storage hiccup: the next beat may pass
                    watch.beat()

        threading.Thread(target=beat, name=f"trial-{number}-heartbeat", daemon=True).start()
        try:
            return self.launcher.launch([overrides], initial_job_idx=number)[0]
        finally:
            returned.set()

    def _submitit(self, overrides: list[str], number: int, output: Path, watch: "JobWatch") -> JobReturn:
        executor = submitit_executor(self.launcher)
        with self.lock:
            if self.cancelled:
                raise RuntimeError("interrupted before it was submitted")
            job = executor.submit(self.launcher, overrides, "hydra.sweep.dir", number, f"job_id_for_{number}",
                                  Singleton.get_state())
        log.info(f"trial {number} is {self.name} job {job.job_id}")
        cancelled_at = None
        try:
            while not job.done():
                if cancelled_at is None and (self.cancelled or watch.stop_reason(job.state in QUEUED)):
                    cancelled_at = time.monotonic()
                    cancel(job)
                elif cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_WAIT:
                    # the trial is recorded FAIL already; a trial still running stops by itself once
                    # it finds its trial ended or its driver gone
                    raise RuntimeError(f"it did not end within {CANCEL_WAIT} s of its cancellation")
                time.sleep(1.0)
            if cancelled_at is not None and not job.paths.result_pickle.exists():
                # a cancelled job writes no result, and submitit's result() would wait 15 s for one
                raise RuntimeError("it was cancelled before it returned")
            return job.result()
        finally:
            for path in (job.paths.stdout, job.paths.stderr):  # one log per trial, as the built-in workers write
                if path.exists():
                    _append(output, path.read_text(errors="replace"))

    def terminate(self) -> None:
        """Ctrl-C or SIGTERM of the sweep: each worker cancels its job."""
        with self.lock:
            self.cancelled = True


def cancel(job) -> None:
    """scancel on SLURM. A local job's controller gets SIGINT from submitit, which a driver started
    in the background passes on ignored; SIGTERM as well reaches the trial (forwarded)."""
    try:
        job.cancel(check=False)
        process = getattr(job, "_process", None)
        if process is not None:
            process.send_signal(signal.SIGTERM)
    except Exception as err:  # already gone
        log.warning(f"could not cancel job {job.job_id}: {err}")


class JobWatch:
    """The driver's side of a launched trial: its heartbeat while the job is queued; once it runs,
    its time limit and its own heartbeat."""

    def __init__(self, study, trial, trial_timeout: float, grace_period: float, heartbeat_interval: float):
        self.study, self.trial = study, trial
        self.trial_timeout, self.grace_period = trial_timeout, grace_period
        self.interval = min(heartbeat_interval, 5)
        self.started: float | None = None  # when the job began to run
        self.next_check = 0.0
        self.reason: str | None = None

    def beat(self) -> None:
        """The trial's heartbeat, sent for it while its job cannot."""
        self.study._storage.record_heartbeat(self.trial._trial_id)

    def stop_reason(self, queued: bool) -> str | None:
        """Why to stop the job now (recorded FAIL first: a cancelled job cannot), or None."""
        now = time.monotonic()
        if now < self.next_check:
            return None
        self.next_check = now + self.interval
        if queued:
            self.beat()
            return None
        self.started = self.started or now
        if now - self.started > self.trial_timeout:
            reason = f"killed by its driver: it ran past sweep.trial_timeout={self.trial_timeout:g} s"
        elif self.trial._trial_id in self.study._storage._get_stale_trial_ids(self.study._study_id):
            reason = f"killed by its driver: it sent no heartbeat for sweep.grace_period={self.grace_period} s"
        else:
            return None
        self.reason = reason
        end_trial(self.study, self.trial._trial_id, TrialState.FAIL, None, {"fail_reason": reason})
        return reason


def submitit_executor(launcher):
    """The executor BaseSubmititLauncher.launch builds, for one job at a time."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    kind = launcher._EXECUTOR
    params = dict(launcher.params)
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{kind}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=kind, **init)
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in shared else f"{kind}_{key}": value for key, value in params.items()})
    return executor


def _append(path: Path, text: str) -> None:
    with open(path, "a") as out:
        out.write(text if text.endswith("\n") else text + "\n")
