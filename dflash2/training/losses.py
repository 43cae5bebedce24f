"""The drafter's training objective (contract section 7) and the counts behind its metrics (section 8).

Everything is computed from one pass of the target head over the proposing slots: cross-entropy, top-1
accuracy and the selector's candidates all come from the same logits, so the full-vocabulary fp32 logits are
materialized once per chunk of slots. `SlotLoss` composes the parts: the labels (`trained_rows`), the
head's cross-entropy (`dflash2.training.head`), the weights (`SlotLoss.training_weights`), the selector's loss
(`selector_pass`) and the counts behind the metrics (`head_counts`, `selector_counts`).

Soft-label distillation (`distill` d > 0) trains slot k of the block at anchor a towards
t = (1 - d) onehot(gold) + d softmax(target logits at a + k - 1), the target's own distribution of the token at
a + k: the head's loss is then sum_v -t_v log p_v = (1 - d) CE_hard + d CE_soft. The teacher logits are the same
frozen head applied to the target's final hidden state there, computed chunk by chunk beside the drafter's.

Position weights. Each trained slot's loss is weighted, and the weights normalized to sum to 1 over the batch:
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
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from dflash2.data.anchors import IGNORE
from dflash2.model.selector import CandidateSelector
from dflash2.training.head import HeadOut, fused_head, plain_head

# Under data parallelism, the mean over the ranks of a tensor (an all-reduce); None in one process.
RankMean = Callable[[torch.Tensor], torch.Tensor] | None
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


def block_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The labels `SlotLoss` trains on: the batch's, IGNORE in every slot of a padding block."""
    return batch["labels"].masked_fill(~batch["anchor_valid"].bool().unsqueeze(-1), IGNORE)


def trained_slots(batch: dict[str, torch.Tensor]) -> int:
    """How many of `block_targets` are not IGNORE (`DraftSlots.trained`), read where the batch is: on the host
    before it moves to the device, this costs no device sync."""
    return int((block_targets(batch) != IGNORE).sum())


@dataclasses.dataclass(frozen=True)
class DraftSlots:
    """One teacher-forced pass of the drafter over a batch's blocks: what it proposed at each block's proposing slots,
    and what each slot should propose. `SlotLoss`'s input, built by `DFlash2Module.draft_step`."""

    hidden: torch.Tensor  # [b, n, B-1, H]: the draft output at slots 1..B-1 of n blocks
    labels: torch.Tensor  # [b, n, B-1]: slot k's gold, the token at anchor + k (IGNORE where it is not trained)
    anchor_ids: torch.Tensor  # [b, n]
    # [b, n, B-1, H]: the target's final hidden state at anchor + k - 1 for slot k, whose softmax under the head is
    # mixed into slot k's target with weight `SlotLoss.distill` (module docstring)
    teacher: torch.Tensor | None = None
    # How many labels are not IGNORE, when the caller knows it without reading the device (`trained_slots` of the
    # batch on the host): the trained rows are then gathered without the device sync of a boolean index.
    trained: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainedRows:
    """The trained slots of a batch, one row each, in the order of the flattened [b, n, B-1] grid."""

    at: torch.Tensor  # where each row sits in the flattened grid
    gold: torch.Tensor  # the token the slot should propose
    slot: torch.Tensor  # the slot's index k - 1 in its block
    previous: torch.Tensor  # the selector's predecessor: the true token before the slot (IGNORE if not trained)
    hidden: torch.Tensor  # [N, H] the drafter's
    teacher: torch.Tensor | None  # [N, H] the target's, when distilling


def trained_rows(slots: DraftSlots) -> TrainedRows:
    """The labels: the slots that are trained, gathered out of the block grid with their gold and predecessor."""
    labels = slots.labels
    valid = labels != IGNORE
    # The selector's predecessor of slot k is the true token before it: the anchor, then the previous gold.
    previous = torch.cat([slots.anchor_ids.unsqueeze(-1), labels[..., :-1]], dim=-1)
    slot = torch.arange(labels.shape[-1], device=labels.device).expand_as(labels)
    if slots.trained is None:
        at = valid.flatten().nonzero().squeeze(-1)
    else:  # the same rows in the same order: the trained ones sort first, stably, and their count is known
        at = torch.argsort((~valid).flatten().to(torch.int8), stable=True)[: slots.trained]
    gold, slot, previous = (x.flatten()[at] for x in (labels, slot, previous))
    teacher = slots.teacher.flatten(0, 2)[at] if slots.teacher is not None else None
    return TrainedRows(at, gold, slot, previous, slots.hidden.flatten(0, 2)[at], teacher)


