"""`python evaluate.py [-m] ...` (`dflash2-evaluate`): one evaluation run, or each run of a sweep, into Hydra's job
folder (configs/evaluate.yaml). The config becomes checked, typed settings once
(`dflash2.evaluation.settings.evaluation_settings`), before Hydra makes the run or sweep folder (`CheckSettings`); the
library then loads, decodes and reports (`dflash2.evaluation.run.main`), and a sweep ends with its summary
(`SweepSummary`).
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dflash2.commands import build, command
from dflash2.errors import BAD_INPUT
from dflash2.evaluation import run as evaluation
from dflash2.evaluation.checks import check_drafter
from dflash2.evaluation.loading import TargetLoader
from dflash2.evaluation.settings import EvaluationSettings, evaluation_settings
from dflash2.evaluation.sweep import SUMMARY_CSV, format_summary, plots_written, summarize_sweep

log = logging.getLogger(__name__)


def main() -> None:
    command("evaluate", run)


def run(cfg: DictConfig) -> dict[str, Any]:
    """One run of the composed config into Hydra's job folder."""
    return evaluate(cfg, HydraConfig.get().runtime.output_dir)


def evaluate(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """A composed configs/evaluate.yaml, run into `run_dir` (a kept run of the same settings is returned as it is)."""
    settings = settings_of(cfg)
    return evaluation.main(settings, target_loader(cfg.model, settings.device), run_dir)


def settings_of(cfg: DictConfig) -> EvaluationSettings:
    """The config's checked settings: as plain values, resolved, without Hydra's own node."""
    return evaluation_settings(OmegaConf.to_container(without_hydra(cfg), resolve=True))


def without_hydra(cfg: DictConfig) -> DictConfig:
    """A callback's config without Hydra's own node, whose sweep paths do not resolve in a single run."""
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg


@functools.lru_cache(maxsize=1)  # the runs of a sweep (one process) share one target
def _load_target(model_json: str, device: str) -> Any:
    return build(json.loads(model_json), device=device)


def target_loader(model: DictConfig, device: Any) -> TargetLoader:
    """The `model` group's target on `device`, capturing the layers the drafter reads."""
    values = OmegaConf.to_container(model, resolve=True)

    def load(layer_ids: list[int]) -> Any:
        return _load_target(json.dumps(values | {"target_layer_ids": list(layer_ids)}, sort_keys=True), str(device))

    return load


class CheckSettings(Callback):
    """Hydra callback (configs/evaluate.yaml): bad settings and drafters are refused before Hydra makes the run folder
    (or a sweep's), so a failed start leaves nothing behind. A sweep's drafters (`-m drafter=a,b`) are each checked."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            settings_of(config)
        except BAD_INPUT as e:
            raise SystemExit(str(e)) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            for drafter in swept(config.hydra.overrides.task, "drafter"):
                check_drafter(drafter)
        except BAD_INPUT as e:
            raise SystemExit(str(e)) from None


def swept(overrides: Any, key: str) -> list[str]:
    """The values a multirun's overrides give `key`: one, or each of a choice sweep (`-m drafter=a,b`)."""
    values = []
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        if override.key_or_group != key:
            continue
        if not override.is_sweep_override():
            values.append(override.get_value_element_as_str())
        elif override.is_choice_sweep():
            values.extend(override.sweep_string_iterator())
    return values


class SweepSummary(Callback):
    """Hydra callback: summarise the sweep folder when a multirun ends (`dflash2.evaluation.sweep`)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            table = summarize_sweep(sweep_dir)
        except FileNotFoundError as e:
            log.error("%s", e)
            return
        print(format_summary(table))
        plots = plots_written(sweep_dir)
        print(f"wrote {sweep_dir / SUMMARY_CSV}, {', '.join(plots[:-1])} and {plots[-1]}")


if __name__ == "__main__":
    main()
