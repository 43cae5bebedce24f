"""A study's plan (`Plan`: the commands it runs) and the checks of its settings that need nothing loaded, on the
settings as plain values (dflash2/commands/study_plan.py composes and checks the rest): each message names the setting
as it is typed (`study.drafters=[dflashh]`).

Nothing here runs a command or writes a file; dflash2/studies/runner.py runs the plan.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository: where train.py, export.py and evaluate.py are
STAGES = ("data", "features", "train", "export", "evaluate", "speed", "collect")
COLLECTS = ("acceptance", "ablation", "depth")
PLD = "pld"
# The regenerated ShareGPT set kept in the repository, four files because its regeneration was resumed three times.
ARTIFACT_DATA = [f"artifacts/data/smollm2_sharegpt_regenerated{p}.jsonl.gz" for p in ("", "_part2", "_part3", "_part4")]
FEATURE_DTYPES = ("bf16", "fp8")
# train.py overrides of every training here: the run's log lines, not a bar, in its log file; metrics.csv to read.
TRAIN_BASE = ["logger=csv", "trainer.enable_progress_bar=false"]
# `key=@name` in a variant: the export folder of drafter `name` (a warm start's module.init_from).
DEPENDENCY = re.compile(r"[^=]+=@(.+)")


def bad(key: str, value: Any, why: str) -> ValueError:
    """A refusal naming the setting as typed: `study.steps=abc: ...`."""
    if isinstance(value, list | tuple):
        value = "[" + ",".join(map(str, value)) + "]"
    return ValueError(f"{key}={value}: {why}")


@dataclasses.dataclass
class Drafter:
    """One proposer of the study: trained here (`overrides`, then `export`ed) or an export made elsewhere (`given`)."""

    name: str
    overrides: list[str] = dataclasses.field(default_factory=list)  # train.py's, all of them, schedule included
    variant: list[str] = dataclasses.field(default_factory=list)  # its own (study.variants', the layers' spread)
    num_layers: int | None = None
    given: str | None = None
    needs: str | None = None  # the drafter whose export its `@name` names (a warm start)
    layers: list[int] | None = None  # the target layers it reads
    batch_size: int | None = None
    steps: int | str | None = None  # int, "auto" (sized by the probe) or None (the experiment's schedule)

    def command(self, *extra: str) -> list[str]:
        return ["python", "train.py", *self.overrides, *extra]


@dataclasses.dataclass
class Sweep:
    """One `evaluate.py -m` process: a proposer at one setting over one group of benches."""

    key: str  # evaluate.<drafter>.<label>
    drafter: str
    folder: Path
    command: list[str]


@dataclasses.dataclass
class Plan:
    """Everything a study runs, checked (dflash2/commands/study_plan.py makes it)."""

    work: Path
    study: dict[str, Any]  # the study's settings, study.rehearsal's applied
    until: str | None
    rehearse: bool
    model_args: list[str]  # the target, for every command
    data: Path  # the main chat file the drafters train on
    sources: list[str]  # the extra chat files (rehearse=true: what the data stage cuts into `extra`)
    extra: list[str] | None  # train.py's data.extra_paths; None = the experiment's
    common: list[str]  # every training's overrides before its variant's
    drafters: dict[str, Drafter]  # every drafter the study needs, dependencies first
    evaluated: list[str]  # the drafters evaluated, in the study's order
    sweeps: list[Sweep]
    speed: list[str] | None  # the speed stage's command
    features: list[str] | None  # the features stage's command
    eval_args: list[str]
    gpus: int  # 0: the CPU
    regenerate_args: list[str]
    conversations: int | None  # rehearse=true: each data file cut to this many conversations

    @property
    def trained(self) -> list[Drafter]:
        return [d for d in self.drafters.values() if d.given is None]


def show(command: Iterable[str]) -> str:
    """A command as a shell line that runs it."""
    return shlex.join(list(command))


def strings(value: Any, key: str) -> list[str]:
    """A list of overrides (null: none), refused naming `key` otherwise."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad(key, value, "give a list of overrides, e.g. '[\"objective.position_weights=decay\"]'")
    return list(value)


def _positive(value: Any, key: str, allow_none: bool = True, real: bool = False) -> Any:
    if value is None and allow_none:
        return None
    kinds = (int, float) if real else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        raise bad(key, value, f"must be a positive {'number' if real else 'integer'}" + (" or null" * allow_none))
    return value


def set_in(overrides: list[str], key: str) -> bool:
    """Whether an override list sets `key` (as `key=...`, `+key=...` or `++key=...`)."""
    return any(o.lstrip("+").split("=", 1)[0] == key for o in overrides)


def check_simple(study: dict[str, Any], work_dir: str | None, until: str | None) -> None:
    """The settings that need nothing loaded: the study's (`study`, study.rehearsal's applied), its work folder
    (`dir`, None when unset) and `until`."""
    if work_dir is None or not str(work_dir).strip():
        raise ValueError("set dir=WORK_DIR: the study's work folder (rerun the same command there to resume)")
    if until is not None and until not in STAGES:
        raise bad("until", until, f"choose a stage: {', '.join(STAGES)}")
    if study["collect"] not in COLLECTS:
        raise bad("study.collect", study["collect"], f"choose one of {', '.join(COLLECTS)}")
    check_schedule(study)
    check_resources(study)
    check_drafters(study)
    check_grid(study)