def weighted_mean(values: torch.Tensor, weights: torch.Tensor, rank_mean: RankMean) -> torch.Tensor:
    """sum_i w_i x_i over the sum of the (detached) weights; under data parallelism over the ranks' mean of that sum:
    this rank's share of the global batch's weighted mean (`SlotLoss.forward`)."""
    total = weights.sum().detach()
    return (values * weights).sum() / (total if rank_mean is None else rank_mean(total)).clamp_min(1e-6)


@dataclasses.dataclass(frozen=True)
class SelectorPass:
    """The selector's scores of the trained rows' candidates given each gold predecessor, and what they get right."""

    loss: torch.Tensor  # the weighted mean of `rows` over the rows it trains (`use`), with grad
    rows: torch.Tensor  # each row's cross-entropy of the gold among the candidates
    use: torch.Tensor  # the rows that train the selector: gold among the candidates and a true predecessor
    in_top: torch.Tensor  # gold among the candidates
    picks_gold: torch.Tensor  # the selector's argmax is the gold


def selector_pass(
    selector: CandidateSelector,
    rows: TrainedRows,
    head: HeadOut,
    weights: torch.Tensor,
    detach: bool,
    rank_mean: RankMean,
) -> SelectorPass:
    """The selector loss: the cross-entropy of each row's gold among the head's top-K, given the gold predecessor,
    weighted by the rows' training `weights` (`detach`: the selector learns on top of the backbone without steering
    it)."""
    vals, hidden = (head.vals.detach(), rows.hidden.detach()) if detach else (head.vals, rows.hidden)
    unary = selector.unary(vals)
    match = head.cand == rows.gold.unsqueeze(-1)
    in_top = match.any(-1)
    gold = match.int().argmax(-1)
    # A slot whose previous gold is not trained has no true predecessor to condition on: it is skipped.
    use = in_top & (rows.previous != IGNORE)
    scores = selector.gold_scores(head.cand[None], unary[None], hidden[None], rows.previous.clamp_min(0)[None])[0]
    ce_rows = F.cross_entropy(scores, gold, reduction="none")
    loss = weighted_mean(ce_rows, weights * use, rank_mean)
    return SelectorPass(loss, ce_rows, use, in_top, scores.argmax(-1) == gold)


def head_counts(rows: TrainedRows, head: HeadOut, weights: torch.Tensor, slots: int) -> dict[str, torch.Tensor]:
    """The head's metrics (section 8) as sums: per slot its argmax's hits and its rows, the `weights`' CE sum."""
    per_slot = torch.zeros(slots, device=rows.hidden.device)
    counts = {
        "correct": per_slot.index_add(0, rows.slot, (head.pred == rows.gold).float()),
        "total": per_slot.index_add(0, rows.slot, torch.ones_like(weights)),
        "ce_sum": (head.ce_rows * weights).sum(),
        "weight_sum": weights.sum(),
    }
    if head.soft_rows is not None:
        counts["distill_sum"] = (head.soft_rows * weights).sum()
    return counts


