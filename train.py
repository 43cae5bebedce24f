"""Train a DFlash2 drafter: `python train.py [group=option ...] [key=value ...]` (see configs/train.yaml)."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from dflash2.groups import BAD_INPUT
from dflash2.training import register_resolvers, train

register_resolvers()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    except BAD_INPUT as e:
        # Bad input (a missing model or file, an invalid setting) is the user's to fix, and the message says how.
        sys.exit(str(e))


if __name__ == "__main__":
    main()
