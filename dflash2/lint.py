"""Check a DFlash / DFlash2 drafter folder against the contract from config.json and the safetensors headers.

Serving engines fail quietly on most contract faults (a codebook named `.weight` loads as zeros, a missing conv
tensor as the identity), so a bad folder costs acceptance length, not an error. The linter reports every
fault at once, each with its fix, and reads no tensor data: it is instant for a 27B drafter.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from safetensors import safe_open

from dflash2.config import DFLASH_FIELDS, LAYER_TYPES, DFlash2Config, tensor_shapes
from dflash2.manifest import MANIFEST_KEY

DIMS = tuple("hidden_size intermediate_size num_attention_heads num_key_value_heads head_dim num_hidden_layers "
             "num_target_layers vocab_size".split())  # fmt: skip
# What the contract fixes at the top level; a present-but-different value changes what engines build.
FIXED = {"model_type": "qwen3", "is_causal": False, "hidden_act": "silu", "attention_bias": False,
         "tie_word_embeddings": False}  # fmt: skip
# Older DFlash folders keep these at the top level and engines still find them there.
TOP_LEVEL_OK = ("block_size", "mask_token_id")
CONV = re.compile(r"\.(attention_conv|mlp_conv)\.")
SELECTOR = re.compile(r"^candidate_selector\.")
FC = re.compile(r"^fc\.")
HEAD = ("embed_tokens", "lm_head", "model.embed_tokens", "model.lm_head")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Tensors = dict[str, tuple[str, tuple[int, ...], str]]  # name -> (safetensors dtype, shape, file)


@dataclasses.dataclass
class LintReport:
    path: Path
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        head = f"{self.path}: " + ("OK" if self.ok else f"{len(self.problems)} problem(s)")
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


class _Unchecked(DFlash2Config):
    """A config that skips validation: the linter reports problems itself and only needs the tensor shapes."""

    def validate(self) -> None:
        pass


def lint(path: str | Path) -> LintReport:
    """Every contract problem of a drafter folder (config.json + safetensors headers), each with its fix."""
    report = LintReport(Path(path))
    if not report.path.is_dir():
        report.problems.append(f"{report.path} is not a folder: pass a drafter folder (config.json + safetensors)")
        return report
    raw = _read_config(report)
    tensors, unread = _read_headers(report)
    cfg, skip = _check_config(raw, report) if raw is not None else (None, [])
    if tensors is not None:
        _check_tensors(cfg, tensors, unread, skip, report)
    return report


# ---------------------------------------------------------------------- reading
def _read_config(report: LintReport) -> dict[str, Any] | None:
    file = report.path / "config.json"
    if not file.is_file():
        report.problems.append(f"{file} not found: a drafter folder needs config.json (export.py writes one)")
        return None
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        report.problems.append(f"config.json is not valid JSON ({e}): fix or re-export it")
        return None
    if not isinstance(raw, dict):
        report.problems.append("config.json is not a JSON object: re-export it")
        return None
    return raw


def _read_headers(report: LintReport) -> tuple[Tensors | None, set[str] | None]:
    """name -> (dtype, shape, file) for every tensor of every weight file, without reading tensor data, and the
    names that sit in unreadable files (None: unknown, so nothing can be called missing)."""
    folder, problem = report.path, report.problems.append
    weight_map: dict[str, str] | None = None
    if (folder / INDEX).is_file():
        try:
            weight_map = dict(json.loads((folder / INDEX).read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            problem(f"{INDEX} is unreadable or has no weight_map ({e!r}): regenerate it (re-export)")
            return None, None
        if (folder / SINGLE).is_file():
            problem(f"both {SINGLE} and {INDEX} exist: engines disagree on which one to load; keep one")
        files = sorted(set(weight_map.values()))
        for extra in sorted({p.name for p in folder.glob("*.safetensors")} - set(files) - {SINGLE}):
            problem(
                f"shard {extra} is missing from {INDEX}: engines never load its tensors; add them to the "
                "weight_map or delete the file"
            )
    elif (folder / SINGLE).is_file():
        files = [SINGLE]
    else:
        problem(f"no weights: neither {SINGLE} nor {INDEX} in {folder}")
        return None, None

    tensors: Tensors = {}
    unread: set[str] = set()
    for name in files:
        if not (folder / name).is_file():
            problem(f"shard {name} listed in {INDEX} is missing: copy it into the folder or re-export")
            unread.add(name)
            continue
        try:
            with safe_open(folder / name, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    if key in tensors:
                        problem(f"tensor {key} is stored twice ({tensors[key][2]} and {name}): keep one copy")
                    tensors[key] = (sl.get_dtype(), tuple(sl.get_shape()), name)
        except Exception as e:  # safetensors raises its own error type for a truncated or foreign file
            problem(f"{name} is unreadable ({e}): the file is truncated or not safetensors; re-copy or re-export it")
            unread.add(name)
    if weight_map is None:
        return tensors, None if unread else set()
    present = set(files) - unread
    wrong = sorted(k for k, (_, _, f) in tensors.items() if weight_map.get(k) != f)
    lost = sorted(k for k, f in weight_map.items() if f in present and k not in tensors)
    if wrong:
        problem(f"{INDEX} does not map {_names(wrong)} to the shard that holds it: regenerate the index")
    if lost:
        problem(f"{INDEX} lists {_names(lost)} but its shard lacks it: regenerate the index or re-export")
    return tensors, {k for k, f in weight_map.items() if f in unread}


# ---------------------------------------------------------------------- config.json
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _ConfigCheck:
    """The problems of one config.json; each `check_*` returns what it validated, or None when it is invalid."""

    def __init__(self, raw: dict[str, Any], report: LintReport) -> None:
        self.raw, self.problem, self.note = raw, report.problems.append, report.notes.append
        self.nested = raw.get("dflash_config")
        if not isinstance(self.nested, dict):
            self.problem(
                "dflash_config is missing: engines read block_size, mask_token_id and target_layer_ids "
                "from a nested dflash_config object; add it"
            )
            self.nested = {}

    def get(self, name: str, default: Any = None) -> Any:
        """A dflash_config field where engines read it, with a word when it sits only at the top level."""
        raw, nested = self.raw, self.nested
        if name in nested:
            if name in raw and raw[name] != nested[name]:
                self.note(
                    f"top-level {name}={raw[name]!r} differs from dflash_config.{name}={nested[name]!r}; "
                    "engines read the nested one"
                )
            return nested[name]
        if name not in raw:
            return default
        if name in TOP_LEVEL_OK:
            self.note(
                f"{name} is only at the top level (older DFlash layout); engines accept it, but copy it "
                "into dflash_config"
            )
        else:
            self.problem(f"{name} is only at the top level, where engines do not read it: move it into dflash_config")
        return raw[name]

    def check_dims(self) -> dict[str, int] | None:
        raw = self.raw
        dims = {d: raw.get(d) for d in DIMS}
        for d, v in dims.items():
            if not _is_int(v) or v <= 0:
                self.problem(f"{d} is {v!r}: it must be a positive integer (the drafter's training config has it)")
        heads, kv = dims["num_attention_heads"], dims["num_key_value_heads"]
        if _is_int(heads) and _is_int(kv) and kv > 0 and heads % kv:
            self.problem(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}: fix one of them")
        if raw.get("rope_parameters") is None and raw.get("rope_theta") is None:
            self.problem("neither rope_parameters nor rope_theta is set: copy the target's RoPE settings here")
        layer_types, n = raw.get("layer_types"), dims["num_hidden_layers"]
        if layer_types is None:
            pass
        elif not isinstance(layer_types, list) or (_is_int(n) and len(layer_types) != n):
            self.problem(f"layer_types {layer_types!r} must list one entry per draft layer ({n})")
        elif bad := sorted({t for t in layer_types if t not in LAYER_TYPES}):
            self.problem(f"layer_types has unknown {bad}: use {list(LAYER_TYPES)}")
        elif "sliding_attention" in layer_types:
            window = raw.get("sliding_window")
            if not _is_int(window) or window <= 0:
                self.problem(
                    f"sliding_window is {window!r} but layer_types has sliding_attention: set the target's window"
                )
            if raw.get("use_sliding_window") is not True:
                self.problem("use_sliding_window must be true when layer_types has sliding_attention")
        return dims if all(_is_int(v) and v > 0 for v in dims.values()) else None

    def check_block(self) -> list[int] | None:
        vocab, n = self.raw.get("vocab_size"), self.raw.get("num_target_layers")
        block = self.get("block_size")
        if not _is_int(block) or block < 2:
            self.problem(
                f"block_size is {block!r}: a block holds the anchor plus at least one proposal; set "
                "dflash_config.block_size >= 2 (16 is the published default)"
            )
        mask = self.get("mask_token_id")
        if mask is None:
            self.problem(
                "mask_token_id is missing: set dflash_config.mask_token_id explicitly (engines fall back "
                "to pad/eos, which silently hurts acceptance)"
            )
        elif not _is_int(mask) or (_is_int(vocab) and not 0 <= mask < vocab):
            self.problem(
                f"mask_token_id {mask!r} is outside the vocabulary [0, {vocab}): use the id the drafter "
                "was trained with"
            )
        ids = self.get("target_layer_ids")
        if not (isinstance(ids, list) and ids and all(_is_int(i) for i in ids)):
            self.problem(
                f"target_layer_ids is {ids!r}: set dflash_config.target_layer_ids to the target layers "
                "the drafter was trained on (a non-empty list of ints)"
            )
            return None
        if _is_int(n) and (bad := [i for i in ids if not 0 <= i < n]):
            self.problem(
                f"target_layer_ids {bad} out of range [0, {n - 1}] (num_target_layers {n}; id i is the "
                "output of decoder layer i): fix the ids or num_target_layers"
            )
        return ids

    def check_pair(self, a: str, b: str, what: str) -> tuple[int, int] | None:
        """Two fields that switch one feature on together (conv: taps/group, selector: rank/top-k)."""
        x, y = self.get(a, 0) or 0, self.get(b, 0) or 0
        if not (_is_int(x) and _is_int(y) and x >= 0 and y >= 0):
            self.problem(f"{a}/{b} are {x!r}/{y!r}: both must be integers >= 0")
            return None
        if (x > 0) != (y > 0):
            self.problem(f"{a}/{b} are {x}/{y}: set both (> 0) for {what} or both to 0 for none")
            return None
        return x, y

    def check_conv(self) -> tuple[int, int] | None:
        pair = self.check_pair("conv_kernel_size", "conv_group_size", "the convolution")
        hidden = self.raw.get("hidden_size")
        if pair and pair[1] and _is_int(hidden) and hidden % pair[1]:
            self.problem(
                f"conv_group_size {pair[1]} does not divide hidden_size {hidden}: use the group size the "
                "drafter was trained with (a divisor of hidden_size)"
            )
            return None
        return pair

    def check_selector(self) -> tuple[int, int] | None:
        pair = self.check_pair("selector_rank", "selector_top_k", "the candidate selector")
        vocab = self.raw.get("vocab_size")
        if pair and (k := pair[1]):
            if k & (k - 1):
                self.problem(
                    f"selector_top_k {k} is not a power of two (the walk keeps K scores in registers): "
                    f"use {1 << (k.bit_length() - 1)} or {1 << k.bit_length()}"
                )
            if _is_int(vocab) and k > vocab:
                self.problem(f"selector_top_k {k} exceeds vocab_size {vocab}: lower it")
        mult, cap = self.get("output_multiplier", 1.0), self.get("final_logit_softcapping")
        if not _is_number(mult) or mult <= 0:
            self.problem(f"output_multiplier is {mult!r}: it must be > 0 (1.0 for Qwen3/Llama targets)")
        if cap is not None and not _is_number(cap):
            self.problem(f"final_logit_softcapping is {cap!r}: use a number (<= 0 or null turns it off)")
        return pair

    def check_declarations(self, dflash2: bool | None) -> None:
        raw = self.raw
        if dflash2 is not None:  # with unpaired fields nobody knows which architecture is meant
            arch = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
            if raw.get("architectures") != [arch]:
                why = "the conv or selector fields are set" if dflash2 else "conv and selector are off"
                self.problem(f"architectures is {raw.get('architectures')!r} but {why}: set it to [{arch!r}]")
        for key, value in FIXED.items():
            if key in raw and raw[key] != value:
                self.problem(f"{key} is {raw[key]!r}: the contract fixes it to {value!r}")
        dtype = raw.get("dtype", raw.get("torch_dtype"))
        if dtype is not None and dtype != "bfloat16":
            self.problem(f"dtype is {dtype!r}: drafters ship in bfloat16; set it to 'bfloat16' and cast the weights")
        for key in sorted(set(self.nested) - set(DFLASH_FIELDS)):
            self.note(f"dflash_config.{key} is not a contract field; engines ignore it")
        if MANIFEST_KEY not in raw:
            self.note(f"no {MANIFEST_KEY}: the evaluator cannot check which target this drafter was trained for")


def _check_config(raw: dict[str, Any], report: LintReport) -> tuple[DFlash2Config | None, list[tuple[re.Pattern, str]]]:
    """Report config.json's problems; return a config for the tensor table and the tensor groups it cannot judge."""
    check = _ConfigCheck(raw, report)
    dims, ids, conv, selector = check.check_dims(), check.check_block(), check.check_conv(), check.check_selector()
    check.check_declarations(None if conv is None or selector is None else bool(conv[0] or selector[0]))
    if dims is None:
        return None, []
    # Invalid fields get stand-ins that change no shape; the tensors that depend on them are skipped instead.
    skip = [(CONV, "conv tensors", conv), (SELECTOR, "selector tensors", selector), (FC, "fc.weight", ids)]
    (taps, group), (rank, top_k) = conv or (0, 0), selector or (0, 0)
    fields = dict(conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=top_k)
    cfg = _Unchecked(**dims, **fields, mask_token_id=0, block_size=16, target_layer_ids=ids or [0], rope_theta=1.0)
    return cfg, [(pattern, what) for pattern, what, ok in skip if ok is None]


