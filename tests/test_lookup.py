"""Prompt lookup (dflash2/decoding/lookup.py), the training-free proposer: its n-gram rule against a plain reference,
at every prefix, its refusals, and greedy decoding with it that is the target's own."""

import random

import pytest
import torch

from dflash2.decoding import speculative as spec
from dflash2.decoding.lookup import PromptLookup
from dflash2.testing import tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(target_layer_ids=[1, 2])


def repeating_prompts(seed, n, vocab):
    """Random pieces repeated a few times (then a random tail), so n-grams recur and lookups find something."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        piece = torch.randint(4, vocab, (int(torch.randint(2, 6, (), generator=g)),), generator=g).tolist()
        tail = torch.randint(4, vocab, (int(torch.randint(0, 4, (), generator=g)),), generator=g).tolist()
        prompts.append(piece * int(torch.randint(2, 4, (), generator=g)) + tail)
    return prompts


@pytest.mark.parametrize("block_size", [4, 8])
def test_prompt_lookup_greedy_output_is_the_targets_greedy_output(tiny, block_size, monkeypatch):
    steps = []  # (features kept for a drafter, target cache width before, after) per compaction

    def recording(rows, cache, draft_cache):
        before = cache.get_seq_length()
        rows = compact(rows, cache, draft_cache)
        steps.append((rows.features, draft_cache, before, cache.get_seq_length()))
        return rows

    compact = spec.compact
    monkeypatch.setattr(spec, "compact", recording)
    seed = random.randrange(10_000)
    # About one draw of prompts in 150, the random target continues none of their repeats: the next draw is taken, so
    # that some lookups are accepted (not only bonus tokens). Every draw's output must be the target's.
    for attempt in range(5):
        prompts = repeating_prompts(seed + attempt, 4, tiny.vocab_size)
        reference = spec.target_generate(tiny, prompts, 24, spec.Sampling(batch_size=4))
        steps.clear()
        out = spec.speculative_generate(tiny, PromptLookup(), prompts, block_size, 24, spec.Sampling(batch_size=3))
        assert [g.output_ids for g in out] == [g.output_ids for g in reference]
        for got in out:
            assert len(got.output_ids) == 1 + sum(got.accept_lengths)
            assert all(1 <= n <= block_size for n in got.accept_lengths)
        if max(n for g in out for n in g.accept_lengths) >= 2:
            break
    assert max(n for g in out for n in g.accept_lengths) >= 2
    assert all(features is None and cache is None for features, cache, _, _ in steps)  # no drafter was fed
    assert any(after < before for _, _, before, after in steps)  # the target's cache alone was compacted


def lookup_reference(tokens, max_ngram, min_ngram, num_tokens, width, filler, with_match=False):
    """The rule written the plainest way, on one list of tokens; `with_match`: also the length of the n-gram that
    matched and how many proposals come from the text (0 and 0 where nothing matches)."""
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = tokens[len(tokens) - n :]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            taken = tokens[starts[-1] + n :][: min(num_tokens, width)]
            proposal = taken + [filler] * (width - len(taken))
            return (proposal, n, len(taken)) if with_match else proposal
    return ([filler] * width, 0, 0) if with_match else [filler] * width


def test_prompt_lookup_proposes_what_the_ngram_rule_gives():
    F = PromptLookup().filler

    def propose(rows, block_size=8, **settings):
        capacity = max(len(r) for r in rows) + 3
        tokens = torch.full((len(rows), capacity), 7)  # junk past each row's end must never be read
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = torch.tensor(r)
        return PromptLookup(**settings).lookup(tokens, torch.tensor([len(r) for r in rows]), block_size).tolist()

    last_occurrence = [1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]  # [1 2 3] at 0 and 4: the later one wins
    longest_first = [5, 8, 9, 1, 4, 6, 9, 2, 8, 9]  # [8 9] at 1 beats [9] at 6
    none = [1, 2, 3, 4]
    overlapping = [4, 4, 4, 4]  # [4 4 4] at 0 overlaps the suffix at 1: allowed, one token follows
    assert propose([last_occurrence, longest_first, none, overlapping]) == [
        [8, 5, 1, 2, 3, F, F],  # what follows runs out at the end of the row: filler, not the junk after it
        [1, 4, 6, 9, 2, 8, 9],
        [F] * 7,
        [4, F, F, F, F, F, F],
    ]
    assert propose([last_occurrence], block_size=4) == [[8, 5, 1]]  # B - 1 slots
    assert propose([last_occurrence], num_tokens=2) == [[8, 5, F, F, F, F, F]]
    assert propose([longest_first], max_ngram=1) == [[2, 8, 9, F, F, F, F]]
    assert propose([[1, 2, 1, 3, 1]], min_ngram=2) == [[F] * 7]  # only a 1-gram recurs
    assert propose([[3]]) == [[F] * 7]

    # Random short rows over a small vocabulary (so n-grams recur), against the plain rule.
    g = torch.Generator().manual_seed(random.randrange(10_000))
    for _ in range(20):
        rows = [torch.randint(1, 5, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (6,), generator=g)]
        max_n = int(torch.randint(1, 5, (), generator=g))
        min_n = int(torch.randint(1, max_n + 1, (), generator=g))
        k = int(torch.randint(1, 8, (), generator=g))
        want = [lookup_reference(r, max_n, min_n, k, 7, F, with_match=True) for r in rows]
        assert propose(rows, max_ngram=max_n, min_ngram=min_n, num_tokens=k) == [p for p, _, _ in want]
        lookup = PromptLookup(max_ngram=max_n, min_ngram=min_n, num_tokens=k)
        lengths = torch.tensor([len(r) for r in rows])
        follow, ngram = lookup.find(torch.tensor([r + [7] * (30 - len(r)) for r in rows]), lengths)
        assert ngram.tolist() == [n for _, n, _ in want]
        assert lookup.available(lengths, follow, 8).tolist() == [taken for _, _, taken in want]


def test_prompt_lookup_at_every_prefix_is_the_lookup_of_each_prefix():
    """`follows` and `matched_lengths` (every prefix of one text at once, through an n-gram index) against `lookup`
    run on each prefix alone: where its proposal starts, and how many of its proposals the text then confirms."""
    # Hand-made: [1 2 3] recurs, so at the second 3 (position 6) the lookup proposes 4 5 (then the row ends).
    text = torch.tensor([1, 2, 3, 4, 5, 2, 3, 4, 9])
    lookup = PromptLookup()
    assert lookup.follows(text).tolist() == [-1, -1, -1, -1, -1, 2, 3, 4, -1]
    assert lookup.matched_lengths(text, 4).tolist() == [0, 0, 0, 0, 0, 2, 1, 0, 0]  # at 5: 3 4 | 9 breaks the third
    counted = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1]).bool()  # an untrained token stops the count
    assert lookup.matched_lengths(text, 4, counted).tolist() == [0, 0, 0, 0, 0, 1, 0, 0, 0]

    seed = random.randrange(10_000)
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    for _ in range(30):
        length = int(torch.randint(1, 60, (), generator=g))
        text = torch.randint(0, int(torch.randint(2, 6, (), generator=g)), (length,), generator=g) + 3
        max_n = int(torch.randint(1, 5, (), generator=g))
        min_n = int(torch.randint(1, max_n + 1, (), generator=g))
        block_size = int(torch.randint(2, 10, (), generator=g))
        k = int(torch.randint(1, block_size, (), generator=g))
        lookup = PromptLookup(max_ngram=max_n, min_ngram=min_n, num_tokens=k, filler=-1)  # -1: no token of the text
        counted = torch.rand(length, generator=g) < 0.9
        proposals = lookup.lookup(text.expand(length, -1), torch.arange(1, length + 1), block_size)
        follows, matched = lookup.follows(text), lookup.matched_lengths(text, block_size, counted)
        _, ngram = lookup.find(text.expand(length, -1), torch.arange(1, length + 1))
        assert torch.equal(lookup.matches(text)[1], ngram), f"seed {seed}"
        for a in range(length):
            proposal, f = proposals[a].tolist(), int(follows[a])
            taken = [int(text[f + j]) if f >= 0 and f + j <= a and j < k else -1 for j in range(block_size - 1)]
            assert proposal == taken, f"seed {seed}, at {a}"
            n = 0
            while n < block_size - 1 and a + 1 + n < length and counted[a + 1 + n] and proposal[n] == text[a + 1 + n]:
                n += 1
            assert matched[a] == n, f"seed {seed}, at {a}"


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(max_ngram=0), "pld.max_ngram=0"),
        (dict(min_ngram=0), "pld.min_ngram=0"),
        (dict(min_ngram=4), "pld.min_ngram=4 is above pld.max_ngram=3"),
        (dict(num_tokens=0), "pld.num_tokens=0"),
    ],
)
def test_prompt_lookup_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        PromptLookup(**settings)


def test_prompt_lookup_refuses_more_tokens_than_a_block_holds(tiny):
    with pytest.raises(ValueError, match="pld.num_tokens=8 does not fit a block of block_size=8"):
        spec.speculative_generate(tiny, PromptLookup(num_tokens=8), [[5, 6]], 8, 4)
