"""Registers `hydra/sweeper=frontier` and the sweep presets, and dispatches a multirun.

Hydra imports this module while it discovers plugins, before it composes any config, so the
registrations below are in place for every `python -m frontier.train`. Heavy imports (Optuna,
torch) wait until a sweep actually runs.

The presets live in <project>/sweeps/*.yaml. Hydra maps a config group to a directory named like
the group under a search-path root, and sweeps/ sits beside conf/, so each file is stored in
Hydra's ConfigStore as an option of the group `sweep` instead: `sweep=lr` selects sweeps/lr.yaml
and `sweep.n_trials=40` overrides its keys (schema: frontier.config.SweepConfig).

No `from __future__ import annotations` here: Hydra executes this module before it is in
sys.modules, and dataclasses then cannot resolve string annotations.
"""
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra._internal.core_plugins import basic_sweeper
from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from frontier import paths

SWEEPS_DIR = paths.sweeps_dir()


@dataclass
class FrontierSweeperConf:
    _target_: str = "hydra_plugins.frontier_sweeper.frontier_sweeper.FrontierSweeper"
    max_batch_size: Optional[int] = None  # plain comma-list grids, as Hydra's basic sweeper
    params: Optional[Dict[str, str]] = None


def register_presets(directory: Path = SWEEPS_DIR) -> None:
    store = ConfigStore.instance()
    for path in sorted(directory.glob("*.yaml")):
        store.store(group="sweep", name=path.stem, node=OmegaConf.load(path), provider="frontier")


ConfigStore.instance().store(group="hydra/sweeper", name="frontier", node=FrontierSweeperConf,
                             provider="frontier")
register_presets()


class FrontierSweeper(Sweeper):
    """With `sweep=NAME`: a budgeted Optuna study (see _study.py). Without: Hydra's basic sweeper,
    so `--multirun model=base,wide optim=muon,adamw` runs the grid as it always has."""

    def __init__(self, max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None):
        self.basic = basic_sweeper.BasicSweeper(max_batch_size=max_batch_size, params=params)
        self.hydra_context = None
        self.config: Optional[DictConfig] = None
        self.launcher = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.hydra_context = hydra_context
        self.config = config
        self.basic.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.launcher = self.basic.launcher

    def sweep(self, arguments: List[str]) -> Any:
        if self.config.get("sweep") is None:
            return self.basic.sweep(arguments)
        from hydra_plugins.frontier_sweeper._study import run_sweep

        return run_sweep(self.config, arguments, self.hydra_context.config_loader, self.launcher)
