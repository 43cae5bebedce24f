"""`python speed.py ...` (`dflash2-speed`): the speed-up at each batch and block size, predicted from measured step
costs and measured by decoding (configs/speed.yaml, dflash2/evaluation/speed.py). The config becomes checked, typed
settings before anything loads or is written."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash2.commands import command
from dflash2.commands.evaluate import target_loader
from dflash2.evaluation.speed import run as measure
from dflash2.evaluation.speed import speed_settings


def main() -> None:
    command("speed", run)


def run(cfg: DictConfig) -> dict[str, Any]:
    """The composed configs/speed.yaml: writes <output>/speed.json and returns what it holds."""
    settings = speed_settings(OmegaConf.to_container(cfg, resolve=True))
    return measure(settings, target_loader(cfg.model, settings.acceptance.device))


if __name__ == "__main__":
    main()
