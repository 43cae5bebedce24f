"""The hybrid proposer (dflash2/decoding/hybrid.py): prompt lookup where its match passes the rule, the drafter
elsewhere. Greedy output stays the target's, the choice is the rule's at every step, the drafter's context holds every
verified slot after lookup steps, and a step that every row gives to lookup runs no drafter forward."""

import random
import types

import matplotlib
import pandas as pd
import pytest
import torch
from fresh_forward import fresh_block_output
from test_evaluation import config, export_draft, fake_wandb, read_run
from test_lookup import lookup_reference, repeating_prompts
from test_speculative import make_draft

from dflash2.commands import evaluate as command
from dflash2.commands.evaluate import evaluate
from dflash2.decoding import drafting
from dflash2.decoding import speculative as spec
from dflash2.decoding import static as fast
from dflash2.decoding.drafting import Drafter
from dflash2.decoding.hybrid import Hybrid, NgramRule
from dflash2.decoding.lookup import PromptLookup
from dflash2.evaluation.report import format_table, log_wandb
from dflash2.evaluation.settings import WandbSettings
from dflash2.evaluation.sweep import hybrid_figure, summary_table
from dflash2.testing import tiny_target

MAX_NEW, BLOCK = 24, 4
PATHS = ("plain", "static")


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(target_layer_ids=[1, 2])


ANY_MATCH = NgramRule(min_ngram=1, min_tokens=1)  # the tiny target's short texts: any match gives lookup its steps


def hybrid(target, draft, rule=ANY_MATCH, compile=None):
    return Hybrid(Drafter(target, draft, use_selector=True, compile=compile), PromptLookup(), rule)


def expected_sources(prompt, generation, rule):
    """What the rule picks at each verify step, replayed from the committed text with the plain lookup of
    tests/test_lookup.py: step i anchors at the output's token sum(accept_lengths[:i]) and sees the prompt and the
    output up to it."""
    text, anchor, picked = prompt + generation.output_ids, 0, []
    for n in generation.accept_lengths:
        _, ngram, taken = lookup_reference(text[: len(prompt) + anchor + 1], 3, 1, BLOCK - 1, BLOCK - 1, 0, True)
        enough = min(rule.min_tokens, BLOCK - 1)  # at least min_tokens, or all a smaller block's slots
        picked.append("lookup" if ngram >= rule.min_ngram and taken >= enough else "drafter")
        anchor += n
    return picked


def decode(target, proposer, prompts, batch_size, path="plain", temperature=0.0, seed=0):
    sampling = spec.Sampling(temperature=temperature, top_k=5, batch_size=batch_size)
    generator = torch.Generator().manual_seed(seed)
    if path == "plain":
        return spec.speculative_generate(target, proposer, prompts, BLOCK, MAX_NEW, sampling, generator=generator)
    return fast.speculative_generate(target, proposer, prompts, BLOCK, MAX_NEW, sampling, generator=generator)


@pytest.mark.parametrize("path", ["plain", "static"])
def test_hybrid_greedy_output_is_the_targets_and_each_step_is_the_rules(tiny, path):
    """The default rule (its min_tokens cut to a 4-token block's 3 slots). Some draws of the tiny target's text repeat
    no 2-gram at length: the next draw is taken then, so that both proposers take steps; every draw's output must be
    the target's and every step the rule's."""
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    draft = make_draft(tiny, "dflash2", BLOCK, seed)
    rule = NgramRule(min_ngram=2)
    for attempt in range(8):
        prompts = repeating_prompts(seed + attempt, 4, tiny.vocab_size)
        reference = spec.target_generate(tiny, prompts, MAX_NEW, spec.Sampling(batch_size=4))
        out = decode(tiny, hybrid(tiny, draft, rule), prompts, batch_size=3, path=path)
        assert [g.output_ids for g in out] == [g.output_ids for g in reference]
        for prompt, got in zip(prompts, out, strict=True):
            assert got.proposers == expected_sources(prompt, got, rule)
        steps = {s for g in out for s in g.proposers}
        if {"lookup", "drafter"} <= steps:
            break
    assert {"lookup", "drafter"} <= steps, "both proposers must take steps for the test to test anything"


