"""Which target a drafter was trained for, recorded in config.json as `dflash2_manifest`.

A drafter reads its target's hidden states, embedding and head, so pairing it with another target (or with a
tokenizer that numbers tokens differently) loads fine and silently proposes garbage. Training writes the
manifest; the evaluator refuses a mismatch before wasting a run. Engines ignore the unknown field.

The export adds `metrics`, the exported checkpoint's validation metrics (`{"val/tau_sim": 3.12, ...}`): the data the
evaluator compares a measured tau with (`manifest_metric`), where the model card only shows them to people; and
`chat_template_kwargs`, the chat template's extra arguments training rendered the data with, which evaluation renders
its prompts with (`manifest_chat_template_kwargs`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from dflash2 import __version__

log = logging.getLogger(__name__)

MANIFEST_KEY = "dflash2_manifest"
# Keys that change with the library version, the download path or the load dtype, not with the model.
VOLATILE_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype"})
# The validation metrics of the exported checkpoint, as logged ("val/tau_sim"), written by the export.
METRICS_KEY = "metrics"
# The chat template's extra arguments training rendered with (dflash2.target.chat_template.KWARGS_KEY), written by the
# export.
CHAT_TEMPLATE_KWARGS_KEY = "chat_template_kwargs"
# A different value in any of these means the drafter was trained for another model.
IDENTITY_FIELDS = ("target_config_hash", "vocab_hash")


def _sha256(obj: Any) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _stable(d: Any) -> Any:
    """Drop volatile and private (`_name_or_path`, `_attn_implementation`...) keys, nested configs included."""
    if isinstance(d, dict):
        return {k: _stable(v) for k, v in d.items() if k not in VOLATILE_KEYS and not str(k).startswith("_")}
    if isinstance(d, list | tuple):
        return [_stable(v) for v in d]
    return d


def config_hash(hf_config: Any) -> str:
    """sha256 of a transformers config (or its dict) without the keys that vary between loads of one model."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return _sha256(_stable(d))


def vocab_hash(tokenizer: Any) -> str:
    """sha256 of the vocabulary, token -> id, added tokens included: what decides which id means what, hence all that
    pairs a drafter with a tokenizer. Not the special tokens' roles: transformers releases have converted one file
    with different ones (SmolLM2's GGUF got <|im_start|> as eos from 5.17), and a drafter proposes the same ids."""
    return _sha256({"vocab": sorted(tokenizer.get_vocab().items())})


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of the vocabulary and the special tokens: what rendering a chat into ids depends on (the data cache's
    key). Manifests written before 2026-12-03 carry it as their identity; `check_manifest` reads `vocab_hash` now."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = getattr(tokenizer, "special_tokens_map", None) or {}
    return _sha256({"vocab": vocab, "special": special})


def target_identity(name: str, hf_config: Any, tokenizer: Any) -> dict[str, Any]:
    """The facts that make two targets interchangeable for a drafter."""
    template = getattr(tokenizer, "chat_template", None)
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    return {
        "target": name,
        # Which model class an engine builds for the target, hence whether it can capture the drafter's features.
        "target_architectures": list(d.get("architectures") or []),
        "target_config_hash": config_hash(hf_config),
        "vocab_hash": vocab_hash(tokenizer),
        "chat_template_hash": None if template is None else _sha256(template),
    }


def build_manifest(identity: dict[str, Any], data_source: str, steps: int, **extra: Any) -> dict[str, Any]:
    """The target's identity plus how the drafter was made; `extra` (e.g. a run name) is kept as given."""
    return {
        "dflash2_version": __version__,
        **identity,
        "data_source": data_source,
        "training_steps": int(steps),
        **extra,
    }


def manifest_metric(manifest: dict[str, Any] | None, name: str) -> float | None:
    """A validation metric the export recorded (`name` as logged without its stage: "tau_sim"), None if it did not."""
    value = ((manifest or {}).get(METRICS_KEY) or {}).get(f"val/{name}")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def manifest_chat_template_kwargs(manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat template's extra arguments the drafter's training rendered its data with, None when the manifest does
    not record them (exported before they were recorded, or by another tool)."""
    value = (manifest or {}).get(CHAT_TEMPLATE_KWARGS_KEY)
    return dict(value) if isinstance(value, dict) else None


def target_architectures(manifest: dict[str, Any] | None) -> list[str] | None:
    """The target's transformers `architectures` as training recorded them (`target_identity`), None when it did not."""
    value = (manifest or {}).get("target_architectures")
    return [str(a) for a in value] if isinstance(value, list) and value else None


def read_manifest(path: str | Path | dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of an exported folder (or of a config dict); None for drafters exported elsewhere."""
    if isinstance(path, dict):
        return path.get(MANIFEST_KEY)
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: pass a drafter folder (config.json + model.safetensors)")
    return json.loads(file.read_text()).get(MANIFEST_KEY)


def check_manifest(manifest: dict[str, Any] | None, identity: dict[str, Any]) -> None:
    """Refuse a drafter trained for another target; a drafter without a manifest passes with a warning."""
    if not manifest:
        log.warning(
            "the drafter carries no %s (exported by another tool?): cannot check that it was trained "
            "for %s; a wrong pairing shows up only as a low acceptance length",
            MANIFEST_KEY,
            identity.get("target"),
        )
        return
    wrong = [f for f in IDENTITY_FIELDS if manifest.get(f) is not None and manifest.get(f) != identity.get(f)]
    if wrong:
        details = "; ".join(f"{f} {str(manifest[f])[:12]} vs {str(identity.get(f))[:12]}" for f in wrong)
        raise ValueError(
            f"the drafter was trained for {manifest.get('target')!r} and the target given "
            f"({identity.get('target')!r}) differs from it: {details}. Serve it with the target (and tokenizer) it "
            "was trained for, or retrain it for this one."
        )
    unchecked = [f for f in IDENTITY_FIELDS if manifest.get(f) is None]
    if unchecked:
        log.warning("%s lacks %s: that part of the pairing is not checked", MANIFEST_KEY, unchecked)
    if manifest.get("chat_template_hash") != identity.get("chat_template_hash"):
        log.warning(
            "the target's chat template differs from the one the drafter was trained with: acceptance "
            "may drop on chat prompts"
        )
