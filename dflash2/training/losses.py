"""The drafter's training objective (contract section 7) and the counts behind its metrics (section 8).

Everything is computed from one pass of the target head over the proposing slots: cross-entropy, top-1
accuracy and the selector's candidates all come from the same logits, so the full-vocabulary fp32 logits are
materialised once per chunk of slots.

Soft-label distillation (`distill` d > 0) trains slot k of the block at anchor a towards
t = (1 - d) onehot(gold) + d softmax(target logits at a + k - 1), the target's own distribution of the token at
a + k: the head's loss is then sum_v -t_v log p_v = (1 - d) CE_hard + d CE_soft. The teacher logits are the same
frozen head applied to the target's final hidden state there, computed chunk by chunk beside the drafter's.

Position weights. Each trained slot's loss is weighted, and the weights normalised to sum to 1 over the batch:
- `decay` (the published recipe): w_k = exp(-(k-1)/gamma), fixed.
- `dpace` (D-PACE, arXiv 2605.18810): from the drafter's own confidence q_k = exp(-CE_k) on each slot's gold,
  smoothed to q~_k = alpha + (1 - alpha) q_k, a slot weighs w_k = sum_{m >= k} prod_{j <= m} q~_j: the chance that
  decoding reaches slot k times the length it can still add, a surrogate of the expected accepted length that moves
  the training signal to the slots that currently limit acceptance. The weights are detached: they reshape the credit,
  never add a gradient. A slot that is not trained neither counts in the products nor gets a weight.
Either weighting can be raised on the late slots: `objective.late_slot_weight` m multiplies the weight of every slot
k >= `objective.late_slot_start` (off at m = 1). Both weightings give those slots the least credit, yet a block that
continues a repeat of its context is accepted in full only if they are right.
The metrics' `loss_ce` and `loss_selector` always use the `decay` weights, so that runs with other weightings compare.

`acc_k` and `tau_sim` score what decoding proposes, teacher-forced: the head's argmax for a DFlash drafter, the
selector's pick given the gold predecessor for a DFlash2 one (its walk, not the argmax, makes the proposal, so an
argmax-based tau_sim would mis-predict the served tau). A DFlash2 drafter's argmax path, i.e. what it proposes
with the selector off, is `tau_sim_top1`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash2.data.anchors import IGNORE
from dflash2.model.selector import CandidateSelector, head_logits

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


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [..., S] of the S proposing slots of each block (module docstring), from the drafter's confidence
    [..., S] on each slot's gold and which slots are trained; 0 where a slot is not trained. Detached."""
    if not 0 < alpha <= 1:
        raise ValueError(f"objective.dpace_alpha={alpha}: it must be in (0, 1] (0 lets the products vanish)")
    with torch.no_grad():
        smoothed = torch.where(valid, alpha + (1 - alpha) * confidence.float(), torch.ones_like(confidence.float()))
        reach = torch.cumprod(smoothed, -1) * valid  # prod_{j <= m} q~_j, the slots that are trained
        return reach.flip(-1).cumsum(-1).flip(-1) * valid  # sum over m >= k


def selector_alpha(step: int, alpha: float, warmup_steps: int = 0, ramp_steps: int = 0) -> float:
    """0 for `warmup_steps`, then a linear ramp over `ramp_steps` to `alpha`."""
    if step < warmup_steps:
        return 0.0
    if ramp_steps <= 0:
        return float(alpha)
    return float(alpha) * min(1.0, (step - warmup_steps + 1) / ramp_steps)


def head_loss(hard: torch.Tensor, soft: torch.Tensor | None, distill: float) -> torch.Tensor:
    """The head's loss against the slot targets (1 - d) onehot(gold) + d softmax(teacher): (1 - d) CE_hard + d CE_soft
    (module docstring); the hard CE alone without a teacher. Per row, or of sums and means alike (it is linear)."""
    return hard if soft is None else (1 - distill) * hard + distill * soft


