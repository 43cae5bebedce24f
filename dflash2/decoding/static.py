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
from dflash2.decoding.proposer import Proposer, Rows
from dflash2.decoding.speculative import (
    Generation,
    OnCommit,
    Requests,
    Sampling,
    committed,
    pad_right,
    run_proposer,
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


def decode_mode(decode: Any, compile: Any, device: torch.device | str = "cpu") -> FastDecode | None:
    """evaluate.py's `decode` and `compile` settings -> None (the plain loops) or the fast path's settings, refused in
    one sentence naming the setting as typed. compile=true is reduce-overhead (CUDA graphs) on a GPU, torch.compile's
    default mode elsewhere (a CPU has no graphs: only to test the compiled step)."""
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
    if compile is True:
        compile = "reduce-overhead" if torch.device(device).type == "cuda" else "default"
    return FastDecode(compile=compile or None)


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
    target: Any, prompts: list[list[int]], rows: int, capacity: int, pad: int
) -> tuple[Any, torch.Tensor, torch.Tensor, TargetStaticCache, torch.Tensor]:
    """The prefill of a static batch: prompts, then padding rows, right-padded as the plain loops pad them, into the
    target's static cache -> (the prefill's output, key mask and positions [rows, capacity], the cache, the tokens'
    buffer [rows, width + pad])."""
    ids, prompt_mask = pad_right(prompts + [[0]] * (rows - len(prompts)), target.lm_head_weight.device)
    width = ids.shape[1]
    positions = torch.arange(width, device=ids.device).expand_as(ids)
    key_mask = F.pad(prompt_mask, (0, capacity - width))
    cache = target.static_cache(rows, capacity)
    lengths = prompt_mask.sum(-1)
    inputs = dict(attention_mask=key_mask, position_ids=positions, past_key_values=cache, use_cache=True)
    out = target.forward(ids, **inputs, logits_at=lengths - 1)
    cache.length = width
    return out, key_mask, F.pad(positions, (0, capacity - width)), cache, F.pad(ids, (0, pad))


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
    sampling: Sampling | None = None,
    use_selector: bool = True,
    generator: torch.Generator | None = None,
    on_commit: OnCommit | None = None,
    fast: FastDecode = FastDecode(),
) -> list[Generation]:
    """speculative.speculative_generate on the fast path (same arguments, same results), its target's verify step and
    its drafter's steady steps compiled under `fast.compile`."""
    sampling = sampling or Sampling()
    proposer = run_proposer(target, draft, block_size, max_new_tokens, use_selector, fast.compile)
    generator = generator or torch.Generator(device=target.lm_head_weight.device).manual_seed(0)
    capacity = fast.capacity_for(prompts_ids, max_new_tokens, block_size)
    step = target.decode_step(fast.compile)
    results: list[Generation] = []
    for start in range(0, len(prompts_ids), sampling.batch_size):
        prompts = prompts_ids[start : start + sampling.batch_size]
        requests = Requests(len(prompts), max_new_tokens, set(sampling.stop_ids), on_commit)
        batch = (prompts, sampling.batch_size, capacity)
        decode_batch(target, proposer, batch, requests, block_size, sampling.token(), generator, step)
        results += requests.out
    return results


