"""A resume continues with the run's own settings: `python train.py ckpt_path=<run>/checkpoints/last.ckpt [k=v ...]`.

Hydra composes a resume line from the defaults, like any other. The run's recorded `.hydra/config.yaml` then replaces
that composition, with the resume line's overrides on top, and Hydra records the resume in `.hydra/resume-<time>/`,
so the record of how the run was started stays as it was. Both are Hydra's records, read here only.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash2.training.checkpoint import run_dir_of

log = logging.getLogger(__name__)

RECORD = ".hydra"


def hydra_subdir(ckpt_path: str | None, stamp: str) -> str:
    """`hydra.output_subdir`, the folder of a job's Hydra record: `.hydra` for a new run, one beside it per resume."""
    return RECORD if ckpt_path is None else f"{RECORD}/resume-{stamp}"


def restore_run_config(cfg: DictConfig) -> None:
    """Turn Hydra's composition of a resume line (`cfg`, with its `hydra` node) into the run's config, in place: the
    run's recorded config, in the checkpoint's folder, with the resume line's overrides applied by Hydra's rules."""
    run = run_dir_of(cfg.ckpt_path)
    record = run / RECORD
    if not (record / "config.yaml").is_file():
        log.warning("%s has no %s/config.yaml: the resume runs with this command's settings", run, RECORD)
        return
    saved = OmegaConf.load(record / "config.yaml")
    started = OmegaConf.load(record / "hydra.yaml").hydra.runtime.choices if (record / "hydra.yaml").is_file() else {}
    overrides = []
    for override in OverridesParser.create().parse_overrides(list(cfg.hydra.overrides.task)):
        group = override.key_or_group
        if group not in cfg.hydra.runtime.choices:
            overrides.append(override)
        elif _choice(override.value()) != _choice(started.get(group)):
            # A group picks a whole block of settings: swapping it under a run would not be that run any more.
            raise ValueError(
                f"{override.input_line}: the run was started with {group}={_choice(started.get(group))} and a "
                f"resume keeps its config groups; override single settings ({group}.<key>=...) or drop ckpt_path "
                "to start a new run"
            )
    saved.run_dir = str(run)  # where the checkpoint is now, even if the run folder moved since it started
    # Hydra's own override semantics (k=v, +k=v, ++k=v, ~k), on a config it did not compose this time.
    ConfigLoaderImpl._apply_overrides_to_config(overrides, saved)
    with open_dict(cfg):
        for key in [k for k in cfg if k != "hydra"]:
            del cfg[key]
        for key, value in OmegaConf.to_container(saved, resolve=False).items():
            cfg[key] = value


def _choice(value: Any) -> str:
    return "null" if value is None else str(value)


def experiment_choice(cfg: DictConfig) -> str | None:
    """The `experiment` a run was started with (None: none, or a run started without Hydra's command line): Hydra's
    choice for this command, or for a resume the one the run's record holds (a resume keeps its run's config groups).
    A model without an experiment of its own (train.yaml's `optional experiment: ${model}`) has none."""
    if not HydraConfig.initialized():
        return None
    choices = HydraConfig.get().runtime.choices
    if cfg.get("ckpt_path"):
        record = run_dir_of(cfg.ckpt_path) / RECORD / "hydra.yaml"
        if record.is_file():
            choices = OmegaConf.load(record).hydra.runtime.choices
    experiment = choices.get("experiment")
    options = GlobalHydra.instance().config_loader().get_group_options("experiment")
    return experiment if experiment in options else None