# ---------------------------------------------------------------------- tensors


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _group(name: str) -> str:
    return "conv" if CONV.search(name) else "selector" if SELECTOR.search(name) else "other"


def _check_tensors(
    cfg: DFlash2Config | None,
    tensors: Tensors,
    unread: set[str] | None,
    skip: list[tuple[re.Pattern, str]],
    report: LintReport,
) -> None:
    """dtypes, then names and shapes against the contract's table for `cfg` (None: dimensions unknown)."""
    problem = report.problems.append
    by_dtype: dict[str, list[str]] = {}
    for name, (dtype, _, _) in sorted(tensors.items()):
        if dtype != "BF16":
            by_dtype.setdefault(dtype, []).append(name)
    for dtype, names in by_dtype.items():
        problem(f"{len(names)} tensor(s) stored as {dtype}, not bf16: {_names(names)}; cast them to bfloat16")
    for name in sorted(n for n in tensors if n.startswith(HEAD)):
        problem(f"unexpected tensor {name}: the drafter shares the target's embedding and head; drop it")
    if cfg is None:
        report.notes.append("tensor names and shapes not checked: fix the model dimensions in config.json first")
        return
    for _, what in skip:
        report.notes.append(f"{what} not checked: the config fields they depend on are invalid (see above)")

    def judged(name: str) -> bool:
        return not any(p.search(name) for p, _ in skip)

    expected = {k: v for k, v in tensor_shapes(cfg).items() if judged(k)}
    found = {k: v[1] for k, v in tensors.items() if judged(k) and not k.startswith(HEAD)}
    # Tensors of an unreadable file were reported with the file; with no index, nothing can be called missing.
    missing = set(expected) - set(found) - unread if unread is not None else set()
    renamed, unknown = [], {"conv": [], "selector": [], "other": []}
    for name in sorted(set(found) - set(expected)):
        fixed = name.removeprefix("model.")
        fixed = fixed.removesuffix(".weight") if fixed.endswith("codebook.weight") else fixed
        if fixed not in missing:
            unknown[_group(name)].append(name)
            continue
        missing.discard(fixed)
        if name.endswith("codebook.weight"):
            problem(f"tensor {name} must be named {fixed}: codebooks carry no .weight suffix (SGLang would load zeros)")
        else:
            renamed.append(name)
        if found[name] != expected[fixed]:
            problem(f"tensor {name} has shape {list(found[name])}, expected {list(expected[fixed])}")
    if renamed:
        problem(
            f"{len(renamed)} tensor(s) carry a 'model.' prefix ({_names(renamed)}): engines look names up "
            "without it; strip the prefix"
        )
    off = {"conv": not cfg.use_conv, "selector": not cfg.use_selector, "other": False}
    for group, names in unknown.items():
        if names and off[group]:
            problem(
                f"unexpected {group} tensor(s) {_names(names)} but the {group} fields are 0: set them in "
                "dflash_config or drop the tensors"
            )
        elif names:
            problem(
                f"unexpected tensor(s) {_names(names)}: not in the contract for this config and engines "
                "ignore them silently; drop them or fix the config"
            )
    lost = {"conv": [], "selector": [], "other": []}
    for name in sorted(missing):
        lost[_group(name)].append(name)
    why = {"conv": "SGLang would load an identity convolution", "selector": "SGLang would load zeros",
           "other": "the drafter cannot load"}  # fmt: skip
    for group, names in lost.items():
        if names:
            problem(f"missing tensor(s) {_names(names)}: {why[group]}; re-export from the training checkpoint")
    mismatched = [(k, found[k], v) for k, v in sorted(expected.items()) if k in found and found[k] != v]
    for name, got, want in mismatched[:8]:
        problem(
            f"tensor {name} has shape {list(got)}, expected {list(want)} from config.json: the weights and "
            "the config disagree; fix the config's dimensions or re-export"
        )
    if len(mismatched) > 8:
        problem(
            f"{len(mismatched) - 8} more shape mismatches: check hidden_size, heads, head_dim and "
            "intermediate_size in config.json"
        )