def decode_batch(
    target: Any,
    proposer: Proposer,
    batch: tuple[list[list[int]], int, int],
    requests: Requests,
    block_size: int,
    sampling: dict,
    generator: torch.Generator,
    step: Any,
) -> None:
    """speculative.decode_batch on `batch` = (prompts, rows, capacity), the verify forward being `step`."""
    prompts, rows, capacity = batch
    n, temperature = len(prompts), sampling["temperature"]
    out, key_mask, positions, cache, tokens = start_batch(
        target, prompts, rows, capacity, requests.max_new_tokens + 2 * block_size
    )
    device, end = key_mask.device, cache.length
    lengths = key_mask.sum(-1)
    live, alive = live_rows([False] * n, rows, device)
    anchor = first_token(out.logits, generator=generator, live=live, **sampling)
    done = [requests.commit(i, [t]) for i, t in enumerate(anchor[:n].tolist())]
    tokens.scatter_(1, lengths[:, None], anchor[:, None])
    features, draft_cache = proposer.pending(out.hidden, key_mask[:, :end].bool()), proposer.new_cache(capacity)
    offsets = torch.arange(block_size, device=device)
    finished = 0
    while True:
        if sum(done) != finished:
            finished = sum(done)
            if finished == n:
                return
            live, alive = live_rows(done, rows, device)
        if end + block_size > capacity:
            end = compact(key_mask, positions, end, 0 if features is None else features.shape[1], cache, draft_cache)
            if end + block_size > capacity:
                raise RuntimeError(f"the static capacity of {capacity} slots is full even after compaction")

        # The whole buffers: the drafter attends over the capacity, as the target does (its cache is static too).
        context = None if features is None else positions[:, end - features.shape[1] : end]
        state = Rows(key_mask, positions, lengths, anchor, features, tokens, live, context)
        block_positions = lengths[:, None] + offsets
        proposals, q = proposer(state, block_positions, draft_cache, temperature=temperature, generator=generator)

        # Verify: the whole block enters the target's cache; the rejected slots (and a finished row's) are masked.
        key_mask[:, end : end + block_size] = 1
        out = step(torch.cat([anchor[:, None], proposals], -1), key_mask, block_positions, cache)
        accepted, bonus = verify(out.logits, proposals, q, generator=generator, live=live, **sampling)
        kept = (offsets[None] <= accepted[:, None]) & alive[:, None]
        key_mask[:, end : end + block_size] = kept
        positions[:, end : end + block_size] = block_positions
        end += block_size
        lengths = lengths + torch.where(alive, accepted + 1, 0)
        tokens.scatter_(1, block_positions[:, 1:], proposals)
        tokens.scatter_(1, lengths[:, None], bonus[:, None])
        anchor = torch.where(alive, bonus, anchor)
        features = proposer.pending(out.hidden, kept)
        steps = committed(proposals, accepted, bonus)
        done = [d or requests.commit(i, s) for i, (d, s) in enumerate(zip(done, steps, strict=False))]


@torch.no_grad()
def target_generate(
    target: Any,
    prompts_ids: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    on_commit: OnCommit | None = None,
    fast: FastDecode = FastDecode(),
) -> list[Generation]:
    """speculative.target_generate on the fast path (same arguments, same results), its one-token step compiled under
    `fast.compile`. Like the reference, finished rows keep decoding (and drawing); only padding rows draw nothing."""
    sampling = sampling or Sampling()
    generator = generator or torch.Generator(device=target.lm_head_weight.device).manual_seed(0)
    token_args = sampling.token()
    rows, capacity = sampling.batch_size, fast.capacity_for(prompts_ids, max_new_tokens, 1)
    step = target.decode_step(fast.compile)
    results: list[Generation] = []
    for start in range(0, len(prompts_ids), rows):
        prompts = prompts_ids[start : start + rows]
        out, key_mask, _, cache, _ = start_batch(target, prompts, rows, capacity, 0)
        end, lengths = cache.length, key_mask.sum(-1)
        live, _ = live_rows([False] * len(prompts), rows, key_mask.device)
        token = first_token(out.logits, generator=generator, live=live, **token_args)
        requests = Requests(len(prompts), max_new_tokens, set(sampling.stop_ids), on_commit)
        done = [requests.commit(i, [t]) for i, t in enumerate(token[: len(prompts)].tolist())]
        while not all(done):
            key_mask[:, end] = 1
            out = step(token[:, None], key_mask, lengths[:, None], cache)
            end, lengths = end + 1, lengths + 1
            token = first_token(out.logits[:, -1], generator=generator, live=live, **token_args)
            done = [d or requests.commit(i, [t]) for i, (d, t) in enumerate(zip(done, token.tolist(), strict=False))]
        results += requests.out
    return results
