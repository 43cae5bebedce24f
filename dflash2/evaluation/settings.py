"""One evaluation run's settings, checked once and typed: `EvaluationSettings`, built by `evaluation_settings` from
evaluate.py's resolved config (configs/evaluate.yaml as plain values) before anything loads. Every refusal names the
setting as it is typed on the command line and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from dflash2.decoding.hybrid import RULES, NgramRule
from dflash2.decoding.lookup import PromptLookup
from dflash2.decoding.static import FastDecode, decode_mode
from dflash2.evaluation.checks import PLD, PLD_BLOCK_SIZE, check_drafter
from dflash2.model.config import DFlash2Config
from dflash2.model.contract import check_block_size
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs
from dflash2.target.model import resolve_device


@dataclasses.dataclass(frozen=True)
class WandbSettings:
    project: str = "dflash2"
    mode: str = "offline"  # used unless WANDB_MODE is set


@dataclasses.dataclass(frozen=True)
class EvaluationSettings:
    """What one run decodes and how (configs/evaluate.yaml documents each). `block_size` is resolved (the drafter's
    own when the setting is null), `decode` is the fast path's settings (None = the plain loops), `hybrid` the rule
    by which prompt lookup takes a step's block beside the drafter (None = the drafter alone), `wandb` None when W&B
    logging is off, and `config` the run's resolved config, which results.json records and a rerun is matched by."""

    drafter: str  # an export folder, or PLD
    bench: str
    limit: int | None
    block_size: int
    max_new_tokens: int
    selector: bool = True
    lookup: PromptLookup = PromptLookup()
    hybrid: NgramRule | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 8
    decode: FastDecode | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    multi_turn: bool = True
    stop_tokens: tuple[str, ...] = ()
    warmup: bool = True
    baseline: bool = False
    repeats: int = 1
    kernels: str = "auto"
    device: torch.device = torch.device("cpu")
    threads: int | None = 1
    seed: int = 0
    wandb: WandbSettings | None = None
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_lookup(self) -> bool:
        return self.drafter == PLD

    @property
    def compile(self) -> str | None:
        """The torch.compile mode of the decode steps (None = eager)."""
        return None if self.decode is None else self.decode.compile


def evaluation_settings(values: Mapping[str, Any]) -> EvaluationSettings:
    """evaluate.py's resolved config as plain values -> its settings, refused in one sentence at the first bad one.
    Reads only the drafter's config.json and safetensors headers (`check_drafter`), never a model."""
    drafter = values.get("drafter")
    check_drafter(drafter)
    repeats = values["repeats"]
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats={repeats}: it counts the timed passes over the prompts, so it must be at least 1")
    if values.get("block_size") is not None:
        check_block_size(values["block_size"])  # a drafter's own B is its export's, which the linter checks
    block_size = values.get("block_size") or own_block_size(str(drafter))
    lookup = PromptLookup(**values["pld"])
    if drafter == PLD or values.get("hybrid") is not None:
        lookup.slots(block_size)
    device = resolve_device(values.get("device"))
    wandb = values.get("wandb") or {}
    return EvaluationSettings(
        drafter=str(drafter),
        bench=values["bench"]["name"],
        limit=values["bench"].get("limit"),
        block_size=int(block_size),
        max_new_tokens=int(values["max_new_tokens"]),
        selector=bool(values["selector"]),
        lookup=lookup,
        hybrid=hybrid_rule(values.get("hybrid"), values.get("hybrid_rule") or {}, str(drafter), lookup),
        temperature=float(values["temperature"]),
        top_k=int(values["top_k"]),
        top_p=float(values["top_p"]),
        batch_size=int(values["batch_size"]),
        decode=decode_mode(
            values.get("decode", "plain"), values.get("compile", False), device, values.get("whole_step", True)
        ),  # fmt: skip
        chat_template_kwargs=check_chat_template_kwargs(values.get(KWARGS_KEY), KWARGS_KEY),
        multi_turn=bool(values["multi_turn"]),
        stop_tokens=tuple(values["stop_tokens"]),
        warmup=bool(values["warmup"]),
        baseline=bool(values.get("baseline", False)),
        repeats=repeats,
        kernels=str(values["kernels"]),
        device=device,
        threads=None if values.get("threads") is None else int(values["threads"]),
        seed=int(values["seed"]),
        wandb=WandbSettings(wandb["project"], wandb["mode"]) if wandb.get("enabled") else None,
        config={k: v for k, v in values.items() if k != "wandb"},
    )


def own_block_size(drafter: str) -> int:
    """The block a run decodes at when `block_size` is null: the drafter's own (its config.json), 16 for lookup."""
    if drafter == PLD:
        return PLD_BLOCK_SIZE
    return DFlash2Config.from_pretrained(Path(drafter).expanduser()).block_size


def hybrid_rule(name: Any, values: Mapping[str, Any], drafter: str, lookup: PromptLookup) -> NgramRule | None:
    """`hybrid` and `hybrid_rule` -> the rule by which prompt lookup takes a step's block, or None (the drafter
    alone)."""
    if name is None:
        return None
    if name not in RULES:
        raise ValueError(
            f"hybrid={name}: choose ngram (prompt lookup takes the block where its n-gram match passes hybrid_rule) "
            "or null (the drafter alone)"
        )
    if drafter == PLD:
        raise ValueError(
            f"hybrid={name} pairs prompt lookup with a drafter, and drafter=pld is prompt lookup alone: pass "
            "drafter=<export dir>, or hybrid=null"
        )
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(NgramRule)})
    if unknown:
        raise ValueError(f"hybrid_rule.{unknown[0]}: not a setting of the {name} rule (min_ngram, min_tokens)")
    rule = NgramRule(**values)
    rule.check(lookup)
    return rule
