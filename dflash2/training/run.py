"""`python train.py`: build the target, data, drafter, logger and Trainer from the Hydra config, then fit.

A resumed run (`ckpt_path=<run>/checkpoints/last.ckpt`) reuses its run directory, its settings (from its Hydra
record, dflash2.training.resume) and its W&B run id, and Lightning restores the step count, optimizer and scheduler
from the checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash2.groups import build
from dflash2.model.config import DFlash2Config
from dflash2.progress import Progress, interactive, quiet_libraries
from dflash2.target.locate import serve_model
from dflash2.target.manifest import target_identity
from dflash2.training.checkpoint import run_dir_of
from dflash2.training.checks import check_config
from dflash2.training.drafter import check_target, resolve_drafter, warm_start_replaced
from dflash2.training.resume import RECORD, hydra_subdir

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_id.txt"
DEFAULT_TASK = "train"  # task_name when no experiment names the run (configs/train.yaml)
QUICKSTART_TASK = "quickstart"  # the CPU quickstart's task_name (configs/quickstart/smollm2.yaml)


def _run_dir(ckpt_path: str | None, default: str) -> str:
    return str(run_dir_of(ckpt_path)) if ckpt_path else default


def _precision() -> str:
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def register_resolvers() -> None:
    """`${dflash2_run_dir:ckpt,default}` (a resumed run keeps its folder), `${dflash2_hydra_subdir:ckpt,time}` (a
    resume's Hydra record goes beside the run's own) and `${dflash2_precision:}`."""
    if not OmegaConf.has_resolver("dflash2_run_dir"):
        OmegaConf.register_new_resolver("dflash2_run_dir", _run_dir, use_cache=True)
    if not OmegaConf.has_resolver("dflash2_hydra_subdir"):
        OmegaConf.register_new_resolver("dflash2_hydra_subdir", hydra_subdir, use_cache=True)
    if not OmegaConf.has_resolver("dflash2_precision"):
        OmegaConf.register_new_resolver("dflash2_precision", _precision)


class ValidateAtMaxSteps(Callback):
    """Make a run that ends on `max_steps` inside an epoch validate (and checkpoint) at its last step.

    Lightning validates when a stop is requested, but reaching max_steps is not a request; this makes it one.
    """

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True


class LogTrainingProgress(Callback):
    """Off a terminal, where Lightning's progress bar shows nothing until the run ends, the training steps as log
    lines (dflash2.progress.Progress: one every LOG_INTERVAL_S) with the bar's metrics, so train.log has them."""

    def __init__(self) -> None:
        self.bar: Any = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        if trainer.is_global_zero and not interactive():
            total = int(trainer.estimated_stepping_batches)
            self.bar = Progress(total=total, initial=trainer.global_step, desc="train", unit="steps", miniters=0)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.bar is not None:
            # Reading the metrics waits for the device to finish the step: only when a log line is due.
            if time.time() - self.bar.last_print_t >= self.bar.mininterval:
                self.bar.set_postfix(trainer.progress_bar_metrics, refresh=False)
            self.bar.update(trainer.global_step - self.bar.n)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(trainer.progress_bar_metrics, refresh=False)
            self.bar.close()
            self.bar = None


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt`, the state at the latest validation (what a resume and the exporter read), kept as one file with the
    best checkpoint when it is the same state: when another ModelCheckpoint (the best by val/tau_sim) has just saved
    this step, last.ckpt becomes a hard link to that file instead of a second copy (a 356 MB drafter's run would
    otherwise keep two). Every tool sees a plain, complete file; when the best moves on, Lightning deletes the old
    name and last.ckpt keeps the data, and the next full save replaces the link (Lightning writes a temp file and
    renames it over the name), so the best file is never written through it. A file system without hard links gets
    the second copy, as before."""

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key, under which runs started before this class saved its state: they resume unwarned.
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
        same = self._saved_this_step(trainer)
        if same is None or not self._link(trainer, same, filepath):
            super()._save_checkpoint(trainer, filepath)
            return
        # What ModelCheckpoint._save_checkpoint records after a save.
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))

    def _saved_this_step(self, trainer: Any) -> str | None:
        """The file the best checkpoint's callback wrote at this very step (same trainer state), if any. Not a timed
        save's (timed_checkpoint): that one is written after the step, before the step's validation."""
        for callback in trainer.checkpoint_callbacks:
            if callback is self or callback.monitor is None or callback._last_global_step_saved != trainer.global_step:
                continue
            if callback._last_checkpoint_saved and not callback.save_weights_only and not self.save_weights_only:
                return callback._last_checkpoint_saved
        return None

    @staticmethod
    def _link(trainer: Any, source: str, filepath: str) -> bool:
        """Hard-link `filepath` to `source` atomically (a temp link renamed over it), on rank 0; every rank learns
        whether it worked."""
        linked = False
        if trainer.is_global_zero:
            tmp = f"{filepath}.link-tmp"
            try:
                if os.path.lexists(tmp):
                    os.remove(tmp)
                os.link(source, tmp)
                os.replace(tmp, filepath)
                linked = True
            except OSError as e:
                log.debug("last.ckpt as a copy: cannot hard-link %s (%s)", source, e)
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        return bool(trainer.strategy.broadcast(linked))


def load_target(cfg: DictConfig, draft: DFlash2Config) -> Any:
    """The target of the `model` group, capturing the layers `draft` reads, checked to be the target `draft` was
    resolved for (dflash2.training.drafter.check_target)."""
    # With data.features the cache replaces the target's layers: only its embedding, norm and head are loaded.
    layers = not cfg.data.get("features")
    target = build(cfg.model, target_layer_ids=list(draft.target_layer_ids), layers=layers)
    check_target(draft, cfg.draft, target)
    return target


def target_and_draft(cfg: DictConfig) -> tuple[Any, DFlash2Config]:
    """The run's drafter config (`resolve_drafter`) and its target, loaded for it: what the data and feature commands
    and the benchmarks build as training does."""
    draft = resolve_drafter(cfg)
    return load_target(cfg, draft), draft


def build_logger(cfg: DictConfig, run_dir: Path) -> Any:
    if not cfg.get("logger") or not cfg.logger.get("_target_"):
        return False
    kwargs: dict[str, Any] = {}
    wandb = cfg.logger._target_.endswith("WandbLogger")
    if wandb:
        # W&B offline unless the user chose a mode; one run id per run dir, so a resume continues the run.
        os.environ.setdefault("WANDB_MODE", "offline")
        id_file = run_dir / WANDB_ID_FILE
        if not cfg.logger.get("id"):
            if not id_file.is_file():
                id_file.parent.mkdir(parents=True, exist_ok=True)
                id_file.write_text(uuid.uuid4().hex[:8])
            kwargs["id"] = id_file.read_text().strip()
        if not interactive() and not cfg.logger.get("settings"):
            import wandb as wandb_sdk

            # W&B's own switch for its non-essential lines (its version, the history as sparklines at the end): off a
            # terminal they are not log lines; the run's W&B files keep everything.
            kwargs["settings"] = wandb_sdk.Settings(quiet=True)
    logger = build(cfg.logger, **kwargs)
    if wandb:
        # Lightning's WandbLogger (2.6) passes wandb.init `anonymous` whatever the config says, an argument W&B has
        # deprecated and warns about on every run: dropped, as by a logger that never sets it.
        getattr(logger, "_wandb_init", {}).pop("anonymous", None)
    return logger


def finish_wandb(logger: Any, exit_code: int = 0) -> None:
    """Close the W&B run (a later train() then starts its own), also when the run fails: W&B's own exit hook would
    otherwise print its closing lines to stdout with terminal colours, into the output file of a run off a terminal."""
    if isinstance(logger, WandbLogger):
        logger.experiment.finish(exit_code=exit_code)


def build_data(cfg: DictConfig, target: Any, draft: DFlash2Config) -> Any:
    """The `data` group's DataModule for the drafter's blocks."""
    # Plain containers: the datamodule's hyper-parameters go into every checkpoint, which must load weights_only.
    return build(
        cfg.data, tokenizer=target.tokenizer, block_size=draft.block_size, mask_token_id=draft.mask_token_id,
        _recursive_=False, _convert_="all",
    )  # fmt: skip


def build_module(target: Any, cfg: DictConfig, draft: DFlash2Config, manifest: dict[str, Any] | None = None) -> Any:
    """The `module` group's LightningModule, with the `objective` and `optim` groups' objects."""
    objective, optim = build(cfg.objective), build(cfg.optim)
    # Partial, then called: Hydra would turn the dataclass arguments into configs if it passed them itself.
    module = build(cfg.module, _partial_=True)
    return module(target=target, draft_config=draft, objective=objective, optim=optim, manifest=manifest)


def train(cfg: DictConfig, callbacks: list[Any] | None = None) -> dict[str, Any]:
    """Fit a drafter; returns {"run_dir", "ckpt_path", "start": val metrics at step 0, "end": latest val, ...}.

    `callbacks` are added to the configured ones (tests use this to look inside a run)."""
    started = time.time()
    # Under train.py PrepareRun checked the config before the run folder existed; a caller of train() did not. The
    # drafter's config is resolved here, once, and every part below takes it.
    draft = check_config(cfg)
    quiet_libraries()
    if rank_zero_only.rank == 0:  # the first line of train.log: what this run trains, before anything loads
        experiment = experiment_choice(cfg)
        log.info("%s", describe_run(cfg, experiment, draft))
        for key, (setting, used) in warm_start_replaced(cfg.draft, draft).items():
            log.warning("draft.%s=%s replaced by %s from module.init_from", key, setting, used)
        if cfg.task_name == QUICKSTART_TASK and accelerator(cfg) in ("gpu", "cuda"):
            log.warning(
                "the CPU quickstart (model=smollm2's experiment) trains its small drafter on a GPU here: "
                "experiment=gpu_smollm2 is the published recipe for this target"
            )
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    if HydraConfig.initialized():
        # The folder Hydra made for this job; DDP workers are re-launched with the launching process's folder.
        with open_dict(cfg):
            cfg.run_dir = HydraConfig.get().runtime.output_dir
    run_dir = Path(cfg.run_dir).absolute()

    target = load_target(cfg, draft)
    datamodule = build_data(cfg, target, draft)
    # Read, tokenized and split here, before the logger and its W&B run exist: bad data leaves no run to sync.
    datamodule.prepare_data()
    datamodule.setup("fit")
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "identity": target_identity(target.name, target.config, target.tokenizer),
        "target_path": target.source,  # where training loaded it, on this machine
        "serve_model": serve_model(cfg.model.get("path"), cfg.model.get("gguf_file")),  # what engines load
        "data_source": str(cfg.data.get("path") or cfg.data.get("name") or "unknown"),
        "run": cfg.task_name,
    }
    module = build_module(target, cfg, draft, manifest)

    logger = build_logger(cfg, run_dir)
    configured = [build(c) for c in (cfg.get("callbacks") or {}).values() if c and c.get("_target_")]
    if not logger:  # a learning-rate monitor without a logger is an error in Lightning
        configured = [c for c in configured if not isinstance(c, L.pytorch.callbacks.LearningRateMonitor)]
    # Lightning's bar off a terminal would end up in the output file as frames; log_progress logs the steps there.
    # Its model summary is a table drawn for a terminal: off one, the first log line says what the drafter is.
    bar = bool(cfg.trainer.get("enable_progress_bar", True)) and interactive()
    table = bool(cfg.trainer.get("enable_model_summary", True)) and interactive()
    trainer = build(
        cfg.trainer,
        logger=logger,
        callbacks=configured + list(callbacks or []),
        default_root_dir=str(run_dir),
        enable_progress_bar=bar,
        enable_model_summary=table,
    )
    if trainer.logger and cfg.logger.get("_target_", "").endswith("WandbLogger") and trainer.is_global_zero:
        trainer.logger.experiment.config.update(run_config(cfg, draft), allow_val_change=True)

    start: dict[str, float] = {}
    try:
        if cfg.ckpt_path is None and cfg.get("validate_first", True):
            start = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except BaseException:  # an error, Ctrl-C or SIGTERM (Lightning raises on it): the W&B run ends as failed
        finish_wandb(logger, exit_code=1)
        raise
    finish_wandb(logger)
    end = dict(module.latest_metrics)

    # The checkpoint without a monitor keeps the latest state (configs/callbacks/default.yaml).
    latest = [c.best_model_path for c in trainer.checkpoint_callbacks if c.monitor is None and c.best_model_path]
    result = {
        "run_dir": str(run_dir),
        "ckpt_path": latest[0] if latest else None,
        "start": start,
        "end": end,
        "global_step": trainer.global_step,
        "seconds": time.time() - started,
    }
    if trainer.is_global_zero:
        log.info("done\n%s", summary(result))  # logged: train.log keeps it, also when stdout is not a terminal
    return result


def experiment_choice(cfg: DictConfig) -> str | None:
    """The `experiment` a run was started with (None: none, or train() called without Hydra): Hydra's choice for this
    command, or for a resume the one the run's record holds (a resume keeps its run's config groups). A model without
    an experiment of its own (train.yaml's `optional experiment: ${model}`) has none."""
    if not HydraConfig.initialized():
        return None
    choices = HydraConfig.get().runtime.choices
    if cfg.get("ckpt_path"):
        record = run_dir_of(cfg.ckpt_path) / RECORD / "hydra.yaml"
        if record.is_file():
            choices = OmegaConf.load(record).hydra.runtime.choices
    experiment = choices.get("experiment")
    options = GlobalHydra.instance().config_loader().get_group_options("experiment")
    return experiment if experiment in options else None


def accelerator(cfg: DictConfig) -> str:
    """trainer.accelerator as Lightning resolves it here: `auto` is the GPU when there is one."""
    chosen = str(cfg.trainer.get("accelerator") or "auto")
    return ("gpu" if torch.cuda.is_available() else "cpu") if chosen == "auto" else chosen


def describe_run(cfg: DictConfig, experiment: str | None, draft: DFlash2Config) -> str:
    """One line saying what a run trains: the experiment, the target, the drafter's shape (`draft`, as resolved: a
    warm start's depth and layers included), the data and the schedule, e.g. `experiment=smollm2, task quickstart:
    target smollm2 (the embedded GGUF), DFlash2 drafter of 1 draft layer over target layers [2, 6], block size 8,
    batch 4 chats of max_length 256, data sharegpt (first 1400), 1 epoch, trainer cpu`. The task (the run folder's
    and the W&B run's name) is shown where it is not the experiment's own name: a model's experiment that runs
    another (model=smollm2's runs the quickstart)."""
    model, data, trainer = cfg.model, cfg.data, cfg.trainer
    source = f"{model.path}" if model.get("path") else "the embedded GGUF" if model.get("gguf_file") else None
    kind = "DFlash2" if (draft.use_conv or draft.use_selector) else "DFlash"
    layers, reads = draft.num_hidden_layers, list(draft.target_layer_ids)
    steps, epochs = int(trainer.get("max_steps") or -1), trainer.get("max_epochs")
    schedule = f"{epochs} epoch{'' if epochs == 1 else 's'}"
    if steps > 0:
        schedule = f"{steps} steps" + (f" (at most {schedule})" if epochs not in (None, -1) else "")
    devices = trainer.get("devices", 1)
    devices = "" if devices == 1 else " on every visible device" if devices == -1 else f" x{devices}"
    name = f"experiment={experiment}" if experiment else f"no experiment (task {cfg.task_name})"
    if experiment and cfg.task_name not in (experiment, DEFAULT_TASK):
        name += f", task {cfg.task_name}"
    if cfg.get("ckpt_path"):
        name = f"resuming {cfg.ckpt_path} ({name})"
    parts = [
        f"target {model.name}" + (f" ({source})" if source else ""),
        f"{kind} drafter of {layers} draft layer{'' if layers == 1 else 's'} over target layers {reads}",
        f"block size {draft.block_size}",
        f"batch {data.get('batch_size')} chat{'' if data.get('batch_size') == 1 else 's'} of max_length "
        f"{data.get('max_length')}",
        f"data {data.get('path') or data.get('name')}" + (f" (first {data.limit})" if data.get("limit") else ""),
        schedule,
        f"trainer {accelerator(cfg)}{devices}",
    ]
    return f"{name}: " + ", ".join(parts)


def run_config(cfg: DictConfig, draft: DFlash2Config) -> dict[str, Any]:
    """The run's config as W&B records it: the draft group's settings as the drafter was resolved (a warm start's depth
    and layers, the target's values for the settings left null)."""
    config = OmegaConf.to_container(cfg, resolve=True)
    resolved = draft.to_dict()
    fields = resolved | resolved.get("dflash_config", {})
    config["draft"] = {k: fields.get(k, v) for k, v in config["draft"].items()}
    return config


def summary(result: dict[str, Any]) -> str:
    start, end = result["start"].get("val/tau_sim"), result["end"].get("val/tau_sim")
    lines = [
        f"run dir     {result['run_dir']}",
        f"checkpoint  {result['ckpt_path']}",
        f"steps       {result['global_step']} in {result['seconds'] / 60:.1f} min",
    ]
    if start is not None:
        lines.append(
            f"val tau_sim {start:.3f} at step 0 -> {end:.3f} at step {result['global_step']}"
            if end is not None
            else f"val tau_sim {start:.3f} at step 0"
        )
    elif end is not None:
        lines.append(f"val tau_sim {end:.3f} at step {result['global_step']}")
    return "\n".join(lines)
