"""The fast decode path (`decode=static`): the two decoders of dflash2/decoding/speculative.py on fixed-capacity caches,
with fixed shapes, the target's and the drafter's steps optionally under torch.compile (CUDA graphs with
reduce-overhead). Same tokens, same accept lengths, same random draws as the plain loops, which stay the reference.

What changes, and why it changes no result:
- The target's KV cache is a `TargetStaticCache`, the drafter's context cache a `StaticDraftCache`, and the key mask
  and positions of the slots are buffers of the same `capacity` slots per row (dflash2/target/static_cache.py),
  written at one pointer: every row appends the same slots per step. The target and the drafter attend over the whole
  capacity, the slots past the pointer masked; a masked key gets exactly zero weight, as the plain loop's holes do.
- `compact` drops the masked slots, by a gather within the same buffers, when the next block would not fit. The plain
  loop compacts once they outnumber the kept ones, because its cache's cost grows with them; a fixed cache costs its
  whole capacity at every step whatever it holds, so here compaction is only ever needed for room.
- A batch keeps its rows to its end. A finished row stays, masked: its new slots are masked, its position stops and it
  draws no random numbers (`live`, distributions.sample), so every other row computes and draws exactly what it does
  in the plain loop, whose batch shrinks instead. A shrinking batch would give each row count its own shapes: the
  static buffers pin the shapes a compiled step is specialised to, so each count would be a compile (and a CUDA graph)
  of its own. Finished rows cost their share of each step until the batch's longest request ends. Every batch has
  `batch_size` rows (padding rows, done from the start, fill a short one) and every batch of a call the same capacity,
  so a call's steps have one shape, which the warm-up's call usually shares (the capacity is rounded up coarsely).
- One copy to the host per step, the tokens to commit (speculative.committed), is the step's one wait for the device;
  a step that compacts waits once more, for its kept width. The rows still decoding go to the device without a wait
  (pinned memory), and transformers' mask code reads the host's copy of the pointer (`TargetStaticCache`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dflash2.decoding import speculative
from dflash2.decoding.distributions import first_token, verify
from dflash2.decoding.graphed import StepBuffers, WholeSteps
from dflash2.decoding.hybrid import Hybrid
from dflash2.decoding.proposer import Proposer, Rows
from dflash2.decoding.speculative import (
    GREEDY,
    Generation,
    OnCommit,
    Requests,
    Sampling,
    commit_one,
    commits,
    committed,
    default_generator,
    in_batches,
    pad_right,
    run_proposer,
    top_margins,
)
from dflash2.model.drafter import DFlash2DraftModel, take_slots_
from dflash2.target.model import COMPILE_MODES
from dflash2.target.static_cache import TargetStaticCache

DECODES = ("plain", "static")  # evaluate.py's `decode` setting
# A call's capacity is rounded up to a multiple of this: calls of similar prompts (the warm-up, the timed passes) then
# share their shapes, and each new shape is a compile.
CAPACITY_STEP = 1024
# Room left for this many more blocks than the worst case needs, so that compaction comes every few steps at most.
SPARE_BLOCKS = 8


@dataclasses.dataclass(frozen=True)
class FastDecode:
    """The fast path's settings: `compile`, the torch.compile mode of the target's and the drafter's decode steps
    (None = eager; `drafting.Drafter` says which of the drafter's steps), and `capacity`, the slots per row (None =
    what a call needs, rounded up to CAPACITY_STEP)."""

    compile: str | None = None
    capacity: int | None = None
    whole_step: bool = True  # greedy: each steady step runs whole, one graph under compile (decoding/graphed.py)

    def capacity_for(self, prompts_ids: list[list[int]], max_new_tokens: int, block_size: int) -> int:
        """Slots per row for a call. Every row holds its prompt and what it commits: up to max_new_tokens - 1 tokens
        while it decodes and one last block past that (the cache keeps what the step computed). After a compaction a
        row also holds the block whose features the drafter has not taken in, and one more block is verified: the
        longest prompt, max_new_tokens and 3 blocks always fit."""
        needed = max(map(len, prompts_ids)) + max_new_tokens + 3 * block_size
        if self.capacity is None:
            return -(-(needed + SPARE_BLOCKS * block_size) // CAPACITY_STEP) * CAPACITY_STEP
        if self.capacity < needed:
            raise ValueError(
                f"a static capacity of {self.capacity} slots cannot hold these prompts and replies: the longest "
                f"prompt, max_new_tokens and 3 blocks need {needed}"
            )
        return self.capacity


def decode_mode(
    decode: Any, compile: Any, device: torch.device | str = "cpu", whole_step: Any = True
) -> FastDecode | None:
    """evaluate.py's `decode`, `compile` and `whole_step` settings -> None (the plain loops) or the fast path's
    settings, refused in one sentence naming the setting as typed. compile=true is reduce-overhead (CUDA graphs) on a
    GPU, torch.compile's default mode elsewhere (a CPU has no graphs: only to test the compiled step)."""
    typed = str(compile).lower() if isinstance(compile, bool) else compile  # as Hydra's command line spells it
    if decode not in DECODES:
        raise ValueError(
            f"decode={decode}: choose plain (transformers' growing cache) or static (fixed-capacity caches of fixed "
            "shapes, which compile needs)"
        )
    if compile not in (None, False, True, *COMPILE_MODES):
        modes = ", ".join(COMPILE_MODES)
        raise ValueError(f"compile={typed}: set it to true, false or one of torch.compile's modes ({modes})")
    if decode == "plain":
        if compile not in (None, False):
            raise ValueError(f"compile={typed} needs decode=static: a compiled step needs the static caches' shapes")
        return None
    if type(whole_step) is not bool:
        raise ValueError(f"whole_step={whole_step}: true (each greedy step one function, one graph) or false")
    if compile is True:
        compile = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    return FastDecode(compile=compile or None, whole_step=whole_step)


