"""The two production kernels (Triton) with their PyTorch references and a switch between them.

`set_backend("auto")` (the default, or $DFLASH2_KERNELS) runs Triton on CUDA tensors and the reference elsewhere;
"triton" forces the kernels (CPU tensors need TRITON_INTERPRET=1 before triton is imported); "torch" forces the
references.
"""

from dflash2.model.kernels._backend import backend, get_backend, set_backend
from dflash2.model.kernels.grouped_conv import grouped_conv, grouped_conv_reference
from dflash2.model.kernels.selector_walk import selector_walk, selector_walk_reference

__all__ = [
    "backend",
    "get_backend",
    "grouped_conv",
    "grouped_conv_reference",
    "selector_walk",
    "selector_walk_reference",
    "set_backend",
]
