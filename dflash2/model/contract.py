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
    review = Review()
    note = review.notes.append

    def problem(fields: tuple[str, ...], why: str) -> None:
        review.problems.append(Problem(fields, why))

    nested = raw.get("dflash_config")
    if not isinstance(nested, Mapping):
        problem(
            ("dflash_config",),
            "is missing: engines read block_size, mask_token_id and target_layer_ids from a "
            "nested dflash_config object; add it",
        )
        nested = {}

    def get(name: str, default: Any = None) -> Any:
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
            problem((name,), "is only at the top level, where engines do not read it: move it into dflash_config")
        return raw[name]

    values = review.values
    # The model's dimensions.
    for d in DIMS:
        v = values[d] = raw.get(d)
        if not _is_int(v) or v <= 0:
            problem((d,), f"is {v!r}: it must be a positive integer (the target's, or the drafter's depth)")
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if _is_int(heads) and _is_int(kv) and kv > 0 and heads % kv:
        problem(("num_key_value_heads",), f"{kv} does not divide num_attention_heads {heads}: fix one of them")
    if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
        problem(("rope_parameters", "rope_theta"), "neither is set: copy the target's RoPE settings (either one)")
    layer_types, n = raw.get("layer_types"), values["num_hidden_layers"]
    if layer_types is None:
        pass
    elif not isinstance(layer_types, list) or (_is_int(n) and len(layer_types) != n):
        problem(("layer_types",), f"{layer_types!r} must list one entry per draft layer ({n})")
    elif bad := sorted({t for t in layer_types if t not in LAYER_TYPES}):
        problem(("layer_types",), f"has unknown {bad}: use {list(LAYER_TYPES)}")
    elif "sliding_attention" in layer_types:
        window = raw.get("sliding_window")
        if not _is_int(window) or window <= 0:
            problem(("sliding_window",), f"is {window!r} but layer_types has sliding_attention: set a positive window")
        if raw.get("use_sliding_window") is not True:
            problem(("use_sliding_window",), "must be true when layer_types has sliding_attention")

    # The block, the mask and the target layers.
    vocab, depth = values["vocab_size"], values["num_target_layers"]
    block = values["block_size"] = get("block_size")
    if not valid_block_size(block):
        problem(("block_size",), f"is {block!r}: {BLOCK_SIZE_RULE} (16 is the published default)")
    mask = values["mask_token_id"] = get("mask_token_id")
    if mask is None:
        problem(
            ("mask_token_id",),
            "must be set explicitly (engines fall back to pad/eos, which silently hurts "
            "acceptance): pick an id the target's chat never produces",
        )
    elif not _is_int(mask) or (_is_int(vocab) and not 0 <= mask < vocab):
        problem(("mask_token_id",), f"{mask!r} is outside the vocabulary [0, {vocab})")
    ids = values["target_layer_ids"] = get("target_layer_ids")
    if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
        problem(
            ("target_layer_ids",), f"is {ids!r}: list the target layers the drafter reads (a non-empty list of ints)"
        )
    elif _is_int(depth) and (bad := [i for i in ids if not 0 <= i < depth]):
        problem(
            ("target_layer_ids",),
            f"{bad} out of range [0, {depth - 1}] (num_target_layers {depth}; id i is the output of decoder layer i)",
        )

    # The convolution and the selector: each pair switches its part on together.
    for pair, what in ((CONV_FIELDS, "the convolution"), (SELECTOR_FIELDS, "the candidate selector")):
        x, y = values[pair[0]], values[pair[1]] = get(pair[0], 0) or 0, get(pair[1], 0) or 0
        if not (_is_int(x) and _is_int(y) and x >= 0 and y >= 0):
            problem(pair, f"are {x!r}/{y!r}: both must be integers >= 0")
        elif (x > 0) != (y > 0):
            problem(pair, f"are {x}/{y}: set both (> 0) for {what} or both to 0 for none")
    group, hidden = values["conv_group_size"], values["hidden_size"]
    if _is_int(group) and group > 0 and _is_int(hidden) and hidden % group:
        problem(("conv_group_size",), f"{group} does not divide hidden_size {hidden}: pick a divisor of hidden_size")
    k = values["selector_top_k"]
    if _is_int(k) and k > 0 and not review.faulty(*SELECTOR_FIELDS):
        if k & (k - 1):
            problem(
                ("selector_top_k",),
                f"{k} is not a power of two (the walk keeps K scores in registers): use "
                f"{1 << (k.bit_length() - 1)} or {1 << k.bit_length()}",
            )
        if _is_int(vocab) and k > vocab:
            problem(("selector_top_k",), f"{k} exceeds vocab_size {vocab}: lower it")
    mult = values["output_multiplier"] = get("output_multiplier", 1.0)
    cap = values["final_logit_softcapping"] = get("final_logit_softcapping")
    if not _is_number(mult) or mult <= 0:
        problem(("output_multiplier",), f"is {mult!r}: it must be > 0 (1.0 for Qwen3/Llama targets)")
    if cap is not None and not _is_number(cap):
        problem(("final_logit_softcapping",), f"is {cap!r}: use a number (<= 0 or null turns it off)")

    # What the folder declares.
    if not review.faulty(*CONV_FIELDS, *SELECTOR_FIELDS):  # with unpaired fields nobody knows which one is meant
        dflash2 = bool(values["conv_kernel_size"] or values["selector_rank"])
        arch = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
        if raw.get("architectures") != [arch]:
            why = "the conv or selector fields are set" if dflash2 else "conv and selector are off"
            problem(("architectures",), f"is {raw.get('architectures')!r} but {why}: set it to [{arch!r}]")
    for key, value in FIXED.items():
        if key in raw and raw[key] != value:
            problem((key,), f"is {raw[key]!r}: the contract fixes it to {value!r}")
    dtype = raw.get("dtype", raw.get("torch_dtype"))
    if dtype is not None and dtype != "bfloat16":
        problem(("dtype",), f"is {dtype!r}: drafters ship in bfloat16; set it to 'bfloat16' and cast the weights")
    for key in sorted(set(nested) - set(DFLASH_FIELDS)):
        note(f"dflash_config.{key} is not a contract field; engines ignore it")
    return review


