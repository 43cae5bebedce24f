"""The measured pace of a run, for sizing a schedule to a time budget: `<run dir>/step_rate.json`.

A run's first steps compile (the drafter, the head's chunks, the target's layers: about a minute on a GPU) and its
validations stop the steps for a while, so neither a whole run's average nor one step's time says how many steps a
budget holds. `StepRate` measures the three apart, as Lightning's `Timer` (trainer.max_time) counts them, from the
start of fit:

- `warmup_s`: from the start of fit to the end of step `skip`, validations excluded (the compilations);
- `steps_per_s`: the `steps` steps after it, validations excluded;
- `validation_s`: each validation inside fit, from its start to the next step's start (or the end of fit), so the
  checkpoints it writes count too; `val_every` is Lightning's `val_check_batch`, the steps between two of them.

The study runner's probe (`python study.py ... steps=auto`) reads them; any run writes them (a resumed run, those of
its last part: `skip` counts from `start_step`, the step it resumed at, as its log line's step numbers do).
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)

STEP_RATE_FILE = "step_rate.json"


def _now(module: Any) -> float:
    """The wall clock once the device has finished what was queued: the host runs ahead of a GPU by several steps."""
    if module.device.type == "cuda":
        torch.cuda.synchronize(module.device)
    return time.perf_counter()


class StepRate(Callback):
    """Measure a run's warm-up, its steady step rate and its validations (see the module's docstring); written to
    `<run dir>/step_rate.json` when fit ends (rank 0), and logged."""

    def __init__(self, skip: int = 20, steps: int = 60) -> None:
        if skip < 0 or steps < 1:
            raise ValueError(f"callbacks.step_rate: skip={skip} must be >= 0 and steps={steps} >= 1")
        self.skip, self.steps = skip, steps
        self._reset()

    def _reset(self) -> None:
        self.start = self.first_step = None
        self.marks: dict[str, tuple[float, float]] = {}  # "warm" / "end": (time, validation seconds so far)
        self.validations: list[float] = []
        self.validating_since: float | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._reset()
        self.start, self.first_step = _now(module), trainer.global_step
        if self.skip == 0:
            self.marks["warm"] = (self.start, 0.0)

    def on_train_batch_start(self, trainer: Any, module: Any, *args: Any) -> None:
        self._end_validation(module)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self.start is None:
            return
        done = trainer.global_step - self.first_step
        for name, at in (("warm", self.skip), ("end", self.skip + self.steps)):
            if done == at and name not in self.marks:
                self.marks[name] = (_now(module), sum(self.validations))

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        if self.start is not None and not trainer.sanity_checking:  # fit's own validations only
            self.validating_since = _now(module)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._end_validation(module)
        if self.start is None:
            return
        result = self.result(trainer)
        self.start = None
        if not trainer.is_global_zero:
            return
        path = Path(trainer.default_root_dir) / STEP_RATE_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(tmp, path)
        if result["steps_per_s"] is not None:
            first = result["start_step"] + result["skip"]  # the run's own step numbers, a resumed run's included
            log.info(
                "step rate: %.3f steps/s over steps %d-%d, after %.1f s of warm-up from step %d; %d validations of "
                "%.1f s", result["steps_per_s"], first, first + result["measured_steps"], result["warmup_s"],
                result["start_step"], len(result["validations_s"]), result["validation_s"] or 0.0,
            )  # fmt: skip

    def _end_validation(self, module: Any) -> None:
        if self.validating_since is not None:
            self.validations.append(_now(module) - self.validating_since)
            self.validating_since = None

    def result(self, trainer: Any) -> dict[str, Any]:
        """The measurement so far; a run that ended before step `skip + steps` measures the steps it took past
        `skip`, and one that ended before `skip` measures nothing (null rate)."""
        end = time.perf_counter()
        done = trainer.global_step - self.first_step
        warm, last = self.marks.get("warm"), self.marks.get("end")
        if last is None and warm is not None and done > self.skip:
            last = (end, sum(self.validations))
        measured = min(done, self.skip + self.steps) - self.skip if last is not None else 0
        rate = None
        if warm is not None and last is not None and measured > 0:
            seconds = (last[0] - warm[0]) - (last[1] - warm[1])
            rate = measured / seconds if seconds > 0 else None
        every = getattr(trainer, "val_check_batch", None)
        return {
            "skip": self.skip,
            "measured_steps": measured,
            "steps_per_s": rate,
            "warmup_s": (warm[0] - self.start - warm[1]) if warm is not None else None,
            "validations_s": self.validations,
            "validation_s": statistics.median(self.validations) if self.validations else None,
            "val_every": int(every) if isinstance(every, int | float) and math.isfinite(every) else None,
            "start_step": self.first_step,
            "steps": trainer.global_step,
        }
