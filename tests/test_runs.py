"""Training runs on the tiny target: checkpoints, resume, precision, throughput and W&B logging, CLI errors."""

from __future__ import annotations

import copy
import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from training_setup import ROOT, config, tiny_overrides

from dflash2.commands.train import run as train
from dflash2.model.config import tensor_shapes
from dflash2.testing import tiny_target_path


class Probe(Callback):
    """What the Trainer holds when training (re)starts."""

    def on_train_start(self, trainer, module) -> None:
        self.step = trainer.global_step
        self.optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
        self.lr = trainer.optimizers[0].param_groups[0]["lr"]


@pytest.mark.slow
def test_checkpoint_layout_and_resume(chats, tmp_path):
    from dflash2.training.checkpoint import draft_from_checkpoint

    run = tmp_path / "run"
    first = train(config(chats, run, "trainer.max_steps=3", "trainer.max_epochs=5"))
    last = Path(first["ckpt_path"])
    assert last == run / "checkpoints" / "last.ckpt" and first["global_step"] == 3
    assert first["start"]["val/tau_sim"] >= 1.0 and first["end"]

    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 3 and ckpt["dflash2"]["step"] == 3
    assert set(ckpt["dflash2"]) == {"manifest", "metrics", "step"}
    assert ckpt["dflash2"]["manifest"]["target"] == "tiny" and ckpt["dflash2"]["manifest"]["training_steps"] == 3
    assert ckpt["dflash2"]["manifest"]["serve_model"] == tiny_target_path()  # what engines load: the folder
    assert ckpt["dflash2"]["metrics"]["val/tau_sim"] == first["end"]["val/tau_sim"]
    cfg = ckpt["hyper_parameters"]["draft_config"]
    assert cfg["dflash_config"]["selector_top_k"] == 4
    state = ckpt["state_dict"]
    assert all(k.startswith("draft.") for k in state)
    from dflash2.model.config import DFlash2Config

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


@pytest.mark.slow
@pytest.mark.parametrize("saved_by", ["validation", "time"])
def test_a_run_killed_mid_epoch_resumes_the_epochs_order(chats, tmp_path, saved_by):
    """Killed in its 5th batch of an 8-batch epoch, a run resumed from last.ckpt trains on batches 5 and 6 of the same
    order as an uninterrupted run, not on the epoch's start. last.ckpt was written by the step-4 validation, or with no
    validation before the end, by the timed checkpoint (train_time_interval, here 0: after every step)."""
    common = ["data.batch_size=2", "trainer.max_epochs=5", "validate_first=false", "trainer.max_steps=6"]
    if saved_by == "validation":
        common += ["trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
    else:
        common += ["callbacks.timed_checkpoint.train_time_interval.minutes=0"]
    whole, killed, resumed = Batches(), Batches(kill_at=5), Batches()
    train(config(chats, tmp_path / "whole", *common), callbacks=[whole])
    run = tmp_path / "killed"
    with pytest.raises(RuntimeError, match="killed"):
        train(config(chats, run, *common), callbacks=[killed])
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4
    done = train(config(chats, run, *common, f"ckpt_path={last}"), callbacks=[resumed])
    assert len(whole.rows) == 6 and killed.rows == whole.rows[:4]
    assert resumed.rows == whole.rows[4:]
    assert done["global_step"] == 6 and torch.load(last, weights_only=True)["global_step"] == 6


@pytest.mark.slow
def test_max_time_stops_a_run_at_its_budget_with_a_checkpoint(chats, tmp_path):
    """trainer.max_time (Lightning's Timer) ends a run long before its max_steps, and the run keeps what it trained:
    a last checkpoint at the step it stopped, which exports."""
    from dflash2.training.checkpoint import draft_from_checkpoint

    run = tmp_path / "run"
    out = train(config(chats, run, "trainer.max_time=00:00:00:02", "trainer.max_steps=100000", "trainer.max_epochs=-1"))
    ckpt = torch.load(Path(out["ckpt_path"]), weights_only=True)
    assert 0 < out["global_step"] < 100000 and ckpt["global_step"] == out["global_step"]
    draft_from_checkpoint(ckpt)


class GradModes(Callback):
    """The autograd modes each validation batch runs under, by the Trainer's entry point (validate or fit)."""

    def __init__(self) -> None:
        self.modes: list[tuple[str, bool, bool]] = []

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0) -> None:
        self.modes.append((trainer.state.fn.value, torch.is_inference_mode_enabled(), torch.is_grad_enabled()))


