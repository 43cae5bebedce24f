"""Every command's Hydra entry, wired one way: the repository's configs/, Hydra 1.3's behaviour, the libraries'
warnings and progress bars kept out of the output (`progress.quiet_libraries`), and bad input (a missing file or
model, an invalid setting: `groups.BAD_INPUT`, whose message names the setting and the fix) ending the command in that
one sentence instead of a traceback.

    python train.py ...                      train()       configs/train.yaml
    python export.py ...                     export()      configs/export.yaml
    python evaluate.py [-m] ...              evaluate()    configs/evaluate.yaml
    python speed.py ...                      speed()       configs/speed.yaml
    python study.py ...                      study()       configs/study.yaml
    python -m dflash2.data.regenerate ...    regenerate()  configs/regenerate.yaml
    python -m dflash2.data.sources ...       sources()     configs/sources.yaml
    python -m dflash2.data.recipe ...        recipe()      configs/recipe.yaml
    python -m dflash2.data.features ...      features()    configs/features.yaml

Each of those configs names its Hydra job (`hydra.job.name`: train.log, evaluate.log), which Hydra would otherwise
name after the file that declares the task, this one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash2.groups import exit_on_bad_input
from dflash2.progress import quiet_libraries

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


def command(config_name: str, task: Callable[[DictConfig], Any]) -> None:
    """Run `task` on configs/<config_name>.yaml composed with the command line's overrides (once per job under -m)."""

    @exit_on_bad_input
    def job(cfg: DictConfig) -> Any:
        quiet_libraries()
        return task(cfg)

    hydra.main(version_base="1.3", config_path=CONFIGS, config_name=config_name)(job)()


def train() -> None:
    """Fit a drafter (dflash2.training.run.train)."""
    from dflash2.training.run import register_resolvers, train

    register_resolvers()  # train.yaml's run folder and precision resolve through them
    command("train", train)


def export() -> None:
    """Check a folder or export a checkpoint (dflash2.export.writer.main); the exit status is the check's."""
    from dflash2.export.writer import main

    command("export", lambda cfg: sys.exit(main(cfg)))


def evaluate() -> None:
    """One evaluation run, or each run of a sweep, into Hydra's job folder (dflash2.evaluation.run.main)."""
    from hydra.core.hydra_config import HydraConfig

    from dflash2.evaluation.run import main

    command("evaluate", lambda cfg: main(cfg, HydraConfig.get().runtime.output_dir))


def speed() -> None:
    """The speed-up at each batch and block size, predicted from measured step costs and measured
    (dflash2.evaluation.speed.run)."""
    from dflash2.evaluation.speed import run

    command("speed", run)


def study() -> None:
    """A study end to end (dflash2.studies.main); the exit status is the study's."""
    from dflash2.studies import main

    command("study", lambda cfg: sys.exit(main(cfg)))


def regenerate() -> None:
    """The target's own replies to chats (dflash2.data.regenerate.run)."""
    from dflash2.data.regenerate import run

    command("regenerate", run)


def sources() -> None:
    """The extra training prompts (dflash2.data.sources.main)."""
    from dflash2.data.sources import main

    command("sources", main)


def recipe() -> None:
    """The recipe's whole training data for a target (dflash2.data.recipe.run)."""
    from dflash2.data.recipe import run

    command("recipe", run)


def features() -> None:
    """The feature cache of a training run's settings (dflash2.training.features.run)."""
    from dflash2.training.features import run
    from dflash2.training.run import register_resolvers

    register_resolvers()  # features.yaml composes train.yaml
    command("features", run)
