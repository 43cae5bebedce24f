"""How evaluate.py (and speed.py) time decoding: the clock, the timed passes over the prompts, and the tokens/s and
speed-up they give."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# A timed pass over the prompts: (generator, whether to warm up first) -> (sample records, seconds).
TimedPass = Callable[[torch.Generator, bool], tuple[list[dict], float]]


def clock(target: Any) -> float:
    """perf_counter once the target's device has finished its queued work."""
    if target.lm_head_weight.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def graphs_compiled() -> int:
    """Graphs torch.compile has built in this process so far (its dynamo counter); 0 when nothing was compiled."""
    from torch._dynamo.utils import counters  # torch's own counter of compiled graphs

    return int(counters["stats"]["unique_graphs"])


def warn_compiles_in_pass(before: int, what: str) -> None:
    """Warn when a timed pass compiled graphs: shapes the warm-up did not cover, whose compile time its tokens/s
    counts (decode=static compile=true specialises every step to its shape)."""
    built = graphs_compiled() - before
    if built:
        log.warning(
            "%s: %d graph(s) compiled inside the timed pass; its tokens/s includes their compile time", what, built
        )


def timed_passes(
    speculative: TimedPass,
    alone: TimedPass | None,
    repeats: int,
    warmup: bool,
    seed: int,
    device: torch.device,
) -> tuple[list[tuple[list[dict], float]], list[tuple[list[dict], float]]]:
    """`repeats` timed passes of `speculative` -> (its passes, the target alone's: empty when `alone` is None). Each
    pass starts from the same seed; the target alone follows each pass, so the two speeds are compared pass by pass on
    a machine in the same state. One-off costs are paid once, before the first timed pass (`warmup`)."""
    passes, reference = [], []
    for r in range(repeats):
        passes.append(speculative(torch.Generator(device).manual_seed(seed), warmup and r == 0))
        if alone is not None:
            reference.append(alone(torch.Generator(device).manual_seed(seed), warmup and r == 0))
    return passes, reference


def speed(passes: list[tuple[list[dict], float]]) -> dict[str, Any]:
    """tokens/s as the median over the timed passes, with every pass's figure beside it."""
    rates = [sum(len(s["output_ids"]) for s in samples) / seconds for samples, seconds in passes if seconds > 0]
    return {
        "tokens_per_s": statistics.median(rates) if rates else None,
        "tokens_per_s_passes": rates,
        "seconds": statistics.median(seconds for _, seconds in passes),
    }


def baseline_speed(
    reference: list[tuple[list[dict], float]],
    passes: list[tuple[list[dict], float]],
    rates: list[float],
    temperature: float,
) -> dict[str, Any]:
    """The target alone on the same prompts: its speed, the speed-up pass by pass, and at T = 0 a check that
    speculative decoding was lossless."""
    out = speed(reference)
    ratios = [a / b for a, b in zip(rates, out["tokens_per_s_passes"], strict=True)]
    out["speedup"] = statistics.median(ratios) if ratios else None
    if temperature == 0:
        samples, target_samples = passes[0][0], reference[0][0]
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(samples, target_samples, strict=True))
        out["identical_outputs"] = same / len(samples)
        if same < len(samples):
            log.warning(
                "%d of %d greedy outputs differ from the target's own (numerics of batched vs one-token "
                "forwards, or a bug)",
                len(samples) - same,
                len(samples),
            )
    return out
