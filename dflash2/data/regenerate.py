"""Regenerate the assistant turns of chat conversations with the frozen target (contract section 7).

    python -m dflash2.commands.regenerate [model=smollm2|tiny|qwen3] [input=FILE] [output=FILE] [limit=N] ...

Each assistant turn is re-generated given the conversation so far, earlier turns already regenerated,
so the drafter learns the target's own distribution. The prompts are rendered with `chat_template_kwargs` (by default
the target's, `model.chat_template_kwargs`), which every record written carries: training renders the conversation
with the same ones (`dflash2.target.chat_template`). Each conversation is appended to a JSONL file
(`{"id", "messages", "regenerated_by", "chat_template_kwargs"}`) once its last turn is in; a rerun skips the ids
already there, so an interrupted run resumes where it stopped, redoing only the conversations that were in flight
(and refuses an output regenerated with other `chat_template_kwargs`). Conversations whose first prompt does not fit
in `max_length` (or that have no assistant turn) are recorded in `<output>.skipped` so they are not retried either.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from dflash2.progress import Progress
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, format_kwargs, render_chat, same_kwargs
from dflash2.target.model import TargetModel


def completed_ids(output: Path) -> set[str]:
    """Ids already written (JSONL and .skipped); a torn last line from a killed run is cut off first."""
    done: set[str] = set()
    if output.exists():
        data = output.read_bytes()
        if data and not data.endswith(b"\n"):
            with output.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
            data = data[: data.rfind(b"\n") + 1]
        done |= {json.loads(line)["id"] for line in data.split(b"\n") if line.strip()}
    skipped = output.with_name(output.name + ".skipped")
    if skipped.exists():
        done |= {line for line in skipped.read_text().splitlines() if line}
    return done


def check_output(output: str | Path, chat_template_kwargs: dict[str, Any] | None) -> None:
    """Refuse to resume into `output` when its records were regenerated with other `chat_template_kwargs`: one file
    is trained with one setting. Records without the setting count as regenerated with none."""
    output = Path(output)
    if not output.is_file():
        return
    for number, line in enumerate(output.read_text("utf-8").split("\n"), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # blank, or the torn last line of a killed run (cut off when resuming)
            continue
        recorded = record.get(KWARGS_KEY) or {}
        if not same_kwargs(recorded, chat_template_kwargs):
            raise ValueError(
                f"{output} (line {number}) holds conversations regenerated with "
                f"{KWARGS_KEY}={format_kwargs(recorded)}, and this run renders with "
                f"{KWARGS_KEY}={format_kwargs(chat_template_kwargs or {})}: resume with "
                f"{KWARGS_KEY}={format_kwargs(recorded)}, or write to another output=FILE"
            )


@dataclasses.dataclass(frozen=True)
class Options:
    """How `regenerate` answers (configs/regenerate.yaml documents each)."""

    batch_size: int = 8  # turns per generate call
    max_new_tokens: int = 512
    temperature: float = 0.0
    max_length: int = 3072  # prompt + reply tokens
    chat_template_kwargs: dict[str, Any] | None = None
    regenerated_by: str = "target"  # the target's name, stamped on every record
    cache_implementation: str | None = None
    shortest_first: bool = True


def regenerate(target: TargetModel, conversations: Iterable[dict[str, Any]], output: str | Path, **options: Any) -> int:
    """Regenerate and append every conversation not in `output` yet; returns how many were written.

    Conversations flow through a pool: each `generate` call takes the `batch_size` oldest waiting turns, whatever
    conversation or turn number they belong to, and a conversation's next turn waits again as soon as its reply
    is in. So every call but the last few is full, where a turn-by-turn schedule leaves the late turns of a few
    long conversations in small batches of their own. A conversation is written when its last turn is in.

    With `shortest_first` the conversations enter the pool shortest first (by characters), so a call's prompts are
    of similar length and its static cache (sized to its longest prompt, `cache_length`) is mostly a short one.
    `options`: the fields of `Options`."""
    o = Options(**options)
    batch_size, max_new_tokens, max_length = o.batch_size, o.max_new_tokens, o.max_length
    output = Path(output)
    chat_template_kwargs = check_chat_template_kwargs(o.chat_template_kwargs, KWARGS_KEY) or {}
    check_output(output, chat_template_kwargs)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(output)
    todo = deque(c for c in conversations if c["id"] not in done)
    dialogues = Dialogues(
        target.tokenizer,
        max_new_tokens=max_new_tokens,
        max_length=max_length,
        chat_template_kwargs=chat_template_kwargs,
    )
    written = calls = 0
    if o.shortest_first:
        todo = deque(sorted(todo, key=conversation_chars))
    with (
        output.open("a") as out,
        output.with_name(output.name + ".skipped").open("a") as skip,
        Progress(total=len(todo), desc="regenerate", unit="conversations") as bar,
    ):
        while todo or dialogues.waiting:
            while todo and len(dialogues.waiting) < batch_size:
                dialogues.add(todo.popleft())
            turns = [dialogues.waiting.popleft() for _ in range(min(batch_size, len(dialogues.waiting)))]
            if turns:
                prompts = [ids for _, ids in turns]
                cache_len = cache_length(max(map(len, prompts)) + max_new_tokens, max_length)
                pad_to = cache_len - max_new_tokens
                replies = generate(
                    target, prompts, max_new_tokens, o.temperature, o.cache_implementation, cache_len, pad_to
                )
                for (key, _), (reply, truncated) in zip(turns, replies, strict=True):
                    dialogues.reply(key, reply, truncated)
                calls += 1
            results = dialogues.pop_finished()
            # One write + fsync per call: a kill leaves at most one torn line, which the next run cuts off.
            stamp = {"regenerated_by": o.regenerated_by, KWARGS_KEY: chat_template_kwargs}  # what training checks
            kept = [r | stamp for r in results if r["messages"]]
            out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
            skip.write("".join(r["id"] + "\n" for r in results if not r["messages"]))
            for f in (out, skip):
                f.flush()
                os.fsync(f.fileno())
            written += len(kept)
            bar.set_postfix(calls=calls, refresh=False)
            bar.update(len(results))
    return written


# A static cache is sized per call to the next multiple of this: few sizes (each one a compile), and a call of short
# prompts attends over 1,024 positions, not max_length's 3,072 (the decode step reads the whole cache).
CACHE_STEP = 1024


def cache_length(needed: int, max_length: int) -> int:
    """The static cache's length for a call whose longest prompt plus reply needs `needed` positions."""
    return min(max_length, -(-needed // CACHE_STEP) * CACHE_STEP)


def conversation_chars(conversation: dict[str, Any]) -> int:
    """A conversation's length in characters, the cheap proxy `shortest_first` sorts by (its last prompt holds it
    all, with the replies regenerated in place of the originals)."""
    return sum(len(m["content"]) for m in conversation["messages"])


class Dialogues:
    """The conversations in flight: the prompt of each one's next assistant turn, then its new reply."""

    def __init__(
        self, tokenizer: Any, *, max_new_tokens: int, max_length: int, chat_template_kwargs: dict[str, Any]
    ) -> None:
        self.tokenizer, self.max_new_tokens, self.max_length = tokenizer, max_new_tokens, max_length
        self.chat_template_kwargs = chat_template_kwargs
        self.waiting: deque[tuple[int, list[int]]] = deque()  # (key, prompt ids), oldest first
        self._conversations: dict[int, dict[str, Any]] = {}
        self._new: dict[int, list[dict[str, str]]] = {}
        self._cursor: dict[int, int] = {}
        self._finished: list[int] = []
        self._next_key = 0

    def add(self, conversation: dict[str, Any]) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._conversations[key], self._new[key], self._cursor[key] = conversation, [], 0
        self._queue_next(key)

    def reply(self, key: int, text: str, truncated: bool) -> None:
        """The new reply of `key`'s waiting turn. One cut by max_new_tokens is written with `"truncated": true`:
        the end-of-turn token the chat template closes it with is not what the target said, so it is not trained."""
        self._new[key].append({"role": "assistant", "content": text} | ({"truncated": True} if truncated else {}))
        self._cursor[key] += 1
        self._queue_next(key)

    def pop_finished(self) -> list[dict[str, Any]]:
        """{"id", "messages"} of the conversations whose last turn is in; empty messages: nothing fit."""
        results = []
        for key in self._finished:
            conversation, messages = self._conversations.pop(key), self._new.pop(key)
            del self._cursor[key]
            while messages and messages[-1]["role"] != "assistant":  # a trailing prompt without its reply
                messages.pop()
            results.append({"id": conversation["id"], "messages": messages})
        self._finished = []
        return results

    def _queue_next(self, key: int) -> None:
        """Queue the prompt of the next reply (after the turns regenerated so far), or finish the conversation."""
        messages, new = self._conversations[key]["messages"], self._new[key]
        while self._cursor[key] < len(messages) and messages[self._cursor[key]]["role"] != "assistant":
            # Role and content only: a dataset read from a regenerated file gives every message `truncated`.
            new.append({k: messages[self._cursor[key]][k] for k in ("role", "content")})
            self._cursor[key] += 1
        if self._cursor[key] < len(messages) and new:  # else finished, or a reply with nothing before it
            text = render_chat(
                self.tokenizer, new, generation_prompt=True, chat_template_kwargs=self.chat_template_kwargs
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) + self.max_new_tokens <= self.max_length:  # else keep the turns before this one
                self.waiting.append((key, ids))
                return
        self._finished.append(key)


def generation_config(target: TargetModel, max_new_tokens: int, temperature: float, **kwargs: Any) -> GenerationConfig:
    """A full config, so a checkpoint's own sampling defaults (Qwen3: top_k 20, top_p 0.95) do not leak in."""
    tokenizer = target.tokenizer
    if tokenizer.pad_token is None:  # some GGUF tokenizers come without one; the left padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    eos = target.eos_token_ids
    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_k=0 if sample else None,
        top_p=1.0 if sample else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        **kwargs,
    )


@torch.no_grad()
def generate(
    target: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    cache_implementation: str | None = None,
    max_cache_len: int | None = None,
    pad_to: int | None = None,
) -> list[tuple[str, bool]]:
    """(reply text, cut by max_new_tokens) per prompt; a reply is cut when no end-of-sequence token ended it.

    `cache_implementation="static"`: transformers preallocates the KV cache and, on CUDA, compiles the decode
    step into a CUDA graph, which is what makes a small target's batched generation fast. `max_cache_len` sizes
    that cache; each new size is a new shape and a recompile, so `regenerate` passes one of a few (`cache_length`)."""
    config = generation_config(
        target,
        max_new_tokens,
        temperature,
        cache_implementation=cache_implementation,
        max_cache_len=max_cache_len if cache_implementation == "static" else None,
    )
    tokenizer, model = target.tokenizer, target.model
    # A static cache compiles the decode step for the prompts' padded width too: a call padded to its own longest
    # prompt is a new shape and a recompile (half a minute at B = 512); padded to `pad_to`, a cache size is one shape.
    padding = {"padding": "max_length", "max_length": pad_to} if pad_to and cache_implementation == "static" else {}
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt", **padding)
    batch = batch.to(model.device)
    out = model.generate(**batch, generation_config=config)
    replies = out[:, batch["input_ids"].shape[1] :]
    # A finished row is padded after its end token (the pad may be eos itself); a cut one never met an end token.
    ended = torch.isin(replies, torch.tensor(config.eos_token_id, device=replies.device)).any(-1)
    texts = tokenizer.batch_decode(replies, skip_special_tokens=True)
    return list(zip(texts, (~ended).tolist(), strict=True))


if __name__ == "__main__":  # the command lives in the command layer, which this library module does not import
    raise SystemExit("this is the library: run python -m dflash2.commands.regenerate ... (or dflash2-regenerate ...)")
