"""Training data: chats rendered with the target's template, random anchors, blocks and their attention mask."""

from dflash2.data.anchors import (
    block_ids,
    block_labels,
    block_positions,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
    valid_anchor_positions,
)
from dflash2.data.chat import load_conversations, render, render_batch, tokenize_conversations
from dflash2.data.datamodule import BlockCollator, DFlashDataModule

__all__ = [
    "BlockCollator",
    "DFlashDataModule",
    "block_ids",
    "block_labels",
    "block_positions",
    "dense_block_mask",
    "flex_block_mask",
    "load_conversations",
    "render",
    "render_batch",
    "sample_anchors",
    "tokenize_conversations",
    "valid_anchor_positions",
]
