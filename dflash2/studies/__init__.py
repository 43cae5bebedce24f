"""Studies: a table of drafters trained, exported and evaluated the same way, run by one resumable command,
`python study.py study=acceptance|ablation|depth dir=WORK_DIR` (configs/study.yaml, configs/study/).

The command (dflash2/commands/study.py, study_plan.py) turns the config into a checked `Plan` (plan.py); here the plan
runs: runner.py runs commands and records them; stages.py holds the stages; budget.py sizes a budget's schedule from a
probe; results.py and collect.py write the study's JSON.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from dflash2.studies.plan import STAGES, Plan
from dflash2.studies.runner import StudyFailed, Work, study_lock, study_log

log = logging.getLogger("dflash2.studies")


def run_plan(plan: Plan) -> dict[str, Any] | None:
    """Run a study's stages in order, each skipping what it finished before, up to `until`; the collected JSON once the
    grid is done. A failed command raises StudyFailed."""
    from dflash2.studies import stages
    from dflash2.studies.collect import collect

    plan.work.mkdir(parents=True, exist_ok=True)
    with study_lock(plan.work) as lock, study_log(plan.work):
        work = Work(plan.work, plan.rehearse, lock)
        log.info("study %s in %s%s", plan.study["collect"], plan.work, " (rehearsal on the CPU)" * plan.rehearse)
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
    now = {"rehearse": plan.rehearse, "study": plan.study}
    path = plan.work / "study.yaml"
    if not path.is_file():
        path.write_text(yaml.safe_dump(now, sort_keys=False))
        return
    before = yaml.safe_load(path.read_text())
    changed = sorted(k for k in set(_flat(before)) | set(_flat(now)) if _flat(before).get(k) != _flat(now).get(k))
    if changed:
        log.warning("settings changed since %s (%s): finished stages and items are kept as they were", path,
                    ", ".join(changed))  # fmt: skip


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


__all__ = ["run_plan", "StudyFailed"]
