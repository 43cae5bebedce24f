"""Regeneration: the target answers the training data's prompts, conversation by conversation, in pooled calls."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash2.data.chat import load_conversations
from dflash2.data.regenerate import completed_ids, regenerate
from dflash2.target.model import TargetModel
from dflash2.testing import tiny_target, tiny_target_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return tiny_target(target_layer_ids=[0, 1, 2, 3])


def write_sharegpt(path: Path) -> None:
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "system", "value": "Be brief."},
                {"from": "human", "value": "Name a colour."},
                {"from": "gpt", "value": "OLD1"},
                {"from": "human", "value": "Another one?"},
                {"from": "gpt", "value": "OLD2"},
            ],
        },
        {"id": "b", "conversations": [{"from": "human", "value": "Count to three."}, {"from": "gpt", "value": "OLD3"}]},
    ]
    path.write_text(json.dumps(records))


def test_regenerate_writes_and_resumes(tiny, tmp_path, caplog):
    write_sharegpt(tmp_path / "chats.json")
    out = tmp_path / "regen.jsonl"
    prompts = []
    original = tiny.model.generate

    def spy(**kwargs):
        prompts.extend(tiny.tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=False))
        return original(**kwargs)

    tiny.model.generate = spy
    try:
        run = lambda: regenerate(
            tiny,
            load_conversations(str(tmp_path / "chats.json")),
            out,
            batch_size=2,
            max_new_tokens=4,
            regenerated_by="tiny",
        )
        with caplog.at_level(logging.INFO, logger="dflash2.progress"):
            assert run() == 2
        assert "regenerate: 2/2 conversations" in caplog.text  # off a terminal the progress is logged
        records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert [m["role"] for m in records["a"]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        replies = [m["content"] for m in records["a"]["messages"] if m["role"] == "assistant"]
        assert "OLD" not in "".join(replies) and all(replies)
        # Turn 2 is generated after the regenerated turn 1, never after the original reply.
        second = [p for p in prompts if "Another one?" in p]
        assert len(prompts) == 3 and len(second) == 1 and replies[0] in second[0] and "OLD1" not in second[0]
        reread = load_conversations(str(out))  # the training data reader takes the output as it is
        assert sorted(reread["id"]) == ["a", "b"] and set(reread["regenerated_by"]) == {"tiny"}
        before = out.read_text()
        assert run() == 0 and out.read_text() == before and len(prompts) == 3  # nothing redone
        # A kill mid-write leaves a torn last line: it is cut off and only that conversation is redone.
        out.write_text(before.splitlines(keepends=True)[0] + '{"id": "b", "mess')
        assert completed_ids(out) == {json.loads(before.splitlines()[0])["id"]}
        assert run() == 1 and len(out.read_text().splitlines()) == 2
    finally:
        tiny.model.generate = original


def test_static_cache_generates_the_same_replies(tiny):
    from dflash2.data.regenerate import generate

    lengths = random.sample(range(3, 12), 3)  # left padding, ragged
    prompts = [torch.randint(4, tiny.vocab_size, (n,)).tolist() for n in lengths]
    dynamic = generate(tiny, prompts, max_new_tokens=6, temperature=0.0)
    caches, original = [], tiny.model.generate

    def spy(**kwargs):
        config = kwargs["generation_config"]
        caches.append((config.cache_implementation, config.max_cache_len))
        return original(**kwargs)

    tiny.model.generate = spy
    try:
        static = generate(tiny, prompts, max_new_tokens=6, temperature=0.0, cache_implementation="static")
        pinned = generate(tiny, prompts, 6, 0.0, cache_implementation="static", max_cache_len=64)
    finally:
        tiny.model.generate = original
    assert caches == [("static", None), ("static", 64)] and static == dynamic == pinned


def test_regenerate_config_on_tiny(tmp_path):
    from hydra import compose, initialize_config_dir

    from dflash2.commands.regenerate import run

    write_sharegpt(tmp_path / "chats.json")
    overrides = ["model=tiny", f"model.path={tiny_target_path()}", f"input={tmp_path / 'chats.json'}"]
    overrides += ["max_new_tokens=3", "limit=1"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("regenerate", overrides=overrides)
    assert cfg.output == "data/regenerated/tiny.jsonl" and cfg.model.mask_token_id == 3
    cfg.output = str(tmp_path / "out.jsonl")
    assert run(cfg) == 1
    assert [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()] == ["a"]


def test_regenerate_shards_split_the_input(tmp_path):
    from hydra import compose, initialize_config_dir

    from dflash2.commands.regenerate import run

    write_sharegpt(tmp_path / "chats.json")
    ids = []
    for index in range(2):
        overrides = ["model=tiny", f"model.path={tiny_target_path()}", f"input={tmp_path / 'chats.json'}"]
        overrides += ["max_new_tokens=2", "num_shards=2"]
        overrides += [f"shard_index={index}", f"output={tmp_path / f'out.{index}.jsonl'}"]
        with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
            run(compose("regenerate", overrides=overrides))
        ids.append([json.loads(line)["id"] for line in (tmp_path / f"out.{index}.jsonl").read_text().splitlines()])
    assert ids[0] and ids[1] and sorted(ids[0] + ids[1]) == ["a", "b"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("regenerate", overrides=["model=tiny", "num_shards=2", "shard_index=2"])
    with pytest.raises(SystemExit, match="shard_index=2"):
        run(cfg)


def test_generate_without_a_pad_token(tiny):
    """Some GGUF tokenizers load without a pad token; batched left-padded generation must still work, unchanged."""
    from dflash2.data.regenerate import generate

    prompts = [torch.randint(4, tiny.vocab_size, (n,)).tolist() for n in random.sample(range(3, 12), 3)]
    expected = generate(tiny, prompts, max_new_tokens=5, temperature=0.0)
    pad = tiny.tokenizer.pad_token
    try:
        tiny.tokenizer.pad_token = None
        assert generate(tiny, prompts, max_new_tokens=5, temperature=0.0) == expected
    finally:
        tiny.tokenizer.pad_token = pad


def test_regenerate_fills_each_call_from_the_pool(tiny, tmp_path):
    """A call takes the oldest waiting turns of any conversations: turn 2 of `a` shares a call with turn 1 of `c`,
    and greedy replies do not depend on that batching (batch 1 writes the same conversations)."""
    write_sharegpt(tmp_path / "chats.json")
    records = json.loads((tmp_path / "chats.json").read_text())
    records.append({"id": "c", "conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "O"}]})
    (tmp_path / "chats.json").write_text(json.dumps(records))
    calls, original = [], tiny.model.generate

    def spy(**kwargs):
        calls.append(tiny.tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=True))
        return original(**kwargs)

    outputs = {}
    tiny.model.generate = spy
    try:
        for batch_size in (2, 1):
            calls.clear()
            out = tmp_path / f"regen-{batch_size}.jsonl"
            conversations = load_conversations(str(tmp_path / "chats.json"))
            kwargs = dict(batch_size=batch_size, max_new_tokens=5, shortest_first=False)  # the input's order
            assert regenerate(tiny, conversations, out, **kwargs) == 3
            outputs[batch_size] = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
            if batch_size == 2:
                pooled = calls[:]
    finally:
        tiny.model.generate = original
    assert len(pooled) == 2 and len(calls) == 4  # turn by turn, batch 2 would take 3 calls
    assert "Another one?" in pooled[1][0] and "Say hi." in pooled[1][1]
    assert outputs[2] == outputs[1] and len(outputs[2]["a"]) == 5


def test_shortest_first_sizes_each_calls_static_cache_and_writes_the_same_replies(tiny, tmp_path):
    """Shortest first, each call's static cache is the next multiple of CACHE_STEP above its longest prompt plus
    reply (at most max_length), and greedy replies are those of the input's order."""
    from dflash2.data.regenerate import CACHE_STEP, cache_length

    rng = random.Random()
    # Words per prompt: the two shortest (the first call, batch 2) fit a cache of 1,024, the longest needs 2,048.
    words = [rng.randint(1, 900), rng.randint(1, 900), rng.randint(1200, 1800)] + rng.sample(range(1, 1800), 3)
    rng.shuffle(words)  # the input's order is random
    text = lambda n: " ".join(rng.choice(["apple", "river", "stone", "cloud"]) for _ in range(n))
    records = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": text(n)}, {"from": "gpt", "value": "OLD"}]}
        for i, n in enumerate(words)
    ]
    (tmp_path / "chats.json").write_text(json.dumps(records))
    calls, original = [], tiny.model.generate

    def spy(**kwargs):
        longest = int(kwargs["attention_mask"].sum(-1).max())  # the call's longest prompt, before its left padding
        calls.append((longest, kwargs["input_ids"].shape[1], kwargs["generation_config"].max_cache_len))
        return original(**kwargs)

    outputs = {}
    tiny.model.generate = spy
    try:
        for shortest_first in (True, False):
            calls.clear()
            out = tmp_path / f"regen-{shortest_first}.jsonl"
            conversations = load_conversations(str(tmp_path / "chats.json"))
            kwargs = dict(batch_size=2, max_new_tokens=3, max_length=2 * CACHE_STEP, cache_implementation="static")
            assert regenerate(tiny, conversations, out, shortest_first=shortest_first, **kwargs) == 6
            lines = [json.loads(line) for line in out.read_text().splitlines()]
            outputs[shortest_first] = {r["id"]: r["messages"] for r in lines}
            if shortest_first:
                assert [r["id"] for r in lines] == [f"c{i}" for i in sorted(range(6), key=words.__getitem__)]
                longest = [n for n, _, _ in calls]
                assert longest == sorted(longest)  # the prompts come shortest first, so their calls do too
                # Both sizes are used: the first call is of the two shortest prompts, the last holds the longest.
                assert {cache for _, _, cache in calls} == {CACHE_STEP, 2 * CACHE_STEP}
            for n, width, cache in calls:
                assert cache == cache_length(n + 3, 2 * CACHE_STEP) == min(2, -(-(n + 3) // CACHE_STEP)) * CACHE_STEP
                assert width == cache - 3  # padded to the cache's prompt width: one compiled shape per cache size
    finally:
        tiny.model.generate = original
    assert outputs[True] == outputs[False]


def test_regenerate_marks_replies_cut_by_max_new_tokens(tiny, tmp_path, monkeypatch):
    """A reply that reaches max_new_tokens without an end token is written `truncated`, and training then leaves
    the end-of-turn token the template closes it with untrained; a reply the target ended keeps it trained."""
    from dflash2.data.chat import render

    records = [
        {"id": i, "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "OLD"}]}
        for i, q in (("c0", "Say hi."), ("c1", "Count to three."))
    ]
    (tmp_path / "chats.json").write_text(json.dumps(records))
    conversations = load_conversations(str(tmp_path / "chats.json"))
    generated, original = [], tiny.model.generate

    def spy(**kwargs):
        out = original(**kwargs)
        generated.append(out[:, kwargs["input_ids"].shape[1] :].tolist())
        return out

    def regenerated(name):
        regenerate(tiny, conversations, tmp_path / name, batch_size=2, max_new_tokens=4)
        return {r["id"]: r["messages"][-1] for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    monkeypatch.setattr(tiny.model, "generate", spy)
    first = regenerated("cut.jsonl")  # the random target ends no reply within 4 tokens
    (c0, c1) = generated[0]  # one call, the conversations in order
    assert first["c0"]["truncated"] is True and first["c1"]["truncated"] is True
    # Make c0's second token an end token: the target now ends c0's reply there (transformers' own stopping).
    assert c0[1] not in c1 and c0[1] not in c0[:1]
    monkeypatch.setattr(tiny.model.generation_config, "eos_token_id", c0[1])
    replies = regenerated("ended.jsonl")
    assert "truncated" not in replies["c0"] and replies["c1"]["truncated"] is True
    assert generated[1][0][:2] == c0[:2] and generated[1][1] == c1

    end_of_turn = tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")
    data = load_conversations(str(tmp_path / "ended.jsonl"))
    for rid, messages in zip(data["id"], data["messages"], strict=True):
        row = render(messages, tiny.tokenizer, 512)
        closing = max(i for i, t in enumerate(row["input_ids"]) if t == end_of_turn)  # after the last reply
        assert row["loss_mask"][closing - 1] == 1  # the reply's own last token is trained either way
        assert row["loss_mask"][closing] == (rid == "c0")


@pytest.mark.slow
def test_the_recipe_command_writes_prompts_and_both_answer_files_and_resumes(tmp_path):
    """`python -m dflash2.commands.recipe` on the tiny target: the prompts file, then the chats' and the prompts'
    replies by one target load, each output what `regenerate` writes; a rerun rewrites the prompts unchanged and adds
    nothing. Two outputs on one file, a missing input or an unknown source are refused, by the name typed, before
    anything is written."""
    write_sharegpt(tmp_path / "chats.json")
    files = {k: tmp_path / f"{k}.jsonl" for k in ("prompts", "output", "extra")}
    cmd = [sys.executable, "-m", "dflash2.commands.recipe", "model=tiny", f"model.path={tiny_target_path()}"]
    cmd += [f"input={tmp_path / 'chats.json'}", "max_new_tokens=3", "prompts.sources=[math]", "prompts.limit.math=3"]
    cmd += [f"prompts.output={files['prompts']}", f"output={files['output']}", f"extra_output={files['extra']}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def recipe(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cmd, *extra], cwd=tmp_path, env=env, capture_output=True, text=True)

    proc = recipe()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    prompts = [json.loads(line) for line in files["prompts"].read_text().splitlines()]
    assert len(prompts) == 3 and all(p["id"].startswith("math/") for p in prompts)
    chats = [json.loads(line) for line in files["output"].read_text().splitlines()]
    extra = [json.loads(line) for line in files["extra"].read_text().splitlines()]
    assert sorted(c["id"] for c in chats) == ["a", "b"]
    assert sorted(c["id"] for c in extra) == sorted(p["id"] for p in prompts)
    for record in chats + extra:
        assert record["regenerated_by"] == "tiny" and record["messages"][-1]["role"] == "assistant"
    for record in extra:  # the prompt as written, the reply the target's
        prompt = next(p for p in prompts if p["id"] == record["id"])
        assert record["messages"][0] == {k: prompt["messages"][0][k] for k in ("role", "content")}
        assert record["messages"][1]["content"] != prompt["messages"][1]["content"]
    assert "wrote 2 conversations to" in proc.stdout and "wrote 3 conversations to" in proc.stdout
    assert not (tmp_path / "outputs").exists()  # a file tool: no Hydra run folder

    before = {k: f.read_bytes() for k, f in files.items()}
    proc = recipe()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("wrote 0 conversations to") == 2
    assert {k: f.read_bytes() for k, f in files.items()} == before

    for bad, message in (
        (f"extra_output={files['output']}", "output and extra_output are both"),
        (f"input={tmp_path / 'missing.json'}", "input="),
        ("prompts.sources=[mathh]", "prompts.sources=['mathh']: choose from"),
    ):
        for f in files.values():
            f.unlink(missing_ok=True)
        proc = recipe(bad)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout, proc.stderr
        assert "Traceback" not in proc.stderr and not any(f.exists() for f in files.values())


def test_the_recipe_command_writes_what_the_qwen3_experiment_trains_on():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        recipe = compose("recipe", overrides=["model=qwen3"])
        train = compose("train", overrides=["experiment=qwen3"])
        sources = compose("sources")
    assert recipe.output == train.data.path
    assert [recipe.extra_output] == list(train.data.extra_paths)
    assert recipe.input is None and recipe.chat_template_kwargs == {"enable_thinking": False}
    assert recipe.prompts == sources  # the recipe's prompts are `python -m dflash2.commands.sources`' own default
