"""A training run, from its built parts to its summary: the first log line, the data read before anything is logged
to W&B, the manifest, the Trainer's arguments the run decides, the fit with its W&B run closed however it ends, and
what a stopped run prints to resume it. The parts (target, data, module, logger, Trainer) are built from the config by
the command (dflash2.commands.train); this module takes them and the run's settings as plain values (`Run`).

A resumed run (`ckpt_path=<run>/checkpoints/last.ckpt`) reuses its run directory, its settings (the command restores
them from the run's Hydra record) and its W&B run id, and Lightning restores the step count, optimizer and scheduler
from the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import time
import uuid
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from dflash2.model.config import DFlash2Config
from dflash2.progress import Progress, interactive
from dflash2.target.locate import serve_model
from dflash2.target.manifest import target_identity
from dflash2.training.checkpoint import load_checkpoint, read_info

log = logging.getLogger(__name__)

WANDB_ID_FILE = "wandb_id.txt"
DEFAULT_TASK = "train"  # task_name when no experiment names the run (configs/train.yaml)
QUICKSTART_TASK = "quickstart"  # the CPU quickstart's task_name (configs/quickstart/smollm2.yaml)
TAU_SIM = "val/tau_sim"


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's settings as plain values: its whole config, resolved (the groups describe_run reads, what W&B records),
    the folder it writes, the experiment it was started with, and the command line that resumes it."""

    config: dict[str, Any]
    run_dir: Path
    experiment: str | None = None
    command: str = "python train.py"

    @property
    def ckpt_path(self) -> str | None:  # a resume's checkpoint
        return self.config.get("ckpt_path")

    @property
    def task_name(self) -> str:  # the run folder's and the W&B run's name
        return str(self.config.get("task_name"))


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

    def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, module)  # the steps done, logged before what the stopped run says last


class LastCheckpoint(ModelCheckpoint):
    """`last.ckpt`, the state at the latest validation (what a resume and the exporter read), kept as one file with the
    best checkpoint when it is the same state: when another ModelCheckpoint (the best by val/tau_sim) has just saved
    this step, last.ckpt becomes a hard link to that file instead of a second copy (a 356 MB drafter's run would
    otherwise keep two). Every tool sees a plain, complete file; when the best moves on, Lightning deletes the old
    name and last.ckpt keeps the data, and the next full save replaces the link (Lightning writes a temp file and
    renames it over the name), so the best file is never written through it. A file system without hard links gets
    a second copy: a plain save."""

    @property
    def state_key(self) -> str:
        # The state is ModelCheckpoint's, kept under its key: a last.ckpt written by a plain ModelCheckpoint (a config
        # without this class) and one written by this class restore into each other, where Lightning would otherwise
        # warn of a callback missing from the Trainer and drop its state.
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


def announce(run: Run, draft: DFlash2Config, replaced: dict[str, tuple[Any, Any]]) -> None:
    """The first lines of train.log, before anything loads: what this run trains (`describe_run`), the draft settings
    a warm start replaced (`replaced`, dflash2.training.drafter.warm_start_replaced), and a quickstart sent to a GPU."""
    if rank_zero_only.rank != 0:
        return
    log.info("%s", describe_run(run.config, run.experiment, draft))
    for key, (setting, used) in replaced.items():
        log.warning("draft.%s=%s replaced by %s from module.init_from", key, setting, used)
    if run.task_name == QUICKSTART_TASK and accelerator(run.config["trainer"]) in ("gpu", "cuda"):
        log.warning(
            "the CPU quickstart (model=smollm2's experiment) trains its small drafter on a GPU here: "
            "experiment=gpu_smollm2 is the published recipe for this target"
        )


def seed_run(run: Run) -> None:
    """The run's threads and seed, before anything random is drawn (the split, the anchors, the drafter's init)."""
    if run.config.get("threads"):
        torch.set_num_threads(int(run.config["threads"]))
    L.seed_everything(run.config["seed"], workers=True, verbose=False)


