"""The slot weightings and the decayed self-distillation against plain loops written from their definitions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dflash2.training.losses import IGNORE, dpace_weights, draft_losses, slot_weights
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
    out = draft_losses(hidden, labels, anchors, head, head.shape[0], decay, fused=fused, dpace_alpha=alpha)
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
    out = draft_losses(hidden, labels, anchors, head, head.shape[0], decay, fused=fused, teacher=teacher, distill=1.0)
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
    args = (hidden, labels, anchors, head, head.shape[0], decay)
    out = draft_losses(*args, fused=fused, dpace_alpha=objective.dpace, slot_scale=scale)
    plain = draft_losses(*args, fused=fused, dpace_alpha=objective.dpace)

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
