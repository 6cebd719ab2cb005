"""`python -m frontier.train`: the command line of one budgeted run (frontier.trainer does the work).

Exit codes: 0 finished (or pruned inside a sweep trial); 2 a user's mistake, one sentence
`error: ...`; 130 stopped by a signal (resume.pt written); 1 a run that failed, one line
`error: <reason>` (no traceback for divergence or a file that could not be written).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from frontier.config import ConfigError
from frontier.core import CoreBundleError
from frontier.data import DataError
from frontier.lifecycle import RunWriteError
from frontier.trainer import Diverged, train

USER_ERRORS = (ConfigError, DataError, CoreBundleError, FileNotFoundError)
FAILED_RUNS = (Diverged, RunWriteError)  # recorded FAILED; one line says why


def say(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one rank says it
        print(f"error: {message}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if cfg.get("sweep") is not None and not multirun:
        print(f"warning: sweep={cfg.sweep.name} needs --multirun; training one run with the base config",
              file=sys.stderr)
    try:
        return train(cfg, Path(hydra_cfg.runtime.output_dir))
    except USER_ERRORS as err:
        if multirun:
            raise  # the sweeper records the trial as failed and goes on
        say(str(err))
        raise SystemExit(2) from None
    except FAILED_RUNS as err:
        if multirun:
            raise
        say(str(err))
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        if multirun:
            raise
        raise SystemExit(130) from None  # recorded KILLED; resume.pt written at a step boundary


def check_output_dirs(argv: list[str]) -> None:
    """Hydra creates its run directory before any of our code runs: one that cannot be created is
    refused here in one sentence, not with Hydra's traceback."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in ("hydra.run.dir", "hydra.sweep.dir") and value:
            try:
                Path(value).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                print(f"error: {key}={value} is not allowed: it cannot be created ({err.strerror or err})",
                      file=sys.stderr)
                raise SystemExit(2) from None


if __name__ == "__main__":
    check_output_dirs(sys.argv[1:])
    main()
