"""A training's schedule within a time budget: `trainer.max_time` stops the run there, and `trainer.max_steps`, which
the cosine spans, is sized from a probe's measured pace so that the learning rate reaches its end in time.

The probe is a short run of the very configuration (dflash2/training/step_rate.py measures it): its warm-up (the
compilations before step `skip`), its steady steps/s and the seconds of one validation, with the steps between two
validations. A run of n steps then takes, as trainer.max_time counts from the start of fit,

    warmup_s + (n - skip) / steps_per_s + ceil(n / val_every) * validation_s

(the last validation at n, which ends every run, included; one validation when the run validates at its end only),
and `budget_steps` is the largest n whose time fits `margin` of the budget.
"""

from __future__ import annotations

import math
from typing import Any


def run_seconds(steps: int, probe: dict[str, Any]) -> float:
    """The seconds a run of `steps` steps takes by the probe's measurements (see the module's docstring); before step
    `skip` the warm-up is spread evenly over its steps."""
    skip, rate = int(probe["skip"]), float(probe["steps_per_s"])
    warmup = float(probe.get("warmup_s") or 0.0)
    stepping = warmup * steps / skip if steps < skip else warmup + (steps - skip) / rate
    every = probe.get("val_every")
    validations = math.ceil(steps / every) if every else 1
    return stepping + validations * float(probe.get("validation_s") or 0.0)


def budget_steps(probe: dict[str, Any], minutes: float, margin: float) -> int:
    """The most steps whose run takes at most `margin` x `minutes` by the probe's measurements (at least 1). With no
    warm-up and no validations that is floor(steps_per_s x minutes x 60 x margin)."""
    rate = probe.get("steps_per_s")
    if not rate or rate <= 0:
        raise ValueError(f"the probe measured no step rate ({probe}): it stopped before step {probe.get('skip')}")
    budget = minutes * 60 * margin
    low, high = 0, int(probe["skip"]) + math.ceil(rate * budget) + 1  # run_seconds(high) > budget
    while high - low > 1:  # run_seconds never falls as steps grow: the largest fit by bisection
        middle = (low + high) // 2
        low, high = (middle, high) if run_seconds(middle, probe) <= budget else (low, middle)
    return max(1, low)


def max_time(minutes: float) -> str:
    """trainer.max_time for a budget in minutes, as Lightning's DD:HH:MM:SS (whole seconds, at least one)."""
    seconds = max(1, round(minutes * 60))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days:02d}:{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
