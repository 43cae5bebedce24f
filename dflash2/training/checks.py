"""What `python train.py` checks before anything loads: a setting left unset, the target, the data files, the
drafter's fields (resolved as training uses them, dflash2.training.drafter), the objective and optimizer settings,
and for a resume its checkpoint.

`PrepareRun` runs the checks before Hydra makes the run folder, so a bad setting costs a second and leaves nothing
behind. Every message names the setting as it is typed on the command line (`draft.conv_group_size`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash2.groups import BAD_INPUT, build
from dflash2.model.config import DFlash2Config
from dflash2.progress import quiet_libraries
from dflash2.training.drafter import resolve_drafter
from dflash2.training.resume import restore_run_config

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


def check_config(cfg: DictConfig) -> DFlash2Config:
    """Fail in one sentence on a setting left unset, a target or data file that is not there or a drafter field that
    does not fit the target, reading only the target's config.json: seconds before its weights would have loaded.
    Returns the drafter's DFlash2Config, resolved once (dflash2.training.drafter.resolve_drafter)."""
    # The target's and the data's modules import transformers and datasets (seconds): here, not when Hydra loads the
    # PrepareRun callback of this module.
    from dflash2.target.model import compile_mode

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError("set " + ", ".join(f"{key}=..." for key in missing) + ": it has no default")
    if cfg.get("ckpt_path"):
        check_resume(cfg.ckpt_path)
    # The target first: its data is made by the target (the recipe command a missing file's message names).
    draft = resolve_drafter(cfg)
    path = cfg.data.get("path")
    if path and not Path(path).expanduser().is_file():
        raise FileNotFoundError(
            f"data.path={path!r} does not exist: `{recipe_command(cfg)}` makes it (the target's replies to ShareGPT "
            "and to the recipe's prompts), or pass data.path=FILE, a JSON/JSONL file of chats"
        )
    for extra in cfg.data.get("extra_paths") or ():
        if not Path(extra).expanduser().is_file():
            raise FileNotFoundError(
                f"data.extra_paths: {extra!r} does not exist: `{recipe_command(cfg, extra)}` makes it (the target's "
                "replies to the recipe's prompts), or list other JSON/JSONL files of chats, or data.extra_paths=[] "
                "for data.path alone"
            )
    check_module_knobs(cfg.module, cfg.trainer.get("strategy"))
    check_fsdp_device(cfg.trainer)
    objective = build(cfg.objective)
    build(cfg.optim)
    compile_mode(cfg.model.get("compile"))
    from dflash2.data.anchors import check_copy_anchors
    from dflash2.data.datamodule import check_drop_last, check_pad_to_multiple_of

    check_pad_to_multiple_of(cfg.data.get("pad_to_multiple_of", 1))
    check_drop_last(cfg.data.get("drop_last", False))
    objective.slot_scale(draft.block_size)  # the late slots' start must fit the block
    copy = cfg.data.get("copy_anchor_weight", 1.0), cfg.data.get("copy_anchor_min_match", 1)
    check_copy_anchors(*copy, draft.block_size)
    if cfg.data.get("features"):  # a cache of another target, layers, template or data is refused before it loads
        from dflash2.data.feature_store import check_cache

        check_cache(cfg, list(draft.target_layer_ids))
    return draft


def recipe_command(cfg: DictConfig, extra: str | None = None) -> str:
    """The command that writes a run's training data (dflash2/data/recipe.py): this target's replies to ShareGPT into
    data.path and its replies to the recipe's prompts into data.extra_paths' file; given `extra`, the command for that
    file, which leaves data.path (an existing file) alone."""
    extras = list(cfg.data.get("extra_paths") or ())
    command = f"python -m dflash2.data.recipe model={cfg.model.name}"
    if cfg.model.get("path"):
        command += f" model.path={cfg.model.path}"
    if extra is None:
        command += f" output={cfg.data.path}"
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


def check_data(cfg: DictConfig) -> None:
    """Read the data files (`data.path`, `data.extra_paths`) through, so that a malformed record fails before the run
    has a folder. The packaged ShareGPT is not re-read: it is the package's, and the run reads it right after."""
    from dflash2.data.chat import load_conversations
    from dflash2.data.datamodule import resolve_chat_template_kwargs
    from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs

    quiet = logging.root.manager.disable
    logging.disable(logging.INFO)  # the run reads the files again and logs their counts, into train.log this time
    try:
        files = {}
        if cfg.data.get("path"):
            files[cfg.data.path] = load_conversations(cfg.data.path, cfg.data.get("limit"))
        for extra in cfg.data.get("extra_paths") or ():
            files[extra] = load_conversations(extra)
        # A file regenerated under other chat template arguments than training renders with is refused here, before
        # the target loads, not after.
        requested = check_chat_template_kwargs(cfg.data.get(KWARGS_KEY), f"data.{KWARGS_KEY}")
        resolve_chat_template_kwargs(requested, files)
    finally:
        logging.disable(quiet)


def check_experiment(choices: Mapping[str, Any], typed: list[str], model: str) -> None:
    """An experiment is sized for its target, whose config it includes (configs/experiment/): refuse a `model=` typed
    beside an experiment of another target, whose layers and sizes would silently apply to it. `choices`: Hydra's
    group choices; `typed`: the command line's overrides; `model`: the composed model.name."""
    experiment, chosen = choices.get("experiment"), choices.get("model")
    groups = {o.key_or_group for o in OverridesParser.create().parse_overrides(typed)}
    if experiment and "model" in groups and chosen != model:
        raise ValueError(
            f"model={chosen} is typed beside experiment={experiment}, which trains model={model}: drop "
            f"experiment={experiment} (model={chosen} picks its own experiment; ~experiment trains with the groups' "
            f"defaults) or drop model={chosen}"
        )


class PrepareRun(Callback):
    """Hydra callback (configs/train.yaml), before Hydra makes the run folder, its record and train.log: a resume takes
    the run's own settings, then the inputs are checked."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        quiet_libraries()  # first: the checks below may dequantize a GGUF target, with the libraries' bars
        try:
            if config.get("ckpt_path"):
                check_resume(config.ckpt_path)  # before the run's record is read or a line is logged
                restore_run_config(config)  # the run's own groups, checked when it started
            else:
                check_experiment(config.hydra.runtime.choices, list(config.hydra.overrides.task), config.model.name)
            task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            check_config(task)
            check_data(task)
        except (*BAD_INPUT, HydraException) as e:
            raise SystemExit(str(e)) from None
