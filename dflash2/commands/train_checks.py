"""train.py's check step: the composed config checked once, before anything loads (`check_config`), reading the
target's config.json only; under train.py before Hydra makes the run folder (`PrepareRun`, below), so a bad setting
costs a second and leaves nothing behind. The checks themselves take plain values (dflash2.training.checks); here
the config is read and its small objects (the drafter's config, the objective, the optimizer) built as training
builds them, so that their own checks run too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash2.commands import build, check_numbers
from dflash2.commands.resume import restore_run_config
from dflash2.commands.train_groups import plain, resolve_drafter
from dflash2.errors import BAD_INPUT
from dflash2.model.config import DFlash2Config
from dflash2.training.checks import (
    check_data,
    check_data_files,
    check_fsdp_device,
    check_module_knobs,
    check_resume,
    check_training,
)

# The groups whose objects name their own bad fields, in their own words (DFlash2Config: `draft.block_size: is ...`).
SELF_CHECKED = ("draft",)


def check_config(cfg: DictConfig, resume_checked: bool = False) -> DFlash2Config:
    """Fail in one sentence on a setting left unset, text where a number goes, a resume's unreadable checkpoint (unless
    the caller checked it: `resume_checked`), a target or data file that is not there or a drafter field that does not
    fit the target: seconds before the target's weights would have loaded. Returns the drafter's DFlash2Config,
    resolved once (dflash2.commands.train_groups.resolve_drafter), which the run then takes."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError("set " + ", ".join(f"{key}=..." for key in missing) + ": it has no default")
    check_numbers(cfg, skip=SELF_CHECKED)
    if cfg.get("ckpt_path") and not resume_checked:
        check_resume(cfg.ckpt_path)
    draft = resolve_drafter(cfg)  # the target first: the data is made by the target (the recipe command names it)
    config = plain(cfg)
    check_data_files(config)
    check_module_knobs(config["module"], config["trainer"].get("strategy"))
    check_fsdp_device(config["trainer"])
    objective = build(cfg.objective)
    build(cfg.optim)
    check_training(config, draft, objective)
    return draft


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
    the run's own settings, then the config is checked, once, and the data files read through. The drafter the check
    resolved (`checked`) goes on to the task, which does not check again."""

    checked: ClassVar[DFlash2Config | None] = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            if config.get("ckpt_path"):
                check_resume(config.ckpt_path)  # before the run's record is read or a line is logged
                restore_run_config(config)  # the run's own groups, checked when it started
            else:
                check_experiment(config.hydra.runtime.choices, list(config.hydra.overrides.task), config.model.name)
            task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
            PrepareRun.checked = check_config(task, resume_checked=True)
            check_data(plain(task))
        except (*BAD_INPUT, HydraException) as e:
            raise SystemExit(str(e)) from None
