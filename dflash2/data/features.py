"""A cache of the target's features: the target runs once per data set, and training reads its layers from disk.

    python -m dflash2.data.features <the run's settings: experiment=..., model..., data..., draft...> output=DIR
    python train.py <the same settings> data.features=DIR

The command renders the chats exactly as training does (the data group's DFlashDataModule), runs the target over
them once and writes, for every row, the captured layers (`draft.target_layer_ids`, concatenated as
`TargetOutput.hidden`) at every position up to the row's last trained token: a block's context is its whole prefix,
and nothing after the last trained token is ever read. Rows go into shards of `shard_rows` rows,
`shard-00000.safetensors`, ... (tensors `features` [tokens, n*H], `offsets` [rows + 1] and, for fp8, `scales`
[tokens, n]); training memory-maps them (safetensors' `safe_open`, one row's slice per fetch). Each shard is written
to a temporary file and renamed into place, so a killed run leaves whole shards only, and a rerun of the same
command writes just the missing ones. `manifest.json` (written first) binds the folder to what produced it: the
target (its config, vocabulary, chat template and a hash of its weight files), the layers, the data file's hash, its
`limit`, `data.max_length` and the rendering version; `train.py` refuses a cache whose binding differs from the run's,
naming the setting, before any weights load.

Storage (`dtype`): bf16 (2 bytes per value; the features' relative rounding 2^-8) or fp8 (float8 e4m3 with one
float32 scale per token and layer, amax/448: 1 byte per value plus 4 per layer; relative rounding 2^-4). Storing the
fused `fc` output instead (H values per token instead of n*H) would halve bf16's bytes for two layers (and divide
Qwen3-8B's five by five), but `fc` would then be frozen, which only the heads-only warm start allows
(`module.train_backbone=false`); not done. Nor is the final hidden state (soft-label distillation,
`objective.distill`) stored: [L, H] more per row, for an objective that is not the recipe's; such a run is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = "dflash2-features"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = ("bf16", "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# The binding's fields, each with the setting that decides it (as typed on the command line) and how to fix it.
BINDING = {
    "target_config_hash": "model.path (the target's config.json)",
    "weights_hash": "model.path (the target's weights)",
    "vocab_hash": "model.path (the target's tokenizer)",
    "tokenizer_hash": "model.path (the target's tokenizer and its special tokens)",
    "chat_template_hash": "model.path (the target's chat template)",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "target_layer_ids": "draft.target_layer_ids",
    "data_sha256": "data.path (the chat file's content)",
    "data_limit": "data.limit",
    "max_length": "data.max_length",
    "render_version": "the chat rendering of this dflash2 version",
}


# ---------------------------------------------------------------------- the binding
def file_sha256(path: str | Path) -> str:
    """sha256 of a file, once per process and version of the file (dflash2.locate's helper). A file in the Hugging
    Face cache is a blob named by its sha256 already, which is taken as is."""
    from dflash2.locate import _sha256

    real = Path(path).resolve()
    if real.parent.name == "blobs" and len(real.name) == 64 and all(c in "0123456789abcdef" for c in real.name):
        return real.name
    stat = real.stat()
    return _sha256(str(real), stat.st_size, stat.st_mtime_ns)


def weights_hash(folder: str | Path) -> str:
    """sha256 over the weight files of a transformers folder (name and sha256 of each)."""
    files = sorted(p for p in Path(folder).iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{folder} holds no weight files ({', '.join(WEIGHT_SUFFIXES)})")
    return hashlib.sha256(json.dumps([[p.name, file_sha256(p)] for p in files]).encode()).hexdigest()


def _target_folder(model_cfg: Mapping[str, Any]) -> tuple[str, dict[str, Any], Path]:
    """(path, from_pretrained kwargs, local folder of its files) of the `model` group's target."""
    from dflash2.locate import target_source

    path, kwargs = target_source(model_cfg.get("path"), model_cfg.get("gguf_file"))
    if Path(path).is_dir():
        return path, kwargs, Path(path)
    import huggingface_hub as hub  # a hub id: its snapshot (what loading the target downloads anyway)

    return path, kwargs, Path(hub.snapshot_download(path, local_files_only=bool(kwargs.get("local_files_only"))))


def binding(model_cfg: Mapping[str, Any], data_cfg: Mapping[str, Any], layer_ids: list[int]) -> dict[str, Any]:
    """What decides a cache's content, from the settings alone (the target's config, tokenizer and weight files are
    read, its weights are not loaded): the writer records it, `check_cache` compares it."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer

    from dflash2.data.chat import RENDER_VERSION, sharegpt_path
    from dflash2.manifest import target_identity, tokenizer_hash

    path, kwargs, folder = _target_folder(model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    identity = target_identity(model_cfg.get("name"), AutoConfig.from_pretrained(path, **kwargs), tokenizer)
    data_path = data_cfg.get("path")
    data_file = Path(sharegpt_path() if data_path is None else data_path).expanduser().absolute()
    template_kwargs = data_cfg.get("chat_template_kwargs") or {}
    if OmegaConf.is_config(template_kwargs):
        template_kwargs = OmegaConf.to_container(template_kwargs, resolve=True)
    return {
        "target": model_cfg.get("name"),
        "target_config_hash": identity["target_config_hash"],
        "weights_hash": weights_hash(folder),
        "vocab_hash": identity["vocab_hash"],
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "chat_template_hash": identity["chat_template_hash"],
        "chat_template_kwargs": template_kwargs,
        "target_layer_ids": [int(i) for i in layer_ids],
        "data_path": str(data_file),
        "data_sha256": file_sha256(data_file),
        "data_limit": data_cfg.get("limit"),
        "max_length": int(data_cfg.get("max_length")),
        "render_version": RENDER_VERSION,
    }


def read_manifest(folder: str | Path, setting: str = "data.features") -> dict[str, Any]:
    file = Path(folder).expanduser() / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(
            f"{setting}={folder}: no {MANIFEST} there; write the cache with `python -m dflash2.data.features "
            f"<this run's settings> output={folder}`"
        )
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{setting}={folder}: not a dflash2 feature cache of version {FORMAT_VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}); write it again"
        )
    return manifest


def differences(manifest: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """One phrase per binding field that differs: the field, the setting that decides it, both values."""
    out = []
    for field, setting in BINDING.items():
        have, want = manifest.get(field), expected.get(field)
        if have != want:
            out.append(f"{field} (set by {setting}): the cache's {_short(have)!r}, the run's {_short(want)!r}")
    return out


def _short(value: Any) -> Any:
    return value[:12] if isinstance(value, str) and len(value) == 64 else value  # a sha256: its first 12 digits


def check_cache(cfg: Mapping[str, Any], layer_ids: list[int]) -> dict[str, Any]:
    """Refuse `data.features` when it does not fit the run (`train.py`'s check, before any weights load): the cache
    must exist, be complete and have been written for this target, these layers, this template and this data."""
    folder = cfg["data"]["features"]
    if cfg["data"].get("extra_paths"):
        raise ValueError(
            f"data.features={folder} covers data.path only; data.extra_paths is not cached: merge the files into "
            "data.path (and write the cache for it), or drop data.features"
        )
    if float(cfg["objective"].get("distill") or 0) > 0:
        raise ValueError(
            f"data.features={folder} holds the captured layers, not the target's final hidden states that "
            f"objective.distill={cfg['objective']['distill']} reads: set objective.distill=0, or data.features=null"
        )
    manifest = read_manifest(folder)
    wrong = differences(manifest, binding(cfg["model"], cfg["data"], layer_ids))
    if wrong:
        raise ValueError(
            f"data.features={folder} was written for other settings: " + "; ".join(wrong) + ". Set them as the "
            "cache has them, or write a cache for this run: `python -m dflash2.data.features <this run's settings> "
            "output=<new folder>`"
        )
    FeatureStore(folder)  # complete?
    return manifest


# ---------------------------------------------------------------------- storage
def feature_lengths(rows: Any) -> list[int]:
    """Per row: positions up to and including its last trained token (what training reads of it)."""
    return [int(np.flatnonzero(np.asarray(m))[-1]) + 1 for m in rows["loss_mask"]]


def quantize(x: torch.Tensor, dtype: str, layers: int) -> dict[str, torch.Tensor]:
    """[T, n*H] features -> what a shard stores: {"features"} in bf16, or {"features" fp8, "scales" float32 [T, n]},
    each token's layer scaled by amax/448 so that its largest value is e4m3's largest."""
    if dtype == "bf16":
        return {"features": x.to(torch.bfloat16)}
    x = x.float().view(len(x), layers, -1)
    scales = (x.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return {"features": q.view(len(x), -1), "scales": scales}


def dequantize(features: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """[..., n*H] stored features (and [..., n] scales for fp8) -> `dtype`."""
    if scales is None:
        return features.to(dtype)
    x = features.float().unflatten(-1, (scales.shape[-1], -1)) * scales.float()[..., None]
    return x.flatten(-2).to(dtype)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


class FeatureStore:
    """A written cache, read row by row through memory maps (`row(i)`: the i-th row of the data's tokenized rows).
    Shards are opened lazily, in the process that reads them (each DataLoader worker opens its own)."""

    def __init__(self, folder: str | Path, setting: str = "data.features"):
        self.folder = Path(folder).expanduser()
        self.manifest = read_manifest(folder, setting)
        m = self.manifest
        missing = [k for k in range(m["shards"]) if not (self.folder / shard_name(k)).is_file()]
        if missing:
            raise ValueError(
                f"{setting}={folder} is incomplete ({m['shards'] - len(missing)} of {m['shards']} shards): rerun "
                f"`python -m dflash2.data.features` with the settings it was started with and output={folder} to "
                "finish it"
            )
        self.rows, self.shard_rows = int(m["rows"]), int(m["shard_rows"])
        self._open: dict[int, tuple[Any, list[int]]] = {}

    def __len__(self) -> int:
        return self.rows

    def __getstate__(self) -> dict[str, Any]:  # a worker started by spawn opens its own maps
        return self.__dict__ | {"_open": {}}

    def _shard(self, k: int) -> tuple[Any, list[int]]:
        if k not in self._open:
            from safetensors import safe_open

            handle = safe_open(str(self.folder / shard_name(k)), framework="pt")
            self._open[k] = (handle, handle.get_tensor("offsets").tolist())
        return self._open[k]

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """{"features": [len, n*H]} (and "feature_scales" [len, n] for fp8) of row i, as stored."""
        if not 0 <= i < self.rows:
            raise IndexError(f"row {i} is outside the cache's {self.rows} rows")
        handle, offsets = self._shard(i // self.shard_rows)
        j = i % self.shard_rows
        out = {"features": handle.get_slice("features")[offsets[j] : offsets[j + 1]]}
        if self.manifest["dtype"] == "fp8":
            out["feature_scales"] = handle.get_slice("scales")[offsets[j] : offsets[j + 1]]
        return out

    def attach(self, rows: Any) -> Any:
        """The data module's tokenized rows with a `feature_row` column (their index here), once their count is
        the cache's; run before the split, so that training and validation rows both find their features."""
        if len(rows) != self.rows:
            raise ValueError(
                f"data.features={self.folder} holds {self.rows} rows and the data has {len(rows)}: it was written "
                "for other data; write the cache again for this run"
            )
        return rows.add_column("feature_row", list(range(len(rows))))


def truncate(row: dict[str, torch.Tensor], cached: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A row cut to its cached positions (the ones up to its last trained token: nothing after them is read)."""
    n = len(cached["features"])
    mask = row["loss_mask"]
    if n > len(mask) or not mask[n - 1] or mask[n:].any():
        raise ValueError("data.features: a row's cached length is not its last trained token's; write the cache again")
    return {"input_ids": row["input_ids"][:n], "loss_mask": mask[:n]}


def pad_features(rows: list[dict[str, torch.Tensor]], length: int) -> dict[str, torch.Tensor]:
    """The cached tensors of a batch, right-padded with zeros to `length` positions ([b, length, ...])."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        raw = t.view(torch.uint8) if t.dtype == FP8 else t  # pad works on bytes; a zero byte is fp8's 0.0
        out = torch.nn.functional.pad(raw, (0, 0, 0, length - len(t)))
        return out.view(FP8) if t.dtype == FP8 else out

    keys = [k for k in ("features", "feature_scales") if k in rows[0]]
    return {k: torch.stack([pad(r[k]) for r in rows]) for k in keys}


def cached_output(batch: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Any:
    """The TargetOutput the target would have returned for the batch (without the final hidden states)."""
    from dflash2.target import TargetOutput

    return TargetOutput(logits=None, hidden=dequantize(batch["features"], batch.get("feature_scales"), dtype))


def drop_target_layers(target: Any) -> None:
    """Free the target's decoder layers (their memory, on the device above all): with data.features training reads
    only its embedding and head. Its forward refuses to run from then on."""
    base = target.model.base_model
    base.layers = torch.nn.ModuleList()

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the target's layers were dropped (data.features): its features come from the cache")

    base.forward = refuse


# ---------------------------------------------------------------------- writing
def _atomic_write(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file, not mkstemp's owner-only mode
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
    _atomic_write(file, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=2) + "\n"))


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
            _atomic_write(output / shard_name(k), lambda tmp, t=tensors: save_file(t, tmp))
    return manifest


def bytes_per_token(hidden_size: int, layers: int, dtype: str) -> int:
    """Stored bytes per token: n*H values, plus fp8's float32 scale per layer."""
    return layers * hidden_size * 2 if dtype == "bf16" else layers * hidden_size + 4 * layers


def run(cfg: Any) -> dict[str, Any]:
    """The CLI on a composed `configs/features.yaml`: the run's target, layers and rows, written to `output`."""
    from omegaconf import open_dict

    from dflash2.target import resolve_device
    from dflash2.training.run import adopt_warm_start, build_data, target_and_draft

    adopt_warm_start(cfg)
    with open_dict(cfg):
        cfg.data.features = None  # the rows themselves: the data module must not read a cache here
    target, draft = target_and_draft(cfg)
    target.to(resolve_device(cfg.device))
    rows, _ = build_data(cfg, target, draft)._rows()
    if cfg.data.get("extra_paths"):
        log.warning("data.extra_paths are not cached: only data.path's rows are written")
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
    import sys

    import hydra

    from dflash2.groups import BAD_INPUT
    from dflash2.training import register_resolvers

    register_resolvers()

    @hydra.main(version_base="1.3", config_path="../../configs", config_name="features")
    def _main(cfg: Any) -> None:
        try:
            run(cfg)
        except BAD_INPUT as e:
            sys.exit(str(e))

    _main()


if __name__ == "__main__":
    main()
