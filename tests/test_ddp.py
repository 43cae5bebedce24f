"""Data parallelism: two CPU processes under Lightning's DDP (gloo) train what one process trains on the same global
batch: the same losses and training metrics, the same gradients at every step, the same validation metrics, and a
run killed and resumed under DDP ends where the single run ends.

The sizes make every edge appear: 15 training chats in global batches of 6 (two ranks of 3) end the epoch on a batch
of 3, which one rank fills with a padding row; 5 validation chats leave one rank a padding row too. The processes are
started here (torch.multiprocessing), each with the environment of a launched rank, so Lightning's DDP joins them
instead of launching the test's command line again.
"""

from __future__ import annotations

import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.callbacks import Callback
from training_setup import config

from dflash2.commands.train import run as train
from dflash2.data.collate import BlockCollator
from dflash2.data.sampling import GlobalBatchSampler
from dflash2.model.selector import CandidateSelector
from dflash2.training.losses import DraftSlots, SlotLoss, slot_weights

WORLD = 2
ROWS = 3  # per rank; the single run takes WORLD * ROWS
COMMON = (
    "draft.selector_top_k=256",  # wide enough that the gold is among the candidates now and then: the selector trains
    "data.val_size=5",
    "trainer.max_steps=3",
    "trainer.max_epochs=5",
    "trainer.val_check_interval=2",
    "trainer.check_val_every_n_epoch=null",
    "logger=none",
)
DDP = (
    "trainer=ddp",
    "trainer.accelerator=cpu",
    f"trainer.devices={WORLD}",
    "trainer.precision=32-true",
    "trainer.strategy={_target_:lightning.pytorch.strategies.DDPStrategy,process_group_backend:gloo}",
)
# The module's own training logs (not the clock's, nor the learning rate's).
NOT_COMPARED = ("time", "per_sec", "lengths", "samples", "batches", "flops", "lr-")


