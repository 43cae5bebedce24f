"""Between the decode loop and a proposer: what the loop gives it (`Rows`) and what it asks of it (`Proposer`). The
proposers, `dflash2.decoding.drafting.Drafter` and `dflash2.decoding.lookup.PromptLookup`, each plug in from their own
module, and the loops (dflash2/decoding/speculative.py, dflash2/decoding/static.py) name none of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import torch


@dataclasses.dataclass
class Rows:
    """Tensors of the requests still decoding. The target's KV cache and the drafter's context cache hold the
    same slots (the prompt, then B per verify step), so one mask and one set of positions serve both."""

    key_mask: torch.Tensor  # [b, slots] 1 = a committed token, 0 = padding or a rejected proposal
    positions: torch.Tensor  # [b, slots] RoPE position of each slot = committed tokens before it
    lengths: torch.Tensor  # [b] committed tokens = the position of the anchor
    anchor: torch.Tensor  # [b] the last committed token, not yet seen by the target
    # [b, c, n*H] target features of the last c slots, not yet in the drafter's cache; None without a drafter
    features: torch.Tensor | None
    tokens: torch.Tensor  # [b, capacity] the committed tokens without holes: tokens[:, :lengths], the anchor, junk
    live: torch.Tensor | None = None  # indices of the rows still decoding, where finished ones stay; None = every row
    # [b, c] the positions of the features' slots; None = the last c of `positions` (the fast path's buffers run on)
    context_positions: torch.Tensor | None = None

    def select(self, keep: torch.Tensor) -> Rows:
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        return Rows(*(None if v is None else v[keep] for v in values))


# What proposed a step's block, as `Proposal.source` numbers it and a request's `Generation.proposers` names it.
SOURCES = ("drafter", "lookup")


class Proposal(NamedTuple):
    """One step's proposals for every row: the tokens [b, B-1]; the q each was drawn from [b, B-1, V], or None for
    point masses (and at T = 0); and, from a proposer that combines others (`dflash2.decoding.hybrid.Hybrid`), which one
    proposed each row's block [b] (an index into SOURCES), None otherwise."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    source: torch.Tensor | None = None


class Proposer(Protocol):
    """What the decode loop asks of a proposer."""

    def slots(self, block_size: int) -> int:
        """How many of a block's B - 1 proposing slots it fills; refuses a block it cannot work with."""
        ...

    def new_cache(self, capacity: int | None = None) -> Any:
        """An empty cache of its own for a batch (None: it keeps none); with `capacity`, a static one of that many
        slots per row (`dflash2.model.drafter.StaticDraftCache`), which may be the previous batch's, emptied."""
        ...

    def pending(self, hidden: torch.Tensor, kept: torch.Tensor) -> Any:
        """What it takes in of the slots just verified (the target's features of them, or None)."""
        ...

    def __call__(
        self,
        rows: Rows,
        block_positions: torch.Tensor,
        draft_cache: Any,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        """The block's proposals for every row (`Proposal`)."""
        ...