def tensor_table(
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    num_hidden_layers: int,
    num_features: int,
    vocab_size: int,
    conv_kernel_size: int = 0,
    conv_group_size: int = 0,
    selector_rank: int = 0,
) -> dict[str, tuple[int, ...]]:
    """Section 3: the exact names and shapes of model.safetensors (`num_features`: how many target layers fc reads)."""
    h, n, i = hidden_size, num_features, intermediate_size
    hq, hkv = num_attention_heads * head_dim, num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, n * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for layer in range(num_hidden_layers):
        p = f"layers.{layer}."
        shapes |= {
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
        if conv_kernel_size:
            t, g = conv_kernel_size, h // conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + f"{conv}.base_kernel"] = (2, t, h)
                shapes[p + f"{conv}.kernel_projection.weight"] = (2 * t * g, h)
    if selector_rank:
        r, v = selector_rank, vocab_size
        shapes |= {
            "candidate_selector.hidden_projection.weight": (r, h),
            "candidate_selector.predecessor_codebook": (v, r),
            "candidate_selector.successor_codebook": (v, r),
        }
    return shapes


# The target's own tensors: a drafter shares its embedding and head and never stores them.
SHARED_TENSORS = ("embed_tokens", "lm_head", "model.embed_tokens", "model.lm_head")


def contract_name(name: str) -> str:
    """Section 3's name for a tensor stored under one of the common wrong ones: without a 'model.' prefix, and a
    codebook without a '.weight' suffix (plain parameters, not nn.Embedding); any other name as it is."""
    name = name.removeprefix("model.")
    return name.removesuffix(".weight") if name.endswith("codebook.weight") else name
