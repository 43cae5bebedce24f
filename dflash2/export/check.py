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

from dflash2.export.engines import review_engines
from dflash2.model.contract import (
    CONV_FIELDS,
    DIMS,
    SELECTOR_FIELDS,
    SHARED_TENSORS,
    TensorDims,
    contract_name,
    review_config,
    tensor_table,
)
from dflash2.target.manifest import MANIFEST_KEY

CONV = re.compile(r"\.(attention_conv|mlp_conv)\.")
SELECTOR = re.compile(r"^candidate_selector\.")
FC = re.compile(r"^fc\.")
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
Tensors = dict[str, tuple[str, tuple[int, ...], str]]  # name -> (safetensors dtype, shape, file)


@dataclasses.dataclass
class LintReport:
    path: Path
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    # What SGLang and vLLM make of the folder (dflash2/export/engines.py): warnings never fail the check.
    warnings: list[str] = dataclasses.field(default_factory=list)
    engines: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def format(self) -> str:
        head = f"{self.path}: " + ("OK" if self.ok else f"{len(self.problems)} problem(s)")
        head += f", {len(self.warnings)} engine warning(s)" if self.warnings else ""
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings] + [f"  engines: {e}" for e in self.engines]
        return "\n".join(lines)


def lint(path: str | Path) -> LintReport:
    """Every contract problem of a drafter folder (config.json + safetensors headers), each with its fix."""
    report = LintReport(Path(path))
    if not report.path.is_dir():
        report.problems.append(f"{report.path} is not a folder: pass a drafter folder (config.json + safetensors)")
        return report
    raw = _read_config(report)
    tensors, unread = _read_headers(report)
    fields, skip = _check_config(raw, report) if raw is not None else (None, [])
    if raw is not None:
        engines = review_engines(raw)
        report.warnings += engines.warnings
        report.engines += engines.notes
    if tensors is not None:
        _check_tensors(fields, tensors, unread, skip, report)
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
    found = _weight_files(report)
    if found is None:
        return None, None
    files, weight_map = found
    tensors, unread = _headers(report, files)
    if weight_map is None:
        return tensors, None if unread else set()
    present = set(files) - unread
    wrong = sorted(k for k, (_, _, f) in tensors.items() if weight_map.get(k) != f)
    lost = sorted(k for k, f in weight_map.items() if f in present and k not in tensors)
    if wrong:
        report.problems.append(f"{INDEX} does not map {_names(wrong)} to the shard that holds it: regenerate the index")
    if lost:
        report.problems.append(
            f"{INDEX} lists {_names(lost)} but its shard lacks it: regenerate the index or re-export"
        )
    return tensors, {k for k, f in weight_map.items() if f in unread}


