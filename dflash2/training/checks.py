"""What `python train.py` checks before anything loads, on the run's settings as plain values: the data files, the
module knobs, the device a strategy needs, the objective's and the data's settings against the drafter's block, a
feature cache against the run, and for a resume its checkpoint. The command's check step
(dflash2.commands.train_checks) runs them once, before Hydra makes the run folder, so a bad setting costs a second
and leaves nothing behind. Every message names the setting as it is typed on the command line
(`data.copy_anchor_min_match`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash2.model.config import DFlash2Config

log = logging.getLogger(__name__)


def check_module_knobs(module: Mapping[str, Any], strategy: Any = None) -> None:
    """The module group's settings that shape training only, never the export (`init_std`, `feature_scaling`,
    `init_from`), against each other and `strategy` (trainer.strategy)."""
    init_std = module.get("init_std")
    if init_std is not None and not (isinstance(init_std, int | float) and init_std > 0):
        raise ValueError(
            f"module.init_std={init_std}: the std of the drafter's initial Linear weights must be > 0 "
            "(SpecForge and ModelOpt use 0.02; null = PyTorch's default init)"
        )
    if module.get("init_from"):
        for knob in ("init_std", "feature_scaling"):
            if module.get(knob) not in (None, False):
                raise ValueError(
                    f"module.{knob}={module[knob]} initialises a drafter built from scratch, and "
                    f"module.init_from={module['init_from']} keeps the weights it loads: drop one of the two"
                )
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else str(strategy or "")
    if module.get("feature_scaling") and "fsdp" in target.lower():
        raise ValueError(
            "module.feature_scaling=true rescales fc in place at the first step, which FSDP's sharded parameters do "
            "not allow: train with trainer=gpu or trainer=ddp, or set module.feature_scaling=false"
        )


def check_fsdp_device(trainer: Mapping[str, Any]) -> None:
    """trainer=fsdp on CPU processes: Lightning's FSDP strategy requires a GPU accelerator and says so only once the
    target and the data have loaded; refused here instead, with the data-parallel setting that does run there."""
    strategy = trainer.get("strategy")
    target = strategy.get("_target_", "") if isinstance(strategy, Mapping) else str(strategy or "")
    if "fsdp" not in target:
        return
    import torch

    if trainer.get("accelerator") == "cpu" or not torch.cuda.is_available():
        raise ValueError(
            "trainer=fsdp requires a GPU accelerator (Lightning's FSDP strategy runs on GPUs only): on CPU processes "
            "use trainer=ddp trainer.accelerator=cpu, which trains the same global batches"
        )


def check_data_files(config: Mapping[str, Any]) -> None:
    """`data.path` and `data.extra_paths` exist; a missing one is named with the command that makes it."""
    data = config["data"]
    path = data.get("path")
    if path and not Path(path).expanduser().is_file():
        raise FileNotFoundError(
            f"data.path={path!r} does not exist: `{recipe_command(config)}` makes it (the target's replies to ShareGPT "
            "and to the recipe's prompts), or pass data.path=FILE, a JSON/JSONL file of chats"
        )
    for extra in data.get("extra_paths") or ():
        if not Path(extra).expanduser().is_file():
            raise FileNotFoundError(
                f"data.extra_paths: {extra!r} does not exist: `{recipe_command(config, extra)}` makes it (the "
                "target's replies to the recipe's prompts), or list other JSON/JSONL files of chats, or "
                "data.extra_paths=[] for data.path alone"
            )


def check_training(config: Mapping[str, Any], draft: DFlash2Config, objective: Any) -> None:
    """The settings read against the drafter's block and the target (`objective`: the objective group's Objective):
    the target's compile mode, the batches' padding and last batch, the late slots, the copy anchors, and a feature
    cache, whose manifest must be of this run's target, layers, template and data."""
    # The target's and the data's modules import transformers and datasets (seconds): here, when the checks run.
    from dflash2.data.anchors import check_copy_anchors
    from dflash2.data.collate import check_pad_to_multiple_of
    from dflash2.data.datamodule import check_drop_last
    from dflash2.target.model import compile_mode

    data = config["data"]
    compile_mode(config["model"].get("compile"))
    check_pad_to_multiple_of(data.get("pad_to_multiple_of", 1))
    check_drop_last(data.get("drop_last", False))
    objective.slot_scale(draft.block_size)  # the late slots' start must fit the block
    check_copy_anchors(data.get("copy_anchor_weight", 1.0), data.get("copy_anchor_min_match", 1), draft.block_size)
    if data.get("features"):  # a cache of another target, layers, template or data is refused before it loads
        from dflash2.data.feature_store import check_cache

        check_cache(config, list(draft.target_layer_ids))


def recipe_command(config: Mapping[str, Any], extra: str | None = None) -> str:
    """The command that writes a run's training data (dflash2/commands/recipe.py): this target's replies to ShareGPT
    into data.path and its replies to the recipe's prompts into data.extra_paths' file; given `extra`, the command for
    that file, which leaves data.path (an existing file) alone."""
    model, data = config["model"], config["data"]
    extras = list(data.get("extra_paths") or ())
    command = f"python -m dflash2.commands.recipe model={model['name']}"
    if model.get("path"):
        command += f" model.path={model['path']}"
    if extra is None:
        command += f" output={data['path']}"
        extra = extras[0] if len(extras) == 1 else None
    return command + (f" extra_output={extra}" if extra else "")


def check_resume(ckpt_path: str) -> None:
    """A resume's checkpoint is a readable training checkpoint: checked before the run's settings, data, logger or
    record are touched. Reading it maps the tensors without reading them (training.checkpoint.load_checkpoint)."""
    from dflash2.training.checkpoint import LAST, load_checkpoint

    path = Path(ckpt_path).expanduser()
    if path.is_dir():
        raise ValueError(f"ckpt_path={ckpt_path} is a folder: resume from its run's checkpoints/{LAST}")
    if not path.is_file():
        raise FileNotFoundError(
            f"ckpt_path={ckpt_path} does not exist: resume from a run's <run dir>/checkpoints/{LAST}, or drop "
            "ckpt_path to start a new run"
        )
    ckpt = load_checkpoint(path)  # a truncated or foreign file: one sentence that names it and ckpt_path
    missing = [k for k in ("state_dict", "loops", "optimizer_states") if k not in ckpt]
    if missing:
        raise ValueError(
            f"ckpt_path={ckpt_path} holds no training state ({', '.join(missing)} missing): resume from a training "
            f"run's checkpoints/{LAST}; to start from an exported drafter, pass module.init_from=<its folder> instead"
        )


def check_data(config: Mapping[str, Any]) -> None:
    """Read the data files (`data.path`, `data.extra_paths`) through, so that a malformed record fails before the run
    has a folder. The packaged ShareGPT is not re-read: it is the package's, and the run reads it right after."""
    from dflash2.data.chat import load_conversations
    from dflash2.data.datamodule import resolve_chat_template_kwargs
    from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs

    data = config["data"]
    quiet = logging.root.manager.disable
    logging.disable(logging.INFO)  # the run reads the files again and logs their counts, into train.log this time
    try:
        files = {}
        if data.get("path"):
            files[data["path"]] = load_conversations(data["path"], data.get("limit"))
        for extra in data.get("extra_paths") or ():
            files[extra] = load_conversations(extra)
        # A file regenerated under other chat template arguments than training renders with is refused here, before
        # the target loads, not after.
        requested = check_chat_template_kwargs(data.get(KWARGS_KEY), f"data.{KWARGS_KEY}")
        resolve_chat_template_kwargs(requested, files)
    finally:
        logging.disable(quiet)
