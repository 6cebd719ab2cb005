"""`python -m frontier.train`: the command line of one budgeted run (frontier.trainer does the work).

Exit codes: 0 finished (or pruned inside a sweep trial); 2 a user's mistake, one sentence
`error: ...`; 130 stopped by a signal (resume.pt written); 1 a run that failed, one line
`error: <reason>` (no traceback for divergence or a file that could not be written).
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.types import Override
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from frontier import cli, compose, paths, sizing
from frontier.config import ConfigError, project_path, to_config


def user_errors() -> tuple[type[Exception], ...]:
    """Imported when needed, so that a mistake on the command line is found before torch loads."""
    from frontier.core import CoreBundleError
    from frontier.data import DataError

    return ConfigError, DataError, CoreBundleError, FileNotFoundError


def say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one rank says it
        print(f"error: {message}", file=sys.stderr)


def check(cfg: DictConfig, overrides: list[Override]) -> None:
    """Checked before Hydra writes anything: where `resume=` points, that nothing else is asked of a resumed
    run and that no process still runs it, that a local data.path holds data and data.tokenizer_path a
    tokenizer, that data.cache_dir can be written, that this machine has the device, kernels and CORE
    bundle the run needs, and that a tracking server answers or a SQLite store can be created (a resumed
    run reads its saved config, checked when it starts)."""
    if cfg.resume is not None:
        from frontier.lifecycle import check_not_running

        for override in overrides:  # the saved config wins: anything else asked would be silently dropped
            if override.key_or_group not in ("resume", "tracking.uri") and not override.is_hydra_override():
                raise ConfigError(f"{override.input_line} is not allowed with resume=: a resumed run continues "
                                  "with the config it was launched with (tracking.uri, to find a run by its "
                                  "MLflow id, and hydra.* options are the only other overrides it takes)")
        from frontier.trainer import resume_point

        # an MLflow run id is looked up now: a mistake found later leaves Hydra's record of a new run
        _, run_dir, _ = resume_point(str(cfg.resume), OmegaConf.to_object(cfg.tracking), mmap=True)
        check_not_running(run_dir, "resume")
        return
    from frontier.data import given_tokenizer, resolve_splits

    if cfg.data.source == "local":
        resolve_splits(OmegaConf.to_object(cfg.data))
    if cfg.data.tokenizer_path:
        given_tokenizer(OmegaConf.to_object(cfg.data))
    compose.check_writable_path("data.cache_dir", project_path(cfg.data.cache_dir))
    from frontier.trainer import check_runnable  # imports torch: after the checks that need none

    check_runnable(to_config(cfg))  # the device, kernels and CORE bundle this machine must have
    # a sweep's driver opens its store whatever tracking.required says, after its study is created
    if cfg.tracking.enabled and (cfg.tracking.required or cfg.get("sweep") is not None):
        from frontier.store import check_store_folder, probe_store

        tracking = OmegaConf.to_object(cfg.tracking)
        try:
            probe_store(tracking)
        except ConfigError as err:
            raise ConfigError(f"{err}; or set tracking.required=false to train without tracking") from None
        check_store_folder(tracking)


GROUPS = ("model", "optim", "schedule", "kernel", "budget", "data", "sweep")
UNNAMED = ("tracking.", "hydra.", "paths.", "trial.", "data.path", "data.cache_dir", "sweep")  # where, not what
RUN_NAME_CHARS = 250  # MLflow's SQL stores keep no longer a run name


def run_name(model: str, overrides: list[str]) -> str:
    """A run's MLflow name: its model, then its command line's other choices and overrides, e.g.
    `d4 optim=adamw optim.matrix_lr=0.02 seed=7` (a sweep names its trials itself)."""
    parts = [model]
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key != "model" and not key.startswith(UNNAMED):
            parts.append(override.lstrip("+~"))
    name = " ".join(parts)
    return name if len(name) <= RUN_NAME_CHARS else name[:RUN_NAME_CHARS - 1] + "…"


@cli.main(config_path=str(paths.conf_dir()), config_name="config", user_errors=user_errors)
def main(cfg: DictConfig) -> float:
    from frontier.lifecycle import RunWriteError
    from frontier.trainer import Diverged, train

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if cfg.get("sweep") is not None and not multirun:
        print(f"warning: sweep={cfg.sweep.name} needs --multirun; training one run with the base config",
              file=sys.stderr)
    if cfg.tracking.run_name is None and cfg.resume is None:  # the MLflow runs table then says what each run is
        cfg.tracking.run_name = run_name(cfg.model.name, list(hydra_cfg.overrides.task))
    sized = sizing.describe()
    if sized and not multirun and cfg.resume is None and int(os.environ.get("RANK", "0")) == 0:
        print(sized, file=sys.stderr)
    try:
        return train(cfg, Path(hydra_cfg.runtime.output_dir))
    except user_errors() as err:
        if multirun:
            raise  # the sweeper records the trial as failed and goes on
        say(str(err))
        raise SystemExit(2) from None
    except (Diverged, RunWriteError) as err:  # recorded FAILED; one line says why
        if multirun:
            raise
        say(str(err))
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if multirun:
            raise
        for sig in (signal.SIGTERM, signal.SIGINT):  # recorded already: a late signal must not turn 130 into 143
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(130) from None  # recorded KILLED; resume.pt written at a step boundary


if __name__ == "__main__":
    main()  # frontier.cli.Checks checks the config Hydra composed (`check` too) before Hydra writes anything
