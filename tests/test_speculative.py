"""Speculative decoding is lossless: greedy output is the target's own, sampled output follows its distribution."""

import random

import pytest
import torch
from fresh_forward import fresh_block_output
from scipy.stats import chisquare

from dflash2 import DFlash2DraftModel
from dflash2.decoding import distributions, drafting, hybrid
from dflash2.decoding import speculative as spec
from dflash2.decoding.hybrid import Hybrid, NgramRule
from dflash2.decoding.lookup import PromptLookup
from dflash2.model import kernels
from dflash2.model.kernels import _backend
from dflash2.target.model import TargetModel
from dflash2.testing import tiny_draft_config, tiny_target

DRAFT_KINDS = {
    "dflash": dict(conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0),
    "dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
    # A window shorter than the prompts plus outputs, so that the sliding layer's queries lose context.
    "sliding": dict(
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=4,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=9,
    ),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_target(target_layer_ids=[1, 2])


def make_draft(target, kind, block_size, seed, scale=0.2, **over):
    draft = DFlash2DraftModel(tiny_draft_config(target, block_size=block_size, **DRAFT_KINDS[kind] | over))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return draft.eval()


def random_prompts(seed, n, vocab):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for length in lengths]


class Oracle:
    """Proposals forced to the reference continuation (some slots corrupted), to exercise long accepts and the bonus
    after a fully accepted block. A request is recognised by its anchor token at the anchor's position. It also
    records what the drafter computed for each request, to be checked against a fresh, uncached forward."""

    def __init__(self, prompts, reference, vocab, wrong, seed, reach=None):
        self.sequences = [p + r.output_ids for p, r in zip(prompts, reference, strict=True)]
        self.vocab, self.wrong, self.reach = vocab, wrong, reach  # reach: corrupt only one of the first slots
        self.g = torch.Generator().manual_seed(seed)
        self.anchor_positions = None
        self.seen = []  # (sequence, anchor position, draft hidden of the proposing slots)

    def watch(self, draft):
        forward = draft.forward

        def recording(block_embeds, block_positions, *args, **kwargs):
            self.anchor_positions = block_positions[:, 0].tolist()
            return forward(block_embeds, block_positions, *args, **kwargs)

        draft.forward = recording

    def wrap(self, propose):
        def forced(draft, head, hidden, anchors, **kwargs):
            tokens, q = propose(draft, head, hidden, anchors, **kwargs)
            tokens = tokens.clone()
            for row, (pos, anchor) in enumerate(zip(self.anchor_positions, anchors.tolist(), strict=True)):
                match = [s for s in self.sequences if len(s) > pos and s[pos] == anchor]
                if len(match) != 1:  # two requests may share a token at one position: no way to tell them apart
                    continue
                self.seen.append((match[0], pos, hidden[row]))
                truth = match[0][pos + 1 : pos + tokens.shape[1] + 1]
                tokens[row, : len(truth)] = torch.tensor(truth)
                # A request's first block is always right (so every run reaches a full accept and its bonus);
                # later ones lose one random slot with probability `wrong`.
                first = all(seq is not match[0] for seq, _, _ in self.seen[:-1])
                if truth and not first and torch.rand((), generator=self.g) < self.wrong:
                    slot = int(torch.randint(min(len(truth), self.reach or len(truth)), (), generator=self.g))
                    tokens[row, slot] = int(torch.randint(4, self.vocab, (), generator=self.g))
            return tokens, q

        return forced


def test_target_generate_is_the_models_own_greedy_generation(tiny):
    prompts = random_prompts(random.randrange(10_000), 3, tiny.vocab_size)
    ours = spec.target_generate(tiny, prompts, 10, spec.Sampling(batch_size=2))
    for prompt, out in zip(prompts, ours, strict=True):
        hf = tiny.model.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        assert out.output_ids == hf[0, len(prompt) :].tolist()
        assert out.accept_lengths == [1] * 9


