"""Speculative decoding with a DFlash2 drafter and its frozen target, verified losslessly (contract section 6).

One verify step per batch: a proposer fills the block `[anchor, d_1 .. d_{B-1}]`, the target scores the whole
block in one forward pass, and every request keeps `accepted + 1` tokens. The proposer is a DFlash2 drafter
(`dflash2.decoding.drafting.Drafter`: one forward pass over the block) or prompt lookup
(`dflash2.decoding.lookup.PromptLookup`, the training-free baseline); both run through the same loop, verify
(dflash2/decoding/distributions.py) and bookkeeping, so their statistics compare like for like.

Ragged acceptance without ragged caches: every step appends all B block slots to the target's KV cache and to
the drafter's context cache for every request, then masks the rejected ones, and `compact` drops them from both
caches once they outnumber the committed slots. `key_mask` ([b, slots], 1 = a committed token) is the target's
2D attention mask with holes, and each request's positions count only its committed tokens, so RoPE positions
are exactly those of plain decoding. Prompts are right-padded: a padded query row then still sees its prompt,
so no attention row is ever empty (an empty row makes NaN that leaks through masked keys).

All randomness comes from one seeded `torch.Generator`, so a run is reproducible. The fast path
(dflash2/decoding/static.py) keeps finished rows in its batch; `live` (the rows still decoding) keeps them from drawing,
so that it draws exactly what this loop draws.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dflash2.decoding.distributions import first_token, verify
from dflash2.decoding.drafting import Drafter
from dflash2.decoding.proposer import SOURCES, Proposal, Proposer, Rows
from dflash2.model.contract import check_block_size
from dflash2.model.drafter import DFlash2DraftModel, DraftCache


@dataclasses.dataclass
class Generation:
    """One request's output. `output_ids[0]` comes from the prefill; each verify step then adds
    `accept_lengths[i]` tokens (accepted proposals + 1), counted up to a stop token or `max_new_tokens`,
    so `len(output_ids) == 1 + sum(accept_lengths)`."""

    output_ids: list[int]
    accept_lengths: list[int]
    # What proposed each verify step's block (`proposer.SOURCES`), where a proposer combines others; else empty.
    proposers: list[str] = dataclasses.field(default_factory=list)
    # Per output token, with `Sampling.record_margins`: (the target's top-1 minus top-2 logit where it chose the token,
    # the top-1 logit), from the forward that chose it; else empty.
    margins: list[tuple[float, float]] = dataclasses.field(default_factory=list)


# Told of every commit, for progress reports: (tokens committed, whether by a verify step, whether the request is done).
OnCommit = Callable[[int, bool, bool], None]


# ---------------------------------------------------------------------------------------------- bookkeeping
def pad_right(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if any(len(p) == 0 for p in prompts):
        raise ValueError("an empty prompt: every request needs at least one token (render the chat template)")
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, device=device)
        mask[i, : len(p)] = 1
    return ids, mask


class Requests:
    """Per-request Python state of one batch: tokens, accept lengths, which batch row holds which request."""

    def __init__(
        self,
        n: int,
        max_new_tokens: int,
        stop_ids: set[int],
        on_commit: OnCommit | None = None,
        record_margins: bool = False,
    ) -> None:
        self.out = [Generation([], []) for _ in range(n)]
        self.rows = list(range(n))  # batch row -> request
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.on_commit, self.record_margins = on_commit, record_margins

    def commit(
        self, row: int, tokens: list[int], source: str | None = None, margins: list[list[float]] | None = None
    ) -> bool:
        """Append a step's tokens to the request at `row`, cut at a stop token / the budget; True when done. `source`:
        what proposed the step's block, where the proposer says (`Proposal.source`); `margins`: each token's
        (`top_margins`), where recorded."""
        gen = self.out[self.rows[row]]
        kept = tokens[: self.max_new_tokens - len(gen.output_ids)]
        stops = [i for i, t in enumerate(kept) if t in self.stop_ids]
        if stops:
            kept = kept[: stops[0] + 1]
        verified = bool(gen.output_ids)  # the prefill's token is not a verify step
        if verified:
            gen.accept_lengths.append(len(kept))
            if source is not None:
                gen.proposers.append(source)
        gen.output_ids.extend(kept)
        if margins is not None:
            gen.margins.extend((m, top) for m, top in margins[: len(kept)])
        done = len(gen.output_ids) >= self.max_new_tokens or bool(stops)
        if self.on_commit is not None:
            self.on_commit(len(kept), verified, done)
        return done

    def drop_done(self, done: list[bool]) -> torch.Tensor:
        """Forget finished rows -> indices of the rows that keep decoding."""
        keep = [i for i, d in enumerate(done) if not d]
        self.rows = [self.rows[i] for i in keep]
        return torch.tensor(keep, dtype=torch.long)


def compact(rows: Rows, cache: Any, draft_cache: DraftCache | None) -> Rows:
    """Drop the masked slots (rejected proposals, prompt padding) from both caches once they outnumber the kept
    ones; each row keeps its committed slots in order, left-aligned, and shorter rows are padded with masked slots.

    Without this, every verify step leaves B - 1 - accepted dead slots in both caches, so at low acceptance the
    caches grow nearly B times faster than the text and each step reads them whole. Attention gives a masked key
    exactly zero weight, so dropping it changes nothing. Only the slots already in both caches are moved: the
    last c target slots, whose features the drafter has not taken in yet, stay where they are. Without a drafter
    (`draft_cache` None) only the target's cache is compacted."""
    layers = getattr(cache, "layers", None)
    # By name, exactly: transformers' sliding-window layers subclass DynamicLayer and count what they drop.
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return rows  # sliding-window or static caches keep their own bookkeeping: leave them as they are
    settled = rows.key_mask.shape[1] - (0 if rows.features is None else rows.features.shape[1])
    if draft_cache is not None and settled != draft_cache.length:
        raise RuntimeError(f"the drafter's cache holds {draft_cache.length} slots where {settled} were expected")
    kept = rows.key_mask[:, :settled].bool()
    width = int(kept.sum(-1).max()) if settled else 0
    if settled - width <= width:
        return rows
    # A stable sort on "masked" puts each row's kept slots first, in their order.
    order = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices[:, :width]

    def take(x: torch.Tensor, dim: int) -> torch.Tensor:  # x: [b, ..., slots (at dim), ...]
        shape = [1] * x.dim()
        shape[0], shape[dim] = order.shape
        index = order.view(shape).expand(*x.shape[:dim], width, *x.shape[dim + 1 :])
        head, tail = x.narrow(dim, 0, settled), x.narrow(dim, settled, x.shape[dim] - settled)
        return torch.cat([head.gather(dim, index), tail], dim)

    for layer in layers:
        layer.keys, layer.values = take(layer.keys, 2), take(layer.values, 2)
    map_draft_cache(draft_cache, lambda x: take(x, 2))
    return dataclasses.replace(rows, key_mask=take(rows.key_mask, 1), positions=take(rows.positions, 1))


