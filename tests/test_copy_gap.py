"""The copy gap (dflash2.evaluation.copy_gap): prompt lookup's accept length replayed at each step of a greedy run,
checked on hand-made runs whose lookups are worked out by hand and against prompt lookup's own decoding."""

import random

import pytest
import torch

from dflash2.decoding import speculative
from dflash2.decoding.lookup import PromptLookup
from dflash2.evaluation.copy_gap import copy_gap, lookup_accepts
from dflash2.testing import tiny_target

# Three hand-made runs at B = 4 (three proposals a step); output[0] comes from the prefill, each step anchors at the
# last committed token. The lookup (n-grams 3..1, the latest earlier occurrence wins) proposes, step by step:
# A  prompt 5 6 7 8 5 6 9, output 5 6 7 8 1, the drafter committing 3 then 1 tokens.
#    step 1, anchor 5 (output[0]): only the 1-gram [5] occurs before, last at prompt[4] -> proposes 6 9 5 (the
#    earliest copy, prompt[0], would give 6 7 8); 6 matches output[1], 9 is not output[2]: lookup commits 2.
#    step 2, anchor 8 (output[3]): [6 7 8] occurs at prompt[1] -> proposes 5 6 9; output[4] = 1: lookup commits 1.
# B  prompt 1 2 3, output 1 2 3, one step of 2: [1] occurs at prompt[0] -> 2 3 1; 2 and 3 match and the output
#    ends there, so the lookup commits 2 (no bonus token after the output's end).
# C  prompt 4, output 5 0 0, one step of 2: nothing matches, the block is filler (0) -> 0 0 0; both 0s match, as in
#    prompt lookup's own run: the lookup commits 2.
A = {"prompt_ids": [5, 6, 7, 8, 5, 6, 9], "output_ids": [5, 6, 7, 8, 1], "accept_lengths": [3, 1]}
B = {"prompt_ids": [1, 2, 3], "output_ids": [1, 2, 3], "accept_lengths": [2]}
C = {"prompt_ids": [4], "output_ids": [5, 0, 0], "accept_lengths": [2]}
LOOKUP_BY_HAND = [[2, 1], [2], [2]]


def accepts(sample: dict, block_size: int = 4) -> list[int]:
    keys = ("prompt_ids", "output_ids", "accept_lengths")
    return lookup_accepts(*(sample[k] for k in keys), block_size, PromptLookup())


def test_lookup_accepts_by_hand():
    assert [accepts(s) for s in (A, B, C)] == LOOKUP_BY_HAND
    assert accepts(A, block_size=2) == [2, 1]  # one proposal a step: 6, then 5
    assert accepts({"prompt_ids": [1], "output_ids": [2], "accept_lengths": []}) == []  # stopped at the prefill


def test_copy_gap_by_hand():
    # Steps, drafter vs lookup: A 3 vs 2, 1 vs 1; B 2 vs 2; C 2 vs 2. Copyable: all but A's second.
    gap = copy_gap([A, B, C], 4)
    assert gap["steps"] == 4 and gap["copyable_share"] == pytest.approx(3 / 4)
    assert gap["tau_copyable"] == pytest.approx((3 + 2 + 2) / 3) and gap["tau_other"] == 1.0
    assert gap["lookup_tau_copyable"] == pytest.approx((2 + 2 + 2) / 3)
    # The lookup drafter=pld uses with its default settings (configs/evaluate.yaml), num_tokens resolved at B.
    assert gap["lookup"] == {"max_ngram": 3, "min_ngram": 1, "num_tokens": 3, "filler": 0}
    assert set(gap) == {"steps", "copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable", "lookup"}

    only_copyable = copy_gap([B, C], 4)  # nothing elsewhere: no tau there
    assert only_copyable["copyable_share"] == 1.0 and only_copyable["tau_other"] is None
    assert only_copyable["tau_copyable"] == 2.0 and only_copyable["lookup_tau_copyable"] == 2.0
    nothing_copyable = copy_gap([A | {"output_ids": [5, 1, 7, 8, 1]}], 4)  # 1 where the lookup proposed 6
    assert nothing_copyable["copyable_share"] == 0.0 and nothing_copyable["tau_other"] == 2.0
    assert nothing_copyable["tau_copyable"] is None and nothing_copyable["lookup_tau_copyable"] is None
    empty = copy_gap([{"prompt_ids": [1], "output_ids": [2], "accept_lengths": []}], 4)
    assert empty["steps"] == 0 and empty["copyable_share"] == 0.0 and empty["tau_other"] is None

    narrow = copy_gap([A, B, C], 4, PromptLookup(max_ngram=1, num_tokens=1))  # one proposal, 1-grams only
    assert narrow["lookup"] == {"max_ngram": 1, "min_ngram": 1, "num_tokens": 1, "filler": 0}


def test_copy_gap_replays_prompt_lookups_own_steps():
    """Replaying prompt lookup's own greedy run at its own anchors must give back every accept length it measured:
    the replay starts each step where the decode loop did and counts acceptance as the verify does."""
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    target = tiny_target()
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(4):
        piece = torch.randint(4, target.vocab_size, (int(torch.randint(2, 6, (), generator=g)),), generator=g)
        prompts.append(piece.tolist() * 3)
    block_size = random.Random(seed).choice([4, 8])
    out = speculative.speculative_generate(
        target, PromptLookup(), prompts, block_size, 24, speculative.Sampling(batch_size=2)
    )
    assert max(n for o in out for n in o.accept_lengths) >= 2  # some lookups were accepted
    for prompt, o in zip(prompts, out, strict=True):
        sample = {"prompt_ids": prompt, "output_ids": o.output_ids, "accept_lengths": o.accept_lengths}
        assert accepts(sample, block_size) == o.accept_lengths
    samples = [
        {"prompt_ids": p, "output_ids": o.output_ids, "accept_lengths": o.accept_lengths}
        for p, o in zip(prompts, out, strict=True)
    ]
    # The lookup against itself: on its copyable steps it is its own tau there.
    gap = copy_gap(samples, block_size)
    assert gap["tau_copyable"] == gap["lookup_tau_copyable"] and gap["tau_other"] in (None, 1.0)
