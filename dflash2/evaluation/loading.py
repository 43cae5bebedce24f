"""What an evaluation run loads, once: the target, the drafter (or prompt lookup) checked against it, and how the
prompts are rendered and stopped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash2.decoding.drafting import Drafter
from dflash2.decoding.hybrid import Hybrid
from dflash2.decoding.lookup import PromptLookup
from dflash2.decoding.proposer import Proposer
from dflash2.evaluation.settings import EvaluationSettings
from dflash2.model.config import DFlash2Config
from dflash2.model.drafter import DFlash2DraftModel
from dflash2.target.chat_template import KWARGS_KEY, format_kwargs, render_chat, same_kwargs
from dflash2.target.manifest import (
    MANIFEST_KEY,
    check_manifest,
    manifest_chat_template_kwargs,
    manifest_metric,
    target_identity,
)

log = logging.getLogger(__name__)

# The `model` group's target capturing the features of the given layers: how a command builds its target (a sweep's
# runs share one).
TargetLoader = Callable[[list[int]], Any]


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A run's target and what proposes: the drafter (None with prompt lookup alone), the target's identity, and
    whether the drafter's candidate selector proposes."""

    target: Any
    draft: DFlash2DraftModel | None
    identity: dict[str, Any]
    use_selector: bool

    def proposer(self, settings: EvaluationSettings) -> Proposer:
        """What proposes: the drafter (its selector on or off), prompt lookup, or both (`settings.hybrid`), the
        drafter's steps compiled as the run's decode steps are."""
        if self.draft is None:
            return settings.lookup
        drafter = Drafter(self.target, self.draft, self.use_selector, settings.compile)
        return drafter if settings.hybrid is None else Hybrid(drafter, settings.lookup, settings.hybrid)


def load(settings: EvaluationSettings, load_target: TargetLoader) -> Loaded:
    """The run's target and drafter (none with drafter=pld), refused when the drafter was trained for another
    target. The drafter folder passed `export.py check` when the settings were built."""
    if settings.is_lookup:
        target = load_target([])  # no features to capture, no manifest to check
        return Loaded(target, None, target_identity(target.name, target.config, target.tokenizer), False)
    draft_dir = Path(settings.drafter).expanduser()
    saved = DFlash2Config.from_pretrained(draft_dir)
    # The drafter decides which target layers it reads, whatever the model group suggests for training.
    target = load_target(list(saved.target_layer_ids))
    identity = target_identity(target.name, target.config, target.tokenizer)
    check_manifest(saved.extra.get(MANIFEST_KEY), identity)
    if saved.hidden_size != target.hidden_size or saved.vocab_size > target.vocab_size:
        raise ValueError(
            f"{draft_dir}: drafter hidden_size/vocab_size {saved.hidden_size}/{saved.vocab_size} do not "
            f"fit target {target.name!r} ({target.hidden_size}/{target.vocab_size})"
        )
    draft = DFlash2DraftModel.from_pretrained(draft_dir, dtype=target.lm_head_weight.dtype, device=settings.device)
    use_selector = settings.selector and draft.candidate_selector is not None
    if settings.selector and draft.candidate_selector is None:
        log.info("the drafter has no candidate selector (plain DFlash): per-slot argmax / sampling")
    return Loaded(target, draft.eval(), identity, use_selector)


def describe_draft(settings: EvaluationSettings, loaded: Loaded) -> dict[str, Any]:
    """The `draft` entry of results.json: what proposed, with the settings that shape its proposals."""
    if loaded.draft is None:
        lookup: PromptLookup = settings.lookup
        return {
            "path": None,
            "name": settings.drafter,
            "architecture": "PromptLookup",
            "selector": None,
            "conv": None,
            "trained_block_size": None,
            "manifest": None,
            "pld": lookup.settings(settings.block_size),
        }
    config = loaded.draft.config
    described = {
        "path": str(Path(settings.drafter).expanduser().resolve()),
        "name": Path(settings.drafter).name,
        "architecture": config.to_dict()["architectures"][0],
        "selector": loaded.use_selector,
        "conv": config.use_conv,
        "trained_block_size": config.block_size,
        "manifest": config.extra.get(MANIFEST_KEY),
    }
    if settings.hybrid is not None:  # with prompt lookup beside it: its settings and the rule
        described["hybrid"] = dataclasses.asdict(settings.hybrid) | {
            "pld": settings.lookup.settings(settings.block_size)
        }
    return described


def read_tau_sim(manifest: dict[str, Any] | None, name: str = "tau_sim") -> float | None:
    """The drafter's teacher-forced `tau_sim` as its export recorded it in config.json (`dflash2_manifest.metrics`),
    None when it did not. `name="tau_sim_top1"`: a DFlash2 drafter's argmax path, the one `selector=false` decodes."""
    return manifest_metric(manifest, name)


def render(
    tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """A conversation rendered with the target's chat template and `chat_template_kwargs`, ready for the assistant's
    reply: the text training rendered the drafter's data with begins the same way (`dflash2.target.chat_template`)."""
    if getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, messages, generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    log.warning("the target's tokenizer has no chat template: prompts are the plain user turns")
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def prompt_chat_template_kwargs(settings: EvaluationSettings, loaded: Loaded) -> dict[str, Any]:
    """The chat template's extra arguments the prompts are rendered with: `chat_template_kwargs` when set, else the
    drafter's (its training's, recorded in its manifest), else none for a drafter that does not record them; for
    prompt lookup, which was never trained, the target's (`model.chat_template_kwargs`)."""
    asked = settings.chat_template_kwargs
    if loaded.draft is None:
        return asked if asked is not None else dict(getattr(loaded.target, KWARGS_KEY, None) or {})
    trained = manifest_chat_template_kwargs(loaded.draft.config.extra.get(MANIFEST_KEY))
    if asked is None:
        if trained is None:
            log.info(
                "the drafter does not record the %s its training rendered with (exported before they were "
                "recorded): rendering the prompts with none, {}, as training did then",
                KWARGS_KEY,
            )
        return trained or {}
    if trained is not None and not same_kwargs(asked, trained):
        log.warning(
            "rendering the prompts with %s=%s, but the drafter was trained on chats rendered with %s: it is measured "
            "on text it was not trained on (%s=null renders as it was trained)",
            KWARGS_KEY,
            format_kwargs(asked),
            format_kwargs(trained),
            KWARGS_KEY,
        )
    return asked


def stop_token_ids(target: Any, extra_tokens: tuple[str, ...] | list[str]) -> list[int]:
    """The target's eos ids, plus chat end tokens named in the config."""
    vocab = target.tokenizer.get_vocab()
    return sorted({*target.eos_token_ids, *(vocab[t] for t in extra_tokens if t in vocab)})
