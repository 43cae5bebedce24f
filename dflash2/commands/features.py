"""`python -m dflash2.commands.features` (`dflash2-features`): the feature cache of a training run's settings, on
configs/features.yaml, which composes train.yaml.

    python -m dflash2.commands.features <the run's settings: experiment=..., model..., data..., draft...> output=DIR

The target, the layers it captures and the rows are built as train.py builds them (dflash2.commands.train_groups), so
the cache holds what that run reads; dflash2.data.features writes them. train.yaml's check step runs here too
(PrepareRun), and the drafter it resolved is the one whose layers are cached.
"""

from __future__ import annotations

from typing import Any

import datasets
from omegaconf import DictConfig, open_dict

from dflash2.commands import command
from dflash2.commands.resolvers import register_resolvers
from dflash2.commands.train_checks import PrepareRun
from dflash2.commands.train_groups import build_data, load_target, plain, resolve_drafter
from dflash2.data.feature_store import binding, bytes_per_token
from dflash2.data.features import write_features
from dflash2.model.config import DFlash2Config
from dflash2.target.model import resolve_device


def main() -> None:
    """The console entry: features.yaml composes train.yaml, whose run folder and precision resolve through dflash2's
    resolvers."""
    register_resolvers()
    command("features", task)


def task(cfg: DictConfig) -> dict[str, Any]:
    """Hydra's task: `run`, with the drafter PrepareRun resolved when it checked this very config."""
    draft, PrepareRun.checked = PrepareRun.checked, None
    return run(cfg, draft)


def run(cfg: DictConfig, draft: DFlash2Config | None = None) -> dict[str, Any]:
    """The command on a composed configs/features.yaml: the run's target, layers and rows, written to `output`.
    `draft`: the run's drafter, resolved by the config's check (else here)."""
    with open_dict(cfg):
        cfg.data.features = None  # the rows themselves: the data module must not read a cache here
    draft = draft or resolve_drafter(cfg)
    target = load_target(cfg, draft)
    target.to(resolve_device(cfg.device))
    rows, extras = build_data(cfg, target, draft).rows()
    if extras:  # data.path's rows first, then each file's: the order FeatureStore.attach numbers them in
        rows = datasets.concatenate_datasets([rows, *extras])
    fields = binding(plain(cfg.model), plain(cfg.data), list(draft.target_layer_ids))
    manifest = write_features(
        target, rows, cfg.output, fields, dtype=cfg.dtype, batch_size=cfg.batch_size, shard_rows=cfg.shard_rows
    )
    print(
        f"features: {manifest['rows']} rows, {manifest['tokens']} tokens of layers {manifest['target_layer_ids']} in "
        f"{cfg.output} ({manifest['dtype']}, "
        f"{bytes_per_token(manifest['hidden_size'], len(manifest['target_layer_ids']), manifest['dtype'])} bytes/token)"
    )
    return manifest


if __name__ == "__main__":
    main()
