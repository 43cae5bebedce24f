"""The drafter's configuration: every field of the contract's config.json, validated on construction."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash2.model.contract import DFLASH_FIELDS, Problem, TensorDims, review_config, tensor_table

# Keys that to_dict() writes from the fields themselves; reading them back must not duplicate them in `extra`.
DERIVED_KEYS = (
    "architectures",
    "model_type",
    "is_causal",
    "hidden_act",
    "attention_bias",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
    "use_sliding_window",
)


class ConfigFieldError(ValueError):
    """A config's first problem; `fields` lets a caller name them as its users type them."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.fields, self.why = list(problem.fields), problem.why


def in_window(query_position: Any, key_position: Any, window: int) -> Any:
    """A sliding layer's rule: the query at absolute position q sees the context position p when q - p < window, the
    window counted from the query's own position, as the engines count it (contract sections 6 and 7). Positions are
    ints or tensors that broadcast."""
    return query_position - key_position < window


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published choice: one target layer per draft layer, spread evenly from layer 1 to layer N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclasses.dataclass
class DFlash2Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_target_layers: int
    vocab_size: int
    mask_token_id: int | None
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_parameters: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # Keys we do not model (an engine's or our manifest) survive a load/save round trip untouched.
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.validate()

    def validate(self) -> None:
        """Raise on the contract's first problem with this config (dflash2.model.contract.review_config)."""
        if problems := review_config(self.to_dict()).problems:
            raise ConfigFieldError(problems[0])

    @property
    def use_conv(self) -> bool:
        return self.conv_kernel_size > 0

    @property
    def use_selector(self) -> bool:
        return self.selector_rank > 0

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size if self.use_conv else 0

    @property
    def theta(self) -> float:
        if self.rope_parameters and "rope_theta" in self.rope_parameters:
            return float(self.rope_parameters["rope_theta"])
        return float(self.rope_theta)

    def replace(self, **changes: Any) -> DFlash2Config:
        return dataclasses.replace(self, **changes)

    def attention_masks(self, build: Callable[[int | None], Any]) -> Any:
        """The mask a forward takes: `build(None)` (every key the rules allow) when no layer slides, else one per layer
        type, the sliding layers' from `build(sliding_window)` (DecoderLayer picks its own by `layer_type`)."""
        if "sliding_attention" not in self.layer_types:
            return build(None)
        return {"full_attention": build(None), "sliding_attention": build(self.sliding_window)}

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlash2Config:
        """Read a contract config.json; older DFlash folders keep block_size / mask_token_id at the top level."""
        if problems := review_config(d).problems:
            raise ConfigFieldError(problems[0])
        d = dict(d)
        nested = d.pop("dflash_config", None) or {}
        fields = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        for name in fields:
            if name in nested:
                kwargs[name] = nested[name]
            elif name in d:
                kwargs[name] = d[name]
        # An explicit null means "off / default" for fields that have a default (conv, selector, softcap).
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in kwargs.items() if v is not None or defaults.get(k) is None}
        extra = {k: v for k, v in d.items() if k not in fields and k not in DERIVED_KEYS}
        extra.update({f"dflash_config.{k}": v for k, v in nested.items() if k not in fields})
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DFlash2Config:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: pass a folder written by export.py (config.json + weights)")
        return cls.from_dict(json.loads(file.read_text()))

    def to_dict(self) -> dict[str, Any]:
        nested_extra = {k.split(".", 1)[1]: v for k, v in self.extra.items() if k.startswith("dflash_config.")}
        top_extra = {k: v for k, v in self.extra.items() if not k.startswith("dflash_config.")}
        out: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel" if self.use_conv or self.use_selector else "DFlashDraftModel"],
            "model_type": "qwen3",
            "is_causal": False,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "num_target_layers": self.num_target_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "attention_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "dtype": "bfloat16",
        }
        if self.rope_parameters is not None:
            out["rope_parameters"] = dict(self.rope_parameters)
        if self.rope_theta is not None:
            out["rope_theta"] = self.rope_theta
        if "sliding_attention" in self.layer_types:
            out["sliding_window"] = self.sliding_window
            out["use_sliding_window"] = True
        out["dflash_config"] = {name: getattr(self, name) for name in DFLASH_FIELDS} | nested_extra
        out["dflash_config"]["target_layer_ids"] = list(self.target_layer_ids)
        return {**top_extra, **out}

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def tensor_shapes(cfg: DFlash2Config) -> dict[str, tuple[int, ...]]:
    """The contract's tensor table (section 3) for this config: the exact names and shapes of model.safetensors."""
    return tensor_table(
        TensorDims(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.num_hidden_layers,
            len(cfg.target_layer_ids),
            cfg.vocab_size,
            cfg.conv_kernel_size,
            cfg.conv_group_size,
            cfg.selector_rank,
        )
    )
