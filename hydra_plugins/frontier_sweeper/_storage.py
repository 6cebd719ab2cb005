"""A study's storage, the sweep folder it claims, and the settings every driver of the study shares."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import optuna
from omegaconf import DictConfig, open_dict
from optuna.trial import TrialState

from frontier.config import ConfigError, error_line
from frontier.lifecycle import earlier_records
from frontier.paths import unwritable
from frontier.study import (ask_lock, build_pruner, damaged_journal, is_rdb, live_drivers, open_storage, record_driver,
                            safe_storage)

STUDY_MARKER = ".study"  # in a sweep's folder: the study whose trials it holds
EVAL_TOKENS = ("final_tokens", "checkpoint_tokens")  # eval.* keys that choose a study's validation set
_UNSET = object()  # a study attribute never recorded


def _comparable(overrides: list[str]) -> list[str]:
    """The overrides that change what a trial computes (not where it is tracked or written)."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("tracking.", "hydra.")))


class StudyStorage:
    """Opens or joins the study, claims its sweep folder, and checks that a joining driver runs the same sweep."""

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
        # every trial's val_bpb must be scored on these rows: frontier.study.outcome refuses another's
        study.set_user_attr("val_fingerprint", self.study_val_fingerprint(study))
        study.set_user_attr("pruner", self.pruner)
        study.set_user_attr("objective", self.objective.describe())
        study.set_user_attr("overrides", self.fixed)
        study.set_user_attr("every_fraction", self.config.eval.every_fraction)
        study.set_user_attr("budget_seconds", self.config.budget.seconds)
        study.set_user_attr("grace_period", self.sweep.grace_period)  # sweep_report: when a silent driver is gone
        study.set_user_attr("sweep_dir", str(self.sweep_dir))
        if self.sweep.ladder is not None:  # what frontier/ladder.py reports
            study.set_user_attr("ladder", {"rungs": list(self.sweep.ladder), "promote": self.sweep.promote})
        if self.family is not None:  # what frontier/shapes.py fits
            study.set_user_attr("frontier", self.family.describe())
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
        final, checkpoint, why = self.sized_eval_tokens()  # the command's own values where it gives them
        return {"final_tokens": final, "checkpoint_tokens": checkpoint, "how": why}

    def study_val_fingerprint(self, study: optuna.Study) -> str:
        """The fingerprint of the validation set every trial is scored on: the study's once a driver
        recorded it, else that of the baseline's rows (its data, tokenizer and model.seq_len) at the
        study's eval.final_tokens. Equal token counts are not equal rows: another seq_len or tokenizer
        scores other text."""
        recorded = study.user_attrs.get("val_fingerprint")
        if recorded:
            return recorded
        from frontier.data import load_corpus, load_tokenizer, resolve_splits, validation_set

        config = run_config(self.baseline)
        train, val = resolve_splits(config.data)
        tokenizer = load_tokenizer(config.data, train)
        return validation_set(load_corpus(val, tokenizer, config.data, "val"), tokenizer, config.model.seq_len,
                              self.eval_tokens["final_tokens"]).fingerprint()

    def sized_eval_tokens(self) -> tuple[int, int, str]:
        import torch

        from frontier.device import resolve_device
        from frontier.model import Ops
        from frontier.trainer import eval_sizing

        config = run_config(self.sizing_config)
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


def run_config(composed: DictConfig):
    """The typed run config (range checks included) of a trial's composed config: its keys without Hydra's."""
    from frontier.config import to_config

    raw = composed.copy()
    with open_dict(raw):
        del raw["hydra"]
    return to_config(raw)
