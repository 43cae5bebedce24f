"""The drafter's training objective (contract section 7) and the counts behind its metrics (section 8).

Everything is computed from one pass of the target head over the proposing slots: cross-entropy, top-1
accuracy and the selector's candidates all come from the same logits, so the full-vocabulary fp32 logits are
materialised once per chunk of slots.

`acc_k` and `tau_sim` score what decoding proposes, teacher-forced: the head's argmax for a DFlash drafter, the
selector's pick given the gold predecessor for a DFlash2 one (its walk, not the argmax, makes the proposal, so an
argmax-based tau_sim would mis-predict the served tau). A DFlash2 drafter's argmax path, i.e. what it proposes
with the selector off, is `tau_sim_top1`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash2.selector import CandidateSelector, head_logits, softcap

IGNORE = -100
# The published decay constants of the slot weights exp(-(k-1)/gamma), as (block size, gamma).
PUBLISHED_GAMMA = ((8, 4.0), (10, 5.0), (16, 7.0))


def loss_gamma(block_size: int) -> float:
    """gamma for a block size: the published points, linear between them, the end segments extended outside.

    Extending the slopes keeps gamma roughly proportional to the number of proposing slots, which is what the
    published points do (about B/2 - 0.5 slots of "attention span"); it never drops below 1.
    """
    points = PUBLISHED_GAMMA
    if block_size <= points[1][0]:
        (b0, g0), (b1, g1) = points[0], points[1]
    else:
        (b0, g0), (b1, g1) = points[-2], points[-1]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Weights [B-1] of the proposing slots k = 1..B-1: exp(-(k-1)/gamma)."""
    gamma = loss_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"loss_gamma is {gamma}; it must be > 0 (or null for the published value)")
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def selector_alpha(step: int, alpha: float, warmup_steps: int = 0, ramp_steps: int = 0) -> float:
    """0 for `warmup_steps`, then a linear ramp over `ramp_steps` to `alpha`."""
    if step < warmup_steps:
        return 0.0
    if ramp_steps <= 0:
        return float(alpha)
    return float(alpha) * min(1.0, (step - warmup_steps + 1) / ramp_steps)


@dataclasses.dataclass
class DraftLosses:
    """The two loss terms (scalars with grad) and the counts the metrics are sums of."""

    ce: torch.Tensor
    selector: torch.Tensor | None
    counts: dict[str, torch.Tensor]


def _head_pass(
    hidden: torch.Tensor, labels: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int, top_k: int
) -> tuple[torch.Tensor, ...]:
    logits = head_logits(hidden, lm_head_weight, vocab_size)
    ce = F.cross_entropy(logits, labels, reduction="none")
    pred = logits.argmax(-1)
    if not top_k:
        return ce, pred
    vals, cand = logits.topk(top_k, dim=-1)
    return ce, pred, vals, cand


