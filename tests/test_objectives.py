"""The slot weightings and the decayed self-distillation against plain loops written from their definitions."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from dflash2.model.selector import CandidateSelector
from dflash2.training.losses import IGNORE, DraftSlots, SlotLoss, dpace_weights, slot_weights
from dflash2.training.objectives import Objective


def dpace_loop(confidence: list[float], valid: list[bool], alpha: float) -> list[float]:
    """w_k = sum over trained m >= k of prod over trained j <= m of (alpha + (1 - alpha) q_j); 0 if k is not trained."""
    smoothed = [alpha + (1 - alpha) * q if ok else 1.0 for q, ok in zip(confidence, valid, strict=True)]
    reach = [math.prod(smoothed[: m + 1]) if valid[m] else 0.0 for m in range(len(smoothed))]
    return [sum(reach[k:]) if valid[k] else 0.0 for k in range(len(smoothed))]


def test_dpace_weights_on_a_hand_made_block():
    # q~ = [1, 0.5, 1, 0.75]: the chances of reaching each slot 1, 0.5, 0.5, 0.375; each weight the sum from it on.
    w = dpace_weights(torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.ones(4, dtype=torch.bool), 0.5)
    assert torch.allclose(w, torch.tensor([2.375, 1.375, 0.875, 0.375]))
    # An untrained slot neither weighs nor breaks the product of the ones around it.
    w = dpace_weights(torch.tensor([1.0, 0.0, 0.3, 0.5]), torch.tensor([True, True, False, True]), 0.5)
    assert torch.allclose(w, torch.tensor([1.875, 0.875, 0.0, 0.375]))
    # alpha = 1: every slot is reached, the weights count the slots left.
    assert torch.equal(dpace_weights(torch.rand(5), torch.ones(5, dtype=torch.bool), 1.0), torch.arange(5, 0, -1.0))


def test_dpace_weights_match_the_loop_on_random_blocks():
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    blocks, slots = 7, int(torch.randint(2, 16, (), generator=gen))
    confidence, valid = torch.rand(blocks, slots, generator=gen), torch.rand(blocks, slots, generator=gen) < 0.8
    alpha = 0.05 + 0.95 * float(torch.rand((), generator=gen))
    got = dpace_weights(confidence, valid, alpha)
    want = torch.tensor([dpace_loop(q.tolist(), ok.tolist(), alpha) for q, ok in zip(confidence, valid, strict=True)])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"seed {seed}"


def test_dpace_alpha_outside_its_range_is_refused():
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(torch.rand(3), torch.ones(3, dtype=torch.bool), 0.0)
    with pytest.raises(ValueError, match="objective.dpace_alpha=1.5"):
        Objective(dpace_alpha=1.5)
    with pytest.raises(ValueError, match="objective.position_weights=dapce: choose one of decay, dpace"):
        Objective(position_weights="dapce")
    assert Objective(position_weights="decay").dpace is None
    assert Objective(position_weights="dpace", dpace_alpha=0.3).dpace == 0.3


def losses_case(seed: int):
    """A small batch of blocks: random drafter rows, a random head and teacher, some slots not trained."""
    gen = torch.Generator().manual_seed(seed)
    v, h, b, n, s = 50, 12, 2, 3, 5
    hidden = torch.randn(b, n, s, h, generator=gen, requires_grad=True)
    labels = torch.randint(0, v, (b, n, s), generator=gen)
    labels[0, 1, 3:] = IGNORE  # a block past the end of its reply
    labels[1, 2, 2] = IGNORE
    return hidden, labels, torch.randint(0, v, (b, n), generator=gen), torch.randn(v, h, generator=gen), gen


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_dpace_loss_and_gradient_are_the_loops(fused):
    """The trained loss is sum_i w_i CE_i / sum_i w_i with the loop's D-PACE weights of each block, computed from
    exp(-CE) and held constant; its gradient is that of the loop's loss. The metrics keep the decay weights."""
    seed = random.randrange(2**31)
    hidden, labels, anchors, head, _ = losses_case(seed)
    alpha, decay = 0.4, slot_weights(labels.shape[-1] + 1)
    out = SlotLoss(decay, dpace_alpha=alpha, fused=fused)(DraftSlots(hidden, labels, anchors), head)
    (grad,) = torch.autograd.grad(out.ce, hidden)

    terms, weights, decay_terms, decay_sum = [], [], [], 0.0
    for block, ids in zip(hidden.flatten(0, 1), labels.flatten(0, 1), strict=True):
        ce = [
            torch.nn.functional.cross_entropy(block[k] @ head.T, ids[k]) if ids[k] != IGNORE else None
            for k in range(len(ids))
        ]
        confidence = [math.exp(-c.item()) if c is not None else 0.0 for c in ce]
        w = dpace_loop(confidence, [c is not None for c in ce], alpha)
        for k, c in enumerate(ce):
            if c is not None:
                terms.append(w[k] * c)
                weights.append(w[k])
                decay_terms.append(float(decay[k]) * float(c))
                decay_sum += float(decay[k])
    loss = sum(terms) / sum(weights)
    (want,) = torch.autograd.grad(loss, hidden)
    assert torch.allclose(out.ce, loss, rtol=1e-5), f"seed {seed}"
    assert torch.allclose(grad, want, rtol=1e-4, atol=1e-7), f"seed {seed}"
    assert math.isclose(
        float(out.counts["ce_sum"] / out.counts["weight_sum"]), sum(decay_terms) / decay_sum, rel_tol=1e-5
    ), f"seed {seed}"


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_decayed_self_distillation_is_the_loop(fused):
    """distill=1 (Model-Optimizer's self-distillation): each trained slot's loss is the cross-entropy of the drafter's
    distribution against the target's softmax at the slot's teacher row, weighted by exp(-(k-1)/gamma)."""
    seed = random.randrange(2**31)
    hidden, labels, anchors, head, gen = losses_case(seed)
    teacher = torch.randn(*hidden.shape, generator=gen)
    decay = slot_weights(labels.shape[-1] + 1, 7.0)
    out = SlotLoss(decay, distill=1.0, fused=fused)(DraftSlots(hidden, labels, anchors, teacher), head)
    terms, weights = [], []
    for block, rows, ids in zip(hidden.flatten(0, 1), teacher.flatten(0, 1), labels.flatten(0, 1), strict=True):
        for k in range(len(ids)):
            if ids[k] != IGNORE:
                q = torch.softmax(rows[k] @ head.T, -1)
                terms.append(float(decay[k]) * -(q * torch.log_softmax(block[k] @ head.T, -1)).sum())
                weights.append(float(decay[k]))
    loss = sum(terms) / sum(weights)
    assert torch.allclose(out.ce, loss, rtol=1e-5), f"seed {seed}"
    (grad,), (want,) = torch.autograd.grad(out.ce, hidden), torch.autograd.grad(loss, hidden)
    assert torch.allclose(grad, want, rtol=1e-4, atol=1e-7), f"seed {seed}"


