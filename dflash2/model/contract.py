"""The rules of the DFlash2 contract (sections 2 and 3), written once: what a config.json may hold and which tensors
it implies.

`review_config` lists every problem of a raw config.json dict. `DFlash2Config` raises on the first one, the linter
(`dflash2.export.check`) reports them all; nothing else re-checks a drafter's fields. `tensor_table` is section 3's
table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
DIMS = tuple(
    "hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim num_hidden_layers "
    "num_target_layers vocab_size".split()
)
# What the contract fixes at the top level; a present-but-different value changes what engines build.
FIXED = {
    "model_type": "qwen3",
    "is_causal": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
}
# Older DFlash folders keep these at the top level and engines still find them there.
TOP_LEVEL_OK = ("block_size", "mask_token_id")
CONV_FIELDS = ("conv_kernel_size", "conv_group_size")
SELECTOR_FIELDS = ("selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One broken rule: the fields at fault (as config.json names them) and why, with the fix."""

    fields: tuple[str, ...]
    why: str

    def __str__(self) -> str:
        return f"{'/'.join(self.fields)}: {self.why}"


@dataclasses.dataclass
class Review:
    """What `review_config` found: the problems, notes that are no fault (an older layout, an unknown field) and each
    contract field as engines read it (None where absent)."""

    problems: list[Problem] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)

    def faulty(self, *fields: str) -> bool:
        """Whether any of `fields` has a problem."""
        return any(f in p.fields for p in self.problems for f in fields)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


BLOCK_SIZE_RULE = "a block holds the anchor plus at least one proposal, so it must be an integer >= 2"


def valid_block_size(block_size: Any) -> bool:
    """The one rule for B, in a config.json and wherever B is chosen at run time."""
    return _is_int(block_size) and block_size >= 2


def check_block_size(block_size: Any, setting: str = "block_size") -> int:
    """`block_size` where it is chosen at run time (decoding, data), refused under the name `setting`."""
    if not valid_block_size(block_size):
        raise ValueError(f"{setting}={block_size!r}: {BLOCK_SIZE_RULE}")
    return block_size


def review_config(raw: Mapping[str, Any]) -> Review:
    """Every problem of a config.json dict, in reading order; the dflash_config fields are read where engines read
    them (nested, or at the top level for the older layout's block_size and mask_token_id)."""
    config = _Reading(raw, Review())
    for rules in (
        _review_dimensions,
        _review_layer_types,
        _review_block_size,
        _review_mask_token,
        _review_target_layers,
        _review_conv_and_selector,
        _review_output_scaling,
        _review_declarations,
    ):
        rules(config)
    return config.review


class _Reading:
    """One config.json under review: its fields read where engines read them, and what the review found so far."""

    def __init__(self, raw: Mapping[str, Any], review: Review) -> None:
        self.raw, self.review = raw, review
        nested = raw.get("dflash_config")
        if not isinstance(nested, Mapping):
            self.problem(
                ("dflash_config",),
                "is missing: engines read block_size, mask_token_id and target_layer_ids from a "
                "nested dflash_config object; add it",
            )
            nested = {}
        self.nested = nested

    def problem(self, fields: tuple[str, ...], why: str) -> None:
        self.review.problems.append(Problem(fields, why))

    def field(self, name: str, default: Any = None) -> Any:
        """A dflash_config field as engines read it, kept in the review's values: the nested one, else the top-level
        one, which only block_size and mask_token_id may be (the older layout)."""
        self.review.values[name] = value = self._read(name, default)
        return value

    def _read(self, name: str, default: Any) -> Any:
        raw, nested, note = self.raw, self.nested, self.review.notes.append
        if name in nested:
            if name in raw and raw[name] != nested[name]:
                note(
                    f"top-level {name}={raw[name]!r} differs from dflash_config.{name}={nested[name]!r}; engines read "
                    "the nested one"
                )
            return nested[name]
        if name not in raw:
            return default
        if name in TOP_LEVEL_OK:
            note(
                f"{name} is only at the top level (older DFlash layout); engines accept it, but copy it into "
                "dflash_config"
            )
        else:
            self.problem((name,), "is only at the top level, where engines do not read it: move it into dflash_config")
        return raw[name]


