"""The candidate selector: top-K per slot from the target head, then the best path through a K x K lattice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.model import kernels


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return cap * torch.tanh(x / cap) if cap is not None and cap > 0 else x


class CandidateSelector(nn.Module):
    """Scores `unary[s, c] + <A[pred] * P(h_s), B[cand_c]>` (contract section 5)."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        rank: int,
        top_k: int,
        output_multiplier: float = 1.0,
        final_logit_softcapping: float | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size, self.rank, self.top_k = vocab_size, rank, top_k
        self.output_multiplier, self.final_logit_softcapping = output_multiplier, final_logit_softcapping
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        # Plain parameters, not nn.Embedding: the contract names them without a `.weight` suffix.
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.hidden_projection.weight, std=self.hidden_projection.in_features**-0.5)
        nn.init.normal_(self.predecessor_codebook, std=1.0)
        # Zero successors make every transition score 0: a fresh selector walks the plain top-1 path.
        nn.init.zeros_(self.successor_codebook)

    def compute_candidates(
        self, hidden: torch.Tensor, lm_head_weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., H] -> (candidate_ids [..., K], unary [..., K] fp32) from a raw matmul with the head."""
        logits = head_logits(hidden, lm_head_weight, self.vocab_size)
        vals, cand = torch.topk(logits, self.top_k, dim=-1)
        return cand, self.unary(vals)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The candidates' unary scores from their raw head logits, fp32: scaled by the target's output multiplier,
        then soft-capped as its head caps them. Decoding and training both score candidates here."""
        return softcap(logits.float() * self.output_multiplier, self.final_logit_softcapping)

    def score(
        self,
        predecessor_ids: torch.Tensor,
        candidate_ids: torch.Tensor,
        unary: torch.Tensor,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        """predecessor_ids [b, S, P], candidate_ids/unary [b, S, K], hidden [b, S, H] -> scores [b, S, P, K]."""
        proj = self.hidden_projection(hidden).float()
        # Row lookups by F.embedding rather than indexing: the same rows, with embedding's backward for the repeated
        # ids instead of indexing's, which took 22 ms of a 141 ms SmolLM2 training step on an H200.
        pred = F.embedding(predecessor_ids, self.predecessor_codebook).float() * proj.unsqueeze(-2)
        succ = F.embedding(candidate_ids, self.successor_codebook).float()
        return unary.unsqueeze(-2) + torch.einsum("bspr,bscr->bspc", pred, succ)

    def build_lattice(
        self,
        candidate_ids: torch.Tensor,
        unary: torch.Tensor,
        hidden: torch.Tensor,
        anchor_token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Scores [b, S, K, K]: row p of slot s follows candidate p of slot s-1; slot 1 follows the anchor."""
        b, _, k = candidate_ids.shape
        first = anchor_token_ids.view(b, 1, 1).expand(b, 1, k)
        predecessors = torch.cat([first, candidate_ids[:, :-1]], dim=1)
        return self.score(predecessors, candidate_ids, unary, hidden)

    def gold_scores(
        self,
        candidate_ids: torch.Tensor,
        unary: torch.Tensor,
        hidden: torch.Tensor,
        previous_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Training scores [b, S, K] with the true previous token as predecessor of every slot."""
        return self.score(previous_ids.unsqueeze(-1), candidate_ids, unary, hidden).squeeze(-2)

    def walk(
        self,
        candidate_ids: torch.Tensor,
        scores: torch.Tensor,
        uniforms: torch.Tensor,
        temperatures: torch.Tensor,
        greedy_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens [b, S], q [b, S, K]): the path from the anchor and the distribution each slot came from."""
        return kernels.selector_walk(candidate_ids, scores, uniforms, temperatures, greedy_mask)


def head_logits(hidden: torch.Tensor, lm_head_weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The raw target head over the real vocabulary (rows past vocab_size are padding), in fp32. The head is the
    target's dense one (`TargetModel.lm_head_weight` refuses any other)."""
    return (hidden.to(lm_head_weight.dtype) @ lm_head_weight[:vocab_size].T).float()
