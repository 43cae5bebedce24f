"""The stages of a study, in order (dflash2/studies/plan.py STAGES); each skips what WORK_DIR/done/ marks finished.

data      the chats the drafters train on: the regenerated ShareGPT set of artifacts/data made one file, or ShareGPT
          answered anew by the target (one `python -m dflash2.commands.regenerate` shard per GPU), or a file given
features  the target's features of those chats, once for every drafter (`python -m dflash2.commands.features`;
          optional)
train     each drafter (`python train.py`), after a probe of its own configuration where steps=auto; a warm start
          after the export of the drafter it starts from
export    each trained drafter exported (`python export.py ckpt_path=...`) and checked (`python export.py check=...`)
evaluate  the grid: one `python evaluate.py -m` sweep per setting, proposer and group of benches, prompt lookup beside
speed     one cell of every proposer alone on the GPU, beside the target decoding alone (optional)
collect   the study's JSON (dflash2/studies/collect.py)
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from dflash2.studies.budget import budget_steps
from dflash2.studies.plan import ARTIFACT_DATA, ROOT, Drafter, Plan, Sweep, show
from dflash2.studies.runner import StudyFailed, Task, Work, read_json, run_tasks

log = logging.getLogger("dflash2.studies")


def records(path: Path) -> Iterator[str]:
    """A chat file's records as JSON lines (JSON lines, gzipped or not, or a JSON list)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        if path.suffix == ".json":
            yield from (json.dumps(r) for r in json.load(f))
        else:
            yield from (line.rstrip("\n") for line in f if line.strip())


