"""A cache of the target's features: the target runs once per data set, and training reads its layers from disk.

    python -m dflash2.commands.features <the run's settings: experiment=..., model..., data..., draft...> output=DIR
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
binding differs from the run's, naming the setting, before any weights load. The command builds the run's target
and rows as training builds them (`dflash2/commands/features.py`); this module writes them.

Storage (`dtype`): bf16 (2 bytes per value; the features' relative rounding 2^-8) or fp8 (float8 e4m3 with one
float32 scale per token and layer, amax/448: 1 byte per value plus 4 per layer; relative rounding 2^-4); fp8 e5m2,
int8 and zlib-compressed bf16 lose more or cost more (BENCHMARKS.md, "Storage ways tried"). The cache holds the
target's layers, not `fc`'s fused output, so that `fc` still trains. The final hidden state (soft-label distillation,
`objective.distill`) is not stored: [L, H] more per row; such a run is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash2.data.feature_store import (
    BINDING,
    DTYPES,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
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


if __name__ == "__main__":  # the command lives in the command layer, which this library module does not import
    raise SystemExit("this is the library: run python -m dflash2.commands.features ... (or dflash2-features ...)")
