"""What configs/train.yaml's groups build, each the one object its `_target_` names: the drafter's DFlash2Config
(`draft`, with a warm start's fields and the target's), the target (`model`), the DataModule (`data`), the
LightningModule with its objective and optimizer (`module`, `objective`, `optim`), the logger, the callbacks and the
Trainer; and the run's settings as plain values (`run_settings`) for dflash2.training.run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash2.commands import build
from dflash2.commands.resume import experiment_choice
from dflash2.model.config import ConfigFieldError, DFlash2Config
from dflash2.training.drafter import check_target, target_config_fields, warm_start_fields
from dflash2.training.run import Run, drop_anonymous, is_wandb, trainer_arguments, wandb_arguments


def plain(node: Any) -> Any:
    """A config node as plain Python (dicts, lists, values), every interpolation resolved: what the library takes."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def draft_config(draft_cfg: DictConfig, target_fields: dict[str, Any]) -> DFlash2Config:
    """The `draft` group's DFlash2Config for a target (`target_fields`: its dimensions and mask token, from
    dflash2.training.drafter's `target_config_fields` or `target_fields`); a draft setting left null takes the
    target's value."""
    inherited = {k: v for k, v in target_fields.items() if draft_cfg.get(k) is None}
    try:
        return build(draft_cfg, **inherited)
    except ConfigFieldError as e:
        # Named as typed: the draft group's own settings, else what the target's config says.
        names = [f"draft.{f}" if f in draft_cfg else f"the target's {f}" for f in e.fields]
        raise ValueError("/".join(names) + f": {e.why}") from None


def resolve_drafter(cfg: DictConfig) -> DFlash2Config:
    """The drafter's whole DFlash2Config for a run's `draft`, `module` and `model` groups, resolved once: every part of
    training takes this object (the target's captured layers, the data's blocks, the module). A bad field is named as
    its setting."""
    draft = OmegaConf.merge(cfg.draft, warm_start_fields(cfg.module.get("init_from")))
    return draft_config(draft, target_config_fields(plain(cfg.model)))


def load_target(cfg: DictConfig, draft: DFlash2Config) -> Any:
    """The target of the `model` group, capturing the layers `draft` reads, checked to be the target `draft` was
    resolved for (dflash2.training.drafter.check_target)."""
    # With data.features the cache replaces the target's layers: only its embedding, norm and head are loaded.
    layers = not cfg.data.get("features")
    target = build(cfg.model, target_layer_ids=list(draft.target_layer_ids), layers=layers)
    check_target(draft, plain(cfg.draft), target)
    return target


def target_and_draft(cfg: DictConfig) -> tuple[Any, DFlash2Config]:
    """The run's drafter config (`resolve_drafter`) and its target, loaded for it: what the data and feature commands
    and the benchmarks build as training does."""
    draft = resolve_drafter(cfg)
    return load_target(cfg, draft), draft


def build_data(cfg: DictConfig, target: Any, draft: DFlash2Config) -> Any:
    """The `data` group's DataModule for the drafter's blocks."""
    # Plain containers: the datamodule's hyper-parameters go into every checkpoint, which must load weights_only.
    return build(
        cfg.data, tokenizer=target.tokenizer, block_size=draft.block_size, mask_token_id=draft.mask_token_id,
        _recursive_=False, _convert_="all",
    )  # fmt: skip


def build_module(target: Any, cfg: DictConfig, draft: DFlash2Config, manifest: dict[str, Any] | None = None) -> Any:
    """The `module` group's LightningModule, with the `objective` and `optim` groups' objects."""
    objective, optim = build(cfg.objective), build(cfg.optim)
    # Partial, then called: Hydra would turn the dataclass arguments into configs if it passed them itself.
    module = build(cfg.module, _partial_=True)
    return module(target=target, draft_config=draft, objective=objective, optim=optim, manifest=manifest)


def build_logger(cfg: DictConfig, run_dir: Path) -> Any:
    """The `logger` group's logger (False: none); W&B's with the arguments the run decides (training.run)."""
    if not cfg.get("logger") or not cfg.logger.get("_target_"):
        return False
    settings = plain(cfg.logger)
    if not is_wandb(settings):
        return build(cfg.logger)
    logger = build(cfg.logger, **wandb_arguments(settings, run_dir))
    drop_anonymous(logger)
    return logger


def build_trainer(cfg: DictConfig, run: Run, logger: Any, extra: list[Any] | None = None) -> Any:
    """The `trainer` group's Trainer with the `callbacks` group's callbacks (and `extra` ones: tests look inside a run
    with them)."""
    configured = [build(c) for c in (cfg.get("callbacks") or {}).values() if c and c.get("_target_")]
    return build(cfg.trainer, **trainer_arguments(run, logger, configured + list(extra or [])))


def run_settings(cfg: DictConfig, command: str) -> Run:
    """The run's settings as plain values: its config resolved, its folder (under Hydra, the job's: DDP workers are
    re-launched with the launching process's folder), the experiment it was started with and the `command` that
    resumes it."""
    if HydraConfig.initialized():
        with open_dict(cfg):
            cfg.run_dir = HydraConfig.get().runtime.output_dir
    return Run(plain(cfg), Path(cfg.run_dir).absolute(), experiment_choice(cfg), command)
