"""Training blocks of contract section 7: random anchors, same-position labels, the block-sparse attention mask.

Queries are n blocks of B slots laid end to end (slot k of block j sits at absolute position anchor_j + k).
Keys are the L context tokens followed by the n*B block slots. A block sees the context strictly before its
anchor and itself bidirectionally, never another block; a padded block sees only itself, so no row is empty.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash2.decoding.lookup import PromptLookup
from dflash2.model.config import in_window
from dflash2.model.contract import check_block_size

IGNORE = -100  # the label of a slot that is not trained (cross-entropy's ignore_index); the losses read it here


def valid_anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a whose token and next token are both trainable: a block there has at least one label."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).flatten()


def sample_anchors(
    loss_mask: torch.Tensor,
    max_anchors: int,
    generator: torch.Generator | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """min(max_anchors, #valid) distinct sorted anchors among `valid_anchor_positions(loss_mask [L])`.

    A fixed count per sequence, not one proportional to its length: each target forward then supervises as many
    blocks as its replies allow (SpecForge and the DFlash paper draw the same way). Uniformly, or with `weights`
    [L] (> 0 at the valid positions, e.g. `CopyAnchors`') one at a time in proportion to the weights of the
    positions not drawn yet (torch.multinomial without replacement)."""
    valid = valid_anchor_positions(loss_mask)
    if weights is None:
        pick = torch.randperm(len(valid), generator=generator)[:max_anchors]
    elif len(valid) == 0:
        pick = valid
    else:
        pick = torch.multinomial(weights[valid].double(), min(max_anchors, len(valid)), generator=generator)
    return valid[pick].sort().values


def check_copy_anchors(weight: Any, min_match: Any, block_size: int | None = None) -> None:
    """`data.copy_anchor_weight` must be a number > 0 (1 = uniform anchors, as without it), `data.copy_anchor_min_match`
    an integer in 1..B-1 (B = `block_size` where known)."""
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not (math.isfinite(weight) and weight > 0):
        raise ValueError(
            f"data.copy_anchor_weight={weight!r}: the weight of an anchor prompt lookup would continue, relative to "
            "the others, must be a number > 0 (1 = every anchor alike, the default; e.g. 4 draws copyable anchors "
            "4 times as often)"
        )
    top = math.inf if block_size is None else block_size - 1
    if isinstance(min_match, bool) or not isinstance(min_match, int) or not 1 <= min_match <= top:
        most = "B-1" if block_size is None else f"{top} (block_size={block_size} less the anchor)"
        raise ValueError(
            f"data.copy_anchor_min_match={min_match!r}: how many of prompt lookup's proposals must match the reply "
            f"for an anchor to count as copyable, an integer from 1 to {most}; 1 = at least one accepted"
        )


@dataclasses.dataclass(frozen=True)
class CopyAnchors:
    """data.copy_anchor_weight: anchors drawn `weight` times as often where the reply repeats its context, i.e. where
    prompt lookup (`dflash2.decoding.lookup.PromptLookup` with the settings of `evaluate.py drafter=pld`) would have
    at least `min_match` of its proposals accepted: from the tokens up to the anchor, its first `min_match` proposals
    equal the trained tokens that follow. The blocks there are what a drafter has to copy to accept as much as the
    lookup. Computed once per fetched row, from its token ids alone (a few sorts; no target)."""

    weight: float
    block_size: int
    min_match: int = 1
    lookup: PromptLookup = PromptLookup()

    def __post_init__(self) -> None:
        check_block_size(self.block_size, "block_size")
        check_copy_anchors(self.weight, self.min_match, self.block_size)

    def copyable(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """[L] bool: whether a block anchored there is copyable."""
        matched = self.lookup.matched_lengths(input_ids, self.block_size, counted=loss_mask)
        return matched >= self.min_match

    def __call__(self, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """[L] float64 weights for `sample_anchors`: `weight` at the copyable positions, 1 elsewhere."""
        copyable = self.copyable(input_ids, loss_mask)
        return torch.where(copyable, float(self.weight), 1.0).double()


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
    holds the anchor and k-1 masks before it, so no shift). IGNORE past the end, on untrained tokens and on
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


def block_mask(
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    context_len: int,
    block_size: int,
    context_valid: torch.Tensor | None = None,
    window: int | None = None,
    flex: bool = False,
    device: torch.device | str | None = None,
    BLOCK_SIZE: int = 128,  # noqa: N803 (flex attention's name)
) -> Any:
    """The mask of n blocks at `anchors` [b, n] over L = `context_len` context keys, of which `context_valid` [b, L]
    says which exist (None: all), on `device` (default anchors'). `window` (a sliding layer): slot k of the block at
    anchor a sees only the context positions p with (a + k) - p < window, as the engines' sliding layers count it
    from each query's own position. Every (query, key) pair follows `block_mask_mod`.

    Without `flex`: bool [b, 1, n*B, L + n*B], True = attend (keys: the L context tokens, then the blocks). With
    `flex`: the same mask as a flex attention BlockMask of BLOCK_SIZE tiles, built tile by tile from each query tile's
    range of anchors, not by evaluating the mask at every (query, key) pair as create_block_mask does (billions of
    pairs at training lengths). A (query tile, key tile) pair is skipped when no key of it can be visible to a query
    of it, attended without the mask when every key is visible to every query (context before the tile's lowest
    anchor, all of it real and inside every window), and masked by `block_mask_mod` otherwise."""
    device = anchors.device if device is None else torch.device(device)
    b, n = anchors.shape
    q_len, kv_len = n * block_size, context_len + n * block_size
    limit = torch.where(anchor_valid.bool(), anchors, 0).to(device)
    known = _key_visible(context_valid, b, context_len, kv_len, device)
    mask_mod = block_mask_mod(limit, known, context_len, block_size, window)
    q = torch.arange(q_len, device=device)
    if not flex:
        rows, kv = torch.arange(b, device=device)[:, None, None], torch.arange(kv_len, device=device)
        return mask_mod(rows, None, q[None, :, None], kv).unsqueeze(1)

    tile = BLOCK_SIZE
    q_tiles, kv_tiles = -(-q_len // tile), -(-kv_len // tile)
    big = 2**30

    def over_query_tiles(x: torch.Tensor, fill: int, reduce) -> torch.Tensor:  # [b, q_len] -> [b, q_tiles, 1]
        x = torch.nn.functional.pad(x, (0, q_tiles * tile - q_len), value=fill)
        return reduce(x.view(b, q_tiles, tile), -1).unsqueeze(-1)

    limit_q = limit.repeat_interleave(block_size, dim=1)  # [b, q_len]: the context end each query sees
    first_key = torch.arange(kv_tiles, device=device) * tile
    last_key = (first_key + tile).clamp(max=kv_len) - 1
    known_tiles = torch.nn.functional.pad(known, (0, kv_tiles * tile - kv_len), value=False).view(b, kv_tiles, tile)
    # Context keys are the first context_len; `known` is False past them, so `all` holds only for context tiles.
    some = (first_key < over_query_tiles(limit_q, 0, torch.amax)) & known_tiles.any(-1).unsqueeze(1)
    full = (last_key < over_query_tiles(limit_q, big, torch.amin)) & known_tiles.all(-1).unsqueeze(1)
    if window is not None:  # a query tile sees some key of a key tile when its lowest query sees the last key,
        # and every key when its highest query sees the first (pads: never the lowest, never the highest)
        query = limit_q + q % block_size
        some &= in_window(over_query_tiles(query, big, torch.amin), last_key, window)
        full &= in_window(over_query_tiles(query, -big, torch.amax), first_key, window)
    # The block keys: query tile i holds blocks first//B .. last//B, whose slots are keys L + B*(first//B) onwards.
    first_query = torch.arange(q_tiles, device=device) * tile
    last_query = (first_query + tile).clamp(max=q_len) - 1
    lo = context_len + first_query // block_size * block_size
    hi = context_len + (last_query // block_size + 1) * block_size  # exclusive
    own_blocks = (first_key < hi[:, None]) & (last_key >= lo[:, None])  # [q_tiles, kv_tiles]
    partial = (some | own_blocks) & ~full

    def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [b, q_tiles, kv_tiles] -> counts, ids
        tiles = tiles.unsqueeze(1)
        order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True)
        return tiles.sum(-1, dtype=torch.int32), order.to(torch.int32)

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=tile,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


def block_mask_mod(
    limit: torch.Tensor, known: torch.Tensor, context_len: int, block_size: int, window: int | None = None
):
    """The rule of the training mask (module docstring), as a flex attention mask_mod: `limit` [b, n] = anchor (0 for
    padded blocks), `known` [b, L + n*B] = key exists, `window` as in `block_mask`. Indices may be tensors that
    broadcast (`block_mask` evaluates it over every pair for the dense mask)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        context = (kv_idx < limit[b, block]) & known[b, kv_idx]
        if window is not None:
            context = context & in_window(limit[b, block] + q_idx % block_size, kv_idx, window)
        same_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return context | same_block

    return mask_mod


# The two forms by name: dense on the CPU, flex on CUDA (module.py: block_attention_mask chooses).
dense_block_mask = functools.partial(block_mask, flex=False)
flex_block_mask = functools.partial(block_mask, flex=True)