class Record(Callback):
    """What a run trains, step by step: its logged training metrics, the gradients each optimizer step takes, the
    validation metrics and the final weights. `kill_at`: the run dies when the batch after that many steps starts."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.kill_at = kill_at
        self.train: dict[int, dict[str, float]] = {}
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.val: dict[int, dict[str, float]] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.kill_at:
            raise RuntimeError("killed")

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        named = module.draft.named_parameters()
        self.grads[trainer.global_step] = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}

    def on_train_batch_end(self, trainer, module, *args) -> None:
        metrics = trainer.callback_metrics.items()
        self.train[trainer.global_step] = {
            k: float(v) for k, v in metrics if k.startswith("train/") and not any(s in k for s in NOT_COMPARED)
        }

    def on_validation_end(self, trainer, module) -> None:
        metrics = trainer.callback_metrics.items()
        self.val[trainer.global_step] = {k: float(v) for k, v in metrics if k.startswith("val/")}

    def on_train_end(self, trainer, module) -> None:
        self.weights = {k: v.detach().clone() for k, v in module.draft.state_dict().items()}

    def results(self) -> dict:
        return {"train": self.train, "grads": self.grads, "val": self.val, "weights": self.weights}


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_rank(rank: int, port: int, chats: Path, run: Path, out: Path, overrides: tuple[str, ...]) -> None:
    """One rank: the environment Lightning reads from a launcher, then the run killed after 2 steps and its resume."""
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(WORLD),
        "NODE_RANK": "0",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
    }
    torch.set_num_threads(1)
    killed, resumed = Record(kill_at=2), Record()
    with pytest.raises(RuntimeError, match="killed"):
        train(config(chats, run, *overrides), callbacks=[killed])
    last = run / "checkpoints" / "last.ckpt"
    train(config(chats, run, *overrides, f"ckpt_path={last}"), callbacks=[resumed])
    torch.save({"killed": killed.results(), "resumed": resumed.results()}, out / f"rank{rank}.pt")


def run_ranks(chats: Path, run: Path, out: Path, overrides: tuple[str, ...], timeout_s: float = 300) -> None:
    ctx = mp.start_processes(
        ddp_rank, args=(free_port(), chats, run, out, overrides), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the DDP ranks did not finish within {timeout_s} s")


def assert_same(single: dict[str, float], ddp: dict[str, float], what: str) -> None:
    assert single.keys() == ddp.keys(), what
    for k in single:
        assert ddp[k] == pytest.approx(single[k], rel=1e-5, abs=1e-6, nan_ok=True), f"{what}: {k}"


def assert_same_tensors(single: dict[str, torch.Tensor], ddp: dict[str, torch.Tensor], what: str, tol: float) -> None:
    assert single.keys() == ddp.keys(), what
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains_on_the_same_global_batch(chats, tmp_path):
    single = Record()
    cache = f"data.cache_dir={tmp_path}/cache"  # the single run renders the chats; the ranks read them
    train(config(chats, tmp_path / "single", *COMMON, cache, f"data.batch_size={WORLD * ROWS}"), callbacks=[single])
    assert sorted(single.train) == [1, 2, 3] and sorted(single.val) == [0, 2, 3]

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(chats, tmp_path / "ddp", out, (*COMMON, cache, f"data.batch_size={ROWS}", *DDP))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    killed, resumed = ranks[0]["killed"], ranks[0]["resumed"]
    assert sorted(killed["train"]) == [1, 2] and sorted(resumed["train"]) == [3]
    assert sorted(killed["val"]) == [0, 2] and sorted(resumed["val"]) == [3]

    for step, logged in single.train.items():
        assert_same(logged, (killed if step < 3 else resumed)["train"][step], f"training logs at step {step}")
    for step, metrics in single.val.items():
        assert_same(metrics, (killed if step < 3 else resumed)["val"][step], f"validation at step {step}")
    for step, grads in single.grads.items():
        assert_same_tensors(grads, (killed if step < 2 else resumed)["grads"][step], f"gradients of step {step}", 1e-5)
    # Every rank steps with the same (averaged) gradients: the ranks' drafters stay one.
    assert_same_tensors(ranks[0]["resumed"]["weights"], ranks[1]["resumed"]["weights"], "the ranks' weights", 0)
    assert_same_tensors(single.weights, resumed["weights"], "weights after the resumed step", 1e-5)


def replay(values: list[torch.Tensor]):
    """A rank_mean that answers with `values`, one call after the other."""
    it = iter(values)
    return lambda t: next(it)


@pytest.mark.parametrize("dpace", [None, 0.5], ids=["decay", "dpace"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_the_ranks_losses_average_to_the_global_batchs_loss_and_gradient(dpace, fused):
    """Rows split over two ranks that train unequal counts of slots: with `rank_mean`, the mean over the ranks of the
    losses and of their gradients (what DDP averages) is the loss and gradient of the whole batch, D-PACE weights
    included; normalised by each rank's own weights, neither is."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    v, h, b, n, s = 96, 16, 4, 5, 6
    labels = torch.randint(0, v, (b, n, s), generator=gen)
    labels[torch.rand(b, n, s, generator=gen) < 0.3] = -100
    labels[0, 2:] = -100  # rank 0's row trains fewer slots than each of rank 1's
    anchors, head = torch.randint(0, v, (b, n), generator=gen), torch.randn(v, h, generator=gen)
    hidden = torch.randn(b, n, s, h, generator=gen)
    sel = CandidateSelector(h, v, rank=4, top_k=32)
    with torch.no_grad():
        sel.successor_codebook.normal_(generator=gen)
    params = list(sel.parameters())

    def step(rows: slice, rank_mean=None):
        x = hidden[rows].clone().requires_grad_()
        slot_loss = SlotLoss(slot_weights(s + 1), dpace_alpha=dpace, fused=fused)
        out = slot_loss(DraftSlots(x, labels[rows], anchors[rows]), head, sel, rank_mean)
        loss = out.ce + out.selector
        return loss.detach(), torch.autograd.grad(loss, [x, *params])

    whole, whole_grads = step(slice(None))
    shares = [slice(0, 1), slice(1, None)]
    local: list[list[torch.Tensor]] = [[], []]  # what each rank asks to average over the ranks, in order
    for r, rows in enumerate(shares):
        step(rows, lambda t, r=r: local[r].append(t) or t)
    means = [(a + b) / 2 for a, b in zip(*local, strict=True)]
    for reduced in (True, False):
        ranks = [step(rows, replay(means) if reduced else None) for rows in shares]
        loss = sum(r[0] for r in ranks) / 2
        hidden_grad = torch.cat([r[1][0] for r in ranks]) / 2  # d (the ranks' mean loss) / d each rank's rows
        param_grads = [sum(g) / 2 for g in zip(*(r[1][1:] for r in ranks), strict=True)]
        close = [torch.allclose(loss, whole, rtol=1e-5), torch.allclose(hidden_grad, whole_grads[0], atol=1e-6)]
        close += [torch.allclose(g, w, rtol=1e-4, atol=1e-6) for g, w in zip(param_grads, whole_grads[1:], strict=True)]
        assert all(close) if reduced else not any(close[:2]), (reduced, close)


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_the_single_processs_global_batches_and_pad_without_repeating(drop_last):
    """N ranks of b rows train the batches of one process of N * b rows, rank r holding rows r, r + N, ... of each;
    the padding that evens the ranks' shares is marked, and no row comes twice. A sampler restored from its state
    continues the epoch it was in where it stopped."""
    rows, b, seed, epoch = random.randint(7, 30), random.randint(1, 4), random.randrange(100), random.randrange(5)
    data = list(range(rows))
    print(f"{rows} rows, {b} per rank, seed {seed}, epoch {epoch}")
    for world in (1, 2, 3):
        single = GlobalBatchSampler(data, 1, 0, True, seed, world * b, drop_last)
        single.set_epoch(epoch)
        draws = list(single)
        assert not any(d.padding for d in draws) and sorted(d.row for d in draws) == sorted(set(d.row for d in draws))
        assert len(draws) == (rows - rows % (world * b) if drop_last else rows)
        want = [draws[i : i + world * b] for i in range(0, len(draws), world * b)]
        shares = []
        for rank in range(world):
            sampler = GlobalBatchSampler(data, world, rank, True, seed, b, drop_last)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        assert len({len(share) for share in shares}) == 1  # the ranks step together
        batches = [[share[i : i + b] for i in range(0, len(share), b)] for share in shares]
        assert len(batches[0]) == len(want)
        for j, global_batch in enumerate(want):
            got = [d for i in range(b) for rank in range(world) for d in batches[rank][j][i : i + 1]]
            assert [d for d in got if not d.padding] == global_batch
            assert sum(d.padding for d in got) == len(got) - len(global_batch) < world
    sampler = GlobalBatchSampler(data, 2, 1, True, seed, b, drop_last)
    sampler.set_epoch(epoch)
    whole, it = list(sampler), iter(sampler)
    taken = [next(it) for _ in range(min(2, len(whole)))]
    restored = GlobalBatchSampler(data, 2, 1, True, seed, b, drop_last)
    restored.load_state_dict(sampler.state_dict())  # the epoch with it: Lightning may set it after the restore
    assert taken + list(restored) == whole and list(restored) == whole


