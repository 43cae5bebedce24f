"""`python train.py` (`dflash2-train`): fit a drafter on configs/train.yaml.

The call path: train.py -> `main` here -> Hydra composes the config -> its PrepareRun callback restores a resume's
settings and checks the config once, before the run folder exists (dflash2.commands.train_checks, which runs
dflash2.training.checks) -> `task` -> `run` builds the groups' objects (dflash2.commands.train_groups) and hands them,
with the run's settings as plain values, to dflash2.training.run, which fits the drafter (dflash2.training.module)
and prints the summary.
"""

from __future__ import annotations

import time
from typing import Any

from omegaconf import DictConfig

from dflash2.commands import command
from dflash2.commands.resolvers import register_resolvers
from dflash2.commands.train_checks import PrepareRun, check_config
from dflash2.commands.train_groups import (
    build_data,
    build_logger,
    build_module,
    build_trainer,
    load_target,
    run_settings,
)
from dflash2.model.config import DFlash2Config
from dflash2.training import run as training
from dflash2.training.drafter import warm_start_replaced

COMMAND = "python train.py"  # what a stopped run's message tells the user to type to resume it


def main() -> None:
    """The console entry: train.yaml's run folder and precision resolve through dflash2's resolvers."""
    register_resolvers()
    command("train", task)


def task(cfg: DictConfig) -> dict[str, Any]:
    """Hydra's task: `run`, with the drafter PrepareRun resolved when it checked this very config."""
    draft, PrepareRun.checked = PrepareRun.checked, None
    return run(cfg, draft=draft)


def run(cfg: DictConfig, callbacks: list[Any] | None = None, draft: DFlash2Config | None = None) -> dict[str, Any]:
    """Fit a drafter on a composed configs/train.yaml; returns dflash2.training.run.fit's result. `draft`: the drafter
    the config's check resolved; without it (a caller that did not check the config) it is checked here. `callbacks`
    are added to the configured ones (tests look inside a run with them)."""
    started = time.time()
    draft = draft or check_config(cfg)
    settings = run_settings(cfg, COMMAND)
    training.announce(settings, draft, warm_start_replaced(settings.config["draft"], draft))
    training.seed_run(settings)
    target = load_target(cfg, draft)
    datamodule = build_data(cfg, target, draft)
    training.prepare_data(settings, datamodule)
    module = build_module(target, cfg, draft, training.manifest(settings, target))
    trainer = build_trainer(cfg, settings, build_logger(cfg, settings.run_dir), callbacks)
    return training.fit(settings, trainer, module, datamodule, draft, started)


if __name__ == "__main__":
    main()
