"""Where a greedy speculative reply leaves the target alone's, and whether that is rounding or a bug.

At T = 0 both decoders pick the target's argmax at every position, so their replies are the same unless the two
computed a logit differently. They do compute differently: a verify scores a block of tokens in one forward where the
target alone scores one token, and in bf16 the two roundings differ. Where the top two logits lie within the rounding
of the logits' dtype at their scale, either forward may put either one on top: a near-tie, and any reply may leave
the other there without anything being wrong. A divergence where either pass saw a clear margin is not explained by
rounding: a bug until shown otherwise.

Both passes record each output token's margin (top-1 minus top-2 logit) and top-1 logit
(`Sampling.record_margins`, `Generation.margins`), so the margins compared are the ones each pass decided by.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rounding(logit: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values at the magnitude of `logit`: two logits closer than this can round to the
    same value, and a different order of the same sums can swap them."""
    scale = max(abs(logit), torch.finfo(dtype).tiny)
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale))


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two replies differ (the shorter one's length when it is the other's prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def divergences(speculative: list[dict], alone: list[dict], dtype: torch.dtype) -> dict[str, Any]:
    """The replies of the same requests from speculative decoding and the target alone (sample records with
    `output_ids` and `margins`) -> how many differ, how many of those are near-ties (both passes' margins at the first
    differing token within the logits' rounding, `rounding`), and every one that is not."""
    differing, not_ties = 0, []
    for spec, base in zip(speculative, alone, strict=True):
        if spec["output_ids"] == base["output_ids"]:
            continue
        differing += 1
        at = first_difference(spec["output_ids"], base["output_ids"])
        found = at < len(spec["margins"]) and at < len(base["margins"])
        (spec_margin, spec_top), (base_margin, base_top) = (
            (spec["margins"][at], base["margins"][at]) if found else ((math.inf, 0.0), (math.inf, 0.0))
        )
        tolerance = rounding(max(abs(spec_top), abs(base_top)), dtype)
        if not (spec_margin <= tolerance and base_margin <= tolerance):
            not_ties.append(
                {
                    "id": spec.get("id"),
                    "turn": spec.get("turn"),
                    "position": at,
                    "margin_speculative": spec_margin if found else None,
                    "margin_alone": base_margin if found else None,
                    "rounding": tolerance,
                }
            )
    return {
        "replies": len(speculative),
        "differing": differing,
        "near_ties": differing - len(not_ties),
        "not_near_ties": not_ties,
        "dtype": str(dtype).removeprefix("torch."),
    }
