"""What decoding must compute at an anchor, written the plainest way: one uncached drafter forward."""

from __future__ import annotations

import torch


def fresh_block_output(target, draft, sequence, pos: int, block_size: int) -> torch.Tensor:
    """Drafter output at the proposing slots [B-1, H] for the block [sequence[pos], MASK, ...] at positions
    pos..pos+B-1, over the target's features of exactly the tokens before pos."""
    sequence = torch.as_tensor(sequence)
    block = torch.tensor([[int(sequence[pos])] + [draft.config.mask_token_id] * (block_size - 1)])
    positions = pos + torch.arange(block_size)[None]
    mask = None
    if "sliding_attention" in draft.config.layer_types:  # slot k sees the context p with (pos + k) - p < window
        near = positions[0, :, None] - torch.arange(pos)[None] < draft.config.sliding_window
        sliding = torch.cat([near, torch.ones(block_size, block_size, dtype=torch.bool)], -1)
        mask = {"full_attention": None, "sliding_attention": sliding[None, None]}
    with torch.no_grad():
        features = target.forward(sequence[None, :pos]).hidden
        out = draft(target.embed_tokens(block), positions, draft.fuse(features), torch.arange(pos)[None], mask)
    return out[0, 1:]
