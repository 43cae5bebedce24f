"""Training: the LightningModule, its objective, and the `python train.py` driver."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import FSDPStrategy

from dflash2.model import DecoderLayer
from dflash2.training.losses import draft_losses, loss_gamma, selector_alpha, slot_weights, summarise
from dflash2.training.module import DFlash2Module, DraftMetrics, freeze_backbone
from dflash2.training.run import register_resolvers, target_and_draft, train


def fsdp_strategy(**kwargs: Any) -> Any:
    """Lightning's FSDP, wrapping each draft decoder layer (Hydra cannot spell a set of classes)."""
    return FSDPStrategy(auto_wrap_policy={DecoderLayer}, use_orig_params=True, **kwargs)


__all__ = [
    "DFlash2Module",
    "DraftMetrics",
    "target_and_draft",
    "draft_losses",
    "freeze_backbone",
    "fsdp_strategy",
    "loss_gamma",
    "register_resolvers",
    "selector_alpha",
    "slot_weights",
    "summarise",
    "train",
]