def test_late_slot_weight_is_a_factor_on_the_late_slots():
    assert Objective().slot_scale(16) is None  # off: the weights as they are
    assert Objective(late_slot_weight=3, late_slot_start=3).slot_scale(6).tolist() == [1, 1, 3, 3, 3]
    assert Objective(late_slot_weight=0.5).slot_scale(8).tolist() == [1, 1, 1, 0.5, 0.5, 0.5, 0.5]  # from B // 2 = 4
    assert Objective(late_slot_weight=2, late_slot_start=15).slot_scale(16).tolist() == [1] * 14 + [2]


@pytest.mark.parametrize("position_weights", ["decay", "dpace"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_late_slot_weight_multiplies_the_training_weights_and_leaves_the_metrics(position_weights, fused):
    """With objective.late_slot_weight m from slot s: the trained loss is sum_i m_i w_i CE_i / sum_i m_i w_i, where w
    are the weighting's own (decay's, or D-PACE's from the loop) and m_i = m on slots >= s, 1 before; the metrics'
    loss_ce keeps the decay weights alone."""
    seed = random.randrange(2**31)
    hidden, labels, anchors, head, _ = losses_case(seed)
    slots = labels.shape[-1]
    objective = Objective(position_weights=position_weights, late_slot_weight=2.5, late_slot_start=3)
    decay, scale = slot_weights(slots + 1, 2.0), objective.slot_scale(slots + 1)
    batch = DraftSlots(hidden, labels, anchors)
    out = SlotLoss(decay, scale, dpace_alpha=objective.dpace, fused=fused)(batch, head)
    plain = SlotLoss(decay, dpace_alpha=objective.dpace, fused=fused)(batch, head)

    terms, weights = [], []
    for block, ids in zip(hidden.flatten(0, 1), labels.flatten(0, 1), strict=True):
        ce = [
            torch.nn.functional.cross_entropy(block[k] @ head.T, ids[k]).item() if ids[k] != IGNORE else None
            for k in range(slots)
        ]
        if position_weights == "dpace":
            w = dpace_loop([math.exp(-c) if c is not None else 0.0 for c in ce], [c is not None for c in ce], 0.5)
        else:
            w = [math.exp(-k / 2.0) for k in range(slots)]  # slot k + 1: exp(-((k + 1) - 1) / gamma), gamma = 2
        for k, c in enumerate(ce):
            if c is not None:
                factor = 2.5 if k + 1 >= 3 else 1.0  # slot k + 1
                terms.append(factor * w[k] * c)
                weights.append(factor * w[k])
    assert math.isclose(float(out.ce), sum(terms) / sum(weights), rel_tol=1e-5), f"seed {seed}"
    assert not math.isclose(float(out.ce), float(plain.ce), rel_tol=1e-6)
    for key in ("ce_sum", "weight_sum"):
        assert torch.equal(out.counts[key], plain.counts[key])


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(late_slot_weight=0), "objective.late_slot_weight=0: .* a number > 0"),
        (dict(late_slot_weight=-1.5), "objective.late_slot_weight=-1.5"),
        (dict(late_slot_weight="x"), "objective.late_slot_weight='x'"),
        (dict(late_slot_weight=2, late_slot_start=0), "objective.late_slot_start=0: .* an integer >= 1"),
        (dict(late_slot_weight=2, late_slot_start=2.5), "objective.late_slot_start=2.5"),
    ],
)
def test_bad_late_slot_settings_are_refused_by_name(settings, message):
    with pytest.raises(ValueError, match=message):
        Objective(**settings)