def committed(
    proposal: Proposal, accepted: torch.Tensor, bonus: torch.Tensor, margins: torch.Tensor | None = None
) -> list[tuple[list[int], str | None, list[list[float]] | None]]:
    """Each row's tokens of a verify step (its accepted proposals, then the bonus), what proposed them (None where the
    proposer does not say) and, given the block's `top_margins`, each token's (else None). One copy to the host, the
    step's one wait for the device (and one more copy with margins, the device then idle)."""
    columns = [proposal.tokens, accepted[:, None], bonus[:, None]]
    if proposal.source is not None:
        columns.append(proposal.source[:, None])
    return commits(torch.cat(columns, -1).tolist(), proposal.tokens.shape[1], proposal.source is not None, margins)


def commits(
    host: list[list[int]], width: int, with_source: bool, margins: torch.Tensor | None
) -> list[tuple[list[int], str | None, list[list[float]] | None]]:
    """`committed` from the host's rows [proposals (width), accepted, bonus, source if `with_source`, ...]."""
    per_row = [None] * len(host) if margins is None else margins.tolist()
    return [
        (
            row[: row[width]] + [row[width + 1]],
            SOURCES[row[width + 2]] if with_source else None,
            None if m is None else m[: row[width] + 1],
        )
        for row, m in zip(host, per_row, strict=True)
    ]


def top_margins(logits: torch.Tensor, wanted: bool) -> torch.Tensor | None:
    """Where `wanted` (`Requests.record_margins`): (top-1 minus top-2 logit, top-1 logit) at every position of logits
    [..., V] -> [..., 2], on the device; None otherwise. A greedy choice by a margin within the logits' rounding is a
    near-tie, which another forward of the same text may break the other way (dflash2/evaluation/divergence.py)."""
    if not wanted:
        return None
    top = logits.float().topk(2, -1).values
    return torch.stack([top[..., 0] - top[..., 1], top[..., 0]], -1)


