"""dflash2: train, export and evaluate DFlash2 speculative-decoding drafters."""

from dflash2.model.config import DFlash2Config, default_target_layer_ids, tensor_shapes
from dflash2.model.conv import DFlashGroupedConv
from dflash2.model.drafter import DFlash2DraftModel, DraftCache
from dflash2.model.selector import CandidateSelector

__version__ = "0.1.0"
__all__ = [
    "CandidateSelector",
    "DFlash2Config",
    "DFlash2DraftModel",
    "DFlashGroupedConv",
    "DraftCache",
    "default_target_layer_ids",
    "tensor_shapes",
]
