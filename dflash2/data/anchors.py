"""Training blocks of contract section 7: random anchors, same-position labels, the block-sparse attention mask.

Queries are n blocks of B slots laid end to end (slot k of block j sits at absolute position anchor_j + k).
Keys are the L context tokens followed by the n*B block slots. A block sees the context strictly before its
anchor and itself bidirectionally, never another block; a padded block sees only itself, so no row is empty.
"""

from __future__ import annotations

import torch

IGNORE = -100


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a whose token and next token are both trainable: a block there has at least one label."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """min(max_anchors, #valid) distinct sorted anchors among `valid_anchor_positions(loss_mask [L])`.

    A fixed count per sequence, not one proportional to its length: each target forward then supervises as many
    blocks as its replies allow (SpecForge and the DFlash paper draw the same way)."""
    valid = valid_anchor_positions(loss_mask)
    pick = torch.randperm(len(valid), generator=generator)[:max_anchors]
    return valid[pick].sort().values


def _slots(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., n] anchors -> [..., n, B] absolute positions anchor + k."""
    return anchors.unsqueeze(-1) + torch.arange(block_size, device=anchors.device)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Absolute position of every block slot: [..., n] -> [..., n*B]."""
    return _slots(anchors, block_size).flatten(-2)


def teacher_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Where slot k (1..B-1) of the block at anchor a takes its soft label: a + k - 1, the position whose target
    logits predict the token at a + k, its label. [..., n] -> [..., n, B-1]."""
    return _slots(anchors, block_size)[..., :-1]


def block_labels(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    anchor_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot k (1..B-1) of the block at anchor a predicts input_ids[a + k], the token AT that position (the block
    holds the anchor and k-1 masks before it, so no shift). -100 past the end, on untrained tokens and on
    padded blocks. Shapes: ids/mask [..., L], anchors [..., n] -> [..., n, B-1]."""
    length = input_ids.shape[-1]
    pos = _slots(anchors, block_size)[..., 1:]
    inside = pos < length
    flat = pos.clamp(max=length - 1).flatten(-2)
    tokens = input_ids.gather(-1, flat).view(pos.shape)
    trained = loss_mask.gather(-1, flat).view(pos.shape).bool() & inside
    if anchor_valid is not None:
        trained &= anchor_valid.bool().unsqueeze(-1)
    return torch.where(trained, tokens, torch.full_like(tokens, IGNORE))


def block_ids(
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    anchor_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block inputs [anchor token, MASK, ..., MASK]: [..., n] -> [..., n*B]; padded blocks are all MASK."""
    first = input_ids.gather(-1, anchors)
    if anchor_valid is not None:
        first = torch.where(anchor_valid.bool(), first, torch.full_like(first, mask_token_id))
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[..., 0] = first
    return ids.flatten(-2)


def _key_visible(
    context_valid: torch.Tensor | None, batch: int, context_len: int, total: int, device: torch.device
) -> torch.Tensor:
    """[b, L + n*B]: which context keys exist (padding never does); the block part is left to the block rule."""
    ok = torch.zeros(batch, total, dtype=torch.bool, device=device)
    ok[:, :context_len] = True if context_valid is None else context_valid.bool().to(device)
    return ok


def dense_block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    context_len: int,
    block_size: int,
    context_valid: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """bool [b, 1, n*B, L + n*B], True = attend (keys: L context tokens, then the blocks). `window` (a sliding layer):
    slot k of the block at anchor a sees only the context positions p with (a + k) - p < window, as the engines'
    sliding layers count it from each query's own position."""
    b, n = anchors.shape
    q = torch.arange(n * block_size, device=anchors.device)
    kv = torch.arange(context_len + n * block_size, device=anchors.device)
    limit = torch.where(anchor_valid.bool(), anchors, 0).repeat_interleave(block_size, dim=1)  # [b, q]
    known = _key_visible(context_valid, b, context_len, len(kv), anchors.device)
    context = (kv[None, None, :] < limit[:, :, None]) & known[:, None, :]
    if window is not None:
        context &= (limit + q % block_size)[:, :, None] - kv[None, None, :] < window
    same_block = (kv[None, :] >= context_len) & (
        (kv[None, :] - context_len) // block_size == (q // block_size)[:, None]
    )
    return (context | same_block[None]).unsqueeze(1)


def flex_block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    context_len: int,
    block_size: int,
    context_valid: torch.Tensor | None = None,
    window: int | None = None,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int | tuple[int, int] = 128,  # noqa: N803 (flex attention's name)
    compiled: bool = False,
):
    """The same mask as `dense_block_mask`, as a flex attention BlockMask (device defaults to anchors').

    `compiled`: build it with a compiled mask_mod; eagerly, create_block_mask evaluates the mask at every (query, key)
    pair of the batch, gigabytes of intermediates at training lengths."""
    from torch.nn.attention.flex_attention import create_block_mask

    device = anchors.device if device is None else torch.device(device)
    b, n = anchors.shape
    total = context_len + n * block_size
    limit = torch.where(anchor_valid.bool(), anchors, 0).to(device)
    known = _key_visible(context_valid, b, context_len, total, device)
    mask_mod = block_mask_mod(limit, known, context_len, block_size, window)
    return create_block_mask(
        mask_mod,
        B=b,
        H=None,
        Q_LEN=n * block_size,
        KV_LEN=total,
        device=device,
        BLOCK_SIZE=BLOCK_SIZE,
        _compile=compiled,
    )


def block_mask_mod(
    limit: torch.Tensor, known: torch.Tensor, context_len: int, block_size: int, window: int | None = None
):
    """flex attention mask_mod: `limit` [b, n] = anchor (0 for padded blocks), `known` [b, L + n*B] = key exists,
    `window` as in `dense_block_mask`."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        context = (kv_idx < limit[b, block]) & known[b, kv_idx]
        if window is not None:
            context = context & (limit[b, block] + q_idx % block_size - kv_idx < window)
        same_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return context | same_block

    return mask_mod
