"""One verify step, one function: the fast path's greedy steps whole (`decode=static`, T = 0), for a CUDA graph.

A step of dflash2/decoding/static.py runs as pieces with host work between them: the drafter's forward, the selector's
walk, the verify forward, the accept lengths and the bookkeeping of the caches and the tokens. At one request each
piece is a few microseconds of GPU work behind tens of microseconds of Python and kernel launches, so the step costs
the host's time, not the GPU's. Here a steady step is one function of tensors that the decode loop only calls: it
proposes, verifies, accepts and updates every buffer in place, the caches' pointer included (`StepBuffers.end`, on the
device), and returns what the host must read, the committed tokens, in one tensor. Under torch.compile (compile=true)
the whole of it is one graph, under reduce-overhead one CUDA graph replayed each step; the host reads once per step.

The step computes what the per-piece step computes, in the same order, from the same buffers (tests compare the two,
and both with the plain loops, token for token and step for step). Greedy only: a sampled step draws from the run's
generator, which a captured graph cannot advance; T > 0 runs the per-piece step. The first step of a batch also does:
the drafter then takes in the prompt's features, a context of another shape.

The proposers whole: a drafter (`drafting.Drafter`), prompt lookup, or both (`hybrid.Hybrid`). The hybrid's step
computes both proposals and keeps lookup's on the rows its rule picks; where every row still decoding takes lookup's,
known from the step before (it returns the rule's pick for the next step with the tokens), the loop calls a step that
runs no drafter forward and only writes the new features into the drafter's cache.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dflash2.decoding import drafting
from dflash2.decoding.drafting import Drafter, only_kept
from dflash2.decoding.hybrid import LOOKUP, Hybrid
from dflash2.decoding.lookup import PromptLookup
from dflash2.decoding.proposer import Proposer
from dflash2.decoding.speculative import top_margins
from dflash2.model import kernels
from dflash2.target.model import compiled_step
from dflash2.target.static_cache import reused

DRAFT, LOOK, BOTH = "draft", "lookup", "hybrid"  # the steps: the drafter's, lookup's (the drafter ingesting), both


@dataclasses.dataclass
class StepBuffers:
    """A batch's decode state on the device, at fixed addresses (a CUDA graph mutates them in place), the same
    buffers for every batch of one shape. `end` is where both caches' next block goes; `features` the target's
    features of the slots just verified, which the drafter takes in next."""

    key_mask: torch.Tensor  # [rows, capacity] long
    positions: torch.Tensor  # [rows, capacity] long
    tokens: torch.Tensor  # [rows, width] long: each row's committed tokens, then room
    lengths: torch.Tensor  # [rows] long
    anchor: torch.Tensor  # [rows] long
    live: torch.Tensor  # [rows] bool: the rows still decoding
    features: torch.Tensor | None  # [rows, B, n*H], None without a drafter
    end: torch.Tensor  # [1] long
    offsets: torch.Tensor  # [B] long: 0..B-1

    @classmethod
    def like(cls, tokens: torch.Tensor, key_mask: torch.Tensor, block_size: int, features: Any) -> StepBuffers:
        device = tokens.device
        rows = key_mask.shape[0]
        made = cls(
            key_mask=torch.zeros_like(key_mask),
            positions=torch.zeros_like(key_mask),
            tokens=torch.zeros_like(tokens),
            lengths=torch.zeros(rows, dtype=torch.long, device=device),
            anchor=torch.zeros(rows, dtype=torch.long, device=device),
            live=torch.zeros(rows, dtype=torch.bool, device=device),
            features=None if features is None else features.new_zeros(rows, block_size, features.shape[-1]),
            end=torch.zeros(1, dtype=torch.long, device=device),
            offsets=torch.arange(block_size, device=device),
        )
        for field in dataclasses.fields(made):  # not astuple: it would copy them
            if (buffer := getattr(made, field.name)) is not None:
                torch._dynamo.mark_static_address(buffer)
        return made

    def reset(self) -> None:
        """Nothing to empty: every buffer is loaded whole before a batch's first step (`load`)."""

    def load(self, **values: Any) -> None:
        """Copy a batch's state in (by field name), each buffer whole."""
        for name, value in values.items():
            target = getattr(self, name)
            target.copy_(torch.as_tensor(value, device=target.device).view(target.shape))


