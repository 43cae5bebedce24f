"""The GPU benchmark scripts, smoke-tested at --small on the CPU: they run, and their JSON is complete and consistent.

Also the two places where a script departs from or models the production path: the overhead script's static draft
cache (it must compute what the model's own DraftCache computes) and the training FLOP formula (its matmul terms
must equal what torch's FLOP counter sees in a real step).
"""

import gzip
import importlib.util
import json
import math
import random
import statistics
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash2.data.anchors import dense_block_mask
from dflash2.model.drafter import DraftCache

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """A script under benchmarks/ as a module (the folder is not a package)."""
    key = f"benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[key]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny shapes gain nothing from a second intra-op thread, and on a busy 2-core machine every op then waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def finite_positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


# ---------------------------------------------------------------------------------------------- overhead.py
def test_overhead_small_writes_consistent_shares(tmp_path):
    overhead = load("overhead")
    out = tmp_path / "overhead.json"
    result = overhead.main(["--small", "--batch", "1", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["timer"] == "cpu_wall" and [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        pieces = [*overhead.PARTS, *overhead.STEPS]
        assert all(finite_positive(row[f"{p}_ms"]) for p in pieces), row
        assert row["graph"] == {p: False for p in pieces}  # a CPU never pretends to have replayed a graph
        assert row["parts_ms"] == pytest.approx(sum(row[f"{p}_ms"] for p in overhead.PARTS))
        total = row["dflash2_draft_ms"] + row["verify_ms"]
        assert row["draft_verify_ms"] == pytest.approx(total)
        assert row["overhead_share"] == pytest.approx(row["parts_ms"] / total)
        assert row["differential_share"] == pytest.approx((row["dflash2_draft_ms"] - row["dflash_draft_ms"]) / total)


def test_static_draft_cache_computes_what_the_draft_cache_computes():
    overhead = load("overhead")
    s, dtype, device = overhead.SMALL, torch.float32, torch.device("cpu")
    torch.manual_seed(0)
    target = overhead.VerifyDecoder(s, [1, 3], device, dtype)
    draft = overhead.build_drafter(s, True, device, dtype)
    x = overhead.draft_inputs(s, target, batch=3, context=24)
    # decode_batch's way: a DraftCache holding the earlier context, which update() extends by this step's B tokens,
    # and the dense mask (here all True: no rejected slots).
    cache = DraftCache(s.draft_layers)
    cache.keys = [k[:, :, : -s.block_size].clone() for k in x.cache.keys]
    cache.values = [v[:, :, : -s.block_size].clone() for v in x.cache.values]
    mask = torch.ones(3, 1, s.block_size, 24 + s.block_size, dtype=torch.bool)
    with torch.no_grad():
        static = overhead.draft_hidden(draft, target, x)
        embeds = target.embed_tokens(x.block_ids)
        reference = draft(embeds, x.block_positions, draft.fuse(x.features), x.feature_positions, mask, cache)[:, 1:]
        torch.testing.assert_close(static, reference)
        assert torch.equal(x.cache.keys[0], cache.keys[0])  # the static buffer now holds this step's context too
        tokens = overhead.draft_step(draft, target, x)
        logits, features = target(x.block_ids, x.block_positions, *target.new_cache(3, 24))
    assert tokens.shape == (3, s.block_size - 1) and logits.shape == (3, s.block_size, s.vocab)
    assert features.shape == x.features.shape


# ---------------------------------------------------------------------------------------------- train_throughput.py
@pytest.mark.slow
def test_train_throughput_small_reports_consistent_rates(tmp_path):
    bench = load("train_throughput")
    out = tmp_path / "train.json"
    result = bench.main(["--small", "--out", str(out), "--peak-tflops", "100"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [r["preset"] for r in result["runs"]] == ["smollm2", "qwen3-8b"]
    for run in result["runs"]:
        assert "error" not in run, run
        assert len(run["step_s"]) == run["warmup_steps"] + 2 and all(finite_positive(t) for t in run["step_s"])
        assert all(math.isfinite(loss) for loss in run["losses"])
        step, sizes, flops = run["step_s_median"], run["batch"], run["flops"]
        assert step == statistics.median(run["step_s"][run["warmup_steps"] :])
        assert sizes["trained_tokens"] > 0 and sizes["block_slots"] == sizes["blocks"] * run["draft"]["block_size"]
        assert run["trained_tokens_per_s"] == pytest.approx(sizes["trained_tokens"] / step)
        assert run["context_tokens_per_s"] == pytest.approx(sizes["context_tokens"] / step)
        assert all(finite_positive(v) for v in flops.values())
        assert flops["total"] == pytest.approx(sum(v for k, v in flops.items() if k != "total"))
        assert run["achieved_tflops"] == pytest.approx(flops["total"] / step / 1e12)
        assert run["mfu"] == pytest.approx(flops["total"] / step / 100e12)
        host = run["host_phases_s_median"]  # each phase's host time, within the timed step
        assert list(host) == ["forward", "backward", "optimizer"] and all(finite_positive(t) for t in host.values())
        assert sum(host.values()) <= max(run["step_s"][run["warmup_steps"] :])


@pytest.mark.parametrize("preset", ["smollm2", "qwen3-8b"])
def test_flop_formula_matches_the_flop_counter(preset):
    """The matmul terms exactly, on a real forward + backward; the attention terms against the training mask."""
    bench = load("train_throughput")
    bench.register_resolvers()
    cfg = bench.compose_preset(preset, small=True)
    torch.manual_seed(0)
    target = bench.build_target(preset, cfg, small=True, device=torch.device("cpu"))
    module = bench.build_module(target, cfg)
    draft = module.draft.config
    batch = bench.synthetic_batch(cfg, draft, target.vocab_size, 0)
    with FlopCounterMode(display=False) as counter:
        out = module.draft_step(batch)
        (out.ce + out.selector).backward()

    def matmul_flops(counts) -> int:
        return sum(v for op, v in counts.items() if str(op).split(".")[1] in ("mm", "addmm", "bmm"))

    # Some transformers versions build the rotary table (inverse frequencies x positions) with a bmm: not model work.
    rotary = sum(matmul_flops(v) for k, v in counter.get_flop_counts().items() if k.endswith("rotary_emb"))
    matmuls = matmul_flops(counter.get_flop_counts()["Global"]) - rotary
    flops = bench.step_flops(batch, draft, max(draft.target_layer_ids) + 1)
    trained = int((batch["labels"] != -100).sum())
    # The fused head sends the top-K values' gradient back through W[cand] (a bmm the plain head folds into its
    # logits' gradient): hardware work the formula leaves out.
    top_k = draft.selector_top_k if module.objective.fused_head else 0
    extra = 2 * trained * top_k * draft.hidden_size
    assert matmuls == flops["target_matmul"] + flops["draft_matmul"] + extra

    b, length = batch["input_ids"].shape
    mask = dense_block_mask(batch["anchors"], batch["anchor_valid"], length, draft.block_size, batch["attention_mask"])
    hq = draft.num_attention_heads * draft.head_dim
    assert flops["draft_attention"] == 3 * draft.num_hidden_layers * 4 * hq * int(mask.sum())
    assert flops["target_attention"] == (max(draft.target_layer_ids) + 1) * 4 * hq * b * length * (length + 1) / 2


@pytest.mark.slow
def test_ddp_small_splits_the_global_batch_and_compares_curves(tmp_path):
    out = tmp_path / "ddp.json"
    load("ddp").main(["--small", "--out", str(out)])
    result = json.loads(out.read_text())
    single, ddp = result["runs"]
    steps = 8  # --small's default
    assert single["devices"] == 1 and ddp["devices"] == 2 and "trainer=ddp" in ddp["command"]
    assert single["steps"] == ddp["steps"] == list(range(steps))
    # The same global batch: one process takes both ranks' rows.
    assert single["rows_per_device"] == 2 * ddp["rows_per_device"] == steps * result["global_rows_per_step"]
    assert all(math.isfinite(x) for x in single["loss"] + ddp["loss"])
    assert ddp["tokens_per_s"] == pytest.approx(2 * ddp["device_tokens_per_s"])
    assert result["throughput_ratio"] == pytest.approx(ddp["tokens_per_s"] / single["tokens_per_s"])
    smooth = lambda r: statistics.mean(r["loss"][-result["smooth"] :])  # noqa: E731
    assert result["final_smoothed_loss"] == pytest.approx([smooth(single), smooth(ddp)])
    assert result["smoothed_loss_gap_last"] == pytest.approx(abs(smooth(ddp) - smooth(single)) / smooth(single))


# ---------------------------------------------------------------------------------------------- decode_step.py
def test_decode_step_small_times_both_attentions(tmp_path):
    decode_step = load("decode_step")
    out = tmp_path / "decode_step.json"
    result = decode_step.main(["--small", "--batch", "1", "3", "--warmup", "1", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["timer"] == "cpu_wall_eager" and [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert all(finite_positive(row[f"{a}_ms"]) for a in decode_step.ATTENTIONS), row
        assert row["grouped_sdpa_tokens_per_s"] == pytest.approx(row["batch"] / row["grouped_sdpa_ms"] * 1e3)
        assert row["speedup"] == pytest.approx(row["sdpa_ms"] / row["grouped_sdpa_ms"])
        assert all(0 <= row[f"{a}_max_abs_error"] <= 1e-4 for a in decode_step.ATTENTIONS), row


# ---------------------------------------------------------------------------------------------- decode_profile.py
def test_decode_profile_small_splits_each_paths_steps(tmp_path):
    out = tmp_path / "decode_profile.json"
    result = load("decode_profile").main(["--small", "--batch", "1", "2", "--tokens", "6", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["timer"] == "cpu_wall" and [r["batch"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        # No compile by default on a CPU: the step in pieces and whole, both eager.
        assert row["identical_outputs"] and set(row["paths"]) == {"plain", "static", "whole"}
        assert finite_positive(row["target_alone"]["wall_ms_per_step"])
        for name, path in row["paths"].items():
            parts = path["parts"]
            assert set(parts) == {"verify", "draft", "conv_selector"} | ({"whole_step"} if name == "whole" else set())
            assert all(finite_positive(p["host_ms"]) and p["device_ms"] is None for p in parts.values()), path
            assert path["other_host_ms"] >= 0 and path["syncs_per_step"] is None
            total = sum(p["host_ms"] for p in parts.values()) + path["other_host_ms"]
            assert path["wall_ms_per_step"] == pytest.approx(total)
            # every request ends at the budget: 1 token from the prefill, then tau per verify step
            assert path["tokens"] == 6 * row["batch"] and 1 <= path["tau"] <= result["block_size"]


# ---------------------------------------------------------------------------------------------- generate_call.py
def test_generate_call_small_times_each_cache_and_width(tmp_path):
    out = tmp_path / "generate_call.json"
    argv = ["--small", "--batch", "2", "--steps", "3", "--width", "5", "--cache", "32", "64", "--widths", "7", "9"]
    result = load("generate_call").main([*argv, "--out", str(out)])
    assert json.loads(out.read_text()) == result
    calls = [(r["cache"], r["width"], r["padding"], r["call"]) for r in result["calls"]]
    assert calls == [
        (32, 5, "none", "first"), (32, 5, "none", "second"), (64, 5, "none", "first"), (64, 5, "none", "second"),
        (32, 7, "fixed", "new width"), (32, 9, "fixed", "new width"), (32, 7, "none", "new width"),
        (32, 9, "none", "new width"),
    ]  # fmt: skip
    assert all(finite_positive(r["seconds"]) and r["ms_per_step"] == 1000 * r["seconds"] / 3 for r in result["calls"])


def test_feature_storage_small_measures_each_way_within_its_rounding(tmp_path):
    out = tmp_path / "feature_storage.json"
    result = load("feature_storage").main(["--small", "--conversations", "3", "--max-length", "64", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    width = 2 * 64  # the tiny target's two captured layers of 64
    # name: (bytes per token, the largest rounding error relative to a token's largest value)
    expected = {
        "bf16 (dtype=bf16)": (2 * width, 2**-8),
        "fp8 e4m3, scale per token and layer (dtype=fp8)": (width + 4 * 2, 2**-4),
        "fp8 e5m2, scale per token and layer": (width + 4 * 2, 2**-3),
        "int8, scale per token and layer": (width + 4 * 2, 0.5 / 127 * (1 + 1e-6)),
        "bf16, zlib level 6": (None, 2**-8),
    }
    assert [row["storage"] for row in result["storage"]] == list(expected)
    for row in result["storage"]:
        size, bound = expected[row["storage"]]
        assert row["bytes_per_token"] == size or (size is None and 0 < row["bytes_per_token"] < 2 * width + 64)
        assert all(0 < layer["max_error_over_token_amax"] <= bound for layer in row["layers"]), row
        assert all(layer["relative_error"] > 0 for layer in row["layers"]), row


def test_target_pass_small_times_each_mode_against_the_first(tmp_path):
    result = load("target_pass").main(["--small", "--reps", "2", "--out", str(tmp_path / "t.json")])
    assert json.loads((tmp_path / "t.json").read_text()) == result
    assert result["lengths"] == [48, 46, 44, 42] and list(result["modes"]) == ["false"]  # the CPU runs eager only
    row = result["modes"]["false"]
    assert 0 < row["min_ms"] <= row["median_ms"] and row["warmup_s"] > 0 and row["max_abs_diff_vs_first"] == 0.0


# ---------------------------------------------------------------------------------------------- copyable_anchors.py
def test_copyable_anchors_counts_what_lookup_at_each_anchor_gets(tmp_path):
    """The script's histogram of matched lengths against prompt lookup run on each anchor's prefix alone, counting its
    proposals while they equal the trained tokens that follow; the shares and means are read off that histogram."""
    from dflash2.data.chat import load_conversations, tokenize_conversations
    from dflash2.decoding.lookup import PromptLookup

    rng = random.Random(random.randrange(2**31))
    words = ["alpha", "beta", "gamma", "delta", "x", "=", "1", "+", "2"]
    records = []
    for i in range(4):
        question = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        reply = f"{question}, so {question} again: " + " ".join(rng.choices(words, k=rng.randint(2, 10)))
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        records.append({"id": str(i), "messages": messages})
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out, cache, block_size = tmp_path / "copyable.json", str(tmp_path / "cache"), 4
    script = load("copyable_anchors")
    args = [f"{path}:3", "--block-size", "4", "--max-length", "200", "--max-anchors", "5", "--weights", "4"]
    result = script.main([*args, "--cache-dir", cache, "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["command"].endswith(f"--out {out}")
    (file,) = result["files"]
    assert file["conversations"] == 3 and file["limit"] == 3  # the first 3 of the file's 4

    chats = load_conversations(str(path), 3)
    stat = path.stat()
    key = f"{path.absolute()}|{stat.st_size}|{stat.st_mtime_ns}|limit=3|n=3"
    rows = tokenize_conversations(chats, script.tokenizer_of(None), 200, key, None, cache)
    histogram = [0] * block_size
    lookup = PromptLookup(filler=-1)
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        for a in range(len(ids) - 1):
            if mask[a] and mask[a + 1]:
                proposal = lookup.lookup(torch.tensor([ids[: a + 1]]), torch.tensor([a + 1]), block_size)[0].tolist()
                n = 0
                while n < block_size - 1 and a + 1 + n < len(ids) and mask[a + 1 + n] and proposal[n] == ids[a + 1 + n]:
                    n += 1
                histogram[n] += 1
    assert file["matched_histogram"] == histogram and sum(histogram[1:]) > 0  # the replies repeat their questions
    anchors = sum(histogram)
    assert file["anchor_positions"] == anchors and file["copyable_share"] == pytest.approx(sum(histogram[1:]) / anchors)
    mean = sum(n * c for n, c in enumerate(histogram)) / sum(histogram[1:])
    assert file["mean_matched_copyable"] == pytest.approx(mean)
    drawn = file["drawn_copyable_share"]
    assert set(drawn) == {"1", "4"} and all(0 <= v <= 1 for v in drawn.values())


# ---------------------------------------------------------------------------------------------- copy_gap.py
def test_copy_gap_splits_a_drafters_steps_by_what_lookup_gets_there(tmp_path):
    """A hand-made run: prompt [1 2 3 4 1], output [2 3 4 9 9] in steps of 1, 1, 2 tokens (output[0] from the prefill).
    At the anchors 2, 3 and 4 the lookup proposes [3 4 1 2], [4 1 2 3] and [1 2 3 4]: 2, 1 and 0 of them match."""
    (tmp_path / "run").mkdir()
    draft = {"name": "dflash2", "architecture": "DFlash2DraftModel"}
    results = {"draft": draft, "temperature": 0.0, "block_size": 16, "bench": "hand"}
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    sample = {"prompt_ids": [1, 2, 3, 4, 1], "output_ids": [2, 3, 4, 9, 9], "accept_lengths": [1, 1, 2]}
    (tmp_path / "run" / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    copy_gap = load("copy_gap")
    (row,) = copy_gap.main([str(tmp_path), "--out", str(tmp_path / "gap.json")])
    assert row["steps"] == 3 and row["copyable_share"] == pytest.approx(2 / 3)
    assert row["tau"] == pytest.approx(4 / 3) and row["tau_copyable"] == 1.0 and row["tau_other"] == 2.0
    assert row["lookup_tau_copyable"] == pytest.approx((3 + 2) / 2)
    assert json.loads((tmp_path / "gap.json").read_text())["runs"] == [row]
    results["temperature"] = 1.0  # sampled: the output depends on the proposer, nothing to replay
    (tmp_path / "run" / "results.json").write_text(json.dumps(results))
    assert copy_gap.main([str(tmp_path)]) == []
    # Prompt lookup's own run is the replay itself, whatever its folder is called.
    lookup = {"name": "dflash2", "architecture": "PromptLookup"}
    (tmp_path / "run" / "results.json").write_text(json.dumps(results | {"temperature": 0.0, "draft": lookup}))
    assert copy_gap.main([str(tmp_path)]) == []


# ---------------------------------------------------------------------------------------------- bench_tau_sim.py
def test_bench_tau_sim_rebuilds_each_chat_from_the_samples(tmp_path, monkeypatch):
    """A two-turn prompt whose samples come out of order, and a one-turn one cut at max_new_tokens: each chat holds
    the bench's user turns and the decoded replies in turn order, and only the cut reply is marked truncated."""
    bench_tau_sim = load("bench_tau_sim")
    rng = random.Random(random.randrange(2**63))
    budget = rng.randint(4, 9)
    prompts = [{"id": "a", "turns": ["first?", "second?"]}, {"id": "b", "turns": ["only?"]}]
    monkeypatch.setattr(bench_tau_sim, "load_prompts", lambda name: prompts)
    outputs = {("a", 0): rng.sample(range(50), budget - 1), ("a", 1): rng.sample(range(50), 2)}
    outputs[("b", 0)] = rng.sample(range(50), budget)
    samples = [{"id": i, "turn": t, "output_ids": o} for (i, t), o in outputs.items()]
    rng.shuffle(samples)
    run = tmp_path / "run"
    run.mkdir()
    results = {"temperature": 0.0, "bench": "hand", "max_new_tokens": budget}
    (run / "results.json").write_text(json.dumps(results))
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))

    class Tokenizer:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    got, chats = bench_tau_sim.bench_chats(run, Tokenizer())
    assert got == results
    by_id = {c["id"]: c["messages"] for c in chats}
    text = {k: " ".join(map(str, v)) for k, v in outputs.items()}
    assert by_id["a"] == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": text[("a", 0)]},
        {"role": "user", "content": "second?"},
        {"role": "assistant", "content": text[("a", 1)]},
    ]
    assert by_id["b"] == [
        {"role": "user", "content": "only?"},
        {"role": "assistant", "content": text[("b", 0)], "truncated": True},
    ]
    (run / "results.json").write_text(json.dumps(results | {"temperature": 1.0}))
    assert bench_tau_sim.bench_chats(run, Tokenizer()) is None  # sampled text is not the target's greedy text


def test_copy_probe_trains_on_loops_with_the_oracles_features(tmp_path):
    """Every trained position of a probe row repeats the token one period back, and anchors sit on trained pairs; the
    oracle's features are token i's embedding and the head's row of token i + 1; a tiny run writes every slot's acc."""
    probe = load("copy_probe")
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for row in probe.periodic_rows(6, 96, (3, 9), 8, gen):
        ids, mask = row["input_ids"], row["loss_mask"]
        trained = mask.nonzero().flatten()
        period = int(trained[0]) - probe.PROMPT
        assert 3 <= period <= 9 and trained[-1] == len(ids) - 1 and len(trained) == len(ids) - probe.PROMPT - period
        assert torch.equal(ids[trained], ids[trained - period])
        assert mask[row["anchors"]].all() and mask[row["anchors"] + 1].all()

    bench = load("train_throughput")
    bench.register_resolvers()
    target = bench.build_target("qwen3-8b", bench.compose_preset("qwen3-8b", small=True), True, torch.device("cpu"))
    ids = torch.randint(0, probe.VOCAB, (2, 10))
    hidden = probe.oracle_features(target, ids).hidden
    h = target.lm_head_weight.shape[1]
    assert torch.equal(hidden[..., :h], target.embed_tokens(ids))
    assert torch.equal(hidden[:, :-1, h:], target.lm_head_weight[ids[:, 1:]]) and not hidden[:, -1, h:].any()

    args = ["--layers", "1", "--drafter", "dflash2", "--steps", "2", "--eval-batches", "1", "--length", "48"]
    result = probe.main([*args, "--anchors", "4", "--batch-size", "2", "--out", str(tmp_path / "probe.json")])
    (run,) = result["runs"]
    assert len(run["acc"]) == result["args"]["block_size"] - 1 and all(0 <= a <= 1 for a in run["acc"])
    assert run["tau_sim"] >= 1 and json.loads((tmp_path / "probe.json").read_text()) == result


def test_random_weight_smollm2_has_the_embedded_targets_architecture():
    """--random-weights measures the SmolLM2 step without the GGUF: only if its architecture is the real one."""
    from dflash2.target.inherited import load_target_config

    bench = load("train_throughput")
    bench.register_resolvers()
    cfg = bench.compose_preset("smollm2", small=False)
    real = load_target_config(cfg.model)
    target = bench.build_target("smollm2", cfg, small=False, device=torch.device("meta"), random_weights=True)
    assert type(target.model).__name__ == real.architectures[0]
    for key in (*bench.SMOLLM2, "hidden_act", "attention_bias", "mlp_bias"):
        want = getattr(real, key)  # the GGUF stores floats in single precision
        assert getattr(target.config, key) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key


# ---------------------------------------------------------------------------------------------- draft_attention.py
def test_draft_attention_small_and_its_pair_count(tmp_path):
    bench = load("draft_attention")
    out = tmp_path / "attention.json"
    result = bench.main(["--small", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [json.loads(r["kernel_options"]) for r in result["rows"]] == bench.CONFIGS
    for row in result["rows"]:  # eager on the CPU: the options change nothing, every set gives the same output
        assert "error" not in row and row["max_abs_diff"] == 0.0 and finite_positive(row["forward_ms"]), row
    # The FLOP count's pairs are the training mask's: count them in the dense mask of random anchors.
    rows, length, n, block = 3, int(torch.randint(64, 200, ())), 6, 4
    anchors = bench.training_blocks(rows, length, n, seed=random.randrange(2**31))
    mask = dense_block_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), length, block)
    assert bench.attended_pairs(anchors, block) == int(mask.sum())


# ---------------------------------------------------------------------------------------------- train_speed.py
def test_train_speed_runs_the_parts_asked_for_with_their_settings(tmp_path):
    """--dry-run lists each part's commands, and only the parts asked for: the equal-steps trainings at --steps and
    --val (the plain one on the PyTorch path), the throughput runs' JSON under --out, the epoch's overrides last."""
    bench = load("train_speed")
    out, steps = tmp_path / "out", random.randint(2, 500)
    names = lambda result: [c["name"] for c in result["commands"]]  # noqa: E731
    result = bench.main(["--out", str(out), "--dry-run", "--steps", str(steps), "--val", "7"])
    assert names(result) == ["plain", "fast", "gpu_tests", *(f"throughput_{n}" for n in bench.THROUGHPUT), "epoch"]
    commands = {c["name"]: c["command"] for c in result["commands"]}
    for name in ("plain", "fast"):
        assert {f"trainer.max_steps={steps}", "trainer.val_check_interval=7"} <= set(commands[name])
        assert f"run_dir={out / 'work' / 'runs' / name}" in commands[name]
    assert set(bench.PLAIN) <= set(commands["plain"]) and not set(bench.PLAIN) & set(commands["fast"])
    assert all(
        commands[f"throughput_{n}"][-2:] == ["--out", str(out / f"train_throughput_{n}.json")] for n in bench.THROUGHPUT
    )
    assert not out.exists()  # a dry run writes nothing

    result = bench.main(["--out", str(out), "--dry-run", "--parts", "epoch", "--epoch-override", "data.batch_size=16"])
    assert names(result) == ["epoch"]
    assert result["commands"][0]["command"][-2:] == ["trainer.max_epochs=1", "data.batch_size=16"]


def test_train_speed_trains_on_the_regenerated_parts_made_one_file(tmp_path, monkeypatch):
    bench = load("train_speed")
    rng = random.Random(random.randrange(2**63))
    parts = [[json.dumps({"id": f"{p}-{i}"}) + "\n" for i in range(rng.randint(1, 5))] for p in range(4)]
    paths = []
    for p, lines in enumerate(parts):
        paths.append(tmp_path / f"part{p}.jsonl.gz")
        paths[-1].write_bytes(gzip.compress("".join(lines).encode()))
    monkeypatch.setattr(bench, "DATA_PARTS", [str(p) for p in paths])
    bench.regenerated_set(tmp_path)
    assert (tmp_path / "smollm2.jsonl").read_text() == "".join(line for lines in parts for line in lines)
    paths[0].unlink()  # made once: a rerun keeps the file
    bench.regenerated_set(tmp_path)
    assert (tmp_path / "smollm2.jsonl").read_text().count("\n") == sum(map(len, parts))
