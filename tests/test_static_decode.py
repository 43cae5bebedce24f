"""The fast decode path (dflash2/decoding/static.py) decodes what the plain loops (dflash2/decoding/speculative.py)
decode: the same tokens and the same accept lengths, greedy and sampled with the same seed, through compaction of its
static caches, requests that finish at different steps and padding rows; and the comparison catches a broken fast
path."""

import random

import pytest
import torch
from test_evaluation import config, export_draft
from test_lookup import repeating_prompts
from test_speculative import make_draft, random_prompts
from torch._dynamo.utils import counters

from dflash2.commands.evaluate import evaluate, settings_of
from dflash2.decoding import drafting
from dflash2.decoding import speculative as spec
from dflash2.decoding import static as fast
from dflash2.decoding.lookup import PromptLookup
from dflash2.model.drafter import StaticDraftCache, take_slots_
from dflash2.target.static_cache import TargetStaticCache
from dflash2.testing import tiny_target

MAX_NEW, BLOCK = 40, 4
# Sampled, the tiny target's distributions and a random drafter's are both nearly flat over the vocabulary, so most
# proposals would be accepted and the caches would hold few rejected slots; the target's top 5 rejects most of them.
TOP_K = 5


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(target_layer_ids=[1, 2])


class Teacher:
    """Proposals forced to a reference continuation wherever a request is recognised (its anchor token at the anchor's
    position), with one slot wrong unless a hash of the anchor and its position says the whole block is right: long
    accepts, full blocks and their bonus tokens. The forcing depends on the proposal's inputs alone, so both paths
    get the same proposals for the same inputs (the fast path also asks for a finished row's, which it keeps). It also
    records what the drafter computed for each (request, anchor position), to compare the paths' drafter caches."""

    def __init__(self, sequences, vocab):
        self.sequences, self.vocab, self.anchor_positions = sequences, vocab, None
        self.seen = {}  # (request, anchor position) -> the drafter's hidden states of the proposing slots

    def watch(self, draft, monkeypatch):
        forward = draft.forward

        def recording(block_embeds, block_positions, *args, **kwargs):
            self.anchor_positions = block_positions[:, 0].tolist()
            return forward(block_embeds, block_positions, *args, **kwargs)

        monkeypatch.setattr(draft, "forward", recording)
        monkeypatch.setattr(drafting, "propose", self.wrap(drafting.propose))

    def wrap(self, propose):
        def forced(draft, head, hidden, anchors, **kwargs):
            tokens, q = propose(draft, head, hidden, anchors, **kwargs)
            tokens = tokens.clone()
            for row, (pos, anchor) in enumerate(zip(self.anchor_positions, anchors.tolist(), strict=True)):
                match = [i for i, s in enumerate(self.sequences) if len(s) > pos + 1 and s[pos] == anchor]
                if len(match) != 1:
                    continue
                self.seen.setdefault((match[0], pos), hidden[row].clone())
                truth = self.sequences[match[0]][pos + 1 : pos + tokens.shape[1] + 1]
                tokens[row, : len(truth)] = torch.tensor(truth)
                key = pos * 31 + anchor * 7
                if key % 5:  # four blocks in five lose one slot
                    slot = key % len(truth)
                    tokens[row, slot] = (truth[slot] + 1) % self.vocab
            return tokens, q

        return forced


def counting_compactions(monkeypatch):
    """Every compaction of the fast path, as (pointer before, pointer after)."""
    seen = []
    real = fast.compact

    def recording(key_mask, positions, end, pending, cache, draft_cache):
        after = real(key_mask, positions, end, pending, cache, draft_cache)
        seen.append((end, after))
        return after

    monkeypatch.setattr(fast, "compact", recording)
    return seen


def decode_both(target, proposer, prompts, temperature, batch_size, seed, stop=(), teacher=None):
    """(plain, fast) generations of the same run (the same seed, the smallest capacity the fast path accepts), each
    with what a teacher saw the drafter compute."""
    sampling = spec.Sampling(temperature, TOP_K, stop_ids=list(stop), batch_size=batch_size)
    capacity = max(map(len, prompts)) + MAX_NEW + 3 * BLOCK
    runs = []
    for generate, extra in (
        (spec.speculative_generate, {}),
        (fast.speculative_generate, {"fast": fast.FastDecode(capacity=capacity)}),
    ):
        generator = torch.Generator().manual_seed(seed)
        out = generate(target, proposer, prompts, BLOCK, MAX_NEW, sampling, generator=generator, **extra)
        runs.append((out, teacher.seen if teacher else {}))
        if teacher:
            teacher.seen = {}
    return runs


