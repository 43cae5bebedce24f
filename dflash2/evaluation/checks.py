"""What `python evaluate.py` checks before anything loads: the drafter (an export folder that passes `export.py check`,
or prompt lookup), `repeats`, `block_size`, `decode` / `compile`, the chat template's arguments and prompt lookup's
settings.

`CheckSettings` runs the checks before Hydra makes the run folder (or a sweep's), so a bad setting leaves nothing
behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

from dflash2.decoding import static as static_decode
from dflash2.decoding.lookup import PromptLookup
from dflash2.export.check import lint
from dflash2.model.contract import check_block_size
from dflash2.progress import quiet_libraries
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs

PLD = "pld"  # drafter=pld: prompt lookup, the training-free baseline, in place of an export folder
PLD_BLOCK_SIZE = 16  # its block when block_size is null: 15 proposals, as in the PLD figure BENCHMARKS quotes


def check_drafter(drafter: Any) -> None:
    """`drafter` as evaluate.py takes it, refused in one sentence naming it and the fix: unset, or a folder that fails
    `export.py check` (config.json and the safetensors headers only: a second, before any target loads)."""
    if not drafter or drafter == "???":
        raise ValueError("drafter is not set: pass drafter=<export dir> (a folder export.py wrote), or drafter=pld")
    if drafter == PLD:
        return
    report = lint(Path(str(drafter)).expanduser())
    if not report.ok:
        raise ValueError(f"drafter={drafter} fails `export.py check`: " + "; ".join(report.problems))


def check_settings(cfg: DictConfig) -> None:
    """Everything about a run that can be refused without loading anything: the drafter, `repeats`, `block_size`,
    `decode` / `compile` and prompt lookup's settings."""
    check_drafter(cfg.get("drafter"))
    static_decode.decode_mode(cfg.get("decode", "plain"), cfg.get("compile", False))
    repeats = int(cfg.repeats)
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: it counts the timed passes over the prompts, so it must be at least 1")
    if cfg.get("block_size") is not None:
        check_block_size(cfg.block_size)  # a drafter's own B is its export's, which the linter checks
    check_chat_template_kwargs(cfg.get(KWARGS_KEY), KWARGS_KEY)
    if cfg.drafter == PLD:
        prompt_lookup(cfg)


class CheckSettings(HydraCallback):
    """Hydra callback (configs/evaluate.yaml): bad settings and drafters are refused before Hydra makes the run folder
    (or a sweep's), so a failed start leaves nothing behind. A sweep's drafters (`-m drafter=a,b`) are each checked."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        quiet_libraries()  # first: the checks below may dequantize a GGUF target, with the libraries' bars
        try:
            check_settings(OmegaConf.masked_copy(config, [k for k in config if k != "hydra"]))
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        quiet_libraries()
        try:
            for override in OverridesParser.create().parse_overrides(list(config.hydra.overrides.task)):
                if override.key_or_group != "drafter":
                    continue
                if not override.is_sweep_override():
                    check_drafter(override.get_value_element_as_str())
                elif override.is_choice_sweep():
                    for drafter in override.sweep_string_iterator():
                        check_drafter(drafter)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from None


def prompt_lookup(cfg: DictConfig) -> tuple[PromptLookup, int]:
    """drafter=pld: the lookup of the `pld` settings and its block size (block_size, or 16 when null), validated."""
    lookup = PromptLookup(**OmegaConf.to_container(cfg.pld, resolve=True))
    block_size = int(cfg.block_size or PLD_BLOCK_SIZE)
    lookup.slots(block_size)
    return lookup, block_size
