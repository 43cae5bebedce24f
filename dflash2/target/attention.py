"""Grouped-query attention that reads each key/value head once, for the target's decode and verify steps.

With a mask (left padding, a static cache longer than the context), transformers' SDPA path copies every key/value
head once per query head that shares it (`repeat_kv`) before calling the kernel. SmolLM2 has 9 query heads on 3
key/value heads, so a decode step writes 3 copies of the whole KV cache and reads 4 instead of 1. For a short query
(one token, or one verify block) the query heads that share a key/value head can instead be folded into the query
length: head `kv * groups + j`, position `i` becomes row `j * t + i` of key/value head `kv`. The attention is the
same; the cache is read once.

`TargetModel.load` uses it unless `model.attn_implementation` names another; long queries (training, prefill)
go to transformers' own SDPA unchanged. `benchmarks/decode_step.py` times a decode step both ways.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "grouped_sdpa"  # not "...flash...": transformers treats such names as flash attention, with 2D masks
FOLD_MAX_QUERY = 64  # longer queries would multiply the mask by the group count for little gain


def grouped_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [b, h, t, d], key/value [b, h_kv, L, d] -> [b, t, h, d]."""
    b, h, t, d = query.shape
    h_kv = key.shape[1]
    groups = h // h_kv
    # A causal query without a mask needs the kernel's own causal flag, which folding would break.
    needs_causal = attention_mask is None and t > 1
    special = dropout or kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None
    if (
        groups == 1
        or t > FOLD_MAX_QUERY
        or needs_causal
        or special
        or (attention_mask is not None and attention_mask.shape[1] != 1)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    folded = query.reshape(b, h_kv, groups * t, d)
    mask = attention_mask
    if mask is not None:  # [b|1, 1, t, L] -> the same row for each of the `groups` folded heads
        mask = (
            mask[:, :, None]
            .expand(mask.shape[0], 1, groups, t, mask.shape[-1])
            .reshape(mask.shape[0], 1, -1, mask.shape[-1])
        )
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous(), None


def use_grouped_sdpa(model: nn.Module) -> None:
    """Switch a model that runs transformers' SDPA to `grouped_sdpa`; other implementations are left alone."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(NAME, grouped_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the same 4D masks as SDPA
    model.set_attn_implementation(NAME)
