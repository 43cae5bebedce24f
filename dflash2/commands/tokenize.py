"""`python -m dflash2.commands.tokenize <train.py overrides>`: render and cache the chats (data.cache_dir) as `python
train.py <the same overrides>` would, so that the trainings a study starts together only read the cache."""

from __future__ import annotations

import sys

from dflash2.commands import compose
from dflash2.commands.train_groups import build_data, target_and_draft
from dflash2.progress import quiet_libraries


def main(overrides: list[str]) -> None:
    quiet_libraries()  # once: this process is a command of its own, without Hydra's entry
    cfg = compose("train", overrides)
    build_data(cfg, *target_and_draft(cfg)).prepare_data()


if __name__ == "__main__":
    main(sys.argv[1:])