def assert_same(plain, static):
    """The same tokens and accept lengths, and the drafter computed the same wherever both paths asked it."""
    (plain, plain_drafts), (static, static_drafts) = plain, static
    assert [g.output_ids for g in static] == [g.output_ids for g in plain]
    assert [g.accept_lengths for g in static] == [g.accept_lengths for g in plain]
    assert set(plain_drafts) <= set(static_drafts)
    for key, hidden in plain_drafts.items():
        torch.testing.assert_close(static_drafts[key], hidden, rtol=1e-4, atol=1e-4)


def proposer_case(tiny, kind, seed, n, monkeypatch):
    """(proposer, prompts, teacher or None) of a case; a teacher's drafter proposes the target's greedy text, forced."""
    if kind == "pld":
        return PromptLookup(), repeating_prompts(seed, n, tiny.vocab_size), None
    prompts = random_prompts(seed, n, tiny.vocab_size)
    draft = make_draft(tiny, "dflash2" if kind == "teacher" else kind, BLOCK, seed)
    if kind != "teacher":
        return draft, prompts, None
    free = spec.target_generate(tiny, prompts, MAX_NEW, spec.Sampling(batch_size=n))
    teacher = Teacher([p + g.output_ids for p, g in zip(prompts, free, strict=True)], tiny.vocab_size)
    teacher.watch(draft, monkeypatch)
    return draft, prompts, teacher


def stop_token(tiny, proposer, prompts, temperature, batch_size, seed):
    """A token the first request first commits halfway or later when nothing stops it: with it as a stop token,
    requests finish at different steps (the run is the same until the first request that commits it finishes) and the
    first runs long enough to compact its caches. The tiny target's text often loops, so the token at the halfway
    point may have come before it; where every later token has, a token the first request never commits (one another
    request does, if any), so the first request runs to its end."""
    sampling = spec.Sampling(temperature, TOP_K, batch_size=batch_size)
    free = spec.speculative_generate(
        tiny, proposer, prompts, BLOCK, MAX_NEW, sampling, generator=torch.Generator().manual_seed(seed)
    )
    first, half = free[0].output_ids, MAX_NEW // 2
    late = [t for t in first[half:] if first.index(t) >= half]
    if late:
        return late[0]
    others = [t for g in free[1:] for t in g.output_ids if t not in first]
    return others[0] if others else next(t for t in range(tiny.vocab_size) if t not in first)


@pytest.mark.parametrize(
    "kind, temperature, batch_size",
    [
        ("teacher", 0.0, 3),
        ("teacher", 1.0, 3),
        ("dflash", 0.0, 1),
        ("dflash", 1.0, 2),
        ("pld", 0.0, 3),
        ("pld", 1.0, 1),
    ],
)
def test_static_path_decodes_what_the_plain_path_decodes(tiny, kind, temperature, batch_size, monkeypatch):
    seed = random.randrange(10_000)
    n = 2 if batch_size == 1 else 4  # two batches, the last one short (padding rows) unless batch_size = 1
    proposer, prompts, teacher = proposer_case(tiny, kind, seed, n, monkeypatch)
    stop = stop_token(tiny, proposer, prompts, temperature, batch_size, seed)
    compactions = counting_compactions(monkeypatch)
    if teacher:
        teacher.seen = {}
    plain, static = decode_both(tiny, proposer, prompts, temperature, batch_size, seed, [stop], teacher)
    assert_same(plain, static)
    plain = plain[0]
    # The run reached what it is meant to test: compactions that shrank the caches, requests of a batch finishing at
    # different steps, long accepts where the proposer can be right.
    assert compactions and all(after < before for before, after in compactions)
    batches = [plain[i : i + batch_size] for i in range(0, n, batch_size)]
    if batch_size > 1:
        assert any(len({len(g.accept_lengths) for g in batch}) > 1 for batch in batches)
    lengths = [a for g in plain for a in g.accept_lengths]
    if kind == "teacher" and temperature == 0:  # sampled, the text leaves the teacher's at once
        assert max(lengths) == BLOCK and sum(lengths) / len(lengths) > 2 and len(static[1]) > 10


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_static_target_alone_decodes_what_the_plain_target_alone_decodes(tiny, temperature):
    seed = random.randrange(10_000)
    prompts = random_prompts(seed, 5, tiny.vocab_size)
    sampling = spec.Sampling(temperature=temperature, batch_size=2)
    free = spec.target_generate(tiny, prompts, 16, sampling, torch.Generator().manual_seed(seed))
    sampling = spec.Sampling(temperature=temperature, stop_ids=[free[0].output_ids[8]], batch_size=2)
    plain = spec.target_generate(tiny, prompts, 16, sampling, torch.Generator().manual_seed(seed))
    capacity = max(map(len, prompts)) + 16 + 3  # the smallest a call of these prompts takes
    static = fast.target_generate(
        tiny, prompts, 16, sampling, torch.Generator().manual_seed(seed), fast=fast.FastDecode(capacity=capacity)
    )
    assert_same((plain, {}), (static, {}))
    assert len({len(g.output_ids) for g in plain}) > 1  # the stop token ended some requests early


