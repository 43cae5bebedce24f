"""The training recipe's two objects, one config group each: what the drafter learns (`objective`) and how it is
optimized (`optim`). Both check their settings when built, so `train.py` refuses a bad one before anything loads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

import torch
from transformers import get_cosine_schedule_with_warmup

from dflash2.training.losses import SlotLoss, selector_alpha, slot_weights

# The slots' loss weights (dflash2/training/losses.py): the published fixed decay, or D-PACE's from the confidence.
POSITION_WEIGHTS = ("decay", "dpace")


@dataclasses.dataclass(frozen=True)
class Objective:
    """configs/objective: the losses of contract section 7 and how the head computes them."""

    loss_gamma: float | None = None  # slot weight decay exp(-(k-1)/gamma); None = the published value for B
    position_weights: str = "dpace"  # the slots' loss weights: "dpace" (D-PACE) or "decay" (exp(-(k-1)/gamma))
    dpace_alpha: float = 0.5  # D-PACE's smoothing of the drafter's confidence, in (0, 1]
    late_slot_weight: float = 1.0  # the training weights of slots >= late_slot_start times this (1 = as they are)
    late_slot_start: int | None = None  # the first slot it multiplies, 1..B-1; None = the later half, slot B // 2 on
    selector_alpha: float = 1.0  # the selector loss's weight ...
    selector_warmup_steps: int = 0  # ... 0 for this many steps ...
    selector_ramp_steps: int = 0  # ... then ramped linearly over this many
    selector_detach: bool = False  # the selector's loss does not reach the backbone
    distill: float = 0.0  # slot targets (1-distill)*onehot(gold) + distill*softmax(the target's logits there)
    fused_head: bool = True  # the head in chunks, each chunk's CE gradient computed in the forward
    logits_chunk_rows: int = 0  # slots per chunk of the fused head; 0 = as many as 1 GiB of fp32 logits holds

    def __post_init__(self) -> None:
        d = self.distill
        if not (isinstance(d, int | float) and not isinstance(d, bool) and 0 <= d <= 1):
            raise ValueError(
                f"objective.distill={d}: the share of the target's own distribution in each slot's target must be in "
                "[0, 1] (0 = the gold token only, 1 = the target's softmax only)"
            )
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(
                f"objective.position_weights={self.position_weights}: choose one of {', '.join(POSITION_WEIGHTS)}"
            )
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"objective.dpace_alpha={self.dpace_alpha}: it must be in (0, 1], e.g. 0.5")
        if self.loss_gamma is not None and not self.loss_gamma > 0:
            raise ValueError(f"objective.loss_gamma={self.loss_gamma}: it must be > 0, or null for the published one")
        w = self.late_slot_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0):
            raise ValueError(
                f"objective.late_slot_weight={w!r}: the factor on the late slots' loss weights must be a number > 0 "
                "(1 = the weights as they are; e.g. 2 doubles the weight of slots >= objective.late_slot_start)"
            )
        start = self.late_slot_start
        if start is not None and (isinstance(start, bool) or not isinstance(start, int) or start < 1):
            raise ValueError(
                f"objective.late_slot_start={start!r}: the first slot objective.late_slot_weight multiplies must be "
                "an integer >= 1 (slot 1 is the one after the anchor), or null for the later half of the block"
            )
        for name in ("selector_warmup_steps", "selector_ramp_steps", "logits_chunk_rows"):
            if getattr(self, name) < 0:
                raise ValueError(f"objective.{name}={getattr(self, name)}: it must be >= 0")

    @property
    def dpace(self) -> float | None:
        """D-PACE's smoothing when the slots are weighted by it, else None (`SlotLoss`' `dpace_alpha`)."""
        return self.dpace_alpha if self.position_weights == "dpace" else None

    def slot_scale(self, block_size: int) -> torch.Tensor | None:
        """The factors [B-1] of the proposing slots' training weights (`SlotLoss`' `scale`):
        `late_slot_weight` on slots k >= `late_slot_start`, 1 before; None when it is 1 (the weights as they are)."""
        start = block_size // 2 if self.late_slot_start is None else self.late_slot_start
        if start > block_size - 1:
            raise ValueError(
                f"objective.late_slot_start={start}: a block of draft.block_size={block_size} has proposing slots "
                f"1..{block_size - 1}; lower objective.late_slot_start"
            )
        if self.late_slot_weight == 1:
            return None
        slots = torch.arange(1, block_size)
        return torch.where(slots >= start, float(self.late_slot_weight), 1.0)

    def slot_loss(self, block_size: int) -> SlotLoss:
        """The loss of a drafter of `block_size`: this objective's weights and settings, built once."""
        return SlotLoss(
            slot_weights(block_size, self.loss_gamma),
            self.slot_scale(block_size),
            self.dpace,
            self.distill,
            self.selector_detach,
            self.fused_head,
            self.logits_chunk_rows,
        )

    def alpha(self, step: int) -> float:
        """The selector loss's weight at optimizer step `step`."""
        return selector_alpha(step, self.selector_alpha, self.selector_warmup_steps, self.selector_ramp_steps)


@dataclasses.dataclass(frozen=True)
class Optim:
    """configs/optim: AdamW with a cosine schedule after a linear warmup (contract section 7)."""

    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04  # of the run's optimizer steps
    fused: bool | None = None  # None = one fused AdamW kernel, except under *-mixed precision (true: there too)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if not self.lr >= 0:
            raise ValueError(f"optim.lr={self.lr}: it must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)}: two numbers in [0, 1), e.g. [0.9, 0.95]")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"optim.warmup_ratio={self.warmup_ratio}: the share of steps spent warming up, in [0, 1)")

    def build(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], precision: str, total_steps: int):
        """Lightning's `configure_optimizers` answer for the trainable parameters of a run of `total_steps`."""
        decay, no_decay = [], []
        for name, p in named_parameters:
            if p.requires_grad:
                # Norm gains and the conv's identity taps are the structure, not capacity: never shrunk.
                (no_decay if p.dim() < 2 or name.endswith("base_kernel") else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # The fused step is one kernel over all tensors (CPU too): several times faster than the loop over them. But
        # under *-mixed precision Lightning refuses to clip the gradients of an optimizer that could unscale them
        # itself, so there the default is the multi-tensor (foreach) step; under bf16-mixed, which scales nothing,
        # optim.fused=true clips in DFlash2Module.configure_gradient_clipping instead.
        fused = not str(precision).endswith("-mixed") if self.fused is None else self.fused
        optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, fused=fused)
        scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(self.warmup_ratio * total_steps), total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def as_dict(obj: Any) -> dict[str, Any]:
    """A recipe object as the plain dict a checkpoint's hyper-parameters hold (weights_only loads accept it)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(obj).items()}
