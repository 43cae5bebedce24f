"""The speed-up model of `python speed.py` (dflash2/evaluation/speed.py): tokens/s of speculative decoding and of the
target alone, predicted from measured step costs and the drafter's acceptance.

A speculative step at batch b and block B takes s(b, B) = draft + verify + other seconds, the target
alone's step s_a(b) = forward + other, each batch's prefill P(b, B) and P_a(b): all measured (`dflash2.decoding.costs`).
The acceptance is the committed-length histogram at B of each reply (h_i(n) of its steps committed n tokens,
n = 1..B), from an evaluate.py run of the bench's prompts; their sum is the run's `accept_hist`, whose mean is tau.
Assumptions:

1. Batch: every row of a step commits its own accept length; a reply's steps commit n tokens with the frequency of
   its own histogram, drawn independently step after step. A step's time is set by the batch (how many rows are
   live), not by any one row: with all b rows live a step commits b * tau tokens on average in s(b, B).
2. Requests finish unevenly. Reply i of N_i tokens takes its first from the prefill and N_i - 1 from verify steps:
   K_i = K(N_i - 1) steps on average, K(m) = 1 + sum_n p_i(n) K(m - n), K(m <= 0) = 0 (a last step is cut at the
   budget or a stop token), p_i = h_i / sum h_i. Speculative decoding drops finished rows, so step j of a batch costs
   s(r_j, B) with r_j = sum_i clamp(K_i - j, 0, 1) live rows (a row's fractional last step happens with that
   probability); s is linear in the rows between measured batch sizes, flat below the smallest, r * s(1) for r < 1.
   The target alone decodes every row until the longest reply is done (`target_generate`): (max N_i - 1) s_a(b).
3. Host overhead: `other`, the part of a step beyond the draft and the verify forward (acceptance, commits, cache
   bookkeeping), measured per step like the forwards; each batch pays its prefill once.

Per batch of replies:  T = P(b, B) + sum_j s(r_j, B),  T_a = P_a(b) + (max_i N_i - 1) s_a(b); over the batches,
tokens/s = sum N / sum T, the target alone's sum N / sum T_a, and the speed-up sum T_a / sum T. The replies are the
acceptance run's, its prompts cycled to whole batches of b, as the measured runs decode them (turn by turn). Long
replies at full batches leave the steady speed-up tau * s_a(b) / s(b, B).

Other blocks B' use the replies of an evaluate.py run at B' (`results=`) where one is given, else the truncation
estimate: a step that committed n tokens at B commits min(n, B') at B' (the same first proposals, cut to the B' - 1
slots of the smaller block; positions in the text taken as alike, as in assumption 1), reply by reply. Each row of
the output says which it used.

On the fast path (`decode=static`, dflash2/decoding/static.py) a batch keeps its rows to its end, finished ones
masked, and a short batch is padded to b rows: every step of a batch costs s(b, B), its prefill P(b, B), and it takes
max_i K_i steps (the expected longest reply's, taken as the longest expected one), so T = P(b, B) + max_i K_i s(b, B)
and the target alone's T_a = P_a(b) + (max_i N_i - 1) s_a(b).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")


def tau_of(hist: Sequence[int]) -> float:
    """Mean committed tokens per step of a histogram (hist[n - 1] = steps that committed n tokens)."""
    return sum(n * h for n, h in enumerate(hist, 1)) / sum(hist)


def truncate(hist: Sequence[int], block_size: int) -> list[int]:
    """A histogram measured at a block of len(hist) estimated at `block_size` <= that: n committed -> min(n, B')."""
    if not 2 <= block_size <= len(hist):
        raise ValueError(f"truncation estimates blocks of 2..{len(hist)} from a histogram at {len(hist)}")
    return [*hist[: block_size - 1], sum(hist[block_size - 1 :])]


def expected_steps(hist: Sequence[int], tokens: int) -> float:
    """K(tokens): the mean number of steps that commit at least `tokens` tokens, each step committing n with the
    histogram's frequency (assumption 2 of the module's docstring); 0 for none."""
    if tokens <= 0:
        return 0.0
    total = sum(hist)
    p = [(n, h / total) for n, h in enumerate(hist, 1) if h]
    k = [0.0] * (tokens + 1)
    for m in range(1, tokens + 1):
        k[m] = 1 + sum(pn * k[max(m - n, 0)] for n, pn in p)
    return k[tokens]


def cost_at(table: Mapping[int, float], rows: float) -> float:
    """A cost measured at some batch sizes, at `rows` live rows: linear between them, flat outside, r * cost(1) below
    one row (the share of the time a last, fractional, step happens)."""
    if rows <= 0:
        return 0.0
    if rows < 1:
        return rows * cost_at(table, 1)
    sizes = sorted(table)
    if rows <= sizes[0] or rows >= sizes[-1]:
        return table[sizes[0] if rows <= sizes[0] else sizes[-1]]
    hi = bisect.bisect_left(sizes, rows)
    lo = hi - 1
    share = (rows - sizes[lo]) / (sizes[hi] - sizes[lo])
    return table[sizes[lo]] + share * (table[sizes[hi]] - table[sizes[lo]])


def cycled(items: Sequence[T], batch: int) -> list[T]:
    """`items` cycled to whole batches of `batch`: every batch decoded is full."""
    return [items[i % len(items)] for i in range(-(-len(items) // batch) * batch)]


def request_batches(replies: Sequence[Sequence[T]], batch: int) -> list[list[T]]:
    """Replies by prompt and turn -> the replies of each batch decoded, as `generate_turns` batches the prompts cycled
    to whole batches: turn by turn, `batch` requests at a time of the prompts that have that turn."""
    prompts = cycled(replies, batch)
    batches = []
    for turn in range(max(len(p) for p in prompts)):
        todo = [p[turn] for p in prompts if turn < len(p)]
        batches += [todo[i : i + batch] for i in range(0, len(todo), batch)]
    return batches


def predict(
    replies: Sequence[Sequence[tuple[int, float]]],
    batch: int,
    tau: float,
    spec: Mapping[int, Mapping[str, float]],
    target: Mapping[int, Mapping[str, float]],
    static: bool = False,
) -> dict[str, float]:
    """Predicted tokens/s of speculative decoding and of the target alone at `batch`, and the speed-up.

    `replies`: (tokens, mean steps K) of each reply by prompt and turn, at one block; `tau` that block's; `spec`:
    batch size -> its draft/verify/other/step/prefill seconds (`costs.measure_costs`); `target`: batch size -> the
    target alone's forward/other/step/prefill; `static`: the fast path's loops, every batch `batch` rows to its end."""
    step, prefill = _column(spec, "step"), _column(spec, "prefill")
    target_step, target_prefill = _column(target, "step"), _column(target, "prefill")
    tokens = seconds = target_seconds = 0.0
    for replies_of_batch in request_batches(replies, batch):
        rows, lengths = len(replies_of_batch), [n for n, _ in replies_of_batch]
        steps = [k for _, k in replies_of_batch]
        tokens += sum(lengths)
        if static:
            rows = batch
            seconds += cost_at(prefill, rows) + max(steps) * cost_at(step, rows)
        else:
            live = [sum(min(max(k - j, 0.0), 1.0) for k in steps) for j in range(math.ceil(max(steps)))]
            seconds += cost_at(prefill, rows) + sum(cost_at(step, r) for r in live)
        target_seconds += cost_at(target_prefill, rows) + (max(lengths) - 1) * cost_at(target_step, rows)
    return {
        "tokens_per_s": tokens / seconds,
        "target_tokens_per_s": tokens / target_seconds,
        "speedup": target_seconds / seconds,
        "speedup_steady": tau * cost_at(target_step, batch) / cost_at(step, batch),
    }


def _column(costs: Mapping[int, Mapping[str, float]], key: str) -> dict[int, float]:
    return {b: c[key] for b, c in costs.items()}
