"""The measured cost of one decoding step: the draft, the verify forward, the rest of a speculative step, and the target
alone's one-token step, at a batch and block size (what `dflash2.evaluation.speed` predicts tokens/s from).

What is timed is the decode loop itself: `speculative_generate` and `target_generate` run on the batch's prompts with
the target's `forward` and the proposer (`Drafter`, which runs the drafter and `propose`, or prompt lookup) wrapped
in timers, so every step does exactly what decoding does (`verify`, commits, cache compaction). A run stops once it
has timed its steps. Per step:

    draft   the proposer's call (the drafter's forward and `propose`, or the lookup)
    verify  the target's forward over the block
    other   the rest of the loop's iteration (one draft's start to the next one's): `verify`'s acceptance, the
            commits, the caches' bookkeeping, host overhead
    step    draft + verify + other
    prefill everything before the second step's start, less one step: the prompt's forward, the first token and the
            drafter's intake of the prompt's features (the first step's extra), once per batch

The target alone's step is its one-token forward (`forward`) plus the rest of `target_generate`'s iteration. Each
figure is the median over `runs` timed runs (after `warmup` untimed ones, which pay compilation and allocation) of
`steps` steps each, and step = draft + verify + other (each a median, `other` that of each step's remainder).
The clock synchronises CUDA before reading perf_counter: the loop synchronises every step anyway (it reads the
accepted lengths on the host), so a step's wall time is what decoding sees. No row stops early (no stop tokens, a
budget beyond the timed steps), so every timed step runs the whole batch; the context is the prompts' plus what the
few timed steps commit.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dflash2.decoding import static
from dflash2.decoding.proposer import Proposer
from dflash2.decoding.speculative import Sampling
from dflash2.decoding.static import FastDecode

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class _Enough(Exception):
    """Every step of a timing run has been timed: ends the decode early."""


class _Timed:
    """Wraps one callable: records (start, end) of every call and refuses the call numbered `stop_at`."""

    def __init__(self, fn: Callable[..., Any], clock: Clock, stop_at: int) -> None:
        self.fn, self.clock, self.stop_at = fn, clock, stop_at
        self.spans: list[tuple[float, float]] = []
        self.last_start = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.fn, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, timed as one of this record's calls."""
        self.last_start = start = self.clock()
        if len(self.spans) == self.stop_at:
            raise _Enough
        out = fn(*args, **kwargs)
        self.spans.append((start, self.clock()))
        return out

    def starts(self) -> list[float]:
        """Every call's start, the refused one's last."""
        return [s for s, _ in self.spans] + [self.last_start]

    def durations(self) -> list[float]:
        return [end - start for start, end in self.spans]


class TimedTarget:
    """The target as the decode loops use it, with `forward` timed (every other attribute is the target's own); on
    the fast path the prefill is a `forward` and each step a `decode_step`, timed as calls of the same record."""

    def __init__(self, target: Any, clock: Clock, stop_at: int) -> None:
        self._target = target
        self.forward = _Timed(target.forward, clock, stop_at)

    def decode_step(self, mode: str | None = None) -> Callable[..., Any]:
        step = self._target.decode_step(mode)
        return functools.partial(self.forward.run, step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


class TimedProposer:
    """A proposer (`Proposer`) whose calls, one per speculative step, are timed."""

    def __init__(self, proposer: Proposer, clock: Clock, stop_at: int) -> None:
        self.proposer = proposer
        self.call = _Timed(proposer, clock, stop_at)

    def slots(self, block_size: int) -> int:
        return self.proposer.slots(block_size)

    def new_cache(self, capacity: int | None = None) -> Any:
        return self.proposer.new_cache(capacity)

    def pending(self, hidden: torch.Tensor, kept: torch.Tensor) -> Any:
        return self.proposer.pending(hidden, kept)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)


def device_clock(device: torch.device) -> Clock:
    """perf_counter once `device` has finished its queued work."""

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


def _run(decode: Callable[[Clock], tuple[list[float], list[float], list[float]]], clock: Clock, steps: int) -> dict:
    """One timing run: `decode(clock)` -> (step starts 0..steps+1, the forwards, the drafts) of its steps."""
    begin = clock()
    starts, forwards, drafts = decode(clock)
    timed = range(1, steps + 1)  # step 0 is the prefill's (the drafter takes in the prompt): not a step
    periods = [starts[k + 1] - starts[k] for k in timed]
    forward, draft = [forwards[k] for k in timed], [drafts[k] if drafts else 0.0 for k in timed]
    return {
        "forward": forward,
        "draft": draft,
        "other": [p - f - d for p, f, d in zip(periods, forward, draft, strict=True)],
        "prefill": starts[1] - begin - statistics.median(periods),
    }


def medians(runs: list[dict]) -> dict[str, float]:
    """Timing runs' steps pooled: median draft (0 without one), forward and other, step their sum, median prefill."""
    costs = {key: statistics.median(x for run in runs for x in run[key]) for key in ("draft", "forward", "other")}
    return costs | {"step": sum(costs.values()), "prefill": statistics.median(run["prefill"] for run in runs)}