def commit_one(requests: Requests, tokens: torch.Tensor, logits: torch.Tensor, done: list[bool]) -> list[bool]:
    """Commit each row's one token `tokens` [b], chosen from `logits` [b, V], to the rows not `done` (of the first
    len(done)) -> which are done now."""
    margins = top_margins(logits, requests.record_margins)
    per_row = [None] * len(done) if margins is None else [[m] for m in margins[: len(done)].tolist()]
    chosen = tokens[: len(done)].tolist()
    return [
        d or requests.commit(i, [t], margins=m) for i, (d, t, m) in enumerate(zip(done, chosen, per_row, strict=True))
    ]


def map_draft_cache(draft_cache: DraftCache | None, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    if draft_cache is not None:
        draft_cache.keys = [None if k is None else fn(k) for k in draft_cache.keys]
        draft_cache.values = [None if v is None else fn(v) for v in draft_cache.values]


def select_caches(keep: torch.Tensor, cache: Any, draft_cache: DraftCache | None) -> None:
    cache.batch_select_indices(keep)
    map_draft_cache(draft_cache, lambda x: x[keep])


# ---------------------------------------------------------------------------------------------- decoding
@dataclasses.dataclass(frozen=True)
class Sampling:
    """How both decoders sample and batch: temperature (0 = greedy), top-k (0 = off) and top-p of every token drawn,
    the ids that end a reply, prompts per batch, and whether to record each greedy choice's margin."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop_ids: tuple[int, ...] | list[int] | set[int] = ()
    batch_size: int = 8
    record_margins: bool = False  # each output token's top-2 logit margin (`Generation.margins`), at T = 0

    def token(self) -> dict[str, float]:
        """The keyword arguments of `first_token` and `verify`."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


GREEDY = Sampling()  # every decoder's default: greedy, no stop ids, batches of 8


def run_proposer(
    target: Any, draft: DFlash2DraftModel | Proposer, block_size: int, max_new_tokens: int, compile: str | None = None
) -> Proposer:
    """The proposer of a run, its settings checked before the first batch (a block too small for the lookup's
    num_tokens fails now): a drafter model becomes a `Drafter` with its selector on where it has one, its steps
    compiled under `compile` (the fast path's); a proposer is taken as it is (`Drafter(..., use_selector=False)`
    decodes a DFlash2 drafter by its per-slot argmax)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}; it must be >= 1")
    check_block_size(block_size)
    proposer = Drafter(target, draft, True, compile) if isinstance(draft, DFlash2DraftModel) else draft
    proposer.slots(block_size)
    return proposer


def default_generator(target: Any) -> torch.Generator:
    """The draws of a call that passes no generator: seeded, so that the same call decodes the same tokens."""
    return torch.Generator(device=target.lm_head_weight.device).manual_seed(0)


def in_batches(
    prompts_ids: list[list[int]],
    sampling: Sampling,
    max_new_tokens: int,
    on_commit: OnCommit | None,
    decode_batch: Callable[[list[list[int]], Requests], None],
) -> list[Generation]:
    """Every decoder's driver: the prompts in batches of `sampling.batch_size`, each decoded by `decode_batch(prompts,
    requests)` into its `Requests` -> one Generation per prompt, in order."""
    results: list[Generation] = []
    for start in range(0, len(prompts_ids), sampling.batch_size):
        prompts = prompts_ids[start : start + sampling.batch_size]
        margins = sampling.record_margins and sampling.temperature == 0
        requests = Requests(len(prompts), max_new_tokens, set(sampling.stop_ids), on_commit, margins)
        decode_batch(prompts, requests)
        results += requests.out
    return results


@torch.no_grad()
def speculative_generate(
    target: Any,
    draft: DFlash2DraftModel | Proposer,
    prompts_ids: list[list[int]],
    block_size: int,
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    on_commit: OnCommit | None = None,
) -> list[Generation]:
    """Decode every prompt with draft-then-verify steps; greedy output equals the target's own greedy output. The
    reference loop, which the fast path (dflash2/decoding/static.py) must decode exactly.

    `target` is a `dflash2.target.model.TargetModel` (forward -> logits, hidden of the drafter's layers, KV cache);
    `draft` a drafter model or a proposer (`run_proposer`): a `Drafter`, prompt lookup, or both (`Hybrid`)."""
    proposer = run_proposer(target, draft, block_size, max_new_tokens)
    generator, token = generator or default_generator(target), sampling.token()

    def batch(prompts: list[list[int]], requests: Requests) -> None:
        decode_batch(target, proposer, prompts, requests, block_size, token, generator)

    return in_batches(prompts_ids, sampling, max_new_tokens, on_commit, batch)


def decode_batch(
    target: Any,
    proposer: Proposer,
    prompts: list[list[int]],
    requests: Requests,
    block_size: int,
    sampling: dict,
    generator: torch.Generator,
) -> None:
    ids, key_mask = pad_right(prompts, target.lm_head_weight.device)
    device, temperature = ids.device, sampling["temperature"]
    positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
    lengths = key_mask.sum(-1)
    out = target.forward(ids, attention_mask=key_mask, position_ids=positions, use_cache=True, logits_at=lengths - 1)
    anchor = first_token(out.logits, generator=generator, **sampling)
    done = commit_one(requests, anchor, out.logits, [False] * len(prompts))
    # Room for every token a request may still commit, plus a block of rejected proposals past its end.
    tokens = F.pad(ids, (0, requests.max_new_tokens + block_size)).scatter_(1, lengths[:, None], anchor[:, None])
    rows = Rows(key_mask, positions, lengths, anchor, proposer.pending(out.hidden, key_mask.bool()), tokens)
    cache, draft_cache = out.past_key_values, proposer.new_cache()
    offsets = torch.arange(block_size, device=device)
    while True:
        if any(done):
            keep = requests.drop_done(done).to(device)
            if not requests.rows:
                return
            rows = rows.select(keep)
            select_caches(keep, cache, draft_cache)
        rows = compact(rows, cache, draft_cache)

        block_positions = rows.lengths[:, None] + offsets
        proposal = proposer(rows, block_positions, draft_cache, temperature=temperature, generator=generator)
        proposals = proposal.tokens

        # Verify: the whole block enters the target's cache; the rejected slots are masked from now on.
        key_mask = torch.cat([rows.key_mask, torch.ones_like(block_positions)], -1)
        out = target.forward(
            torch.cat([rows.anchor[:, None], proposals], -1),
            attention_mask=key_mask,
            position_ids=block_positions,
            past_key_values=cache,
            use_cache=True,
        )
        cache = out.past_key_values
        accepted, bonus = verify(out.logits, proposals, proposal.q, generator=generator, **sampling)
        kept = offsets[None] <= accepted[:, None]  # the anchor and the accepted proposals
        key_mask[:, -block_size:] = kept
        lengths = rows.lengths + accepted + 1
        # All proposals go in, then the bonus over the first rejected one: the rest lies past the committed end.
        tokens = rows.tokens.scatter_(1, block_positions[:, 1:], proposals)
        tokens.scatter_(1, lengths[:, None], bonus[:, None])
        features = proposer.pending(out.hidden, kept)
        rows = Rows(key_mask, torch.cat([rows.positions, block_positions], -1), lengths, bonus, features, tokens)
        steps = committed(proposal, accepted, bonus, top_margins(out.logits, requests.record_margins))
        done = [requests.commit(i, *step) for i, step in enumerate(steps)]


@torch.no_grad()
def target_generate(
    target: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    on_commit: OnCommit | None = None,
) -> list[Generation]:
    """The target alone, one token per forward, with the same padding and cache machinery: the reference, and the
    autoregressive baseline (every step commits 1 token, tau = 1)."""
    generator, token = generator or default_generator(target), sampling.token()

    def batch(prompts: list[list[int]], requests: Requests) -> None:
        decode_alone(target, prompts, requests, token, generator)

    return in_batches(prompts_ids, sampling, max_new_tokens, on_commit, batch)


def decode_alone(
    target: Any, prompts: list[list[int]], requests: Requests, sampling: dict, generator: torch.Generator
) -> None:
    """One batch of the target alone. Finished rows keep decoding (and are ignored): the reference favours
    simplicity."""
    ids, key_mask = pad_right(prompts, target.lm_head_weight.device)
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    lengths = key_mask.sum(-1)
    out = target.forward(ids, attention_mask=key_mask, position_ids=positions, use_cache=True, logits_at=lengths - 1)
    token = first_token(out.logits, generator=generator, **sampling)
    done = commit_one(requests, token, out.logits, [False] * len(prompts))
    while not all(done):
        key_mask = torch.cat([key_mask, torch.ones_like(key_mask[:, :1])], -1)
        out = target.forward(
            token[:, None],
            attention_mask=key_mask,
            position_ids=lengths[:, None],
            past_key_values=out.past_key_values,
            use_cache=True,
        )
        lengths = lengths + 1
        token = first_token(out.logits[:, -1], generator=generator, **sampling)
        done = commit_one(requests, token, out.logits[:, -1], done)
