"""Regenerate the assistant turns of chat conversations with the frozen target (contract section 7).

    python -m dflash2.data.regenerate [model=smollm2|tiny|qwen3] [input=FILE] [output=FILE] [limit=N] ...

Each assistant turn is re-generated given the conversation so far, earlier turns already regenerated,
so the drafter learns the target's own distribution. Conversations are written to a JSONL file
(`{"id", "messages"}`) one chunk at a time; a rerun skips the ids already there, so an interrupted
run resumes where it stopped. Conversations whose first prompt does not fit in `max_length` (or that
have no assistant turn) are recorded in `<output>.skipped` so they are not retried either.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm
from transformers import GenerationConfig

from dflash2.data.chat import load_conversations
from dflash2.target import TargetModel, TargetNotFoundError


def completed_ids(output: Path) -> set[str]:
    """Ids already written (JSONL and .skipped); a torn last line from a killed run is cut off first."""
    done: set[str] = set()
    if output.exists():
        data = output.read_bytes()
        if data and not data.endswith(b"\n"):
            with output.open("r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
            data = data[: data.rfind(b"\n") + 1]
        done |= {json.loads(line)["id"] for line in data.splitlines() if line.strip()}
    skipped = output.with_name(output.name + ".skipped")
    if skipped.exists():
        done |= {line for line in skipped.read_text().splitlines() if line}
    return done


def regenerate(
    target: TargetModel,
    conversations: Iterable[dict[str, Any]],
    output: str | Path,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    max_length: int = 3072,
    chunk_size: int = 64,
    chat_template_kwargs: dict[str, Any] | None = None,
    regenerated_by: str = "target",
    cache_implementation: str | None = None,
    continuous_batching: bool = False,
) -> int:
    """Regenerate and append every conversation not in `output` yet; returns how many were written."""
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    done = completed_ids(output)
    todo = [c for c in conversations if c["id"] not in done]
    written = 0
    with (
        output.open("a") as out,
        output.with_name(output.name + ".skipped").open("a") as skip,
        tqdm(total=len(todo), desc="regenerate", unit="conv") as bar,
    ):
        for start in range(0, len(todo), chunk_size):
            chunk = todo[start : start + chunk_size]
            results = regenerate_chunk(
                target,
                chunk,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                max_length=max_length,
                chat_template_kwargs=chat_template_kwargs or {},
                cache_implementation=cache_implementation,
                continuous_batching=continuous_batching,
            )
            # One write + fsync per chunk: a kill leaves at most one torn line, which the next run cuts off.
            kept = [r | {"regenerated_by": regenerated_by} for r in results if r["messages"]]
            out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
            skip.write("".join(r["id"] + "\n" for r in results if not r["messages"]))
            for f in (out, skip):
                f.flush()
                os.fsync(f.fileno())
            written += len(kept)
            bar.update(len(chunk))
    return written


class Dialogues:
    """Walks the conversations of a chunk: the prompt of each one's next assistant turn, then its new reply."""

    def __init__(
        self,
        conversations: list[dict[str, Any]],
        tokenizer: Any,
        *,
        max_new_tokens: int,
        max_length: int,
        chat_template_kwargs: dict[str, Any],
    ) -> None:
        self.conversations, self.tokenizer = conversations, tokenizer
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        self.chat_template_kwargs = chat_template_kwargs
        self.new: list[list[dict[str, str]]] = [[] for _ in conversations]
        self.cursor = [0] * len(conversations)

    def next_prompt(self, i: int) -> list[int] | None:
        """Token ids of conversation i's next reply prompt (its regenerated turns so far); None once it is done."""
        messages = self.conversations[i]["messages"]
        while self.cursor[i] < len(messages) and messages[self.cursor[i]]["role"] != "assistant":
            self.new[i].append(dict(messages[self.cursor[i]]))
            self.cursor[i] += 1
        if self.cursor[i] == len(messages) or not self.new[i]:  # finished, or a reply with nothing before it
            self.cursor[i] = len(messages)
            return None
        text = self.tokenizer.apply_chat_template(
            self.new[i], tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) + self.max_new_tokens > self.max_length:
            self.cursor[i] = len(messages)  # this turn does not fit: keep the turns before it
            return None
        return ids

    def reply(self, i: int, text: str) -> None:
        self.new[i].append({"role": "assistant", "content": text})
        self.cursor[i] += 1

    def results(self) -> list[dict[str, Any]]:
        results = []
        for conv, messages in zip(self.conversations, self.new, strict=True):
            while messages and messages[-1]["role"] != "assistant":  # a trailing prompt without its reply
                messages.pop()
            results.append({"id": conv["id"], "messages": messages})
        return results