def decoders(fast: FastDecode | None) -> tuple[Callable[..., list[Generation]], Callable[..., list[Generation]]]:
    """(speculative_generate, target_generate) of the plain loops (`fast` None) or of the fast path at `fast`: the
    same arguments either way."""
    if fast is None:
        return speculative.speculative_generate, speculative.target_generate
    return functools.partial(speculative_generate, fast=fast), functools.partial(target_generate, fast=fast)


# ---------------------------------------------------------------------------------------------- bookkeeping
def live_rows(done: list[bool], rows: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The rows still decoding, of `rows` (the requests' first, then padding): (their indices, None when every row
    is live; a bool mask [rows]). Copied to the device without waiting for it."""
    mask = torch.zeros(rows, dtype=torch.bool)
    mask[: len(done)] = ~torch.tensor(done, dtype=torch.bool)
    index = None if bool(mask.all()) else mask.nonzero().squeeze(-1)
    return (None if index is None else to_device(index, device)), to_device(mask, device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, so that the host does not wait for the device."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def start_batch(
    target: Any, prompts: list[list[int]], rows: int, capacity: int, tokens_width: int
) -> tuple[Any, torch.Tensor, torch.Tensor, TargetStaticCache, torch.Tensor]:
    """The prefill of a static batch: prompts, then padding rows, right-padded as the plain loops pad them, into the
    target's static cache -> (the prefill's output, key mask and positions [rows, capacity], the cache, the tokens'
    buffer [rows, tokens_width] or [rows, prompt width] when that is wider)."""
    ids, prompt_mask = pad_right(prompts + [[0]] * (rows - len(prompts)), target.lm_head_weight.device)
    width = ids.shape[1]
    positions = torch.arange(width, device=ids.device).expand_as(ids)
    key_mask = F.pad(prompt_mask, (0, capacity - width))
    cache = target.static_cache(rows, capacity)
    lengths = prompt_mask.sum(-1)
    inputs = dict(attention_mask=key_mask, position_ids=positions, past_key_values=cache, use_cache=True)
    out = target.forward(ids, **inputs, logits_at=lengths - 1)
    cache.length = width
    return out, key_mask, F.pad(positions, (0, capacity - width)), cache, F.pad(ids, (0, max(tokens_width - width, 0)))


def compact(
    key_mask: torch.Tensor, positions: torch.Tensor, end: int, pending: int, cache: TargetStaticCache, draft_cache: Any
) -> int:
    """Drop the masked slots among the first `end` of every static buffer, in place -> the new pointer. Each row keeps
    its committed slots in order, then the last `pending` slots (target features the drafter has not taken in), moved
    as they are; rows shorter than the widest are padded with masked slots, as speculative.compact leaves them."""
    settled = end - pending
    if draft_cache is not None and settled != draft_cache.length:
        raise RuntimeError(f"the drafter's cache holds {draft_cache.length} slots where {settled} were expected")
    kept = key_mask[:, :settled].bool()
    width = int(kept.sum(-1).max()) if settled else 0
    # A stable sort on "masked" puts each row's kept slots first, in their order.
    order = torch.sort((~kept).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
    tail = torch.arange(settled, end, device=key_mask.device).expand(key_mask.shape[0], -1)
    index = torch.cat([order, tail], -1)
    cache.keep(index)
    take_slots_(key_mask, index, 1)
    take_slots_(positions, index, 1)
    key_mask[:, index.shape[1] :] = 0
    if draft_cache is not None:
        draft_cache.keep(order)
    return index.shape[1]


# ---------------------------------------------------------------------------------------------- decoding
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
    fast: FastDecode = FastDecode(),
) -> list[Generation]:
    """speculative.speculative_generate on the fast path (same arguments, same results), its target's verify step and
    its drafter's steady steps compiled under `fast.compile`."""
    proposer = run_proposer(target, draft, block_size, max_new_tokens, fast.compile)
    generator, token = generator or default_generator(target), sampling.token()
    shape = Shape(sampling.batch_size, fast.capacity_for(prompts_ids, max_new_tokens, block_size), block_size)
    step = target.decode_step(fast.compile)
    whole = None
    if fast.whole_step and sampling.temperature == 0 and WholeSteps.handles(proposer):
        whole = WholeSteps(target, proposer, fast.compile, sampling.record_margins)

    def batch(prompts: list[list[int]], requests: Requests) -> None:
        decode_batch(target, proposer, prompts, shape, requests, token, generator, step, whole)

    return in_batches(prompts_ids, sampling, max_new_tokens, on_commit, batch)


