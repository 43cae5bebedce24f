"""The one renderer: a chat into text by the target's chat template, with the drafter's `chat_template_kwargs`.

Regeneration renders the prompts the target answers, training renders the conversations the drafter learns from,
evaluation renders the prompts it decodes (and the target renders its probe chat): all through `render_chat`, with
the same arguments, so the text a drafter is trained on begins with the prompt text its replies were generated
under and with the prompt text it is measured on. The arguments (for Qwen3, `{enable_thinking: false}`) travel with
the data: a regenerated record carries them under `KWARGS_KEY`, the training checkpoint and the export's manifest
record the ones training rendered with, and evaluation renders with the drafter's (contract section 7).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

KWARGS_KEY = "chat_template_kwargs"  # in a regenerated record, in a drafter's manifest, in the configs
# Arguments of `apply_chat_template` itself: as template variables they would change what it does instead.
RESERVED = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip


def check_chat_template_kwargs(value: Any, setting: str) -> dict[str, Any] | None:
    """`value` as a plain dict (None stays None: "not set"), or a ValueError naming `setting` as the user types it and
    the fix. The values must be JSON (they are recorded in data files and manifests) and no key may be one of
    `apply_chat_template`'s own arguments."""
    if value is None:
        return None
    example = "e.g. {enable_thinking: false} for Qwen3, {} for none"
    if not isinstance(value, Mapping):
        raise ValueError(f"{setting}={value!r}: the chat template's extra arguments are a mapping ({example})")
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ValueError(f"{setting}: keys {bad} are not names a chat template can read ({example})")
    reserved = sorted(set(value) & RESERVED)
    if reserved:
        raise ValueError(
            f"{setting}: {reserved} are arguments of apply_chat_template itself, not variables of the template; "
            "drop them"
        )
    try:
        plain = json.loads(json.dumps(dict(value), default=_container))
    except (TypeError, ValueError):
        raise ValueError(f"{setting}={dict(value)!r}: the values must be plain data (strings, numbers, booleans, "
                         "lists, mappings)") from None  # fmt: skip
    return plain


def _container(value: Any) -> Any:
    """A mapping or a list of any kind (a config node's too) as JSON writes it; anything else is not plain data."""
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not plain data")


def format_kwargs(kwargs: Mapping[str, Any] | None) -> str:
    """As a user types it in a Hydra override or a YAML file: `{enable_thinking: false}`, `{}`, `null`."""
    if kwargs is None:
        return "null"
    return "{" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in kwargs.items()) + "}"


def same_kwargs(a: Mapping[str, Any] | None, b: Mapping[str, Any] | None) -> bool:
    """Whether two settings render alike (None and {} both mean no extra arguments)."""
    return json.dumps(dict(a or {}), sort_keys=True) == json.dumps(dict(b or {}), sort_keys=True)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """`messages` rendered by the tokenizer's chat template: ready for the assistant's reply (`generation_prompt`,
    what regeneration and evaluation feed the target) or as a whole conversation (what training tokenizes)."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **dict(chat_template_kwargs or {})
    )


def one_setting(found: list[tuple[str, dict[str, Any]]], what: str, fix: str) -> dict[str, Any] | None:
    """The one `chat_template_kwargs` that all of `found` ((label, the arguments it was regenerated with) pairs)
    shares; None when `found` is empty. Data regenerated under two settings is refused, naming each: training renders
    it one way, so one part would be trained on text it was not generated under."""
    if len({format_kwargs(k) for _, k in found}) > 1:
        listed = "; ".join(f"{label}: {format_kwargs(k)}" for label, k in found)
        raise ValueError(f"{what} regenerated with different {KWARGS_KEY} ({listed}): {fix}")
    return found[0][1] if found else None
