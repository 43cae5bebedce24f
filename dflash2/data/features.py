"""A cache of the target's features: the target runs once per data set, and training reads its layers from disk.

    python -m dflash2.data.features <the run's settings: experiment=..., model..., data..., draft...> output=DIR
    python train.py <the same settings> data.features=DIR

The command renders the chats exactly as training does (the data group's DFlashDataModule), runs the target over
them once and writes, for every row (data.path's, then each `data.extra_paths` file's), the captured layers
(`draft.target_layer_ids`, concatenated as `TargetOutput.hidden`) at every position up to the row's last trained
token: a block's context is its whole prefix, and nothing after the last trained token is ever read. Rows go into
shards of `shard_rows` rows, `shard-00000.safetensors`, ... (tensors `features` [tokens, n*H], `offsets` [rows + 1]
and, for fp8, `scales` [tokens, n]); training memory-maps them (safetensors' `safe_open`, one row's slice per
fetch). Each shard is written to a temporary file and renamed into place, so a killed run leaves whole shards only,
and a rerun of the same command writes just the missing ones. `manifest.json` (written first) binds the folder to
what produced it: the target (its config, vocabulary, chat template and a hash of its weight files), the layers, the
data files' hashes, `data.limit`, `data.max_length` and the rendering version; `train.py` refuses a cache whose
binding differs from the run's, naming the setting, before any weights load.

Storage (`dtype`): bf16 (2 bytes per value; the features' relative rounding 2^-8) or fp8 (float8 e4m3 with one
float32 scale per token and layer, amax/448: 1 byte per value plus 4 per layer; relative rounding 2^-4). fp8 e5m2,
int8 and zlib-compressed bf16 were measured and not kept (BENCHMARKS.md, "Storage ways tried"). Storing the
fused `fc` output instead (H values per token instead of n*H) would halve bf16's bytes for two layers (and divide
Qwen3-8B's five by five), but `fc` would then be frozen, which only the heads-only warm start allows
(`module.train_backbone=false`); not done. Nor is the final hidden state (soft-label distillation,
`objective.distill`) stored: [L, H] more per row, for an objective that is not the recipe's; such a run is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch

from dflash2.data.feature_store import (
    BINDING,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    binding,
    bytes_per_token,
    feature_lengths,
    quantize,
    shard_name,
)
from dflash2.downloads import write_atomic


# ---------------------------------------------------------------------- writing
def write_manifest(output: Path, manifest: dict[str, Any]) -> None:
    """Write the manifest, or check the one there: a rerun continues a cache of the same binding and refuses another."""
    file = output / MANIFEST
    if file.is_file():
        old = json.loads(file.read_text())
        keys = [*BINDING, "dtype", "rows", "shard_rows", "shards", "tokens"]
        wrong = [f"{k}: {old.get(k)!r} there, {manifest.get(k)!r} now" for k in keys if old.get(k) != manifest.get(k)]
        if wrong:
            raise ValueError(
                f"output={output} holds a feature cache of other settings ({'; '.join(wrong)}): pass another output, "
                "or the settings it was started with to finish it"
            )
        return
    write_atomic(file, (json.dumps(manifest, indent=2) + "\n").encode())


def write_features(
    target: Any,
    rows: Any,
    output: str | Path,
    binding_fields: dict[str, Any],
    *,
    dtype: str = "bf16",
    batch_size: int = 8,
    shard_rows: int = 256,
) -> dict[str, Any]:
    """Run `target` over `rows` (the data module's tokenized rows: input_ids, loss_mask) and write the cache into
    `output`, skipping the shards already there; returns the manifest."""
    from safetensors.torch import save_file

    from dflash2 import __version__
    from dflash2.progress import Progress

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: the cache stores bf16 or fp8 (e4m3 with a scale per token and layer)")
    if batch_size < 1 or shard_rows < 1:
        raise ValueError(f"batch_size={batch_size} and shard_rows={shard_rows} must be >= 1")
    output = Path(output).expanduser()
    output.mkdir(parents=True, exist_ok=True)
    lengths = feature_lengths(rows)
    layers = len(target.target_layer_ids)
    shards = math.ceil(len(lengths) / shard_rows)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dflash2_version": __version__,
        **binding_fields,
        "target_source": target.source,
        "target_dtype": str(target.embed_tokens.weight.dtype).removeprefix("torch."),
        "hidden_size": target.hidden_size,
        "dtype": dtype,
        "rows": len(lengths),
        "tokens": sum(lengths),
        "shard_rows": shard_rows,
        "shards": shards,
    }
    write_manifest(output, manifest)
    device = target.embed_tokens.weight.device
    todo = [k for k in range(shards) if not (output / shard_name(k)).is_file()]
    with Progress(total=sum(lengths), desc="features", unit="tokens") as bar:
        bar.update(sum(lengths) - sum(sum(lengths[k * shard_rows : (k + 1) * shard_rows]) for k in todo))
        for k in todo:
            first = k * shard_rows
            ids = rows.select(range(first, min(first + shard_rows, len(lengths))))["input_ids"]
            own = lengths[first : first + len(ids)]
            out: list[torch.Tensor | None] = [None] * len(ids)
            order = sorted(range(len(ids)), key=lambda j: own[j])  # similar lengths together: little padding
            for s in range(0, len(order), batch_size):
                chunk = order[s : s + batch_size]
                width = max(own[j] for j in chunk)
                batch = torch.zeros(len(chunk), width, dtype=torch.long)
                for r, j in enumerate(chunk):
                    batch[r, : own[j]] = torch.as_tensor(ids[j][: own[j]])
                # Right-padded, no attention mask: as training runs the target (DFlash2Module.target_pass).
                hidden = target(batch.to(device), logits=False).hidden
                for r, j in enumerate(chunk):
                    out[j] = hidden[r, : own[j]].cpu()
                bar.update(sum(own[j] for j in chunk))
            tensors = quantize(torch.cat(out), dtype, layers)
            tensors["offsets"] = torch.tensor(np.cumsum([0, *own]), dtype=torch.int64)
            write_atomic(output / shard_name(k), lambda tmp, t=tensors: save_file(t, tmp))
    return manifest


def run(cfg: Any) -> dict[str, Any]:
    """The CLI on a composed `configs/features.yaml`: the run's target, layers and rows, written to `output`."""
    from omegaconf import open_dict

    from dflash2.target import resolve_device
    from dflash2.training.run import build_data, target_and_draft

    with open_dict(cfg):
        cfg.data.features = None  # the rows themselves: the data module must not read a cache here
    target, draft = target_and_draft(cfg)
    target.to(resolve_device(cfg.device))
    rows, extras = build_data(cfg, target, draft)._rows()
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


def main() -> None:
    import hydra

    from dflash2.groups import exit_on_bad_input
    from dflash2.training import register_resolvers

    register_resolvers()
    hydra.main(version_base="1.3", config_path="../../configs", config_name="features")(exit_on_bad_input(run))()


if __name__ == "__main__":
    main()