@dataclasses.dataclass(frozen=True)
class Shape:
    """Every batch of a call on the fast path: `rows` rows (padding rows fill a short batch) of `capacity` slots,
    verified `block_size` tokens a step."""

    rows: int
    capacity: int
    block_size: int = 1


@dataclasses.dataclass
class Batch:
    """One batch's state on the fast path: the buffers of its slots and tokens (`Rows`' fields), its caches, the
    pointer `end` of both (where the next block goes) and the rows still decoding (`live` their indices, None = all;
    `live_mask` [rows])."""

    key_mask: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    anchor: torch.Tensor
    features: torch.Tensor | None
    end: int
    cache: TargetStaticCache
    draft_cache: Any
    live: torch.Tensor | None
    live_mask: torch.Tensor

    def rows(self) -> Rows:
        """The proposer's view: the whole buffers (the drafter attends over the capacity, as the target does)."""
        pending = None if self.features is None else self.features.shape[1]
        context = None if pending is None else self.positions[:, self.end - pending : self.end]
        return Rows(self.key_mask, self.positions, self.lengths, self.anchor, self.features, self.tokens, self.live,
                    context)  # fmt: skip


def decode_batch(
    target: Any,
    proposer: Proposer,
    prompts: list[list[int]],
    shape: Shape,
    requests: Requests,
    sampling: dict,
    generator: torch.Generator,
    step: Any,
    whole: WholeSteps | None = None,
) -> None:
    """speculative.decode_batch on a batch of `shape`, the verify forward being `step`; with `whole` (greedy), each
    steady step runs whole (dflash2/decoding/graphed.py)."""
    block_size = shape.block_size
    batch, done = start(target, proposer, prompts, shape, requests, sampling, generator)
    finished, buffers, take_next = 0, None, None
    while True:
        if sum(done) != finished:
            finished = sum(done)
            if finished == len(prompts):
                return
            batch.live, batch.live_mask = live_rows(done, shape.rows, batch.key_mask.device)
            if buffers is not None:
                buffers.live.copy_(batch.live_mask)
        make_room(batch, shape.capacity, block_size, buffers)
        if whole is not None and buffers is None and steady(batch, block_size):
            buffers = whole.buffers(batch.tokens, batch.key_mask, block_size, batch.features)
            load(buffers, batch)
            take_next = whole.first_take(buffers)
        if buffers is None:
            steps = eager_step(batch, proposer, block_size, requests, sampling, generator, step)
        else:
            host, margins = whole(whole.kind(take_next, done), buffers, batch.cache, batch.draft_cache)
            advance(batch, block_size)
            steps = commits(host, block_size - 1, isinstance(proposer, Hybrid), margins)
            take_next = [bool(row[-1]) for row in host]
        done = [d or requests.commit(i, *s) for i, (d, s) in enumerate(zip(done, steps, strict=False))]


