"""`python study.py` (`dflash2-study`): a study end to end, resumably, on configs/study.yaml:
`python study.py study=acceptance|ablation|depth dir=WORK_DIR [key=value ...]` (rehearse=true for tiny sizes on the
CPU, until=<stage> to stop after a stage). The config becomes a checked plan (dflash2.commands.study_plan) before
anything runs; dflash2.studies runs it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from omegaconf import DictConfig

from dflash2.commands import command
from dflash2.commands.study_plan import make_plan
from dflash2.studies import StudyFailed, run_plan

log = logging.getLogger("dflash2.studies")


def main() -> None:
    """The console entry; the exit status is the study's."""
    command("study", lambda cfg: sys.exit(run(cfg)))


def run(cfg: DictConfig) -> int:
    """The study's exit status; a bad setting or a failed command ends it in a sentence that names it."""
    try:
        run_study(cfg)
    except ValueError as e:
        log.error("%s", e)
        return 2
    except StudyFailed as e:
        log.error("FAILED %s (rerun the same command to resume)", e)
        return 1
    except KeyboardInterrupt:
        log.error("stopped: rerun the same command to resume")
        return 130
    return 0


def run_study(cfg: DictConfig) -> dict[str, Any] | None:
    """Plan the study (every setting checked: nothing has run yet), then run it: the collected JSON once the grid is
    done, else None (stopped by `until`)."""
    return run_plan(make_plan(cfg))


if __name__ == "__main__":
    main()
