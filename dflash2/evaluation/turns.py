"""Decoding a bench's prompts turn by turn, as one timed pass: later turns see the earlier answers, each request
becomes a sample record of samples.jsonl."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dflash2.decoding.proposer import Proposer
from dflash2.decoding.speculative import Generation, OnCommit, Sampling
from dflash2.decoding.static import FastDecode, decoders
from dflash2.evaluation.loading import render
from dflash2.evaluation.timing import clock, graphs_compiled, warn_compiles_in_pass
from dflash2.progress import DecodeProgress

WARMUP_TOKENS = 16  # what the untimed warm-up decodes of one prompt


@dataclasses.dataclass(frozen=True)
class Decoder:
    """How a pass decodes a list of prompts: speculatively with `proposer` (a drafter, prompt lookup, or both), or
    the target alone (`proposer` None), on the plain loops or the fast path (`fast`)."""

    target: Any
    proposer: Proposer | None
    sampling: Sampling
    max_new_tokens: int
    block_size: int
    fast: FastDecode | None = None

    def __call__(
        self, prompt_ids: list[list[int]], generator: torch.Generator, on_commit: OnCommit | None = None
    ) -> list[Generation]:
        speculative, alone = decoders(self.fast)
        if self.proposer is None:
            return alone(self.target, prompt_ids, self.max_new_tokens, self.sampling, generator, on_commit)
        return speculative(
            self.target, self.proposer, prompt_ids, self.block_size, self.max_new_tokens, self.sampling, generator,
            on_commit,
        )  # fmt: skip

    def alone(self) -> Decoder:
        """The target alone, decoding as this one does: the baseline."""
        return dataclasses.replace(self, proposer=None)


def generate_turns(
    decoder: Decoder,
    prompts: list[dict],
    multi_turn: bool,
    chat_template_kwargs: dict[str, Any] | None,
    generator: torch.Generator,
    warmup: bool = True,
) -> tuple[list[dict], float]:
    """Decode every turn of every prompt (later turns see the earlier answers) -> (sample records, seconds); the
    prompts are rendered with `chat_template_kwargs` (`loading.prompt_chat_template_kwargs`).

    `warmup` first decodes a few tokens of one prompt, untimed, so that one-off costs (CUDA context, Triton
    compilation, allocator growth) stay out of tokens/s."""
    tokenizer = decoder.target.tokenizer
    conversations = [[] for _ in prompts]
    samples, seconds = [], 0.0
    n_turns = max(len(p["turns"]) for p in prompts) if multi_turn else 1
    what = "decode" if decoder.proposer is not None else "target alone"
    if warmup:  # before the progress bar too, whose tokens/s then counts what the timed passes count
        first = render(tokenizer, [{"role": "user", "content": prompts[0]["turns"][0]}], chat_template_kwargs)
        spare = torch.Generator(generator.device).manual_seed(0)
        dataclasses.replace(decoder, max_new_tokens=WARMUP_TOKENS)([first], spare)
    progress = DecodeProgress(sum(min(len(p["turns"]), n_turns) for p in prompts), what)
    compiled = graphs_compiled()
    for turn in range(n_turns):
        todo = [i for i, p in enumerate(prompts) if turn < len(p["turns"])]
        for i in todo:
            conversations[i].append({"role": "user", "content": prompts[i]["turns"][turn]})
        prompt_ids = [render(tokenizer, conversations[i], chat_template_kwargs) for i in todo]
        start = clock(decoder.target)
        outputs = decoder(prompt_ids, generator, progress)
        seconds += clock(decoder.target) - start
        for i, ids, out in zip(todo, prompt_ids, outputs, strict=True):
            answer = tokenizer.decode(out.output_ids, skip_special_tokens=True)
            conversations[i].append({"role": "assistant", "content": answer})
            samples.append(sample_record(prompts[i]["id"], turn, ids, out))
    progress.close()
    warn_compiles_in_pass(compiled, what)
    return samples, seconds


def sample_record(prompt_id: str, turn: int, prompt_ids: list[int], out: Generation) -> dict[str, Any]:
    """One request's record: its line of samples.jsonl (`proposers` only where a run combines proposers), and its
    margins where they were recorded."""
    record = {
        "id": prompt_id,
        "turn": turn,
        "prompt_ids": prompt_ids,
        "output_ids": out.output_ids,
        "accept_lengths": out.accept_lengths,
    }
    if out.proposers:
        record["proposers"] = out.proposers
    if out.margins:  # for the divergence report, not written to samples.jsonl
        record["margins"] = out.margins
    return record