def start(
    target: Any,
    proposer: Proposer,
    prompts: list[list[int]],
    shape: Shape,
    requests: Requests,
    sampling: dict,
    generator: torch.Generator,
) -> tuple[Batch, list[bool]]:
    """The prefill and the first token of every request -> the batch, and which requests are done."""
    # The tokens' buffer as wide as the caches: every batch of the call one shape (a whole step's graph reads it all).
    out, key_mask, positions, cache, tokens = start_batch(target, prompts, shape.rows, shape.capacity, shape.capacity)
    live, live_mask = live_rows([False] * len(prompts), shape.rows, key_mask.device)
    anchor = first_token(out.logits, generator=generator, live=live, **sampling)
    done = commit_one(requests, anchor, out.logits, [False] * len(prompts))
    lengths = key_mask.sum(-1)
    tokens.scatter_(1, lengths[:, None], anchor[:, None])
    features = proposer.pending(out.hidden, key_mask[:, : cache.length].bool())
    draft_cache = proposer.new_cache(shape.capacity)
    batch = Batch(key_mask, positions, tokens, lengths, anchor, features, cache.length, cache, draft_cache, live,
                  live_mask)  # fmt: skip
    return batch, done


def make_room(batch: Batch, capacity: int, block_size: int, buffers: StepBuffers | None) -> None:
    """Compact the caches when the next block would not fit (`compact`)."""
    if batch.end + block_size <= capacity:
        return
    pending = 0 if batch.features is None else batch.features.shape[1]
    batch.end = compact(batch.key_mask, batch.positions, batch.end, pending, batch.cache, batch.draft_cache)
    if batch.end + block_size > capacity:
        raise RuntimeError(f"the static capacity of {capacity} slots is full even after compaction")
    if buffers is not None:
        buffers.end.fill_(batch.end)


def steady(batch: Batch, block_size: int) -> bool:
    """Whether the next step has the shapes of every later one: a verify block's features pending (or no drafter),
    and the drafter's cache there for these rows."""
    if batch.features is None:
        return True
    return batch.features.shape[1] == block_size and batch.draft_cache.allocated(batch.key_mask.shape[0])


def load(buffers: StepBuffers, batch: Batch) -> None:
    """The batch's state into the step's buffers, which from now on are the batch's (every step moves them)."""
    buffers.load(
        key_mask=batch.key_mask, positions=batch.positions, tokens=batch.tokens, lengths=batch.lengths,
        anchor=batch.anchor, live=batch.live_mask, end=batch.end,
        **({} if batch.features is None else {"features": batch.features}),
    )  # fmt: skip
    batch.key_mask, batch.positions, batch.tokens = buffers.key_mask, buffers.positions, buffers.tokens
    batch.lengths, batch.anchor, batch.features = buffers.lengths, buffers.anchor, buffers.features