def _review_dimensions(config: _Reading) -> None:
    """The model's dimensions, the heads' grouping and the RoPE settings."""
    values, raw = config.review.values, config.raw
    for d in DIMS:
        v = values[d] = raw.get(d)
        if not _is_int(v) or v <= 0:
            config.problem((d,), f"is {v!r}: it must be a positive integer (the target's, or the drafter's depth)")
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if _is_int(heads) and _is_int(kv) and kv > 0 and heads % kv:
        config.problem(("num_key_value_heads",), f"{kv} does not divide num_attention_heads {heads}: fix one of them")
    if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
        config.problem(
            ("rope_parameters", "rope_theta"), "neither is set: copy the target's RoPE settings (either one)"
        )


def _review_layer_types(config: _Reading) -> None:
    """`layer_types`, optional: one known type per draft layer, and a sliding window where a layer slides."""
    raw, n = config.raw, config.review.values["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or (_is_int(n) and len(layer_types) != n):
        config.problem(("layer_types",), f"{layer_types!r} must list one entry per draft layer ({n})")
    elif bad := sorted({t for t in layer_types if t not in LAYER_TYPES}):
        config.problem(("layer_types",), f"has unknown {bad}: use {list(LAYER_TYPES)}")
    elif "sliding_attention" in layer_types:
        window = raw.get("sliding_window")
        if not _is_int(window) or window <= 0:
            config.problem(
                ("sliding_window",), f"is {window!r} but layer_types has sliding_attention: set a positive window"
            )
        if raw.get("use_sliding_window") is not True:
            config.problem(("use_sliding_window",), "must be true when layer_types has sliding_attention")


def _review_block_size(config: _Reading) -> None:
    block = config.field("block_size")
    if not valid_block_size(block):
        config.problem(("block_size",), f"is {block!r}: {BLOCK_SIZE_RULE} (16 is the published default)")


def _review_mask_token(config: _Reading) -> None:
    """The mask token: set explicitly, inside the vocabulary."""
    vocab, mask = config.review.values["vocab_size"], config.field("mask_token_id")
    if mask is None:
        config.problem(
            ("mask_token_id",),
            "must be set explicitly (engines fall back to pad/eos, which silently hurts "
            "acceptance): pick an id the target's chat never produces",
        )
    elif not _is_int(mask) or (_is_int(vocab) and not 0 <= mask < vocab):
        config.problem(("mask_token_id",), f"{mask!r} is outside the vocabulary [0, {vocab})")


def _review_target_layers(config: _Reading) -> None:
    """The target layers the drafter reads: a non-empty list of the target's layer ids."""
    depth, ids = config.review.values["num_target_layers"], config.field("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        config.problem(
            ("target_layer_ids",), f"is {ids!r}: list the target layers the drafter reads (a non-empty list of ints)"
        )
    elif _is_int(depth) and (bad := [i for i in ids if not 0 <= i < depth]):
        config.problem(
            ("target_layer_ids",),
            f"{bad} out of range [0, {depth - 1}] (num_target_layers {depth}; id i is the output of decoder layer i)",
        )


def _review_conv_and_selector(config: _Reading) -> None:
    """The convolution and the selector: each pair of fields switches its part on together, and each part's size
    fits the model."""
    for pair, what in ((CONV_FIELDS, "the convolution"), (SELECTOR_FIELDS, "the candidate selector")):
        x, y = config.field(pair[0], 0) or 0, config.field(pair[1], 0) or 0
        config.review.values[pair[0]], config.review.values[pair[1]] = x, y
        if not (_is_int(x) and _is_int(y) and x >= 0 and y >= 0):
            config.problem(pair, f"are {x!r}/{y!r}: both must be integers >= 0")
        elif (x > 0) != (y > 0):
            config.problem(pair, f"are {x}/{y}: set both (> 0) for {what} or both to 0 for none")
    values = config.review.values
    group, hidden = values["conv_group_size"], values["hidden_size"]
    if _is_int(group) and group > 0 and _is_int(hidden) and hidden % group:
        config.problem(
            ("conv_group_size",), f"{group} does not divide hidden_size {hidden}: pick a divisor of hidden_size"
        )
    k, vocab = values["selector_top_k"], values["vocab_size"]
    if not (_is_int(k) and k > 0) or config.review.faulty(*SELECTOR_FIELDS):
        return
    if k & (k - 1):
        config.problem(
            ("selector_top_k",),
            f"{k} is not a power of two (the walk keeps K scores in registers): use "
            f"{1 << (k.bit_length() - 1)} or {1 << k.bit_length()}",
        )
    if _is_int(vocab) and k > vocab:
        config.problem(("selector_top_k",), f"{k} exceeds vocab_size {vocab}: lower it")


def _review_output_scaling(config: _Reading) -> None:
    """What scales the head's logits: the output multiplier and the final soft-capping."""
    mult = config.field("output_multiplier", 1.0)
    cap = config.field("final_logit_softcapping")
    if not _is_number(mult) or mult <= 0:
        config.problem(("output_multiplier",), f"is {mult!r}: it must be > 0 (1.0 for Qwen3/Llama targets)")
    if cap is not None and not _is_number(cap):
        config.problem(("final_logit_softcapping",), f"is {cap!r}: use a number (<= 0 or null turns it off)")


def _review_declarations(config: _Reading) -> None:
    """What the folder declares: its architecture, the fields the contract fixes, its dtype, and unknown fields."""
    raw, values = config.raw, config.review.values
    if not config.review.faulty(*CONV_FIELDS, *SELECTOR_FIELDS):  # with unpaired fields nobody knows which is meant
        dflash2 = bool(values["conv_kernel_size"] or values["selector_rank"])
        arch = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
        if raw.get("architectures") != [arch]:
            why = "the conv or selector fields are set" if dflash2 else "conv and selector are off"
            config.problem(("architectures",), f"is {raw.get('architectures')!r} but {why}: set it to [{arch!r}]")
    for key, value in FIXED.items():
        if key in raw and raw[key] != value:
            config.problem((key,), f"is {raw[key]!r}: the contract fixes it to {value!r}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype != "bfloat16":
        config.problem(
            ("dtype",), f"is {dtype!r}: drafters ship in bfloat16; set it to 'bfloat16' and cast the weights"
        )
    for key in sorted(set(config.nested) - set(DFLASH_FIELDS)):
        config.review.notes.append(f"dflash_config.{key} is not a contract field; engines ignore it")


@dataclasses.dataclass(frozen=True)
class TensorDims:
    """What section 3's table depends on: the model's dimensions, how many target layers fc reads (`num_features`)
    and the sizes of the DFlash2 parts (0: the part is off)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_features: int
    vocab_size: int
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0


def tensor_table(dims: TensorDims) -> dict[str, tuple[int, ...]]:
    """Section 3: the exact names and shapes of model.safetensors."""
    shapes = {"fc.weight": (dims.hidden_size, dims.num_features * dims.hidden_size)}
    shapes |= {"hidden_norm.weight": (dims.hidden_size,), "norm.weight": (dims.hidden_size,)}
    for layer in range(dims.num_hidden_layers):
        shapes |= _layer_tensors(dims, f"layers.{layer}.")
    if dims.selector_rank:
        r, v = dims.selector_rank, dims.vocab_size
        shapes |= {
            "candidate_selector.hidden_projection.weight": (r, dims.hidden_size),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
        }
    return shapes


def _layer_tensors(dims: TensorDims, p: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors, named under the prefix `p`."""
    h, i, head_dim = dims.hidden_size, dims.intermediate_size, dims.head_dim
    hq, hkv = dims.num_attention_heads * head_dim, dims.num_key_value_heads * head_dim
    shapes = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (hq, h),
        p + "self_attn.k_proj.weight": (hkv, h),
        p + "self_attn.v_proj.weight": (hkv, h),
        p + "self_attn.o_proj.weight": (h, hq),
        p + "self_attn.q_norm.weight": (head_dim,),
        p + "self_attn.k_norm.weight": (head_dim,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }
    if dims.conv_kernel_size:
        t, g = dims.conv_kernel_size, h // dims.conv_group_size
        for conv in ("attention_conv", "mlp_conv"):
            shapes[p + f"{conv}.base_kernel"] = (2, t, h)
            shapes[p + f"{conv}.kernel_projection.weight"] = (2 * t * g, h)
    return shapes


# The target's own tensors: a drafter shares its embedding and head and never stores them.
SHARED_TENSORS = ("embed_tokens", "lm_head", "model.embed_tokens", "model.lm_head")


def contract_name(name: str) -> str:
    """Section 3's name for a tensor stored under one of the common wrong ones: without a 'model.' prefix, and a
    codebook without a '.weight' suffix (plain parameters, not nn.Embedding); any other name as it is."""
    name = name.removeprefix("model.")
    return name.removesuffix(".weight") if name.endswith("codebook.weight") else name