def off_by_one_pointer(monkeypatch):
    real = TargetStaticCache.keep

    def keep(self, index):
        real(self, index)
        for layer in self.layers:  # the target writes the next block one slot before where the mask expects it
            layer.cumulative_length.sub_(1)

    monkeypatch.setattr(TargetStaticCache, "keep", keep)


def finished_rows_draw(monkeypatch):
    real = fast.live_rows
    monkeypatch.setattr(fast, "live_rows", lambda done, rows, device: (None, real(done, rows, device)[1]))


def compaction_drops_a_slot(monkeypatch):
    real = StaticDraftCache.keep

    def keep(self, index):  # the drafter's first kept slot is lost, its second kept twice
        real(self, torch.cat([index[:, 1:2], index[:, 1:]], -1))

    monkeypatch.setattr(StaticDraftCache, "keep", keep)


@pytest.mark.parametrize(
    "sabotage, temperature",
    [(off_by_one_pointer, 0.0), (finished_rows_draw, 1.0), (compaction_drops_a_slot, 0.0)],
)
@pytest.mark.slow
def test_the_comparison_catches_a_broken_fast_path(tiny, sabotage, temperature, monkeypatch):
    """The same comparison as above fails when the fast path is broken in a small way."""
    seed = random.randrange(10_000)
    draft, prompts, teacher = proposer_case(tiny, "teacher", seed, 4, monkeypatch)
    stop = stop_token(tiny, draft, prompts, temperature, 3, seed)
    teacher.seen = {}
    sabotage(monkeypatch)
    plain, static = decode_both(tiny, draft, prompts, temperature, 3, seed, [stop], teacher)
    with pytest.raises(AssertionError):
        assert_same(plain, static)


def test_the_drafters_static_cache_keeps_its_buffers_from_batch_to_batch(tiny, monkeypatch):
    """Every batch of a capacity gets the same drafter cache, emptied, its buffers where they were (a CUDA graph reads
    them at the addresses it recorded), and a later call of that capacity too; the outputs are checked against the
    plain loop's, batch after batch, by the tests above."""
    seed = random.randrange(10_000)
    prompts = random_prompts(seed, 3, tiny.vocab_size)
    draft = make_draft(tiny, "dflash2", BLOCK, seed)
    caches = []  # (the cache, its key buffers' addresses, its length) as each batch gets it
    real = drafting.Drafter.new_cache

    def recording(self, capacity=None):
        cache = real(self, capacity)
        caches.append((cache, [k.data_ptr() for k in cache.keys if k is not None], cache.length))
        return cache

    monkeypatch.setattr(drafting.Drafter, "new_cache", recording)
    sampling = spec.Sampling(batch_size=1)
    capacity = max(map(len, prompts)) + MAX_NEW + 3 * BLOCK

    def decode(capacity):
        settings = fast.FastDecode(capacity=capacity)
        fast.speculative_generate(tiny, draft, prompts, BLOCK, MAX_NEW, sampling, fast=settings)

    decode(capacity)
    decode(capacity)
    first = caches[0][0]
    assert len(caches) == 6 and all(cache is first and length == 0 for cache, _, length in caches)
    assert caches[0][1] == [] and all(ptrs == caches[1][1] for _, ptrs, _ in caches[1:]) and len(caches[1][1]) > 0
    decode(capacity + 1)
    assert caches[-1][0] is not first  # another capacity, other buffers