def test_the_first_validation_runs_in_the_grad_mode_of_fits_validations(chats, tmp_path):
    """validate_first and fit's validations both run under no_grad and neither under inference_mode: a compiled graph
    guards on the inputs being inference tensors, so a first validation under inference_mode would compile the
    drafter, the head's chunks and the target's layers once more inside the training's time."""
    probe = GradModes()
    train(config(chats, tmp_path / "run", "trainer.max_steps=2", "trainer.val_check_interval=1"), callbacks=[probe])
    assert {fn for fn, *_ in probe.modes} == {"validate", "fit"}
    assert {tuple(modes) for _, *modes in probe.modes} == {(False, False)}, probe.modes


@pytest.mark.slow
def test_last_checkpoint_is_the_latest_state_even_without_a_new_best(chats, tmp_path):
    """With the learning rate at 0, val/tau_sim never improves after the first validation: the best checkpoint stays
    at step 2 while last.ckpt (what a resume and the exporter read) follows every validation, to step 4."""
    run = tmp_path / "run"
    overrides = ["trainer.max_steps=4", "trainer.max_epochs=5", "trainer.val_check_interval=2"]
    result = train(config(chats, run, *overrides, "trainer.check_val_every_n_epoch=null", "optim.lr=0"))
    assert result["ckpt_path"] == str(run / "checkpoints" / "last.ckpt") and result["global_step"] == 4
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    # last.ckpt was the best's hard link after step 2; saving step 4 replaced the link, never wrote through it.
    best = run / "checkpoints" / "epoch=0-step=2.ckpt"
    assert torch.load(best, weights_only=True)["global_step"] == 2 and best.stat().st_nlink == 1


@pytest.mark.slow
def test_when_the_latest_validation_is_the_best_one_copy_is_kept(chats, tmp_path):
    """A run whose last validation is also its best keeps one file under two names (last.ckpt a hard link to the
    best), not two copies of the same state; a resume and the exporter read last.ckpt as before."""
    from dflash2.training.checkpoint import draft_from_checkpoint

    run = tmp_path / "run"
    result = train(config(chats, run, "trainer.max_steps=2", "trainer.max_epochs=5", "validate_first=false"))
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    last, best = folder / "last.ckpt", folder / "epoch=0-step=2.ckpt"
    assert result["ckpt_path"] == str(last) and last.samefile(best) and not last.is_symlink()
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 2 and draft_from_checkpoint(ckpt)
    resumed = train(config(chats, run, "trainer.max_steps=3", "trainer.max_epochs=5", f"ckpt_path={last}"))
    assert resumed["global_step"] == 3 and torch.load(last, weights_only=True)["global_step"] == 3


