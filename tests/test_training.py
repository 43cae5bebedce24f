"""The training side on the tiny target: objective, wiring of labels, freezing, checkpoints, resume, CLI errors."""

from __future__ import annotations

import copy
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback

from dflash2.config import tensor_shapes
from dflash2.training import DFlash2Module, draft_losses, loss_gamma, register_resolvers, slot_weights, train
from dflash2.training.losses import head_pass, summarise
from dflash2.training.run import build_data, draft_config_for

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the a cat dog runs jumps over under blue red big small fast slow code python number one two three "
    "four five six seven eight nine ten list item value print return"
).split()
register_resolvers()


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh random chat file: two turns per chat, replies long enough for several blocks."""
    rng = random.Random(time.time_ns())
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with path.open("w") as f:
        for i in range(20):
            messages = []
            for _ in range(2):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 10)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(12, 30)))})
            f.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
    return path


def config(chats: Path, run_dir: Path, *overrides: str):
    if not any(o.startswith("draft=") for o in overrides):
        overrides = ("draft.selector_rank=8", "draft.selector_top_k=4", *overrides)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                "model=tiny",
                "data=jsonl",
                f"data.path={chats}",
                "data.val_size=4",
                "data.batch_size=4",
                "data.max_length=128",
                "data.num_proc=1",
                "data.num_workers=0",
                f"data.cache_dir={run_dir}/cache",
                "trainer=cpu",
                "trainer.enable_progress_bar=false",
                "trainer.enable_model_summary=false",
                "logger=csv",
                f"run_dir={run_dir}",
                *overrides,
            ],
        )


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


# ---------------------------------------------------------------------- runs, checkpoints, resume
class Probe(Callback):
    """What the Trainer holds when training (re)starts."""

    def on_train_start(self, trainer, module) -> None:
        self.step = trainer.global_step
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]


def test_checkpoint_layout_and_resume(chats, tmp_path):
    from dflash2.export import draft_from_checkpoint

    run = tmp_path / "run"
    first = train(config(chats, run, "trainer.max_steps=3", "trainer.max_epochs=5"))
    last = Path(first["ckpt_path"])
    assert last == run / "checkpoints" / "last.ckpt" and first["global_step"] == 3
    assert first["start"]["val/tau_sim"] >= 1.0 and first["end"]

    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["dflash2"]["step"] == 3
    assert set(ckpt["dflash2"]) == {"manifest", "metrics", "step"}
    assert ckpt["dflash2"]["manifest"]["target"] == "tiny" and ckpt["dflash2"]["manifest"]["training_steps"] == 3
    assert ckpt["dflash2"]["metrics"]["val/tau_sim"] == first["end"]["val/tau_sim"]
    cfg = ckpt["hyper_parameters"]["draft_config"]
    assert cfg["dflash_config"]["selector_top_k"] == 4
    state = ckpt["state_dict"]
    assert all(k.startswith("draft.") for k in state)
    from dflash2.config import DFlash2Config

    assert {k.removeprefix("draft.") for k in state} == set(tensor_shapes(DFlash2Config.from_dict(cfg)))
    draft_from_checkpoint(ckpt)  # the exporter reads it

    probe = Probe()
    resumed = train(
        config(chats, run, f"ckpt_path={last}", "trainer.max_steps=5", "trainer.max_epochs=5"), callbacks=[probe]
    )
    assert resumed["run_dir"] == str(run) and resumed["global_step"] == 5
    assert probe.step == 3
    saved = ckpt["optimizer_states"][0]
    assert probe.optimizer["state"].keys() == saved["state"].keys()
    for i, s in saved["state"].items():
        assert int(probe.optimizer["state"][i]["step"]) == int(s["step"]) == 3
        assert torch.equal(probe.optimizer["state"][i]["exp_avg_sq"], s["exp_avg_sq"])
    assert probe.lr == ckpt["lr_schedulers"][0]["_last_lr"][0]


class Batches(Callback):
    """The token rows of every training batch, in order; with `kill_at`, the run dies when that batch arrives."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.rows: list[list[list[int]]] = []
        self.kill_at = kill_at

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if len(self.rows) + 1 == self.kill_at:
            raise RuntimeError("killed")
        self.rows.append(batch["input_ids"].tolist())


