"""Progress of the long loops (training, decoding, regeneration): a tqdm bar on a terminal, log lines elsewhere.

Under nohup, a scheduler or `> file` a bar's carriage returns pile up into one line that no log viewer shows and
that never reaches the job's log file (train.log, evaluate.log); there the same bar writes one log line every
LOG_INTERVAL_S seconds instead, plus one when it starts and one when it ends.
"""

from __future__ import annotations

import io
import logging
import sys
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