@pytest.fixture(scope="module")
def greedy_case(tiny):
    """Fresh prompts, the target's own greedy outputs, and a stop token from the middle of the first output."""
    prompts = random_prompts(random.randrange(10_000), 4, tiny.vocab_size)
    free = spec.target_generate(tiny, prompts, MAX_NEW, spec.Sampling(batch_size=4))
    stop = free[0].output_ids[MAX_NEW // 2]
    # Greedy decoding with a stop token is the free run cut after the stop's first occurrence.
    with_stop = [g.output_ids[: g.output_ids.index(stop) + 1] if stop in g.output_ids else g.output_ids for g in free]
    return prompts, free, stop, with_stop


MAX_NEW = 16


@pytest.mark.parametrize(
    "kind, block_size, oracle",
    [
        ("dflash", 4, False),
        ("dflash", 8, False),
        ("dflash2", 4, False),
        ("dflash2", 8, False),
        ("dflash", 4, True),
        ("dflash2", 8, True),
        ("sliding", 8, True),
    ],
)
def test_greedy_speculative_output_is_the_targets_greedy_output(
    tiny, greedy_case, kind, block_size, oracle, monkeypatch
):
    prompts, free, stop, reference = greedy_case
    seed = random.randrange(10_000)
    draft = make_draft(tiny, kind, block_size, seed)
    if oracle:
        forced = Oracle(prompts, free, tiny.vocab_size, wrong=0.5, seed=seed)
        forced.watch(draft)
        monkeypatch.setattr(drafting, "propose", forced.wrap(drafting.propose))
    out = spec.speculative_generate(
        tiny, draft, prompts, block_size, MAX_NEW, spec.Sampling(stop_ids=[stop], batch_size=3)
    )
    assert [g.output_ids for g in out] == reference
    for got in out:
        assert len(got.output_ids) == 1 + sum(got.accept_lengths)
        assert all(1 <= n <= block_size for n in got.accept_lengths)
    lengths = [n for g in out for n in g.accept_lengths]
    if oracle:  # the test itself must reach the long-accept and bonus paths
        assert max(lengths) == block_size and sum(lengths) / len(lengths) > 2
        assert_drafts_match_fresh_forwards(tiny, draft, forced.seen, block_size)


def test_compacted_caches_decode_exactly_and_stay_small(tiny, monkeypatch):
    """Proposals that are mostly rejected leave most slots masked: compaction must drop them from both caches
    (the widths shrink) without changing a token or what the drafter computes."""
    seed = random.randrange(10_000)
    prompts = random_prompts(seed, 4, tiny.vocab_size)
    # Long enough that the masked slots (6 or 7 per step after each request's first block) outgrow the text.
    free = spec.target_generate(tiny, prompts, 40, spec.Sampling(batch_size=4))
    reference = [g.output_ids for g in free]
    draft = make_draft(tiny, "dflash2", 8, seed)
    forced = Oracle(prompts, free, tiny.vocab_size, wrong=1.0, seed=seed, reach=2)
    forced.watch(draft)
    monkeypatch.setattr(drafting, "propose", forced.wrap(drafting.propose))
    widths = []

    def recording(rows, cache, draft_cache):
        before = (rows.key_mask.shape[1], cache.get_seq_length(), draft_cache.length)
        rows = compact(rows, cache, draft_cache)
        after = (rows.key_mask.shape[1], cache.get_seq_length(), draft_cache.length)
        widths.append((before, after, rows.key_mask[:, : draft_cache.length].sum(-1).tolist()))
        return rows

    compact = spec.compact
    monkeypatch.setattr(spec, "compact", recording)
    out = spec.speculative_generate(tiny, draft, prompts, 8, 40, spec.Sampling(batch_size=4))
    assert [g.output_ids for g in out] == reference
    shrunk = [(b, a) for b, a, _ in widths if a != b]
    assert shrunk, "no step compacted the caches"
    for (mask_b, target_b, draft_b), (mask_a, target_a, draft_a) in shrunk:
        assert mask_a == target_a < target_b == mask_b and draft_a < draft_b
        assert mask_a - draft_a == mask_b - draft_b  # the slots the drafter has not taken in yet stay put
    for _, (_, _, settled), kept in widths:  # after a compaction the widest row has no holes
        assert max(kept) <= settled <= 2 * max(kept) or settled == 0
    assert_drafts_match_fresh_forwards(tiny, draft, forced.seen, 8)


def assert_drafts_match_fresh_forwards(target, draft, seen, block_size):
    """The drafter's cached, masked context (rejected slots, padding, finished rows dropped) must give what one
    uncached forward over exactly the committed tokens gives."""
    assert len(seen) > 5
    for sequence, pos, hidden in seen:
        fresh = fresh_block_output(target, draft, sequence, pos, block_size)
        torch.testing.assert_close(hidden, fresh, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(_backend.triton is None, reason="triton is not installed")
def test_triton_and_reference_walks_decode_identically(tiny, monkeypatch):
    seed = random.randrange(10_000)
    prompts = random_prompts(seed, 2, tiny.vocab_size)
    # Sizeable codebooks, so the walk leaves the argmax path.
    draft = make_draft(tiny, "dflash2", 4, seed, scale=0.5)
    if torch.cuda.is_available():  # the compiled kernel; without a GPU, conftest.py has set TRITON_INTERPRET=1
        tiny = tiny_target(target_layer_ids=[1, 2], device="cuda")
        draft = draft.cuda()
    seen = {}

    def recording(*args, **kwargs):
        tokens, q = real(*args, **kwargs)
        seen.setdefault(kernels.get_backend(), []).append(tokens)
        return tokens, q

    real = drafting.propose
    monkeypatch.setattr(drafting, "propose", recording)
    outs = {}
    for name in ("triton", "torch"):
        with kernels.backend(name):
            outs[name] = spec.speculative_generate(tiny, draft, prompts, 4, 6, spec.Sampling(batch_size=2))
    assert [g.output_ids for g in outs["triton"]] == [g.output_ids for g in outs["torch"]]
    assert len(seen["triton"]) == len(seen["torch"]) > 0
    for a, b in zip(seen["triton"], seen["torch"], strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- sampling
def test_verify_resamples_to_the_target_distribution():
    """One slot, many rows: accepted draft tokens plus residual resamples must be distributed as p exactly."""
    g = torch.Generator().manual_seed(random.randrange(10_000))
    vocab, rows = 8, 100_000
    logits = (torch.randn(1, 2, vocab, generator=g) * 1.5).expand(rows, 2, vocab)
    q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, -1).expand(rows, 1, vocab)
    drafted = torch.multinomial(q[:, 0], 1, replacement=True, generator=g)
    p = torch.softmax(logits[0, 0], -1)

    def first_tokens(q_used):
        accepted, bonus = distributions.verify(logits, drafted, q_used, 1.0, 0, 1.0, g)
        return torch.where(accepted == 1, drafted[:, 0], bonus)

    expected = (p.double() / p.double().sum() * rows).numpy()
    good = chisquare(torch.bincount(first_tokens(q), minlength=vocab).numpy(), expected).pvalue
    greedy_q = torch.nn.functional.one_hot(q.argmax(-1), vocab).float()  # the q a greedy walk would report
    bad = chisquare(torch.bincount(first_tokens(greedy_q), minlength=vocab).numpy(), expected).pvalue
    assert good > 1e-4  # fresh seeds: a correct verify fails 1 run in 10^4
    assert bad < 1e-6


def small_target(vocab=8, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).float()
        with torch.no_grad():
            model.lm_head.weight.normal_(0, 0.3)  # peaked enough that contexts differ, flat enough to accept
    return TargetModel(model, None, target_layer_ids=[0, 1])


def exact_joint(target, prompt, temperature, top_k):
    """P(x0, x1, x2) of the target's own sampling, enumerated: [V, V, V]."""
    v = target.vocab_size
    pairs = torch.cartesian_prod(torch.arange(v), torch.arange(v))
    seqs = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], -1)
    logits = target.forward(seqs).logits[:, len(prompt) - 1 :].float() / temperature
    if top_k:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    p = torch.softmax(logits, -1)  # [V*V, 3, V]: p0, p1 | x0, p2 | x0, x1
    p0, p1, p2 = p[0, 0], p[::v, 1], p[:, 2].view(v, v, v)
    return p0[:, None, None] * p1[:, :, None] * p2