def advance(batch: Batch, block_size: int) -> None:
    """The host's copies of the pointers after a whole step, which moved the device's: both caches one block on."""
    batch.end += block_size
    batch.cache.length += block_size
    if batch.draft_cache is not None:
        batch.draft_cache.slots += block_size


def eager_step(
    batch: Batch,
    proposer: Proposer,
    block_size: int,
    requests: Requests,
    sampling: dict,
    generator: torch.Generator,
    step: Any,
) -> list[tuple[list[int], str | None, list[list[float]] | None]]:
    """One step in pieces: propose, verify (`step`), then the bookkeeping -> each row's commit."""
    b, end = batch, batch.end
    offsets = torch.arange(block_size, device=b.key_mask.device)
    block_positions = b.lengths[:, None] + offsets
    proposal = proposer(b.rows(), block_positions, b.draft_cache, temperature=sampling["temperature"],
                        generator=generator)  # fmt: skip
    proposals = proposal.tokens

    # Verify: the whole block enters the target's cache; the rejected slots (and a finished row's) are masked.
    b.key_mask[:, end : end + block_size] = 1
    out = step(torch.cat([b.anchor[:, None], proposals], -1), b.key_mask, block_positions, b.cache)
    accepted, bonus = verify(out.logits, proposals, proposal.q, generator=generator, live=b.live, **sampling)
    kept = (offsets[None] <= accepted[:, None]) & b.live_mask[:, None]
    b.key_mask[:, end : end + block_size] = kept
    b.positions[:, end : end + block_size] = block_positions
    b.end += block_size
    b.lengths = b.lengths + torch.where(b.live_mask, accepted + 1, 0)
    b.tokens.scatter_(1, block_positions[:, 1:], proposals)
    b.tokens.scatter_(1, b.lengths[:, None], bonus[:, None])
    b.anchor = torch.where(b.live_mask, bonus, b.anchor)
    b.features = proposer.pending(out.hidden, kept)
    return committed(proposal, accepted, bonus, top_margins(out.logits, requests.record_margins))


@torch.no_grad()
def target_generate(
    target: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
    on_commit: OnCommit | None = None,
    fast: FastDecode = FastDecode(),
) -> list[Generation]:
    """speculative.target_generate on the fast path (same arguments, same results), its one-token step compiled under
    `fast.compile`. Like the reference, finished rows keep decoding (and drawing); only padding rows draw nothing."""
    generator, token = generator or default_generator(target), sampling.token()
    shape = Shape(sampling.batch_size, fast.capacity_for(prompts_ids, max_new_tokens, 1))
    step = target.decode_step(fast.compile)

    def batch(prompts: list[list[int]], requests: Requests) -> None:
        decode_alone(target, prompts, shape, requests, token, generator, step)

    return in_batches(prompts_ids, sampling, max_new_tokens, on_commit, batch)


def decode_alone(
    target: Any,
    prompts: list[list[int]],
    shape: Shape,
    requests: Requests,
    sampling: dict,
    generator: torch.Generator,
    step: Any,
) -> None:
    """speculative.decode_alone on a batch of `shape`, the one-token forward being `step`."""
    out, key_mask, _, cache, _ = start_batch(target, prompts, shape.rows, shape.capacity, 0)
    end, lengths = cache.length, key_mask.sum(-1)
    live, _ = live_rows([False] * len(prompts), shape.rows, key_mask.device)
    token = first_token(out.logits, generator=generator, live=live, **sampling)
    done = commit_one(requests, token, out.logits, [False] * len(prompts))
    while not all(done):
        key_mask[:, end] = 1
        out = step(token[:, None], key_mask, lengths[:, None], cache)
        end, lengths = end + 1, lengths + 1
        token = first_token(out.logits[:, -1], generator=generator, live=live, **sampling)
        done = commit_one(requests, token, out.logits[:, -1], done)
