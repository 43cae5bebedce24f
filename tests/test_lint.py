"""The contract linter on synthetic header-only folders: the public DFlash2 layout passes, each fault is named."""

from __future__ import annotations

import copy
import json
import os
import struct
import time
from pathlib import Path

import pytest

from dflash2.export.check import lint

BYTES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8}


def fixture_config(num_hidden_layers: int = 5) -> dict:
    """The public DFlash2 layout at hidden 6656, written by hand from the contract (not by DFlash2Config)."""
    return {
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "is_causal": False,
        "hidden_size": 6656,
        "intermediate_size": 17920,
        "num_attention_heads": 52,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": num_hidden_layers,
        "num_target_layers": 48,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "max_position_embeddings": 40960,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "vocab_size": 202048,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "dflash_config": {
            "block_size": 16,
            "mask_token_id": 202047,
            "target_layer_ids": [1, 12, 23, 34, 45],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 256,
            "selector_top_k": 16,
            "output_multiplier": 1.0,
            "final_logit_softcapping": None,
        },
        "dflash2_manifest": {"target": "some/target-27B", "target_config_hash": "0" * 64},
    }


def fixture_tensors(cfg: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The contract's tensor table (section 3) for `cfg`, written out independently of dflash2.tensor_shapes."""
    d = cfg["dflash_config"]
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    t, g, r, v = d["conv_kernel_size"], h // d["conv_group_size"], d["selector_rank"], cfg["vocab_size"]
    shapes = {"fc.weight": (h, len(d["target_layer_ids"]) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"layers.{n}."
        for name, shape in [
            ("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,)),
            ("self_attn.q_proj.weight", (hq, h)), ("self_attn.k_proj.weight", (hkv, h)),
            ("self_attn.v_proj.weight", (hkv, h)), ("self_attn.o_proj.weight", (h, hq)),
            ("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,)),
            ("mlp.gate_proj.weight", (i, h)), ("mlp.up_proj.weight", (i, h)), ("mlp.down_proj.weight", (h, i)),
            ("attention_conv.base_kernel", (2, t, h)), ("attention_conv.kernel_projection.weight", (2 * t * g, h)),
            ("mlp_conv.base_kernel", (2, t, h)), ("mlp_conv.kernel_projection.weight", (2 * t * g, h)),
        ]:  # fmt: skip
            shapes[p + name] = shape
    shapes |= {
        "candidate_selector.hidden_projection.weight": (r, h),
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
    }
    return {name: ("BF16", shape) for name, shape in shapes.items()}


def write_header_only(file: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors header whose data section is a hole: the file claims its size but uses no disk."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)


def write_folder(folder: Path, cfg: dict, tensors: dict, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        write_header_only(folder / "model.safetensors", tensors)
        return folder
    names, weight_map = list(tensors), {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        write_header_only(folder / file, {k: tensors[k] for k in part})
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _nested(**fields):
    return lambda cfg, tensors: cfg["dflash_config"].update(fields)


def _rename(old, new):
    return lambda cfg, tensors: tensors.__setitem__(new, tensors.pop(old))


def _drop_nested(name):
    return lambda cfg, tensors: cfg["dflash_config"].pop(name)


def _truncate(folder: Path) -> None:
    file = folder / "model.safetensors"
    os.truncate(file, file.stat().st_size - 2)


# (mutation of config/tensors before writing, number of shards, action on the written folder, expected name)
FAULTS = {
    "conv fields unpaired": (_nested(conv_group_size=0), 1, None, "conv_kernel_size/conv_group_size"),
    "selector fields unpaired": (_nested(selector_top_k=0), 1, None, "selector_rank/selector_top_k"),
    "codebook named .weight": (
        _rename("candidate_selector.successor_codebook", "candidate_selector.successor_codebook.weight"),
        1, None, "candidate_selector.successor_codebook.weight",
    ),
    "missing conv tensor": (
        lambda c, t: t.pop("layers.3.mlp_conv.base_kernel"), 1, None, "layers.3.mlp_conv.base_kernel"
    ),
    "missing attention tensor": (
        lambda c, t: t.pop("layers.2.self_attn.k_norm.weight"), 1, None, "layers.2.self_attn.k_norm.weight"
    ),
    "missing selector tensor": (
        lambda c, t: t.pop("candidate_selector.hidden_projection.weight"), 1, None, "hidden_projection"
    ),
    "embed_tokens present": (
        lambda c, t: t.__setitem__("embed_tokens.weight", ("BF16", (202048, 6656))), 1, None, "embed_tokens"
    ),
    "lm_head present": (lambda c, t: t.__setitem__("lm_head.weight", ("BF16", (202048, 6656))), 1, None, "lm_head"),
    "unknown extra tensor": (
        lambda c, t: t.__setitem__("layers.0.self_attn.q_proj.bias", ("BF16", (6656,))), 1, None, "q_proj.bias"
    ),
    "model. prefix": (
        lambda c, t: [t.__setitem__("model." + k, t.pop(k)) for k in list(t)], 1, None, "'model.' prefix"
    ),
    "shape mismatch": (lambda c, t: t.__setitem__("fc.weight", ("BF16", (6656, 4 * 6656))), 1, None, "fc.weight"),
    "codebook rank mismatch": (
        lambda c, t: t.__setitem__("candidate_selector.predecessor_codebook", ("BF16", (202048, 128))),
        1, None, "predecessor_codebook",
    ),
    "target layer out of range": (_nested(target_layer_ids=[1, 12, 23, 34, 48]), 1, None, "target_layer_ids"),
    "target layer ids top-level only": (
        lambda c, t: c.__setitem__("target_layer_ids", c["dflash_config"].pop("target_layer_ids")),
        1, None, "target_layer_ids",
    ),
    "mask id outside vocab": (_nested(mask_token_id=202048), 1, None, "mask_token_id"),
    "mask id missing": (_drop_nested("mask_token_id"), 1, None, "mask_token_id"),
    "top-k not a power of two": (_nested(selector_top_k=12), 1, None, "selector_top_k"),
    "group size does not divide hidden": (_nested(conv_group_size=15), 1, None, "conv_group_size"),
    "tensor dtype not bf16": (lambda c, t: t.__setitem__("norm.weight", ("F32", (6656,))), 1, None, "norm.weight"),
    "config dtype not bf16": (lambda c, t: c.__setitem__("dtype", "float16"), 1, None, "dtype"),
    "block_size < 2": (_nested(block_size=1), 1, None, "block_size"),
    "output_multiplier <= 0": (_nested(output_multiplier=0.0), 1, None, "output_multiplier"),
    "architectures says DFlash": (
        lambda c, t: c.__setitem__("architectures", ["DFlashDraftModel"]), 1, None, "architectures"
    ),
    "no rope settings": (lambda c, t: c.pop("rope_parameters"), 1, None, "rope"),
    "shard file missing": (
        None, 2, lambda f: (f / "model-00002-of-00002.safetensors").unlink(), "model-00002-of-00002.safetensors"
    ),
    "shard missing from the index": (
        None, 2, lambda f: write_header_only(f / "model-00003-of-00003.safetensors", {"x": ("BF16", (2,))}),
        "model-00003-of-00003.safetensors",
    ),
    "truncated weights": (None, 1, _truncate, "model.safetensors"),
}  # fmt: skip


def test_public_fixture_layout_passes(tmp_path):
    cfg = fixture_config()
    for shards in (1, 3):
        report = lint(write_folder(tmp_path / f"s{shards}", cfg, fixture_tensors(cfg), shards))
        assert report.ok, report.format()
        assert report.notes == [], report.format()


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_single_fault_is_caught_by_name(tmp_path, fault):
    mutate, shards, after, name = FAULTS[fault]
    cfg = copy.deepcopy(fixture_config())
    tensors = fixture_tensors(cfg)
    if mutate:
        mutate(cfg, tensors)
    folder = write_folder(tmp_path / "drafter", cfg, tensors, shards)
    if after:
        after(folder)
    report = lint(folder)
    assert not report.ok
    # Exactly one problem per fault: the report stays readable and the fault is the one it names.
    assert len(report.problems) == 1, report.format()
    assert name in report.problems[0], report.format()


def test_every_problem_is_reported_at_once(tmp_path):
    cfg, chosen = fixture_config(), ["mask id outside vocab", "codebook named .weight", "tensor dtype not bf16"]
    tensors = fixture_tensors(cfg)
    for fault in chosen:
        FAULTS[fault][0](cfg, tensors)
    report = lint(write_folder(tmp_path / "drafter", cfg, tensors))
    assert len(report.problems) == len(chosen), report.format()
    for fault in chosen:
        assert any(FAULTS[fault][3] in p for p in report.problems), (fault, report.format())


def test_older_dflash_layout_gives_notes_not_problems(tmp_path):
    cfg = fixture_config()
    tensors = fixture_tensors(cfg)
    for key in ("block_size", "mask_token_id"):
        cfg[key] = cfg["dflash_config"].pop(key)
    del cfg["dflash2_manifest"]
    report = lint(write_folder(tmp_path / "drafter", cfg, tensors))
    assert report.ok, report.format()
    for word in ("block_size", "mask_token_id", "dflash2_manifest"):
        assert any(word in n for n in report.notes), (word, report.format())


def test_published_dflash_layout_passes(tmp_path):
    """A plain DFlash folder as z-lab publishes them: no DFlash2 fields at all, block_size at the top level."""
    cfg = fixture_config()
    cfg["architectures"], cfg["auto_map"] = ["DFlashDraftModel"], {"AutoModel": "dflash.DFlashDraftModel"}
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["block_size"] = cfg["dflash_config"].pop("block_size")
    cfg["dflash_config"] = {k: cfg["dflash_config"][k] for k in ("mask_token_id", "target_layer_ids")}
    del cfg["dflash2_manifest"]
    tensors = {k: v for k, v in fixture_tensors(fixture_config()).items() if "conv" not in k and "selector" not in k}
    report = lint(write_folder(tmp_path / "drafter", cfg, tensors))
    assert report.ok, report.format()
    assert any("block_size" in n for n in report.notes)
    assert not any("mask_token_id" in n for n in report.notes)
    # The same folder still carrying DFlash2 tensors is refused: engines would silently drop them.
    report = lint(write_folder(tmp_path / "with-conv", cfg, fixture_tensors(fixture_config())))
    assert any("conv tensor(s)" in p for p in report.problems) and any("selector" in p for p in report.problems)


def test_missing_folder_is_a_problem_not_a_crash(tmp_path):
    report = lint(tmp_path / "nowhere")
    assert not report.ok and "config.json" in report.format()


def test_instant_on_a_27b_drafter(tmp_path):
    cfg = fixture_config(num_hidden_layers=56)
    tensors = fixture_tensors(cfg)
    folder = write_folder(tmp_path / "big", cfg, tensors, shards=4)
    files = list(folder.glob("*.safetensors"))
    claimed = sum(f.stat().st_size for f in files)
    assert claimed > 50e9  # ~27B bf16 parameters
    assert sum(f.stat().st_blocks * 512 for f in files) < 50e6  # the data sections are holes
    start = time.perf_counter()
    report = lint(folder)
    assert report.ok, report.format()
    assert time.perf_counter() - start < 3.0


@pytest.mark.parametrize("fault", [f for f, (_, shards, after, _) in FAULTS.items() if shards == 1 and after is None])
def test_the_config_raises_the_linters_first_config_problem(tmp_path, fault):
    """One rule book: the linter reports review_config's problems first, and DFlash2Config refuses the same
    config.json with the first of them, word for word; a fault of the tensors alone leaves the config valid."""
    from dflash2.model.config import DFlash2Config
    from dflash2.model.contract import review_config

    cfg = copy.deepcopy(fixture_config())
    tensors = fixture_tensors(cfg)
    FAULTS[fault][0](cfg, tensors)
    report = lint(write_folder(tmp_path / "drafter", cfg, tensors))
    problems = [str(p) for p in review_config(cfg).problems]
    assert report.problems[: len(problems)] == problems
    if not problems:
        assert DFlash2Config.from_dict(cfg).hidden_size == cfg["hidden_size"]
        return
    with pytest.raises(ValueError) as refused:
        DFlash2Config.from_dict(cfg)
    assert str(refused.value) == problems[0]


# --- what SGLang 0.5.23 and vLLM 0.33.0 make of a folder (contract section 9): warnings, never problems ---------


def shaped(tmp_path: Path, conv: bool = True, selector: bool = True, **changes) -> Path:
    """The public fixture with the conv and/or the selector off (and their tensors dropped), `changes` on top (a
    `dflash_config.` prefix reaches into the nested fields)."""
    cfg = fixture_config()
    tensors = fixture_tensors(cfg)
    for on, fields, pattern in ((conv, ("conv_kernel_size", "conv_group_size"), "_conv."),
                                (selector, ("selector_rank", "selector_top_k"), "candidate_selector.")):  # fmt: skip
        if not on:
            cfg["dflash_config"].update(dict.fromkeys(fields, 0))
            tensors = {k: v for k, v in tensors.items() if pattern not in k}
    if not conv and not selector:
        cfg["architectures"] = ["DFlashDraftModel"]
    for key, value in changes.items():
        node, _, leaf = key.rpartition(".")
        (cfg[node] if node else cfg)[leaf] = value
    name = f"{'c' if conv else ''}{'s' if selector else ''}-{len(list(tmp_path.iterdir()))}"
    return write_folder(tmp_path / name, cfg, tensors)


def manifest_with(architecture: str) -> dict:
    return {"target": "some/target", "target_config_hash": "0" * 64, "target_architectures": [architecture]}


def test_the_published_shapes_pass_with_how_each_engine_serves_them(tmp_path):
    report = lint(shaped(tmp_path))  # DFlash2: conv and selector
    assert report.ok and report.notes == [] and report.warnings == [], report.format()
    engines = "\n".join(report.engines)
    assert "SGLang 0.5.23 serves it: --speculative-algorithm DFLASH --speculative-num-draft-tokens 16" in engines
    assert "vLLM 0.33.0 serves it on its V2 model runner only (VLLM_USE_V2_MODEL_RUNNER=1" in engines
    assert '"num_speculative_tokens": 15' in engines and "reads no dflash_config.block_size" in engines
    assert "target's architecture is not recorded" in engines  # the fixture's manifest predates it
    assert report.format().splitlines()[0].endswith(": OK") and "  engines: " in report.format()

    plain = lint(shaped(tmp_path, conv=False, selector=False))  # DFlash: V1 and V2 both serve it
    assert plain.ok and plain.warnings == [], plain.format()
    assert any("vLLM 0.33.0 serves it on either model runner" in e for e in plain.engines)


SG, VL = "SGLang 0.5.23", "vLLM 0.33.0"


@pytest.mark.parametrize(
    "shape, warned, sglang, vllm",
    [
        (dict(conv=True, selector=False), ["a conv-only DFlash2 drafter", SG, VL], False, False),
        (dict(conv=False, selector=True), [f"a selector-only DFlash2 drafter: {VL} does not load it"], True, False),
        ({"dflash_config.target_layer_ids": [45, 34, 23, 12, 1]}, ["are not strictly ascending"], True, True),
        ({"dflash_config.target_layer_ids": [1, 12, 23, 34, 34]}, ["are not strictly ascending"], True, True),
        ({"dflash_config.target_layer_ids": [1, 12, 23, 34, 47]}, ["include the target's last layer (47"], True, True),
        ({"dflash2_manifest": manifest_with("Qwen2ForCausalLM")}, [f"Qwen2ForCausalLM: {SG} captures no", f"{VL} can"],
         True, True),
        ({"dflash2_manifest": manifest_with("Gemma3ForCausalLM")}, [f"Gemma3ForCausalLM: {SG} and {VL} capture no"],
         True, True),
    ],
)  # fmt: skip
def test_what_an_engine_cannot_serve_is_a_warning_not_a_problem(tmp_path, shape, warned, sglang, vllm):
    flags = {k: shape.pop(k) for k in ("conv", "selector") if k in shape}
    report = lint(shaped(tmp_path, **flags, **shape))
    assert report.ok, report.format()  # the folder meets the contract; our evaluator serves it
    assert len(report.warnings) == 1, report.format()
    assert all(w in report.warnings[0] for w in warned), report.format()
    assert report.format().splitlines()[0].endswith("OK, 1 engine warning(s)")
    assert any(("SGLang 0.5.23 serves it" if sglang else "SGLang 0.5.23 cannot serve it") in e for e in report.engines)
    assert any(("vLLM 0.33.0 serves it" if vllm else "vLLM 0.33.0 cannot serve it") in e for e in report.engines)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"])
def test_targets_both_engines_capture_give_no_warning(tmp_path, architecture):
    report = lint(shaped(tmp_path, dflash2_manifest=manifest_with(architecture)))
    assert report.ok and report.warnings == [], report.format()
    assert any(
        f"target architecture {architecture}: SGLang 0.5.23 and vLLM 0.33.0 capture" in e for e in report.engines
    )


def test_the_embedded_targets_architecture_is_known_for_drafters_that_do_not_record_it(tmp_path):
    """SmolLM2 drafters exported before `target_architectures` was recorded: the embedded GGUF dequantizes to the
    architecture `EMBEDDED_ARCHITECTURES` names, and such a drafter is recognised by where it was trained or served."""
    from dflash2.export.engines import EMBEDDED_ARCHITECTURES
    from dflash2.target.locate import SMOLLM2_HUB_ID, smollm2_folder

    config = json.loads((smollm2_folder() / "config.json").read_text())
    assert config["architectures"] == [EMBEDDED_ARCHITECTURES[SMOLLM2_HUB_ID]]
    for manifest in ({"serve_model": SMOLLM2_HUB_ID}, {"target_path": str(smollm2_folder())}):
        report = lint(shaped(tmp_path, dflash2_manifest={"target": "smollm2"} | manifest))
        assert any("LlamaForCausalLM (the embedded SmolLM2's" in e for e in report.engines), report.format()
    report = lint(shaped(tmp_path, dflash2_manifest={"target": "x", "target_path": "/models/some-folder"}))
    assert any("not recorded" in e for e in report.engines) and report.warnings == []