def check_schedule(study: dict[str, Any]) -> None:
    """study.minutes, study.steps, study.val and the probe that sizes steps=auto."""
    _positive(study["minutes"], "study.minutes", real=True)
    if study["steps"] not in (None, "auto"):
        _positive(study["steps"], "study.steps")
    if study["steps"] == "auto" and study["minutes"] is None:
        raise bad("study.steps", "auto", "sizes the cosine to a budget: set study.minutes too")
    _positive(study["val"], "study.val")
    probe = study["probe"]
    for key in ("skip", "steps"):
        _positive(probe[key], f"study.probe.{key}", allow_none=False)
    if not (isinstance(probe["margin"], int | float) and 0 < probe["margin"] <= 1):
        raise bad("study.probe.margin", probe["margin"], "the share of the budget the schedule fills, in (0, 1]")


def check_resources(study: dict[str, Any]) -> None:
    """The jobs and GPUs, the feature cache, the data source and the earlier folders (study.from)."""
    for key in ("jobs", "train_jobs"):
        _positive(study[key], f"study.{key}", allow_none=False)
    gpus = study["gpus"]
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0):
        raise bad("study.gpus", gpus, "a number of GPUs (0: the CPU), or null for every visible one")
    if study["features"] not in (None, *FEATURE_DTYPES):
        raise bad("study.features", study["features"], f"choose {' or '.join(FEATURE_DTYPES)}, or null for none")
    source = study["data"]["source"]
    if source not in ("artifacts", "regenerate") and not Path(str(source)).expanduser().is_file():
        raise bad("study.data.source", source, "choose artifacts, regenerate or an existing chat file")
    _positive(study["data"]["limit"], "study.data.limit")
    for path in study.get("from") or []:
        if not Path(path).expanduser().exists():
            raise bad("study.from", list(study["from"]), f"{path} does not exist")


def check_drafters(study: dict[str, Any]) -> None:
    """study.variants (each a list of train.py overrides) and study.exports (export folders)."""
    if not isinstance(study["variants"], Mapping):
        raise bad("study.variants", study["variants"], "map each name to its train.py overrides")
    for name, overrides in study["variants"].items():
        strings(overrides, f"study.variants.{name}")
    for name, path in (study["exports"] or {}).items():
        if path is not None and not Path(path).expanduser().is_dir():
            raise bad(f"study.exports.{name}", path, "is not a folder: give an export (config.json + weights)")


def check_grid(study: dict[str, Any]) -> None:
    """study.benches (groups of benches), study.settings (evaluate.py settings) and study.speed."""
    benches = study["benches"]
    if not (isinstance(benches, list) and benches and all(isinstance(g, list) and g for g in benches)):
        raise bad("study.benches", benches, "give groups of benches, one sweep each, e.g. [[gsm8k,humaneval],[mbpp]]")
    if not (isinstance(study["settings"], list) and study["settings"]):
        raise bad(
            "study.settings", study["settings"], 'give evaluate.py settings, e.g. ["temperature=0,1 block_size=16"]'
        )
    speed = study["speed"]
    if speed is not None:
        missing = {"bench", "setting", "repeats"} - set(speed)
        if missing:
            raise bad("study.speed", speed, f"set {', '.join(sorted(missing))} too, or null for no speed stage")
        _positive(speed["repeats"], "study.speed.repeats", allow_none=False)


def chosen(study: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(the drafters evaluated, every drafter needed with its dependencies first)."""
    variants = study["variants"]
    given = {n for n, p in (study["exports"] or {}).items() if p is not None}
    known = [*variants, *(n for n in given if n not in variants)]
    names = list(study["drafters"]) if study["drafters"] is not None else [n for n in variants if n not in given]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise bad(
            "study.drafters", names, f"{'unknown ' + ','.join(map(str, unknown)) if unknown else 'none chosen'}; "
            f"choose from {','.join(known)} (study.variants, study.exports)",
        )  # fmt: skip
    order: list[str] = []

    def need(name: str, path: list[str]) -> None:
        if name in order:
            return
        if name in path:
            raise bad(f"study.variants.{name}", variants[name], f"starts from itself: {' -> '.join(path)}")
        if name not in given:
            for o in variants[name]:
                match = DEPENDENCY.fullmatch(o)
                if match:
                    if match[1] not in known:
                        raise bad(
                            f"study.variants.{name}", variants[name],
                            f"@{match[1]} names no drafter: add it to study.variants or set "
                            f"study.exports.{match[1]}=<an export folder>",
                        )  # fmt: skip
                    need(match[1], [*path, name])
        order.append(name)

    for name in names:
        need(name, [])
    return names, order


def dependency(overrides: list[str]) -> str | None:
    """The drafter whose export a variant starts from (its `@name`), if any."""
    found = [m[1] for o in overrides if (m := DEPENDENCY.fullmatch(o))]
    return found[0] if found else None


def format_list(values: Iterable[Any]) -> str:
    return "[" + ",".join(map(str, values)) + "]"
