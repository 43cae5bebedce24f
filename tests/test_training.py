"""The training objective and the Lightning module on the tiny target: losses, labels, freezing, warm start."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from fresh_forward import fresh_block_output
from training_setup import config

from dflash2.training import DFlash2Module, draft_losses, loss_gamma, slot_weights
from dflash2.training.losses import head_pass, summarise
from dflash2.training.run import build_data, draft_config_for


@pytest.fixture(scope="module")
def parts(chats: Path, tmp_path_factory: pytest.TempPathFactory):
    """Target, draft config and one training batch, shared by the in-process tests."""
    from dflash2.target import TargetModel

    cfg = config(chats, tmp_path_factory.mktemp("run"))
    target = TargetModel.from_config(cfg.model)
    draft_config = draft_config_for(target, cfg.model, cfg.draft)
    data = build_data(cfg, target, draft_config)
    data.prepare_data()
    data.setup("fit")
    return cfg, target, draft_config, next(iter(data.train_dataloader()))


def module_for(parts, **kwargs) -> DFlash2Module:
    cfg, target, draft_config, _ = parts
    return DFlash2Module(target, draft_config.to_dict(), **kwargs)


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


def test_one_head_pass_matches_the_selector_and_chunking():
    from dflash2.selector import CandidateSelector

    v, h, n = 300, 24, random.randint(20, 40)
    sel = CandidateSelector(h, v, rank=8, top_k=8, output_multiplier=0.7, final_logit_softcapping=5.0)
    head, hidden = torch.randn(v, h), torch.randn(n, h, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    ce, pred, vals, cand = head_pass(hidden, labels, head, v, top_k=8)
    ref_cand, ref_unary = sel.compute_candidates(hidden, head)
    from dflash2.selector import softcap

    assert torch.equal(cand, ref_cand)
    assert torch.allclose(softcap(vals * 0.7, 5.0), ref_unary)
    grad = torch.autograd.grad(ce.sum() + vals.sum(), hidden)[0]
    chunked = head_pass(hidden, labels, head, v, top_k=8, chunk_rows=7)
    for a, b in zip(chunked, (ce, pred, vals, cand), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)
    assert torch.allclose(torch.autograd.grad(chunked[0].sum() + chunked[2].sum(), hidden)[0], grad, atol=1e-5)


def test_selector_loss_skips_ignored_predecessors_and_golds_outside_top_k():
    from dflash2.selector import CandidateSelector

    v, h, b, n, s = 64, 16, 2, 3, 4
    sel = CandidateSelector(h, v, rank=4, top_k=4)
    head = torch.randn(v, h)
    labels = torch.randint(0, v, (b, n, s))
    labels[0, 0, 1] = -100  # slot 2 ignored -> slot 3 has no true predecessor
    out = draft_losses(torch.randn(b, n, s, h), labels, torch.randint(0, v, (b, n)), head, v, slot_weights(s + 1), sel)
    valid = int((labels != -100).sum())
    assert out.counts["topk_total"] == valid and out.counts["total"].sum() == valid
    assert out.counts["selector_total"] <= out.counts["topk_hit"]
    # Everything in the top-K when K == V: every slot with a true predecessor trains the selector.
    sel_all = CandidateSelector(h, v, rank=4, top_k=v)
    out = draft_losses(
        torch.randn(b, n, s, h), labels, torch.randint(0, v, (b, n)), head, v, slot_weights(s + 1), sel_all
    )
    assert out.counts["topk_hit"] == valid and out.counts["selector_total"] == valid - 1


def test_accuracy_scores_the_walk_that_decoding_runs():
    """A DFlash2 drafter's acc_k / tau_sim count the selector's pick (what decoding proposes), not the argmax."""
    from dflash2.selector import CandidateSelector

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
    out = draft_losses(hidden, walked.view(b, n, slots), anchors, head, v, slot_weights(slots + 1), sel)
    assert torch.equal(out.counts["correct"], out.counts["total"])
    assert torch.equal(out.counts["correct_top1"], (argmax == walked).float().sum(0))
    metrics = summarise(out.counts)
    assert metrics["tau_sim"] == slots + 1 and metrics["tau_sim_top1"] < slots + 1

    # A fresh selector (zero successors) walks the argmax path: both accuracies agree on any labels.
    labels = torch.where(torch.rand(b, n, slots) < 0.5, argmax.view(b, n, slots), torch.randint(0, v, (b, n, slots)))
    fresh = draft_losses(hidden, labels, anchors, head, v, slot_weights(slots + 1), CandidateSelector(h, v, 8, 8))
    assert torch.equal(fresh.counts["correct"], fresh.counts["correct_top1"]) and fresh.counts["correct"].sum() > 0


# ---------------------------------------------------------------------- the module on the tiny target
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
        losses = fit_batch(module_for(parts), parts[3], steps=12, lr=3e-3)
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

    def oracle(block_embeds, block_positions, context, context_positions, mask, cache=None):
        ids = batch["input_ids"].gather(1, block_positions.clamp(max=batch["input_ids"].shape[1] - 1))
        return head[ids] * 50.0

    module.draft.forward = oracle
    right = module.draft_step(batch).counts
    shifted = dict(batch, labels=batch["labels"].roll(1, dims=-1))
    wrong = module.draft_step(shifted).counts
    acc = lambda c: float(c["correct"].sum() / c["total"].sum())  # noqa: E731
    assert acc(right) > 0.95 and acc(wrong) < 0.3, (acc(right), acc(wrong))


def test_training_blocks_are_what_decoding_computes(parts):
    """Each training block (a padded batch, many anchors in one masked pass) must give the drafter's output that
    decoding computes at that anchor: one uncached forward of [anchor, MASK, ...] over the target's features of
    exactly the tokens before it (tests/test_speculative.py ties the cached decode loop to that forward). Any
    shifted position, context or label between training and serving fails here."""
    _, target, _, batch = parts
    module = module_for(parts)
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


def test_dflash_has_no_conv_or_selector(parts, chats, tmp_path):
    cfg = config(chats, tmp_path, "draft=dflash")
    draft_config = draft_config_for(parts[1], cfg.model, cfg.draft)
    module = DFlash2Module(parts[1], draft_config.to_dict())
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
    from dflash2.model import DFlash2DraftModel
    from dflash2.training.run import adopt_warm_start

    cfg, target = parts[0], parts[1]
    layer_ids = sorted(random.sample(range(target.num_layers), 2))
    dflash = draft_config_for(target, cfg.model, config(chats, tmp_path, "draft=dflash").draft)
    saved = DFlash2DraftModel(dflash.replace(target_layer_ids=layer_ids))
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_()
    saved.save_pretrained(tmp_path / "dflash")

    warm = config(chats, tmp_path, f"draft.init_from={tmp_path / 'dflash'}", "draft.train_backbone=false")
    adopt_warm_start(warm)
    assert list(warm.model.target_layer_ids) == layer_ids
    from dflash2.target import TargetModel

    target = TargetModel.from_config(warm.model)  # it captures the warm start's layers
    draft_config = draft_config_for(target, warm.model, warm.draft)
    module = DFlash2Module(target, draft_config.to_dict(), init_from=warm.draft.init_from, train_backbone=False)
    assert module.hparams.draft_config["architectures"] == ["DFlash2DraftModel"]
    state = module.draft.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16).float()), name
    selector = module.draft.candidate_selector
    assert selector is not None and not selector.successor_codebook.any()
    fit_batch(module, parts[3], steps=2)
    state = module.draft.state_dict()
    assert all(torch.equal(state[n], t.to(torch.bfloat16).float()) for n, t in saved.state_dict().items())
