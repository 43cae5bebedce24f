"""What a run's drafter takes from elsewhere than the `draft` group: a warm start's depth and target layers
(`module.init_from`, `warm_start_fields`), and the target's dimensions and mask token for the settings left null,
read from the target's config.json alone, before any weights (`target_config_fields`). The drafter's DFlash2Config is
built from them once (dflash2.commands.train_groups.resolve_drafter); training loads the target for that config and
checks that the loaded modules are the ones it was resolved for (`check_target`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash2.errors import BAD_INPUT
from dflash2.model.config import DFlash2Config


def target_fields(target: Any) -> dict[str, Any]:
    """What a drafter inherits from a loaded target (`TargetModel`), mask token included."""
    return target.draft_config_fields() | {"mask_token_id": target.mask_token_id}


def target_config_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """`target_fields` from the `model` group's settings and the target's config.json alone, in a second, before any
    weights."""
    # Imported here: transformers' seconds, for this only.
    from dflash2.target.inherited import draft_config_fields, load_target_config

    return draft_config_fields(load_target_config(model)) | {"mask_token_id": model.get("mask_token_id")}


def warm_start_fields(init_from: str | None) -> dict[str, Any]:
    """What a warm start (`module.init_from`, an export folder) fixes in the draft group: the drafter's depth and the
    target layers."""
    if not init_from:
        return {}
    try:
        saved = DFlash2Config.from_pretrained(init_from)
    except BAD_INPUT as e:
        raise ValueError(f"module.init_from={init_from}: {e}") from None
    return {"num_hidden_layers": saved.num_hidden_layers, "target_layer_ids": list(saved.target_layer_ids)}


def warm_start_replaced(draft_settings: Mapping[str, Any], draft: DFlash2Config) -> dict[str, tuple[Any, Any]]:
    """The draft group's settings a warm start replaced in the resolved drafter: {key: (setting, value used)}."""
    replaced = {}
    for key in ("num_hidden_layers", "target_layer_ids"):
        setting = draft_settings.get(key)
        setting = list(setting) if isinstance(setting, tuple | list) else setting
        used = getattr(draft, key)
        used = list(used) if isinstance(used, tuple | list) else used
        if setting is not None and setting != used:
            replaced[key] = (setting, used)
    return replaced


def check_target(draft: DFlash2Config, draft_settings: Mapping[str, Any], target: Any) -> None:
    """The loaded target is the one the drafter was resolved for: each field the drafter took from its config.json
    (a draft setting left null) is what its loaded modules say. A target whose weights disagree with its config.json
    is refused: an engine builds it from that config.json."""
    for key, loaded in target_fields(target).items():
        resolved = getattr(draft, key)
        if draft_settings.get(key) is None and resolved != loaded:
            raise ValueError(
                f"model.path={target.source}: the target's config.json gives {key}={resolved} and its loaded weights "
                f"{key}={loaded}: fix the folder's config.json to match its weights"
            )
