"""Training runs on the tiny target: checkpoints, resume, precision, throughput and W&B logging, CLI errors."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from training_setup import ROOT, config

from dflash2.config import tensor_shapes
from dflash2.training import train


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


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml")))
def test_draft_dflash_is_plain_dflash_under_every_experiment(experiment):
    # An experiment restating a head size would give the `draft=dflash` baseline a selector or a conv.
    from hydra import compose, initialize_config_dir

    heads = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        dflash = compose("train", overrides=[f"experiment={experiment}", "draft=dflash"]).draft
        dflash2 = compose("train", overrides=[f"experiment={experiment}", "draft=dflash2"]).draft
    assert {h: dflash[h] for h in heads} == dict.fromkeys(heads, 0)
    assert all(dflash2[h] > 0 for h in heads), dflash2
