"""The resolvers configs/train.yaml (and every config composing it: features.yaml, a study's checks) interpolates:
`${dflash2_run_dir:ckpt,default}` (a resumed run keeps its folder), `${dflash2_hydra_subdir:ckpt,time}` (a resume's
Hydra record goes beside the run's own) and `${dflash2_precision:}` (bf16-mixed where the GPU has it, else fp32)."""

from __future__ import annotations

import torch
from omegaconf import OmegaConf

from dflash2.commands.resume import hydra_subdir
from dflash2.training.checkpoint import run_dir_of


def _run_dir(ckpt_path: str | None, default: str) -> str:
    return str(run_dir_of(ckpt_path)) if ckpt_path else default


def _precision() -> str:
    return "bf16-mixed" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "32-true"


def register_resolvers() -> None:
    """Register the three, once per process."""
    if not OmegaConf.has_resolver("dflash2_run_dir"):
        OmegaConf.register_new_resolver("dflash2_run_dir", _run_dir, use_cache=True)
    if not OmegaConf.has_resolver("dflash2_hydra_subdir"):
        OmegaConf.register_new_resolver("dflash2_hydra_subdir", hydra_subdir, use_cache=True)
    if not OmegaConf.has_resolver("dflash2_precision"):
        OmegaConf.register_new_resolver("dflash2_precision", _precision)
