"""The selector's walk through the K x K lattice (contract section 5): a Triton kernel and its reference.

i_0 comes from row scores[b, 0, 0, :], i_s from row scores[b, s, i_{s-1}, :]. A greedy row takes the argmax (lowest
index on ties) and reports q one-hot; a sampling row draws from softmax(row / T) by inverse CDF with its uniform and
reports q = that softmax, the distribution the token really came from, which keeps verification lossless.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash2.model.kernels._backend import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _selector_walk_kernel(
        candidates_ptr,
        scores_ptr,
        uniforms_ptr,
        temperatures_ptr,
        greedy_ptr,
        tokens_ptr,
        q_ptr,
        n_slots: tl.constexpr,  # one compile per block size; a runtime bound breaks older Triton interpreters
        K: tl.constexpr,
    ):
        # One program walks one request: the slots depend on each other, the requests do not.
        request = tl.program_id(0).to(tl.int64)
        k = tl.arange(0, K)
        greedy = tl.load(greedy_ptr + request) != 0
        temperature = tl.load(temperatures_ptr + request)
        temperature = tl.where(greedy, 1.0, temperature)  # greedy rows may carry T = 0
        previous = tl.program_id(0) * 0  # an int32 tensor, so the loop-carried type never changes
        for s in range(n_slots):
            slot = request * n_slots + s
            row = tl.load(scores_ptr + (slot * K + previous) * K + k).to(tl.float32)
            best = tl.max(row, axis=0)
            argmax = tl.min(tl.where(row == best, k, K), axis=0)
            z = row / temperature
            e = tl.exp(z - tl.max(z, axis=0))
            probs = e / tl.sum(e, axis=0)
            below = tl.load(uniforms_ptr + slot) >= tl.cumsum(probs, axis=0)
            drawn = tl.minimum(tl.sum(below.to(tl.int32), axis=0), K - 1)
            choice = tl.where(greedy, argmax, drawn)
            q = tl.where(greedy, (k == argmax).to(tl.float32), probs)
            tl.store(q_ptr + slot * K + k, q)
            tl.store(tokens_ptr + slot, tl.load(candidates_ptr + slot * K + choice))
            previous = choice
else:
    _selector_walk_kernel = None


def _selector_walk_triton(
    candidate_ids: Tensor, scores: Tensor, uniforms: Tensor, temperatures: Tensor, greedy_mask: Tensor
) -> tuple[Tensor, Tensor]:
    batch, n_slots, k = candidate_ids.shape
    tokens = torch.empty(batch, n_slots, dtype=torch.int64, device=candidate_ids.device)
    q = torch.empty(batch, n_slots, k, dtype=torch.float32, device=candidate_ids.device)
    if batch and n_slots:
        _selector_walk_kernel[(batch,)](
            candidate_ids.to(torch.int64).contiguous(),
            scores.float().contiguous(),
            uniforms.float().contiguous(),
            temperatures.float().contiguous(),
            greedy_mask.to(torch.int32).contiguous(),
            tokens,
            q,
            n_slots=n_slots,
            K=k,
            num_warps=1,  # K <= a few hundred scores fit one warp's registers
        )
    return tokens, q


def selector_walk_reference(
    candidate_ids: Tensor, scores: Tensor, uniforms: Tensor, temperatures: Tensor, greedy_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """Plain PyTorch: a loop over the (few) slots, vectorised over the batch."""
    batch, n_slots, k = candidate_ids.shape
    if n_slots == 0:
        return candidate_ids.new_empty(batch, 0, dtype=torch.long), scores.new_empty(batch, 0, k, dtype=torch.float)
    requests = torch.arange(batch, device=candidate_ids.device)
    greedy = greedy_mask.to(device=candidate_ids.device, dtype=torch.bool)
    temperature = torch.where(greedy, 1.0, temperatures.float())[:, None]
    previous = torch.zeros(batch, dtype=torch.long, device=candidate_ids.device)
    tokens, qs = [], []
    for s in range(n_slots):
        row = scores[requests, s, previous].float()
        argmax = row.argmax(-1)  # torch documents the first maximal index
        probs = torch.softmax(row / temperature, dim=-1)
        drawn = (uniforms[:, s, None].float() >= probs.cumsum(-1)).sum(-1).clamp(max=k - 1)
        choice = torch.where(greedy, argmax, drawn)
        qs.append(torch.where(greedy[:, None], torch.nn.functional.one_hot(argmax, k).float(), probs))
        tokens.append(candidate_ids[requests, s, choice])
        previous = choice
    return torch.stack(tokens, 1).long(), torch.stack(qs, 1)


def _check(candidate_ids, scores, uniforms, temperatures, greedy_mask) -> None:
    if candidate_ids.dim() != 3:
        raise ValueError(f"candidate_ids must be [batch, slots, K], got shape {tuple(candidate_ids.shape)}")
    batch, n_slots, k = candidate_ids.shape
    if k < 1 or k & (k - 1):
        raise ValueError(f"K = {k} candidates per slot must be a power of two (selector_top_k); the walk keeps a row "
                         "of K scores in registers")  # fmt: skip
    expected = {
        "scores": (scores, (batch, n_slots, k, k)),
        "uniforms": (uniforms, (batch, n_slots)),
        "temperatures": (temperatures, (batch,)),
        "greedy_mask": (greedy_mask, (batch,)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(tensor.shape)}")
        if tensor.device != candidate_ids.device:
            raise ValueError(f"{name} is on {tensor.device} but candidate_ids is on {candidate_ids.device}")


def selector_walk(
    candidate_ids: Tensor, scores: Tensor, uniforms: Tensor, temperatures: Tensor, greedy_mask: Tensor
) -> tuple[Tensor, Tensor]:
    """candidate_ids [b, S, K], scores [b, S, K, K], uniforms [b, S], temperatures [b], greedy_mask [b]
    -> (tokens [b, S] int64, q [b, S, K] fp32). Sampling rows need temperature > 0 (not checked: no host sync)."""
    _check(candidate_ids, scores, uniforms, temperatures, greedy_mask)
    if use_triton(candidate_ids, _selector_walk_kernel):
        return _selector_walk_triton(candidate_ids, scores, uniforms, temperatures, greedy_mask)
    return selector_walk_reference(candidate_ids, scores, uniforms, temperatures, greedy_mask)
