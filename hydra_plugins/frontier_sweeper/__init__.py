"""Frontier's Hydra sweeper: budgeted Optuna searches selected with `--multirun sweep=NAME`."""