def selector_counts(
    rows: TrainedRows, head: HeadOut, sel: SelectorPass, weights: torch.Tensor, argmax_hits: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The selector's metrics as sums. A slot is `correct` when the walk picks its gold given the gold prefix, and
    `correct_top1` (`argmax_hits`) when the head's argmax is it."""
    # The walk picks gold given the gold prefix; without a trained predecessor the argmax stands in.
    picked = torch.where(rows.previous != IGNORE, sel.picks_gold & sel.in_top, head.pred == rows.gold)
    w_use = weights * sel.use
    return {
        "correct_top1": argmax_hits,
        "correct": torch.zeros_like(argmax_hits).index_add(0, rows.slot, picked.float()),
        "topk_hit": sel.in_top.sum().float(),
        "topk_total": torch.tensor(float(rows.gold.numel()), device=rows.hidden.device),
        "selector_hit": (sel.picks_gold & sel.use).sum().float(),
        "selector_total": sel.use.sum().float(),
        "selector_sum": (sel.rows.detach() * w_use).sum(),
        "selector_weight_sum": w_use.sum(),
    }


class SlotLoss(torch.nn.Module):
    """The drafter's training objective (module docstring), built once from the objective config group
    (`Objective.slot_loss`). A module, as torch.nn's weighted losses are: its slot weights are buffers, so they move
    with the LightningModule to its device, and no step copies them there.

    `weights` [B-1]: the decay weights, the metrics' always. `dpace_alpha`: train with the D-PACE weights of that
    smoothing instead. `scale` [B-1]: factors on each slot's training weight, after D-PACE's (`Objective.slot_scale`:
    the late slots'). `fused` runs the head through `fused_head` (chunks of `chunk_rows`), else through `plain_head`.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        scale: torch.Tensor | None = None,
        dpace_alpha: float | None = None,
        distill: float = 0.0,
        selector_detach: bool = False,
        fused: bool = True,
        chunk_rows: int = 0,
    ) -> None:
        super().__init__()
        self.register_buffer("weights", weights, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dpace_alpha, self.distill, self.selector_detach = dpace_alpha, distill, selector_detach
        self.fused, self.chunk_rows = fused, chunk_rows

    def forward(
        self,
        slots: DraftSlots,
        lm_head_weight: torch.Tensor,
        selector: CandidateSelector | None = None,
        rank_mean: RankMean = None,
        compiled: bool = False,
    ) -> DraftLosses:
        """The losses of the proposing slots and the counts behind the metrics. `lm_head_weight`: the target's head,
        the drafter's vocabulary of rows. `compiled`: the fused head's chunks under torch.compile.

        `rank_mean`: under data parallelism, the mean over the ranks of a tensor (an all-reduce). Each loss is then
        this rank's share of the global batch's weighted mean: its rows' weighted sum over the ranks' mean sum of
        weights, so that the mean over the ranks of the losses, and of their gradients (what DDP averages), is the
        global batch's, as one process computes it; a loss over the rank's own weights would weigh the ranks' rows
        unequally."""
        if self.distill > 0 and slots.teacher is None:
            raise ValueError(f"distill={self.distill} needs the teacher: the target's final hidden states of the slots")
        rows = trained_rows(slots)
        head = self.head(rows, lm_head_weight, selector.top_k if selector is not None else 0, compiled)
        weights = self.weights.to(rows.hidden.device)[rows.slot]
        train_weights = self.training_weights(rows, slots.labels, head.ce_rows, weights)
        ce = weighted_mean(head.rows, train_weights, rank_mean)
        counts = head_counts(rows, head, weights, slots.labels.shape[-1])
        if selector is None:
            return DraftLosses(ce, None, counts)
        sel = selector_pass(selector, rows, head, train_weights, self.selector_detach, rank_mean)
        return DraftLosses(ce, sel.loss, counts | selector_counts(rows, head, sel, weights, counts["correct"]))

    def head(self, rows: TrainedRows, lm_head_weight: torch.Tensor, top_k: int, compiled: bool) -> HeadOut:
        """The cross-entropy: one pass of the target head over the trained rows."""
        args = (rows.hidden, rows.gold, lm_head_weight, top_k)
        if self.fused:
            return fused_head(*args, self.chunk_rows, compiled, rows.teacher, self.distill)
        return plain_head(*args, rows.teacher, self.distill)

    def training_weights(
        self, rows: TrainedRows, labels: torch.Tensor, ce_rows: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The weights: each trained row's in the losses, the decay `weights` or D-PACE's from the rows' hard CE, times
        the slot scale."""
        if self.dpace_alpha is not None:  # on the block grid, where a slot's weight depends on the slots around it
            confidence = torch.ones(labels.numel(), device=ce_rows.device).index_put((rows.at,), torch.exp(-ce_rows))
            weights = dpace_weights(confidence.view_as(labels), labels != IGNORE, self.dpace_alpha).flatten()[rows.at]
        if self.scale is not None:
            weights = weights * self.scale.to(ce_rows.device)[rows.slot]
        return weights


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


def metric_floats(counts: dict[str, torch.Tensor]) -> dict[str, float]:
    """`metric_tensors` as Python floats."""
    return {k: float(v) for k, v in metric_tensors(counts).items()}


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, NaN when den is 0 (no such rows in the batch)."""
    den = den.double()
    return torch.where(den > 0, num.double() / den.clamp_min(1e-12), torch.full_like(den, math.nan))
