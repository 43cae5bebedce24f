"""`python -m dflash2.commands.regenerate` (`dflash2-regenerate`): the target's own replies to chats
(dflash2.data.regenerate), on configs/regenerate.yaml.

    python -m dflash2.commands.regenerate [model=smollm2|tiny|qwen3] [input=FILE] [output=FILE] [limit=N] ...

Every setting is checked before the target loads: the shard, the chat template's arguments, the input, and the output
against what it already holds (a rerun resumes into it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import datasets
import torch
from omegaconf import DictConfig

from dflash2.commands import build, command
from dflash2.data.chat import load_conversations
from dflash2.data.regenerate import check_output, regenerate
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, format_kwargs
from dflash2.target.locate import TargetNotFoundError
from dflash2.target.model import TargetModel, resolve_device


def main() -> None:
    """The console entry."""
    command("regenerate", run)


def run(cfg: DictConfig) -> int:
    """The command on a composed configs/regenerate.yaml; returns how many conversations were written."""
    options = checked_options(cfg, [cfg.output])
    conversations = conversations_of(cfg, cfg.input)  # before the target loads: a wrong input fails at once
    n = regenerate(load_target(cfg), conversations, cfg.output, **options)
    print(f"regenerate: {report(n, cfg.output, options)}")
    return n


def checked_options(cfg: DictConfig, outputs: Iterable[str]) -> dict[str, Any]:
    """`regenerate`'s keyword arguments from a composed configs/regenerate.yaml, checked before the target loads:
    the shard, the chat template's arguments, and each of `outputs` against what it already holds."""
    if not 0 <= cfg.shard_index < cfg.num_shards:
        raise SystemExit(f"shard_index={cfg.shard_index} must be in [0, num_shards={cfg.num_shards}); pass 0 .. n-1")
    try:
        chat_template_kwargs = check_chat_template_kwargs(cfg.chat_template_kwargs, KWARGS_KEY) or {}
        for output in outputs:
            check_output(output, chat_template_kwargs)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return {
        "batch_size": cfg.batch_size,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "max_length": cfg.max_length,
        "chat_template_kwargs": chat_template_kwargs,
        "regenerated_by": cfg.model.name,
        "cache_implementation": cfg.get("cache_implementation"),
        "shortest_first": cfg.shortest_first,
    }


def load_target(cfg: DictConfig) -> TargetModel:
    """The frozen target of `cfg.model`, seeded by `cfg.seed` (sampled replies); a missing one exits in a sentence."""
    torch.manual_seed(cfg.seed)
    try:
        return build(cfg.model, device=resolve_device(cfg.device))
    except TargetNotFoundError as e:
        raise SystemExit(str(e)) from None  # one sentence, no traceback


def conversations_of(cfg: DictConfig, path: str | None, setting: str = "input") -> datasets.Dataset:
    """The conversations of `path` (None = the packaged ShareGPT) this process regenerates: `limit`, then its shard.
    A missing file exits naming `setting`, the key the user typed it as."""
    if path is not None and not Path(path).is_file():
        raise SystemExit(f"{setting}={path!r} does not exist: pass a JSON/JSONL file of chats, or null for ShareGPT")
    conversations = load_conversations(path, limit=cfg.limit)
    if cfg.num_shards > 1:
        conversations = conversations.shard(cfg.num_shards, cfg.shard_index, contiguous=False)
    return conversations


def report(written: int, output: str, options: dict[str, Any]) -> str:
    kwargs = format_kwargs(options["chat_template_kwargs"])
    return f"wrote {written} conversations to {output} (target {options['regenerated_by']}, {KWARGS_KEY}={kwargs})"


if __name__ == "__main__":
    main()
