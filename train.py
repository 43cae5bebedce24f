"""Train a DFlash2 drafter: `python train.py [group=option ...] [key=value ...]` (see configs/train.yaml)."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dflash2.groups import exit_on_bad_input
from dflash2.training import register_resolvers, train

register_resolvers()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
@exit_on_bad_input
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
