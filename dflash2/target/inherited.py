"""What a drafter inherits from its target, read from the target's transformers config, head and tokenizer: the
DFlash2Config fields (sizes, rope, logit scale and softcap), the dense head its candidate selector scores with, and
the mask token its slots are filled with. `load_target_config` reads the config alone, in a second, before any weight
loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dflash2.target.chat_template import render_chat
from dflash2.target.locate import TargetNotFoundError, target_source

DENSE_HEAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def draft_config_fields(
    c: Any, hidden_size: int | None = None, vocab_size: int | None = None, num_layers: int | None = None
) -> dict[str, Any]:
    """The DFlash2Config fields a drafter inherits from a target's transformers config; the sizes of the loaded
    modules, when given, win over what the config says."""
    hidden_size = hidden_size or c.hidden_size
    rope = getattr(c, "rope_parameters", None)
    theta = (rope or {}).get("rope_theta", getattr(c, "rope_theta", None))
    return {
        "hidden_size": hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        "head_dim": getattr(c, "head_dim", None) or hidden_size // c.num_attention_heads,
        "num_target_layers": num_layers or c.num_hidden_layers,
        "vocab_size": vocab_size or c.vocab_size,
        "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "rope_theta": float(theta) if theta is not None else None,
        "rope_parameters": dict(rope) if rope else None,
        "max_position_embeddings": c.max_position_embeddings,
        "output_multiplier": output_multiplier(c),
        "final_logit_softcapping": getattr(c, "final_logit_softcapping", None),
    }


def load_target_config(model_cfg: Mapping[str, Any]) -> Any:
    """The target's transformers config alone (the `model` group, as TargetModel.load reads it): what a check reads
    in a second, before the weights take seconds to minutes to load."""
    from transformers import AutoConfig

    path, kwargs = target_source(model_cfg.get("path"), model_cfg.get("gguf_file"))
    try:
        config = AutoConfig.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # not JSON, or a model_type this transformers does not know
        raise TargetNotFoundError(
            f"model.path={model_cfg.get('path')!r}: its config.json cannot be read ({str(e).splitlines()[0]}); pass "
            "model.path=/local/dir, a folder with the target's config.json and weights"
        ) from None
    return config.get_text_config()


def dense_head_weight(model: nn.Module, hidden_size: int) -> torch.Tensor:
    """The head as a plain [V, H] float matrix; the selector's raw matmul cannot read anything else."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    found = (
        f"{type(head).__name__} with weight {type(weight).__name__} "
        f"{getattr(weight, 'dtype', None)} {tuple(getattr(weight, 'shape', ()))}"
    )
    dense = (
        type(weight) in (torch.Tensor, nn.Parameter)
        and weight.dtype in DENSE_HEAD_DTYPES
        and weight.dim() == 2
        and weight.shape[1] == hidden_size
    )
    if not dense:
        raise ValueError(
            f"lm_head: found {found}; DFlash needs a dense fp32/bf16/fp16 [vocab, {hidden_size}] "
            f"head, so load the target unquantized (a GGUF file is dequantized, bitsandbytes is not)"
        )
    return weight


def output_multiplier(config: Any) -> float:
    """The target's own logit scale, which the selector's unary scores mirror."""
    if getattr(config, "logit_scale", None):  # Cohere multiplies the logits
        return float(config.logit_scale)
    if getattr(config, "logits_scaling", None):  # Granite divides them
        return 1.0 / float(config.logits_scaling)
    return 1.0


def choose_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """A spare embedding row if there is one, else a special token the chat never produces (never pad/eos)."""
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    reserved = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    rendered = set(tokenizer(render_probe_chat(tokenizer), add_special_tokens=True)["input_ids"]) if template else set()
    for token_id, token in sorted(tokenizer.added_tokens_decoder.items()):
        # A token named in the template source may be emitted for other inputs (tools, thinking): skip it too.
        if token_id in reserved or token_id in rendered or token.content in template or token_id >= vocab_size:
            continue
        return token_id
    raise ValueError(
        "mask_token_id: the target has no spare embedding row and no unused special token; "
        "set model.mask_token_id to an id its chat never produces"
    )


def render_probe_chat(tokenizer: Any) -> str:
    """A multi-turn chat with a system prompt, rendered by the target's template (for token-usage checks)."""
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi, what is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And `x = 3 * 7` in code?"},
    ]
    return render_chat(tokenizer, messages, generation_prompt=True)
