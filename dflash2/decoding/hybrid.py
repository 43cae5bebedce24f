"""Prompt lookup and a drafter together: each step, each row's block comes from prompt lookup where its match passes a
rule, and from the drafter otherwise (`python evaluate.py drafter=<export> hybrid=ngram`).

The two are good at different steps. Where the text repeats itself, lookup's copy runs many tokens long and a drafter
trained on single tokens commits a few; elsewhere lookup proposes nothing the target keeps and the drafter does. The
rule looks only at the committed text (the match lookup finds there), never at a draw, so whichever proposer a row
takes, its block is verified exactly as that proposer's alone would be: lookup's proposals as point masses, the
drafter's with their q. Greedy output stays the target's, sampled output follows its distribution.

The drafter's context stays complete: the target's features of every verified slot enter its cache, whichever
proposer proposed the block. A step on which every row takes lookup runs no drafter forward; the features of the
slots just verified go into the cache alone (`Drafter.ingest`), which is what the forward would have written there.
A step where only some rows take lookup runs the drafter for the whole batch and keeps its block on the other rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dflash2.decoding.distributions import point_mass
from dflash2.decoding.drafting import Drafter
from dflash2.decoding.lookup import PromptLookup
from dflash2.decoding.proposer import SOURCES, Proposal, Rows

RULES = ("ngram",)  # evaluate.py's `hybrid` setting: the rules that pick lookup's block (null = the drafter alone)
LOOKUP = SOURCES.index("lookup")


@dataclasses.dataclass(frozen=True)
class NgramRule:
    """Lookup takes a row's block when the n-gram it matched is at least `min_ngram` tokens long and what follows the
    match gives at least `min_tokens` proposals (all the block's, in a block of fewer slots). A 1-token match is often
    chance (a common token seen before), and a short continuation commits few tokens even when all are right, where
    the drafter might commit as many: lookup pays where the text repeats at length. The defaults are the best of the
    rules measured (BENCHMARKS.md, "Prompt lookup beside the drafter")."""

    min_ngram: int = 2
    min_tokens: int = 8

    def check(self, lookup: PromptLookup) -> None:
        """Refused in one sentence, named as evaluate.py's settings are typed (`hybrid_rule`)."""
        if type(self.min_ngram) is not int or not lookup.min_ngram <= self.min_ngram <= lookup.max_ngram:
            raise ValueError(
                f"hybrid_rule.min_ngram={self.min_ngram!r}: an integer from pld.min_ngram={lookup.min_ngram} to "
                f"pld.max_ngram={lookup.max_ngram}, the n-grams prompt lookup tries"
            )
        if type(self.min_tokens) is not int or self.min_tokens < 1:
            raise ValueError(f"hybrid_rule.min_tokens={self.min_tokens!r}: an integer >= 1")

    def takes(self, ngram: torch.Tensor, available: torch.Tensor, slots: int) -> torch.Tensor:
        """Whether lookup proposes each row's block: ngram, available [b] (`PromptLookup.find`, `.available`), the
        `slots` lookup fills in a block -> [b]."""
        return (ngram >= self.min_ngram) & (available >= min(self.min_tokens, slots))


class Hybrid:
    """The decode loop's proposer (`proposer.Proposer`) made of a drafter and prompt lookup, chosen per row and step by
    `rule`. Its `Proposal.source` says which one proposed each row's block, for the run's statistics."""

    def __init__(self, drafter: Drafter, lookup: PromptLookup, rule: NgramRule) -> None:
        rule.check(lookup)
        self.drafter, self.lookup, self.rule = drafter, lookup, rule

    def slots(self, block_size: int) -> int:
        self.lookup.slots(block_size)
        return self.drafter.slots(block_size)

    def new_cache(self, capacity: int | None = None) -> Any:
        return self.drafter.new_cache(capacity)

    def pending(self, hidden: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        return self.drafter.pending(hidden, kept)

    def __call__(
        self,
        rows: Rows,
        block_positions: torch.Tensor,
        draft_cache: Any,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        block_size, committed = block_positions.shape[1], rows.lengths + 1
        follow, ngram = self.lookup.find(rows.tokens, committed)
        available = self.lookup.available(committed, follow, block_size)
        looked = self.lookup.continuation(rows.tokens, committed, follow, block_size)
        take = self.rule.takes(ngram, available, self.lookup.slots(block_size))
        source = take.long() * LOOKUP
        live = take if rows.live is None else take[rows.live]
        if bool(live.all()):  # the step's one early wait for the device: whether any row needs the drafter
            self.drafter.ingest(rows, block_size, draft_cache)
            return Proposal(looked, None, source)
        drafted = self.drafter(rows, block_positions, draft_cache, temperature, generator)
        tokens = torch.where(take[:, None], looked, drafted.tokens)
        if drafted.q is None:
            return Proposal(tokens, None, source)
        q = torch.where(take[:, None, None], point_mass(looked, drafted.q.shape[-1]), drafted.q)
        return Proposal(tokens, q, source)