class FirstStepFc(Callback):
    """fc's weight when the first training batch arrives (callbacks see it before the module's own hook) and right
    before the first optimizer step."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if not hasattr(self, "start"):
            self.start = module.draft.fc.weight.detach().clone()

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        if not hasattr(self, "stepped"):
            self.stepped = module.draft.fc.weight.detach().clone()


@pytest.mark.slow
def test_feature_scaling_scales_a_fresh_run_once_and_a_resume_never(chats, tmp_path, caplog):
    """module.feature_scaling rescales fc's column blocks at a fresh run's first step (and logs the RMS it measured);
    a resumed run keeps the fc of its checkpoint. With objective.distill the soft CE is logged beside the hard one."""
    import pandas as pd

    run = tmp_path / "run"
    knobs = ["module.feature_scaling=true", "objective.distill=0.5", "trainer.max_epochs=5"]
    fresh, resumed = FirstStepFc(), FirstStepFc()
    with caplog.at_level(logging.INFO, logger="dflash2.training.module"):
        first = train(config(chats, run, *knobs, "trainer.max_steps=2"), callbacks=[fresh])
    assert len([r for r in caplog.records if r.message.startswith("feature scaling: target layers [1, 2]")]) == 1
    h = fresh.start.shape[0]
    ratios = (fresh.stepped / fresh.start).view(h, 2, h)  # one factor per target layer's block of columns
    assert torch.allclose(ratios, ratios[:1, :, :1].expand_as(ratios)) and not torch.allclose(ratios, torch.ones(1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.training.module"):
        train(config(chats, run, *knobs, "trainer.max_steps=3", f"ckpt_path={first['ckpt_path']}"), callbacks=[resumed])
    assert not [r for r in caplog.records if r.message.startswith("feature scaling")]
    assert torch.equal(resumed.start, resumed.stepped)
    metrics = pd.concat(pd.read_csv(f) for f in sorted(run.glob("csv/*/metrics.csv")))
    for name in ("train/loss_ce", "train/loss_distill", "val/loss_ce", "val/loss_distill"):
        assert metrics[name].notna().any(), name
    # The soft CE is a cross-entropy against a spread-out distribution, not the hard one.
    assert not (metrics["val/loss_distill"].dropna().to_numpy() == metrics["val/loss_ce"].dropna().to_numpy()).any()


def test_mixed_precision_trains_with_gradient_clipping(chats, tmp_path):
    """trainer=gpu's bf16-mixed with the recipe's clipping: Lightning refuses a fused AdamW there, so none is used."""
    cfg = config(chats, tmp_path / "run", "trainer.max_steps=2", "trainer.precision=bf16-mixed", "validate_first=false")
    assert cfg.trainer.gradient_clip_val > 0 and cfg.optim.fused is None
    assert train(cfg)["global_step"] == 2


@pytest.mark.slow
def test_a_fused_adamw_under_bf16_mixed_clips_as_the_foreach_one(chats, tmp_path):
    """optim.fused=true under bf16-mixed, where Lightning's plugin would refuse to clip: the module clips by norm, and
    three steps end on the foreach step's weights; with no clipping they end elsewhere, so the clip acted."""
    from dflash2.training.checkpoint import load_checkpoint

    seed = random.randrange(2**31)
    print(f"seed {seed}")

    def weights(name: str, *overrides: str) -> dict[str, torch.Tensor]:
        cfg = config(chats, tmp_path / name, "trainer.max_steps=3", "trainer.precision=bf16-mixed", f"seed={seed}",
                     "validate_first=false", "trainer.gradient_clip_val=0.05", *overrides)  # fmt: skip
        return load_checkpoint(train(cfg)["ckpt_path"])["state_dict"]

    fused, foreach = weights("fused", "optim.fused=true"), weights("foreach", "optim.fused=false")
    unclipped = weights("unclipped", "optim.fused=true", "trainer.gradient_clip_val=null")
    assert fused.keys() == foreach.keys()
    for name, w in fused.items():
        torch.testing.assert_close(w, foreach[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(w, unclipped[name], rtol=1e-4, atol=1e-5) for name, w in fused.items())


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


@pytest.mark.slow
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


def offline_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python train.py ...` with the Hugging Face Hub offline and an empty cache, its run folder tmp_path/run."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    command = [sys.executable, "train.py", *args, f"run_dir={tmp_path / 'run'}"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_an_unavailable_target_fails_fast_in_one_sentence(tmp_path):
    """`python train.py model=qwen3` offline, without Qwen3-8B in the cache: one sentence naming model.path, before
    anything loads, no traceback and no run folder."""
    start = time.time()
    done = offline_cli(tmp_path, "model=qwen3")
    assert time.time() - start < 60
    assert done.returncode != 0 and not done.stdout
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "model.path=/local/dir" in done.stderr and "HF_HUB_OFFLINE=1" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_missing_recipe_data_names_the_command_that_makes_it(tmp_path):
    """With its target found (here the tiny one's folder, with SmolLM2's vocabulary hence its mask token, and its 4
    layers), the Qwen3 experiment's missing data fails in one sentence naming the recipe command that writes exactly
    its files."""
    fits_tiny = ["model.mask_token_id=3", "draft.target_layer_ids=[1,2]"]
    done = offline_cli(tmp_path, "model=qwen3", f"model.path={tiny_target_path()}", *fits_tiny)
    assert done.returncode != 0 and not done.stdout
    assert done.stderr.strip().count("\n") == 0, done.stderr
    command = (
        f"`python -m dflash2.commands.recipe model=qwen3 model.path={tiny_target_path()} "
        "output=data/regenerated/qwen3.jsonl extra_output=data/regenerated/qwen3_recipe.jsonl`"
    )
    assert done.stderr.startswith("data.path='data/regenerated/qwen3.jsonl' does not exist") and command in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, error",
    [
        ("data.path=???", "set data.path=..."),
        ("data.path={tmp}/missing.jsonl", "data.path='.*missing.jsonl'"),
        ("data.extra_paths=[{tmp}/missing.jsonl]", "data.extra_paths: '.*missing.jsonl'"),
    ],
)
def test_bad_data_path_fails_before_the_target_loads(chats, tmp_path, monkeypatch, override, error):
    from dflash2.target.model import TargetModel

    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("the target loaded first"))
    cfg = config(chats, tmp_path, override.format(tmp=tmp_path))
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        train(cfg)


