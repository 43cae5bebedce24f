"""The whole greedy step (dflash2/decoding/graphed.py) decodes what the per-piece step and the plain loop decode: the
same tokens, accept lengths, proposers and margins, through compaction, finished rows and padding rows; compiled, it is
one graph per kind of step, compiled once for every batch and call."""

import dataclasses
import random

import pytest
import torch
from test_lookup import repeating_prompts
from test_speculative import make_draft
from test_static_decode import BLOCK, MAX_NEW, counting_compactions, stop_token
from torch._dynamo.utils import counters

from dflash2.decoding import graphed
from dflash2.decoding import speculative as spec
from dflash2.decoding import static as fast
from dflash2.decoding.drafting import Drafter
from dflash2.decoding.hybrid import Hybrid, NgramRule
from dflash2.decoding.lookup import PromptLookup
from dflash2.testing import tiny_target


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(target_layer_ids=[1, 2])


def proposer_of(tiny, kind, seed):
    if kind == "pld":
        return PromptLookup()
    draft = make_draft(tiny, "dflash" if kind == "dflash" else "dflash2", BLOCK, seed)
    if kind == "hybrid":
        return Hybrid(Drafter(tiny, draft, True), PromptLookup(), NgramRule(min_ngram=1, min_tokens=1))
    return draft


PIECES = "pieces"


def counting_whole_steps(monkeypatch, pieces=False):
    """The kinds of the whole steps run, in order; with `pieces`, every step in pieces too, as PIECES."""
    kinds = []
    real, real_pieces = graphed.WholeSteps.__call__, fast.eager_step

    def counted(self, kind, *args):
        kinds.append(kind)
        return real(self, kind, *args)

    def counted_pieces(*args):
        kinds.append(PIECES)
        return real_pieces(*args)

    monkeypatch.setattr(graphed.WholeSteps, "__call__", counted)
    if pieces:
        monkeypatch.setattr(fast, "eager_step", counted_pieces)
    return kinds


def generations(target, proposer, prompts, batch_size, stop, fast_decode=None):
    sampling = spec.Sampling(stop_ids=[stop], batch_size=batch_size, record_margins=True)
    if fast_decode is None:
        return spec.speculative_generate(target, proposer, prompts, BLOCK, MAX_NEW, sampling)
    return fast.speculative_generate(target, proposer, prompts, BLOCK, MAX_NEW, sampling, fast=fast_decode)


@pytest.mark.parametrize(
    "kind, batch_size", [("dflash2", 3), ("dflash2", 1), ("dflash", 2), ("pld", 3), ("hybrid", 1), ("hybrid", 3)]
)
def test_whole_steps_decode_what_the_pieces_and_the_plain_loop_decode(tiny, kind, batch_size, monkeypatch):
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    prompts = repeating_prompts(seed, 2 if batch_size == 1 else 4, tiny.vocab_size)
    proposer = proposer_of(tiny, kind, seed)
    stop = stop_token(tiny, proposer, prompts, 0.0, batch_size, seed)
    capacity = max(map(len, prompts)) + MAX_NEW + 3 * BLOCK  # the smallest: compaction comes early
    compactions = counting_compactions(monkeypatch)
    kinds = counting_whole_steps(monkeypatch)
    plain = generations(tiny, proposer, prompts, batch_size, stop)
    pieces = generations(
        tiny, proposer, prompts, batch_size, stop, fast.FastDecode(capacity=capacity, whole_step=False)
    )
    assert kinds == []
    whole = generations(tiny, proposer, prompts, batch_size, stop, fast.FastDecode(capacity=capacity))
    for reference in (plain, pieces):
        assert [g.output_ids for g in whole] == [g.output_ids for g in reference]
        assert [g.accept_lengths for g in whole] == [g.accept_lengths for g in reference]
        assert [g.proposers for g in whole] == [g.proposers for g in reference]
        for a, b in zip(whole, reference, strict=True):
            torch.testing.assert_close(torch.tensor(a.margins), torch.tensor(b.margins), rtol=1e-5, atol=1e-5)
    # The run reached what it tests: whole steps (all but a batch's first, where a drafter may take in a prompt of
    # another width), compactions, and for the hybrid both kinds of step.
    batches = [whole[i : i + batch_size] for i in range(0, len(whole), batch_size)]
    steps = sum(max(len(g.accept_lengths) for g in b) for b in batches)
    assert steps - len(batches) * (kind != "pld") <= len(kinds) <= steps and compactions
    if kind == "hybrid":
        assert {"lookup", "drafter"} <= {s for g in whole for s in g.proposers}
    if kind == "hybrid" and batch_size == 1:  # each whole step is the lookup step exactly where lookup proposed
        steps = counting_whole_steps(monkeypatch, pieces=True)
        assert_kinds_follow_the_proposers(steps, generations(tiny, proposer, prompts, 1, stop, fast.FastDecode()))


