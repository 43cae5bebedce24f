"""Building what a config group names (`_target_`), the one way the entry points do it."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

# Bad input: the user's to fix, and the message says how, so the entry points print it without a traceback.
BAD_INPUT = (FileNotFoundError, ValueError)


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node, **kwargs)`, letting the object's own refusal of a bad setting (a ValueError or
    FileNotFoundError that names it) through instead of Hydra's wrapper around it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, BAD_INPUT):
            raise e.__cause__ from None
        raise
