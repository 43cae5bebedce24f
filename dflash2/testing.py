"""A tiny random Qwen3 target for the tests and the benchmarks' `--small` runs: real shapes and RoPE, SmolLM2's
tokenizer, no weights to ship. It is written once as an ordinary transformers folder, so that every path that loads a
real target (`model.path=<folder>`, `TargetModel.load`, a subprocess running train.py) loads it the same way.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from dflash2.cache import cache_root, model_folder
from dflash2.model.config import DFlash2Config
from dflash2.target.locate import smollm2_folder

TINY_QWEN3 = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False,
)
# What the tests' drafters use on it: the tiny Qwen3 has SmolLM2's vocabulary, hence SmolLM2's mask choice.
TINY_MASK_TOKEN_ID = 3


def tiny_target_path() -> str:
    """The tiny target's folder, built on first use under `cache_root()` (seeded: the same weights every time)."""
    # Here: transformers takes a second to import, and most callers want the cached folder's path only.
    import transformers
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer_source = smollm2_folder()
    # The weights are drawn by transformers' init under a fixed seed: a new release may draw them differently.
    key = json.dumps([TINY_QWEN3, transformers.__version__, torch.__version__, str(tokenizer_source)], sort_keys=True)

    def build(tmp: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
        config = Qwen3Config(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **TINY_QWEN3,
        )
        with torch.random.fork_rng(devices=[]):  # without touching the caller's RNG
            torch.manual_seed(0)
            model = Qwen3ForCausalLM(config).float()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    return str(model_folder(cache_root() / "tiny" / f"qwen3-{digest}", build))


def tiny_target(**kwargs: Any) -> Any:
    """`TargetModel.load` of the tiny target; `kwargs` as load takes them (target_layer_ids, device, ...)."""
    from dflash2.target.model import TargetModel  # here: seconds of imports that callers of the path alone skip

    return TargetModel.load(tiny_target_path(), **{"name": "tiny", "mask_token_id": TINY_MASK_TOKEN_ID} | kwargs)


def tiny_draft_config(target: Any, **changes: Any) -> DFlash2Config:
    """A drafter's config for the tiny target, shaped as configs/quickstart/tiny.yaml shapes training's: one layer
    over target layers [1, 2], blocks of 4; `changes` replace any field (the conv and selector parts, say)."""
    shape = dict(num_hidden_layers=1, block_size=4, mask_token_id=TINY_MASK_TOKEN_ID, target_layer_ids=[1, 2])
    return DFlash2Config(**(target.draft_config_fields() | shape | changes))