def test_a_run_killed_mid_epoch_resumes_the_epochs_order(chats, tmp_path):
    """Killed in its 5th batch of an 8-batch epoch, after the step-2 and step-4 validations, a run resumed from
    last.ckpt trains on batches 5 and 6 of the same order as an uninterrupted run, not on the epoch's start."""
    common = ["data.batch_size=2", "trainer.max_epochs=5", "validate_first=false", "trainer.max_steps=6"]
    common += ["trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
    whole, killed, resumed = Batches(), Batches(kill_at=5), Batches()
    train(config(chats, tmp_path / "whole", *common), callbacks=[whole])
    run = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="killed"):
        train(config(chats, run, *common), callbacks=[killed])
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4
    train(config(chats, run, *common, f"ckpt_path={last}"), callbacks=[resumed])
    assert len(whole.rows) == 6 and killed.rows == whole.rows[:4]
    assert resumed.rows == whole.rows[4:]


def test_last_checkpoint_is_the_latest_state_even_without_a_new_best(chats, tmp_path):
    """With the learning rate at 0, val/tau_sim never improves after the first validation: the best checkpoint stays
    at step 2 while last.ckpt (what a resume and the exporter read) follows every validation, to step 4."""
    run = tmp_path / "run"
    overrides = ["trainer.max_steps=4", "trainer.max_epochs=5", "trainer.val_check_interval=2"]
    result = train(config(chats, run, *overrides, "trainer.check_val_every_n_epoch=null", "optim.lr=0"))
    assert result["ckpt_path"] == str(run / "checkpoints" / "last.ckpt") and result["global_step"] == 4
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]


def test_mixed_precision_trains_with_gradient_clipping(chats, tmp_path):
    """trainer=gpu's bf16-mixed with the recipe's clipping: Lightning refuses a fused AdamW there, so none is used."""
    cfg = config(chats, tmp_path / "run", "trainer.max_steps=2", "trainer.precision=bf16-mixed", "validate_first=false")
    assert cfg.trainer.gradient_clip_val > 0 and cfg.optim.fused is None
    assert train(cfg)["global_step"] == 2


class TokenProbe(Callback):
    def __init__(self) -> None:
        self.tokens: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.tokens.append(int((batch["labels"] != -100).sum()))


def test_throughput_is_logged_in_trained_tokens(chats, tmp_path):
    """Lightning's ThroughputMonitor counts what a step trains on: the running token count is the labelled slots."""
    import pandas as pd

    probe = TokenProbe()
    train(config(chats, tmp_path / "run", "trainer.max_steps=4", "validate_first=false"), callbacks=[probe])
    metrics = pd.read_csv(next((tmp_path / "run" / "csv").rglob("metrics.csv")))
    logged = metrics.dropna(subset=["train/lengths"]).sort_values("step")
    assert len(probe.tokens) == 4 and logged["train/lengths"].tolist() == list(itertools.accumulate(probe.tokens))
    assert logged["train/time"].is_monotonic_increasing and logged["train/samples"].iloc[-1] == 4 * 4


class WandbProbe(Callback):
    def on_train_start(self, trainer, module) -> None:
        self.id = trainer.logger.experiment.id


def test_wandb_offline_run_is_resumed_with_the_same_id(chats, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run, probes = tmp_path / "run", [WandbProbe(), WandbProbe()]
    first = train(
        config(chats, run, "logger=wandb", "trainer.max_steps=2", "trainer.max_epochs=5"), callbacks=[probes[0]]
    )
    assert os.environ["WANDB_MODE"] == "offline"
    train(
        config(
            chats, run, "logger=wandb", f"ckpt_path={first['ckpt_path']}", "trainer.max_steps=3", "trainer.max_epochs=5"
        ),
        callbacks=[probes[1]],
    )
    run_id = (run / "wandb_id.txt").read_text().strip()
    assert probes[0].id == probes[1].id == run_id
    assert list((run / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_unavailable_target_fails_fast_in_one_sentence(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    start = time.time()
    done = subprocess.run(
        [sys.executable, "train.py", "model=qwen3", f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.time() - start < 60
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    assert "model.path=/local/dir" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "path, error", [("???", "set data.path=..."), ("missing.jsonl", "data.path='.*missing.jsonl'")]
)
def test_bad_data_path_fails_before_the_target_loads(chats, tmp_path, monkeypatch, path, error):
    from dflash2.target import TargetModel

    monkeypatch.setattr(TargetModel, "from_config", lambda *a, **k: pytest.fail("the target loaded first"))
    cfg = config(chats, tmp_path, f"data.path={path if path == '???' else tmp_path / path}")
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        train(cfg)
