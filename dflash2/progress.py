"""Progress of the long loops (training, decoding, regeneration): a tqdm bar on a terminal, log lines elsewhere.

Under nohup, a scheduler or `> file` a bar's carriage returns pile up into one line that no log viewer shows and
that never reaches the job's log file (train.log, evaluate.log); there the same bar writes one log line every
LOG_INTERVAL_S seconds instead, plus one when it starts and one when it ends.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0
log = logging.getLogger(__name__)


class _Nowhere(io.TextIOBase):
    """Where a logging bar's own terminal output goes (tqdm still writes a newline when it closes)."""

    def write(self, s: str) -> int:
        return len(s)


def interactive() -> bool:
    """Both output streams on a terminal: someone watches a bar there. Otherwise the output lands in files."""
    return sys.stdout.isatty() and sys.stderr.isatty()


# Library warnings that tell a user of dflash2 nothing to act on; silenced so that a run's output (in a file under nohup
# or a scheduler above all) keeps to its own lines. Message patterns, each with why it is noise:
QUIET_WARNINGS = (
    r"'set_vital' is deprecated",  # torchdata's StatefulDataLoader calls a torch API torch deprecates
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",  # Lightning 2.6's use of torch's pytree
    r"You have overridden `on_before_batch_transfer` in `LightningModule`",  # DFlash2Module's blocks, on purpose
    r"When using the `ThroughputMonitor`, you need to define a `flops_per_batch`",  # it logs tokens/s, not FLOPs
    r"Checkpoint directory .* exists and is not empty",  # a resume writes into its own run's checkpoints/ by design
)
# Lightning's informational lines that are not about the run: an advertisement, and a step of its own bookkeeping.
QUIET_LIGHTNING_LINES = ("\N{ELECTRIC LIGHT BULB} Tip:", "Loading `train_dataloader` to estimate")
# Off a terminal, also its device banner, which the run's first log line says in its own words ("trainer cpu"):
# rank_zero_info's lines and, on a GPU, the CUDA accelerator's (its logger and the line's start).
DEVICE_BANNER = {
    "lightning.pytorch.utilities.rank_zero": ("GPU available:", "TPU available:", "HPU available:"),
    "lightning.pytorch.accelerators.cuda": ("LOCAL_RANK:",),
}


class _DropLines(logging.Filter):
    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


_DROP_LINES = _DropLines(QUIET_LIGHTNING_LINES)
_DROP_BANNER = {name: _DropLines(starts) for name, starts in DEVICE_BANNER.items()}


def quiet_libraries() -> None:
    """Keep a run's output to its own lines: the library warnings of QUIET_WARNINGS and Lightning's
    QUIET_LIGHTNING_LINES are dropped; off a terminal, where each frame of a bar lands in the file as a line of its
    own, the Hugging Face libraries' progress bars (loading weights, mapping datasets, downloads) are off too, and
    dflash2's own `Progress` logs there instead, and Lightning's DEVICE_BANNER is dropped. (Off a terminal the
    training also turns off Lightning's model summary table and W&B's non-essential lines: dflash2.training.run.)"""
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DROP_LINES)  # a set: added once
    if interactive():
        return
    for name, drop in _DROP_BANNER.items():
        logging.getLogger(name).addFilter(drop)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported, later
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Here, off a terminal only: transformers takes a second to import, which a run on a terminal need not spend now.
    import huggingface_hub.utils
    import transformers.utils.logging

    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()


@contextlib.contextmanager
def module_bars_off(module: Any) -> Iterator[None]:
    """Off a terminal, the bars of a library module that draws plain tqdm (not its library's switchable one) are
    off while the block runs: transformers' GGUF conversion draws one, which the libraries' switches do not reach."""
    if interactive():
        yield
        return
    drawn = module.tqdm
    module.tqdm = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        module.tqdm = drawn


class Progress(tqdm):
    """tqdm, except that off a terminal each display is a log line (without the bar) at most every LOG_INTERVAL_S."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.logs = not interactive()
        if self.logs:
            kwargs |= {"file": _Nowhere(), "mininterval": LOG_INTERVAL_S}
            kwargs.setdefault("bar_format", "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]")
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if not self.logs:
            return super().display(msg, pos)
        if msg != "":  # tqdm clears a bar with an empty message; there is nothing to clear in a log
            log.info("%s", str(self) if msg is None else msg)
        return True


class DecodeProgress(Progress):
    """The `on_commit` callback of `speculative_generate` / `target_generate`: requests done out of `total`, with
    tokens/s and the running tau (mean tokens committed per verify step) beside them."""

    def __init__(self, total: int, desc: str = "decode") -> None:
        self.tokens = self.steps = self.step_tokens = 0  # before tqdm's first display reads them
        # miniters=0: a display is due on time alone, also between two finished requests (a batch decodes long).
        super().__init__(total=total, desc=desc, unit="requests", miniters=0)

    def __call__(self, tokens: int, verified: bool, done: bool) -> None:
        self.tokens += tokens
        if verified:
            self.steps, self.step_tokens = self.steps + 1, self.step_tokens + tokens
        self.update(int(done))

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        rate = self.tokens / d["elapsed"] if d["elapsed"] > 0 else 0.0
        tau = self.step_tokens / self.steps if self.steps else 0.0
        d["postfix"] = f"{rate:.1f} tokens/s, tau {tau:.2f}"
        return d