def head_pass(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    vocab_size: int,
    top_k: int = 0,
    chunk_rows: int = 0,
) -> tuple[torch.Tensor, ...]:
    """rows [N, H] -> (ce [N], argmax [N], top-K values [N, K], top-K ids [N, K]) from one head matmul.

    With more rows than `chunk_rows` (> 0) the rows go through in chunks whose logits are recomputed in the
    backward pass instead of kept, which bounds memory by one chunk of [chunk_rows, V] logits.
    """
    if chunk_rows <= 0 or hidden.shape[0] <= chunk_rows:
        return _head_pass(hidden, labels, lm_head_weight, vocab_size, top_k)
    parts = [
        checkpoint(_head_pass, h, y, lm_head_weight, vocab_size, top_k, use_reentrant=False)
        for h, y in zip(hidden.split(chunk_rows), labels.split(chunk_rows), strict=True)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


def draft_losses(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    anchor_ids: torch.Tensor,
    lm_head_weight: torch.Tensor,
    vocab_size: int,
    weights: torch.Tensor,
    selector: CandidateSelector | None = None,
    selector_detach: bool = False,
    chunk_rows: int = 0,
) -> DraftLosses:
    """Losses of the proposing slots.

    hidden [b, n, B-1, H]: draft output at slots 1..B-1 of n blocks; labels [b, n, B-1]: slot k's gold is
    the token at anchor + k (IGNORE where it is not trained); anchor_ids [b, n]; weights [B-1].
    """
    slots = labels.shape[-1]
    valid = labels != IGNORE
    # The selector's predecessor of slot k is the true token before it: the anchor, then the previous gold.
    previous = torch.cat([anchor_ids.unsqueeze(-1), labels[..., :-1]], dim=-1)
    slot = torch.arange(slots, device=labels.device).expand_as(labels)

    h, y, k, prev = hidden[valid], labels[valid], slot[valid], previous[valid]
    w = weights.to(h.device)[k]
    top_k = selector.top_k if selector is not None else 0
    out = head_pass(h, y, lm_head_weight, vocab_size, top_k, chunk_rows)
    ce_rows, pred = out[0], out[1]
    w_sum = w.sum()
    ce = (ce_rows * w).sum() / w_sum.clamp_min(1e-6)

    per_slot = torch.zeros(slots, device=h.device)
    counts = {
        "correct": per_slot.index_add(0, k, (pred == y).float()),
        "total": per_slot.index_add(0, k, torch.ones_like(w)),
        "ce_sum": (ce_rows.detach() * w).sum(),
        "weight_sum": w_sum,
    }
    if selector is None:
        return DraftLosses(ce, None, counts)

    vals, cand = out[2], out[3]
    if selector_detach:  # the selector learns on top of the backbone without steering it
        vals, h = vals.detach(), h.detach()
    unary = softcap(vals.float() * selector.output_multiplier, selector.final_logit_softcapping)
    match = cand == y.unsqueeze(-1)
    in_top = match.any(-1)
    gold = match.int().argmax(-1)
    # A slot whose previous gold is not trained has no true predecessor to condition on: it is skipped.
    use = in_top & (prev != IGNORE)
    scores = selector.gold_scores(cand[None], unary[None], h[None], prev.clamp_min(0)[None])[0]
    sel_rows = F.cross_entropy(scores, gold, reduction="none")
    w_use = w * use
    sel = (sel_rows * w_use).sum() / w_use.sum().clamp_min(1e-6)
    picks_gold = scores.argmax(-1) == gold
    # The walk picks gold given the gold prefix; without a trained predecessor the argmax stands in.
    picked = torch.where(prev != IGNORE, picks_gold & in_top, pred == y)
    counts |= {
        "correct_top1": counts["correct"],
        "correct": per_slot.index_add(0, k, picked.float()),
        "topk_hit": in_top.sum().float(),
        "topk_total": torch.tensor(float(y.numel()), device=h.device),
        "selector_hit": (picks_gold & use).sum().float(),
        "selector_total": use.sum().float(),
        "selector_sum": (sel_rows.detach() * w_use).sum(),
        "selector_weight_sum": w_use.sum(),
    }
    return DraftLosses(ce, sel, counts)


def summarise(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """Counts (summed over any number of batches) -> the metrics of contract section 8."""
    total = counts["total"].double()

    def accuracy(correct: torch.Tensor) -> torch.Tensor:
        return torch.where(total > 0, correct.double() / total.clamp_min(1), torch.zeros_like(total))

    acc = accuracy(counts["correct"])
    out = {f"acc_{k + 1}": float(a) for k, a in enumerate(acc)}
    out["tau_sim"] = 1.0 + float(torch.cumprod(acc, 0).sum())
    if "correct_top1" in counts:
        out["tau_sim_top1"] = 1.0 + float(torch.cumprod(accuracy(counts["correct_top1"]), 0).sum())
    out["loss_ce"] = float(counts["ce_sum"] / counts["weight_sum"].clamp_min(1e-6))
    if "topk_hit" in counts:
        out["topk_recall"] = _ratio(counts["topk_hit"], counts["topk_total"])
        out["selector_acc"] = _ratio(counts["selector_hit"], counts["selector_total"])
        out["loss_selector"] = float(counts["selector_sum"] / counts["selector_weight_sum"].clamp_min(1e-6))
    return out


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if float(den) > 0 else math.nan