def test_take_slots_moves_each_rows_slots_in_place():
    buffer = torch.arange(2 * 3 * 5).view(2, 3, 5)  # [b, heads, slots]: slot s of row r, head h = 15 r + 5 h + s
    take_slots_(buffer, torch.tensor([[4, 0], [2, 2]]), 2)
    assert buffer[0].tolist() == [[4, 0, 2, 3, 4], [9, 5, 7, 8, 9], [14, 10, 12, 13, 14]]
    assert buffer[1].tolist() == [[17, 17, 17, 18, 19], [22, 22, 22, 23, 24], [27, 27, 27, 28, 29]]


def test_capacity_holds_a_call_and_rounds_up_to_few_shapes():
    prompts = [[5] * 30, [5] * 7]
    assert fast.FastDecode().capacity_for(prompts, 256, 16) == fast.CAPACITY_STEP  # 30 + 256 + 11 * 16 = 462
    assert fast.FastDecode().capacity_for(prompts, 900, 16) == 2 * fast.CAPACITY_STEP
    assert fast.FastDecode(capacity=334).capacity_for(prompts, 256, 16) == 334  # 30 + 256 + 3 * 16
    with pytest.raises(ValueError, match="capacity of 333 slots .* need 334"):
        fast.FastDecode(capacity=333).capacity_for(prompts, 256, 16)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["decode=fast"], "decode=fast: choose plain"),
        (["decode=static", "compile=yes"], "compile=yes: set it to true, false or one of"),
        (["compile=true"], "compile=true needs decode=static"),
    ],
)
def test_evaluate_refuses_bad_decode_settings_by_name(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        settings_of(config("drafter=pld", *overrides))


def test_decode_mode_reads_compile_as_the_device_allows():
    assert fast.decode_mode("plain", False) is None
    assert fast.decode_mode("static", False) == fast.FastDecode()
    assert fast.decode_mode("static", True, "cpu").compile == "default"  # a CPU has no CUDA graphs
    assert fast.decode_mode("static", True, "cuda").compile == "reduce-overhead"
    assert fast.decode_mode("static", "max-autotune", "cpu").compile == "max-autotune"


def test_evaluate_decodes_alike_on_both_paths(tiny, tmp_path):
    draft = export_draft(tiny, tmp_path / "draft")
    common = [f"drafter={draft}", "bench.limit=3", "max_new_tokens=8", "batch_size=2", "temperature=1"]
    runs = {d: evaluate(config(*common, f"decode={d}", "baseline=true"), tmp_path / d) for d in ("plain", "static")}
    samples = {d: (tmp_path / d / "samples.jsonl").read_text() for d in runs}
    assert samples["static"] == samples["plain"]
    assert runs["static"]["config"]["decode"] == "static" and runs["static"]["baseline"]["tokens_per_s"] > 0


@pytest.mark.slow
def test_compiled_steps_decode_what_the_plain_path_decodes(tiny):
    """torch.compile of the target's verify and one-token steps and of the drafter's steady steps (on a CPU without
    CUDA graphs: minutes to compile)."""
    seed = random.randrange(10_000)
    prompts = random_prompts(seed, 3, tiny.vocab_size)
    draft = make_draft(tiny, "dflash2", BLOCK, seed)
    sampling = spec.Sampling(temperature=1.0, batch_size=2)
    compiled = fast.FastDecode(compile="default", capacity=max(map(len, prompts)) + MAX_NEW + 3 * BLOCK)
    seeded = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
    counters.clear()
    plain = spec.speculative_generate(tiny, draft, prompts, BLOCK, MAX_NEW, sampling, seeded())
    static = fast.speculative_generate(tiny, draft, prompts, BLOCK, MAX_NEW, sampling, seeded(), fast=compiled)
    assert_same((plain, {}), (static, {}))
    plain = spec.target_generate(tiny, prompts, 12, sampling, seeded())
    static = fast.target_generate(tiny, prompts, 12, sampling, seeded(), fast=compiled)
    assert_same((plain, {}), (static, {}))
    # One graph per step shape (the drafter's, the verify, the one token), each whole: no breaks, no recompiles.
    assert counters["stats"]["unique_graphs"] == 3