def _weight_files(report: LintReport) -> tuple[list[str], dict[str, str] | None] | None:
    """(the weight files, the index's weight_map, None without an index); None when there are no readable weights."""
    folder, problem = report.path, report.problems.append
    if (folder / INDEX).is_file():
        try:
            weight_map = dict(json.loads((folder / INDEX).read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            problem(f"{INDEX} is unreadable or has no weight_map ({e!r}): regenerate it (re-export)")
            return None
        if (folder / SINGLE).is_file():
            problem(f"both {SINGLE} and {INDEX} exist: engines disagree on which one to load; keep one")
        files = sorted(set(weight_map.values()))
        for extra in sorted({p.name for p in folder.glob("*.safetensors")} - set(files) - {SINGLE}):
            problem(
                f"shard {extra} is missing from {INDEX}: engines never load its tensors; add them to the "
                "weight_map or delete the file"
            )
        return files, weight_map
    if (folder / SINGLE).is_file():
        return [SINGLE], None
    problem(f"no weights: neither {SINGLE} nor {INDEX} in {folder}")
    return None


def _headers(report: LintReport, files: list[str]) -> tuple[Tensors, set[str]]:
    """(name -> (dtype, shape, file) of every tensor in `files`, the files that could not be read)."""
    folder, problem = report.path, report.problems.append
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
    return tensors, unread


# ---------------------------------------------------------------------- config.json
def _check_config(
    raw: dict[str, Any], report: LintReport
) -> tuple[dict[str, int] | None, list[tuple[re.Pattern, str]]]:
    """Report config.json's problems (dflash2.model.contract.review_config); return the fields of the tensor table, with
    stand-ins that change no shape for invalid ones, and the tensor groups those leave unjudged."""
    review = review_config(raw)
    report.problems += [str(p) for p in review.problems]
    report.notes += review.notes
    if MANIFEST_KEY not in raw:
        report.notes.append(f"no {MANIFEST_KEY}: the evaluator cannot check which target this drafter was trained for")
    if review.faulty(*DIMS):
        return None, []
    v = review.values
    bad_conv, bad_selector = review.faulty(*CONV_FIELDS), review.faulty(*SELECTOR_FIELDS)
    bad_ids = review.faulty("target_layer_ids")
    fields = {d: v[d] for d in DIMS if d != "num_target_layers"}
    fields["num_features"] = 1 if bad_ids else len(v["target_layer_ids"])
    if not bad_conv:
        fields |= dict(conv_kernel_size=v["conv_kernel_size"], conv_group_size=v["conv_group_size"])
    if not bad_selector:
        fields["selector_rank"] = v["selector_rank"]
    skip = [(CONV, "conv tensors", bad_conv), (SELECTOR, "selector tensors", bad_selector), (FC, "fc.weight", bad_ids)]
    return fields, [(pattern, what) for pattern, what, faulty in skip if faulty]


# ---------------------------------------------------------------------- tensors


def _names(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _group(name: str) -> str:
    return "conv" if CONV.search(name) else "selector" if SELECTOR.search(name) else "other"


def _check_tensors(
    fields: dict[str, int] | None,
    tensors: Tensors,
    unread: set[str] | None,
    skip: list[tuple[re.Pattern, str]],
    report: LintReport,
) -> None:
    """dtypes, then names and shapes against the contract's table for `fields` (None: dimensions unknown)."""
    _check_dtypes(tensors, report)
    if fields is None:
        report.notes.append("tensor names and shapes not checked: fix the model dimensions in config.json first")
        return
    for _, what in skip:
        report.notes.append(f"{what} not checked: the config fields they depend on are invalid (see above)")

    def judged(name: str) -> bool:
        return not any(p.search(name) for p, _ in skip)

    expected = {k: v for k, v in tensor_table(TensorDims(**fields)).items() if judged(k)}
    found = {k: v[1] for k, v in tensors.items() if judged(k) and not k.startswith(SHARED_TENSORS)}
    # Tensors of an unreadable file were reported with the file; with no index, nothing can be called missing.
    missing = set(expected) - set(found) - unread if unread is not None else set()
    unknown = _check_names(expected, found, missing, report)
    _check_unknown(unknown, fields, report)
    _check_missing(missing, report)
    _check_shapes(expected, found, report)


def _check_dtypes(tensors: Tensors, report: LintReport) -> None:
    """Every tensor bf16, none of the target's shared ones."""
    by_dtype: dict[str, list[str]] = {}
    for name, (dtype, _, _) in sorted(tensors.items()):
        if dtype != "BF16":
            by_dtype.setdefault(dtype, []).append(name)
    for dtype, names in by_dtype.items():
        report.problems.append(
            f"{len(names)} tensor(s) stored as {dtype}, not bf16: {_names(names)}; cast them to bfloat16"
        )
    for name in sorted(n for n in tensors if n.startswith(SHARED_TENSORS)):
        report.problems.append(f"unexpected tensor {name}: the drafter shares the target's embedding and head; drop it")


def _check_names(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], missing: set[str], report: LintReport
) -> dict[str, list[str]]:
    """The found tensors the contract does not name: a misnamed one (a `model.` prefix, a codebook's `.weight`) is
    reported and taken off `missing`; the others are returned by group (conv, selector, other)."""
    problem = report.problems.append
    renamed, unknown = [], {"conv": [], "selector": [], "other": []}
    for name in sorted(set(found) - set(expected)):
        fixed = contract_name(name)
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
    return unknown


def _check_unknown(unknown: dict[str, list[str]], fields: dict[str, int], report: LintReport) -> None:
    off = {"conv": not fields.get("conv_kernel_size"), "selector": not fields.get("selector_rank"), "other": False}
    for group, names in unknown.items():
        if names and off[group]:
            report.problems.append(
                f"unexpected {group} tensor(s) {_names(names)} but the {group} fields are 0: set them in "
                "dflash_config or drop the tensors"
            )
        elif names:
            report.problems.append(
                f"unexpected tensor(s) {_names(names)}: not in the contract for this config and engines "
                "ignore them silently; drop them or fix the config"
            )


def _check_missing(missing: set[str], report: LintReport) -> None:
    lost = {"conv": [], "selector": [], "other": []}
    for name in sorted(missing):
        lost[_group(name)].append(name)
    why = {"conv": "SGLang would load an identity convolution", "selector": "SGLang would load zeros",
           "other": "the drafter cannot load"}  # fmt: skip
    for group, names in lost.items():
        if names:
            report.problems.append(
                f"missing tensor(s) {_names(names)}: {why[group]}; re-export from the training checkpoint"
            )


def _check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], report: LintReport) -> None:
    mismatched = [(k, found[k], v) for k, v in sorted(expected.items()) if k in found and found[k] != v]
    for name, got, want in mismatched[:8]:
        report.problems.append(
            f"tensor {name} has shape {list(got)}, expected {list(want)} from config.json: the weights and "
            "the config disagree; fix the config's dimensions or re-export"
        )
    if len(mismatched) > 8:
        report.problems.append(
            f"{len(mismatched) - 8} more shape mismatches: check hidden_size, heads, head_dim and "
            "intermediate_size in config.json"
        )