def test_the_static_path_decodes_the_hybrid_as_the_plain_path_does(tiny):
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    prompts = repeating_prompts(seed, 3, tiny.vocab_size)
    draft = make_draft(tiny, "dflash2", BLOCK, seed)
    for temperature, batch_size in ((0.0, 2), (1.0, 2), (1.0, 1)):
        runs = [
            decode(tiny, hybrid(tiny, draft), prompts, batch_size, p, temperature, seed) for p in ("plain", "static")
        ]
        plain, static = ([(g.output_ids, g.accept_lengths, g.proposers) for g in run] for run in runs)
        assert static == plain, f"seed {seed}, T={temperature}, batch {batch_size}"


def test_a_lookup_step_runs_no_drafter_forward_and_the_drafter_sees_every_verified_slot(tiny, monkeypatch):
    """At batch 1 on the fast path: the drafter's forwards are exactly its own steps, and the hidden states of each
    are what one uncached forward over exactly the committed tokens gives, lookup steps before it included."""
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    draft = make_draft(tiny, "dflash2", BLOCK, seed)
    forwards, ingests, seen = [], [], []
    real_forward, real_ingest, real_propose = drafting.draft_forward, drafting.draft_ingest, drafting.propose

    def counted_forward(draft, embeds, block_positions, *args):
        forwards.append(int(block_positions[0, 0]))
        return real_forward(draft, embeds, block_positions, *args)

    def counted_ingest(*args):
        ingests.append(1)
        return real_ingest(*args)

    def recording(draft, head, hidden, anchors, **kwargs):
        seen.append((forwards[-1], hidden[0].clone()))
        return real_propose(draft, head, hidden, anchors, **kwargs)

    monkeypatch.setattr(drafting, "draft_forward", counted_forward)
    monkeypatch.setattr(drafting, "draft_ingest", counted_ingest)
    monkeypatch.setattr(drafting, "propose", recording)
    for attempt in range(5):  # a draw whose text gives lookup steps followed by drafter steps
        prompt = repeating_prompts(seed + attempt, 1, tiny.vocab_size)
        forwards.clear(), ingests.clear(), seen.clear()
        (out,) = decode(tiny, hybrid(tiny, draft), prompt, batch_size=1, path="static")
        sources = out.proposers
        if "lookup" in sources and "drafter" in sources[sources.index("lookup") :]:
            break
    assert "lookup" in sources and "drafter" in sources[sources.index("lookup") :]
    assert len(forwards) == sources.count("drafter") and len(ingests) == sources.count("lookup")
    sequence = prompt[0] + out.output_ids
    for pos, hidden in seen:
        torch.testing.assert_close(hidden, fresh_block_output(tiny, draft, sequence, pos, BLOCK), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "rule, message",
    [
        (NgramRule(min_ngram=0), "hybrid_rule.min_ngram=0"),
        (NgramRule(min_ngram=4), "hybrid_rule.min_ngram=4: an integer from pld.min_ngram=1 to pld.max_ngram=3"),
        (NgramRule(min_tokens=0), "hybrid_rule.min_tokens=0"),
        (NgramRule(min_tokens=1.5), "hybrid_rule.min_tokens=1.5"),
    ],
)
def test_the_hybrid_refuses_bad_rules_by_name(tiny, rule, message):
    with pytest.raises(ValueError, match=message):
        hybrid(tiny, make_draft(tiny, "dflash2", BLOCK, 0), rule)


