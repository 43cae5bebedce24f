"""What each token is drawn from, and the verify rule (contract section 6): the target's distribution, the drafter's
proposals (`propose`: the selector's walk, or the head's argmax or sample) and the lossless check of a block against
the target's logits (`verify`). The decode loops (dflash2/decoding/speculative.py, dflash2/decoding/static.py) call
these; all randomness comes from the one `torch.Generator` they pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from dflash2.model.selector import head_logits

if TYPE_CHECKING:
    from dflash2.model.drafter import DFlash2DraftModel


# ---------------------------------------------------------------------------------------------- distributions
def target_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution the target samples from: softmax(logits / T) after top-k / top-p, fp32, any leading dims."""
    scores = logits.float().reshape(-1, logits.shape[-1]) / temperature
    if top_k and top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).view(logits.shape)


def sample(probs: torch.Tensor, generator: torch.Generator, live: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of probs [b, ..., V] -> [b, ...]. `live` (row indices, None = all): only those rows draw, in
    order, as a batch of just them would; the others get 0."""
    if live is not None:
        out = torch.zeros(probs.shape[:-1], dtype=torch.long, device=probs.device)
        out[live] = sample(probs[live], generator)
        return out
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def uniform(
    shape: tuple[int, ...], generator: torch.Generator, device: torch.device, live: torch.Tensor | None = None
) -> torch.Tensor:
    """torch.rand of shape [b, ...]; with `live` (row indices) only those rows draw, as in `sample`."""
    if live is None:
        return torch.rand(shape, generator=generator, device=device)
    out = torch.zeros(shape, device=device)
    out[live] = torch.rand((live.shape[0], *shape[1:]), generator=generator, device=device)
    return out


def selector_q(candidate_ids: torch.Tensor, q: torch.Tensor, vocab: int) -> torch.Tensor:
    """The walk's q over its K candidates [b, S, K] -> the same distribution over the vocabulary [b, S, vocab]."""
    return q.new_zeros(*q.shape[:-1], vocab).scatter_(-1, candidate_ids, q)


def point_mass(proposals: torch.Tensor, vocab: int) -> torch.Tensor:
    """The q of a proposer that draws nothing (prompt lookup): all mass on each proposal [b, S] -> [b, S, vocab]."""
    return F.one_hot(proposals, vocab).float()


# ---------------------------------------------------------------------------------------------- draft and verify
def propose(
    draft: DFlash2DraftModel,
    lm_head_weight: torch.Tensor,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    temperature: float,
    use_selector: bool,
    vocab: int,
    generator: torch.Generator,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft hidden of the proposing slots [b, S, H] -> (tokens [b, S], q [b, S, vocab] or None when greedy).

    q is the distribution each token was really drawn from: the walk's softmax over its K candidates with a
    selector, the full-vocabulary softmax without one. `live`: the rows that draw (`sample`)."""
    b, n_slots, _ = hidden.shape
    greedy = temperature == 0
    selector = draft.candidate_selector if use_selector else None
    if selector is not None:
        candidates, unary = selector.compute_candidates(hidden, lm_head_weight)
        scores = selector.build_lattice(candidates, unary, hidden, anchors)
        # A greedy walk draws nothing: no uniforms either, so that a greedy step uses no generator at all.
        uniforms = (
            hidden.new_zeros(b, n_slots, dtype=torch.float32)
            if greedy
            else uniform((b, n_slots), generator, hidden.device, live)
        )
        temperatures = torch.full((b,), max(temperature, 1e-5), device=hidden.device)
        greedy_mask = torch.full((b,), greedy, dtype=torch.bool, device=hidden.device)
        tokens, q = selector.walk(candidates, scores, uniforms, temperatures, greedy_mask)
        return tokens, None if greedy else selector_q(candidates, q, vocab)
    logits = head_logits(hidden, lm_head_weight, draft.config.vocab_size)
    if greedy:
        return logits.argmax(-1), None
    q = torch.softmax(logits / temperature, dim=-1)
    return sample(q, generator, live), F.pad(q, (0, vocab - q.shape[-1]))


def verify(
    logits: torch.Tensor,
    proposals: torch.Tensor,
    q: torch.Tensor | None,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits over the block [b, B, V] verify proposals [b, B-1] -> (accepted [b], bonus token [b]).

    q [b, B-1, V] is what each proposal was drawn from; None: each proposal is a point mass (a deterministic
    proposer), which keeps sampling lossless too. Logits at block index j predict the token at j + 1, so proposal
    s is checked against logits[:, s - 1] and the bonus comes from logits[:, accepted]. `live`: the rows that draw
    (`sample`)."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if temperature == 0:
        best = logits.argmax(-1)
        accepted = (proposals == best[:, :-1]).long().cumprod(-1).sum(-1)
        return accepted, best[rows, accepted]
    p = target_probs(logits, temperature, top_k, top_p)
    if q is None:
        q = point_mass(proposals, p.shape[-1])
    p_d = p[:, :-1].gather(-1, proposals[..., None]).squeeze(-1)
    q_d = q.gather(-1, proposals[..., None]).squeeze(-1)
    # Accept d with probability min(1, p(d) / q(d)); q(d) > 0 because d was drawn from q.
    uniforms = uniform(proposals.shape, generator, logits.device, live)
    accepted = (uniforms * q_d < p_d).long().cumprod(-1).sum(-1)
    # A zero q after the last slot turns the residual max(p - q, 0) into p itself: the all-accepted bonus.
    q_after = F.pad(q, (0, 0, 0, 1))[rows, accepted]
    p_at = p[rows, accepted]
    residual = (p_at - q_after).clamp(min=0)
    # p == q leaves nothing to resample; rejection then has probability 0, any distribution is fine.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return accepted, sample(residual / residual.sum(-1, keepdim=True), generator, live)


def first_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    return sample(target_probs(logits, temperature, top_k, top_p), generator, live)
