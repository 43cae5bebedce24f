"""The training objective and the Lightning module on the tiny target: losses, labels, freezing, warm start."""

from __future__ import annotations

import random
import types
from pathlib import Path

import pytest
import torch
from fresh_forward import fresh_block_output
from training_setup import config

from dflash2.commands import train_groups
from dflash2.commands.train_groups import build_data, target_and_draft
from dflash2.data.anchors import IGNORE
from dflash2.model.selector import head_logits
from dflash2.testing import tiny_target
from dflash2.training import drafter
from dflash2.training.head import fused_head, grouped_topk, plain_head
from dflash2.training.losses import DraftSlots, SlotLoss, loss_gamma, metric_floats, slot_weights
from dflash2.training.module import DFlash2Module
from dflash2.training.objectives import Objective


@pytest.fixture(scope="module")
def parts(chats: Path, tmp_path_factory: pytest.TempPathFactory):
    """Target, draft config and one training batch, shared by the in-process tests."""
    cfg = config(chats, tmp_path_factory.mktemp("run"))
    target, draft_config = target_and_draft(cfg)
    data = build_data(cfg, target, draft_config)
    data.prepare_data()
    data.setup("fit")
    return cfg, target, draft_config, next(iter(data.train_dataloader()))


def module_for(parts, **kwargs) -> DFlash2Module:
    """The module of `parts`; `kwargs` are its own settings and the objective's."""
    cfg, target, draft_config, _ = parts
    objective = {k: kwargs.pop(k) for k in list(kwargs) if k in Objective.__dataclass_fields__}
    return DFlash2Module(target, draft_config, Objective(**objective), **kwargs)


def fit_batch(module: DFlash2Module, batch: dict, steps: int, lr: float = 3e-3) -> list[float]:
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        out = module.draft_step(batch)
        loss = out.ce + out.selector
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(out.ce.detach()))
    return losses


# ---------------------------------------------------------------------- objective
def test_gamma_published_points_and_slot_weights():
    assert [loss_gamma(b) for b in (8, 10, 16)] == [4.0, 5.0, 7.0]
    gammas = [loss_gamma(b) for b in range(2, 33)]
    assert all(g >= 1 for g in gammas) and gammas == sorted(gammas)
    b = random.randint(3, 20)
    w = slot_weights(b)
    assert (
        w.shape == (b - 1,) and w[0] == 1 and torch.allclose(w[1] / w[0], torch.tensor(torch.e ** (-1 / loss_gamma(b))))
    )


def test_head_outputs_are_the_selectors_candidates():
    from dflash2.model.selector import CandidateSelector

    v, h, n = 300, 24, random.randint(20, 40)
    sel = CandidateSelector(h, v, rank=8, top_k=8, output_multiplier=0.7, final_logit_softcapping=5.0)
    head, hidden = torch.randn(v, h), torch.randn(n, h)
    labels = torch.randint(0, v, (n,))
    for out in (plain_head(hidden, labels, head, 8), fused_head(hidden, labels, head, 8)):
        ref_cand, ref_unary = sel.compute_candidates(hidden, head)
        # Training scores its candidates by the selector's own unary rule: output_multiplier, then the softcap.
        assert torch.equal(out.cand, ref_cand) and torch.allclose(sel.unary(out.vals), ref_unary)
        assert torch.allclose(ref_unary, 5.0 * torch.tanh(out.vals * 0.7 / 5.0))
        assert torch.equal(out.pred, ref_cand[:, 0])


