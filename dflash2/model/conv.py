"""DFlash2's grouped dynamic depthwise convolution over the positions of a block (contract section 4)."""

from __future__ import annotations

import torch
from torch import nn

from dflash2.model import kernels


class DFlashGroupedConv(nn.Module):
    """Wraps one sublayer: `prepare` mixes its input, `finish` mixes its output, both inside each block.

    One projection per token yields the dynamic taps of both sides ([2, T, G]): side 0 is used at once by
    `prepare`, side 1 is handed to `finish`, so the sublayer output is convolved with coefficients that were
    computed from the sublayer's input.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.hidden_size, self.taps, self.group_size = hidden_size, taps, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # The identity: tap 0 passes the token through, every other tap and every dynamic coefficient is zero.
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., tokens, H], tokens in whole blocks of `block_size` -> (convolved x, side-1 coefficients for
        `finish`). The block size is the caller's, per call: engines pick B at run time."""
        flat = x.reshape(-1, self.hidden_size)
        if flat.shape[0] % block_size:
            raise ValueError(
                f"{flat.shape[0]} tokens is not a whole number of blocks of {block_size}; "
                "the convolution needs block-aligned tokens"
            )
        delta = self.kernel_projection(flat).view(-1, 2, self.taps, self.groups)
        y = kernels.grouped_conv(flat, delta[:, 0], self.base_kernel[0], block_size)
        return y.view_as(x), delta[:, 1]

    def finish(self, x: torch.Tensor, coeffs: torch.Tensor, block_size: int) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden_size)
        y = kernels.grouped_conv(flat, coeffs, self.base_kernel[1], block_size)
        return y.view_as(x)

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, taps={self.taps}, group={self.group_size}"
