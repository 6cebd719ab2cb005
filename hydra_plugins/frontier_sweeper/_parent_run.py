"""MLflow for a sweep: one parent run per study, which every driver continues; trials nest under it."""
from __future__ import annotations

import logging

from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, TrialState

from frontier.config import ConfigError, error_line, store_error_line
from frontier.study import live_drivers, record_driver, safe_storage

log = logging.getLogger(__package__ + "._study")  # the sweep driver's lines under one name, whichever part logs


class TrackingStartError(Exception):
    """The tracking store failed as the sweep opened its MLflow parent run, after the command line's
    check found it usable."""


def _short(value) -> str:
    """A parameter as a run's name shows it: floats to 4 significant digits."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ParentRun:
    """The study's MLflow parent run, and the runs of trials this driver ended."""

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

    def end_tracking(self, status: str, metrics: dict, artifacts: list, tags: dict | None = None) -> None:
        """The last driver of the study to stop ends its parent run (with the confirmation's `verdict`
        tags, frontier/verdict.py); earlier ones leave it running."""
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
                                    metrics, artifacts, tags)
        except Exception as err:
            log.warning(f"could not end the sweep's MLflow run {self.parent_run_id} ({error_line(err)}); "
                        f"once the tracking store answers, {self.redo()} attaches the report and ends it "
                        f"{status}")

    def close_trial_runs(self, trials: list[FrozenTrial]) -> None:
        """MLflow runs of FAIL trials whose process died before it could end them: KILLED, with the
        trial's fail_reason as their `error` tag. A run the store could not close (it was down) is tried
        again with the next ones and at the sweep's end."""
        if not self.config.tracking.enabled:
            return
        from frontier import store

        with self.closing:
            self.unclosed.update({t.user_attrs["mlflow_run_id"]: t.user_attrs.get("fail_reason", "")
                                  for t in trials if t.state == TrialState.FAIL and t.user_attrs.get("mlflow_run_id")})
            if not self.unclosed:
                return
            failed = store.close_runs(OmegaConf.to_object(self.config.tracking), sorted(self.unclosed), "KILLED",
                                      self.unclosed)
            for run_id, error in failed.items():
                log.warning(f"could not close the MLflow run {run_id} yet (tried again later): {error}")
            self.unclosed = {run_id: self.unclosed[run_id] for run_id in failed}

    def tag_trial_run(self, trial: FrozenTrial, tags: dict[str, str]) -> None:
        """Tags on a trial's MLflow run, ended or not; a store that fails is a warning (the study has it)."""
        run_id = trial.user_attrs.get("mlflow_run_id")
        if not self.config.tracking.enabled or not run_id:
            return
        from frontier import store

        try:
            store.tag_run(OmegaConf.to_object(self.config.tracking), run_id, tags)
        except Exception as err:
            log.warning(f"could not tag the MLflow run {run_id} of trial {trial.number} ({store_error_line(err)})")
