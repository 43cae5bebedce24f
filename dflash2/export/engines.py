"""What SGLang and vLLM make of an export, as contract section 9 records it from their released source.

`review_engines` reads config.json alone (and its `dflash2_manifest`): which engine serves the export, how (the
flags those releases take), and warnings for what they cannot serve or would serve differently from how the drafter
was trained: a conv-only or selector-only DFlash2 shape, `target_layer_ids` out of ascending order or holding the
target's last layer, a target whose architecture an engine captures no layers from. `export.py check` prints them
(`dflash2/export/check.py`), never as problems: the folder meets the contract, and our evaluator serves every shape. The
model card's serving section is written from the same review (`dflash2/export/writer.py: model_card`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from dflash2.model.contract import CONV_FIELDS, SELECTOR_FIELDS, review_config
from dflash2.target.manifest import MANIFEST_KEY, manifest_chat_template_kwargs, target_architectures

SGLANG = "SGLang 0.5.23"
VLLM = "vLLM 0.33.0"
V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER=1"

# Target architectures SGLang 0.5.23 captures DFlash features from: the model classes (by the `architectures` name
# they register) that define or inherit `set_dflash_layers_to_capture`. Without it (Qwen2, Gemma 1-3, Mixtral, ...)
# the server refuses to start a DFlash draft for the target.
SGLANG_CAPTURE = frozenset(
    """
    BeamForCausalLM Cosmos3ForConditionalGeneration DeepseekV2ForCausalLM DeepseekV32ForCausalLM DeepseekV3ForCausalLM
    Gemma4ForCausalLM Gemma4ForConditionalGeneration Gemma4UnifiedForConditionalGeneration Glm4MoeLiteForCausalLM
    Glm5NextForConditionalGeneration GlmMoeDsaForCausalLM GptOssForCausalLM IQuestCoderForCausalLM
    InklingForConditionalGeneration InternLM3ForCausalLM InternS1ProForConditionalGeneration
    InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration KimiK25ForConditionalGeneration
    KimiK3ForConditionalGeneration KimiK3LinearForCausalLM LagunaForCausalLM Lfm2ForCausalLM Lfm2MoeForCausalLM
    Lfm2VlForConditionalGeneration Llama4ForCausalLM LlamaForCausalLM MellumForCausalLM MiMoV2FlashForCausalLM
    MiMoV2ForCausalLM MiniMaxM3SparseForConditionalGeneration Ministral3ForCausalLM MistralForCausalLM
    MistralLarge3ForCausalLM MuseGlimmerForCausalLM MuseGlimmerForConditionalGeneration
    MuseSparkForConditionalGeneration NanbeigeForCausalLM NemotronHForCausalLM NemotronHPuzzleForCausalLM
    Phi3ForCausalLM Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM Qwen3VLForConditionalGeneration
    Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM Qwen3_5ForConditionalGeneration Qwen3_5MoeForCausalLM
    Qwen3_5MoeForConditionalGeneration Qwen4ExpForConditionalGeneration TeleFLMForCausalLM
    """.split()
)
# Target architectures vLLM 0.33.0 captures DFlash features from: those its model registry maps to a class that
# implements `SupportsEagle3` (Qwen2 does; Gemma 1-3 and Mixtral do not).
VLLM_CAPTURE = frozenset(
    """
    AfmoeForCausalLM ApertusForCausalLM Cohere2MoeForCausalLM CohereCompassForConditionalGeneration
    Cosmos3ForConditionalGeneration DeepseekForCausalLM DeepseekV2ForCausalLM DeepseekV3ForCausalLM Ernie4_5ForCausalLM
    Exaone4_5_ForConditionalGeneration Gemma4ForCausalLM Gemma4ForConditionalGeneration
    Gemma4UnifiedForConditionalGeneration GlmMoeDsaForCausalLM GptOssForCausalLM GraniteForCausalLM
    GraniteMoeForCausalLM GraniteMoeSWAForCausalLM GraniteMoeSharedForCausalLM GraniteSWAForCausalLM
    IQuestCoderForCausalLM InternLM3ForCausalLM InternS1ProForConditionalGeneration
    InternS2MobiusForConditionalGeneration InternS2PreviewForConditionalGeneration K2HorizonForCausalLM
    KimiK25ForConditionalGeneration LLaMAForCausalLM LagunaForCausalLM LightOnOCRForConditionalGeneration
    Llama4ForCausalLM Llama4ForConditionalGeneration LlamaForCausalLM LlavaForConditionalGeneration MiMoForCausalLM
    MiMoV2FlashForCausalLM MiMoV2ForCausalLM MiMoV2OmniForCausalLM MiniCPM3ForCausalLM MiniCPMForCausalLM
    MiniCPMOcrForConditionalGeneration MiniCPMV4_6ForConditionalGeneration MiniCPMV4_7ForConditionalGeneration
    MiniMaxM2ForCausalLM Ministral3ForCausalLM Mistral3ForConditionalGeneration MistralForCausalLM
    MistralLarge3ForCausalLM MuseGlimmerForCausalLM MuseGlimmerForConditionalGeneration NemotronHForCausalLM
    NemotronHPuzzleForCausalLM OpenCUAForConditionalGeneration Phi3ForCausalLM PixtralForConditionalGeneration
    Plamo3ForCausalLM Qwen2ForCausalLM Qwen2_5_VLForConditionalGeneration Qwen3ASRForConditionalGeneration
    Qwen3ForCausalLM Qwen3MoeForCausalLM Qwen3NextForCausalLM Qwen3OmniMoeForConditionalGeneration
    Qwen3VLForConditionalGeneration Qwen3VLMoeForConditionalGeneration Qwen3_5ForCausalLM
    Qwen3_5ForConditionalGeneration Qwen3_5MoeForCausalLM Qwen3_5MoeForConditionalGeneration RadioMBartPrefixForCausalLM
    SarvamMLAForCausalLM Step1ForCausalLM TeleChat2ForCausalLM TeleChat3ForCausalLM TeleFLMForCausalLM
    """.split()
)
# The embedded target's architecture (its GGUF dequantizes to a transformers Llama), for drafters whose manifest does
# not record `target_architectures`.
EMBEDDED_ARCHITECTURES = {"HuggingFaceTB/SmolLM2-135M-Instruct": "LlamaForCausalLM"}


@dataclasses.dataclass
class EngineReview:
    """What the engines make of one export: `notes` say how each one serves it, `warnings` what it cannot serve or
    would serve otherwise than the drafter was trained. Empty when config.json is too broken to tell (the linter
    reports why)."""

    notes: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    sglang: bool = False  # SGLang serves the folder's shape (whatever the target)
    vllm: bool = False  # vLLM serves it
    v2_runner: bool = False  # vLLM serves it on its V2 model runner only
    block_size: int | None = None
    target_architecture: str | None = None


def target_architecture(manifest: Mapping[str, Any] | None) -> str | None:
    """The target's architecture as the manifest records it, or for the embedded SmolLM2 (served by its hub id, or
    trained from its dequantized copy) the one it is known to have; None when unknown."""
    recorded = target_architectures(dict(manifest) if manifest else None)
    if recorded:
        return recorded[0]
    if not manifest:
        return None
    from dflash2.target.locate import SMOLLM2_HUB_ID, is_dequantized_smollm2

    loaded = manifest.get("target_path")
    if manifest.get("serve_model") == SMOLLM2_HUB_ID or (loaded and is_dequantized_smollm2(str(loaded))):
        return EMBEDDED_ARCHITECTURES[SMOLLM2_HUB_ID]
    return None


def review_engines(raw: Mapping[str, Any]) -> EngineReview:
    """How SGLang and vLLM read a config.json dict (contract section 9)."""
    out = EngineReview()
    review = review_config(raw)
    fields = ("block_size", "target_layer_ids", "num_target_layers", *CONV_FIELDS, *SELECTOR_FIELDS)
    if review.faulty(*fields):
        return out
    values = review.values
    conv, selector = bool(values["conv_kernel_size"]), bool(values["selector_rank"])
    out.block_size = values["block_size"]
    layer_types = raw.get("layer_types") or []
    mixed = 0 < sum(t == "sliding_attention" for t in layer_types) < len(layer_types)

    # The shape: which engine builds it.
    out.sglang = selector or not conv
    out.vllm = conv == selector
    out.v2_runner = out.vllm and (selector or mixed)
    _shape_warnings(conv, selector, out)
    _layer_warnings(list(values["target_layer_ids"]), values["num_target_layers"], out)
    manifest = raw.get(MANIFEST_KEY) if isinstance(raw.get(MANIFEST_KEY), Mapping) else None
    _target_review(manifest, out)
    kwargs = manifest_chat_template_kwargs(dict(manifest) if manifest else None)
    if kwargs:
        out.notes.append(
            f"training rendered its chats with chat_template_kwargs {json.dumps(kwargs)}: serve with"
            f"{serve_flags(manifest)} (both engines take it) so that requests render alike"
        )
    _serving_notes(selector, out)
    return out


def _shape_warnings(conv: bool, selector: bool, out: EngineReview) -> None:
    """A DFlash2 drafter with one of its two heads: which engine refuses it."""
    if conv and not selector:
        out.warnings.append(
            f"a conv-only DFlash2 drafter: neither {SGLANG} (its DFlash2DraftModel requires the selector) nor {VLLM} "
            "(it builds the conv and the selector from all four fields) loads it; only dflash2's evaluator serves it. "
            "Train with the selector too (draft.selector_rank, draft.selector_top_k) to serve it"
        )
    elif selector and not conv:
        out.warnings.append(
            f"a selector-only DFlash2 drafter: {VLLM} does not load it (it builds the conv from conv fields of 0); "
            f"{SGLANG} serves it. Train with the conv too (draft.conv_kernel_size, draft.conv_group_size) for vLLM"
        )


def _layer_warnings(ids: list[int], depth: int, out: EngineReview) -> None:
    """The target layers: both engines concatenate the captured features in ascending layer order, and capture the
    state after layer id as the input of layer id + 1."""
    if ids != sorted(set(ids)):
        out.warnings.append(
            f"target_layer_ids {ids} are not strictly ascending: {SGLANG} and {VLLM} concatenate the features in "
            "ascending layer order (vLLM sorts and deduplicates them), so fc reads them in another order than it was "
            "trained on; retrain with ascending ids"
        )
    if depth - 1 in ids:
        out.warnings.append(
            f"target_layer_ids include the target's last layer ({depth - 1} of num_target_layers {depth}): {SGLANG} "
            f"never captures it (it captures before layer id + 1), so the features no longer fit fc, and {VLLM} "
            "captures it before the final norm, where training read it after; retrain without it (the default ids "
            "stop at N - 3)"
        )


def _target_review(manifest: Mapping[str, Any] | None, out: EngineReview) -> None:
    """The target: an engine serves a drafter only for a target whose layers it can capture."""
    arch = out.target_architecture = target_architecture(manifest)
    if arch is None:
        out.notes.append(
            f"the target's architecture is not recorded ({MANIFEST_KEY}.target_architectures): check that {SGLANG} "
            "captures DFlash layers from it (Llama and Qwen3 families do; Qwen2 and Gemma 3 do not) and that "
            f"{VLLM} does (its EAGLE-3 capture: Llama, Qwen2, Qwen3 and others)"
        )
        return
    captures = {SGLANG: arch in SGLANG_CAPTURE, VLLM: arch in VLLM_CAPTURE}
    missing = [e for e, ok in captures.items() if not ok]
    if missing:
        able = [e for e, ok in captures.items() if ok]
        out.warnings.append(
            f"target architecture {arch}: {' and '.join(missing)} capture{'s' if len(missing) == 1 else ''} no "
            f"layers from it for DFlash (SGLang: the Llama and Qwen3 families, not Qwen2 or Gemma 3), so "
            f"{'it cannot' if len(missing) == 1 else 'neither can'} serve this drafter with its target"
            + (f"; {able[0]} can" if able else "")
        )
    else:
        known = "" if target_architectures(dict(manifest or {})) else " (the embedded SmolLM2's; not recorded)"
        out.notes.append(f"target architecture {arch}{known}: {SGLANG} and {VLLM} capture its layers")


def _serving_notes(selector: bool, out: EngineReview) -> None:
    """How each engine serves the shape."""
    b, note = out.block_size, out.notes.append
    if out.sglang:
        note(f"{SGLANG} serves it: --speculative-algorithm DFLASH --speculative-num-draft-tokens {b} (the block size)")
    else:
        note(f"{SGLANG} cannot serve it (see the warnings)")
    if out.vllm:
        runner = (
            f"on its V2 model runner only ({V2_RUNNER}: "
            + ("the V1 runner refuses a DFlash2DraftModel" if selector else "drafters mixing sliding and full layers")
            + ")"
            if out.v2_runner
            else "on either model runner"
        )
        note(
            f'{VLLM} serves it {runner}: "method": "dflash", "num_speculative_tokens": {b - 1} (B - 1; vLLM reads '
            "no dflash_config.block_size)"
        )
    else:
        note(f"{VLLM} cannot serve it (see the warnings)")


def serve_flags(manifest: Mapping[str, Any] | None) -> str:
    """The serving flag that renders requests as training rendered the drafter's data (both engines take
    `--default-chat-template-kwargs`), or "" when it recorded none or the empty setting."""
    kwargs = manifest_chat_template_kwargs(dict(manifest) if manifest else None)
    return f" --default-chat-template-kwargs '{json.dumps(kwargs)}'" if kwargs else ""
