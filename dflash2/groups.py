"""Building what a config group names (`_target_`), the one way the entry points do it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

# Bad input: the user's to fix, and the message says how, so the entry points print it without a traceback.
BAD_INPUT = (FileNotFoundError, ValueError)


def exit_on_bad_input(command: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A command line's task: bad input (a missing model or file, an invalid setting) is the user's to fix, and its
    message says how, so it ends the command with that sentence instead of a traceback."""

    @functools.wraps(command)
    def task(cfg: Any) -> Any:
        try:
            return command(cfg)
        except BAD_INPUT as e:
            sys.exit(str(e))

    return task


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node, **kwargs)`, letting the object's own refusal of a bad setting (a ValueError or
    FileNotFoundError that names it) through instead of Hydra's wrapper around it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, BAD_INPUT):
            raise e.__cause__ from None
        raise
