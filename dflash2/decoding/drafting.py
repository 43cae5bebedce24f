"""A DFlash2 drafter as the decode loop's proposer (`proposer.Proposer`; prompt lookup is the other one,
dflash2/decoding/lookup.py): the target features of the slots just verified go into the drafter's context cache, then
one forward over the block `[anchor, MASK, ...]` whose B-1 proposing rows become tokens (`distributions.propose`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dflash2.decoding.distributions import propose
from dflash2.decoding.proposer import Proposal, Rows
from dflash2.model import kernels
from dflash2.model.config import in_window
from dflash2.model.drafter import DFlash2DraftModel, DraftCache, StaticDraftCache
from dflash2.target.model import compiled_step
from dflash2.target.static_cache import reused


def draft_mask(
    draft: DFlash2DraftModel, key_mask: torch.Tensor, lengths: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor | dict:
    """Bool [b, 1, B, slots + B] (`Rows`' key_mask, lengths and positions): the block sees every committed context
    slot and all of itself; on sliding layers slot k sees the context positions p with (anchor + k) - p <
    sliding_window (the window counted from each query's own position, as the engines count it)."""
    valid = key_mask.bool()
    ones = valid.new_ones(valid.shape[0], block_size, block_size)

    def build(window: int | None) -> torch.Tensor:
        seen = valid[:, None].expand(-1, block_size, -1)
        if window is not None:
            query = lengths[:, None] + torch.arange(block_size, device=valid.device)  # [b, B]
            seen = seen & in_window(query[:, :, None], positions[:, None], window)
        return torch.cat([seen, ones], -1)[:, None]

    return draft.config.attention_masks(build)


def only_kept(features: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Zero the features of masked slots: a padded or rejected slot may hold anything (even NaN), and a masked
    key still multiplies its value by 0 inside attention."""
    return torch.where(kept[..., None], features, 0)


def draft_forward(
    draft: DFlash2DraftModel,
    block_embeds: torch.Tensor,
    block_positions: torch.Tensor,
    features: torch.Tensor,
    context_positions: torch.Tensor,
    key_mask: torch.Tensor,
    lengths: torch.Tensor,
    positions: torch.Tensor,
    cache: DraftCache,
) -> torch.Tensor:
    """One draft step's forward: the target features of the slots just verified into the drafter's cache, then the
    block `[anchor, MASK, ...]` over that context -> norm(h) [b, B, H]."""
    block_size = block_positions.shape[1]
    mask = draft_mask(draft, key_mask, lengths, positions, block_size)
    context = draft.fuse(features)
    return draft(block_embeds, block_positions, context, context_positions, mask, cache=cache, block_size=block_size)


def draft_ingest(
    draft: DFlash2DraftModel, features: torch.Tensor, context_positions: torch.Tensor, cache: DraftCache
) -> None:
    """The target features of the slots just verified into the drafter's cache, with no block: a step that another
    proposer drafted (`dflash2.decoding.hybrid`), so that the drafter's context stays every committed slot."""
    draft.ingest(draft.fuse(features), context_positions, cache)


# (draft_forward or draft_ingest, torch.compile mode) -> that function compiled, on the reference kernels
_compiled: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}
# draft model -> {capacity: its StaticDraftCache}, which every batch of that capacity reuses (`reused`)
_static_caches: weakref.WeakKeyDictionary[DFlash2DraftModel, dict[int, StaticDraftCache]] = weakref.WeakKeyDictionary()


def _on_reference_kernels(step: Callable[..., Any], *args: Any) -> Any:
    with kernels.backend("torch"):
        return step(*args)


class Drafter:
    """A DFlash2 drafter as the loop's proposer: the target features of the newly committed slots go into its
    cache, then one forward over `[anchor, MASK, ...]` whose B-1 proposing rows become tokens (`propose`).

    `compile` (a torch.compile mode, the fast path's): the forward of every step whose shapes repeat, a verify
    block's features into a `StaticDraftCache` already allocated, runs compiled (CUDA graphs with reduce-overhead),
    the grouped conv on its PyTorch reference, which the compiler fuses; the first step after a prefill stays eager."""

    def __init__(self, target: Any, draft: DFlash2DraftModel, use_selector: bool, compile: str | None = None) -> None:
        self.target, self.draft, self.use_selector, self.compile = target, draft, use_selector, compile

    def slots(self, block_size: int) -> int:
        return block_size - 1  # one forward proposes every slot, at any block size

    def new_cache(self, capacity: int | None = None) -> DraftCache:
        """An empty context cache: growing (None) or of `capacity` slots per row, the same one for the same capacity
        (`reused`; the last two kept: a warm-up's call and the timed ones may differ)."""
        layers = self.draft.config.num_hidden_layers
        if capacity is None:
            return DraftCache(layers)
        caches = _static_caches.setdefault(self.draft, {})
        return reused(caches, capacity, lambda: StaticDraftCache(layers, capacity))

    def pending(self, hidden: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """What the next draft forward takes in: the target features of the slots just verified."""
        return only_kept(hidden, kept)

    def compiled(self, fn: Callable[..., Any], steady: bool) -> Callable[..., Any]:
        """`fn` (`draft_forward` or `draft_ingest`), compiled (`compile`) for a step whose shapes repeat (`steady`),
        with the grouped conv on its PyTorch reference, which the compiler fuses."""
        if self.compile is None or not steady:
            return fn
        if (fn, self.compile) not in _compiled:
            step = compiled_step(fn, self.compile)
            _compiled[fn, self.compile] = functools.partial(_on_reference_kernels, step)
        return _compiled[fn, self.compile]

    def context(self, rows: Rows, draft_cache: DraftCache, block_size: int) -> tuple[torch.Tensor, bool]:
        """The positions of the slots whose features the step takes in, and whether the step is steady: a static
        cache's buffers already there for these rows, and a verify block's features in. Claims the slots in a
        static cache."""
        c = rows.features.shape[1]
        positions = rows.positions[:, -c:] if rows.context_positions is None else rows.context_positions
        static = isinstance(draft_cache, StaticDraftCache)
        steady = static and draft_cache.allocated(len(rows.anchor)) and c == block_size
        if static:
            draft_cache.reserve(c, rows.anchor.device)
        return positions, steady

    def ingest(self, rows: Rows, block_size: int, draft_cache: DraftCache) -> None:
        """Take in the features of the slots just verified, with no block (`draft_ingest`)."""
        positions, steady = self.context(rows, draft_cache, block_size)
        self.compiled(draft_ingest, steady)(self.draft, rows.features, positions, draft_cache)

    def __call__(
        self,
        rows: Rows,
        block_positions: torch.Tensor,
        draft_cache: DraftCache,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        draft = self.draft
        masks = torch.full_like(block_positions[:, 1:], draft.config.mask_token_id)
        block_ids = torch.cat([rows.anchor[:, None], masks], -1)
        context_positions, steady = self.context(rows, draft_cache, block_positions.shape[1])
        hidden = self.compiled(draft_forward, steady)(
            draft,
            self.target.embed_tokens(block_ids),
            block_positions,
            rows.features,
            context_positions,
            rows.key_mask,
            rows.lengths,
            rows.positions,
            draft_cache,
        )
        return Proposal(*self.proposals(hidden, rows.anchor, temperature, generator, rows.live))

    def proposals(
        self,
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None,
        live: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block's draft hidden states [b, B, H] (the anchor's row first) -> (tokens [b, B-1], q or None)
        (`distributions.propose`); greedy (T = 0) draws nothing, so `generator` may be None."""
        head = self.target.lm_head_weight
        return propose(
            self.draft,
            head,
            hidden[:, 1:],
            anchor,
            temperature=temperature,
            use_selector=self.use_selector,
            vocab=head.shape[0],
            generator=generator,
            live=live,
        )