def copy_chats(sources: list[Path], out: Path, limit: int | None = None) -> int:
    """The sources' records one after another into `out` (atomically), the first `limit` only when given."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, count = out.with_name(out.name + ".tmp"), 0
    with tmp.open("w") as f:
        for line in itertools.islice((line for source in sources for line in records(source)), limit):
            f.write(line + "\n")
            count += 1
    os.replace(tmp, out)
    return count


def check_given(plan: Plan, work: Work) -> None:
    """The exports given (study.exports), checked against the contract before anything else runs, and linked into
    WORK_DIR/exports under their study names (evaluate.py names a drafter by its folder)."""
    for d in plan.drafters.values():
        if d.given is None:
            continue
        if not work.done(f"check.{d.name}"):
            try:
                work.run(f"check.{d.name}", ["python", "export.py", f"check={d.given}"])
            except StudyFailed as e:
                raise StudyFailed(f"study.exports.{d.name}={d.given} does not pass export.py check: {e}") from None
            work.mark(f"check.{d.name}")
        link = plan.work / "exports" / d.name
        if not (link.is_symlink() and os.readlink(link) == d.given):
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.is_file():
                link.unlink()
            elif link.exists():
                shutil.rmtree(link)
            link.symlink_to(d.given, target_is_directory=True)


def data(plan: Plan, work: Work) -> None:
    if work.done("data"):
        log.info("data: done before (%s)", plan.data)
        return
    source, limit = str(plan.study["data"]["source"]), plan.conversations
    if source == "regenerate":
        shards = max(1, plan.gpus)
        regen = plan.work / "data" / "regenerate"
        tasks = []
        for i in range(shards):
            command = ["python", "-m", "dflash2.commands.regenerate", *plan.model_args, *plan.regenerate_args]
            command += [f"limit={limit or plan.study['data']['limit']}", f"num_shards={shards}", f"shard_index={i}"]
            command.append(f"output={regen / f'train.{i}.jsonl'}")
            tasks.append(
                Task(f"data.regenerate.{i}", partial(work.run, f"data.regenerate.{i}", command, gpus=plan.gpus))
            )
        run_tasks(work, tasks, shards, shards)
        count = copy_chats([regen / f"train.{i}.jsonl" for i in range(shards)], plan.data)
    elif source == "artifacts" or plan.rehearse:
        files = [ROOT / f for f in ARTIFACT_DATA] if source == "artifacts" else [Path(source).expanduser()]
        count = copy_chats(files, plan.data, limit)
        staged = "artifacts/data/smollm2_sharegpt_regenerated{,_part2,_part3,_part4}.jsonl.gz"
        if source != "artifacts":
            staged = str(files[0])
        cut = f" | head -n {limit}" if limit else ""
        work.update("commands", "data", f"gunzip -cf {staged}{cut} > {plan.data}")
    else:
        count = sum(1 for _ in records(plan.data))
    if plan.rehearse:  # the extra files cut too
        for source_file, out in zip(plan.sources, plan.extra or [], strict=True):
            copy_chats([Path(source_file)], Path(out), limit)
    log.info("data: %d conversations in %s", count, plan.data)
    if plan.study["train_jobs"] > 1 and plan.trained:  # the trainings started together then only read the cache
        overrides = [o for o in plan.trained[0].overrides if not o.startswith("data.features=")]
        work.run("data.tokenize", ["python", "-m", "dflash2.commands.tokenize", *overrides, "run_dir=unused"])
    work.mark("data")


def features(plan: Plan, work: Work) -> None:
    if plan.features is None:
        return
    if work.done("features"):
        log.info("features: done before")
        return
    work.run("features", plan.features, 0, plan.gpus)
    work.mark("features")


def train(plan: Plan, work: Work) -> None:
    tasks = []
    for d in plan.trained:
        needs = frozenset({f"train.{d.needs}"}) if d.needs and plan.drafters[d.needs].given is None else frozenset()
        tasks.append(Task(f"train.{d.name}", partial(train_one, plan, work, d), needs))
    run_tasks(work, tasks, plan.study["train_jobs"], plan.gpus)


def train_one(plan: Plan, work: Work, d: Drafter, slot: int) -> None:
    """Train one drafter: a finished one is kept, a killed one resumes from its last checkpoint (its own settings and
    budget), one killed before its first checkpoint starts over."""
    if d.needs and plan.drafters[d.needs].given is None:
        export_one(plan, work, d.needs)  # the warm start's init
    key = f"train.{d.name}"
    if work.done(key):
        log.info("%s: done before", key)
        return
    run_dir = plan.work / "runs" / d.name
    extra = [f"trainer.max_steps={probe(plan, work, d, slot)}"] if d.steps == "auto" else []
    command = d.command(*extra, f"run_dir={run_dir}", f"task_name={plan.study['collect']}_{d.name}")
    last = run_dir / "checkpoints" / "last.ckpt"
    if last.is_file():
        work.run(key, [*command, f"ckpt_path={last}"], slot, plan.gpus, record=f"{key}.resume")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        work.run(key, command, slot, plan.gpus)
    work.mark(key)


def probe(plan: Plan, work: Work, d: Drafter, slot: int) -> int:
    """trainer.max_steps for a drafter's budget, from a short run of its own configuration (dflash2/studies/budget.py),
    measured once and recorded in WORK_DIR/budgets.json."""
    key = f"probe.{d.name}"
    budgets = read_json(plan.work / "budgets.json", {})
    if work.done(key) and d.name in budgets:
        return int(budgets[d.name]["max_steps"])
    folder, p = plan.work / "probes" / d.name, plan.study["probe"]
    shutil.rmtree(folder, ignore_errors=True)
    command = d.command(f"trainer.max_steps={p['skip'] + p['steps']}", "trainer.max_time=null")
    command += [f"callbacks.step_rate.skip={p['skip']}", f"callbacks.step_rate.steps={p['steps']}"]
    command += [f"run_dir={folder}", f"task_name={plan.study['collect']}_{d.name}_probe"]
    work.run(key, command, slot, plan.gpus)
    measured = read_json(folder / "step_rate.json", {})
    if not measured.get("steps_per_s"):
        raise StudyFailed(f"{key} measured no step rate ({folder / 'step_rate.json'}): see {work.logfile(key)}")
    minutes = plan.study["minutes"]
    steps = budget_steps(measured, float(minutes), float(p["margin"]))
    budget = {"minutes": minutes, "margin": p["margin"], "max_steps": steps, "probe_command": show(command)}
    work.update("budgets", d.name, measured | budget)
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # the probe's weights are of no use
    log.info(
        "%s: %.3f steps/s after %.1f s of warm-up, validations of %.1f s every %s steps: trainer.max_steps=%d in %s "
        "min", key, measured["steps_per_s"], measured["warmup_s"] or 0, measured.get("validation_s") or 0,
        measured.get("val_every") or "(the last step only)", steps, plan.study["minutes"],
    )  # fmt: skip
    work.mark(key)
    return steps


def export_one(plan: Plan, work: Work, name: str, slot: int | None = None) -> None:
    key = f"export.{name}"
    with work.once(key):
        if work.done(key):
            return
        run, out = plan.work / "runs" / name, plan.work / "exports" / name
        work.run(
            key,
            ["python", "export.py", f"ckpt_path={run}", f"output_dir={out}", "max_shard_size=15MB", "overwrite=true"],
        )
        work.run(key, ["python", "export.py", f"check={out}"], record=f"check.{name}")
        work.mark(key)


def export(plan: Plan, work: Work) -> None:
    done = [d.name for d in plan.trained if work.done(f"export.{d.name}")]
    if done:
        log.info("export: %s done before", ", ".join(done))
    tasks = [Task(f"export.{d.name}", partial(export_one, plan, work, d.name)) for d in plan.trained]
    run_tasks(work, tasks, plan.study["jobs"], 0)


def evaluate(plan: Plan, work: Work) -> None:
    missing = [n for n in plan.evaluated if not (plan.work / "exports" / n / "config.json").is_file()]
    if missing:
        raise StudyFailed(f"evaluate: no export of {', '.join(missing)}: the export stage did not finish")
    left = [s for s in plan.sweeps if not work.done(s.key)]
    if len(left) < len(plan.sweeps):
        log.info("evaluate: %d of %d sweeps done before", len(plan.sweeps) - len(left), len(plan.sweeps))
    run_tasks(work, [Task(s.key, partial(sweep_one, plan, work, s)) for s in left], plan.study["jobs"], plan.gpus)


def sweep_one(plan: Plan, work: Work, sweep: Sweep, slot: int) -> None:
    work.run(sweep.key, sweep.command, slot, plan.gpus)
    work.mark(sweep.key)


def speed(plan: Plan, work: Work) -> None:
    if plan.speed is None:
        return
    if work.done("speed"):
        log.info("speed: done before")
        return
    work.run("speed", plan.speed, 0, plan.gpus)  # alone: the grid has finished
    work.mark("speed")


RUN = {"data": data, "features": features, "train": train, "export": export, "evaluate": evaluate, "speed": speed}