def regenerate_chunk(
    target: TargetModel,
    conversations: list[dict[str, Any]],
    *,
    batch_size: int,
    max_new_tokens: int,
    temperature: float,
    max_length: int,
    chat_template_kwargs: dict[str, Any],
    cache_implementation: str | None = None,
    continuous_batching: bool = False,
) -> list[dict[str, Any]]:
    """Every assistant turn of the chunk, each after the turns regenerated before it."""
    dialogues = Dialogues(
        conversations,
        target.tokenizer,
        max_new_tokens=max_new_tokens,
        max_length=max_length,
        chat_template_kwargs=chat_template_kwargs,
    )
    if continuous_batching:
        _continuous(target, dialogues, max_new_tokens, temperature)
        return dialogues.results()
    # Turn by turn across the chunk: every conversation's k-th reply is generated in the same batches.
    prompts = {i: ids for i in range(len(conversations)) if (ids := dialogues.next_prompt(i)) is not None}
    while prompts:
        order = sorted(prompts, key=lambda i: len(prompts[i]))  # similar lengths share a batch: less left padding
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            replies = generate(
                target, [prompts[i] for i in batch], max_new_tokens, temperature, cache_implementation, max_length
            )
            for i, reply in zip(batch, replies, strict=True):
                dialogues.reply(i, reply)
        prompts = {i: ids for i in prompts if (ids := dialogues.next_prompt(i)) is not None}
    return dialogues.results()


@torch.no_grad()
def _continuous(target: TargetModel, dialogues: Dialogues, max_new_tokens: int, temperature: float) -> None:
    """transformers' continuous batching (paged KV cache; CUDA graphs on a GPU): a conversation's next turn is
    queued the moment its previous reply finishes, so no batch waits for its longest reply."""
    if not hasattr(target.model, "continuous_batching_context_manager"):
        raise ValueError(
            "continuous_batching=true needs transformers' continuous batching (tested with 5.17 and 5.24): upgrade "
            "transformers or set continuous_batching=false"
        )
    tokenizer = target.tokenizer
    config = generation_config(target, max_new_tokens, temperature)
    with target.model.continuous_batching_context_manager(generation_config=config) as manager:

        def submit(i: int) -> bool:
            ids = dialogues.next_prompt(i)
            if ids is not None:  # the id names the turn too: each request id must be new
                manager.add_request(ids, request_id=f"{i}/{len(dialogues.new[i])}", max_new_tokens=max_new_tokens)
            return ids is not None

        live = sum(submit(i) for i in range(len(dialogues.conversations)))
        while live:
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped before all replies were generated")
                continue
            if not out.is_finished():
                continue
            if out.error is not None:
                raise RuntimeError(f"generating reply {out.request_id} (conversation/turn) failed: {out.error}")
            i = int(out.request_id.split("/")[0])
            dialogues.reply(i, tokenizer.decode(out.generated_tokens, skip_special_tokens=True))
            live += submit(i) - 1


def generation_config(target: TargetModel, max_new_tokens: int, temperature: float, **kwargs: Any) -> GenerationConfig:
    """A full config, so a checkpoint's own sampling defaults (Qwen3: top_k 20, top_p 0.95) do not leak in."""
    tokenizer, model = target.tokenizer, target.model
    if tokenizer.pad_token is None:  # some GGUF tokenizers come without one; the left padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    eos = model.generation_config.eos_token_id
    eos = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
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
) -> list[str]:
    """`cache_implementation="static"`: transformers preallocates the KV cache and, on CUDA, compiles the decode
    step into a CUDA graph, which is what makes a small target's batched generation fast. `max_cache_len` sizes
    that cache for the longest call once: otherwise each batch's own length is a new shape and a recompile."""
    config = generation_config(
        target,
        max_new_tokens,
        temperature,
        cache_implementation=cache_implementation,
        max_cache_len=max_cache_len if cache_implementation == "static" else None,
    )
    tokenizer, model = target.tokenizer, target.model
    batch = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(model.device)
    out = model.generate(**batch, generation_config=config)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)


def run(cfg: DictConfig) -> int:
    """The CLI on a composed `configs/regenerate.yaml`; returns how many conversations were written."""
    torch.manual_seed(cfg.seed)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = TargetModel.from_config(cfg.model, device=device)
    except TargetNotFoundError as e:
        raise SystemExit(str(e)) from None  # one sentence, no traceback
    conversations = load_conversations(cfg.input, limit=cfg.limit)  # input null = the packaged ShareGPT
    n = regenerate(
        target,
        conversations,
        cfg.output,
        batch_size=cfg.batch_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        max_length=cfg.max_length,
        chunk_size=cfg.chunk_size,
        chat_template_kwargs=OmegaConf.to_container(cfg.chat_template_kwargs),
        regenerated_by=cfg.model.name,
        cache_implementation=cfg.get("cache_implementation"),
        continuous_batching=cfg.get("continuous_batching", False),
    )
    print(f"regenerate: wrote {n} conversations to {cfg.output} (target {cfg.model.name})")
    return n


@hydra.main(version_base="1.3", config_path="../../configs", config_name="regenerate")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
