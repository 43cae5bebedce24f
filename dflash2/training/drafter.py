"""The drafter's DFlash2Config, resolved once for a run (`resolve_drafter`): the `draft` group's settings, with a warm
start's depth and target layers over them (`module.init_from`), and the target's dimensions and mask token for those
left null, read from the target's config.json alone, before any weights. Training loads the target for that config
and checks that the loaded modules are the ones it was resolved for (`check_target`).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash2.groups import BAD_INPUT, build
from dflash2.model.config import ConfigFieldError, DFlash2Config


def resolve_drafter(cfg: DictConfig) -> DFlash2Config:
    """The drafter's whole DFlash2Config for a run's `draft`, `module` and `model` groups; a bad field is named as its
    setting. Every part of training takes this object (the target's captured layers, the data's blocks, the module)."""
    return draft_config(OmegaConf.merge(cfg.draft, warm_start_fields(cfg.module)), target_config_fields(cfg.model))


def draft_config(draft_cfg: DictConfig, target_fields: dict[str, Any]) -> DFlash2Config:
    """The `draft` group's DFlash2Config for a target (`target_fields`: its dimensions and mask token, from
    `target_config_fields` or `target_fields`); a draft setting left null takes the target's value."""
    inherited = {k: v for k, v in target_fields.items() if draft_cfg.get(k) is None}
    try:
        return build(draft_cfg, **inherited)
    except ConfigFieldError as e:
        # Named as typed: the draft group's own settings, else what the target's config says.
        names = [f"draft.{f}" if f in draft_cfg else f"the target's {f}" for f in e.fields]
        raise ValueError("/".join(names) + f": {e.why}") from None


def target_fields(target: Any) -> dict[str, Any]:
    """What a drafter inherits from a loaded target (`TargetModel`), mask token included."""
    return target.draft_config_fields() | {"mask_token_id": target.mask_token_id}


def target_config_fields(model_cfg: DictConfig) -> dict[str, Any]:
    """`target_fields` from the `model` group and the target's config.json alone, in a second, before any weights."""
    # Imported here: transformers' seconds, for this only.
    from dflash2.target.inherited import draft_config_fields, load_target_config

    return draft_config_fields(load_target_config(model_cfg)) | {"mask_token_id": model_cfg.get("mask_token_id")}


def warm_start_fields(module_cfg: DictConfig) -> dict[str, Any]:
    """What a warm start (`module.init_from`) fixes in the draft group: the drafter's depth and the target layers."""
    if not module_cfg.get("init_from"):
        return {}
    try:
        saved = DFlash2Config.from_pretrained(module_cfg.init_from)
    except BAD_INPUT as e:
        raise ValueError(f"module.init_from={module_cfg.init_from}: {e}") from None
    return {"num_hidden_layers": saved.num_hidden_layers, "target_layer_ids": list(saved.target_layer_ids)}


def warm_start_replaced(draft_cfg: DictConfig, draft: DFlash2Config) -> dict[str, tuple[Any, Any]]:
    """The draft group's settings a warm start replaced in the resolved drafter: {key: (setting, value used)}."""
    replaced = {}
    for key in ("num_hidden_layers", "target_layer_ids"):
        setting = draft_cfg.get(key)
        setting = OmegaConf.to_object(setting) if OmegaConf.is_config(setting) else setting
        used = getattr(draft, key)
        used = list(used) if isinstance(used, tuple | list) else used
        if setting is not None and setting != used:
            replaced[key] = (setting, used)
    return replaced


def check_target(draft: DFlash2Config, draft_cfg: DictConfig, target: Any) -> None:
    """The loaded target is the one the drafter was resolved for: each field the drafter took from its config.json
    (a draft setting left null) is what its loaded modules say. A target whose weights disagree with its config.json
    is refused: an engine builds it from that config.json."""
    for key, loaded in target_fields(target).items():
        resolved = getattr(draft, key)
        if draft_cfg.get(key) is None and resolved != loaded:
            raise ValueError(
                f"model.path={target.source}: the target's config.json gives {key}={resolved} and its loaded weights "
                f"{key}={loaded}: fix the folder's config.json to match its weights"
            )
