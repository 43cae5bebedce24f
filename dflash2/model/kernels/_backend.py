"""Which implementation the kernels run: Triton on CUDA tensors, the PyTorch reference elsewhere, or one forced."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

try:
    import triton
except ImportError:  # the references need no Triton; "auto" then always picks them
    triton = None

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "DFLASH2_KERNELS"


def _checked(name: str, source: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{source} is {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def backend_from_env() -> str:
    """The initial backend: $DFLASH2_KERNELS, "auto" when unset."""
    return _checked(os.environ.get(ENV_VAR, "").strip().lower() or "auto", f"${ENV_VAR}")


_current = backend_from_env()


def get_backend() -> str:
    return _current


def set_backend(name: str) -> None:
    """Choose "auto" (Triton on CUDA tensors, the reference otherwise), "triton", or "torch" (the reference)."""
    global _current
    _current = _checked(name, "the kernel backend")


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run a block with another backend, restoring the previous one afterwards."""
    previous = get_backend()
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def is_interpreted(kernel: object) -> bool:
    # triton.jit chooses the interpreter when the kernel is defined, so ask the kernel, not today's environment.
    return type(kernel).__name__ == "InterpretedFunction"


def use_triton(tensor: torch.Tensor, kernel: object) -> bool:
    """Whether `kernel` should run on `tensor`; raises when Triton is forced where it cannot run."""
    if _current == "torch":
        return False
    if _current == "auto":
        return kernel is not None and tensor.is_cuda
    if kernel is None:
        raise RuntimeError(
            "the 'triton' kernel backend was forced but triton is not importable; "
            "install triton or use dflash2.model.kernels.set_backend('torch')"
        )
    if not tensor.is_cuda and not is_interpreted(kernel):
        raise ValueError(
            f"the 'triton' kernel backend got tensors on {tensor.device}; Triton needs CUDA tensors, or "
            "TRITON_INTERPRET=1 set before triton is first imported to run on the CPU"
        )
    return True
