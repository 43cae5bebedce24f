"""Batches of anchored blocks: rows right-padded to one length, with the block inputs, positions and labels of every
anchor (contract section 7)."""

from __future__ import annotations

import torch

from dflash2.data.anchors import block_ids, block_labels, block_positions
from dflash2.data.feature_store import pad_features


class BlockCollator:
    """Right-pads rows and anchors and builds the block inputs, positions and labels of every anchor.

    `pad_to_multiple_of` rounds each batch's row length up to a multiple of it, and its block slots (anchors times B,
    in whole blocks) up to one too where B divides it: fewer distinct shapes, so the per-shape work on a GPU (cuDNN's
    attention plans, one for every new length) is done a few dozen times instead of once per batch, and flex
    attention's 128-wide tiles line up with the context's end and with the blocks. Right padding is what lets the
    target run without an attention mask (DFlash2Module.target_pass)."""

    def __init__(self, block_size: int, mask_token_id: int, pad_token_id: int = 0, pad_to_multiple_of: int = 1):
        check_pad_to_multiple_of(pad_to_multiple_of)
        self.block_size, self.mask_token_id, self.pad_token_id = block_size, mask_token_id, pad_token_id
        self.length_multiple = pad_to_multiple_of
        self.block_multiple = max(1, pad_to_multiple_of // block_size)

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = _round_up(max(len(r["input_ids"]) for r in rows), self.length_multiple)
        blocks = _round_up(max(len(r["anchors"]) for r in rows), self.block_multiple)
        input_ids = _right_pad([r["input_ids"] for r in rows], length, self.pad_token_id)
        loss_mask = _right_pad([r["loss_mask"] for r in rows], length)
        attention_mask = _right_pad([torch.ones_like(r["input_ids"]) for r in rows], length)
        anchors = _right_pad([r["anchors"] for r in rows], blocks)
        anchor_valid = [torch.full_like(r["anchors"], not r.get("padding"), dtype=torch.bool) for r in rows]
        anchor_valid = _right_pad(anchor_valid, blocks)
        cached = pad_features(rows, length) if "features" in rows[0] else {}  # data.features
        return {
            **cached,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "anchors": anchors,
            "anchor_valid": anchor_valid,
            "block_ids": block_ids(input_ids, anchors, self.block_size, self.mask_token_id, anchor_valid),
            "block_positions": block_positions(anchors, self.block_size),
            "labels": block_labels(input_ids, loss_mask, anchors, self.block_size, anchor_valid),
        }


def check_pad_to_multiple_of(value: object) -> None:
    """`data.pad_to_multiple_of` must be an integer >= 1 (1 = no rounding)."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"data.pad_to_multiple_of={value}: the multiple a batch's length is rounded up to must be an integer >= 1 "
            "(1 = no rounding; 128 on a GPU)"
        )


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _right_pad(rows: list[torch.Tensor], length: int, value: int = 0) -> torch.Tensor:
    """[len_i] rows -> [rows, length], each padded on the right with `value`."""
    return torch.stack([torch.nn.functional.pad(r, (0, length - len(r)), value=value) for r in rows])