def pending_slots(buffers: StepBuffers, draft_cache: Any) -> torch.Tensor:
    """The positions of the last block's slots, whose features the drafter takes in now [rows, B], its cache's pointer
    set to them: they go where that block went in the target's cache."""
    b, block = buffers, buffers.offsets.shape[0]
    draft_cache.pointer.copy_(b.end - block)
    return b.positions.index_select(1, b.end - block + b.offsets)


@dataclasses.dataclass(frozen=True)
class Step:
    """What a step needs besides its buffers: the target and the proposer's parts."""

    target: Any
    drafter: Drafter | None
    lookup: PromptLookup | None
    hybrid: Hybrid | None
    margins: bool

    # ------------------------------------------------------------------ proposing
    def drafted(self, buffers: StepBuffers, draft_cache: Any, block_positions: torch.Tensor) -> torch.Tensor:
        """The drafter's greedy proposals [rows, B-1], the features of the slots just verified into its cache."""
        drafter, b = self.drafter, buffers
        context_positions = pending_slots(b, draft_cache)
        masks = torch.full_like(block_positions[:, 1:], drafter.draft.config.mask_token_id)
        block_ids = torch.cat([b.anchor[:, None], masks], -1)
        embeds = self.target.embed_tokens(block_ids)
        hidden = drafting.draft_forward(
            drafter.draft, embeds, block_positions, b.features, context_positions, b.key_mask, b.lengths,
            b.positions, draft_cache,
        )  # fmt: skip
        return drafter.proposals(hidden, b.anchor, 0.0, None)[0]

    def ingested(self, buffers: StepBuffers, draft_cache: Any) -> None:
        """The features of the slots just verified into the drafter's cache, no block drafted."""
        context_positions = pending_slots(buffers, draft_cache)
        drafting.draft_ingest(self.drafter.draft, buffers.features, context_positions, draft_cache)

    def looked(self, buffers: StepBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """Lookup's proposals [rows, B-1], and where the hybrid's rule takes them [rows] (all True without one)."""
        b, block = buffers, buffers.offsets.shape[0]
        committed = b.lengths + 1
        follow, ngram = self.lookup.find(b.tokens, committed)
        proposals = self.lookup.continuation(b.tokens, committed, follow, block)
        if self.hybrid is None:
            return proposals, torch.ones_like(b.live)
        available = self.lookup.available(committed, follow, block)
        return proposals, self.hybrid.rule.takes(ngram, available, self.lookup.slots(block))

    # ------------------------------------------------------------------ the step
    def __call__(self, kind: str, buffers: StepBuffers, cache: Any, draft_cache: Any) -> tuple[torch.Tensor, ...]:
        """One greedy step, every buffer updated in place -> (the host's read [rows, B + 3]: proposals, accepted,
        bonus, source, and whether a hybrid's rule takes lookup at each row's next step; the margins of the block's
        tokens [rows, B, 2], or an empty tensor)."""
        b = buffers
        block = b.offsets.shape[0]
        block_positions = b.lengths[:, None] + b.offsets
        source = torch.zeros_like(b.lengths)
        if kind == DRAFT:
            proposals = self.drafted(b, draft_cache, block_positions)
        elif kind == LOOK:
            proposals, _ = self.looked(b)
            source = source + LOOKUP
            if self.drafter is not None:
                self.ingested(b, draft_cache)
        else:
            looked, take = self.looked(b)
            proposals = torch.where(take[:, None], looked, self.drafted(b, draft_cache, block_positions))
            source = take.long() * LOOKUP

        # Verify: the whole block enters the target's cache at `end`; the rejected slots are masked.
        slots = b.end + b.offsets
        b.key_mask.index_fill_(1, slots, 1)
        out = self.target._decode_step(torch.cat([b.anchor[:, None], proposals], -1), b.key_mask, block_positions,
                                       cache)  # fmt: skip
        logits, hidden = out
        best = logits.argmax(-1)
        accepted = (proposals == best[:, :-1]).long().cumprod(-1).sum(-1)
        bonus = best.gather(1, accepted[:, None]).squeeze(1)
        kept = (b.offsets[None] <= accepted[:, None]) & b.live[:, None]
        b.key_mask.index_copy_(1, slots, kept.long())
        b.positions.index_copy_(1, slots, block_positions)
        b.end.add_(block)
        b.lengths.add_(torch.where(b.live, accepted + 1, 0))
        b.tokens.scatter_(1, block_positions[:, 1:], proposals)
        b.tokens.scatter_(1, b.lengths[:, None], bonus[:, None])
        b.anchor.copy_(torch.where(b.live, bonus, b.anchor))
        if b.features is not None:
            b.features.copy_(only_kept(hidden, kept))
        take_next = self.looked(b)[1] if self.hybrid is not None else b.live
        read = torch.cat([proposals, accepted[:, None], bonus[:, None], source[:, None], take_next[:, None].long()], -1)
        margins = top_margins(logits, True) if self.margins else logits.new_zeros(0)
        return read, margins


class WholeSteps:
    """A decode call's steady greedy steps (`Step`), compiled whole under `compile` (a torch.compile mode; None =
    run as they are), one function per kind of step, and the buffers they run on. Both are kept from call to call:
    the functions per target, proposer and mode (a compile each), the buffers per target and shape (a CUDA graph
    records each)."""

    def __init__(self, target: Any, proposer: Proposer, compile: str | None, margins: bool) -> None:
        hybrid = proposer if isinstance(proposer, Hybrid) else None
        drafter = hybrid.drafter if hybrid else (proposer if isinstance(proposer, Drafter) else None)
        lookup = hybrid.lookup if hybrid else (proposer if isinstance(proposer, PromptLookup) else None)
        self.target, self.compile, self.margins = target, compile, margins
        self.parts = (drafter, lookup, hybrid)
        self.kinds = [BOTH, LOOK] if hybrid else ([DRAFT] if drafter else [LOOK])

    @staticmethod
    def handles(proposer: Proposer) -> bool:
        return isinstance(proposer, Drafter | PromptLookup | Hybrid)

    def buffers(self, tokens: torch.Tensor, key_mask: torch.Tensor, block_size: int, features: Any) -> StepBuffers:
        """The buffers of this shape: the same ones every batch and call (a CUDA graph replays at their addresses)."""
        shapes = _buffers.setdefault(self.target, {})
        key = (tuple(tokens.shape), tuple(key_mask.shape), block_size, None if features is None else features.shape[-1])
        return reused(shapes, key, lambda: StepBuffers.like(tokens, key_mask, block_size, features))

    def first_take(self, buffers: StepBuffers) -> list[bool] | None:
        """A hybrid's pick of each row's first whole step, as the step before would have given it (`kind`)."""
        if self.parts[2] is None:
            return None
        step = Step(self.target, *self.parts, self.margins)
        return step.looked(buffers)[1].tolist()

    def kind(self, take_next: list[bool] | None, done: list[bool]) -> str:
        """The step to run: the hybrid's lookup step where every row still decoding takes lookup next, else the
        first kind."""
        if (
            len(self.kinds) > 1
            and take_next is not None
            and all(t for t, d in zip(take_next, done, strict=False) if not d)
        ):
            return LOOK
        return self.kinds[0]

    def function(self, kind: str) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The step of `kind`, compiled under `compile` with the grouped conv and the walk on their PyTorch
        references, which the compiler fuses: one function per target, proposer's settings, kind and mode."""
        drafter, lookup, hybrid = self.parts
        step = Step(self.target, drafter, lookup, hybrid, self.margins)
        if self.compile is None:
            return step
        key = (
            id(self.target), id(drafter.draft) if drafter else None, drafter.use_selector if drafter else None,
            lookup, hybrid.rule if hybrid else None, self.margins, kind, self.compile,
        )  # fmt: skip
        if key not in _functions:  # the Step kept with it holds the models, so their ids stay theirs
            _functions[key] = _on_reference_kernels(compiled_step(step, self.compile))
        return _functions[key]

    def __call__(
        self, kind: str, buffers: StepBuffers, cache: Any, draft_cache: Any
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """One step -> (the host's read, per row: proposals, accepted, bonus, source, take next; the margins or
        None), the step's one wait for the device."""
        read, margins = self.function(kind)(kind, buffers, cache, draft_cache)
        return read.tolist(), margins if self.margins else None


# target -> {shape: its StepBuffers}; (target, draft, settings, kind, mode) -> the step compiled
_buffers: weakref.WeakKeyDictionary[Any, dict[tuple, StepBuffers]] = weakref.WeakKeyDictionary()
_functions: dict[tuple, Callable[..., Any]] = {}


def _on_reference_kernels(step: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with kernels.backend("torch"):
            return step(*args)

    return run
