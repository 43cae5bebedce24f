"""`python -m dflash2.data.features`: the feature cache of a training run's settings (configs/features.yaml composes
train.yaml). The target, the layers it captures and the rows are built as `train()` builds them
(dflash2.training.run), so the cache holds what that run reads; dflash2.data.features writes them.
"""

from __future__ import annotations

from typing import Any

import datasets
from omegaconf import open_dict

from dflash2.data.feature_store import binding, bytes_per_token
from dflash2.data.features import write_features
from dflash2.target.model import resolve_device
from dflash2.training.run import build_data, target_and_draft


def run(cfg: Any) -> dict[str, Any]:
    """The CLI on a composed `configs/features.yaml`: the run's target, layers and rows, written to `output`."""
    with open_dict(cfg):
        cfg.data.features = None  # the rows themselves: the data module must not read a cache here
    target, draft = target_and_draft(cfg)
    target.to(resolve_device(cfg.device))
    rows, extras = build_data(cfg, target, draft).rows()
    if extras:  # data.path's rows first, then each file's: the order FeatureStore.attach numbers them in
        rows = datasets.concatenate_datasets([rows, *extras])
    fields = binding(cfg.model, cfg.data, list(draft.target_layer_ids))
    manifest = write_features(
        target, rows, cfg.output, fields, dtype=cfg.dtype, batch_size=cfg.batch_size, shard_rows=cfg.shard_rows
    )
    print(
        f"features: {manifest['rows']} rows, {manifest['tokens']} tokens of layers {manifest['target_layer_ids']} in "
        f"{cfg.output} ({manifest['dtype']}, "
        f"{bytes_per_token(manifest['hidden_size'], len(manifest['target_layer_ids']), manifest['dtype'])} bytes/token)"
    )
    return manifest
