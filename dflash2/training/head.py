"""The target head over the trained rows, in one pass: the hard (and with a teacher the soft) cross-entropy of each
row, its argmax and the top-K candidates the selector scores (`HeadOut`). `plain_head` is the reference, over the whole
[N, V] fp32 logits; `fused_head` computes the same in chunks of rows, each chunk's cross-entropy gradient in the
forward, so that the logits never exist whole (dflash2/training/losses.py composes it into the objective).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dflash2.model.selector import head_logits


def head_loss(hard: torch.Tensor, soft: torch.Tensor | None, distill: float) -> torch.Tensor:
    """The head's loss against the slot targets (1 - d) onehot(gold) + d softmax(teacher): (1 - d) CE_hard + d CE_soft
    (dflash2/training/losses.py); the hard CE alone without a teacher. Per row, or of sums and means alike (it is
    linear)."""
    return hard if soft is None else (1 - distill) * hard + distill * soft


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


class _ChunkPlan(NamedTuple):
    """How `_FusedHead` runs `_chunk`: `fused_head`'s settings, and whether a gradient is needed."""

    top_k: int
    chunk_rows: int
    compiled: bool
    grad: bool
    distill: float


@functools.cache
def _compiled_chunk():
    return torch.compile(_chunk, dynamic=True)


class _FusedHead(torch.autograd.Function):
    """`plain_head` chunk by chunk, never holding more than one chunk of logits: the CE's gradient is computed in the
    forward pass (it is known there, as the loss is a fixed weighted sum), so the backward only scales it and adds
    the top-K values' part, whose logits are rows of the head (W[cand]). A teacher's logits exist one chunk at a
    time too: never as an [N, V] tensor."""

    @staticmethod
    def forward(ctx, hidden, labels, weight, teacher, plan: _ChunkPlan):
        run = _compiled_chunk() if plan.compiled else _chunk
        chunks = len(labels.split(plan.chunk_rows))
        teachers = teacher.split(plan.chunk_rows) if teacher is not None else [None] * chunks
        with torch.no_grad():
            parts = [
                run(h, y, weight, plan.top_k, plan.grad, t, plan.distill)
                for h, y, t in zip(hidden.split(plan.chunk_rows), labels.split(plan.chunk_rows), teachers, strict=True)
            ]
        ce, soft, pred, vals, cand, grad_hidden = (
            torch.cat(p) if p[0] is not None else None for p in zip(*parts, strict=True)
        )
        ctx.save_for_backward(grad_hidden, cand, weight)
        ctx.hidden_dtype, ctx.chunk_rows = hidden.dtype, plan.chunk_rows
        ctx.mark_non_differentiable(*(t for t in (ce, soft, pred, cand if plan.top_k else None) if t is not None))
        # A tensor of its own: `ce` is marked non-differentiable, the rows carry the gradient.
        rows = ce.clone() if soft is None else head_loss(ce, soft, plan.distill)
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
        return grad.to(ctx.hidden_dtype), *[None] * 4


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
    plan = _ChunkPlan(top_k, chunk_rows, compiled, grad, float(distill))
    rows, ce, soft, pred, vals, cand = _FusedHead.apply(hidden, labels, lm_head_weight, teacher, plan)
    return HeadOut(rows, ce, pred, vals, cand, soft)
