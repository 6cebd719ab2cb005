"""The workers of a sweep: device slots, the processes that run trials (one started ahead per slot), and
how a trial's end is settled."""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import optuna
from omegaconf import DictConfig
from optuna.trial import TrialState

from frontier.config import ConfigError, store_error_line
from frontier.lifecycle import TERMINAL, earlier_records
from frontier.study import DRIVER_ENV, Process, end_trial, outcome, read_summary
from hydra_plugins.frontier_sweeper._confirm import next_run
from hydra_plugins.frontier_sweeper._launch import JobWatch
from hydra_plugins.frontier_sweeper._parent_run import _short
from hydra_plugins.frontier_sweeper._space import as_override

log = logging.getLogger(__package__ + "._study")  # the sweep driver's lines under one name, whichever part logs


@dataclass
class Slot:
    """Where one worker runs its trials: the environment that pins the trial's process."""

    label: str
    env: dict[str, str]
    kind: str = ""  # what runs its trials (a GPU's name, a CPU and its threads): their speeds compare within a kind


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
        from frontier.bench_results import cpu_family

        return [Slot(f"cpu ({threads} threads)", env, f"{cpu_family()} cpu, {threads} threads") for _ in range(n_jobs)]
    if n_jobs * per_trial > len(ids):
        raise ConfigError(f"sweep.n_jobs={n_jobs} is not allowed: this machine has {len(ids)} {kind} "
                          f"device(s) ({variable}={','.join(ids) or 'none'}), so at most "
                          f"{len(ids) // per_trial} trials of sweep.devices_per_trial={per_trial}")
    groups = [ids[i * per_trial:(i + 1) * per_trial] for i in range(n_jobs)]
    # torch numbers the visible devices in the order the variable lists them
    names = [" + ".join(torch.cuda.get_device_name(ids.index(i)) if kind == "cuda" else kind for i in group)
             for group in groups]
    return [Slot(f"{kind} {variable}={','.join(group)}", {variable: ','.join(group)}, name)
            for group, name in zip(groups, names)]


def trainer_command(per_trial: int = 1) -> list[str]:
    """The command that started this sweep, for its trials: `python -m frontier.train`, under
    torchrun when a trial owns several devices."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    if per_trial > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={per_trial}",
                *program]
    return [sys.executable, *program]


def describe_exit(returncode: int, log_path: Path) -> str:
    """Why a trial's process ended without telling the study. A kill by this driver never gets
    here (it records its reason first), so an unexplained SIGKILL is most likely the kernel's."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        return f"killed by {name}" + (" (not by its driver: by hand, or by the kernel when out of host "
                                      "memory?)" if name == "SIGKILL" else "")
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {returncode}"
WAIT = object()  # next_trial: none to start now, but one may follow


class SweepDirTaken(Exception):
    """A trial's folder holds another run's records, written there after the sweep's start was checked."""


class SweepDirUnwritable(Exception):
    """The sweep's folder cannot be written (a full disk)."""


PROBE_BYTES = 1 << 20  # a folder that cannot take this much more cannot take a trial's records
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
UNWRITABLE = (*NO_SPACE, errno.EROFS, errno.EACCES, errno.EPERM)


def unwritable(folder: Path, fail_reason: str) -> str | None:
    """Why trials cannot write into `folder`, judged when one failed with `fail_reason`: the OS's "No space
    left on device" in that reason (the failed write's own files are gone by now, so the disk may no longer
    look full), or the OS's reason for refusing a write there now (full, read-only, not permitted)."""
    found = next((os.strerror(code) for code in NO_SPACE if os.strerror(code) in fail_reason), None)
    if found is not None:
        return found
    probe = folder / ".write-probe"
    try:
        with open(probe, "wb") as out:
            out.write(bytes(PROBE_BYTES))
            out.flush()
            os.fsync(out.fileno())
    except OSError as err:
        return os.strerror(err.errno) if err.errno in UNWRITABLE else None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


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


class Workers:
    """Runs each trial in a process of its own pinned to its slot, supervises it, and settles its end."""

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
            params = self.trial_overrides(trial.params)
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
                               "device": slot.label, "device_kind": slot.kind or slot.label,
                               "driver": str(self.driver), "launched": self.launched is not None}.items():
                trial.set_user_attr(key, value)
            rerun_of = trial.user_attrs.get("rerun_of")
            log.info(f"trial {trial.number} started on {slot.label}: {' '.join(params)}"
                     + (f" (confirmation: {confirm}, seed={seed})" if confirm is not None else "")
                     + (f" (re-run of the contended trial {rerun_of})" if rerun_of is not None else ""))
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
            # appended: a slot's log keeps every standby's output, in turn
            with contextlib.suppress(OSError), open(self.sweep_dir / f".standby-{number}.log", "a") as out:
                tracked = ["--tracked"] if self.config.tracking.enabled else []
                command = [sys.executable, "-m", "frontier.standby", *tracked]
                self.standby[id(slot)] = self.start_process(slot, command, stdout=out, stdin=subprocess.PIPE, text=True)
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
        fork) ends FAIL saying why, rather than staying RUNNING until another driver takes it for dead."""
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

    def not_counted(self, number: int, reason: str) -> None:
        """Trial `number` failed for want of a writable folder, not for its parameters: it does not count
        toward sweep.n_trials (_objective.py), so the study gets all its trials once there is space."""
        with self.locked():
            self.study.set_user_attr("uncounted", {**self.study.user_attrs.get("uncounted", {}), str(number): reason})

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
            state, value, attrs = outcome(read_summary(run_dir), reason, self.study.user_attrs.get("objective"),
                                          self.study.user_attrs.get("val_fingerprint"))
            end_trial(self.study, trial._trial_id, state, value, attrs)
            frozen = storage.get_trial(trial._trial_id)
        with self.lock:
            self.busy_seconds += seconds
            if frozen.state == TrialState.FAIL:
                self.failures += 1
        self.close_trial_runs([frozen])
        if frozen.state == TrialState.FAIL:  # every next trial would fail the same way: the sweep stops
            reason = frozen.user_attrs.get("fail_reason", "")
            why = unwritable(self.sweep_dir, reason)
            if why is not None:
                self.not_counted(frozen.number, reason)
                where = (f"the disk of its folder {self.sweep_dir} is full" if why in map(os.strerror, NO_SPACE)
                         else f"its folder {self.sweep_dir} cannot be written ({why})")
                raise SweepDirUnwritable(f"{where} (trial {trial.number} failed: {reason}); once it can be written, "
                                         "the same command goes on with the study, without counting that trial")
        message = {TrialState.COMPLETE: ", ".join(f"{name} {value:.4f}" for name, value in
                                                zip(self.objective.value_names, frozen.values or ())),
                   TrialState.PRUNED: frozen.user_attrs.get("prune_reason", "pruned")}.get(
            frozen.state, frozen.user_attrs.get("fail_reason", ""))
        log.info(f"trial {trial.number} {frozen.state.name} after {seconds:.0f} s: {message}")