@pytest.mark.parametrize("soft", [False, True], ids=["hard", "distill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_matches_the_plain_head_in_loss_and_gradients(dtype, soft):
    """Fresh random rows, weights, labels and upstream gradients; chunks that do not divide the rows. `distill`:
    soft labels from a random teacher's rows, mixed with a random share. A vocabulary of thousands, so that the fused
    path's grouped top-K has groups to leave out."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    v, h, n, k = int(torch.randint(2000, 4000, (), generator=gen)), 32, int(torch.randint(40, 90, (), generator=gen)), 8
    head = torch.randn(v, h, generator=gen).to(dtype)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=gen)
    weights = torch.rand(n, generator=gen)
    weights = weights / weights.sum()
    teacher = torch.randn(n, h, generator=gen) * 0.5 if soft else None
    distill = 0.2 + 0.6 * float(torch.rand((), generator=gen)) if soft else 0.0
    # Two upstream gradients as the objective has them: the loss's scalar and the selector's pull on the top-K values.
    g_loss, g_vals = torch.rand((), generator=gen) + 0.5, torch.randn(n, k, generator=gen)
    chunk_rows = int(torch.randint(5, 30, (), generator=gen))
    results = []
    for out in (
        plain_head(hidden, labels, head, k, teacher, distill),
        fused_head(hidden, labels, head, k, chunk_rows, teacher=teacher, distill=distill),
    ):
        # The rows weighted as the objective weighs them; each part's gradient on its own: the top-K values' is the
        # larger and would hide an error in the loss's.
        loss = (out.rows * weights).sum()
        (grad_loss,) = torch.autograd.grad(loss * g_loss, hidden, retain_graph=True)
        (grad_vals,) = torch.autograd.grad((out.vals.float() * g_vals).sum(), hidden)
        results.append((out, loss, (grad_loss, grad_vals)))
    (plain, plain_loss, g_plain), (fused, fused_loss, g_fused) = results
    assert torch.allclose(fused_loss, plain_loss, rtol=1e-3 if dtype == torch.bfloat16 else 1e-5)
    assert torch.allclose(fused.ce_rows, plain.ce_rows, rtol=1e-5, atol=1e-5)
    if soft:
        assert torch.allclose(fused.soft_rows, plain.soft_rows, rtol=1e-5, atol=1e-5)
        # The reference itself: -sum_v q_v log p_v with q the teacher's softmax, mixed with the hard CE by `distill`.
        logits = lambda x: (x.detach().to(dtype) @ head.T).float()  # noqa: E731
        soft_rows = -(torch.softmax(logits(teacher), -1) * torch.log_softmax(logits(hidden), -1)).sum(-1)
        assert torch.allclose(plain.soft_rows, soft_rows, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(soft_rows, plain.ce_rows, rtol=0.1)
        mixed = ((1 - distill) * plain.ce_rows + distill * soft_rows) @ weights
        assert torch.allclose(plain_loss, mixed, rtol=1e-5)
    else:
        assert fused.soft_rows is None and plain.soft_rows is None
    assert torch.equal(fused.pred, plain.pred) and torch.allclose(fused.vals.float(), plain.vals.float())
    # The top-K's indices are defined up to ties (bf16 scores tie often): the fused path's point at the top-K values,
    # and are the plain path's in every row whose k + 1 largest logits are apart by more than the chunks' rounding.
    # Its values' gradient is then checked against the reference's for the same candidates.
    logits = head_logits(hidden.detach(), head, v)
    assert torch.allclose(logits.gather(1, fused.cand), plain.vals.float())
    top = logits.topk(k + 1, -1).values
    distinct = (top[:, :-1] - top[:, 1:] > (0 if dtype == torch.bfloat16 else 1e-5) * top[:, :1]).all(-1)
    assert distinct.any() and torch.equal(fused.cand[distinct], plain.cand[distinct])
    (g_ref,) = torch.autograd.grad((head_logits(hidden, head, v).gather(1, fused.cand) * g_vals).sum(), hidden)
    g_plain = (g_plain[0], g_ref)
    # bf16 rounds the logits' gradient once in the plain path, twice (CE part, top-K part) in the fused one: 3e-4 of
    # the loss part's norm at most over 40 seeds.
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-5
    for f, p in zip(g_fused, g_plain, strict=True):
        assert (f - p).norm() <= tol * p.norm(), ((f - p).norm(), p.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_topk_gives_topks_values_and_indices_that_hold_them(dtype):
    """Fresh rows: normal scores, and small integers (ties everywhere); group sizes that do not divide the vocabulary,
    and k above the number of groups."""
    for _ in range(30):
        n, v = random.randint(1, 12), random.randint(20, 2500)
        k, group = min(2 ** random.randint(0, 5), v), random.randint(1, 300)
        scores = torch.randn(n, v) * 4 if random.random() < 0.5 else torch.randint(-4, 5, (n, v)).float()
        scores = scores.to(dtype)
        vals, cand = grouped_topk(scores, k, group)
        assert torch.equal(vals, scores.topk(k, -1).values), (n, v, k, group)
        assert torch.equal(scores.gather(1, cand), vals)
        assert all(len(set(row.tolist())) == k for row in cand)


def test_fused_head_without_grad_and_without_top_k():
    v, h, n = 200, 16, 33
    head, hidden, labels = torch.randn(v, h), torch.randn(n, h), torch.randint(0, v, (n,))
    with torch.no_grad():
        out = fused_head(hidden.requires_grad_(), labels, head, 0, chunk_rows=10)
    ref = plain_head(hidden, labels, head, 0)
    assert out.vals is None and out.cand is None and not out.rows.requires_grad
    assert torch.allclose(out.rows, ref.rows.detach()) and torch.equal(out.pred, ref.pred)


def test_selector_loss_skips_ignored_predecessors_and_golds_outside_top_k():
    from dflash2.model.selector import CandidateSelector

    v, h, b, n, s = 64, 16, 2, 3, 4
    sel = CandidateSelector(h, v, rank=4, top_k=4)
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (b, n, s))
    labels[0, 0, 1] = -100  # slot 2 ignored -> slot 3 has no true predecessor
    slot_loss = SlotLoss(slot_weights(s + 1))
    out = slot_loss(DraftSlots(torch.randn(b, n, s, h), labels, torch.randint(0, v, (b, n))), head, sel)
    valid = int((labels != -100).sum())
    assert out.counts["topk_total"] == valid and out.counts["total"].sum() == valid
    assert out.counts["selector_total"] <= out.counts["topk_hit"]
    # Everything in the top-K when K == V: every slot with a true predecessor trains the selector.
    sel_all = CandidateSelector(h, v, rank=4, top_k=v)
    out = slot_loss(DraftSlots(torch.randn(b, n, s, h), labels, torch.randint(0, v, (b, n))), head, sel_all)
    assert out.counts["topk_hit"] == valid and out.counts["selector_total"] == valid - 1


@pytest.mark.parametrize("fused", [False, True])
def test_rows_counted_on_the_host_are_the_boolean_indexs_rows(fused):
    """`trained` (the count the host knows) gathers the same rows in the same order as the boolean index: every
    output and gradient is the same; a count one short is not."""
    from dflash2.model.selector import CandidateSelector

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    v, h, b, n, s = 96, 16, 3, 5, 6
    labels = torch.randint(0, v, (b, n, s), generator=gen)
    labels[torch.rand(b, n, s, generator=gen) < 0.3] = -100
    anchors, head = torch.randint(0, v, (b, n), generator=gen), torch.randn(v, h, generator=gen)
    hidden, teacher = torch.randn(b, n, s, h, generator=gen), torch.randn(b, n, s, h, generator=gen)
    sel = CandidateSelector(h, v, rank=4, top_k=8)
    with torch.no_grad():
        sel.successor_codebook.normal_(generator=gen)
    count = int((labels != -100).sum())
    outs = []
    for trained in (None, count, count - 1):
        x = hidden.clone().requires_grad_()
        slot_loss = SlotLoss(slot_weights(s + 1), distill=0.5, fused=fused)
        out = slot_loss(DraftSlots(x, labels, anchors, teacher=teacher, trained=trained), head, sel)
        grads = torch.autograd.grad(out.ce + out.selector, [x, *sel.parameters()])
        outs.append((out, grads))
    (want, want_grads), (got, got_grads), (short, _) = outs
    assert torch.equal(got.ce, want.ce) and torch.equal(got.selector, want.selector)
    assert got.counts.keys() == want.counts.keys()
    assert all(torch.equal(got.counts[key], want.counts[key]) for key in want.counts)
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    assert short.counts["total"].sum() == count - 1 != want.counts["total"].sum()


def test_the_module_counts_a_batchs_trained_slots_on_the_host(parts):
    """Before the batch moves, the module adds its count of labelled slots, which the step then uses: the same
    losses and counts as the step without it."""
    module, batch = module_for(parts), parts[3]
    moved = module.on_before_batch_transfer(dict(batch), 0)
    labels = batch["labels"].masked_fill(~batch["anchor_valid"].bool().unsqueeze(-1), -100)
    assert moved["trained_slots"] == int((labels != -100).sum()) > 0 and "trained_slots" not in batch
    with torch.no_grad():
        want, got = module.draft_step(batch), module.draft_step(moved)
    assert torch.equal(got.ce, want.ce) and all(torch.equal(got.counts[k], want.counts[k]) for k in want.counts)


def test_accuracy_scores_the_walk_that_decoding_runs():
    """A DFlash2 drafter's acc_k / tau_sim count the selector's pick (what decoding proposes), not the argmax."""
    from dflash2.model.selector import CandidateSelector

    v, h, b, n, slots = 96, 16, 2, 5, 7
    sel = CandidateSelector(h, v, rank=8, top_k=8)
    torch.nn.init.normal_(sel.successor_codebook)  # a trained-looking lattice: the walk leaves the argmax path
    head, hidden, anchors = torch.randn(v, h), torch.randn(b, n, slots, h), torch.randint(0, v, (b, n))
    # The production path: candidates, lattice and greedy walk of every block.
    flat = hidden.view(b * n, slots, h)
    cand, unary = sel.compute_candidates(flat, head)
    lattice = sel.build_lattice(cand, unary, flat, anchors.view(-1))
    zeros = torch.zeros(b * n)
    walked, _ = sel.walk(cand, lattice, torch.zeros(b * n, slots), zeros, torch.ones(b * n, dtype=torch.bool))
    argmax = cand[..., 0]  # top-K is sorted: candidate 0 is the argmax
    assert not torch.equal(walked, argmax)

    # Gold = the walk's own path: the walk is right at every slot; the argmax only where it agrees with it.
    slot_loss = SlotLoss(slot_weights(slots + 1))
    out = slot_loss(DraftSlots(hidden, walked.view(b, n, slots), anchors), head, sel)
    assert torch.equal(out.counts["correct"], out.counts["total"])
    assert torch.equal(out.counts["correct_top1"], (argmax == walked).float().sum(0))
    metrics = metric_floats(out.counts)
    assert metrics["tau_sim"] == slots + 1 and metrics["tau_sim_top1"] < slots + 1

    # A fresh selector (zero successors) walks the argmax path: both accuracies agree on any labels.
    labels = torch.where(torch.rand(b, n, slots) < 0.5, argmax.view(b, n, slots), torch.randint(0, v, (b, n, slots)))
    fresh = slot_loss(DraftSlots(hidden, labels, anchors), head, CandidateSelector(h, v, 8, 8))
    assert torch.equal(fresh.counts["correct"], fresh.counts["correct_top1"]) and fresh.counts["correct"].sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile's fast path runs on CUDA")
@pytest.mark.parametrize("drafter", ["dflash2", "dflash", "dflash2_distill"])
def test_fast_path_matches_the_plain_path_on_cuda(parts, chats, tmp_path, drafter):
    """The fused head + compiled drafter, head chunks and mask against eager PyTorch over whole logits, as trained:
    bf16 autocast, random weights (conv and selector away from their inert init), the same batch; `_distill`: with
    soft labels (objective.distill=0.5), whose teacher rows go through the compiled chunks too."""
    cfg, target = parts[0], parts[1].to("cuda")
    try:
        _compare_fast_and_plain(cfg, target, parts[3], chats, tmp_path, drafter)
    finally:
        target.to("cpu")  # the other tests share this target


def _compare_fast_and_plain(cfg, target, batch, chats, tmp_path, drafter):
    overrides = ("draft=dflash",) if drafter == "dflash" else ()
    draft = train_groups.draft_config(config(chats, tmp_path, *overrides).draft, drafter.target_fields(target))
    distill = 0.5 if drafter.endswith("_distill") else 0.0
    plain = DFlash2Module(target, draft, Objective(fused_head=False, distill=distill)).cuda()
    fast_head = Objective(fused_head=True, logits_chunk_rows=37, distill=distill)
    fast = DFlash2Module(target, draft, fast_head, compile=True).cuda()
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    with torch.no_grad():
        for p in plain.draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    fast.draft.load_state_dict(plain.draft.state_dict())
    fast.compile_draft()
    batch = {k: v.cuda() for k, v in batch.items()}
    results = []
    for module in (plain, fast):
        target.compile_features = module is fast  # model.compile: the target's compiled features path too
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = module.draft_step(batch)
                loss = out.ce + (out.selector if out.selector is not None else 0)
        finally:
            target.compile_features = False
        grads = torch.autograd.grad(loss, [p for p in module.draft.parameters() if p.requires_grad])
        results.append((out, grads))
    (p_out, p_grads), (f_out, f_grads) = results
    torch.testing.assert_close(f_out.ce, p_out.ce, rtol=1e-3, atol=0)
    if distill:
        torch.testing.assert_close(f_out.counts["distill_sum"], p_out.counts["distill_sum"], rtol=1e-3, atol=0)
    if drafter != "dflash":
        torch.testing.assert_close(f_out.selector, p_out.selector, rtol=1e-3, atol=1e-4)
    for f, p in zip(f_grads, p_grads, strict=True):
        assert (f - p).norm() <= 2e-2 * p.norm() + 1e-6, ((f - p).norm(), p.norm())


# ---------------------------------------------------------------------- the module on the tiny target
@pytest.mark.slow
def test_loss_decreases(parts):
    torch.manual_seed(random.randint(0, 2**31))
    # The tiny target's random head has rows of norm ~0.16: its logits cannot leave ~ln(V) whatever the drafter
    # does. Scaled by 10 (for this test only) they can, and a learning drafter takes the loss from ~12 to ~10 in
    # 12 steps (1.8-2.3 lower over 10 seeds and two chat files); a broken gradient path leaves it where it is.
    head = parts[1].model.get_output_embeddings().weight
    saved = head.detach().clone()
    with torch.no_grad():
        head.mul_(10.0)
    try:
        # Under the fixed decay weights: D-PACE's move with the drafter's confidence, so its loss is another sum at each
        # step (its gradient is checked against a loop in test_objectives.py).
        losses = fit_batch(module_for(parts, position_weights="decay"), parts[3], steps=12, lr=3e-3)
    finally:
        with torch.no_grad():
            head.copy_(saved)
    assert losses[-1] < losses[0] - 1.0, losses


def test_labels_are_the_same_position_tokens(parts):
    """An oracle drafter that emits, at each slot, the head row of the token AT that slot's position is
    right on every label; shifting the labels by one position makes it wrong almost everywhere."""
    _, target, _, batch = parts
    module = module_for(parts, selector_alpha=0.0)
    head = target.lm_head_weight.detach()

    def oracle(block_embeds, block_positions, context, context_positions, mask, cache=None, block_size=None):
        ids = batch["input_ids"].gather(1, block_positions.clamp(max=batch["input_ids"].shape[1] - 1))
        return head[ids] * 50.0

    module.draft.forward = oracle
    right = module.draft_step(batch).counts
    shifted = dict(batch, labels=batch["labels"].roll(1, dims=-1))
    wrong = module.draft_step(shifted).counts
    acc = lambda c: float(c["correct"].sum() / c["total"].sum())  # noqa: E731
    assert acc(right) > 0.95 and acc(wrong) < 0.3, (acc(right), acc(wrong))


@pytest.mark.parametrize("sliding", [False, True])
def test_training_blocks_are_what_decoding_computes(parts, sliding):
    """Each training block (a padded batch, many anchors in one masked pass) must give the drafter's output that
    decoding computes at that anchor: one uncached forward of [anchor, MASK, ...] over the target's features of
    exactly the tokens before it (tests/test_speculative.py ties the cached decode loop to that forward). Any
    shifted position, context or label between training and serving fails here."""
    cfg, target, draft_config, batch = parts
    if sliding:  # a window well under the chats' lengths, on the first of two layers
        layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=11)
        draft_config = draft_config.replace(**layers)
    module = DFlash2Module(target, draft_config)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    with torch.no_grad():  # random weights everywhere: the conv and selector are not at their inert init
        for p in module.draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        hidden = module.block_hidden(batch)
    cfg = module.draft.config
    rows, blocks = torch.nonzero(batch["anchor_valid"].bool(), as_tuple=True)
    pick = torch.randperm(len(rows), generator=gen)[:8]
    assert len(pick) == 8 and batch["attention_mask"].sum(-1).unique().numel() > 1  # several lengths: padding
    for i, j in zip(rows[pick].tolist(), blocks[pick].tolist(), strict=True):
        length = int(batch["attention_mask"][i].sum())
        sequence = batch["input_ids"][i, :length]
        pos = int(batch["anchors"][i, j])
        fresh = fresh_block_output(target, module.draft, sequence, pos, cfg.block_size)
        torch.testing.assert_close(hidden[i, j], fresh, rtol=1e-4, atol=1e-4)
        # Slot k's label is the token decoding must propose there: the one at pos + k.
        labels = batch["labels"][i, j]
        for k in range(1, cfg.block_size):
            if labels[k - 1] != -100:
                assert labels[k - 1] == sequence[pos + k]


def test_rounded_shapes_change_nothing_that_is_trained(parts):
    """The same rows collated with data.pad_to_multiple_of: more pad tokens (which the target sees without a mask) and
    more padded blocks, yet the same losses and counts to rounding."""
    from dflash2.data.collate import BlockCollator

    cfg, target, draft_config, batch = parts
    module = DFlash2Module(target, draft_config)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    with torch.no_grad():
        for p in module.draft.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    rows = []
    for i, length in enumerate(batch["attention_mask"].sum(-1).tolist()):
        anchors = batch["anchors"][i][batch["anchor_valid"][i].bool()]
        rows.append({"input_ids": batch["input_ids"][i, :length], "loss_mask": batch["loss_mask"][i, :length],
                     "anchors": anchors})  # fmt: skip
    pad = target.tokenizer.pad_token_id or 0
    rounded = BlockCollator(draft_config.block_size, draft_config.mask_token_id, pad, pad_to_multiple_of=32)(rows)
    size = lambda b: b["input_ids"].numel() + b["anchors"].numel()  # noqa: E731
    assert size(rounded) > size(batch)
    with torch.no_grad():
        want, got = module.draft_step(batch), module.draft_step(rounded)
    torch.testing.assert_close(got.ce, want.ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.selector, want.selector, rtol=1e-5, atol=1e-6)
    for key, count in want.counts.items():
        torch.testing.assert_close(got.counts[key], count, rtol=1e-5, atol=1e-5)


def test_dflash_has_no_conv_or_selector(parts, chats, tmp_path):
    cfg = config(chats, tmp_path, "draft=dflash")
    module = DFlash2Module(parts[1], train_groups.draft_config(cfg.draft, drafter.target_fields(parts[1])))
    names = [n for n, _ in module.draft.named_parameters()]
    assert not [n for n in names if "conv" in n or "selector" in n]
    assert module.hparams.draft_config["architectures"] == ["DFlashDraftModel"]
    assert module.draft_step(parts[3]).selector is None


def test_frozen_backbone_only_trains_conv_and_selector(parts):
    module = module_for(parts, train_backbone=False)
    before = {n: p.detach().clone() for n, p in module.draft.named_parameters()}
    fit_batch(module, parts[3], steps=2)
    changed = {n for n, p in module.draft.named_parameters() if not torch.equal(p, before[n])}
    added = {n for n in before if "conv" in n or "candidate_selector" in n}
    assert changed <= added, changed - added
    assert {n for n in changed if "conv" in n}, "the conv is trainable"


def test_warm_start_from_a_dflash_folder(parts, chats, tmp_path):
    """A plain DFlash export warm-starts DFlash2: its backbone and target layers are adopted, the conv and
    selector start inert, and with the backbone frozen only they train."""
    from dflash2.model.drafter import DFlash2DraftModel

    target = parts[1]
    layer_ids = sorted(random.sample(range(target.num_layers), 2))
    dflash = train_groups.draft_config(config(chats, tmp_path, "draft=dflash").draft, drafter.target_fields(target))
    saved = DFlash2DraftModel(dflash.replace(target_layer_ids=layer_ids))
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_()
    saved.save_pretrained(tmp_path / "dflash")

    warm = config(chats, tmp_path, f"module.init_from={tmp_path / 'dflash'}", "module.train_backbone=false")
    assert train_groups.resolve_drafter(warm).target_layer_ids == layer_ids
    target, draft = target_and_draft(warm)  # it captures the warm start's layers
    assert draft.target_layer_ids == target.target_layer_ids == layer_ids
    module = DFlash2Module(target, draft, init_from=warm.module.init_from, train_backbone=False)
    assert module.hparams.draft_config["architectures"] == ["DFlash2DraftModel"]
    state = module.draft.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16).float()), name
    selector = module.draft.candidate_selector
    assert selector is not None and not selector.successor_codebook.any()
    fit_batch(module, parts[3], steps=2)
    state = module.draft.state_dict()
    assert all(torch.equal(state[n], t.to(torch.bfloat16).float()) for n, t in saved.state_dict().items())


# ---------------------------------------------------------------------- initialisation and soft labels
def test_init_std_draws_the_backbone_and_leaves_the_conv_and_selector_inert(parts):
    from dflash2.model.drafter import DFlash2DraftModel
    from dflash2.training.module import backbone_linears

    std = random.uniform(0.01, 0.03)  # PyTorch's default here is U(+-1/sqrt(fan_in)): std 0.072 at fan-in 64
    module = module_for(parts, init_std=std)
    weights = [linear.weight.detach().flatten() for linear in backbone_linears(module.draft)]
    pooled = torch.cat(weights)
    assert len(weights) == 1 + 7 * module.draft.config.num_hidden_layers and pooled.numel() > 40_000
    assert abs(float(pooled.std()) / std - 1) < 0.03 and abs(float(pooled.mean())) < 0.03 * std
    assert all(abs(float(w.std()) / std - 1) < 0.1 for w in weights)
    # The conv stays an exact no-op at init: both sides pass their input through, bit for bit.
    b = module.draft.config.block_size
    for layer in module.draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            x, z = torch.randn(2, 3 * b, conv.hidden_size), torch.randn(2, 3 * b, conv.hidden_size)
            y, coeffs = conv.prepare(x, b)
            assert torch.equal(y, x) and torch.equal(conv.finish(z, coeffs, b), z)
    selector = module.draft.candidate_selector
    assert not selector.successor_codebook.any()
    projection = selector.hidden_projection.weight
    assert abs(float(projection.std()) * projection.shape[1] ** 0.5 - 1) < 0.1  # its own init, std H^-0.5

    # Off (null), the drafter is exactly what it was: the constructor's init, draw for draw.
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    default = module_for(parts).draft.state_dict()
    torch.manual_seed(seed)
    reference = DFlash2DraftModel(module.draft.config).state_dict()
    assert all(torch.equal(default[k], reference[k]) for k in reference)
    with pytest.raises(ValueError, match="module.init_std=0"):
        module_for(parts, init_std=0.0)
    with pytest.raises(ValueError, match="module.init_std=0.02 initialises a drafter built from scratch"):
        module_for(parts, init_std=0.02, init_from="some/export")


def test_feature_scaling_equalises_the_layers_contributions(parts):
    """At the first step each target layer's features enter fc at one scale: fc's column block k is scaled by
    (1/rms_k) / mean_j(1/rms_j), rms_k measured here from the same batch's real tokens. Layers 1 and 3 of the tiny
    target differ ~50x in scale (the last layer is read after the final norm)."""
    _, _, draft_config, batch = parts
    layers = [1, 3]
    target = tiny_target(target_layer_ids=layers)
    module = DFlash2Module(target, draft_config.replace(target_layer_ids=layers), feature_scaling=True)
    h = draft_config.hidden_size
    before = module.draft.fc.weight.detach().clone()
    module.on_train_batch_start(batch, 0)
    after = module.draft.fc.weight.detach().clone()

    real = batch["attention_mask"].bool()
    states = target.model(batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    # hidden_states[-1] is after the final norm, as the capture of the last layer (contract: id i = hidden_states[i+1])
    features = [states.hidden_states[i + 1][real] for i in layers]
    rms = torch.stack([x.pow(2).mean().sqrt() for x in features])
    scale = rms.reciprocal() / rms.reciprocal().mean()
    for k in range(2):
        block = slice(k * h, (k + 1) * h)
        torch.testing.assert_close(after[:, block], before[:, block] * scale[k], rtol=1e-5, atol=0)

    def spread(weight: torch.Tensor) -> float:
        contributions = [(x @ weight[:, k * h : (k + 1) * h].T).pow(2).mean().sqrt() for k, x in enumerate(features)]
        return float(max(contributions) / min(contributions))

    assert spread(before) > 10 and spread(after) < 1.15, (spread(before), spread(after))
    module.on_train_batch_start(batch, 1)  # once only
    assert torch.equal(module.draft.fc.weight, after)
    restored = DFlash2Module(target, draft_config.replace(target_layer_ids=layers), feature_scaling=True)
    restored.on_load_checkpoint({})  # a resumed run: its fc is the checkpoint's
    before = restored.draft.fc.weight.detach().clone()
    restored.on_train_batch_start(batch, 0)
    assert torch.equal(restored.draft.fc.weight, before)


def test_distill_zero_is_the_hard_label_loss_exactly(parts):
    """With distill=0 a teacher changes nothing, bit for bit, in either head; and the module asks the target for no
    final hidden states (no extra layers, no teacher rows)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    v, h, n, k = 300, 24, 57, 4
    head, teacher = torch.randn(v, h, generator=gen), torch.randn(n, h, generator=gen)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    labels, weights = torch.randint(0, v, (n,), generator=gen), torch.rand(n, generator=gen)
    for run in (lambda *a: plain_head(*a), lambda *a: fused_head(*a[:4], 13, False, *a[4:])):
        results = []
        for args in ((), (teacher, 0.0)):
            out = run(hidden, labels, head, k, *args)
            loss = (out.rows * weights).sum()
            results.append((loss, *torch.autograd.grad(loss + out.vals.sum(), hidden)))
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    module = module_for(parts)
    assert module.target_pass(parts[3]).final_hidden is None
    assert "distill_sum" not in module.draft_step(parts[3]).counts


def test_validation_loss_is_the_objective_training_minimises(parts, monkeypatch):
    """Validation rebuilds the objective from its summed metrics (hard CE, soft CE, selector loss): on one batch it is
    the loss training_step minimises, with distillation and the selector both on and a ramped selector alpha. Under
    the decay weights, which the metrics use whatever the objective's weighting (D-PACE's trains otherwise)."""
    _, target, _, batch = parts
    module = module_for(parts, distill=0.4, selector_alpha=0.7, selector_ramp_steps=4, position_weights="decay")
    logged: dict = {}
    monkeypatch.setattr(module, "log_dict", lambda metrics, **_: logged.update(metrics))
    monkeypatch.setattr(module, "log", lambda name, value, **_: logged.update({name: value}))
    module._trainer = types.SimpleNamespace(global_step=1, sanity_checking=True, world_size=1)  # alpha 0.35: halfway
    # The random head's top 4 almost never holds a gold token, which leaves the selector's loss out. With the rows of
    # the chats' words scaled by 10, about half of those words lead every slot's logits, so some golds are candidates.
    weight = target.model.get_output_embeddings().weight
    saved = weight.detach().clone()
    words = batch["labels"][batch["labels"] != IGNORE].unique()
    try:
        with torch.no_grad():
            weight[words] *= 10.0
            loss = float(module.training_step(batch, 0))
            module.validation_step(batch, 0)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    module.on_validation_epoch_end()
    assert logged["train/selector_alpha"] == pytest.approx(0.35) and logged["val/loss_selector"] > 0
    assert logged["val/loss_distill"] != logged["val/loss_ce"]
    assert logged["val/loss"] == pytest.approx(loss, rel=1e-5), (logged["val/loss"], loss)


def test_soft_labels_are_the_targets_distribution_before_each_slot(parts):
    """An oracle drafter that emits, at slot k of the block at anchor a, the target's own final hidden state at
    a + k - 1 has the target's distribution there: its soft CE is the target's entropy (the KL part is 0). The
    entropy comes from the target's own logits. Emitting the hidden state one position later breaks it."""
    _, target, _, batch = parts
    module = module_for(parts, distill=1.0, selector_alpha=0.0)
    # As in test_loss_decreases: the random head's logits are nearly uniform; scaled, the distributions differ.
    weight = target.model.get_output_embeddings().weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(10.0)
    try:
        final = target(batch["input_ids"], attention_mask=batch["attention_mask"], logits=False, final=True)
        logits = target.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        rows = torch.arange(len(final.final_hidden))[:, None]
        shift = 1

        def oracle(block_embeds, block_positions, context, context_positions, mask, cache=None, block_size=None):
            return final.final_hidden[rows, (block_positions - shift).clamp(0, logits.shape[1] - 1)]

        module.draft.forward = oracle
        right = module.draft_step(batch).counts
        shift = 0
        wrong = module.draft_step(batch).counts
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    # The target's entropy at a + k - 1 for every trained slot k, weighted as the loss weighs the slots.
    b, n = batch["anchors"].shape
    labels = batch["labels"]
    valid = labels != -100
    positions = batch["anchors"][..., None] + torch.arange(labels.shape[-1])  # a + k - 1 for k = 1..B-1
    logp = torch.log_softmax(logits[torch.arange(b)[:, None, None], positions], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    w = module.slot_loss.weights.expand_as(labels)[valid]
    expected = float((entropy[valid] * w).sum() / w.sum())
    loss = lambda c: float(c["distill_sum"] / c["weight_sum"])  # noqa: E731
    assert abs(loss(right) - expected) < 1e-4 * expected, (loss(right), expected)
    assert loss(wrong) - expected > 0.1, (loss(wrong), expected)