# ---------------------------------------------------------------------------------------------- evaluate.py
def test_a_hybrid_run_reports_each_proposers_share_and_tau(tmp_path, monkeypatch):
    matplotlib.use("Agg")
    draft = export_draft(tiny_target(), tmp_path / "draft")
    common = [f"drafter={draft}", "bench.limit=3", "max_new_tokens=24", "batch_size=2", "block_size=4"]
    any_match = ["hybrid=ngram", "hybrid_rule.min_ngram=1", "hybrid_rule.min_tokens=1"]
    results = evaluate(config(*common, *any_match), tmp_path / "hybrid")
    _, samples = read_run(tmp_path / "hybrid")
    steps = [(who, n) for s in samples for who, n in zip(s["proposers"], s["accept_lengths"], strict=True)]
    assert {who for who, _ in steps} == {"lookup", "drafter"}, "both proposers must take steps"
    for name, stats in results["proposers"].items():
        mine = [n for who, n in steps if who == name]
        assert stats["steps"] == len(mine) and stats["share"] == pytest.approx(len(mine) / len(steps))
        assert stats["tau"] == pytest.approx(sum(mine) / len(mine))
    assert results["draft"]["hybrid"] == {"min_ngram": 1, "min_tokens": 1, "pld": PromptLookup().settings(4)}
    table = format_table(results)
    assert results["copy_gap"] is None and "prompt lookup took its steps in this hybrid run" in table
    lookup = results["proposers"]["lookup"]
    assert f"proposed by lookup {lookup['share']:.0%} of the steps (tau {lookup['tau']:.2f} there)" in table

    alone = evaluate(config(*common), tmp_path / "alone")
    assert alone["proposers"] is None and "proposed by" not in format_table(alone)
    summary = summary_table([results, alone])
    assert summary["lookup_share"][0] == pytest.approx(lookup["share"]) and pd.isna(summary["lookup_share"][1])
    assert "not a hybrid run" in summary["note"][1] and list(summary["draft"]) == ["draft+lookup", "draft"]
    assert hybrid_figure(summary) is not None and hybrid_figure(summary_table([alone])) is None
    assert "lookup_share" not in summary_table([alone])  # a sweep without a hybrid shows no hybrid columns

    logged = fake_wandb(monkeypatch, tmp_path)
    log_wandb(types.SimpleNamespace(wandb=WandbSettings(), config={}), results, tmp_path)
    assert logged["hybrid/lookup_share"] == lookup["share"] and logged["hybrid/tau_lookup"] == lookup["tau"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hybrid=ngrams"], "hybrid=ngrams: choose ngram"),
        (["hybrid=ngram", "hybrid_rule.min_ngram=0"], "hybrid_rule.min_ngram=0: an integer from pld.min_ngram=1"),
        (["hybrid=ngram", "hybrid_rule.min_ngram=4"], "hybrid_rule.min_ngram=4: an integer from pld.min_ngram=1"),
        (["hybrid=ngram", "hybrid_rule.min_tokens=0"], "hybrid_rule.min_tokens=0: an integer >= 1"),
        (["hybrid=ngram", "+hybrid_rule.max_tokens=3"], "hybrid_rule.max_tokens: not a setting of the ngram rule"),
        (["hybrid=ngram", "pld.num_tokens=16", "block_size=16"], "pld.num_tokens=16 does not fit a block"),
    ],
)
def test_bad_hybrid_settings_are_refused_before_anything_loads(tmp_path, monkeypatch, overrides, message):
    draft = export_draft(tiny_target(), tmp_path / "draft")
    monkeypatch.setattr(command, "_load_target", lambda *a: pytest.fail("the target was loaded first"))
    with pytest.raises(ValueError, match=message):
        command.evaluate(config(f"drafter={draft}", *overrides), tmp_path / "run")


def test_a_hybrid_needs_a_drafter(tmp_path, monkeypatch):
    monkeypatch.setattr(command, "_load_target", lambda *a: pytest.fail("the target was loaded first"))
    with pytest.raises(ValueError, match="hybrid=ngram pairs prompt lookup with a drafter, and drafter=pld is"):
        command.evaluate(config("drafter=pld", "hybrid=ngram"), tmp_path / "run")