@pytest.mark.parametrize(
    "kind, temperature, top_k",
    [("dflash2", 1.0, 0), ("dflash2", 0.7, 5), ("dflash", 1.0, 0), ("pld", 0.7, 5), ("hybrid", 1.0, 0)],
)
def test_sampled_tokens_follow_the_target_distribution(kind, temperature, top_k, monkeypatch):
    target = small_target()
    if kind == "pld":
        draft = PromptLookup()
    else:
        draft = make_draft(
            target,
            "dflash2" if kind == "hybrid" else kind,
            4,
            seed=11,
            scale=0.3,
            target_layer_ids=[0, 1],
            mask_token_id=7,
            conv_group_size=0 if kind == "dflash" else 8,
            selector_rank=0 if kind == "dflash" else 4,
        )
    if kind == "hybrid":  # a 1-token match gives lookup the rows whose first token recurs, the drafter the rest
        draft = Hybrid(drafting.Drafter(target, draft, True), PromptLookup(), NgramRule(min_ngram=1, min_tokens=1))
    prompt, n = [1, 5, 2, 6, 3], 4000
    sources = []
    expected = exact_joint(target, prompt, temperature, top_k).flatten().double()

    def pvalue():
        out = spec.speculative_generate(
            target,
            draft,
            [prompt] * n,
            4,
            3,
            spec.Sampling(temperature=temperature, top_k=top_k, batch_size=n),
            generator=torch.Generator().manual_seed(5),
        )
        sources.extend(s for g in out for s in g.proposers)
        codes = torch.tensor([g.output_ids for g in out]) @ torch.tensor([64, 8, 1])
        observed = torch.bincount(codes, minlength=512).double()
        counts = expected / expected.sum() * n
        big = counts >= 5  # pool the rare cells so the chi-square approximation holds
        obs = torch.cat([observed[big], observed[~big].sum()[None]])
        exp = torch.cat([counts[big], counts[~big].sum()[None]])
        return chisquare(obs.numpy(), exp.numpy()).pvalue

    assert pvalue() > 1e-3
    if kind == "hybrid":  # the test reaches steps of both proposers
        assert sources.count("lookup") > n / 4 and sources.count("drafter") > n / 4
    if kind in ("pld", "hybrid"):  # lookups claimed to be drawn from a uniform q instead of point masses are caught
        uniform = lambda d, v: torch.full((*d.shape, v), 1 / v)  # noqa: E731
        monkeypatch.setattr(distributions, "point_mass", uniform)
        monkeypatch.setattr(hybrid, "point_mass", uniform)
        assert pvalue() < 1e-6
    if kind == "dflash2":  # the same run with the q a greedy walk reports (one-hot) must be caught
        real = distributions.selector_q
        monkeypatch.setattr(
            distributions,
            "selector_q",
            lambda c, q, v: real(c, torch.nn.functional.one_hot(q.argmax(-1), q.shape[-1]).float(), v),
        )
        assert pvalue() < 1e-6
