"""The feature cache's format and reading side: its binding to a run (`binding`, `check_cache`), the shards' storage
(`quantize`, `dequantize`, `shard_name`) and `FeatureStore`, which training memory-maps. `dflash2.data.features`
writes it (python -m dflash2.commands.features); this module imports nothing of training, so the data module, the
LightningModule and the run's checks can read a cache without an import cycle."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
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
    "extra_sha256": "data.extra_paths (the training-only chat files' content)",
    "data_limit": "data.limit",
    "max_length": "data.max_length",
    "render_version": "the chat rendering of this dflash2 version",
}


# ---------------------------------------------------------------------- the binding
def file_sha256(path: str | Path) -> str:
    """sha256 of a file, once per process and version of the file (dflash2.target.locate's helper). A file in the
    Hugging Face cache is a blob named by its sha256 already, which is taken as is."""
    from dflash2.target.locate import _sha256

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
    from dflash2.target.locate import target_source

    path, kwargs = target_source(model_cfg.get("path"), model_cfg.get("gguf_file"))
    if Path(path).is_dir():
        return path, kwargs, Path(path)
    import huggingface_hub as hub  # a hub id: its snapshot (what loading the target downloads anyway)

    return path, kwargs, Path(hub.snapshot_download(path, local_files_only=bool(kwargs.get("local_files_only"))))


def binding(model_cfg: Mapping[str, Any], data_cfg: Mapping[str, Any], layer_ids: list[int]) -> dict[str, Any]:
    """What decides a cache's content, from the settings alone (the target's config, tokenizer and weight files are
    read, its weights are not loaded): the writer records it, `check_cache` compares it."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash2.data.chat import RENDER_VERSION, sharegpt_path
    from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs
    from dflash2.target.manifest import target_identity, tokenizer_hash

    path, kwargs, folder = _target_folder(model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    identity = target_identity(model_cfg.get("name"), AutoConfig.from_pretrained(path, **kwargs), tokenizer)
    data_path = data_cfg.get("path")
    data_file = Path(sharegpt_path() if data_path is None else data_path).expanduser().absolute()
    extras = [Path(p).expanduser().absolute() for p in data_cfg.get("extra_paths") or ()]
    template_kwargs = check_chat_template_kwargs(data_cfg.get(KWARGS_KEY), f"data.{KWARGS_KEY}") or {}
    out = {
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
    if extras:  # absent without them: a cache of data.path alone binds by data.path's fields only
        out["extra_paths"] = [str(p) for p in extras]
        out["extra_sha256"] = [file_sha256(p) for p in extras]
    return out


def read_manifest(folder: str | Path, setting: str = "data.features") -> dict[str, Any]:
    file = Path(folder).expanduser() / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(
            f"{setting}={folder}: no {MANIFEST} there; write the cache with `python -m dflash2.commands.features "
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
    if isinstance(value, list):
        return [_short(v) for v in value]
    return value[:12] if isinstance(value, str) and len(value) == 64 else value  # a sha256: its first 12 digits


def check_cache(cfg: Mapping[str, Any], layer_ids: list[int]) -> dict[str, Any]:
    """Refuse `data.features` when it does not fit the run (`train.py`'s check, before any weights load): the cache
    must exist, be complete and have been written for this target, these layers, this template and this data."""
    folder = cfg["data"]["features"]
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
            "cache has them, or write a cache for this run: `python -m dflash2.commands.features <this run's settings> "
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
    values, scales = scale_tokens(x, layers, FP8_MAX)
    return {"features": values.to(FP8).flatten(1), "scales": scales}


def scale_tokens(x: torch.Tensor, layers: int, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, n*H] -> ([T, n, H] float32 within [-qmax, qmax], [T, n] float32 scales): each token's layer divided by
    amax/qmax, so that its largest value is the format's largest."""
    x = x.float().view(len(x), layers, -1)
    scales = (x.abs().amax(-1) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scales[..., None]).clamp(-qmax, qmax), scales


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
                f"`python -m dflash2.commands.features` with the settings it was started with and output={folder} to "
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

    def attach(self, rows: Any, extras: Sequence[Any] = ()) -> tuple[Any, list[Any]]:
        """The data module's tokenized rows of data.path and of each data.extra_paths file, each with a
        `feature_row` column (their index here: data.path's rows first, then each file's, as written), once their
        count is the cache's; run before the split, so that training and validation rows both find their features."""
        parts = [rows, *extras]
        total = sum(len(part) for part in parts)
        if total != self.rows:
            raise ValueError(
                f"data.features={self.folder} holds {self.rows} rows and the data has {total}: it was written "
                "for other data; write the cache again for this run"
            )
        out, start = [], 0
        for part in parts:
            out.append(part.add_column("feature_row", list(range(start, start + len(part)))))
            start += len(part)
        return out[0], out[1:]


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
    from dflash2.target.model import TargetOutput

    return TargetOutput(logits=None, hidden=dequantize(batch["features"], batch.get("feature_scales"), dtype))


def bytes_per_token(hidden_size: int, layers: int, dtype: str) -> int:
    """Stored bytes per token: n*H values, plus fp8's float32 scale per layer."""
    return layers * hidden_size * 2 if dtype == "bf16" else layers * hidden_size + 4 * layers
