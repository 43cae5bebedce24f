"""The target's fixed-capacity cache for the fast decode path (`decode=static`, dflash2/decoding/static.py).

Every row of a decode batch appends the same slots at every step (a whole verify block, or one token), rejected ones
included, so one write pointer serves every row: the target's keys/values and the drafter's context keys/values live in
buffers preallocated at `capacity` slots per row, written in place at that pointer. Shapes and addresses then stay
fixed from step to step, which is what torch.compile and CUDA graphs need. Dropping the masked slots (`keep`) is a
gather within the same buffers that moves the pointer back.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dflash2.model.drafter import take_slots_

Cache = TypeVar("Cache")


def reused(caches: dict[Any, Cache], key: Hashable, make: Callable[[], Cache], kept: int = 2) -> Cache:
    """The static cache of `key` (a shape) from `caches`, emptied by its `reset()`, or a new one (`make()`): the same
    buffers at the same addresses for every batch of that shape, so that compiled steps replay the CUDA graphs they
    recorded instead of recording new ones. The last `kept` keys are kept, the newest last."""
    cache = caches.pop(key, None)
    if cache is None:
        while len(caches) >= kept:  # the oldest goes before new buffers are allocated
            caches.pop(next(iter(caches)))
        cache = make()
    cache.reset()
    caches[key] = cache
    return cache


class TargetStaticCache(StaticCache):
    """transformers' StaticCache for a target whose every layer attends to its whole context, with the write pointer
    also kept on the host (`length`, set by whoever moves it: the decode loop and `keep`).

    transformers' mask code compares the query offset with 0 before it builds a verify block's mask; from a StaticLayer
    that offset is its device counter, so an eager step would wait for the device there. Here an eager step reads the
    host's copy; a compiled one still reads the counter, so that its graph does not depend on the pointer's value."""

    def __init__(self, config: Any, capacity: int) -> None:
        super().__init__(config=config, max_cache_len=capacity)
        others = sorted({type(layer).__name__ for layer in self.layers if type(layer) is not StaticLayer})
        if others:
            raise ValueError(
                f"decode=static: the target has {', '.join(others)} cache layers (sliding or chunked attention, "
                "recurrent state), which keep their own positions; it needs full attention in every layer. Use "
                "decode=plain"
            )
        self.capacity, self.length = capacity, 0

    def get_query_offset(self, layer_idx: int = 0) -> int | torch.Tensor:
        if torch.compiler.is_compiling():
            return super().get_query_offset(layer_idx)
        return self.length

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def keep(self, index: torch.Tensor) -> None:
        """Make each row's slots `index[row]` ([b, n], in that order) its first n, and n the pointer."""
        for layer in self.layers:
            if layer.is_initialized:
                take_slots_(layer.keys, index, 2)
                take_slots_(layer.values, index, 2)
                layer.cumulative_length.fill_(index.shape[1])
        self.length = index.shape[1]
