"""What `python train.py` checks before anything loads: a setting left unset, the data file, the drafter's fields.

`PrepareRun` runs the checks before Hydra makes the run folder, so a bad setting costs a second and leaves nothing
behind. Every message names the setting as it is typed on the command line (`draft.conv_group_size`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash2.config import ConfigFieldError, DFlash2Config

log = logging.getLogger(__name__)

DRAFT_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# DFlash2Config field -> the setting it comes from (draft_config_from copies them); the others are the target's.
SETTINGS = {
    "num_hidden_layers": "model.num_draft_layers",
    "block_size": "model.block_size",
    "mask_token_id": "model.mask_token_id",
    "target_layer_ids": "model.target_layer_ids",
    "layer_types": "draft.layer_types",
    "sliding_window": "draft.sliding_window",
} | {f: f"draft.{f}" for f in DRAFT_FIELDS}
# Bad input: the user's to fix, and the message says how, so train.py prints it without a traceback.
BAD_INPUT = (FileNotFoundError, ValueError)


def draft_config_from(target_fields: dict[str, Any], model_cfg: DictConfig, draft_cfg: DictConfig) -> DFlash2Config:
    """The drafter shares the target's dimensions (`target_fields`); block, mask and layer ids come from the model
    group and the DFlash2 parts from the draft group. An invalid field is named as its setting."""
    fields = dict(target_fields)
    fields.update(
        num_hidden_layers=int(model_cfg.num_draft_layers),
        block_size=int(model_cfg.block_size),
        mask_token_id=model_cfg.get("mask_token_id"),
        target_layer_ids=list(model_cfg.target_layer_ids) if model_cfg.get("target_layer_ids") else None,
    )
    fields.update({f: int(draft_cfg.get(f) or 0) for f in DRAFT_FIELDS})
    if draft_cfg.get("layer_types"):
        fields.update(layer_types=list(draft_cfg.layer_types), sliding_window=draft_cfg.get("sliding_window"))
    if fields["mask_token_id"] is None:
        raise ValueError(
            "model.mask_token_id is not set: pick an id the target's chat never produces "
            "(dflash2.target.choose_mask_token suggests one)"
        )
    try:
        return DFlash2Config(**fields)
    except ConfigFieldError as e:
        raise ValueError("/".join(SETTINGS.get(f, f"the target's {f}") for f in e.fields) + f": {e.why}") from None


def warm_start_fields(draft_cfg: DictConfig) -> dict[str, Any]:
    """What a warm start (`draft.init_from`) fixes in the model group: the drafter's depth and the target layers."""
    if not draft_cfg.get("init_from"):
        return {}
    try:
        saved = DFlash2Config.from_pretrained(draft_cfg.init_from)
    except BAD_INPUT as e:
        raise ValueError(f"draft.init_from={draft_cfg.init_from}: {e}") from None
    return {"num_draft_layers": saved.num_hidden_layers, "target_layer_ids": list(saved.target_layer_ids)}


def check_training_knobs(draft: Mapping[str, Any], strategy: Any = None) -> None:
    """The draft group's settings that shape training only, never the export: `init_std`, `feature_scaling` and
    `distill` (dflash2.training.module.DFlash2Module takes them), with `init_from`; `strategy` is trainer.strategy."""
    init_std, distill = draft.get("init_std"), draft.get("distill") or 0.0
    if init_std is not None and not (isinstance(init_std, int | float) and init_std > 0):
        raise ValueError(
            f"draft.init_std={init_std}: the std of the drafter's initial Linear weights must be > 0 "
            "(SpecForge and ModelOpt use 0.02; null = PyTorch's default init)"
        )
    if not (isinstance(distill, int | float) and 0 <= distill <= 1):
        raise ValueError(
            f"draft.distill={distill}: the share of the target's own distribution in each slot's target must be in "
            "[0, 1] (0 = the gold token only, 1 = the target's softmax only)"
        )
    if draft.get("init_from"):
        for knob in ("init_std", "feature_scaling"):
            if draft.get(knob) not in (None, False):
                raise ValueError(
                    f"draft.{knob}={draft[knob]} initialises a drafter built from scratch, and "
                    f"draft.init_from={draft['init_from']} keeps the weights it loads: drop one of the two"
                )
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else str(strategy or "")
    if draft.get("feature_scaling") and "fsdp" in target.lower():
        raise ValueError(
            "draft.feature_scaling=true rescales fc in place at the first step, which FSDP's sharded parameters do "
            "not allow: train with trainer=gpu or trainer=ddp, or set draft.feature_scaling=false"
        )


def check_config(cfg: DictConfig) -> None:
    """Fail in one sentence on a setting left unset, a data file that is not there or a drafter field that does not
    fit the target, reading only the target's config.json: seconds before its weights would have loaded."""
    from dflash2.target import compile_mode, draft_config_fields, load_target_config

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError("set " + ", ".join(f"{key}=..." for key in missing) + ": it has no default")
    path = cfg.data.get("path")
    if path and not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"data.path={path!r} does not exist; pass a JSON/JSONL file of chats")
    for extra in cfg.data.get("extra_paths") or ():
        if not Path(extra).expanduser().is_file():
            raise FileNotFoundError(
                f"data.extra_paths: {extra!r} does not exist; list JSON/JSONL files of chats, e.g. "
                "data.extra_paths=[data/regenerated/math_codeio.jsonl]"
            )
    check_training_knobs(cfg.draft, cfg.trainer.get("strategy"))
    compile_mode(cfg.model.get("compile"))
    from dflash2.data.datamodule import check_drop_last, check_pad_to_multiple_of

    check_pad_to_multiple_of(cfg.data.get("pad_to_multiple_of", 1))
    check_drop_last(cfg.data.get("drop_last", False))
    model = OmegaConf.merge(cfg.model, warm_start_fields(cfg.draft))
    draft_config_from(draft_config_fields(load_target_config(cfg.model)), model, cfg.draft)


def check_data(cfg: DictConfig) -> None:
    """Read the data files (`data.path`, `data.extra_paths`) through, so that a malformed record fails before the run
    has a folder. The packaged ShareGPT is not re-read: it is the package's, and the run reads it right after."""
    from dflash2.data.chat import load_conversations

    quiet = logging.root.manager.disable
    logging.disable(logging.INFO)  # the run reads the files again and logs their counts, into train.log this time
    try:
        if cfg.data.get("path"):
            load_conversations(cfg.data.path, cfg.data.get("limit"))
        for extra in cfg.data.get("extra_paths") or ():
            load_conversations(extra)
    finally:
        logging.disable(quiet)


class PrepareRun(Callback):
    """Hydra callback (configs/train.yaml), before Hydra makes the run folder, its record and train.log: a resume takes
    the run's own settings, then the inputs are checked."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from dflash2.training.resume import restore_run_config

        try:
            if config.get("ckpt_path"):
                restore_run_config(config)
            task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_config(task)
            check_data(task)
        except (*BAD_INPUT, HydraException) as e:
            raise SystemExit(str(e)) from None
