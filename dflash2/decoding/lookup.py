"""Prompt lookup decoding (PLD): the training-free baseline, proposing text the request already holds.

It plugs into `dflash2.decoding.speculative.speculative_generate` in place of a drafter, so it is verified by the same
lossless loop and measured by the same statistics (`python evaluate.py drafter=pld`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dflash2.decoding.proposer import Proposal
from dflash2.model.contract import check_block_size

if TYPE_CHECKING:
    from dflash2.decoding.proposer import Rows


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """The rule: for n = `max_ngram` down to `min_ngram`, look for the request's last n tokens (prompt and committed
    output, the anchor last) earlier in those same tokens; the first n that occurs wins, and of its occurrences the
    LAST one that is not the suffix itself (it may overlap the suffix). The proposal is the tokens that followed that
    occurrence, up to `num_tokens` (None = B - 1) and up to the end of the request's tokens.

    transformers' `PromptLookupCandidateGenerator` and vLLM's `NgramProposer` also prefer the longest n-gram, but take
    its EARLIEST occurrence. We take the latest: in the text a model writes, repeats are local (the next line of a
    list or a derivation, the code being edited), so the most recent copy is the one whose continuation is most
    likely to be what comes next. The figure BENCHMARKS quotes for PLD used 15 tokens and n-grams up to 3, the
    defaults here at B = 16.

    Where the match yields fewer than B - 1 tokens (or nothing matches) the block is filled with `filler`, so every
    block stays B wide: a filler slot is a proposal like any other, accepted only where the target itself produces
    that token. Proposals are drawn from nothing, so at T > 0 each is a point mass (`verify` with q None), which keeps
    the verify exactly lossless. Needs no target features and no cache of its own.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    num_tokens: int | None = None
    filler: int = 0

    def __post_init__(self) -> None:
        # Named as evaluate.py's settings are typed (configs/evaluate.yaml, group `pld`).
        for name, value in (("max_ngram", self.max_ngram), ("min_ngram", self.min_ngram)):
            if type(value) is not int or value < 1:
                raise ValueError(f"pld.{name}={value!r}: it must be an integer >= 1")
        if self.num_tokens is not None and (type(self.num_tokens) is not int or self.num_tokens < 1):
            raise ValueError(f"pld.num_tokens={self.num_tokens!r}: an integer >= 1, or null = block_size - 1")
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"pld.min_ngram={self.min_ngram} is above pld.max_ngram={self.max_ngram}: the lookup tries n-grams "
                "from pld.max_ngram down to pld.min_ngram"
            )

    def slots(self, block_size: int) -> int:
        """How many of a block's B - 1 proposing slots the lookup may fill (the rest hold the filler)."""
        check_block_size(block_size)
        if self.num_tokens is not None and self.num_tokens > block_size - 1:
            raise ValueError(
                f"pld.num_tokens={self.num_tokens} does not fit a block of block_size={block_size} "
                f"(at most {block_size - 1} proposals); lower pld.num_tokens or raise block_size"
            )
        return block_size - 1 if self.num_tokens is None else self.num_tokens

    def settings(self, block_size: int) -> dict[str, int | None]:
        """The settings as results.json records them, `num_tokens` resolved at `block_size`."""
        return dataclasses.asdict(self) | {"num_tokens": self.slots(block_size)}

    def new_cache(self, capacity: int | None = None) -> None:
        return None  # nothing to cache: the lookup reads the committed tokens only

    def pending(self, hidden: torch.Tensor | None, kept: torch.Tensor) -> None:
        return None  # target features are of no use to a lookup: the drafter's cache is never fed

    def __call__(
        self,
        rows: Rows,
        block_positions: torch.Tensor,
        draft_cache: None,
        temperature: float,
        generator: torch.Generator,
    ) -> Proposal:
        """The decode loop's proposer: proposals [b, B-1], q None (point masses)."""
        return Proposal(self.lookup(rows.tokens, rows.lengths + 1, block_positions.shape[1]), None)

    def lookup(self, tokens: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
        """Row i's tokens `tokens[i, :lengths[i]]` ([b, capacity], anything after them) -> proposals [b, B-1]."""
        follow, _ = self.find(tokens, lengths)
        return self.continuation(tokens, lengths, follow, block_size)

    def find(self, tokens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The match of each row's tokens `tokens[i, :lengths[i]]` -> (where its proposal starts [b], -1 where nothing
        matches; the length n of the n-gram that matched [b], 0 where nothing does).

        Batched on the tokens' device: for each n, every window of n tokens is compared with the row's suffix."""
        b, capacity = tokens.shape
        follow = torch.full((b,), -1, dtype=torch.long, device=tokens.device)  # where the proposal starts, -1 = none
        ngram = torch.zeros(b, dtype=torch.long, device=tokens.device)
        for n in range(min(self.max_ngram, capacity), self.min_ngram - 1, -1):
            windows = tokens.unfold(1, n, 1)  # [b, capacity - n + 1, n]: windows[:, s] = tokens[:, s : s + n]
            suffix = tokens.gather(1, (lengths[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0))
            starts = torch.arange(windows.shape[1], device=tokens.device)
            # Strictly before the suffix's own start, which also keeps the window inside the row's tokens.
            hit = (windows == suffix[:, None]).all(-1) & (starts < lengths[:, None] - n)
            last = torch.where(hit, starts, -1).amax(-1)
            new = (follow < 0) & (last >= 0)
            follow, ngram = torch.where(new, last + n, follow), torch.where(new, n, ngram)
        return follow, ngram

    def available(self, lengths: torch.Tensor, follow: torch.Tensor, block_size: int) -> torch.Tensor:
        """How many tokens a match starting at `follow` proposes from the text (the rest of the block is filler): up to
        the end of the row's tokens and up to `slots(block_size)`; 0 where nothing matched. -> [b]"""
        return torch.where(follow >= 0, (lengths - follow).clamp(max=self.slots(block_size)), 0)

    def continuation(
        self, tokens: torch.Tensor, lengths: torch.Tensor, follow: torch.Tensor, block_size: int
    ) -> torch.Tensor:
        """The proposals [b, B-1] of matches starting at `follow` [b] (`find`): the tokens there, then filler."""
        capacity, width = tokens.shape[1], block_size - 1
        step = torch.arange(width, device=tokens.device)
        found = step[None] < self.available(lengths, follow, block_size)[:, None]
        index = (follow[:, None] + step).clamp(0, capacity - 1)
        return torch.where(found, tokens.gather(1, index), self.filler)

    def follows(self, tokens: torch.Tensor) -> torch.Tensor:
        """`lookup` at every prefix of one text at once: tokens [L] -> [L], where the proposal from the committed
        tokens `tokens[: a + 1]` (the anchor a last) starts, -1 where no n-gram matches (`matches`)."""
        return self.matches(tokens)[0]

    def matches(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`find` at every prefix of one text at once: tokens [L] -> (where the proposal from `tokens[: a + 1]` starts,
        -1 where no n-gram matches; the length of the n-gram that matched, 0 where none), each [L]. The same rule as
        `find` (tests/test_lookup.py compares them at every prefix), through an index of the n-grams: each n-gram gets
        an id, and each window the latest earlier window of the same id, so a whole conversation costs a few sorts
        instead of one comparison with every window per prefix."""
        length = len(tokens)
        follow = torch.full((length,), -1, dtype=torch.long, device=tokens.device)
        ngram = torch.zeros(length, dtype=torch.long, device=tokens.device)
        if length == 0:
            return follow, ngram
        text = (tokens - tokens.min()).long()  # ids >= 0, so that (n-gram id, next token) pairs number uniquely
        base = int(text.max()) + 1
        ids = torch.zeros(length, dtype=torch.long, device=tokens.device)  # the id of the n-gram at each start
        found = []  # per n, min_ngram up: (n, where the proposal of each prefix starts when its last n tokens match)
        for n in range(1, min(self.max_ngram, length) + 1):
            # The n-gram at s is the (n-1)-gram at s and the token at s + n - 1.
            codes = ids[: length - n + 1] * base + text[n - 1 :]
            order = torch.argsort(codes, stable=True)  # by n-gram, and by start within one
            ordered = codes[order]
            same = ordered[1:] == ordered[:-1]
            ids = torch.empty_like(codes)  # renumbered densely by rank, so that ids stay < L and codes fit int64
            ids[order] = torch.cat([same.new_zeros(1, dtype=torch.long), (~same).long().cumsum(0)])
            if n < self.min_ngram:
                continue
            earlier = torch.full_like(codes, -1)  # the latest earlier start of the same n-gram
            earlier[order[1:]] = torch.where(same, order[:-1], -1)
            # The suffix of the prefix ending at a starts at a - n + 1; its proposal follows the earlier copy.
            at = torch.full((length,), -1, dtype=torch.long, device=tokens.device)
            at[n - 1 :] = torch.where(earlier >= 0, earlier + n, -1)
            found.append((n, at))
        for n, at in reversed(found):  # the longest n that matches wins
            new = (follow < 0) & (at >= 0)
            follow, ngram = torch.where(new, at, follow), torch.where(new, n, ngram)
        return follow, ngram

    def matched_lengths(
        self, tokens: torch.Tensor, block_size: int, counted: torch.Tensor | None = None
    ) -> torch.Tensor:
        """At every position a of one text (tokens [L]): how many of the proposals `lookup` makes from `tokens[: a +
        1]` equal the tokens that follow, in a row from the first: what a verify at T = 0 accepts of them where the
        text is the target's own. Filler slots never count (they are not taken from the text), nor do tokens that
        `counted` [L] (bool) leaves out, nor any after one of them. -> [L] long, in 0..slots(block_size)."""
        length, width = len(tokens), self.slots(block_size)
        follow = self.follows(tokens)
        anchor = torch.arange(length, device=tokens.device)[:, None]
        step = torch.arange(width, device=tokens.device)
        source, target = follow[:, None] + step, anchor + 1 + step  # the proposal's token and the one it stands for
        ok = (follow[:, None] >= 0) & (source <= anchor) & (target < length)

        def at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # index_select: a 2-d index is slow on CPU
            return values.index_select(0, index.clamp(0, length - 1).flatten()).view(index.shape)

        ok &= at(tokens, source) == at(tokens, target)
        if counted is not None:
            ok &= at(counted.bool(), target)
        return ok.long().cumprod(-1).sum(-1)
