"""The drafter's configuration: every field of the contract's config.json, validated on construction."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

DFLASH_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
)
LAYER_TYPES = ("full_attention", "sliding_attention")
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
    """An invalid field, or pair of fields written `a/b`; `fields` lets a caller name them as its users type them."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.fields, self.why = field.split("/"), why


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
        if self.rope_theta is None and self.rope_parameters is None:
            raise ValueError("rope_theta / rope_parameters: inherit the target's RoPE settings (set either one)")
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ConfigFieldError(field, why)

        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "num_hidden_layers",
            "num_target_layers",
            "vocab_size",
        ):
            need(int(getattr(self, name)) > 0, name, "must be a positive integer")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            f"must divide num_attention_heads ({self.num_attention_heads})",
        )
        need(
            isinstance(self.block_size, int) and self.block_size >= 2,
            "block_size",
            f"is {self.block_size}; a block holds the anchor plus at least one proposal, so it must be >= 2",
        )
        need(
            self.mask_token_id is not None,
            "mask_token_id",
            "must be set explicitly (a pad/eos fallback silently hurts acceptance); pick an id the chat never emits",
        )
        need(
            0 <= self.mask_token_id < self.vocab_size,
            "mask_token_id",
            f"is {self.mask_token_id}, outside the vocabulary [0, {self.vocab_size})",
        )
        need(len(self.target_layer_ids) > 0, "target_layer_ids", "must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        need(
            not bad,
            "target_layer_ids",
            f"{bad} out of range [0, {self.num_target_layers - 1}] (id i is the output of decoder layer i)",
        )
        need(
            len(self.layer_types) == self.num_hidden_layers,
            "layer_types",
            f"has {len(self.layer_types)} entries for {self.num_hidden_layers} draft layers",
        )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        need(not unknown, "layer_types", f"unknown {unknown}; use {list(LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types:
            need(
                bool(self.sliding_window) and self.sliding_window > 0,
                "sliding_window",
                "must be a positive integer when layer_types has sliding_attention",
            )
        need(
            (self.conv_kernel_size > 0) == (self.conv_group_size > 0),
            "conv_kernel_size/conv_group_size",
            f"are {self.conv_kernel_size}/{self.conv_group_size}; set both (> 0) or neither (0)",
        )
        need(
            self.conv_kernel_size >= 0 and self.conv_group_size >= 0,
            "conv_kernel_size/conv_group_size",
            "must be >= 0",
        )
        if self.use_conv:
            need(
                self.hidden_size % self.conv_group_size == 0,
                "conv_group_size",
                f"{self.conv_group_size} does not divide hidden_size {self.hidden_size}",
            )
        need(
            (self.selector_rank > 0) == (self.selector_top_k > 0),
            "selector_rank/selector_top_k",
            f"are {self.selector_rank}/{self.selector_top_k}; set both (> 0) or neither (0)",
        )
        if self.use_selector:
            k = self.selector_top_k
            need(
                k & (k - 1) == 0,
                "selector_top_k",
                f"{k} is not a power of two (try {2 ** round(math.log2(k))})",
            )
            need(k <= self.vocab_size, "selector_top_k", f"{k} exceeds vocab_size {self.vocab_size}")
        need(self.output_multiplier > 0, "output_multiplier", f"is {self.output_multiplier}; it must be > 0")

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

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DFlash2Config:
        """Read a contract config.json; older DFlash folders keep block_size / mask_token_id at the top level."""
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
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise ValueError(f"config.json lacks {missing}; a DFlash2 config needs every field of the contract")
        if d.get("hidden_act", "silu") != "silu" or d.get("attention_bias", False):
            raise ValueError("hidden_act/attention_bias: a DFlash drafter is Qwen3-style (silu, no attention bias)")
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
    h, n = cfg.hidden_size, len(cfg.target_layer_ids)
    hq, hkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, n * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (hq, h),
            p + "self_attn.k_proj.weight": (hkv, h),
            p + "self_attn.v_proj.weight": (hkv, h),
            p + "self_attn.o_proj.weight": (h, hq),
            p + "self_attn.q_norm.weight": (cfg.head_dim,),
            p + "self_attn.k_norm.weight": (cfg.head_dim,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        }
        if cfg.use_conv:
            t, g = cfg.conv_kernel_size, cfg.conv_groups
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + f"{conv}.base_kernel"] = (2, t, h)
                shapes[p + f"{conv}.kernel_projection.weight"] = (2 * t * g, h)
    if cfg.use_selector:
        r, v = cfg.selector_rank, cfg.vocab_size
        shapes |= {
            "candidate_selector.hidden_projection.weight": (r, h),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
        }
    return shapes