def target_run(
    target: Any,
    prompts: list[list[int]],
    token: dict[str, float],
    steps: int,
    seed: int,
    fast: FastDecode | None = None,
) -> dict:
    """One timing run of the target alone on one batch (`prompts`), on the plain loop or the fast path (`fast`);
    `medians` of runs are its costs."""
    sampling = Sampling(**token, batch_size=len(prompts))  # no stop ids: every row decodes every timed step

    def decode(clock: Clock) -> tuple[list[float], list[float], list[float]]:
        timed = TimedTarget(target, clock, stop_at=steps + 2)  # call 0 is the prefill, call k + 1 step k
        generator = torch.Generator(target.lm_head_weight.device).manual_seed(seed)
        try:
            static.decoders(fast)[1](timed, prompts, steps + 3, sampling, generator)
        except _Enough:
            pass
        return timed.forward.starts()[1:], timed.forward.durations()[1:], []

    return _run(decode, device_clock(target.lm_head_weight.device), steps)


def speculative_run(
    target: Any,
    proposer: Proposer,
    prompts: list[list[int]],
    block_size: int,
    token: dict[str, float],
    steps: int,
    seed: int,
    fast: FastDecode | None = None,
) -> dict:
    """One timing run of speculative decoding on one batch at `block_size`, on the plain loop or the fast path
    (`fast`); `medians` of runs are its costs."""
    sampling = Sampling(**token, batch_size=len(prompts))
    budget = (steps + 3) * block_size  # more than the timed steps can commit: no row finishes before the end

    def decode(clock: Clock) -> tuple[list[float], list[float], list[float]]:
        timed_target = TimedTarget(target, clock, stop_at=-1)
        timed = TimedProposer(proposer, clock, stop_at=steps + 1)  # call k is step k's draft
        generator = torch.Generator(target.lm_head_weight.device).manual_seed(seed)
        try:
            generate = static.decoders(fast)[0]
            generate(timed_target, timed, prompts, block_size, budget, sampling, generator=generator)
        except _Enough:
            pass
        # The target's call 0 is the prompt's prefill, call k + 1 step k's verify.
        return timed.call.starts(), timed_target.forward.durations()[1:], timed.call.durations()

    return _run(decode, device_clock(target.lm_head_weight.device), steps)


@dataclasses.dataclass(frozen=True)
class Timing:
    """How each cost is timed: `steps` decode steps per run (after the prefill and a first step), `runs` timed runs
    after `warmup` untimed ones, every run from `seed`."""

    steps: int
    runs: int
    warmup: int
    seed: int


def measure_costs(
    target: Any,
    proposer: Proposer,
    batches: Mapping[int, list[list[int]]],
    block_sizes: list[int],
    token: dict[str, float],
    timing: Timing,
    fast: FastDecode | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """The target alone's costs at every batch (batch size -> its prompts) and speculative decoding's at every batch
    and block size, in seconds, with the prompts' tokens (the context they ran at), on the plain loops or the fast
    path (`fast`, dflash2/decoding/static.py), as the measured decoding runs.

    Every setting first runs `warmup` untimed runs; then the timed runs go round the settings `runs` times, so that
    a spell of load on a shared machine touches every setting a little rather than one a lot."""
    steps, seed = timing.steps, timing.seed
    jobs: dict[tuple[int, int | None], Callable[[], dict]] = {}
    for b, prompts in batches.items():
        jobs[b, None] = functools.partial(target_run, target, prompts, token, steps, seed, fast)
        for block in block_sizes:
            jobs[b, block] = functools.partial(
                speculative_run, target, proposer, prompts, block, token, steps, seed, fast
            )
    log.info("timing %d settings (the target alone and each block, at each batch size), %d runs each", len(jobs),
             timing.runs)  # fmt: skip
    for job in jobs.values():
        for _ in range(timing.warmup):
            job()
    timed: dict[tuple[int, int | None], list[dict]] = {key: [] for key in jobs}
    for _ in range(timing.runs):
        for key, job in jobs.items():
            timed[key].append(job())
    out: dict[str, list[dict[str, Any]]] = {"target": [], "speculative": [], "context": []}
    for b, prompts in batches.items():
        out["context"].append({"batch": b, "mean": sum(map(len, prompts)) / b, "max": max(map(len, prompts))})
        cost = medians(timed[b, None])
        out["target"].append({"batch": b} | {k: cost[k] for k in ("forward", "other", "step", "prefill")})
        for block in block_sizes:
            cost = {"verify" if k == "forward" else k: v for k, v in medians(timed[b, block]).items()}
            out["speculative"].append({"batch": b, "block": block, **cost})
            log.info(
                "costs at batch %d, block %d: %s", b, block, ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in cost.items())
            )
    return out