def total_loss(head: torch.Tensor, selector: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """What training minimises: the head's loss plus `alpha` (`selector_alpha`, ramped) times the selector's."""
    return head if selector is None else head + alpha * selector


@dataclasses.dataclass
class DraftLosses:
    """The two loss terms (scalars with grad) and the counts the metrics are sums of. `ce` is the cross-entropy
    against the slots' targets: the gold tokens, mixed with the target's distributions under distillation."""

    ce: torch.Tensor
    selector: torch.Tensor | None
    counts: dict[str, torch.Tensor]


@dataclasses.dataclass
class HeadOut:
    """One pass of the target head over the trained rows: each row's loss (with grad; the caller weights them), the
    per-row hard-label CE (detached), the argmax, with a teacher the per-row soft CE (detached), and, with a selector,
    the top-K logits (with grad) and their ids."""

    rows: torch.Tensor
    ce_rows: torch.Tensor
    pred: torch.Tensor
    vals: torch.Tensor | None = None
    cand: torch.Tensor | None = None
    soft_rows: torch.Tensor | None = None


def plain_head(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    top_k: int,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
) -> HeadOut:
    """The reference: the whole [N, V] fp32 logits at once (and the teacher's, from its hidden rows [N, H]),
    autograd through them."""
    logits = head_logits(hidden, lm_head_weight, lm_head_weight.shape[0])
    ce_rows = F.cross_entropy(logits, labels, reduction="none")
    rows, soft_rows = ce_rows, None
    if teacher is not None:
        target = torch.softmax(head_logits(teacher, lm_head_weight, lm_head_weight.shape[0]), -1)
        soft_rows = -(target * torch.log_softmax(logits, -1)).sum(-1)
        rows = head_loss(ce_rows, soft_rows, distill)
        soft_rows = soft_rows.detach()
    out = HeadOut(rows, ce_rows.detach(), logits.argmax(-1), soft_rows=soft_rows)
    if top_k:
        out.vals, out.cand = logits.topk(top_k, dim=-1)
    return out


def grouped_topk(scores: torch.Tensor, k: int, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores.topk(k, -1)` of [N, V] scores, without a radix select over the whole vocabulary: the maximum of each
    run of `group` entries, the k groups with the largest maxima, then the top-k of their k * group entries.

    Exact in values and their order: if an entry y among a row's k largest lay in a group left out, each of the k
    chosen groups would have a maximum >= y, so the candidates would already hold k entries >= y. Among tied values
    the indices may differ from topk's, which leaves ties unordered too."""
    n, v = scores.shape
    pad = -v % group
    padded = F.pad(scores, (0, pad), value=float("-inf")) if pad else scores
    groups = padded.view(n, padded.shape[1] // group, group)  # not -1: a batch may train no rows (a padding row's)
    # In vocabulary order, so that ties among the candidates meet topk in the order they have in the row.
    chosen = groups.amax(-1).topk(min(k, groups.shape[1]), -1).indices.sort(-1).values  # [N, k]
    candidates = groups.gather(1, chosen[..., None].expand(-1, -1, group)).flatten(1)
    vals, at = candidates.topk(k, -1)
    return vals, chosen.gather(1, at // group) * group + at % group


def _chunk(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    grad: bool,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
) -> tuple[torch.Tensor | None, ...]:
    """One chunk of rows: what `plain_head` computes from its logits, plus each row's d loss_i / d hidden_i."""
    scores = hidden.to(weight.dtype) @ weight.T  # in the head's dtype: `logits` is its exact upcast
    logits = scores.float()
    lse = torch.logsumexp(logits, -1)
    ce = lse - logits.gather(-1, labels[:, None]).squeeze(-1)
    soft = target = None
    if teacher is not None:  # -sum_v q_v log p_v = lse - sum_v q_v logits_v, as the q_v sum to 1
        target = torch.softmax((teacher.to(weight.dtype) @ weight.T).float(), -1)
        soft = lse - (target * logits).sum(-1)
    pred = logits.argmax(-1)
    vals = cand = None
    if top_k:  # the same values as the fp32 logits' top-K, from half the bytes; compiled, no fp32 logits are written
        vals, cand = grouped_topk(scores, top_k)
        vals = vals.float()
    grad_hidden = None
    if grad:  # d loss / d logits = softmax - t, t = (1-d) onehot(label) + d q, back through the head
        grad_logits = torch.exp(logits - lse[:, None])
        if target is not None:
            grad_logits.sub_(target, alpha=distill)
        # A comparison, not a scatter: compiled, the gradient is then one pass that writes it in the head's dtype.
        is_label = torch.arange(logits.shape[-1], device=logits.device) == labels[:, None]
        grad_logits = torch.where(is_label, grad_logits - (1.0 - distill), grad_logits)
        # Unweighted: the row weights may depend on every row's loss (D-PACE), so they are applied in the backward.
        grad_hidden = grad_logits.to(weight.dtype) @ weight
    return ce, soft, pred, vals, cand, grad_hidden


@functools.cache
def _compiled_chunk():
    return torch.compile(_chunk, dynamic=True)


class _FusedHead(torch.autograd.Function):
    """`plain_head` chunk by chunk, never holding more than one chunk of logits: the CE's gradient is computed in the
    forward pass (it is known there, as the loss is a fixed weighted sum), so the backward only scales it and adds
    the top-K values' part, whose logits are rows of the head (W[cand]). A teacher's logits exist one chunk at a
    time too: never as an [N, V] tensor."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, top_k, chunk_rows, compiled, grad, teacher, distill):
        run = _compiled_chunk() if compiled else _chunk
        chunks = len(labels.split(chunk_rows))
        teachers = teacher.split(chunk_rows) if teacher is not None else [None] * chunks
        with torch.no_grad():
            parts = [
                run(h, y, weight, top_k, grad, t, distill)
                for h, y, t in zip(hidden.split(chunk_rows), labels.split(chunk_rows), teachers, strict=True)
            ]
        ce, soft, pred, vals, cand, grad_hidden = (
            torch.cat(p) if p[0] is not None else None for p in zip(*parts, strict=True)
        )
        ctx.save_for_backward(grad_hidden, cand, weight)
        ctx.hidden_dtype, ctx.chunk_rows = hidden.dtype, chunk_rows
        ctx.mark_non_differentiable(*(t for t in (ce, soft, pred, cand if top_k else None) if t is not None))
        # A tensor of its own: `ce` is marked non-differentiable, the rows carry the gradient.
        rows = ce.clone() if soft is None else head_loss(ce, soft, distill)
        return rows, ce, soft, pred, vals, cand

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows, _ce, _soft, _pred, grad_vals, _cand):
        grad_hidden, cand, weight = ctx.saved_tensors
        grad = grad_hidden.float() * grad_rows[:, None]
        if grad_vals is not None:  # d vals[i, k] / d hidden[i] = W[cand[i, k]], gathered a chunk at a time
            for rows in torch.arange(len(cand), device=cand.device).split(ctx.chunk_rows):
                g = grad_vals[rows].to(weight.dtype)
                grad[rows] += torch.einsum("nk,nkh->nh", g, weight[cand[rows]]).float()
        return grad.to(ctx.hidden_dtype), *[None] * 8


def fused_head(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    lm_head_weight: torch.Tensor,
    top_k: int,
    chunk_rows: int = 0,
    compiled: bool = False,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
) -> HeadOut:
    """What `plain_head` returns, in chunks of `chunk_rows` rows (0: as many as 1 GiB of fp32 logits holds)."""
    if chunk_rows <= 0:
        chunk_rows = max(1, 2**30 // (4 * lm_head_weight.shape[0]))
    grad = hidden.requires_grad and torch.is_grad_enabled()  # Function.forward itself runs without grad
    rows, ce, soft, pred, vals, cand = _FusedHead.apply(
        hidden, labels, lm_head_weight, top_k, chunk_rows, compiled, grad, teacher, float(distill)
    )
    return HeadOut(rows, ce, pred, vals, cand, soft)


def block_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The labels `draft_losses` trains on: the batch's, IGNORE in every slot of a padding block."""
    return batch["labels"].masked_fill(~batch["anchor_valid"].bool().unsqueeze(-1), IGNORE)


def trained_slots(batch: dict[str, torch.Tensor]) -> int:
    """How many of `block_targets` are not IGNORE (`draft_losses`' `trained`), read where the batch is: on the host
    before it moves to the device, this costs no device sync."""
    return int((block_targets(batch) != IGNORE).sum())


def draft_losses(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    anchor_ids: torch.Tensor,
    lm_head_weight: torch.Tensor,
    vocab_size: int,
    weights: torch.Tensor,
    selector: CandidateSelector | None = None,
    selector_detach: bool = False,
    fused: bool = True,
    chunk_rows: int = 0,
    compiled: bool = False,
    teacher: torch.Tensor | None = None,
    distill: float = 0.0,
    trained: int | None = None,
    dpace_alpha: float | None = None,
    rank_mean: Callable[[torch.Tensor], torch.Tensor] | None = None,
    slot_scale: torch.Tensor | None = None,
) -> DraftLosses:
    """Losses of the proposing slots.

    hidden [b, n, B-1, H]: draft output at slots 1..B-1 of n blocks; labels [b, n, B-1]: slot k's gold is
    the token at anchor + k (IGNORE where it is not trained); anchor_ids [b, n]; weights [B-1]. `fused` runs the
    head through `fused_head` (chunks of `chunk_rows`, `compiled` by torch.compile), else through `plain_head`.
    teacher [b, n, B-1, H]: the target's final hidden state at anchor + k - 1 for slot k, whose softmax under the
    head is mixed into slot k's target with weight `distill` (module docstring). `trained`: the count of labels
    that are not IGNORE, when the caller knows it without reading the device (`trained_slots` of the batch on the
    host); the trained rows are then gathered without the device sync of a boolean index. `dpace_alpha`: train with
    the D-PACE weights of that smoothing instead of `weights` (module docstring); the metrics keep `weights`.
    `slot_scale` [B-1]: factors on each slot's training weight, after D-PACE's (`Objective.slot_scale`: the late
    slots'); the metrics keep `weights` here too.
    `rank_mean`: under data parallelism, the mean over the ranks of a tensor (an all-reduce). Each loss is then this
    rank's share of the global batch's weighted mean: its rows' weighted sum over the ranks' mean sum of weights, so
    that the mean over the ranks of the losses, and of their gradients (what DDP averages), is the global batch's,
    as one process computes it; a loss over the rank's own weights would weigh the ranks' rows unequally.
    """
    if distill > 0 and teacher is None:
        raise ValueError(f"distill={distill} needs the teacher: the target's final hidden states of the slots")
    slots = labels.shape[-1]
    valid = labels != IGNORE
    # The selector's predecessor of slot k is the true token before it: the anchor, then the previous gold.
    previous = torch.cat([anchor_ids.unsqueeze(-1), labels[..., :-1]], dim=-1)
    slot = torch.arange(slots, device=labels.device).expand_as(labels)

    if trained is None:
        at = valid.flatten().nonzero().squeeze(-1)
    else:  # the same rows in the same order: the trained ones sort first, stably, and their count is known
        at = torch.argsort((~valid).flatten().to(torch.int8), stable=True)[:trained]
    y, k, prev = (x.flatten()[at] for x in (labels, slot, previous))
    h = hidden.flatten(0, 2)[at]
    t = teacher.flatten(0, 2)[at] if teacher is not None else None
    w = weights.to(h.device)[k]
    top_k = selector.top_k if selector is not None else 0
    w_sum = w.sum()
    head = (h, y, lm_head_weight[:vocab_size], top_k)  # rows past the vocab are padding
    out = fused_head(*head, chunk_rows, compiled, t, distill) if fused else plain_head(*head, t, distill)
    ce_rows, pred = out.ce_rows, out.pred
    w_train = w
    if dpace_alpha is not None:  # on the block grid, where a slot's weight depends on the slots before and after it
        confidence = torch.ones(labels.numel(), device=h.device).index_put((at,), torch.exp(-ce_rows))
        w_train = dpace_weights(confidence.view_as(labels), valid, dpace_alpha).flatten()[at]
    if slot_scale is not None:
        w_train = w_train * slot_scale.to(h.device)[k]
    ce = (out.rows * w_train).sum() / _global(w_train.sum(), rank_mean)

    per_slot = torch.zeros(slots, device=h.device)
    counts = {
        "correct": per_slot.index_add(0, k, (pred == y).float()),
        "total": per_slot.index_add(0, k, torch.ones_like(w)),
        "ce_sum": (ce_rows * w).sum(),
        "weight_sum": w_sum,
    }
    if out.soft_rows is not None:
        counts["distill_sum"] = (out.soft_rows * w).sum()
    if selector is None:
        return DraftLosses(ce, None, counts)

    vals, cand = out.vals, out.cand
    if selector_detach:  # the selector learns on top of the backbone without steering it
        vals, h = vals.detach(), h.detach()
    unary = selector.unary(vals)
    match = cand == y.unsqueeze(-1)
    in_top = match.any(-1)
    gold = match.int().argmax(-1)
    # A slot whose previous gold is not trained has no true predecessor to condition on: it is skipped.
    use = in_top & (prev != IGNORE)
    scores = selector.gold_scores(cand[None], unary[None], h[None], prev.clamp_min(0)[None])[0]
    sel_rows = F.cross_entropy(scores, gold, reduction="none")
    w_use = w * use
    sel = (sel_rows * w_train * use).sum() / _global((w_train * use).sum(), rank_mean)
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


def _global(weight_sum: torch.Tensor, rank_mean: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """A loss's denominator: the sum of its (detached) weights, or under data parallelism their mean over ranks."""
    return (weight_sum.detach() if rank_mean is None else rank_mean(weight_sum.detach())).clamp_min(1e-6)


def metric_tensors(counts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Counts (summed over any number of batches) -> the metrics of contract section 8, as 0-d tensors on the counts'
    device (reading them is a device sync: the training step logs them as they are)."""
    total = counts["total"].double()

    def accuracy(correct: torch.Tensor) -> torch.Tensor:
        return torch.where(total > 0, correct.double() / total.clamp_min(1), torch.zeros_like(total))

    acc = accuracy(counts["correct"])
    out = {f"acc_{k + 1}": a for k, a in enumerate(acc.unbind())}
    out["tau_sim"] = 1.0 + torch.cumprod(acc, 0).sum()
    if "correct_top1" in counts:
        out["tau_sim_top1"] = 1.0 + torch.cumprod(accuracy(counts["correct_top1"]), 0).sum()
    out["loss_ce"] = counts["ce_sum"].double() / counts["weight_sum"].double().clamp_min(1e-6)
    if "distill_sum" in counts:
        out["loss_distill"] = counts["distill_sum"].double() / counts["weight_sum"].double().clamp_min(1e-6)
    if "topk_hit" in counts:
        out["topk_recall"] = _ratio(counts["topk_hit"], counts["topk_total"])
        out["selector_acc"] = _ratio(counts["selector_hit"], counts["selector_total"])
        out["loss_selector"] = counts["selector_sum"].double() / counts["selector_weight_sum"].double().clamp_min(1e-6)
    return out


def summarise(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """`metric_tensors` as Python floats."""
    return {k: float(v) for k, v in metric_tensors(counts).items()}


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, NaN when den is 0 (no such rows in the batch)."""
    den = den.double()
    return torch.where(den > 0, num.double() / den.clamp_min(1e-12), torch.full_like(den, math.nan))