def test_a_late_slot_start_past_the_block_is_refused_with_the_block_size():
    with pytest.raises(ValueError, match="objective.late_slot_start=16: a block of draft.block_size=16 has"):
        Objective(late_slot_weight=2, late_slot_start=16).slot_scale(16)


def straight_line_losses(hidden, labels, anchors, head, weights, selector=None, settings=None):
    """The whole objective written out in one piece from its definition (losses.py's docstring), over the whole
    logits of the trained slots: (ce, selector loss, counts) with the same operations as `SlotLoss`'s parts."""
    settings = settings or {}
    distill, dpace_alpha, scale = settings.get("distill", 0.0), settings.get("dpace_alpha"), settings.get("scale")
    valid = labels != IGNORE
    previous = torch.cat([anchors.unsqueeze(-1), labels[..., :-1]], dim=-1)  # the anchor, then the previous gold
    at = valid.flatten().nonzero().squeeze(-1)
    gold, slot = labels.flatten()[at], torch.arange(labels.shape[-1]).expand_as(labels).flatten()[at]
    prev, h = previous.flatten()[at], hidden.flatten(0, 2)[at]
    logits = (h @ head.T).float()
    ce_rows = F.cross_entropy(logits, gold, reduction="none")
    rows, soft = ce_rows, None
    if settings.get("teacher") is not None:
        target = torch.softmax((settings["teacher"].flatten(0, 2)[at] @ head.T).float(), -1)
        soft = -(target * torch.log_softmax(logits, -1)).sum(-1)
        rows, soft = (1 - distill) * ce_rows + distill * soft, soft.detach()
    w = weights[slot]
    w_train = w
    if dpace_alpha is not None:
        confidence = torch.ones(labels.numel()).index_put((at,), torch.exp(-ce_rows.detach()))
        w_train = dpace_weights(confidence.view_as(labels), valid, dpace_alpha).flatten()[at]
    if scale is not None:
        w_train = w_train * scale[slot]
    ce = (rows * w_train).sum() / w_train.sum().detach().clamp_min(1e-6)
    pred, per_slot = logits.argmax(-1), torch.zeros(labels.shape[-1])
    counts = {
        "correct": per_slot.index_add(0, slot, (pred == gold).float()),
        "total": per_slot.index_add(0, slot, torch.ones_like(w)),
        "ce_sum": (ce_rows.detach() * w).sum(),
        "weight_sum": w.sum(),
    }
    if soft is not None:
        counts["distill_sum"] = (soft * w).sum()
    if selector is None:
        return ce, None, counts
    vals, cand = logits.topk(selector.top_k, dim=-1)
    if settings.get("selector_detach"):
        vals, h = vals.detach(), h.detach()
    match = cand == gold.unsqueeze(-1)
    in_top, gold_at = match.any(-1), match.int().argmax(-1)
    use = in_top & (prev != IGNORE)  # the gold among the candidates, after a true predecessor
    scores = selector.gold_scores(cand[None], selector.unary(vals)[None], h[None], prev.clamp_min(0)[None])[0]
    sel_rows = F.cross_entropy(scores, gold_at, reduction="none")
    sel = (sel_rows * w_train * use).sum() / (w_train * use).sum().detach().clamp_min(1e-6)
    picks_gold = scores.argmax(-1) == gold_at
    picked = torch.where(prev != IGNORE, picks_gold & in_top, pred == gold)
    counts |= {
        "correct_top1": counts["correct"],
        "correct": per_slot.index_add(0, slot, picked.float()),
        "topk_hit": in_top.sum().float(),
        "topk_total": torch.tensor(float(gold.numel())),
        "selector_hit": (picks_gold & use).sum().float(),
        "selector_total": use.sum().float(),
        "selector_sum": (sel_rows.detach() * w * use).sum(),
        "selector_weight_sum": (w * use).sum(),
    }
    return ce, sel, counts


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"selector": True},
        {"selector": True, "selector_detach": True, "dpace_alpha": 0.4, "scale": True, "distill": 0.5, "trained": True},
    ],
    ids=["head", "selector", "every-setting"],
)
def test_the_slot_losses_parts_compose_to_the_objective_written_in_one_piece(settings):
    """SlotLoss (the labels, the head's cross-entropy, the weights, the selector's loss and the counts, each a part of
    its own) gives bit for bit the losses, counts and gradients of the objective written out in one piece."""
    seed = random.randrange(2**31)
    hidden, labels, anchors, head, gen = losses_case(seed)
    labels[:, :, 2] = IGNORE  # slot 4 of every block has no true predecessor
    slots = labels.shape[-1]
    # Most golds among the candidates: the selector trains on most rows, and the metrics tell its rows from the rest.
    selector = (
        CandidateSelector(hidden.shape[-1], head.shape[0], rank=4, top_k=32) if settings.get("selector") else None
    )
    if selector is not None:
        with torch.no_grad():
            selector.successor_codebook.normal_(generator=gen)  # a trained-looking lattice: the walk leaves the argmax
    teacher = torch.randn(*hidden.shape, generator=gen) if settings.get("distill") else None
    scale = Objective(late_slot_weight=2.5, late_slot_start=3).slot_scale(slots + 1) if settings.get("scale") else None
    decay = slot_weights(slots + 1)
    params = [hidden, *(selector.parameters() if selector is not None else [])]

    loss = SlotLoss(
        decay, scale, settings.get("dpace_alpha"), settings.get("distill", 0.0), settings.get("selector_detach", False),
        fused=False,
    )  # fmt: skip
    trained = int((labels != IGNORE).sum()) if settings.get("trained") else None
    got = loss(DraftSlots(hidden, labels, anchors, teacher, trained), head, selector)
    want = straight_line_losses(
        hidden, labels, anchors, head, decay, selector, settings | {"teacher": teacher, "scale": scale}
    )
    total = lambda ce, sel: ce + (sel if sel is not None else 0)  # noqa: E731
    got_grads = torch.autograd.grad(total(got.ce, got.selector), params, allow_unused=True)
    want_grads = torch.autograd.grad(total(want[0], want[1]), params, allow_unused=True)
    assert torch.equal(got.ce, want[0]), f"seed {seed}"
    assert (got.selector is None) == (selector is None) and (selector is None or torch.equal(got.selector, want[1]))
    assert list(got.counts) == list(want[2]), f"seed {seed}"
    assert all(torch.equal(got.counts[k], want[2][k]) for k in want[2]), f"seed {seed}"
    assert all((g is None and w is None) or torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True)), (
        f"seed {seed}"
    )
