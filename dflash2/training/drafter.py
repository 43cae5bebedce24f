"""The `draft` group's DFlash2Config for a target: its null settings take the target's dimensions and mask token, and
a warm start (`module.init_from`) fixes the depth and the target layers. The checks build it from the target's
config.json alone, training from the loaded target.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from dflash2.groups import BAD_INPUT, build
from dflash2.model.config import ConfigFieldError, DFlash2Config


def draft_config(draft_cfg: DictConfig, target_fields: dict[str, Any]) -> DFlash2Config:
    """The `draft` group's DFlash2Config for a target (`target_fields`: its dimensions and mask token, from
    `draft_config_fields`); a draft setting left null takes the target's value. A bad field is named as its setting."""
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
    from dflash2.target.model import draft_config_fields, load_target_config  # here: transformers' seconds, this only

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