def leaves(tree: dict, prefix: str = ""):
    """(dotted key, value) of every leaf of a nested dict."""
    for key, value in tree.items():
        yield from leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(prefix + key, value)]


def select(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def compose_train(*overrides: str):
    """train.py's config for a command line, with Hydra's node (its choices)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=True)


def task(cfg) -> dict:
    """The config a run gets, without Hydra's own node."""
    from omegaconf import OmegaConf

    return {k: v for k, v in OmegaConf.to_container(cfg).items() if k != "hydra"}


def test_each_model_trains_with_its_own_experiment():
    """`python train.py` is model=smollm2's experiment, the quickstart: every size of configs/quickstart/smollm2.yaml;
    `model=qwen3` is Qwen3-8B's recipe (data=jsonl's keys, its regenerated data, 5 draft layers), as `experiment=qwen3`
    alone is; `~experiment` keeps the groups' own sizes, and another experiment replaces the model's."""
    import yaml
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    sizes = dict(leaves(yaml.safe_load((ROOT / "configs" / "quickstart" / "smollm2.yaml").read_text())))
    default = compose_train()
    assert default.hydra.runtime.choices["experiment"] == "smollm2" and default.model.name == "smollm2"
    quickstart = task(default)
    for key, value in sizes.items():
        assert select(quickstart, key) == value, key
    assert task(compose_train("model=smollm2")) == quickstart

    plain = task(compose_train("model=smollm2", "~experiment"))
    choices = default.hydra.runtime.choices
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        groups = {g: OmegaConf.to_container(compose(f"{g}/{choices[g]}")) for g in ("draft", "data")}
    for key in (k for k in sizes if k.split(".")[0] in groups):
        group = key.split(".")[0]  # a group's config composes under its package: {"draft": {...}}
        assert select(plain, key) == select(groups[group], key), f"{key} is not the {group} group's own"
    assert plain["draft"]["block_size"] != sizes["draft.block_size"] and plain["task_name"] == "train"

    recipe = yaml.safe_load((ROOT / "configs" / "experiment" / "qwen3.yaml").read_text())
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        jsonl = OmegaConf.to_container(compose("data/jsonl"))["data"]
    for typed in (["model=qwen3"], ["experiment=qwen3"]):
        qwen3 = compose_train(*typed)
        assert qwen3.hydra.runtime.choices["experiment"] == "qwen3", typed
        assert qwen3.model.name == "qwen3" and qwen3.task_name == "qwen3", typed
        assert OmegaConf.to_container(qwen3.draft) | recipe["draft"] == OmegaConf.to_container(qwen3.draft), typed
        assert OmegaConf.to_container(qwen3.data) == jsonl | recipe["data"], typed
    assert compose_train("model=qwen3", "~experiment").draft.num_hidden_layers == plain["draft"]["num_hidden_layers"]
    gpu = compose_train("experiment=gpu_smollm2")
    assert gpu.draft.block_size == 16 and gpu.task_name == "gpu_smollm2" and gpu.model.name == "smollm2"
    # The GPU recipe trains the model group's target: a study rehearses it on the tiny one.
    rehearsal = compose_train("experiment=gpu_smollm2", "model=tiny")
    assert rehearsal.model.name == "tiny" and rehearsal.model.gguf_file is None and rehearsal.draft.block_size == 16


@pytest.mark.slow
@pytest.mark.parametrize("model, experiment", [("tiny", "quickstart"), ("tiny", "qwen3"), ("qwen3", "smollm2")])
def test_a_model_typed_beside_another_targets_experiment_is_refused(tmp_path, model, experiment):
    """A model-named experiment brings its target's config: `model=X experiment=Y` for another target's Y would train
    Y's target, so it fails in one sentence naming both and the fixes, before anything loads and without a run
    folder."""
    done = train_cli(f"model={model}", f"experiment={experiment}", f"run_dir={tmp_path / 'run'}")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f"model={model} is typed beside experiment={experiment}, which trains model=" in last
    assert "~experiment" in last
    assert not (tmp_path / "run").exists()


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


# ---------------------------------------------------------------------------------------------- train.py itself
def train_cli(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`python train.py ...` as a user runs it, off a terminal (stdout a file or a pipe)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "train.py", *args]
    return subprocess.run(command, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600)


@pytest.fixture(scope="module")
def cli_run(chats, tmp_path_factory):
    """A 4-step run validating at steps 2 and 4, its output to a file (stderr in train.err) with Lightning's progress
    bar, its model summary and W&B on as configured by default. With the learning rate at 0 the best checkpoint stays
    the step-2 one, a point to resume from."""
    run = tmp_path_factory.mktemp("cli") / "run"
    lines = ["trainer.max_steps=4", "trainer.max_epochs=5", "trainer.val_check_interval=2", "optim.lr=0"]
    lines += ["trainer.check_val_every_n_epoch=null", "trainer.enable_progress_bar=true"]
    lines += ["trainer.enable_model_summary=true", "logger=wandb"]  # as configured by default
    out = run.parent / "train.out"
    with out.open("w") as f:
        done = train_cli(*tiny_overrides(chats, run, *lines), stdout=f)
    assert done.returncode == 0, done.stderr[-3000:]
    (run.parent / "train.err").write_text(done.stderr)
    return run, out.read_text()


# What a run's output to a file must not hold: bar frames and terminal codes, Lightning's model summary table and
# device banner, library deprecation warnings (W&B's `anonymous`), an advertisement, W&B's history sparklines.
NOT_LOG_LINES = ("\r", "\x1b", "\N{BOX DRAWINGS HEAVY HORIZONTAL}", "it/s]", "Trainable params", "GPU available",
                 "TPU available", "Warning", "WARNING", "deprecated", "anonymous", "Tip:", "Loading weights",
                 "Rendering chats", "flops_per_batch", "Run history", "\N{LOWER ONE EIGHTH BLOCK}")  # fmt: skip


@pytest.mark.slow
def test_output_to_a_file_keeps_to_the_runs_lines(cli_run):
    """Off a terminal (nohup, `> file`) the output holds log lines only (NOT_LOG_LINES): each library's noise is off
    by its own switch (Lightning's enable_model_summary and rank_zero logger, W&B's quiet setting, warnings filters)."""
    run, stdout = cli_run
    output = stdout + (run.parent / "train.err").read_text()
    for noise in NOT_LOG_LINES:
        assert noise not in output, (noise, output)
    assert "validation at step 4: tau_sim " in output and "train: 4/4 steps" in output  # dflash2's own lines


@pytest.mark.slow
def test_the_first_log_line_says_what_the_run_trains(cli_run):
    run, _ = cli_run
    first = (run / "train.log").read_text().splitlines()[0]
    assert first.split(" - ", 1)[1].startswith(f"experiment=tiny: target tiny ({tiny_target_path()}), "), first
    for part in ("DFlash2 drafter of 1 draft layer over target layers [1, 2]", "block size 4",
                 "batch 4 chats of max_length 128", "4 steps (at most 5 epochs)", "trainer cpu"):  # fmt: skip
        assert part in first, (part, first)


def test_the_quickstarts_line_names_it_and_its_sizes():
    """What `python train.py` logs first: the experiment (model=smollm2's, which runs the quickstart) and every size
    that makes it the quickstart."""
    from dflash2.commands.train_groups import resolve_drafter
    from dflash2.training.run import describe_run

    cfg = compose_train("trainer=cpu")
    d = cfg.draft
    line = describe_run(cfg, cfg.hydra.runtime.choices.experiment, resolve_drafter(cfg))
    assert line == (
        "experiment=smollm2, task quickstart: target smollm2 (the embedded GGUF), DFlash2 drafter of "
        f"{d.num_hidden_layers} draft "
        f"layer over target layers {list(d.target_layer_ids)}, block size {d.block_size}, batch {cfg.data.batch_size} "
        f"chats of max_length {cfg.data.max_length}, data sharegpt (first {cfg.data.limit}), "
        f"{cfg.trainer.max_epochs} epoch, trainer cpu"
    )


@pytest.mark.slow
def test_train_log_holds_each_validation_and_the_summary_off_a_terminal(cli_run):
    run, stdout = cli_run
    log = (run / "train.log").read_text()
    for step in (0, 2, 4):
        assert f"validation at step {step}: tau_sim " in log
    assert "train: 4/4 steps" in log  # the steps too, at most every 30 s: here the last one only
    assert "steps       4 in" in log and f"checkpoint  {run / 'checkpoints' / 'last.ckpt'}" in log
    assert "validation at step 4: tau_sim " in stdout and "steps       4 in" in stdout


@pytest.mark.slow
def test_resume_runs_with_the_runs_settings_and_keeps_its_record(cli_run):
    """Resumed from step 2 with nothing but the checkpoint (plus a group retyped as it was, and one new setting), the
    run goes on to its own max_steps=4 (the defaults would train for epochs), and its record stays as it was."""
    run, _ = cli_run
    record = {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")}
    assert set(record) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    resume = ['ckpt_path="' + str(run / "checkpoints" / "epoch=0-step=2.ckpt") + '"', "model=tiny"]
    done = train_cli(*resume, "trainer.log_every_n_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")} == record
    (resumed,) = (run / ".hydra").glob("resume-*")
    from omegaconf import OmegaConf

    assert OmegaConf.load(resumed / "overrides.yaml") == [*resume, "trainer.log_every_n_steps=3"]
    cfg = OmegaConf.load(resumed / "config.yaml")
    assert cfg.trainer.max_steps == 4 and cfg.trainer.log_every_n_steps == 3 and cfg.model.name == "tiny"
    done = train_cli(*resume, "model=smollm2")
    assert done.returncode != 0 and "model=smollm2" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_killed_run_resumes_from_its_timed_checkpoint(chats, tmp_path, stop):
    """A run whose output goes to files, stopped (SIGTERM, or Ctrl-C's SIGINT) between validations once its timed
    checkpoint exists, says so in its output and train.log with the checkpoint and the command that resumes it, the
    README's `python train.py ckpt_path=<run>/checkpoints/last.ckpt`; that command resumes from that step and finishes
    in the same folder, and its summary counts the steps it trained, the run's total beside them. The stopped run's
    output holds log lines only (W&B's run is closed as failed, not left to W&B's exit hook, which prints terminal
    codes)."""
    run, out = tmp_path / "run", tmp_path / "train.out"
    timed = "callbacks.timed_checkpoint.train_time_interval.minutes=0"  # last.ckpt after every step
    last = run / "checkpoints" / "last.ckpt"
    lines = tiny_overrides(chats, run, "trainer.max_steps=100000", "trainer.max_epochs=-1", "logger=wandb", timed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with out.open("w") as stdout, (tmp_path / "train.err").open("w") as stderr:
        killed = subprocess.Popen(
            [sys.executable, "train.py", *lines], cwd=ROOT, env=env, stdout=stdout, stderr=stderr,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job has it
        )  # fmt: skip
        try:
            while not last.is_file() and killed.poll() is None:  # the first step's checkpoint: fit is running
                time.sleep(0.5)
            killed.send_signal(stop)
            killed.wait(timeout=300)
        finally:
            killed.kill()
    output = out.read_text() + (tmp_path / "train.err").read_text()
    for noise in NOT_LOG_LINES:
        assert noise not in output, (noise, output)
    step = torch.load(last, weights_only=True)["global_step"]
    assert 0 < step < 100000 and "Traceback" not in output
    told = f"its last checkpoint, {last} (step {step}), resumes it with its own settings: python train.py ckpt_path="
    told += str(last)
    assert told in out.read_text() and told in (run / "train.log").read_text()

    done = train_cli(f"ckpt_path={last}", f"trainer.max_steps={step + 2}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert torch.load(last, weights_only=True)["global_step"] == step + 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "train.err", "train.out"]
    assert f"resuming {last} (experiment=tiny)" in (run / "train.log").read_text()
    assert f"resuming at step {step}; no validation before the first step" in done.stdout
    assert "steps       2 in " in done.stdout and f"(resumed at step {step}: {step + 2} in all)" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ["missing", "truncated", "not_a_training_state"])
def test_a_resume_that_cannot_start_writes_and_logs_nothing(tmp_path, checkpoint):
    """A resume whose checkpoint is missing, unreadable or not a training checkpoint fails in one sentence naming
    ckpt_path, before the run's record, data, W&B run or log are touched: the run folder is left as it was."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "last.ckpt"
    if checkpoint == "truncated":
        torch.save({"state_dict": {"draft.w": torch.zeros(1000)}, "loops": {}}, ckpt)
        ckpt.write_bytes(ckpt.read_bytes()[:2000])
    elif checkpoint == "not_a_training_state":
        torch.save({"draft.w": torch.zeros(3)}, ckpt)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    done = train_cli(f"ckpt_path={ckpt}", "logger=wandb")
    assert done.returncode != 0 and not done.stdout
    assert done.stderr.strip().count("\n") == 0 and "ckpt_path" in done.stderr, done.stderr
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


@pytest.mark.parametrize(
    "override, error",
    [
        ("draft.conv_group_size=7", "draft.conv_group_size: 7 does not divide hidden_size 64"),
        ("draft.block_size=1", "draft.block_size: is 1"),
        ("draft.selector_top_k=0", "draft.selector_rank/draft.selector_top_k: are 8/0"),
        ("draft.target_layer_ids=[1,9]", r"draft.target_layer_ids: \[9\] out of range"),
        ("model.mask_token_id=null", "draft.mask_token_id: must be set explicitly"),
        ("objective.distill=1.5", r"objective.distill=1.5: .* must be in \[0, 1\]"),
        ("optim.warmup_ratio=1.5", r"optim.warmup_ratio=1.5: .* in \[0, 1\)"),
        ("module.init_std=-0.02", "module.init_std=-0.02: .* must be > 0"),
        ("trainer=fsdp", "module.feature_scaling=true .* FSDP"),
        ("model.compile=fast", "model.compile='fast': set it to true, false or one of torch.compile's modes"),
        ("data.drop_last=yes", "data.drop_last='yes': set it to true or false"),
        ("data.copy_anchor_weight=0", "data.copy_anchor_weight=0: .* a number > 0"),
        ("data.copy_anchor_min_match=4", r"data.copy_anchor_min_match=4: .* from 1 to 3 \(block_size=4"),
        ("objective.late_slot_weight=-1", "objective.late_slot_weight=-1: .* a number > 0"),
        ("objective.late_slot_start=4", "objective.late_slot_start=4: a block of draft.block_size=4"),
        ("optim.lr=abc", r"optim.lr=abc: give a number here, e.g. optim.lr=0.0006"),
        ("optim.betas=[0.9,abc]", r"optim.betas=\[0.9,abc\]: give a list of numbers here, e.g. optim.betas=\[0.9,"),
        ("objective.dpace_alpha=half", "objective.dpace_alpha=half: give a number here, e.g. objective.dpace_alpha="),
        ("trainer.max_steps=ten", "trainer.max_steps=ten: give an integer here, e.g. trainer.max_steps=-1"),
        ("trainer.gradient_clip_val=x", "trainer.gradient_clip_val=x: give a number here"),
        ("callbacks.step_rate.skip=x", "callbacks.step_rate.skip=x: give an integer here"),
    ],
)
def test_a_bad_drafter_setting_fails_before_the_target_loads(chats, tmp_path, monkeypatch, override, error):
    from dflash2.target.model import TargetModel

    monkeypatch.setattr(TargetModel, "load", lambda *a, **k: pytest.fail("the target loaded first"))
    overrides = [override, "module.feature_scaling=true"] if override == "trainer=fsdp" else [override]
    with pytest.raises(ValueError, match=error):
        train(config(chats, tmp_path / "run", *overrides))


def test_train_py_checks_its_config_once_and_resolves_its_drafter_once(chats, tmp_path, monkeypatch):
    """`python train.py`'s whole path in this process (the console entry, Hydra, PrepareRun, the task): the config is
    checked once, before the run folder exists, the drafter's config is resolved once and passed on, and the libraries
    are quieted once."""
    from dflash2 import commands
    from dflash2.commands import train as command
    from dflash2.commands import train_checks, train_groups

    calls: dict[str, int] = {}

    def counted(name: str, f=lambda *a, **k: None):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return f(*args, **kwargs)

        return wrapper

    check = counted("check_config", train_checks.check_config)
    monkeypatch.setattr(train_checks, "check_config", check)  # PrepareRun's
    monkeypatch.setattr(command, "check_config", check)  # the task's, for a config nobody checked
    monkeypatch.setattr(train_groups, "draft_config", counted("draft_config", train_groups.draft_config))
    monkeypatch.setattr(commands, "quiet_libraries", counted("quiet_libraries"))
    run = tmp_path / "run"
    line = tiny_overrides(chats, run, "trainer.max_steps=1", "validate_first=false", "logger=none")
    monkeypatch.setattr(sys, "argv", ["train.py", *line])
    handlers, level = logging.root.handlers[:], logging.root.level
    try:
        command.main()
    finally:  # Hydra's job logging (train.log) is this run's only
        for handler in set(logging.root.handlers) - set(handlers):
            handler.close()
        logging.root.handlers[:], logging.root.level = handlers, level
    assert calls == {"check_config": 1, "draft_config": 1, "quiet_libraries": 1}
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1
    assert "steps       1 in" in (run / "train.log").read_text()


def test_a_resumed_runs_summary_counts_the_steps_it_trained():
    """A resumed run's summary: the steps this process trained, the step it resumed at and the run's total, and the
    validation its checkpoint recorded as where it started."""
    from dflash2.training.run import summary

    begun, trained = random.randint(1, 500), random.randint(1, 500)
    start, end = random.uniform(1, 2), random.uniform(2, 3)
    result = {"run_dir": "r", "ckpt_path": "c", "start": {"val/tau_sim": start}, "end": {"val/tau_sim": end},
              "start_step": begun, "global_step": begun + trained, "seconds": 90.0}  # fmt: skip
    lines = summary(result).splitlines()
    assert lines[2] == f"steps       {trained} in 1.5 min (resumed at step {begun}: {begun + trained} in all)"
    assert (
        lines[3]
        == f"val tau_sim {start:.3f} (the checkpoint's latest validation) -> {end:.3f} at step {begun + trained}"
    )
    fresh = summary(result | {"start_step": 0, "global_step": trained}).splitlines()
    assert fresh[2] == f"steps       {trained} in 1.5 min"
    assert fresh[3] == f"val tau_sim {start:.3f} at step 0 -> {end:.3f} at step {trained}"


def test_a_malformed_data_file_leaves_no_wandb_run(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"id": "0", "messages": [{"role": "user", "content": "hi"}]}\n{"id": "1", "messages": [\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        train(config(data, tmp_path / "run", "logger=wandb"))
    assert not (tmp_path / "run" / "wandb").exists() and not (tmp_path / "run" / "wandb_id.txt").exists()


@pytest.mark.parametrize(
    "bad, error",
    [
        ("draft.conv_group_size=7", "draft.conv_group_size: 7 does not divide"),
        ("optim.lr=abc", "optim.lr=abc: give a number here, e.g. optim.lr=0.0006"),
        ("data", "line 1 is not"),
    ],
)
@pytest.mark.slow
def test_bad_input_leaves_no_run_folder(chats, tmp_path, bad, error):
    """train.py checks the drafter's settings and the data file before Hydra makes the run folder (and train.log)."""
    data, overrides = chats, [bad]
    if bad == "data":
        data, overrides = tmp_path / "chats.jsonl", []
        data.write_text(chats.read_text().replace("}]}", "}]", 1))  # the first record's JSON is cut short
    done = train_cli(*tiny_overrides(data, tmp_path / "run", "logger=wandb", *overrides))
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert error in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()