def test_padding_rows_have_no_trained_block():
    """A padding draw's row comes with its anchors, but none of its blocks is valid, so it has no label."""
    collate = BlockCollator(block_size=4, mask_token_id=3)
    rows = [
        {"input_ids": torch.arange(10), "loss_mask": torch.ones(10), "anchors": torch.tensor([1, 4]), "padding": p}
        for p in (False, True)
    ]
    batch = collate(rows)
    assert batch["anchor_valid"].tolist() == [[True, True], [False, False]]
    assert (batch["labels"][0] != -100).any() and (batch["labels"][1] == -100).all()


def test_fsdp_on_the_cpu_is_refused_before_training(chats, tmp_path):
    """trainer=fsdp cannot run on CPU processes: Lightning's FSDP strategy takes GPUs only, and says so when the Trainer
    is built, before any step (the DDP parity above is what FSDP's gradient averaging relies on too)."""
    from dflash2.commands.train_checks import check_config

    overrides = ("trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true")
    cfg = config(chats, tmp_path, *overrides, "logger=none")
    refused = "trainer=fsdp requires a GPU accelerator.*trainer=ddp trainer.accelerator=cpu"
    with pytest.raises(ValueError, match=refused):
        check_config(cfg)  # train.py's checks: before the target or the data load
    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        train(cfg, callbacks=[Record(kill_at=0)])