def assert_kinds_follow_the_proposers(kinds, generations):
    """At batch 1, where each step is one request's: a whole step ran the lookup step exactly where lookup proposed,
    the hybrid's step where the drafter did (`PIECES` marks a step run in pieces)."""
    proposers = [p for g in generations for p in g.proposers]
    assert len(kinds) == len(proposers)
    for kind, proposer in zip(kinds, proposers, strict=True):
        if kind != PIECES:
            assert kind == (graphed.LOOK if proposer == "lookup" else graphed.BOTH)


def test_sampled_steps_run_in_pieces(tiny, monkeypatch):
    """A captured graph cannot draw from the run's generator: at T > 0 every step runs in pieces."""
    kinds = counting_whole_steps(monkeypatch)
    prompts = repeating_prompts(random.randrange(10_000), 2, tiny.vocab_size)
    sampling = spec.Sampling(temperature=1.0, batch_size=2)
    fast.speculative_generate(tiny, PromptLookup(), prompts, BLOCK, 8, sampling, fast=fast.FastDecode())
    assert kinds == []


@pytest.mark.slow
def test_compiled_whole_steps_are_one_graph_each_compiled_once(tiny):
    """torch.compile of the whole step (on a CPU: no CUDA graph, the same graph capture): one graph per kind of step,
    no break, and no recompile for another batch of the call or a second call."""
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    prompts = repeating_prompts(seed, 3, tiny.vocab_size)
    hybrid = proposer_of(tiny, "hybrid", seed)
    capacity = max(map(len, prompts)) + MAX_NEW + 3 * BLOCK
    sampling = spec.Sampling(batch_size=2)
    counters.clear()
    compiled = fast.FastDecode(compile="default", capacity=capacity)
    first = fast.speculative_generate(tiny, hybrid, prompts, BLOCK, MAX_NEW, sampling, fast=compiled)
    built = counters["stats"]["unique_graphs"]
    again = fast.speculative_generate(tiny, hybrid, prompts, BLOCK, MAX_NEW, sampling, fast=compiled)
    plain = spec.speculative_generate(tiny, hybrid, prompts, BLOCK, MAX_NEW, sampling)
    assert [g.output_ids for g in first] == [g.output_ids for g in again] == [g.output_ids for g in plain]
    assert [g.accept_lengths for g in first] == [g.accept_lengths for g in plain]
    # A graph per kind of step: the hybrid's two whole steps, and of a batch's first step, in pieces, the verify and,
    # when its prompt happens to be one block wide, the drafter's forward and its ingest. The second call compiles
    # nothing: the same shapes, the same buffers.
    assert counters["stats"]["unique_graphs"] == built <= 5
    assert sum(counters["graph_break"].values()) == 0


def test_the_step_buffers_keep_their_addresses_from_batch_to_batch_and_call_to_call(tiny, monkeypatch):
    """A CUDA graph replays at fixed addresses: every batch of a shape, in every call, runs on the same buffers, each
    marked as a static address (which in-place updates under a CUDA graph need)."""
    seen = []
    real = graphed.WholeSteps.buffers

    def recording(self, *args):
        buffers = real(self, *args)
        seen.append({f.name: getattr(buffers, f.name) for f in dataclasses.fields(buffers)})
        return buffers

    monkeypatch.setattr(graphed.WholeSteps, "buffers", recording)
    prompts = repeating_prompts(random.randrange(10_000), 4, tiny.vocab_size)
    draft = proposer_of(tiny, "dflash2", 0)
    for _ in range(2):  # two calls of two batches each
        fast.speculative_generate(tiny, draft, prompts, BLOCK, 8, spec.Sampling(batch_size=2), fast=fast.FastDecode())
    assert len(seen) == 4
    for buffers in seen[1:]:
        assert all(buffers[name] is tensor for name, tensor in seen[0].items())
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in seen[0].values() if t is not None)
