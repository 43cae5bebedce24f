"""A study's commands, composed from its settings and checked as their commands check them (train.py's checks on each
drafter's whole command, evaluate.py's on each setting, every bench's prompts loaded), so that a bad setting is refused
in seconds, naming it as typed, before anything runs: `make_plan` turns configs/study.yaml into the checked
dflash2.studies.plan.Plan that dflash2.studies runs.
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from dflash2.commands import compose
from dflash2.commands.train_checks import check_config
from dflash2.commands.train_groups import plain
from dflash2.studies.budget import max_time
from dflash2.studies.plan import (
    DEPENDENCY,
    PLD,
    TRAIN_BASE,
    Drafter,
    Plan,
    Sweep,
    bad,
    check_simple,
    chosen,
    dependency,
    format_list,
    set_in,
    strings,
)

NO_REHEARSAL = {"train_args": [], "eval_args": []}


def settings_of(cfg: DictConfig) -> dict[str, Any]:
    """The study's settings as plain values, with study.rehearsal's on top under rehearse=true (a list given there
    replaces the study's)."""
    study = OmegaConf.masked_copy(cfg, ["study"]).study
    if cfg.get("rehearse"):
        study = OmegaConf.merge(study, study.get("rehearsal") or {})
    return plain(study)


def checked_train(overrides: list[str], what: str) -> dict[str, Any]:
    """train.py's config for `overrides` as plain values, through train.py's own checks (they read the target's
    config.json only)."""
    try:
        cfg = compose("train", overrides)
        check_config(cfg)
    except (HydraException, ValueError, FileNotFoundError) as e:
        raise ValueError(f"{what}: {str(e).splitlines()[0]}") from None
    return plain(cfg)


@contextlib.contextmanager
def stand_in(path: Path) -> Iterator[Path]:
    """`path`, or while the data stage has not written it yet an empty file in its place, for the checks."""
    if path.is_file():
        yield path
        return
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        yield Path(f.name)


def gpu_count(study: dict[str, Any], rehearse: bool) -> int:
    """The GPUs the study spreads its commands over (0: the CPU, as a rehearsal runs)."""
    if rehearse:
        return 0
    if study["gpus"] is not None:
        return int(study["gpus"])
    import torch

    return torch.cuda.device_count()


def setting_label(setting: str) -> str:
    """A sweep folder's name for an evaluate.py setting: `temperature=0,1 block_size=16` -> `t0-1_b16` (a comma in
    hydra.sweep.dir would make it a sweep)."""
    short = setting.replace("temperature=", "t").replace("block_size=", "b").replace(",", "-")
    return "_".join(re.sub(r"[^A-Za-z0-9.-]+", "", token) for token in short.split()) or "default"


def make_plan(cfg: DictConfig) -> Plan:
    """Every command of the study, checked; a ValueError names the first bad setting."""
    from dflash2.training.drafter import target_config_fields

    study = settings_of(cfg)
    check_simple(study, None if OmegaConf.is_missing(cfg, "dir") else cfg.dir, cfg.get("until"))
    work = Path(str(cfg.dir)).expanduser().absolute()
    rehearse = bool(cfg.get("rehearse"))
    rehearsal = plain(cfg.rehearsal) if rehearse else NO_REHEARSAL
    model_args = strings(study["model_args"], "study.model_args")
    if rehearse:
        from dflash2.testing import tiny_target_path

        model_args += ["model=tiny", f"model.path={tiny_target_path()}"]
    data, extra = data_files(study, work, rehearse)
    experiment = [f"experiment={study['experiment']}"] if study["experiment"] else ["~experiment"]
    train_args = strings(study["train_args"], "study.train_args")
    tail = [*strings(rehearsal["train_args"], "rehearsal.train_args"), *train_args]

    def head(path: Path) -> list[str]:
        return [*experiment, *TRAIN_BASE, *model_args, f"data.path={path}", f"data.cache_dir={work / 'data_cache'}"]

    with stand_in(data) as check_data:
        what = "the study's train.py overrides (study.experiment, study.model_args, study.train_args)"
        base = checked_train([*head(check_data), *tail, *([] if extra is None else ["data.extra_paths=[]"])], what)
        sources = extra if extra is not None else [str(p) for p in base["data"]["extra_paths"]]
        if rehearse:  # the data stage cuts each file to its first conversations
            extra = [str(work / "data" / f"extra.{i}.jsonl") for i in range(len(sources))]
        common = [*head(data), *([] if extra is None else [f"data.extra_paths={format_list(extra)}"]), *tail]
        check_common = [*head(check_data), *([] if extra is None else [f"data.extra_paths={format_list(sources)}"])]
        depth = int(target_config_fields(base["model"])["num_target_layers"])
        evaluated, order = chosen(study)
        drafters = plan_drafters(study, work, order, common, [*check_common, *tail], train_args, depth)
    schedule(drafters, study, int(base["data"]["batch_size"]))
    features = feature_command(study, work, drafters, common)
    eval_args = [*model_args, *strings(study["eval_args"], "study.eval_args")]
    eval_args += [*strings(rehearsal["eval_args"], "rehearsal.eval_args"), "wandb.enabled=false"]
    check_evaluate(study, eval_args)
    gpus = gpu_count(study, rehearse)
    if study["steps"] == "auto" and study["train_jobs"] > max(1, gpus):
        raise bad(
            "study.train_jobs", study["train_jobs"], "steps=auto sizes each training by its pace alone on its GPU: run "
            f"at most one per GPU ({gpus} here), or give study.steps",
        )  # fmt: skip
    return Plan(
        work, study, cfg.get("until"), rehearse, model_args, data, sources, extra, common, drafters, evaluated,
        plan_sweeps(study, work, evaluated, eval_args), speed_command(study, work, evaluated, eval_args), features,
        eval_args, gpus,
        strings(rehearsal["regenerate_args"] if rehearse else study["data"]["regenerate_args"],
                "study.data.regenerate_args"),
        int(rehearsal["conversations"]) if rehearse else None,
    )  # fmt: skip


def data_files(study: dict[str, Any], work: Path, rehearse: bool) -> tuple[Path, list[str] | None]:
    """(the main chat file the drafters train on, the extra ones given as study.extra_data: None = the experiment's)."""
    source = str(study["data"]["source"])
    data = work / "data" / "train.jsonl"
    if source not in ("artifacts", "regenerate") and not rehearse:
        data = Path(source).expanduser().absolute()
    if study["extra_data"] is None:
        return data, None
    extra = [str(Path(p).expanduser().absolute()) for p in strings(study["extra_data"], "study.extra_data")]
    for path in extra:
        if not Path(path).is_file():
            raise bad("study.extra_data", study["extra_data"], f"{path} does not exist")
    return data, extra


def feature_command(
    study: dict[str, Any], work: Path, drafters: dict[str, Drafter], common: list[str]
) -> list[str] | None:
    """The features stage's command (None: no cache), and each trained drafter's command reading its cache."""
    trained = [d for d in drafters.values() if d.given is None]
    if not study["features"] or not trained:
        return None
    if len({tuple(d.layers or ()) for d in trained}) > 1:
        sets = {d.name: d.layers for d in trained}
        raise bad("study.features", study["features"], f"one cache serves one set of target layers; these read {sets}")
    features = ["python", "-m", "dflash2.commands.features", *common, f"output={work / 'features'}"]
    features += [f"dtype={study['features']}", f"draft.target_layer_ids={format_list(trained[0].layers)}"]
    for d in trained:
        d.overrides.append(f"data.features={work / 'features'}")
    return features


def plan_drafters(
    study: dict[str, Any],
    work: Path,
    order: list[str],
    common: list[str],
    check_common: list[str],
    train_args: list[str],
    depth: int,
) -> dict[str, Drafter]:
    """Each drafter's train.py command (its schedule comes after); `@name` becomes that drafter's export folder."""
    from dflash2.model.config import default_target_layer_ids
    from dflash2.training.drafter import warm_start_fields

    drafters: dict[str, Drafter] = {}
    for name in order:
        if name == PLD:
            raise bad("study.drafters", list(order), f"{PLD} is prompt lookup (study.pld): name the drafter otherwise")
        given = (study["exports"] or {}).get(name)
        if given is not None:
            drafters[name] = Drafter(name, given=str(Path(given).expanduser().absolute()))
            continue
        variant = list(study["variants"][name])
        needs = dependency(variant)
        resolved = [fill(o, lambda n: drafters[n].given or str(work / "exports" / n)) for o in variant]
        ready = needs is None or drafters[needs].given is not None or (work / "done" / f"export.{needs}").is_file()
        checked = resolved if ready else [o for o in resolved if not set_in([o], "module.init_from")]
        what = f"study.variants.{name}={format_list(variant)}"
        composed = checked_train([*check_common, *checked], what)
        draft, spread = composed["draft"], []
        if set_in(variant, "module.init_from"):  # the export it starts from fixes its depth and layers
            init_from = composed["module"].get("init_from")
            layers = warm_start_fields(init_from).get("target_layer_ids") if ready else drafters[needs].layers
        elif not set_in([*train_args, *variant], "draft.target_layer_ids") and (
            set_in(variant, "draft.num_hidden_layers") or draft["target_layer_ids"] is None
        ):
            layers = default_target_layer_ids(depth, int(draft["num_hidden_layers"]))
            spread = [f"draft.target_layer_ids={format_list(layers)}"]
        else:
            layers = list(draft["target_layer_ids"])
        drafters[name] = Drafter(
            name, [*common, *resolved, *spread], [*variant, *spread], int(draft["num_hidden_layers"]),
            needs=needs, layers=[int(i) for i in layers or []] or None,
            batch_size=int(composed["data"]["batch_size"]), steps=study["steps"],
        )  # fmt: skip
    return drafters


def fill(override: str, export: Callable[[str], str]) -> str:
    """`key=@name` -> `key=<the export folder of drafter name>`."""
    match = DEPENDENCY.fullmatch(override)
    return override if match is None else override[: -len(match[1]) - 1] + export(match[1])


def schedule(drafters: dict[str, Drafter], study: dict[str, Any], base_batch: int) -> None:
    """Each training's steps, validations and budget. Steps and validations count the experiment's batch: a drafter
    with another data.batch_size takes the steps that see as many conversations."""

    def scaled(value: int, key: str, d: Drafter) -> int:
        if (value * base_batch) % d.batch_size:
            unit = d.batch_size // math.gcd(d.batch_size, base_batch)
            raise bad(
                key, value, f"{d.name} trains data.batch_size={d.batch_size}: give a multiple of {unit}, so that it "
                f"sees as many conversations as {value} steps of {base_batch}",
            )  # fmt: skip
        return value * base_batch // d.batch_size

    for d in drafters.values():
        if d.given is not None:
            continue
        if isinstance(study["steps"], int):
            d.steps = scaled(study["steps"], "study.steps", d)
            d.overrides += [f"trainer.max_steps={d.steps}", "trainer.max_epochs=-1"]
        elif study["steps"] == "auto":
            d.overrides.append("trainer.max_epochs=-1")  # trainer.max_steps comes from the probe
        if study["val"] is not None:
            every = scaled(study["val"], "study.val", d)
            d.overrides += [f"trainer.val_check_interval={every}", "trainer.check_val_every_n_epoch=null"]
        if study["minutes"] is not None:
            d.overrides.append(f"trainer.max_time={max_time(study['minutes'])}")


def plan_sweeps(study: dict[str, Any], work: Path, evaluated: list[str], eval_args: list[str]) -> list[Sweep]:
    """The grid: per setting, each proposer (prompt lookup last) over each group of benches, one sweep each."""
    sweeps = []
    for setting in study["settings"]:
        label = setting_label(str(setting))
        for name in [*evaluated, *([PLD] if study["pld"] else [])]:
            drafter = PLD if name == PLD else str(work / "exports" / name)
            for group in study["benches"]:
                folder = work / "evaluate" / name / f"{label}_{group[0]}"
                command = ["python", "evaluate.py", "-m", f"hydra.sweep.dir={folder}", f"drafter={drafter}"]
                command += [*eval_args, *str(setting).split(), f"bench={','.join(map(str, group))}"]
                if study["hybrid"] and name != PLD:  # also with prompt lookup beside it: `<name>+lookup`
                    command.append("hybrid=null,ngram")
                sweeps.append(Sweep(f"evaluate.{name}.{folder.name}", name, folder, command))
    return sweeps


def speed_command(study: dict[str, Any], work: Path, evaluated: list[str], eval_args: list[str]) -> list[str] | None:
    """The speed stage's command: one cell of every proposer alone, beside the target decoding alone (None: none)."""
    speed = study["speed"]
    if speed is None:
        return None
    drafts = ",".join([*(str(work / "exports" / n) for n in evaluated), *([PLD] if study["pld"] else [])])
    command = ["python", "evaluate.py", "-m", f"hydra.sweep.dir={work / 'speed'}", f"drafter={drafts}", *eval_args]
    command += [*str(speed["setting"]).split(), f"bench={speed['bench']}", "baseline=true"]
    return [*command, f"repeats={speed['repeats']}"]


def check_evaluate(study: dict[str, Any], eval_args: list[str]) -> None:
    """Every bench loads its prompts, and evaluate.py takes every setting (each sweep's first cell) with the study's
    arguments, prompt lookup's checks included."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from dflash2.data.benches import load_prompts
    from dflash2.evaluation.settings import evaluation_settings

    speed = study["speed"]
    benches = sorted({str(b) for group in study["benches"] for b in group} | ({speed["bench"]} if speed else set()))
    for bench in benches:
        try:
            load_prompts(bench, limit=1)
        except (ValueError, FileNotFoundError, KeyError, OSError) as e:
            raise bad("study.benches", study["benches"], f"{bench}: {e}") from None
    parser = OverridesParser.create()
    settings = [("study.settings", s) for s in study["settings"]]
    if speed is not None:
        settings.append(("study.speed.setting", speed["setting"]))
    try:
        compose("evaluate", ["drafter=pld", *eval_args])
    except HydraException as e:
        raise ValueError(f"study.eval_args (with study.model_args): {str(e).splitlines()[0]}") from None
    for key, setting in settings:
        try:
            cells = []
            for o in parser.parse_overrides(str(setting).split()):
                sweep = o.is_sweep_override()
                cells.append(
                    f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if sweep else o.input_line
                )
            evaluation_settings(plain(compose("evaluate", ["drafter=pld", *eval_args, *cells, f"bench={benches[0]}"])))
        except (HydraException, ValueError, FileNotFoundError) as e:
            raise bad(key, setting, str(e).splitlines()[0]) from None
