"""Studies: a table of drafters trained, exported and evaluated the same way, run by one resumable command,
`python study.py study=acceptance|ablation|depth dir=WORK_DIR` (configs/study.yaml, configs/study/).

plan.py and commands.py turn the config into checked commands; runner.py runs commands and records them; stages.py
holds the stages (tokenize.py: the chats rendered once for trainings started together); budget.py sizes a budget's
schedule from a probe; results.py and collect.py write the study's JSON.
"""

from __future__ import annotations

import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash2.studies.commands import make_plan
from dflash2.studies.plan import STAGES, Plan
from dflash2.studies.runner import StudyFailed, Work, study_lock, study_log

log = logging.getLogger("dflash2.studies")


def run_study(cfg: DictConfig) -> dict[str, Any] | None:
    """Run a study's stages in order, each skipping what it finished before, up to `until`; the collected JSON once the
    grid is done. Bad settings raise ValueError before anything runs; a failed command raises StudyFailed."""
    from dflash2.studies import stages
    from dflash2.studies.collect import collect

    plan = make_plan(cfg)  # every setting checked: nothing has run yet
    plan.work.mkdir(parents=True, exist_ok=True)
    with study_lock(plan.work) as lock, study_log(plan.work):
        work = Work(plan.work, plan.rehearse, lock)
        log.info("study %s in %s%s", plan.study.collect, plan.work, " (rehearsal on the CPU)" * plan.rehearse)
        remember(plan)
        stages.check_given(plan, work)
        for stage in STAGES[:-1]:
            stages.RUN[stage](plan, work)
            if plan.until == stage:
                log.info("stopped after %s (until=%s)", stage, stage)
                break
        if all(work.done(s.key) for s in plan.sweeps):
            return collect(plan)
    return None


def remember(plan: Plan) -> None:
    """WORK_DIR/study.yaml: the settings the study started with; a rerun with others says what changed (what was
    finished before stays as it was)."""
    settings = OmegaConf.create({"rehearse": plan.rehearse, "study": plan.study})
    path = plan.work / "study.yaml"
    if not path.is_file():
        OmegaConf.save(settings, path)
        return
    before = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    now = OmegaConf.to_container(settings, resolve=True)
    changed = sorted(k for k in set(_flat(before)) | set(_flat(now)) if _flat(before).get(k) != _flat(now).get(k))
    if changed:
        log.warning("settings changed since %s (%s): finished stages and items are kept as they were", path,
                    ", ".join(changed))  # fmt: skip


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


def main(cfg: DictConfig) -> int:
    """study.py: the exit status; a bad setting or a failed command ends it in a sentence that names it."""
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


__all__ = ["main", "run_study", "StudyFailed"]
