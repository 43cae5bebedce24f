"""Fixed-capacity caches for the fast decode path (`decode=static`, dflash2/static_decode.py).

Every row of a decode batch appends the same slots at every step (a whole verify block, or one token), rejected ones
included, so one write pointer serves every row: the target's keys/values and the drafter's context keys/values live in
buffers preallocated at `capacity` slots per row, written in place at that pointer. Shapes and addresses then stay
fixed from step to step, which is what torch.compile and CUDA graphs need. Dropping the masked slots (`keep`) is a
gather within the same buffers that moves the pointer back.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from dflash2.model import DraftCache


def take_slots_(buffer: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    """In place: slot j of each row (along `dim`) becomes its slot index[row, j], for j < index.shape[1]; the slots
    after those are left as they were. buffer [b, ..., slots (at dim), ...], index [b, n] (any slot of the row)."""
    shape = [1] * buffer.dim()
    shape[0], shape[dim] = index.shape
    sizes = list(buffer.shape)
    sizes[dim] = index.shape[1]
    gathered = buffer.gather(dim, index.view(shape).expand(sizes))  # a copy: the writes below cannot clobber a read
    buffer.narrow(dim, 0, index.shape[1]).copy_(gathered)


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


class StaticDraftCache(DraftCache):
    """The drafter's context cache (`DraftCache`) in buffers of `capacity` slots per row and layer, allocated at the
    first update. `keys[layer]` / `values[layer]` are views of the slots written so far, so a draft step attends over
    the context it holds, with no copy of the cache: DraftCache concatenates the whole cache at every step."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(num_layers)
        self.capacity = capacity
        self.buffers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buffers[layer] is None:
            shape = (*k.shape[:2], self.capacity, k.shape[3])
            self.buffers[layer] = (k.new_zeros(shape), v.new_zeros(shape))
        start = 0 if self.keys[layer] is None else self.keys[layer].shape[2]
        end = start + k.shape[2]
        if end > self.capacity:
            raise RuntimeError(f"the drafter's static cache holds {self.capacity} slots; {end} were asked for")
        keys, values = self.buffers[layer]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        self.keys[layer], self.values[layer] = keys[:, :, :end], values[:, :, :end]
        return self.keys[layer], self.values[layer]

    def keep(self, index: torch.Tensor) -> None:
        """Make each row's slots `index[row]` ([b, n], in that order) its first n, and n the slots it holds."""
        n = index.shape[1]
        for layer, buffers in enumerate(self.buffers):
            if buffers is not None:
                for buffer in buffers:
                    take_slots_(buffer, index, 2)
                self.keys[layer], self.values[layer] = buffers[0][:, :, :n], buffers[1][:, :, :n]
