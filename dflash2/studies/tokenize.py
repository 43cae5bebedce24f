"""python -m dflash2.studies.tokenize <train.py overrides>: render and cache the chats (data.cache_dir) as `python
train.py <the same overrides>` would, so that the trainings a study starts together only read the cache."""

from __future__ import annotations

import sys

from dflash2.progress import quiet_libraries


def main(overrides: list[str]) -> None:
    from dflash2.studies.commands import compose
    from dflash2.training.run import build_data, target_and_draft

    quiet_libraries()
    cfg = compose("train", overrides)
    build_data(cfg, *target_and_draft(cfg)).prepare_data()


if __name__ == "__main__":
    main(sys.argv[1:])