def prepare_data(run: Run, datamodule: Any) -> None:
    """Read, tokenize and split the data before the logger and its W&B run exist (bad data leaves no run to sync),
    then make the run folder."""
    datamodule.prepare_data()
    datamodule.setup("fit")
    run.run_dir.mkdir(parents=True, exist_ok=True)


def manifest(run: Run, target: Any) -> dict[str, Any]:
    """What the checkpoints record of the target and the data (dflash2.target.manifest), for the export."""
    model, data = run.config["model"], run.config["data"]
    return {
        "identity": target_identity(target.name, target.config, target.tokenizer),
        "target_path": target.source,  # where training loaded it, on this machine
        "serve_model": serve_model(model.get("path"), model.get("gguf_file")),  # what engines load
        "data_source": str(data.get("path") or data.get("name") or "unknown"),
        "run": run.task_name,
    }


def is_wandb(logger: dict[str, Any] | None) -> bool:
    """The logger group's settings name Lightning's W&B logger."""
    return str((logger or {}).get("_target_") or "").endswith("WandbLogger")


def wandb_arguments(logger: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The W&B logger's arguments the run decides: offline unless the user chose a mode, one run id per run folder
    (wandb_id.txt) so that a resume continues the W&B run, and W&B's non-essential lines off a terminal."""
    os.environ.setdefault("WANDB_MODE", "offline")
    kwargs: dict[str, Any] = {}
    if not logger.get("id"):
        id_file = run_dir / WANDB_ID_FILE
        if not id_file.is_file():
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(uuid.uuid4().hex[:8])
        kwargs["id"] = id_file.read_text().strip()
    if not interactive() and not logger.get("settings"):
        import wandb

        # W&B's own switch for its non-essential lines (its version, the history as sparklines at the end): off a
        # terminal they are not log lines; the run's W&B files keep everything.
        kwargs["settings"] = wandb.Settings(quiet=True)
    return kwargs


def drop_anonymous(logger: Any) -> None:
    """Lightning's WandbLogger (2.6) passes wandb.init `anonymous` whatever the config says, an argument W&B has
    deprecated and warns about on every run: dropped, as by a logger that never sets it."""
    getattr(logger, "_wandb_init", {}).pop("anonymous", None)


def trainer_arguments(run: Run, logger: Any, callbacks: list[Callback]) -> dict[str, Any]:
    """The Trainer's arguments beside the trainer group's: the logger, the callbacks (a learning-rate monitor needs a
    logger, Lightning refuses it otherwise), the run folder, and off a terminal no progress bar (its frames would fill
    the output file: LogTrainingProgress logs the steps there) and no model summary table (the first log line says
    what the drafter is)."""
    if not logger:
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    trainer = run.config["trainer"]
    return {
        "logger": logger,
        "callbacks": callbacks,
        "default_root_dir": str(run.run_dir),
        "enable_progress_bar": bool(trainer.get("enable_progress_bar", True)) and interactive(),
        "enable_model_summary": bool(trainer.get("enable_model_summary", True)) and interactive(),
    }


def fit(run: Run, trainer: Any, module: Any, datamodule: Any, draft: DFlash2Config, started: float) -> dict[str, Any]:
    """Fit the drafter, from the checkpoint of a resume; returns {"run_dir", "ckpt_path", "start": the validation it
    started from, "end": the latest, "start_step", "global_step", "seconds"}. The W&B run is closed however the fit
    ends; a run stopped by Ctrl-C or SIGTERM says which checkpoint resumes it and how."""
    if isinstance(trainer.logger, WandbLogger) and trainer.is_global_zero:
        trainer.logger.experiment.config.update(run_config(run.config, draft), allow_val_change=True)
    start_step, start = resume_point(run.ckpt_path) if run.ckpt_path else (0, {})
    try:
        if run.ckpt_path is None and run.config.get("validate_first", True):
            start = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
        elif run.ckpt_path is not None and trainer.is_global_zero:
            log.info("%s", resuming(start_step, start))
        trainer.fit(module, datamodule=datamodule, ckpt_path=run.ckpt_path)
    except BaseException as e:  # an error, Ctrl-C or SIGTERM (Lightning raises on it): the W&B run ends as failed
        finish_wandb(trainer, exit_code=1)
        if isinstance(e, KeyboardInterrupt | SystemExit) and trainer.interrupted and trainer.is_global_zero:
            log.info("%s", interrupted(run, trainer))
        raise
    finish_wandb(trainer)
    result = {
        "run_dir": str(run.run_dir),
        "ckpt_path": latest_checkpoint(trainer),
        "start": start,
        "end": dict(module.latest_metrics),
        "start_step": start_step,
        "global_step": trainer.global_step,
        "seconds": time.time() - started,
    }
    if trainer.is_global_zero:
        log.info("done\n%s", summary(result))  # logged: train.log keeps it, also when stdout is not a terminal
    return result


def finish_wandb(trainer: Any, exit_code: int = 0) -> None:
    """Close the W&B run (a later run in this process then starts its own), also when the run fails: W&B's own exit
    hook would otherwise print its closing lines to stdout with terminal colours, into the output file of a run off a
    terminal."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.finish(exit_code=exit_code)


def latest_checkpoint(trainer: Any) -> str | None:
    """The file of the run's latest state: the checkpoint without a monitor (configs/callbacks/default.yaml)."""
    latest = [c.best_model_path for c in trainer.checkpoint_callbacks if c.monitor is None and c.best_model_path]
    return latest[0] if latest else None


def resume_point(ckpt_path: str) -> tuple[int, dict[str, float]]:
    """(the step a checkpoint resumes at, the validation metrics it records: its run's latest validation, at or
    before that step). Reading them maps the tensors without reading them."""
    ckpt = load_checkpoint(ckpt_path)
    metrics = read_info(ckpt).get("metrics") or {}
    return int(ckpt.get("global_step", 0)), {k: float(v) for k, v in metrics.items()}


def resuming(step: int, metrics: dict[str, float]) -> str:
    """The line a resume starts with. A new run validates before its first step; a resume does not: Lightning
    restores the checkpoint inside fit, which skips its sanity check when restarting, and a validation before fit would
    run on a Trainer still at step 0. The checkpoint records its run's latest validation instead."""
    recorded = f"{TAU_SIM.split('/')[1]} {metrics[TAU_SIM]:.3f}" if TAU_SIM in metrics else "no validation"
    return (
        f"resuming at step {step}; no validation before the first step of a resume: the checkpoint records its run's "
        f"latest, {recorded}"
    )


def interrupted(run: Run, trainer: Any) -> str:
    """What a run stopped by Ctrl-C or SIGTERM prints (and train.log keeps): the step it stopped at, the checkpoint that
    resumes it and the command that does. A rerun of the run's own command would start a new run in a new folder."""
    ckpt = latest_checkpoint(trainer) or run.ckpt_path
    if ckpt is None or not Path(ckpt).is_file():
        return (
            f"interrupted at step {trainer.global_step}, before its first checkpoint: rerun the command to start over"
        )
    step, _ = resume_point(ckpt)
    return (
        f"interrupted at step {trainer.global_step}; its last checkpoint, {ckpt} (step {step}), resumes it with its "
        f"own settings: {resume_line(run.command, ckpt)}"
    )


def resume_line(command: str, ckpt: str) -> str:
    """`<command> ckpt_path=<ckpt>` as a shell takes it, the path quoted for Hydra where its override grammar needs it
    (Lightning's `epoch=0-step=2.ckpt`)."""
    value = json.dumps(ckpt) if re.search(r"""[=,\s\[\]{}()'"\\]""", ckpt) else ckpt
    return f"{command} {shlex.quote(f'ckpt_path={value}')}"


def accelerator(trainer: dict[str, Any]) -> str:
    """The trainer group's accelerator as Lightning resolves it here: `auto` is the GPU when there is one."""
    chosen = str(trainer.get("accelerator") or "auto")
    return ("gpu" if torch.cuda.is_available() else "cpu") if chosen == "auto" else chosen


def describe_run(config: Any, experiment: str | None, draft: DFlash2Config) -> str:
    """One line saying what a run trains (`config`: the run's config, any mapping of its groups): the experiment, the
    target, the drafter's shape (`draft`, as resolved: a warm start's depth and layers included), the data and the
    schedule, e.g. `experiment=smollm2, task quickstart: target smollm2 (the embedded GGUF), DFlash2 drafter of 1 draft
    layer over target layers [2, 6], block size 8, batch 4 chats of max_length 256, data sharegpt (first 1400), 1 epoch,
    trainer cpu`. The task (the run folder's and the W&B run's name) is shown where it is not the experiment's own
    name: a model's experiment that runs another (model=smollm2's runs the quickstart)."""
    model, data, trainer = config["model"], config["data"], config["trainer"]
    source = f"{model['path']}" if model.get("path") else "the embedded GGUF" if model.get("gguf_file") else None
    kind = "DFlash2" if (draft.use_conv or draft.use_selector) else "DFlash"
    layers, reads = draft.num_hidden_layers, list(draft.target_layer_ids)
    steps, epochs = int(trainer.get("max_steps") or -1), trainer.get("max_epochs")
    schedule = f"{epochs} epoch{'' if epochs == 1 else 's'}"
    if steps > 0:
        schedule = f"{steps} steps" + (f" (at most {schedule})" if epochs not in (None, -1) else "")
    devices = trainer.get("devices", 1)
    devices = "" if devices == 1 else " on every visible device" if devices == -1 else f" x{devices}"
    task = config["task_name"]
    name = f"experiment={experiment}" if experiment else f"no experiment (task {task})"
    if experiment and task not in (experiment, DEFAULT_TASK):
        name += f", task {task}"
    if config.get("ckpt_path"):
        name = f"resuming {config['ckpt_path']} ({name})"
    batch = data.get("batch_size")
    parts = [
        f"target {model['name']}" + (f" ({source})" if source else ""),
        f"{kind} drafter of {layers} draft layer{'' if layers == 1 else 's'} over target layers {reads}",
        f"block size {draft.block_size}",
        f"batch {batch} chat{'' if batch == 1 else 's'} of max_length {data.get('max_length')}",
        f"data {data.get('path') or data.get('name')}" + (f" (first {data['limit']})" if data.get("limit") else ""),
        schedule,
        f"trainer {accelerator(trainer)}{devices}",
    ]
    return f"{name}: " + ", ".join(parts)


def run_config(config: dict[str, Any], draft: DFlash2Config) -> dict[str, Any]:
    """The run's config as W&B records it: the draft group's settings as the drafter was resolved (a warm start's depth
    and layers, the target's values for the settings left null)."""
    resolved = draft.to_dict()
    fields = resolved | resolved.get("dflash_config", {})
    return config | {"draft": {k: fields.get(k, v) for k, v in config["draft"].items()}}


def summary(result: dict[str, Any]) -> str:
    """The lines a run ends with: its folder, its latest checkpoint, the steps this process trained (and for a resume
    the run's total), and the validation tau_sim it started from and ended at."""
    step, begun = result["global_step"], result.get("start_step", 0)
    steps = f"steps       {step - begun} in {result['seconds'] / 60:.1f} min"
    if begun:
        steps += f" (resumed at step {begun}: {step} in all)"
    lines = [f"run dir     {result['run_dir']}", f"checkpoint  {result['ckpt_path']}", steps]
    start, end = result["start"].get(TAU_SIM), result["end"].get(TAU_SIM)
    where = "(the checkpoint's latest validation)" if begun else "at step 0"
    tau = [f"{start:.3f} {where}"] if start is not None else []
    tau += [f"{end:.3f} at step {step}"] if end is not None else []
    if tau:
        lines.append("val tau_sim " + " -> ".join(tau))
    return "\n".join(lines)
